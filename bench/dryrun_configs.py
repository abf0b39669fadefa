"""The shipped configs at their real size: ``nemo-jq dryrun`` on every distinct workload under configs/.

Configs that differ only in what the dry run cannot see (:data:`UNSEEN`: q, the learning rate, the dataset's name,
format, source and sizes, the run directory, logging) share one dry run (:func:`workloads`). Each workload is
simulated once, on the H100 profile, and given on every profile of :data:`nemo_jq.dryrun.GPUS` by
:func:`nemo_jq.dryrun.on_gpu` (80 GB each: the same memory, other time bounds). A megatron config runs at its
documented world (:data:`WORLD_SIZES`), on the dry run's default ranks. Writes bench/results/dryrun_configs.json and
the table docs/results/dryrun_configs.md (not in CI: too slow for it).

    python bench/dryrun_configs.py [--prompt-tokens 1024] [--only qwen3_0p6b]   # --only: those rows rerun, the rest kept
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from nemo_jq.config import Config, load_config
from nemo_jq.dryrun import GPUS, dry_run, on_gpu
from nemo_jq.dryrun.report import against_plan

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "dryrun_configs.json"
TABLE = ROOT / "docs" / "results" / "dryrun_configs.md"
#: The profile each workload is simulated on; the others are derived from it.
SIMULATED_ON = "h100-80gb"
#: Config keys (dotted; a section for all of its keys) no dry-run figure depends on: the stand-in task and
#: tokenizer replace the data, the first step's memory and FLOPs do not read q or the learning rate. (The
#: evaluation's time bound reads data.validation_size: :func:`on_gpu` and the table take each workload's first config's.)
UNSEEN = ("data.name", "data.format", "data.source", "data.hub_config", "data.prepared_dir", "data.on_bad_row",
          "data.train_size", "data.validation_size", "data.test_size", "data.seed", "objective.q", "optim.lr",
          "train.run_dir", "train.epochs", "train.max_steps", "train.seed", "train.save_every",
          "train.keep_checkpoints", "train.tensorboard", "eval.every", "tracking")
#: The GPUs each megatron config's layout is documented for (configs/paper_runs.py's node of eight for the 8B paper
#: runs; the 32B example's 16 nodes, in its own header): the dry run's world, so DP is the one the run has (the first
#: prefix a path starts with).
WORLD_SIZES = {"configs/qwen3_8b/": 8, "configs/examples/qwen3_32b_": 128, "configs/examples/qwen3_30b_a3b_one_node_": 8,
               "configs/examples/qwen3_30b_a3b_": 64, "configs/examples/qwen3_235b_a22b_": 128}


def workload_key(config: Config) -> str:
    """What a dry run's numbers depend on: the config without :data:`UNSEEN`."""
    flat = dict(_flattened(dataclasses.asdict(config)))
    return json.dumps({key: value for key, value in flat.items()
                       if not any(key == unseen or key.startswith(unseen + ".") for unseen in UNSEEN)},
                      sort_keys=True, default=str)


def _flattened(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _flattened(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def workloads(only: str = "") -> list[list[str]]:
    """Every run config under configs/ (not the schedule fragments) whose path contains ``only``, grouped by
    :func:`workload_key`: each group's paths, the groups in the order of their first path."""
    groups: dict[str, list[str]] = {}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        rel = str(path.relative_to(ROOT))
        if only in rel and not rel.startswith("configs/schedules/"):
            groups.setdefault(workload_key(load_config(path)), []).append(rel)
    return list(groups.values())


def world_size(path: str) -> int | None:
    """The documented world of a megatron config (None: one replica, the dry run's default)."""
    return next((size for prefix, size in WORLD_SIZES.items() if path.startswith(prefix)), None)


def dry_run_workload(path: str, prompt_tokens: int) -> dict[str, dict[str, Any]]:
    """The config's dry run on every GPU profile (simulated once, on :data:`SIMULATED_ON`); the tiny demo model's
    prompts as long as its context leaves beside the budgets (the dry run's choice), where ``prompt_tokens`` are more."""
    config = load_config(ROOT / path)
    report = dry_run(config, GPUS[SIMULATED_ON], prompt_tokens=prompt_tokens if config.model.path else None,
                     world_size=world_size(path))
    return {name: report if name == SIMULATED_ON else on_gpu(report, config, gpu) for name, gpu in GPUS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--only", default="", help="configs whose path contains this: their rows replace (or join) "
                                                   "those of the results written before; the others are kept")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = kept_results(args.only, args.prompt_tokens) if args.only else []
    for paths in workloads(args.only):
        started = time.perf_counter()
        reports = dry_run_workload(paths[0], args.prompt_tokens)
        seconds = round(time.perf_counter() - started, 1)
        report = reports[SIMULATED_ON]
        results.append({"configs": paths, "dry_run_seconds": seconds, "report": report,
                        "seconds_at_least": {name: {phase: data["seconds_at_least"] for phase, data in r["phases"].items()}
                                             for name, r in reports.items()},
                        "against_plan": planned(report, load_config(ROOT / paths[0]))})
        phase = report["phases"][report["peak_phase"]]
        print(f"{paths[0]} (+{len(paths) - 1}): peak {report['peak_gib']:.1f} GiB in {report['peak_phase']} "
              f"({', '.join(f'{k} {v:.1f}' for k, v in phase['by_kind_gib'].items())}); {seconds} s to simulate",
              flush=True)
    results.sort(key=lambda result: result["configs"][0])  # the order workloads() gives, kept rows and new alike
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "simulated_on": SIMULATED_ON,
                               "workloads": results}, indent=1) + "\n")
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(markdown(results, args.prompt_tokens))
    print(f"wrote {OUT} and {TABLE}")


def kept_results(only: str, prompt_tokens: int) -> list[dict[str, Any]]:
    """The workloads of the results written before (at the same prompt length) that ``--only`` does not rerun."""
    if not OUT.exists():
        return []
    earlier = json.loads(OUT.read_text())
    if earlier["prompt_tokens"] != prompt_tokens:
        raise SystemExit(f"{OUT} holds dry runs at {earlier['prompt_tokens']} prompt tokens: rerun them all at "
                         f"{prompt_tokens} (no --only)")
    return [result for result in earlier["workloads"] if not any(only in path for path in result["configs"])]


def planned(report: dict[str, Any], config: Config) -> dict[str, dict[str, float]]:
    """:func:`~nemo_jq.dryrun.report.against_plan`, for a Qwen3 size (plan knows no tiny demo model: {})."""
    return against_plan(report, config) if config.model.path else {}


#: The phases in the table, in a run's order.
TABLE_PHASES = ("rollout", "train", "optimizer_step", "refit", "save", "guard_restore", "evaluate", "resume")


def markdown(results: list[dict], prompt_tokens: int) -> str:
    """The table docs/results/dryrun_configs.md holds: per workload, each phase's peak GiB and what dominates it."""
    lines = [f"# The shipped configs at their real size (`python bench/dryrun_configs.py`, prompts of {prompt_tokens} "
             "tokens, 80 GB GPUs: 72 GiB usable)", "",
             "The tiny demo model's configs (examples/synthetic_*) have prompts as long as its context leaves beside the "
             "budgets. vLLM's decode runs the rows its KV cache holds (its share less its weights), at most its "
             "max_num_seqs (nemo_jq/dryrun/bounds.py `rows_at_once`).", "",
             "Peak GiB per phase (megatron: the fullest simulated rank's, at the config's documented world); the "
             "largest kind at the peak in brackets; –: not run for that config. plan/dry: `nemo-jq plan --config`'s "
             "per-component ratio to the dry run, least and most. Least seconds per step: rollout + train on A100 / "
             "H100. Configs that differ only in what the dry run cannot see (bench/dryrun_configs.py's `UNSEEN`: q, "
             "the dataset, the run directory...) share a row; host GiB a node: the host memory this project's code "
             "holds on a node of 8 GPUs at the fullest process's peak (in its phase; not vLLM's own process memory, "
             "Python or the libraries); decode: the prompts a step's rollouts have an engine decode of its replica's, "
             "over the replica's engines (counted on the simulated ranks; **twice**: a prompt decoded by more than one "
             "engine); h a run (H100): the whole run's steps and evaluations at the bounds, and expected at the fractions "
             "of them measured on a GPU (docs/dryrun.md; –: a setting not measured, as vLLM's decode); simulated in: "
             "seconds on this build machine's 2 shared cores.", "",
             "| configs | GPUs | " + " | ".join(phase.replace("_", " ") for phase in TABLE_PHASES)
             + " | host GiB a node | fits | plan/dry | decode | s/step A100 / H100 | h a run (H100): at least / expected "
               "| simulated in |",
             "| --- " * (len(TABLE_PHASES) + 10) + "|"]
    for entry in results:
        report, paths = entry["report"], entry["configs"]
        cells = []
        for phase in TABLE_PHASES:
            data = report["phases"].get(phase)
            if data is None:
                cells.append("–")
                continue
            kind = max(data["by_kind_gib"], key=data["by_kind_gib"].get)
            cells.append(f"{data['peak_gib']:.1f} ({kind.replace('_', ' ')})")
        ratios = [row["plan_over_dry_run"] for row in entry["against_plan"].values() if row["plan_over_dry_run"]]
        step = {gpu: bounds["rollout"] + bounds["train"] for gpu, bounds in entry["seconds_at_least"].items()}
        name = paths[0].removeprefix("configs/") + (f" (+{len(paths) - 1})" if len(paths) > 1 else "")
        host = report["host"]
        lines.append(f"| {name} | {report.get('world_size', 1)} | " + " | ".join(cells)
                     + f" | {host['gib']:.1f} ({host['phase'].replace('_', ' ')}) | {'yes' if report['fits'] else '**no**'} | "
                     + (f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "–") + f" | {decode_cell(report['decode'])} | "
                     f"{step['a100-80gb']:.0f} / {step['h100-80gb']:.0f} | {run_hours(report['run_time'])} | "
                     f"{entry['dry_run_seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def run_hours(timed: dict[str, Any] | None) -> str:
    """``62.0 / 170.3``: a run's hours at the bounds and at the measured fractions (–: not measured, or no step count)."""
    if timed is None:
        return "–"
    return f"{timed['hours_at_least']:.1f} / " + (f"{timed['hours_expected']:.1f}" if "hours_expected" in timed else "–")


def decode_cell(decode: dict[str, Any] | None) -> str:
    """``8 of 32, 4 engines``: the most an engine decoded of its replica's prompts (–: rollout ranks of their own)."""
    if decode is None:
        return "–"
    cell = f"{decode['most_decoded']} of {decode['replica_prompts']}, {decode['engines']} engine{'s' * (decode['engines'] > 1)}"
    return cell + (" **twice**" if decode["duplicated"] else "")


if __name__ == "__main__":
    main()
