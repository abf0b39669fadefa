"""``nemo-jq doctor``: what this node and process see (torch, CUDA, NCCL, GPUs, TE/apex/megatron, the world)."""

from __future__ import annotations

import argparse
import json

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    doctor = commands.add_parser("doctor", help="print torch/CUDA/NCCL, GPUs, TE/apex/megatron, the layer spec "
                                 "and the world size/rank this process sees")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--model", help="a Qwen3 size or HF config whose head size vLLM's CPU attention is asked about "
                        "(default: --config's model.path, else the demo's tiny model)")
    doctor.add_argument("--config", type=arguments.path, help="a run config: with rollout.placement=separate, say this rank's role")
    doctor.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides of --config (e.g. "
                        "rollout.placement=separate rollout.ranks=8)")
    doctor.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.cluster import doctor

    if args.config is not None and not args.config.is_file():
        raise ValueError(f"--config {args.config}: {'a folder, not a file' if args.config.is_dir() else 'no such file'}"
                         ": give the run's config file")
    config = doctor.run_config(args.config, args.overrides)
    info = doctor.report(args.model or config.model.path, config.rollout.own_ranks)
    print(json.dumps(info, indent=2) if args.json else doctor.format_report(info))
    return 0
