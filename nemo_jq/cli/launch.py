"""``nemo-jq launch``: a nemo-jq command through NeMo-Run: on SLURM (srun starts a process per GPU), Docker or here."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    launcher = commands.add_parser(
        "launch", help="run a nemo-jq command through NeMo-Run: on SLURM (srun starts a process per GPU), Docker or here",
        description="nemo-jq launch launch.yaml [--dryrun] train --config /abs/config.yaml model.backend=megatron ...\n\n"
        "launch.yaml keys: executor (slurm, docker, local), account, partition, nodes, gpus_per_node, time,\n"
        "container_image, container_mounts (host:container), env, network_interface (gloo's and NCCL's sockets),\n"
        "job_dir, signal, master_port, exclusive, mem, cpus_per_task. The command's words are read by its own\n"
        "parser here, before anything is queued. Needs the launch extra.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    launcher.add_argument("launch_config", type=arguments.path, help="launch YAML")
    launcher.add_argument("--dryrun", action="store_true",
                          help="show what would be submitted (SLURM: the sbatch script) and write nothing; before the command")
    launcher.add_argument("launched", nargs=argparse.REMAINDER, help="a nemo-jq command and its arguments")
    launcher.set_defaults(nemo_jq_commands=commands.choices)  # filled in as the commands are added
    launcher.set_defaults(run=run)


def path_options(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of the command's options that name a path, by option (its subcommand's too: ``data prepare
    --out``) and ``data prepare --source`` (a path where it names a file, as ``data.source``: ``check_job_paths``);
    a path option the command gives a default of its own when it is not given (``unset_paths``: an experiment's
    ``--out``) at that default."""
    paths = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(arguments, action.dest, None))
            paths.update(path_options(chosen, arguments) if chosen is not None else {})
        elif getattr(action.type, "names_a_path", False):
            paths[action.option_strings[0] if action.option_strings else action.dest] = getattr(arguments, action.dest)
        elif action.option_strings == ["--source"]:
            paths["--source"] = getattr(arguments, action.dest)
    return {**paths, **getattr(arguments, "unset_paths", lambda _: {})(arguments)}  # a default the command fills in


def run(args: argparse.Namespace) -> int:
    from nemo_jq.cli import parse_words
    from nemo_jq.cluster import launch

    while args.launched and args.launched[0] in ("--dryrun", "--"):  # argparse's remainder keeps options after the config
        args.dryrun |= args.launched.pop(0) == "--dryrun"
    if not args.launched:
        raise ValueError("nemo-jq launch needs the command to run after the launch config, e.g. train --config C.yaml")
    name, words = args.launched[0], args.launched[1:]
    if name == "launch":
        raise ValueError("launch cannot wrap launch: give one launch config, then the command it runs "
                         f"(nemo-jq launch {args.launch_config} train --config C.yaml)")
    known = sorted(command for command in args.nemo_jq_commands if command != "launch")
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        raise ValueError(f"{name!r} is not a nemo-jq command"
                         + (f" (did you mean {close[0]!r}?)" if close else f"; choose one of {', '.join(known)}"))
    parser = args.nemo_jq_commands[name]
    if "--dryrun" in words and "--dryrun" not in parser._option_string_actions:
        raise ValueError(f"--dryrun after the command goes to {name}, which takes no --dryrun: put it before the command "
                         f"(nemo-jq launch {args.launch_config} --dryrun {name} ...)")
    arguments = parse_words(parser, words)  # as nemo-jq reads them, before anything is written or queued
    paths = path_options(parser, arguments)
    config = launch.load_launch_config(args.launch_config)
    script = launch.launch(config, args.launched, arguments, paths, dryrun=args.dryrun)
    if script is not None:
        print(script)
    return 0
