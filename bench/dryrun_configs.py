"""The shipped configs at their real size: ``nemo-jq dryrun`` on every distinct workload under configs/.

Configs that differ only in what the dry run cannot see (q, the dataset's name and sizes, the run directory) share
one dry run. Each workload runs once (memory does not depend on the GPU); its time bounds are given for every GPU
profile. Writes bench/results/dryrun_configs.json and prints a table.

    python bench/dryrun_configs.py [--prompt-tokens 1024] [--only qwen3_0p6b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from nemo_jq import plan
from nemo_jq.config import load_config
from nemo_jq.dryrun import GPUS, dry_run
from nemo_jq.dryrun.run import against_plan, seconds_at_least
from nemo_jq.objectives import Need, get_objective

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "dryrun_configs.json"
TABLE = ROOT / "docs" / "results" / "dryrun_configs.md"


def workload_key(config) -> tuple:
    """What a dry run's numbers depend on."""
    needs = get_objective(config.objective.name).needs
    return (config.model.path, config.model.backend, config.rollout.num_samples, config.rollout.max_thinking_tokens,
            config.rollout.max_answer_tokens, config.rollout.engine, config.rollout.kv_cache_tokens,
            config.rollout.async_steps, config.train.batch_size, config.train.micro_batch_size,
            config.train.micro_batch_rows, config.model.activation_checkpointing, config.eval.batch_size,
            config.eval.num_samples, Need.SAMPLED_ANSWER_REWARD in needs, Need.GIVEN_TARGET in needs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--only", default="", help="configs whose path contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    groups: dict[tuple, list[str]] = {}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        rel = str(path.relative_to(ROOT))
        if args.only not in rel or "schedules" in rel or load_config(path).model.path is None:
            continue  # schedules are fragments; the examples train the tiny model (the suite dry-runs it)
        groups.setdefault(workload_key(load_config(path)), []).append(rel)
    results, megatron = [], []
    for key, paths in groups.items():
        config = load_config(ROOT / paths[0])
        if config.model.backend == "megatron":  # not simulated yet (issue 28): plan's estimate at the config's layout
            megatron.append({"configs": paths, "plan": planned_at_layout(config, args.prompt_tokens)})
            continue
        started = time.perf_counter()
        report = dry_run(config, GPUS["h100-80gb"], prompt_tokens=args.prompt_tokens)
        seconds = round(time.perf_counter() - started, 1)
        bounds = {name: {phase: seconds_at_least(phase, data["flops"], report["shape"], config, gpu)
                         for phase, data in report["phases"].items()} for name, gpu in GPUS.items()}
        planned = plan.plan(plan.architecture(config.model.path), plan.Workload.from_config(config, args.prompt_tokens),
                            gpus_per_node=1, nodes=1, gpu_gb=80)[0]
        results.append({"configs": paths, "dry_run_seconds": seconds, "report": report, "seconds_at_least": bounds,
                        "against_plan": against_plan(report, config), "plan_total_gib": planned.total_gib})
        phase = report["phases"][report["peak_phase"]]
        print(f"{paths[0]} (+{len(paths) - 1}): peak {report['peak_gib']:.1f} GiB in {report['peak_phase']} "
              f"({', '.join(f'{k} {v:.1f}' for k, v in phase['by_kind_gib'].items())}); rollout "
              f"{report['phases']['rollout']['peak_gib']:.1f} GiB; {seconds} s to simulate", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "workloads": results, "megatron_planned": megatron},
                              indent=1) + "\n")
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(markdown(results, args.prompt_tokens) + megatron_markdown(megatron))
    print(f"wrote {OUT} and {TABLE}")


def markdown(results: list[dict], prompt_tokens: int) -> str:
    """The table docs/results/dryrun_configs.md holds: per workload, each phase's peak GiB and what dominates it."""
    lines = [f"# The shipped configs at their real size (`python bench/dryrun_configs.py`, prompts of {prompt_tokens} "
             "tokens, 80 GB GPUs: 72 GiB usable)", "",
             "Peak GiB per phase on the one GPU of `model.backend=hf`; the largest kind at the peak in brackets; "
             "plan: `nemo-jq plan --config`'s total beside the dry run's. Least seconds per step: rollout + train on "
             "A100 / H100. Configs that differ only in q, the dataset's name or the run directory share a row.", "",
             "| configs | rollout | train | optimizer step | guard restore | evaluate | resume | fits | plan | s/step A100 / H100 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for entry in results:
        report, paths = entry["report"], entry["configs"]
        cells = []
        for phase in ("rollout", "train", "optimizer_step", "guard_restore", "evaluate", "resume"):
            data = report["phases"][phase]
            kind = max(data["by_kind_gib"], key=data["by_kind_gib"].get)
            cells.append(f"{data['peak_gib']:.1f} ({kind.replace('_', ' ')})")
        step = {gpu: bounds["rollout"] + bounds["train"] for gpu, bounds in entry["seconds_at_least"].items()}
        name = paths[0].removeprefix("configs/") + (f" (+{len(paths) - 1})" if len(paths) > 1 else "")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if report['fits'] else '**no**'} | "
                     f"{entry['plan_total_gib']:.1f} | {step['a100-80gb']:.0f} / {step['h100-80gb']:.0f} |")
    return "\n".join(lines) + "\n"


#: The node the megatron configs are laid out for (configs/paper_runs.py): eight 80 GB GPUs.
GPUS_PER_NODE = 8


def planned_at_layout(config, prompt_tokens: int) -> dict:
    """``nemo-jq plan --config``'s components at the config's own TP x PP, the rest of one node data-parallel."""
    tp, pp = config.megatron.tensor_parallel, config.megatron.pipeline_parallel
    estimate = plan.estimate(plan.architecture(config.model.path), plan.Workload.from_config(config, prompt_tokens), tp,
                             pp, GPUS_PER_NODE // (tp * pp), 80, 0.9)
    return dataclasses.asdict(estimate)


def megatron_markdown(entries: list[dict]) -> str:
    if not entries:
        return ""
    lines = ["", "`model.backend=megatron` configs are not simulated by the dry run yet (its layouts need a fake process "
             f"group per rank): `nemo-jq plan --config`'s estimate at each config's layout on one node of {GPUS_PER_NODE} "
             "80 GB GPUs, GiB per GPU.", "",
             "| configs | TP x PP x DP | weights | gradients | optimizer | activations | log-prob head | vLLM | total | fits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for entry in entries:
        e, paths = entry["plan"], entry["configs"]
        name = paths[0].removeprefix("configs/") + (f" (+{len(paths) - 1})" if len(paths) > 1 else "")
        lines.append(f"| {name} | {e['tensor_parallel']} x {e['pipeline_parallel']} x {e['data_parallel']} | "
                     f"{e['weights_gib']:.1f} | {e['gradients_gib']:.1f} | {e['optimizer_gib']:.1f} | "
                     f"{e['activations_gib']:.1f} | {e['logprob_head_gib']:.1f} | {e['vllm_gib']:.1f} | "
                     f"{e['total_gib']:.1f} | {'yes' if e['fits'] else '**no**'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
