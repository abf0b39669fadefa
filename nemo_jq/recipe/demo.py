"""The embedded default job: a cold-start comparison in the paper's sense, on CPU in minutes.

A tiny Qwen3 trained from scratch on the synthetic sums task, with linearised prompts and no
formatting hint, so the initial P is far below 1/M. One shared configuration (the defaults of
``nemo_jq.config``) for every method; only the estimator and q change. Prints a table shaped
like the paper's Table 2 and writes the Figure-3 style plot.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from nemo_jq.config import load_config
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.monitor import plot_runs, read_metrics
from nemo_jq.runtime.outputs import claim_dir
from nemo_jq.runtime.preemption import Series

DEMO_RUNS = (
    ("GRPO", "grpo", ["objective.name=grpo"]),
    ("GARL q=0 (RB-RLOO)", "garl_q0", ["objective.name=garl", "objective.q=0.0"]),
    ("GARL q=0.5", "garl_q0.5", ["objective.name=garl", "objective.q=0.5"]),
    ("GARL q=0.75", "garl_q0.75", ["objective.name=garl", "objective.q=0.75"]),
    ("GARL q=1", "garl_q1", ["objective.name=garl", "objective.q=1.0"]),
)


SUMMARY_FILE, FIGURE_FILE = "summary.json", "figure3.png"


@Series("train", again="`nemo-jq train --demo-dir NEW_DIR` (or --overwrite) runs the whole comparison again")
def run_demo(out_dir: Path, overrides: list[str] | tuple[str, ...] = (), *, overwrite: bool = False) -> dict[str, dict]:
    """Run the five methods into ``out_dir/<slug>``; an earlier demo there is refused, or moved aside with ``overwrite``."""
    out_dir = Path(out_dir)
    claim_dir(out_dir, (SUMMARY_FILE, FIGURE_FILE, *(slug for _, slug, _ in DEMO_RUNS)), overwrite=overwrite,
              what="an earlier demo", advice="pass --demo-dir DIR for a new one, or --overwrite to move it aside first")
    out_dir.mkdir(parents=True, exist_ok=True)
    results, curves = {}, {}
    for label, slug, method in DEMO_RUNS:
        config = load_config(None, [*overrides, *method, f"train.run_dir={out_dir / slug}"])
        results[label] = Trainer(config).fit()
        records = read_metrics(out_dir / slug)
        curves[label] = records
        first = next(r for r in records if r["kind"] == "train")
        results[label]["initial_log_p_hat"] = first.get("log_p_hat")
    num_samples = config.rollout.num_samples
    print(format_table(results, num_samples))
    plot_runs(curves, out_dir / FIGURE_FILE)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(results, indent=2))
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
    lines = [
        f"Cold start (test split, best validation m@16 checkpoint; log(1/M) = {math.log(1 / num_samples):.2f})",
        f"{'Method':<20} {'p@1':>6} {'p@16':>6} {'m@16':>6}  {'initial log P̂':>14}",
    ]
    for label, result in results.items():
        test = result["test"]
        initial = result.get("initial_log_p_hat")
        initial_text = f"{initial:14.2f}" if initial is not None else f"{'n/a':>14}"
        lines.append(f"{label:<20} {test['p@1']:6.1f} {test['p@16']:6.1f} {test['m@16']:6.1f}  {initial_text}")
    return "\n".join(lines)
