"""One-step-off rollouts against synchronous ones, on the demo's configuration.

Each of the demo's methods (GRPO and GARL at q = 0, 0.5, 0.75, 1; the embedded defaults otherwise) is
trained once per seed in each mode: ``rollout.async_steps=0`` (sample, then train) and
``rollout.async_steps=1`` (sample step t+1 in a child process while step t trains, corrected by
``objective.importance=auto``, which truncates). Reported, all from the same run:

1. wall-clock per training step, one-step-off over synchronous, first and on an otherwise idle machine:
   GARL q=0.75 at the demo's thinking budget and longer ones (``--thinking``; sampling is a larger share
   of the step), ``--timing-steps`` steps per run, the modes interleaved ``--timing-repeats`` times, the
   median step after 5 warm-up steps; then, from the learning runs below, the mean step and the whole
   run (``fit``: evaluation and the sampling process's start included);
2. the learning outcome per mode: test m@16 and p@1 (mean and standard deviation over seeds), and the
   largest gap between the modes' mean validation m@16 curves against the seeds' spread;
3. whether the demo's cold-start ordering holds in each mode and seed: GRPO stuck (m@16 below
   ``--stuck``), GARL at q >= 0.5 escaping (above it).

Goal: one-step-off at least 1.3x faster per step on 2 cores, with equal learning within seed noise.
Usage: python bench/async_rollouts.py [--seeds 0 1 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = {
    "GRPO": ["objective.name=grpo"],
    "GARL q=0": ["objective.name=garl", "objective.q=0.0"],
    "GARL q=0.5": ["objective.name=garl", "objective.q=0.5"],
    "GARL q=0.75": ["objective.name=garl", "objective.q=0.75"],
    "GARL q=1": ["objective.name=garl", "objective.q=1.0"],
}
MODES = {"sync": 0, "one_step_off": 1}
QUICK = ["data.train_size=24", "train.epochs=1", "eval.every=2", "data.validation_size=8", "data.test_size=8",
         "eval.num_samples=4"]


def train(method: list[str], mode: int, seed: int, run_dir: Path, extra: list[str]) -> dict:
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.monitor import read_metrics

    config = load_config(None, [*method, f"rollout.async_steps={mode}", f"train.seed={seed}",
                                f"train.run_dir={run_dir}", "train.tensorboard=false", *extra])
    started = time.perf_counter()
    result = Trainer(config).fit()
    seconds = time.perf_counter() - started
    records = read_metrics(run_dir)
    steps = [r for r in records if r["kind"] == "train"]
    k = config.eval.num_samples
    return {"fit_seconds": seconds, "mean_step_seconds": statistics.mean(r["step_time"] for r in steps),
            "steps": len(steps), "test": result["test"], "m_at_k": f"m@{k}",
            "validation": [[r["step"], r[f"m@{k}"]] for r in records if r["kind"] == "validation"],
            "mean_kl_k3": statistics.mean(r.get("kl_k3", 0.0) for r in steps),
            "truncated_fraction": statistics.mean(r.get("is_truncated_fraction", 0.0) for r in steps)}


def step_ratio_at(thinking: int, steps: int, repeats: int, work: Path) -> dict[str, float]:
    """Median step seconds of each mode (after 5 warm-up steps) at a thinking budget, interleaved over repeats."""
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.monitor import read_metrics

    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode, steps_off in MODES.items():
            run_dir = work / f"timing_{thinking}_{mode}_{repeat}"
            Trainer(load_config(None, [*METHODS["GARL q=0.75"], f"rollout.async_steps={steps_off}",
                                       f"rollout.max_thinking_tokens={thinking}", f"train.max_steps={steps}",
                                       "eval.every=100000", "train.tensorboard=false", f"train.run_dir={run_dir}"])).fit()
            seconds[mode] += [r["step_time"] for r in read_metrics(run_dir) if r["kind"] == "train"][5:]
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    return {"sync_step_seconds": medians["sync"], "one_step_off_step_seconds": medians["one_step_off"],
            "speedup": medians["sync"] / medians["one_step_off"]}


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--stuck", type=float, default=5.0, help="m@16 (percent) below which a run has not escaped")
    parser.add_argument("--thinking", type=int, nargs="*", default=[6, 32, 64],
                        help="thinking budgets to time the modes at (the demo's is 6)")
    parser.add_argument("--timing-steps", type=int, default=60)
    parser.add_argument("--timing-repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny run of every path (a smoke test, not a result)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "async_rollouts.json")
    args = parser.parse_args()
    extra = QUICK if args.quick else []
    if args.quick:
        args.thinking, args.timing_steps, args.timing_repeats = [6], 7, 1

    import torch

    runs: dict[str, dict[str, list[dict]]] = {name: {mode: [] for mode in MODES} for name in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        timings = {str(t): step_ratio_at(t, args.timing_steps, args.timing_repeats, Path(tmp)) for t in args.thinking}
        for thinking, timing in timings.items():
            print(f"max_thinking_tokens={thinking}: {timing['speedup']:.2f}x per step", flush=True)
        for seed in args.seeds:
            for name in args.methods:
                for mode, steps_off in MODES.items():  # interleaved, so drift hits both modes alike
                    run_dir = Path(tmp) / f"{name.replace(' ', '_')}_{mode}_{seed}"
                    run = train(METHODS[name], steps_off, seed, run_dir, extra)
                    runs[name][mode].append(run)
                    print(f"{name:<12} {mode:<13} seed {seed}: {run['m_at_k']} {run['test'][run['m_at_k']]:.1f}, "
                          f"{run['mean_step_seconds']:.4f} s/step", flush=True)

    key = runs[args.methods[0]]["sync"][0]["m_at_k"]
    per_method = {}
    for name, by_mode in runs.items():
        summary = {mode: {"m_at_k": spread([r["test"][key] for r in rs]), "p@1": spread([r["test"]["p@1"] for r in rs]),
                          "mean_step_seconds": statistics.mean(r["mean_step_seconds"] for r in rs),
                          "fit_seconds": statistics.mean(r["fit_seconds"] for r in rs),
                          "mean_kl_k3": statistics.mean(r["mean_kl_k3"] for r in rs),
                          "truncated_fraction": statistics.mean(r["truncated_fraction"] for r in rs)}
                   for mode, rs in by_mode.items()}
        curves = {mode: [statistics.mean(r["validation"][i][1] for r in rs) for i in range(len(rs[0]["validation"]))]
                  for mode, rs in by_mode.items()}
        seed_sd = statistics.mean(statistics.stdev(r["validation"][i][1] for r in rs) if len(rs) > 1 else 0.0
                                  for rs in by_mode.values() for i in range(len(rs[0]["validation"])))
        summary["largest_curve_gap"] = max(abs(a - b) for a, b in zip(curves["sync"], curves["one_step_off"]))
        summary["mean_seed_sd_of_curve"] = seed_sd
        per_method[name] = summary
    learning_step_ratio = (statistics.mean(s["sync"]["mean_step_seconds"] for s in per_method.values())
                           / statistics.mean(s["one_step_off"]["mean_step_seconds"] for s in per_method.values()))
    step_ratio = timings[str(args.thinking[0])]["speedup"]
    fit_ratio = (statistics.mean(s["sync"]["fit_seconds"] for s in per_method.values())
                 / statistics.mean(s["one_step_off"]["fit_seconds"] for s in per_method.values()))
    ordering = {}
    if "GRPO" in runs:
        escaping = [n for n in ("GARL q=0.5", "GARL q=0.75", "GARL q=1") if n in runs]
        for mode in MODES:
            ordering[mode] = [runs["GRPO"][mode][i]["test"][key] < args.stuck
                              and all(runs[n][mode][i]["test"][key] >= args.stuck for n in escaping)
                              for i in range(len(args.seeds))]
    result = {"setup": {"seeds": args.seeds, "methods": args.methods, "quick": args.quick, "stuck": args.stuck,
                        "threads": torch.get_num_threads(), "torch": torch.__version__},
              "speedup_per_step": step_ratio, "speedup_at_thinking_budget": timings,
              "learning_runs_speedup_per_step": learning_step_ratio, "speedup_per_run": fit_ratio,
              "methods": per_method,
              "ordering_holds": ordering, "runs": runs,
              "targets_met": {"one_step_off_1.3x_per_step": step_ratio >= 1.3,
                              "ordering_holds_in_every_seed": all(all(v) for v in ordering.values()) if ordering else None}}

    print(f"\n{'method':<12} {'mode':<13} {key + ' mean':>10} {'sd':>6} {'p@1':>6} {'step s':>8} {'run s':>7} "
          f"{'KL k3':>8} {'trunc':>6}")
    for name, summary in per_method.items():
        for mode in MODES:
            s = summary[mode]
            print(f"{name:<12} {mode:<13} {s['m_at_k']['mean']:>10.1f} {s['m_at_k']['sd']:>6.1f} {s['p@1']['mean']:>6.1f} "
                  f"{s['mean_step_seconds']:>8.4f} {s['fit_seconds']:>7.1f} {s['mean_kl_k3']:>8.4f} "
                  f"{s['truncated_fraction']:>6.3f}")
        print(f"{'':<12} largest gap of the mean validation curves {summary['largest_curve_gap']:.1f} "
              f"(seeds' sd {summary['mean_seed_sd_of_curve']:.1f})")
    print(f"one-step-off speed-up at the demo's budget: {step_ratio:.2f}x per step (timed alone); in the learning runs "
          f"{learning_step_ratio:.2f}x per step, {fit_ratio:.2f}x per run")
    for thinking, timing in timings.items():
        print(f"  at max_thinking_tokens={thinking}: {timing['sync_step_seconds']:.4f} s -> "
              f"{timing['one_step_off_step_seconds']:.4f} s per step, {timing['speedup']:.2f}x")
    for mode, holds in ordering.items():
        print(f"ordering (GRPO stuck, GARL q>=0.5 escaping) in {mode}: {holds}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
