"""The embedded default job: a cold-start comparison in the paper's sense, on CPU in minutes.

A tiny Qwen3 trained from scratch on the synthetic sums task, with linearised prompts and no
formatting hint, so the initial P is far below 1/M. One shared configuration (the defaults of
``nemo_jq.config``) for every method; only the estimator and q change. The five runs are a sweep
(:mod:`nemo_jq.runtime.sweep`) in the demo's folder, side by side where the free cores allow, one torch thread
each (a tiny model gains little from a second, and two processes with all the cores each run several times slower);
after a stop, ``nemo-jq train --resume DIR`` continues it. Prints a table shaped like the paper's Table 2 and writes
the Figure-3 style plot.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nemo_jq.runtime.monitor import plot_runs, valid_json
from nemo_jq.runtime.outputs import write_atomic
from nemo_jq.runtime.report import read_run
from nemo_jq.runtime.sweep import SWEEP_FILE, Sweep, SweepRun, free_cores, refuse_running, run_here

DEMO_RUNS = (
    ("GRPO", "grpo", ["objective.name=grpo"]),
    ("GARL q=0 (RB-RLOO)", "garl_q0", ["objective.name=garl", "objective.q=0.0"]),
    ("GARL q=0.5", "garl_q0.5", ["objective.name=garl", "objective.q=0.5"]),
    ("GARL q=0.75", "garl_q0.75", ["objective.name=garl", "objective.q=0.75"]),
    ("GARL q=1", "garl_q1", ["objective.name=garl", "objective.q=1.0"]),
)
#: Where ``nemo-jq train`` with no config writes the demo unless ``--demo-dir`` says (``--quick``: a folder of its own,
#: so the full demo after it starts rather than finding the quick one to continue).
DEMO_DIR, QUICK_DIR = Path("runs/cold_start"), Path("runs/cold_start_quick")
#: ``--quick``: a comparison of about a minute (not the README's table): one epoch (96 steps), 32 validation prompts
#: every 32 steps, 64 test prompts.
QUICK = ("train.epochs=1", "eval.every=32", "data.validation_size=32", "data.test_size=64")
#: Keys the demo sets itself: each run's method, and its folder under the demo's.
OWN_KEYS = ("objective.name", "objective.q", "train.run_dir")

SUMMARY_FILE, FIGURE_FILE = "summary.json", "figure3.png"


def demo_sweep(out_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> Sweep:
    """The five runs under ``out_dir``, ``overrides`` in each (a key the demo sets per run is refused, naming it)."""
    taken = [word for word in overrides if word.split("=", 1)[0] in OWN_KEYS]
    if taken:
        raise ValueError(f"{taken[0]}: the demo sets {', '.join(OWN_KEYS)} for each of its runs: drop it (or train one "
                         "run: nemo-jq train --config FILE ...)")
    runs = [SweepRun(slug, None, (*overrides, *method)) for _, slug, method in DEMO_RUNS]
    return Sweep(Path(out_dir), runs, {"demo": list(overrides)})


def asks_for_demo(arguments: Any) -> bool:
    """Whether ``nemo-jq train``'s parsed words ask for the demo: no ``--config`` and no ``--resume``, and no overrides
    unless ``--demo-dir`` or ``--quick`` (overrides alone train one run from the defaults)."""
    return (arguments.config is None and arguments.resume is None
            and (not arguments.overrides or arguments.demo_dir is not None or arguments.quick))


def run_demo(out_dir: Path, overrides: list[str] | tuple[str, ...] = (), *, overwrite: bool = False,
             resume: bool = False) -> dict[str, dict]:
    """Run the five methods into ``out_dir/<slug>`` (an earlier demo there is refused, or moved aside with
    ``overwrite``; ``resume`` continues the one there, ``overrides`` then of how long its runs train, how they are
    evaluated and saved: :meth:`~nemo_jq.runtime.sweep.Sweep.go_on_with`), then print the table and write the plot."""
    out_dir = Path(out_dir)
    if resume:
        sweep = Sweep.load(out_dir)
        if "demo" not in sweep.grid:
            raise ValueError(f"{out_dir} holds a sweep, not the demo: `nemo-jq sweep --resume {out_dir}` continues it")
        refuse_running(sweep, command="train")  # before the table's heading
        if overrides:
            sweep.go_on_with(overrides, command="train")
    else:
        sweep = demo_sweep(out_dir, overrides)
        resumable = (out_dir / SWEEP_FILE).exists()  # else an older demo's or an experiment's results alone
        sweep.write(overwrite=overwrite, markers=(SUMMARY_FILE, FIGURE_FILE),
                    what="an earlier demo" if resumable else "an earlier demo's or an experiment's results",
                    advice=(f"continue it with `nemo-jq train --resume {out_dir}`, " if resumable else "")
                    + "pass --demo-dir DIR for a new one, or --overwrite to move it aside first")
    parallel = min(len(sweep.runs), free_cores())
    print(f"nemo-jq train: the cold-start comparison, {', '.join(label for label, _, _ in DEMO_RUNS)}; steps and time "
          "left follow as they are measured", flush=True)
    run_here(sweep, parallel=parallel, threads=1, command="train")
    return summarise(out_dir)


def summarise(out_dir: Path) -> dict[str, dict]:
    """The finished demo's results (each run's ``results.json`` and its first log P̂): the table printed, the plot and
    ``summary.json`` written."""
    results, curves = {}, {}
    for label, slug, _ in DEMO_RUNS:
        run = read_run(out_dir / slug)
        curves[label] = run.records
        first = next(r for r in run.records if r["kind"] == "train")
        results[label] = {**run.results, "initial_log_p_hat": first.get("log_p_hat")}
    print(format_table(results, run.samples))
    plot_runs(curves, out_dir / FIGURE_FILE)
    write_atomic(out_dir / SUMMARY_FILE, valid_json(results, indent=2))
    print(f"wrote {out_dir / FIGURE_FILE} and {out_dir / SUMMARY_FILE}")
    return results


def markdown_table(results: dict[str, dict]) -> str:
    """The README's demo table (test split, percent, one decimal): CI checks the README against it."""
    lines = ["| method | p@1 | p@16 | m@16 |", "| --- | --- | --- | --- |"]
    for label, result in results.items():
        test = result["test"]
        lines.append(f"| {label} | {test['p@1']:.1f} | {test['p@16']:.1f} | {test['m@16']:.1f} |")
    return "\n".join(lines)


def format_table(results: dict[str, dict], num_samples: int) -> str:
    """The demo's table as it prints: each run's test scores (p@1, p@k and m@k, k being ``eval.num_samples``: 16 unless
    an override says otherwise) and its first log P̂ beside log(1/M)."""
    columns = list(next(iter(results.values()))["test"])
    unvalidated = {result.get("best_step") is None for result in results.values()}  # as results.json's "tested" says
    tested = {frozenset({False}): f"best validation {columns[-1]} checkpoint",
              frozenset({True}): f"latest checkpoint: no validation {columns[-1]} rose above 0"}.get(
        frozenset(unvalidated), f"best validation {columns[-1]} checkpoint, or the latest where none rose above 0")
    lines = [
        f"Cold start (test split, {tested}; log(1/M) = {math.log(1 / num_samples):.2f})",
        f"{'Method':<20} " + " ".join(f"{column:>6}" for column in columns) + f"  {'initial log P̂':>14}",
    ]
    for label, result in results.items():
        initial = result.get("initial_log_p_hat")
        initial_text = f"{initial:14.2f}" if initial is not None else f"{'n/a':>14}"
        scores = " ".join(f"{result['test'][column]:6.1f}" for column in columns)
        lines.append(f"{label:<20} {scores}  {initial_text}")
    return "\n".join(lines)
