"""``nemo-jq launch``: a nemo-jq command through NeMo-Run (SLURM, Docker or local), under torchrun."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path


def add_parser(commands) -> None:
    launcher = commands.add_parser(
        "launch", help="run a nemo-jq command through NeMo-Run (SLURM, Docker or local), under torchrun",
        description="nemo-jq launch launch.yaml [--dryrun] train --config /abs/config.yaml model.backend=megatron ...\n\n"
        "launch.yaml keys: executor (slurm, docker, local), account, partition, nodes, gpus_per_node, time,\n"
        "container_image, container_mounts (host:container), env, network_interface (gloo's and NCCL's sockets),\n"
        "job_dir, signal. Needs the launch extra.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    launcher.add_argument("launch_config", type=Path, help="launch YAML")
    launcher.add_argument("--dryrun", action="store_true", help="print the sbatch script (SLURM) instead of submitting")
    launcher.add_argument("launched", nargs=argparse.REMAINDER, help="a nemo-jq command and its arguments")
    launcher.set_defaults(nemo_jq_commands=commands.choices)  # filled in as the commands are added
    launcher.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.cluster import launch

    while args.launched and args.launched[0] in ("--dryrun", "--"):  # argparse's remainder keeps options after the config
        args.dryrun |= args.launched.pop(0) == "--dryrun"
    if not args.launched:
        raise ValueError("nemo-jq launch needs the command to run after the launch config, e.g. train --config C.yaml")
    known = sorted(name for name in args.nemo_jq_commands if name != "launch")
    if args.launched[0] not in known:
        close = difflib.get_close_matches(args.launched[0], known, n=1)
        raise ValueError(f"{args.launched[0]!r} is not a nemo-jq command"
                         + (f" (did you mean {close[0]!r}?)" if close else f"; choose one of {', '.join(known)}"))
    script = launch.launch(launch.load_launch_config(args.launch_config), args.launched, dryrun=args.dryrun)
    if script is not None:
        print(script)
    return 0
