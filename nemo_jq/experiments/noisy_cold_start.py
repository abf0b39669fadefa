"""``nemo-jq experiment noisy-cold-start``: can a q schedule escape cold start and still resist label noise?

The synthetic sums, cold format (initial P far below 1/M), with ``label_noise`` of the training labels
replaced by wrong answers (validation and test clean). Every method trains with the same settings
(:data:`SETTINGS`; ``--quick``: a smoke-test size) over each seed; only the estimator and its q change:
GRPO, GARL at fixed q, SFT-then-RLVR (q=1 then q=0), linear and cosine annealing from 1 to 0, and
the adaptive rule (q from log P̂; knobs :data:`TUNED_ADAPTIVE`). Per run: test p@1 / p@16 / m@16, steps to
leave P̂ ≈ 0 (log P̂ > :data:`LEFT_COLD`) and to escape (the first step whose log P̂ exceeds log(1/M)), and memorisation
(the share of noisy training prompts whose corrupted label the final model's greedy answer reproduces, beside what
those answers score against wrong labels drawn afresh: memorisation by chance). Writes ``summary.json``,
``table.md``, ``tradeoff.png`` (test m@16 against memorisation, a point per method and seed) and
``figure3_seed<S>.png`` (the Figure-3 panels of the first seed) to the output folder.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

import yaml

from nemo_jq.config import load_config
from nemo_jq.experiments.common import PER_RUN, Progress, chosen_methods, refuse_per_run_keys, slug, start_run
from nemo_jq.runtime.monitor import plot_runs, read_metrics, valid_json
from nemo_jq.runtime.preemption import Series
from nemo_jq.runtime.report import mean_sd, seed_stats
from nemo_jq.runtime.sweep import refuse_repeats, steps_of
from nemo_jq.typed import ConfigError

#: The one configuration every method trains with: the demo's model, M=4 and budgets on sums of two digits, 64
#: training prompts (13 of them noisy at rho=0.2) seen 64 times (512 steps of 8 prompts), so that a method can
#: memorise labels; validation (16) and test (20) take the rest of the 100 expressions.
SETTINGS = ["data.format=cold", "data.num_operands=2", "data.train_size=64", "data.validation_size=16",
            "data.test_size=20", "train.epochs=64", "eval.every=64", "train.tensorboard=false", "train.save_every=64",
            "train.keep_checkpoints=1"]
#: A few-second version for the smoke test.
QUICK = ["data.train_size=24", "data.validation_size=4", "data.test_size=4", "train.batch_size=4",
         "train.micro_batch_size=4", "train.epochs=1", "eval.every=3", "eval.num_samples=4", "rollout.max_thinking_tokens=3",
         "rollout.max_answer_tokens=3", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "train.tensorboard=false", "train.save_every=3"]


#: The adaptive rule's knobs, tuned once on seed 0 at :data:`SETTINGS` over cold_p in {1/4, 1/16, 1/64} x q_min in
#: {0, 0.25} (best validation m@16 minus memorisation; ties: mean validation m@16); docs/results/noisy_cold_start/README.md.
TUNED_ADAPTIVE = {"q_max": 1.0, "q_min": 0.0, "cold_p": 1.0 / 64}


def methods(steps: int, adaptive: dict[str, float] | None = None) -> dict[str, list[str]]:
    """Method name -> its overrides; the schedules span the run's ``steps``. ``adaptive`` overrides the adaptive
    rule's knobs (``q_max``, ``q_min``, ``cold_p``, ``ema_decay``; default :data:`TUNED_ADAPTIVE`, ema_decay 0.9)."""
    garl = ["objective.name=garl"]
    knobs = {**TUNED_ADAPTIVE, **(adaptive or {})}
    schedule = lambda spec: [*garl, f"objective.q_schedule={spec}"]  # noqa: E731
    return {
        "GRPO": ["objective.name=grpo"],
        **{f"q={q:g}": [*garl, f"objective.q={q}"] for q in (0.25, 0.5, 0.75, 1.0)},
        "SFT-then-RLVR": schedule(f"{{name: step, switch_step: {max(1, steps // 4)}, q_before: 1.0, q_after: 0.0}}"),
        "linear 1->0": schedule(f"{{name: linear, num_steps: {steps}, q_start: 1.0, q_end: 0.0}}"),
        "cosine 1->0": schedule(f"{{name: cosine, num_steps: {steps}, q_start: 1.0, q_end: 0.0}}"),
        "adaptive": schedule(yaml.safe_dump({"name": "adaptive", **knobs}, default_flow_style=True, sort_keys=False).strip()),
    }


SUMMARY_FILE, TABLE_FILE, TRADEOFF_FILE = "summary.json", "table.md", "tradeoff.png"
#: The keys each run sets (:data:`~nemo_jq.experiments.common.PER_RUN`), with the noise rate every run takes.
CONTROLLED = {**PER_RUN, "objective.q_schedule": ("per method (the adaptive one's knobs from --adaptive)", "--methods"),
              "data.seed": ("per seed", "--seeds"), "data.label_noise": ("from --label-noise", "--label-noise")}


#: log P̂ above which a run has left P̂ ≈ 0 (the demo's reading uses it too): e^-5 ≈ 0.7%, where the initial is ~e^-21.
LEFT_COLD = -5.0


def steps_to_escape(records: Sequence[dict[str, Any]], threshold: float) -> int | None:
    """The first step whose mean log P̂ exceeds ``threshold`` (the escape: log(1/M)); None if none did (or the
    method logs no P̂)."""
    return next((r["step"] for r in records if r["kind"] == "train" and (r.get("log_p_hat") or -math.inf) > threshold), None)


@Series("experiment noisy-cold-start", again="`nemo-jq experiment noisy-cold-start --resume {out_dir}` goes on from there")
def run_experiment(out_dir: Path, seeds: Sequence[int], label_noise: float, *, quick: bool = False,
                   overrides: Sequence[str] = (), overwrite: bool = False, only: Sequence[str] = (),
                   adaptive: dict[str, float] | None = None, resume: bool = False) -> dict[str, Any]:
    """Every method (or those named in ``only``) over every seed into ``out_dir/<method>/seed<S>``, then the
    table and figures. ``adaptive``: the adaptive rule's knobs (see :func:`methods`). ``resume``: go on with the
    experiment in ``out_dir`` (:class:`~nemo_jq.experiments.common.Progress`; its options are the ones given)."""
    out_dir = Path(out_dir)
    refuse_repeats("--seeds", seeds)
    refuse_per_run_keys("noisy-cold-start", overrides, CONTROLLED)
    base = [*(QUICK if quick else SETTINGS), f"data.label_noise={label_noise}", *overrides]
    probe = load_config(None, base)
    if round(label_noise * probe.data.train_size) < 1:  # corrupt_labels' count: the experiment measures memorising them
        raise ConfigError(f"--label-noise {label_noise:g} makes none of the {probe.data.train_size} training labels wrong, "
                          "and the experiment measures how many wrong ones a method memorises: give at least "
                          f"{1 / probe.data.train_size:.2g}")
    steps = steps_of(probe)
    every = methods(steps, adaptive)
    plan = chosen_methods(every, only)
    checked = [*plan.values(), *([every["adaptive"]] if adaptive and "adaptive" not in plan else [])]  # its knobs too
    for method in checked:  # every run's config is checked before anything is written or trained
        load_config(None, [*base, *method])
    progress = Progress.begin(out_dir, "noisy-cold-start", dict(seeds=list(seeds), label_noise=label_noise, quick=quick,
                              overrides=list(overrides), only=list(only), adaptive=adaptive),
                              markers=(SUMMARY_FILE, TABLE_FILE, TRADEOFF_FILE, *map(slug, plan)), overwrite=overwrite,
                              resume=resume)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in plan}
    curves: dict[str, list[dict[str, Any]]] = {}
    for seed in seeds:
        for name, method in plan.items():
            run_dir = out_dir / slug(name) / f"seed{seed}"
            config = load_config(None, [*base, *method, f"train.seed={seed}", f"data.seed={seed}", f"train.run_dir={run_dir}"])
            runs[name].append(progress.run(run_dir, lambda: describe_run(config, start_run(config).fit())))
            if seed == seeds[0]:
                curves[name] = read_metrics(run_dir)
    k = probe.eval.num_samples
    summary = {"settings": base, "methods": plan, "seeds": list(seeds), "label_noise": label_noise, "steps": steps,
               "num_samples": probe.rollout.num_samples, "k": k, "runs": runs,
               "aggregate": {name: aggregate(per_seed, k) for name, per_seed in runs.items()},
               "theory": theory(probe.rollout.num_samples, label_noise)}
    (out_dir / SUMMARY_FILE).write_text(valid_json(summary, indent=2) + "\n")
    (out_dir / TABLE_FILE).write_text(markdown_table(summary) + "\n")
    plot_tradeoff(runs, k, out_dir / TRADEOFF_FILE)
    plot_runs(curves, out_dir / f"figure3_seed{seeds[0]}.png")
    print(markdown_table(summary))
    print(f"wrote {out_dir / SUMMARY_FILE}, {out_dir / TABLE_FILE}, {out_dir / TRADEOFF_FILE} and the Figure-3 panels")
    return summary


def describe_run(config: Any, result: dict[str, Any]) -> dict[str, Any]:
    """One run's entry: its test scores and memorisation (``result``, fit's), and what its metrics show."""
    records = read_metrics(Path(config.train.run_dir))
    return {"seed": config.train.seed, "test": result["test"], "memorisation": result["memorisation"]["final"],
            "memorisation_tested": result["memorisation"]["tested"],
            "memorisation_chance": result["memorisation"]["chance"]["final"], "best_step": result["best_step"],
            "best_validation": result["best_validation"],
            "final_q": next((r.get("q") for r in reversed(records) if r["kind"] == "train"), None),
            "steps_to_escape": steps_to_escape(records, -math.log(config.rollout.num_samples)),
            "steps_to_leave_cold": steps_to_escape(records, LEFT_COLD),
            "guard_events": sum(r["kind"] == "guard" for r in records)}


def aggregate(per_seed: Sequence[dict[str, Any]], k: int) -> dict[str, dict[str, float | None]]:
    """Each reported quantity over the seeds (``report.seed_stats``: mean, sd, n, 95% t-interval; escape: over the
    seeds that escaped, ``n`` says how many)."""
    return {"p@1": seed_stats([r["test"]["p@1"] for r in per_seed]), f"p@{k}": seed_stats([r["test"][f"p@{k}"] for r in per_seed]),
            f"m@{k}": seed_stats([r["test"][f"m@{k}"] for r in per_seed]),
            "steps_to_escape": seed_stats([r["steps_to_escape"] for r in per_seed]),
            "steps_to_leave_cold": seed_stats([r["steps_to_leave_cold"] for r in per_seed]),
            "memorisation": seed_stats([r["memorisation"] for r in per_seed]),
            "memorisation_chance": seed_stats([r.get("memorisation_chance") for r in per_seed])}


def theory(num_samples: int, label_noise: float) -> dict[str, Any]:
    """The theory module's predictions for fixed q: the noise-fitting equilibrium p̃*(q) at ε = label_noise
    (the stable mass on a wrong label when a prompt's labels are wrong at rate ε), where it exists."""
    from nemo_jq.theory.landscape import noise_equilibrium

    if not 0.0 < label_noise < 0.5:
        return {}
    return {f"q={q:g}": {"noise_equilibrium": noise_equilibrium(q, label_noise)} for q in (0.25, 0.5, 0.75, 1.0)}


def markdown_table(summary: dict[str, Any]) -> str:
    k = summary["k"]

    def cell(stats: dict[str, float | None], digits: int = 1) -> str:
        if stats["mean"] is None:
            return "n/a"
        text = mean_sd(stats, f".{digits}f")
        return text if stats["n"] == len(summary["seeds"]) else f"{text} ({stats['n']}/{len(summary['seeds'])})"

    lines = [f"| method | test p@1 | test p@{k} | test m@{k} | steps to log P̂ > {LEFT_COLD:g} | steps to escape (log P̂ > log 1/M) "
             f"| memorisation % | by chance % | theory p̃*(q, ε={summary['label_noise']:g}) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, stats in summary["aggregate"].items():
        predicted = summary["theory"].get(name, {}).get("noise_equilibrium")
        theory = "" if predicted is None else f"{100 * predicted:.2g}%"
        chance = cell(stats.get("memorisation_chance", {"mean": None}))  # a summary written before it: n/a
        lines.append(f"| {name} | {cell(stats['p@1'])} | {cell(stats[f'p@{k}'])} | {cell(stats[f'm@{k}'])} | "
                     f"{cell(stats['steps_to_leave_cold'], 0)} | {cell(stats['steps_to_escape'], 0)} | {cell(stats['memorisation'])} | "
                     f"{chance} | {theory} |")
    return "\n".join(lines)


def plot_tradeoff(runs: dict[str, list[dict[str, Any]]], k: int, path: Path) -> None:
    """Test m@k against memorisation, one point per method and seed (up and left is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for index, (name, per_seed) in enumerate(runs.items()):
        x, y = [r["memorisation"] for r in per_seed], [r["test"][f"m@{k}"] for r in per_seed]
        color, nudge = f"C{index % 10}", 0.4 * (index - (len(runs) - 1) / 2)  # seeds share values: spread the methods
        ax.scatter([v + nudge for v in x], [v + nudge for v in y], color=color, alpha=0.45, s=18)
        ax.errorbar(statistics.mean(x), statistics.mean(y), xerr=statistics.pstdev(x), yerr=statistics.pstdev(y),
                    fmt="os^D"[index // 10 % 4], color=color, markersize=8, capsize=3, label=f"{name} (mean ± sd)")
    ax.set_xlabel("memorisation of noisy training labels (%, greedy)")
    ax.set_ylabel(f"test m@{k} (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
