"""``nemo-jq sweep``: a grid of runs under one folder, run here a few at a time (or continued with ``--resume``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_jq.cli import arguments


def seeds(text: str) -> list[int]:
    """``0,1,2`` -> ``[0, 1, 2]``."""
    try:
        return [arguments.seed(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be seeds (whole numbers from 0 to {arguments.LARGEST_SEED}) separated "
                                         f"by commas, e.g. 0,1,2; got {text!r}") from None


def add_parser(commands) -> None:
    sweep = commands.add_parser(
        "sweep", help="a grid of runs (configs x key=a,b,c x seeds) under one folder, resumable as a whole",
        description="nemo-jq sweep --out runs/q_sweep objective.name=garl objective.q=0,0.5,0.75,1 --seeds 0,1,2\n"
                    "nemo-jq sweep --out runs/paper --config configs/qwen3_0p6b/*_cold_*.yaml\n"
                    "nemo-jq sweep --resume runs/q_sweep\n"
                    "nemo-jq sweep --resume runs/q_sweep train.epochs=4     # every run trains on to 4 epochs\n"
                    "nemo-jq sweep --out runs/q_sweep objective.q=0,1 --seeds 0,1 --slurm --sbatch=--time=08:00:00\n\n"
                    "key=value is the same for every run; key=a,b,c sweeps it. Each run is DIR/NAME (NAME from the\n"
                    "swept values and the seed), its output DIR/logs/NAME.log; DIR/sweep.json records the grid.\n"
                    "After a stop signal every running run writes its checkpoint; --resume continues them, keeps the\n"
                    "finished ones and starts the rest. The report of the finished runs closes the sweep.\n"
                    "--slurm submits the unfinished runs as a SLURM job array instead (launchers/slurm.sbatch, one GPU\n"
                    "a task unless --sbatch says otherwise), each task `nemo-jq sweep --task DIR`: its run, requeued\n"
                    "after the time-limit signal; `nemo-jq report DIR` once they have finished.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_argument("--out", type=arguments.path, help="a new folder for the sweep")
    sweep.add_argument("--config", nargs="+", default=[], help="run configs (YAML), each a point of the grid "
                       "(default: the embedded defaults)")
    sweep.add_argument("--seeds", type=seeds, help="train.seed values, e.g. 0,1,2 (default: each config's own)")
    sweep.add_argument("--resume", type=arguments.path, metavar="SWEEP_DIR", help="continue a sweep: its finished runs are kept, "
                       "stopped ones continue from their checkpoints, the others start")
    sweep.add_argument("--parallel", type=arguments.positive, help="runs at once on this machine (default 1; with "
                       "--resume, what the sweep was started with); with --slurm, the most array tasks running at once")
    sweep.add_argument("--threads", type=arguments.positive, help="torch threads a run (default: this machine's free "
                       "cores, shared out over --parallel; with --resume, what the sweep was started with)")
    sweep.add_argument("--overwrite", action="store_true", help="if --out holds a sweep, move it aside first")
    sweep.add_argument("--slurm", action="store_true", help="submit the unfinished runs as a SLURM job array instead "
                       "of running them here")
    sweep.add_argument("--sbatch", action="append", default=[], metavar="OPTION", help="an sbatch option for --slurm "
                       "(repeatable; e.g. --sbatch=--time=08:00:00 --sbatch=--partition=gpu; with --resume, the sweep's last ones)")
    sweep.add_argument("--task", type=arguments.path, metavar="SWEEP_DIR", help="run one run of the sweep here, in this process: "
                       "the one --index names, else $SLURM_ARRAY_TASK_ID's (what each array task of --slurm runs)")
    sweep.add_argument("--index", type=int, help="with --task: the run's place in sweep.json's runs, from 0")
    sweep.add_argument("overrides", nargs="*", default=[], help="section.key=value (the same for every run) or section.key=a,b,c "
                       "(swept)")
    sweep.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.cluster.launch import refuse_queued_array
    from nemo_jq.runtime.sweep import SWEEP_FILE, Sweep, run_here

    if args.index is not None and args.task is None:
        raise ValueError(f"--index {args.index} picks the run of --task SWEEP_DIR: add --task, or drop --index")
    if args.sbatch and not args.slurm:
        raise ValueError(f"--sbatch={args.sbatch[0]} is an option of --slurm's job array: add --slurm, or drop --sbatch")
    if args.slurm and args.threads:
        raise ValueError("--threads shares this machine's cores out over its runs; each task of --slurm's array runs on "
                         "a node of its own: drop --threads (--sbatch=--cpus-per-task=N sizes a task)")
    if args.task is not None:
        sweep = Sweep.load(args.task)
        sweep.work_from_start()
        return run_task(sweep, args.index)
    if args.resume is None and args.overwrite and args.out is not None and (args.out / SWEEP_FILE).exists():
        refuse_queued_array(Sweep.load(args.out))  # the sweep --overwrite would move aside
    if args.resume is not None:
        if args.out or args.config or args.seeds or args.overwrite:
            raise ValueError("--resume continues a sweep as its sweep.json records it: drop --out, --config, --seeds "
                             "and --overwrite (key=value words of how long its runs train, how they are evaluated and "
                             "saved, are allowed)")
        sweep = Sweep.load(args.resume)
        refuse_queued_array(sweep)
        sweep.work_from_start()
        if args.overrides:
            sweep.go_on_with(args.overrides)
    else:
        if args.out is None:
            raise ValueError("nemo-jq sweep needs --out DIR (a new folder for the sweep) or --resume SWEEP_DIR")
        sweep = Sweep.from_grid(args.out, [str(path) for path in args.config], args.overrides, args.seeds)
        sweep.here = {"parallel": args.parallel, "threads": args.threads, "started_in": str(Path.cwd())}
        sweep.write(overwrite=args.overwrite)
    from nemo_jq.cli.report import print_report

    if args.slurm:
        from nemo_jq.cluster.launch import submit_sweep

        # a resume submits as the sweep was first submitted (its GPUs a task, time limit, running at once), unless told
        options, parallel = args.sbatch or sweep.here.get("sbatch", []), args.parallel or sweep.here.get("parallel")
        sweep.here.update(sbatch=options, parallel=parallel)  # saved by submit_sweep with the array's id
        try:
            submit_sweep(sweep, options, parallel=parallel)
        except BaseException:
            if args.resume is None:  # a sweep SLURM never took leaves no folder to be refused by the next try
                sweep.withdraw()
            raise
        return 0
    run_here(sweep, parallel=args.parallel or sweep.here.get("parallel") or 1,
             threads=args.threads or sweep.here.get("threads"))
    return print_report([sweep.directory], figures=sweep.directory)


def run_task(sweep, index: int | None) -> int:
    """One run of ``sweep`` in this process (its ``nemo-jq train --requeue`` words): the run ``index`` names, else the
    SLURM array task's; a finished run is left alone."""
    import os

    from nemo_jq.cli import main
    from nemo_jq.runtime.sweep import FINISHED

    given = f"--index {index}"
    if index is None:
        if "SLURM_ARRAY_TASK_ID" not in os.environ:
            raise ValueError("--task runs one run of a sweep: give --index K, or run it as a SLURM array task "
                             "(nemo-jq sweep --slurm submits them)")
        task = os.environ["SLURM_ARRAY_TASK_ID"]
        if not task.isdigit():
            raise ValueError(f"SLURM_ARRAY_TASK_ID is {task!r}, not a run's place in the sweep (a whole number): run "
                             "--task as a task of the array `nemo-jq sweep --slurm` submits, or give --index K")
        given, index = f"SLURM_ARRAY_TASK_ID={task}", int(task)
    if not 0 <= index < len(sweep.runs):
        raise ValueError(f"{given}: {sweep.directory} holds runs 0 to {len(sweep.runs) - 1}")
    run = sweep.runs[index]
    if sweep.status(run) == FINISHED:
        print(f"nemo-jq sweep: run {index} ({run.name}) has finished; nothing to do")
        return 0
    print(f"nemo-jq sweep: run {index} of {sweep.directory}: {run.name}", flush=True)
    return main(run.train_words(sweep.directory))
