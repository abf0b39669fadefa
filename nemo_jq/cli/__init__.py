"""The ``nemo-jq`` command: train, eval, export, theory."""

from __future__ import annotations

import argparse
import difflib
import errno
import json
import os
import sys
from pathlib import Path

from nemo_jq.runtime.preemption import Stopped

#: Set to 1 (or pass --debug) to see the traceback behind an error message.
DEBUG_ENV = "NEMO_JQ_DEBUG"
EXPERIMENTS = ("noisy-cold-start", "escape-rates", "warm-start")
STEP_HELP = ("for a run directory: best (the best validation m@k; ties keep the earliest, as training does), latest, "
             "or a step number; the output names the step and why")


def main(argv: list[str] | None = None) -> int:
    from nemo_jq.config import describe_keys

    parser = argparse.ArgumentParser(prog="nemo-jq", description="Post-train reasoning LLMs on the J_Q loss continuum.")
    parser.add_argument("--debug", action="store_true", help=f"show the traceback behind an error (or set {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train",
        help="train one run; with no arguments, the embedded CPU cold-start comparison",
        description="nemo-jq train --config configs/x.yaml objective.name=paft objective.q=0.75\n\n"
        "A run directory (train.run_dir) holds one run: a new run refuses a directory that already\n"
        "holds one; --resume continues it; --overwrite moves it aside to RUN_DIR.old-<time> first.",
        epilog="config keys (section.key = default; allowed values; meaning):\n" + describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", type=Path, help="YAML config (defaults: the embedded CPU demo settings)")
    train.add_argument("--resume", type=Path, metavar="RUN_DIR",
                       help="continue a run from its latest checkpoint; overrides may change only how long it runs, "
                            "how it is evaluated and saved (train.epochs, train.max_steps, eval.*, ...) and the megatron "
                            "layout (megatron.tensor_parallel, pipeline_parallel, context_parallel, ...)")
    train.add_argument("--overwrite", action="store_true",
                       help="if the run directory (or --demo-dir) holds a run, move it aside to NAME.old-<time> first")
    train.add_argument("--requeue", action="store_true",
                       help="for a job the scheduler may restart with the same command: resume train.run_dir if it holds "
                            "this run; after SIGUSR1 (SLURM's signal before the time limit) write a checkpoint and exit "
                            "with 75, on which the launchers' batch scripts requeue the job from the host (docs/cluster.md: "
                            "the lines for a batch script of your own); SIGTERM (scancel) checkpoints and ends the run")
    train.add_argument("--demo-dir", type=Path, default=Path("runs/cold_start"), help="output of the no-argument demo")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on a split")
    evaluate.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a run directory (its best checkpoint)")
    evaluate.add_argument("--split", default="test", choices=("train", "validation", "test"))
    evaluate.add_argument("--step", default="best", help=STEP_HELP)
    evaluate.add_argument("overrides", nargs="*", help="e.g. eval.num_samples=16")

    export = commands.add_parser("export", help="export a checkpoint to an HF folder")
    export.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a run directory (its best checkpoint)")
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--step", default="best", help=STEP_HELP)

    experiment = commands.add_parser("experiment", help="multi-run studies (not tests): noisy-cold-start, escape-rates, "
                                        "warm-start")
    experiment.add_argument("name", choices=EXPERIMENTS)
    experiment.add_argument("--out", type=Path, help="a new folder for the runs (default: runs/noisy_cold_start, "
                            "runs/escape_rates, runs/warm_start)")
    experiment.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    experiment.add_argument("--label-noise", type=float, help="noisy-cold-start: share of training labels made wrong "
                            "(default 0.2)")
    experiment.add_argument("--widths", type=int, nargs="+", help="escape-rates: the answer widths, the p0 knob "
                            "(default 2 3 4; --quick: 2 3)")
    experiment.add_argument("--cap", type=int, help="escape-rates: steps before a run counts as censored (default 200; "
                            "--quick: 4)")
    experiment.add_argument("--dependences", nargs="+", help="warm-start: the synthetic task's data.rationale_dependence "
                            "settings (default none operations; also sum)")
    experiment.add_argument("--target-p1", type=float, help="warm-start: the validation p@1 (percent) the warm-up SFT "
                            "stops at (default 20)")
    experiment.add_argument("--quick", action="store_true", help="a few-second smoke size (not a result)")
    experiment.add_argument("--overwrite", action="store_true", help="if --out holds an experiment, move it aside first")
    experiment.add_argument("--methods", type=lambda text: [name.strip() for name in text.split(",")], default=[],
                            metavar="NAME,NAME", help="run only these methods (e.g. adaptive,q=1); default: all")
    experiment.add_argument("--adaptive", type=_knobs, default={}, metavar="KNOB=VALUE,...",
                            help="noisy-cold-start: the adaptive rule's knobs: q_max, q_min, cold_p, ema_decay (default: the "
                            "tuned ones, TUNED_ADAPTIVE)")
    experiment.add_argument("overrides", nargs="*", help="section.key=value overrides for every run (e.g. guard.enabled=true)")

    data = commands.add_parser("data", help="dataset tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    from nemo_jq.data.qa import describe_datasets

    prep = data_commands.add_parser(
        "prepare", help="write deterministic train/validation/test subsets as JSONL with a manifest",
        description="nemo-jq data prepare --dataset jsonl --source mine.jsonl --sizes 800,100,100 --out data/mine",
        epilog="datasets (a --source file gives every split; a folder, one file per split):\n" + describe_datasets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("--dataset", required=True, help="finqa, hotpotqa, musique or jsonl")
    prep.add_argument("--source", help="local file, folder of split files, or hub name (default: the paper's hub name)")
    prep.add_argument("--hub-config", help="hub dataset config (hotpotqa: distractor)")
    prep.add_argument("--out", type=Path, required=True, help="a new folder (one that holds prepared data is refused)")
    prep.add_argument("--overwrite", action="store_true", help="if --out holds prepared data, move it aside to NAME.old-<time> first")
    prep.add_argument("--sizes", help="train,validation,test sizes (default: the paper's for its datasets)")
    prep.add_argument("--seed", type=_whole_number, default=0)
    prep.add_argument("--on-bad-row", default="skip", choices=("skip", "fail"))
    prep.add_argument("--template", type=_with_escapes,
                      help="jsonl: user-turn template over {question} and {context}; \\n is a new line")
    prep.add_argument("--system", type=_with_escapes, help="jsonl: system message for the warm format; \\n is a new line")
    prep.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                      help="a module or .py file that registers a dataset (docs/extending.md); repeatable")

    planner = commands.add_parser(
        "plan", help="estimate per-GPU memory of every TP x PP x DP layout (at a CP size) and recommend one",
        description="nemo-jq plan --model 8b --gpus-per-node 8 --nodes 2 --gpu-memory 80",
        epilog=_plan_assumptions(), formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_argument("--config", type=Path, help="read the workload from a run config (model, micro-batch in the "
                         "trainer's units, M, budgets, backend, engine, optimizer mode); key=value overrides as train takes")
    planner.add_argument("--prompt-tokens", type=_positive, default=1024,
                         help="with --config: the longest prompt the data holds, in tokens")
    planner.add_argument("overrides", nargs="*", help="with --config: section.key=value overrides")
    planner.add_argument("--model", help="a Qwen3 size (0.6b, 1.7b, 4b, 8b, 14b, 32b) or an HF config.json / folder "
                         "(with --config: its model.path)")
    planner.add_argument("--gpus-per-node", type=_positive, default=8)
    planner.add_argument("--nodes", type=_positive, default=1)
    planner.add_argument("--gpu-memory", type=_positive_gb, default=80.0, help="GiB per GPU")
    planner.add_argument("--seq-len", type=_positive, help="prompt + thinking + answer tokens")
    planner.add_argument("--micro-batch", type=_positive, help="rows per forward/backward (train.micro_batch_rows)")
    planner.add_argument("--samples", type=_positive, help="M, rollouts per prompt")
    planner.add_argument("--batch-prompts", type=_positive, help="prompts per optimizer step (train.batch_size)")
    planner.add_argument("--recompute", action="store_const", const=True, help="full activation recomputation")
    planner.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_const", const=False)
    planner.add_argument("--context-parallel", type=_positive,
                         help="CP: ranks that split every sequence (megatron.context_parallel; GPU only, with TE)")
    planner.add_argument("--optimizer", choices=("fp32-adamw", "fp32-distopt", "bf16-distopt"),
                         help="fp32-adamw: the backend's default; fp32-distopt: megatron.distributed_optimizer=true; "
                              "bf16-distopt: megatron.bf16_weights=true as well")
    planner.add_argument("--rollout-engine", choices=("native", "hf", "vllm"), help="rollout.engine")
    planner.add_argument("--kv-cache-tokens", type=_positive,
                         help="rollout.kv_cache_tokens: the native/hf samplers' most keys and values held at once")
    planner.add_argument("--vllm-memory-utilization", type=_fraction, help="rollout.vllm_memory_utilization")
    planner.add_argument("--rollout-tensor-parallel", type=_positive,
                         help="rollout.tensor_parallel: ranks that hold one vLLM engine")
    planner.add_argument("--json", action="store_true", help="print JSON instead of a table")

    launcher = commands.add_parser(
        "launch", help="run a nemo-jq command through NeMo-Run (SLURM, Docker or local), under torchrun",
        description="nemo-jq launch launch.yaml [--dryrun] train --config /abs/config.yaml model.backend=megatron ...\n\n"
        "launch.yaml keys: executor (slurm, docker, local), account, partition, nodes, gpus_per_node, time,\n"
        "container_image, container_mounts (host:container), env, job_dir, signal. Needs the launch extra.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    launcher.add_argument("launch_config", type=Path, help="launch YAML")
    launcher.add_argument("--dryrun", action="store_true", help="print the sbatch script (SLURM) instead of submitting")
    launcher.add_argument("launched", nargs=argparse.REMAINDER, help="a nemo-jq command and its arguments")
    launcher.set_defaults(nemo_jq_commands=commands.choices)  # filled in as the commands are added

    dry = commands.add_parser(
        "dryrun", help="a run's first step at its real size on fake tensors: per-phase GPU memory by kind, FLOPs and a "
        "time bound, with nothing allocated",
        description="nemo-jq dryrun --config configs/qwen3_8b/finqa_cold_garl_q0.75.yaml --gpu h100-80gb [key=value ...]",
        epilog=_dryrun_notes(), formatter_class=argparse.RawDescriptionHelpFormatter)
    dry.add_argument("--config", type=Path, help="the run's YAML config (as train takes it)")
    dry.add_argument("--gpu", default="h100-80gb", help="a100-80gb or h100-80gb (its memory, bf16 FLOP/s and bandwidth)")
    dry.add_argument("--gpu-memory", type=_positive_gb, help="GiB per GPU, instead of the profile's")
    dry.add_argument("--prompt-tokens", type=_positive, default=1024, help="the longest prompt the data holds, in tokens")
    dry.add_argument("--decode-steps", type=_positive, default=2, help="decode steps each sampling call runs")
    dry.add_argument("--gpus", type=_positive, help="model.backend=megatron: the world's GPUs (processes), which the "
                     "layout splits into TP x PP x CP x DP (default: one replica, TP x PP x CP)")
    dry.add_argument("--ranks", type=_ranks, help="model.backend=megatron: the global ranks to simulate, one at a time, "
                     "comma-separated (default: replica 0's first rank of the first and of the last pipeline stage)")
    dry.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON to FILE")
    dry.add_argument("overrides", nargs="*", help="section.key=value overrides (as train takes them)")

    doctor = commands.add_parser("doctor", help="print torch/CUDA/NCCL, GPUs, TE/apex/megatron, the layer spec "
                                 "and the world size/rank this process sees")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--model", help="a Qwen3 size or HF config whose head size vLLM's CPU attention is asked about "
                        "(default: the demo's tiny model)")

    theory = commands.add_parser("theory", help="print the paper's stylised results and plot escape times")
    theory.add_argument("--out", type=Path, default=Path("runs/theory"), help="directory for theory.json and escape_time.png")

    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:  # key=value words after an option land here
        args.overrides = [*args.overrides, *extra]
    try:
        return _dispatch(args)
    except BrokenPipeError:  # the reader went away (``nemo-jq plan ... | head -1``): the rest is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so Python's exit-time flush stays quiet
        return 0
    except KeyboardInterrupt:
        print(f"nemo-jq {args.command}: interrupted", file=sys.stderr)
        return 130
    except Stopped as stopped:  # a signal ended a command of several runs: it says what finished, how to go on
        print(stopped, file=sys.stderr, flush=True)
        return stopped.exit_code
    except Exception as err:
        from nemo_jq.runtime import distributed

        message = user_error_message(err)
        if message is None or args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        # rank 0 names the failed rank; that rank prints its own message
        if distributed.is_writer() or not isinstance(err, distributed.OtherRankFailed):
            where = "" if distributed.is_writer() else f" (rank {distributed.rank()})"
            print(f"nemo-jq {args.command}{where}: error: {message}", file=sys.stderr, flush=True)
        distributed.await_failing_ranks()
        return 2


def user_error_message(err: BaseException) -> str | None:
    """One line for an error that ordinary bad input causes (None for a bug: its traceback is shown).

    Under torchrun, rank 0 also names any other rank that failed, and each failed rank prints its own.
    """
    from nemo_jq.runtime import distributed

    if isinstance(err, OSError) and err.errno is not None and err.filename is not None:
        hints = {
            errno.ENOSPC: "free some space or choose another train.run_dir / --out; the last good checkpoint "
                          "(checkpoints/latest) is still loadable, so `nemo-jq train --resume RUN_DIR` continues",
            errno.EDQUOT: "free some of your quota (`lfs quota -u $USER PATH` on Lustre, `quota -s` elsewhere) or choose "
                          "another train.run_dir / --out; the last good checkpoint (checkpoints/latest) is still "
                          "loadable, so `nemo-jq train --resume RUN_DIR` continues",
            errno.EACCES: "make it writable or choose another train.run_dir / --out",
            errno.EROFS: "choose a writable train.run_dir / --out",
            errno.EPERM: "make it writable or choose another train.run_dir / --out",
        }
        reason = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err)).lower()
        return f"{reason}: {err.filename}" + (f"; {hints[err.errno]}" if err.errno in hints else "")
    if isinstance(err, (ValueError, OSError, KeyError, distributed.OtherRankFailed)):
        text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        return " ".join(str(text).split())
    return None


def _with_escapes(text: str) -> str:
    """``\\n`` and ``\\t`` typed in a shell argument mean a new line and a tab."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return int(text)


def _positive_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of GiB > 0; got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1); got {text!r}")
    return value


def run_named_experiment(args: argparse.Namespace) -> None:
    """``nemo-jq experiment NAME``: each experiment takes the shared options and its own (another's is an error)."""
    from nemo_jq.config import ConfigError

    own = {"noisy-cold-start": {"--label-noise": args.label_noise, "--adaptive": args.adaptive or None},
           "escape-rates": {"--widths": args.widths, "--cap": args.cap},
           "warm-start": {"--dependences": args.dependences, "--target-p1": args.target_p1}}
    foreign = {flag: value for name, flags in own.items() if name != args.name for flag, value in flags.items()}
    given = [flag for flag, value in foreign.items() if value is not None]
    if given:
        raise ConfigError(f"experiment {args.name} takes no {', '.join(given)} (another experiment's option): drop it")
    common = dict(quick=args.quick, overrides=args.overrides, overwrite=args.overwrite, only=args.methods)
    if args.name == "noisy-cold-start":
        from nemo_jq.experiments.noisy_cold_start import run_experiment

        run_experiment(args.out or Path("runs/noisy_cold_start"), args.seeds,
                       0.2 if args.label_noise is None else args.label_noise, adaptive=args.adaptive, **common)
    elif args.name == "escape-rates":
        from nemo_jq.experiments.escape_rates import run_experiment

        run_experiment(args.out or Path("runs/escape_rates"), args.seeds, widths=args.widths, cap=args.cap, **common)
    else:
        from nemo_jq.experiments.warm_start import TARGET_P1, run_experiment

        run_experiment(args.out or Path("runs/warm_start"), args.seeds, dependences=args.dependences,
                       target_p1=TARGET_P1 if args.target_p1 is None else args.target_p1, **common)


def _knobs(text: str) -> dict[str, float]:
    """``name=number,...``, as ``--adaptive cold_p=0.0625,q_min=0.25`` gives it."""
    knobs = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            if not name.strip():
                raise ValueError
            knobs[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be KNOB=NUMBER,... (e.g. cold_p=0.0625,q_min=0.25); got {item!r}") from None
    return knobs


def _plan_assumptions() -> str:
    from nemo_jq.cluster import plan

    return "assumptions:\n" + plan.__doc__.split("\n", 2)[2]


def _dryrun_notes() -> str:
    """The dry run's modules' docstrings, read from their files: every command builds this parser, and importing the
    dry run (torch's private fake-tensor module, which differs between versions) must not be a condition of ``train``."""
    import ast

    folder = Path(__file__).parents[1] / "dryrun"
    notes = [ast.get_docstring(ast.parse((folder / f"{name}.py").read_text())).split("\n", 2)[2] for name in ("run", "world")]
    return "how it works:\n" + notes[0] + "\n" + notes[1]


def _dryrun(args: argparse.Namespace) -> int:
    import dataclasses

    from nemo_jq.config import load_config
    from nemo_jq.dryrun import GPUS, check_fits, dry_run, format_report

    if args.gpu not in GPUS:
        raise ValueError(f"--gpu {args.gpu!r}: choose one of {', '.join(GPUS)}")
    gpu = GPUS[args.gpu] if args.gpu_memory is None else dataclasses.replace(GPUS[args.gpu], memory_gib=args.gpu_memory)
    config = load_config(args.config, args.overrides)
    if config.model.backend != "megatron" and (args.gpus or args.ranks):
        raise ValueError(f"--gpus and --ranks lay out model.backend=megatron; this config's is {config.model.backend!r}")
    report = dry_run(config, gpu, prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps,
                     world_size=args.gpus, ranks=args.ranks)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    check_fits(report)
    return 0


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(rank) for rank in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ranks (e.g. 0,4)") from None
    return ranks


#: ``nemo-jq plan``'s workload options: their Workload field, and the value without --config.
PLAN_WORKLOAD = {"seq_len": ("seq_len", 4096), "micro_batch": ("micro_batch", 1), "samples": ("samples", 32),
                 "batch_prompts": ("batch_prompts", 64), "recompute": ("recompute", False),
                 "sequence_parallel": ("sequence_parallel", True), "optimizer": ("optimizer", "fp32-adamw"),
                 "context_parallel": ("context_parallel", 1), "rollout_engine": ("rollout_engine", "native"),
                 "kv_cache_tokens": ("kv_cache_tokens", 131072),
                 "vllm_memory_utilization": ("vllm_memory_utilization", 0.5),
                 "rollout_tensor_parallel": ("vllm_tensor_parallel", 1)}


def _plan(args: argparse.Namespace) -> int:
    from nemo_jq.cluster import plan

    given = {option: getattr(args, option) for option in PLAN_WORKLOAD if getattr(args, option) is not None}
    if args.config is None:
        if args.overrides:
            raise ValueError(f"key=value overrides ({' '.join(args.overrides)}) need --config: give the run config")
        if args.model is None:
            raise ValueError("nemo-jq plan needs --model (a Qwen3 size or an HF config) or --config (a run config)")
        work = plan.Workload(**{field: given.get(option, default) for option, (field, default) in PLAN_WORKLOAD.items()})
    else:
        from nemo_jq.config import load_config

        if given:
            flags = ", ".join("--" + option.replace("_", "-") for option in given)
            raise ValueError(f"{flags}: --config gives the workload; set it in the config or as key=value overrides")
        config = load_config(args.config, args.overrides)
        work = plan.Workload.from_config(config, args.prompt_tokens)
        args.model = args.model or config.model.path
        if args.model is None:
            raise ValueError(f"{args.config} trains a tiny model from scratch (model.path: null): plan sizes real ones")
    arch = plan.architecture(args.model)
    layouts = plan.plan(arch, work, gpus_per_node=args.gpus_per_node, nodes=args.nodes, gpu_gb=args.gpu_memory)
    result = plan.report(arch, work, layouts, args.gpu_memory, 0.9)
    print(json.dumps(result, indent=2) if args.json else plan.format_report(result))
    return 0


def _launch(args: argparse.Namespace) -> int:
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


def _whole_number(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0; got {text!r}")
    return int(text)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "theory":
        from nemo_jq.theory.report import run

        run(args.out)
        return 0
    if args.command == "data":
        return _prepare_data(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "launch":
        return _launch(args)
    if args.command == "dryrun":
        return _dryrun(args)
    if args.command == "doctor":
        from nemo_jq.cluster import doctor

        info = doctor.report(args.model)
        print(json.dumps(info, indent=2) if args.json else doctor.format_report(info))
        return 0

    if args.command == "experiment":
        run_named_experiment(args)
        return 0

    from nemo_jq.runtime import distributed
    from nemo_jq.runtime.runs import load_for_inference

    if args.command == "train":
        from nemo_jq.runtime.outputs import release_run_dirs

        try:
            return _train(args)
        finally:  # let go of the run directory: a start that failed leaves nothing behind that blocks the next
            release_run_dirs()

    loaded = load_for_inference(args.checkpoint, getattr(args, "overrides", ()), args.step)
    selected = loaded.selected
    if args.command == "eval":
        from nemo_jq.recipe.evaluation import Evaluator
        from nemo_jq.runtime.runs import write_evaluation

        report = {"split": args.split, **selected.describe(), **Evaluator(loaded.components).evaluate(args.split)}
        if distributed.is_writer():
            print(json.dumps(report, indent=2))
            written = write_evaluation(selected.run_dir, args.split, selected.step, report)
            print(f"nemo-jq: evaluated step {selected.step} of {selected.run_dir} ({selected.why}); wrote {written}",
                  file=sys.stderr)
    else:
        from nemo_jq.models.export import record_source

        loaded.components.policy.export(args.out, loaded.components.tokenizer)
        if distributed.is_writer():
            record_source(args.out, selected.describe())
            print(f"exported step {selected.step} of {selected.run_dir} ({selected.why}) to {args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime import distributed
    from nemo_jq.runtime.preemption import StopSignals, end_stopped_run
    from nemo_jq.runtime.runs import holds_this_run

    if args.resume is not None and (args.config is not None or args.overwrite or args.requeue):
        raise ValueError("--resume continues a run with its own config.yaml: drop --config/--overwrite/--requeue "
                         "(key=value overrides of how long it runs and how it is evaluated are allowed)")
    if args.resume is None and args.config is None and not args.overrides:
        from nemo_jq.recipe.demo import run_demo

        run_demo(args.demo_dir, overwrite=args.overwrite)
        return 0
    with StopSignals() as stop:  # from the start: a time-limit signal while the model loads is not lost
        if args.resume is not None:
            trainer = Trainer.resume(args.resume, args.overrides)
        else:
            config = load_config(args.config, args.overrides)
            held = holds_this_run(config) if args.requeue else None
            trainer = (Trainer.resume(config.train.run_dir) if held == "resume" else
                       Trainer(config, overwrite=args.overwrite or held == "restart"))
        result = trainer.fit(stop=stop)
    if distributed.is_writer():
        print(json.dumps(result, indent=2))
    if "preempted" in result:
        return end_stopped_run(result["preempted"], result["step"], trainer.run_dir, requeue=args.requeue)
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from nemo_jq.config import import_plugins
    from nemo_jq.data.prepare import PAPER_SIZES, PREPARED_FILES, describe_rejects, make_task, prepare, write_prepared
    from nemo_jq.runtime.outputs import claim_dir

    import_plugins(args.plugin)
    task = make_task(args.dataset, template=args.template, system=args.system)
    if args.sizes:
        parts = args.sizes.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--sizes needs three whole numbers >= 1 (train,validation,test), e.g. 800,100,100; got {args.sizes!r}")
        sizes = tuple(int(p) for p in parts)
    elif args.dataset in PAPER_SIZES:
        sizes = PAPER_SIZES[args.dataset]
    else:
        raise ValueError(f"--sizes is required for dataset {args.dataset!r} (train,validation,test, e.g. 800,100,100)")
    splits, manifest = prepare(task, args.source, sizes, args.seed, hub_config=args.hub_config, on_bad_row=args.on_bad_row)
    claim_dir(args.out, PREPARED_FILES, overwrite=args.overwrite, what="prepared data",
              advice="choose another --out, or pass --overwrite to move it aside first")
    write_prepared(splits, manifest, args.out)
    for name, entry in manifest["sources"].items():
        derived = {k: v for k, v in entry["reference_sources"].items() if k != "answer"}
        print(f"{name}: {entry['rows']} rows, {describe_rejects(task, entry)}, selected {entry['selected']}, "
              f"{entry['unused']} unused" + "".join(f", y* from {k} in {v}" for k, v in derived.items()))
    print(f"wrote {args.out}/{{train,validation,test}}.jsonl and manifest.json")
    return 0

