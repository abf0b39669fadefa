"""``nemo-jq train``: one run, or with no arguments (or ``--demo-dir``/``--quick``) the embedded CPU cold-start
comparison."""

from __future__ import annotations

import argparse
import json
import sys

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    from nemo_jq.config import describe_keys

    train = commands.add_parser(
        "train",
        help="train one run; with no arguments, the embedded CPU cold-start comparison",
        description="nemo-jq train --config configs/x.yaml objective.name=paft objective.q=0.75\n\n"
        "A run directory (train.run_dir) holds one run: a new run refuses a directory that already\n"
        "holds one; --resume continues it; --overwrite moves it aside to RUN_DIR.old-<time> first.",
        epilog=lambda: "config keys (section.key = default; allowed values; meaning):\n" + describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", type=arguments.path, help="YAML config (defaults: the embedded CPU demo settings)")
    train.add_argument("--resume", type=arguments.path, metavar="RUN_DIR",
                       help="continue a run from its latest checkpoint; overrides may change only how long it runs, "
                            "how it is evaluated and saved (train.epochs, train.max_steps, eval.every, eval.batch_size, ...; "
                            "not eval.num_samples, the k that picks its best checkpoint) and the megatron "
                            "layout (megatron.tensor_parallel, pipeline_parallel, context_parallel, ...)")
    train.add_argument("--overwrite", action="store_true",
                       help="if the run directory (or --demo-dir) holds a run, move it aside to NAME.old-<time> first")
    train.add_argument("--requeue", action="store_true",
                       help="for a job the scheduler may restart with the same command: resume train.run_dir if it holds "
                            "this run; after SIGUSR1 (SLURM's signal before the time limit) write a checkpoint and exit "
                            "with 75, on which the launchers' batch scripts requeue the job from the host (docs/cluster.md: "
                            "the lines for a batch script of your own); SIGTERM (scancel) checkpoints and ends the run")
    train.add_argument("--demo-dir", type=arguments.path, help="the folder of the no-argument demo (default runs/cold_start; "
                       "--quick: runs/cold_start_quick); "
                       "key=value overrides given with it apply to each of the demo's runs")
    train.add_argument("--quick", action="store_true", help="the demo in about a minute (one epoch, 32 "
                       "validation and 64 test prompts): a smoke test, not the README's table")
    train.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.runtime.outputs import release_run_dirs

    try:
        return train(args)
    finally:  # let go of the run directory: a start that failed leaves nothing behind that blocks the next
        release_run_dirs()


def train(args: argparse.Namespace) -> int:
    from nemo_jq.cluster.rows import rows_on_this_machine
    from nemo_jq.config import ConfigError, load_config
    from nemo_jq.recipe.demo import DEMO_DIR, QUICK, QUICK_DIR, asks_for_demo, run_demo
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime import distributed
    from nemo_jq.runtime.preemption import StopSignals, end_stopped_run
    from nemo_jq.runtime.runs import holds_this_run
    from nemo_jq.runtime.sweep import SWEEP_FILE

    if args.resume is not None and (args.config is not None or args.overwrite or args.requeue):
        raise ValueError("--resume continues a run with its own config.yaml: drop --config/--overwrite/--requeue "
                         "(key=value overrides of how long it runs and how it is evaluated are allowed)")
    if args.resume is not None and (args.resume / SWEEP_FILE).exists():  # the demo, stopped: its runs go on
        if args.quick or args.demo_dir:  # its folder is --resume's
            given = " and ".join(["--quick"] * args.quick + ["--demo-dir"] * bool(args.demo_dir))
            raise ValueError(f"--resume {args.resume} continues the demo as it started: drop {given}")
        run_demo(args.resume, args.overrides, resume=True)
        return 0
    if asks_for_demo(args):
        if args.requeue:
            raise ValueError("--requeue resumes one run of --config where a batch job requeued it: the demo (no "
                             "--config) continues with `nemo-jq train --resume DEMO_DIR`; drop --requeue")
        run_demo(args.demo_dir or (QUICK_DIR if args.quick else DEMO_DIR), [*(QUICK if args.quick else ()), *args.overrides],
                 overwrite=args.overwrite)
        return 0
    if args.quick or args.demo_dir:
        raise ValueError("--demo-dir and --quick are the demo's (nemo-jq train with no --config or --resume)")
    trainer = None
    try:
        with StopSignals() as stop:  # from the start: a time-limit signal while the model loads is not lost
            if args.resume is not None:
                trainer = Trainer.resume(args.resume, args.overrides, rows_for=rows_on_this_machine)
                if (finished := trainer.finished()) is not None:
                    raise ConfigError(finished)
            else:
                config = load_config(args.config, args.overrides)
                held, changed = holds_this_run(config) if args.requeue else ("new", [])
                trainer = (Trainer.resume(config.train.run_dir, changed, rows_for=rows_on_this_machine) if held == "resume"
                           else Trainer(config, overwrite=args.overwrite or held == "restart", rows_for=rows_on_this_machine))
                if held == "resume" and (finished := trainer.finished()) is not None and distributed.is_writer():
                    print(f"nemo-jq train: {finished}", flush=True)  # a job launched again: its results follow
            result = trainer.fit(stop=stop)
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of this step; say which one the run goes on from
        if distributed.is_writer():
            print(f"nemo-jq train: interrupted; {surviving_checkpoint(trainer)}", file=sys.stderr, flush=True)
        return 130
    if "preempted" in result:  # the line says what stopped it and how to go on
        return end_stopped_run(result["preempted"], result["step"], trainer.run_dir, requeue=args.requeue)
    if distributed.is_writer():
        print(json.dumps(result, indent=2))
    return 0


def surviving_checkpoint(trainer) -> str:
    """Which checkpoint a run stopped mid-step goes on from, in words (a checkpoint is complete or absent)."""
    from nemo_jq.runtime.checkpoint import latest_checkpoint
    from nemo_jq.runtime.runs import CHECKPOINT_DIR

    if trainer is None:
        return ("before the first step: a run's checkpoints are as they were, and a new run's start is moved aside by "
                "the next start there")
    try:
        latest = latest_checkpoint(trainer.run_dir / CHECKPOINT_DIR)
    except FileNotFoundError:
        latest = None
    if latest is None:
        return f"{trainer.run_dir} has no checkpoint yet: the next start there moves it aside and begins afresh"
    return (f"the last checkpoint written, {latest}, is intact (this step's is not written): `nemo-jq train --resume "
            f"{trainer.run_dir}` continues from it")
