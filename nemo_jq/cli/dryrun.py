"""``nemo-jq dryrun``: a run's first step at its real size on fake tensors, with nothing allocated."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    dry = commands.add_parser(
        "dryrun", help="a run's first step at its real size on fake tensors: per-phase GPU memory by kind, FLOPs and a "
        "time bound, with nothing allocated",
        description="nemo-jq dryrun --config configs/qwen3_8b/finqa_cold_garl_q0.75.yaml --gpu h100-80gb [key=value ...]",
        epilog=notes, formatter_class=argparse.RawDescriptionHelpFormatter)
    dry.add_argument("--config", type=arguments.path, help="the run's YAML config (as train takes it)")
    dry.add_argument("--gpu", default="h100-80gb", help="a100-80gb or h100-80gb (its memory, bf16 FLOP/s and bandwidth)")
    dry.add_argument("--gpu-memory", type=arguments.positive_gb, help="GiB per GPU, instead of the profile's")
    dry.add_argument("--prompt-tokens", type=arguments.positive, help="the longest prompt the data holds, in tokens "
                     "(default 1024, or as many as the model's context leaves beside the thinking and answer budgets)")
    dry.add_argument("--decode-steps", type=arguments.positive, default=2, help="decode steps each sampling call runs")
    dry.add_argument("--gpus", type=arguments.positive, help="model.backend=megatron: the world's GPUs (processes), which the "
                     "layout splits into TP x PP x CP x DP (default: one replica, TP x PP x CP)")
    dry.add_argument("--ranks", type=ranks, help="model.backend=megatron: the global ranks to simulate, one at a time, "
                     "comma-separated (default: replica 0's first rank of the first and of the last pipeline stage)")
    dry.add_argument("--gpus-per-node", type=arguments.positive, default=8, help="processes a node runs (one a GPU): "
                     "what a node's host memory holds")
    dry.add_argument("--host-memory", type=arguments.positive_gb, metavar="GiB", help="a node's host memory: exit 2 "
                     "in one line if its processes need more")
    dry.add_argument("--json", type=arguments.output_file("dry run's JSON report", arguments.json_holding(
        "gpu", "usable_gib", "phases", "peak_gib")), metavar="FILE",
                     help="also write the report as JSON to FILE (a new file, or an earlier dry run's report)")
    dry.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides (as train takes them)")
    dry.set_defaults(run=run)


def notes() -> str:
    """The dry run's modules' docstrings, read from their files: every command builds this parser, and importing the
    dry run (torch's private fake-tensor module, which differs between versions) must not be a condition of ``train``."""
    import ast

    folder = Path(__file__).parents[1] / "dryrun"
    notes = [ast.get_docstring(ast.parse((folder / f"{name}.py").read_text())).split("\n", 2)[2] for name in ("run", "world")]
    return "how it works:\n" + notes[0] + "\n" + notes[1]


def ranks(text: str) -> list[int]:
    try:
        ranks = [int(rank) for rank in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ranks (e.g. 0,4)") from None
    return ranks


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from nemo_jq.config import load_config
    from nemo_jq.dryrun import check_fits, dry_run, format_report
    from nemo_jq.dryrun.bounds import gpu_profile

    gpu = gpu_profile(args.gpu)
    gpu = gpu if args.gpu_memory is None else dataclasses.replace(gpu, memory_gib=args.gpu_memory)
    config = load_config(args.config, args.overrides)
    if config.model.backend != "megatron" and (args.gpus or args.ranks):
        raise ValueError(f"--gpus and --ranks lay out model.backend=megatron; this config's is {config.model.backend!r}")
    report = dry_run(config, gpu, prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps,
                     world_size=args.gpus, ranks=args.ranks, gpus_per_node=args.gpus_per_node,
                     host_memory_gib=args.host_memory)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    check_fits(report, config)
    return 0
