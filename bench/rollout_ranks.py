"""Rollouts on a rank of their own, one step off, against colocated synchronous rollouts at equal process count.

On this 2-core machine, under torchrun (gloo), the demo's GARL q=0.75 (its embedded defaults otherwise), three
placements:

* ``colocated 1 thread``: one process samples, then trains (the demo as it runs);
* ``colocated 2 threads``: the same with two torch threads: the baseline on equal cores (the hf backend trains in
  one process, so a colocated run cannot take the second core as a second process);
* ``separate 1+1``: one trainer and one rollout rank, one thread each (``rollout.placement=separate``), the rollout
  rank sampling step t+1 from θ_t while the trainer trains step t (``rollout.async_steps=1``; the estimator corrects
  the lag).

Reported, all from one run of this script: (1) the median step (after 5 warm-up steps) of each placement at the demo's
thinking budget and longer ones (``--thinking``), the placements interleaved, and separate's speed-up over the
colocated baseline (goal: 1.5x at 64 thinking tokens; two cores make 2x the ideal, reached only when sampling and
training take equal time: ``overlap_bound`` is the 1-thread colocated step over the longer of the two); (2) learning, ``--seeds`` runs of
``--epochs`` epochs of the colocated baseline and separate: test m@16 and p@1 (mean, sd), the largest gap between their mean
validation m@16 curves against the seeds' spread; (3) the weight sync of the separate runs: bytes, buckets and seconds
per sync (``sync_*`` in metrics.jsonl).

Usage: python bench/rollout_ranks.py [--seeds 0 1 2] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHOD = ["objective.name=garl", "objective.q=0.75"]
#: Each placement: processes, torch threads a process, and its overrides.
PLACEMENTS = {
    "colocated 1 thread": (1, 1, ["rollout.placement=colocated", "rollout.async_steps=0"]),
    "colocated 2 threads": (1, 2, ["rollout.placement=colocated", "rollout.async_steps=0"]),
    "separate 1+1": (2, 1, ["rollout.placement=separate", "rollout.ranks=1", "rollout.async_steps=1"]),
}
BASELINE, SEPARATE = "colocated 2 threads", "separate 1+1"
#: The learning runs compare these two (equal cores).
LEARNING = (BASELINE, SEPARATE)
QUICK = ["data.train_size=16", "data.validation_size=8", "data.test_size=8", "eval.num_samples=4", "eval.every=2"]
WARM_UP_STEPS = 5
#: The timing runs' learning rate: the weights stay put (to 1e-12), so every placement samples rollouts of one
#: distribution and length (learning, the placements' policies drift apart and their rollout lengths with them: at
#: 256 thinking tokens, the separate run's rationales were 4x shorter within 8 steps); each step still syncs.
TIMING_LR = 1e-12


def train(placement: str, overrides: list[str], run_dir: Path) -> list[dict]:
    """One run under torchrun; its metrics.jsonl records."""
    from nemo_jq.runtime.monitor import read_metrics

    processes, threads, placed = PLACEMENTS[placement]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               "-m", "nemo_jq.cli", "train", *METHOD, *placed, *overrides, f"train.run_dir={run_dir}",
               "train.tensorboard=false"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"{placement} failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    return read_metrics(run_dir)


def steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "train"]


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def sampling_seconds(record: dict) -> float:
    """The seconds a step's rollouts took to sample (on whichever rank sampled them)."""
    return record["rollout_tokens"] / record["rollout_tokens_per_s"] if record["rollout_tokens"] else 0.0


def timing(thinking: int, count: int, repeats: int, work: Path, extra: list[str]) -> dict[str, float]:
    """The median step of each placement at a thinking budget (after the warm-up steps), interleaved over repeats,
    with its median rollout tokens and sampling seconds (the rollout rank's, separate), and the most overlapping
    sampling with training can give: the 1-thread colocated step over the longer of its sampling and the rest (1.0:
    nothing to hide; 2.0: the two halves equal), and the 2-thread colocated step over that longer half (separate's
    gain over the baseline if each of its processes took as long as the 1-thread colocated step's half)."""
    seconds: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
    tokens: dict[str, list[int]] = {name: [] for name in PLACEMENTS}
    sampling: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
    bounds, longer_halves = [], []
    for repeat in range(repeats):
        for name in PLACEMENTS:
            records = train(name, [f"rollout.max_thinking_tokens={thinking}", f"train.max_steps={count}",
                                   "eval.every=100000", f"optim.lr={TIMING_LR}", *extra],
                            work / f"timing_{thinking}_{name.replace(' ', '_')}_{repeat}")
            timed = steps(records)[WARM_UP_STEPS:]
            seconds[name] += [r["step_time"] for r in timed]
            tokens[name] += [r["rollout_tokens"] for r in timed]
            sampling[name] += [sampling_seconds(r) for r in timed]
            if name == "colocated 1 thread":
                halves = [max(sampling_seconds(r), r["step_time"] - sampling_seconds(r)) for r in timed]
                bounds += [r["step_time"] / longer for r, longer in zip(timed, halves)]
                longer_halves += halves
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {**{f"{name} step_seconds": value for name, value in medians.items()},
            **{f"{name} rollout_tokens": statistics.median(values) for name, values in tokens.items()},
            **{f"{name} sampling_seconds": statistics.median(values) for name, values in sampling.items()},
            "speedup_over_colocated_2_threads": medians[BASELINE] / medians[SEPARATE],
            "speedup_over_colocated_1_thread": medians["colocated 1 thread"] / medians[SEPARATE],
            "overlap_bound": statistics.median(bounds),
            "overlap_bound_over_colocated_2_threads": medians[BASELINE] / statistics.median(longer_halves)}


def learning(seeds: list[int], epochs: int, work: Path, extra: list[str]) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in LEARNING}
    for seed in seeds:
        for name in LEARNING:  # interleaved, so drift hits both alike
            records = train(name, [f"train.seed={seed}", f"train.epochs={epochs}", *extra],
                            work / f"learn_{name.replace(' ', '_')}_{seed}")
            (test,) = [r for r in records if r["kind"] == "test"]
            k = next(key for key in test if key.startswith("m@"))
            runs[name].append({"seed": seed, "test": {"m@k": test[k], "p@1": test["p@1"]}, "k": k,
                               "validation": [[r["step"], r[k]] for r in records if r["kind"] == "validation"],
                               "mean_step_seconds": statistics.mean(r["step_time"] for r in steps(records)),
                               "syncs": [{key: r[key] for key in ("sync_bytes", "sync_buckets", "sync_seconds")}
                                         for r in steps(records) if "sync_bytes" in r]})
            print(f"{name:<20} seed {seed}: test {k} {test[k]:.1f}, p@1 {test['p@1']:.1f}", flush=True)
    curves = {name: [statistics.mean(r["validation"][i][1] for r in rs) for i in range(len(rs[0]["validation"]))]
              for name, rs in runs.items()}
    syncs = [sync for run in runs[SEPARATE] for sync in run["syncs"]]
    return {"runs": runs,
            "test": {name: {"m@k": spread([r["test"]["m@k"] for r in rs]), "p@1": spread([r["test"]["p@1"] for r in rs])}
                     for name, rs in runs.items()},
            "largest_curve_gap": max(abs(a - b) for a, b in zip(*curves.values())),
            "mean_seed_sd_of_curve": statistics.mean(
                statistics.stdev(r["validation"][i][1] for r in rs) if len(rs) > 1 else 0.0
                for rs in runs.values() for i in range(len(rs[0]["validation"]))),
            "sync": {"count": len(syncs), "bytes": statistics.mean(s["sync_bytes"] for s in syncs),
                     "buckets": statistics.mean(s["sync_buckets"] for s in syncs),
                     "median_seconds": statistics.median(s["sync_seconds"] for s in syncs)} if syncs else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each learning run (the demo trains 8)")
    parser.add_argument("--thinking", type=int, nargs="+", default=[6, 64, 256], help="thinking budgets to time (demo: 6)")
    parser.add_argument("--timing-steps", type=int, default=25)
    parser.add_argument("--timing-repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny run of every path (a smoke test, not a result)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout_ranks.json")
    args = parser.parse_args()
    extra = QUICK if args.quick else []
    if args.quick:
        args.seeds, args.epochs, args.thinking, args.timing_steps = args.seeds[:1], 1, [6], WARM_UP_STEPS + 2

    with tempfile.TemporaryDirectory() as tmp:
        timings = {}
        for thinking in args.thinking:
            timings[str(thinking)] = timing(thinking, args.timing_steps, args.timing_repeats, Path(tmp), extra)
            print(f"max_thinking_tokens={thinking}: " + ", ".join(f"{name} {timings[str(thinking)][f'{name} step_seconds']:.3f} s"
                                                                 for name in PLACEMENTS)
                  + f"; separate over colocated (2 threads) {timings[str(thinking)]['speedup_over_colocated_2_threads']:.2f}x "
                  f"(overlap bound {timings[str(thinking)]['overlap_bound']:.2f}x)", flush=True)
        learned = learning(args.seeds, args.epochs, Path(tmp), extra)
    result = {"setup": {"seeds": args.seeds, "epochs": args.epochs, "method": METHOD, "quick": args.quick,
                        "timing_steps": args.timing_steps,
                        "timing_repeats": args.timing_repeats, "warm_up_steps": WARM_UP_STEPS},
              "timing": timings, "learning": learned,
              "targets_met": {"separate_1.5x_over_colocated_at_64": (timings["64"]["speedup_over_colocated_2_threads"] >= 1.5
                                                                       if "64" in timings else None),
                              "curves_within_seed_noise": learned["largest_curve_gap"]
                              <= 2 * learned["mean_seed_sd_of_curve"] if len(args.seeds) > 1 else None}}
    print(f"\n{'thinking':>8} " + " ".join(f"{name + ' s (tokens)':>31}" for name in PLACEMENTS)
          + f" {'vs 2 thr':>8} {'vs 1 thr':>8} {'bound':>6} {'bound 2':>7}")
    for thinking, row in timings.items():
        print(f"{thinking:>8} " + " ".join(f"{row[f'{name} step_seconds']:>22.4f} ({row[f'{name} rollout_tokens']:>5.0f})"
                                           for name in PLACEMENTS)
              + f" {row['speedup_over_colocated_2_threads']:>7.2f}x {row['speedup_over_colocated_1_thread']:>7.2f}x"
              f" {row['overlap_bound']:>5.2f}x {row['overlap_bound_over_colocated_2_threads']:>6.2f}x")
    for name, test in learned["test"].items():
        print(f"{name:<20} test m@k {test['m@k']['mean']:.1f} ± {test['m@k']['sd']:.1f}, p@1 {test['p@1']['mean']:.1f} "
              f"± {test['p@1']['sd']:.1f}")
    print(f"largest gap of the mean validation curves {learned['largest_curve_gap']:.1f} (seeds' sd "
          f"{learned['mean_seed_sd_of_curve']:.1f})")
    if learned["sync"]:
        sync = learned["sync"]
        print(f"weight sync: {sync['bytes'] / 1e6:.2f} MB in {sync['buckets']:.0f} bucket(s), median "
              f"{sync['median_seconds'] * 1e3:.1f} ms ({sync['count']} syncs)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
