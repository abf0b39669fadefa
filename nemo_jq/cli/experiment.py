"""``nemo-jq experiment NAME``: the multi-run studies (not tests), each with its own options."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from types import ModuleType

from nemo_jq.cli import arguments

#: The options every experiment takes: (flags, argparse keywords).
SHARED = [
    (("--out",), dict(type=arguments.path, help="a new folder for the runs (default: {default})")),
    (("--seeds",), dict(type=arguments.seed, nargs="+", help="default 0 1 2")),
    (("--quick",), dict(action="store_true", help="a few-second smoke size (not a result)")),
    (("--overwrite",), dict(action="store_true", help="if --out holds an experiment, move it aside first")),
    (("--resume",), dict(type=arguments.path, metavar="OUT", help="go on with the experiment a stop left in OUT, with the options "
                         "it started with: its finished runs are kept, the stopped one continues from its checkpoint")),
]
#: The seeds an experiment runs unless ``--seeds`` says.
SEEDS = [0, 1, 2]
#: ``--methods``, shared too; its help gives an example of the methods each experiment takes (:data:`METHODS_EXAMPLE`).
METHODS = dict(type=lambda text: [name.strip() for name in text.split(",")], default=[], metavar="NAME,NAME")
METHODS_EXAMPLE = {"noisy-cold-start": "adaptive,q=1", "escape-rates": "GRPO,q=1", "warm-start": "'GRPO,PAFT q=0.25'"}


def knobs(text: str) -> dict[str, float]:
    """``name=number,...``, as ``--adaptive cold_p=0.0625,q_min=0.25`` gives it."""
    parsed = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            if not name:
                raise ValueError
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be KNOB=NUMBER,... (e.g. cold_p=0.0625,q_min=0.25); got {item!r}") from None
        if name in parsed:
            raise argparse.ArgumentTypeError(f"{name} is given twice: drop one")
        parsed[name] = number
    return parsed


#: Each experiment's own options (another experiment's is an error that names it).
OWN = {
    "noisy-cold-start": [
        (("--label-noise",), dict(type=float, help="share of training labels made wrong (default 0.2)")),
        (("--adaptive",), dict(type=knobs, default={}, metavar="KNOB=VALUE,...", help="the adaptive rule's knobs: "
                               "q_max, q_min, cold_p, ema_decay (default: the tuned ones, TUNED_ADAPTIVE)"))],
    "escape-rates": [
        (("--widths",), dict(type=int, nargs="+", help="the answer widths, the p0 knob (default 2 3 4; --quick: 2 3)")),
        (("--cap",), dict(type=int, help="steps before a run counts as censored (default 200; --quick: 4)"))],
    "warm-start": [
        (("--dependences",), dict(nargs="+", help="the synthetic task's data.rationale_dependence settings (default "
                                  "none operations; also sum)")),
        (("--target-p1",), dict(type=float, help="the validation p@1 (percent) the warm-up SFT stops at (default 20)")),
        (("--methods-override",), dict(action="append", metavar="KEY=VALUE", help="an override of the methods' phase "
                                       "only, not the warm-up (repeatable; e.g. optim.lr=1e-3)"))],
}
EXPERIMENTS = tuple(OWN)
#: Where each experiment writes without ``--out``.
DEFAULT_OUT = {name: Path("runs") / name.replace("-", "_") for name in EXPERIMENTS}
OVERRIDES = dict(nargs="*", default=[], help="section.key=value overrides for every run (e.g. guard.enabled=true)")


def add_parser(commands) -> None:
    experiment = commands.add_parser("experiment", add_help=False, help="multi-run studies (not tests): "
                                     + ", ".join(EXPERIMENTS) + " (nemo-jq experiment NAME --help: its options)")
    experiment.add_argument("-h", "--help", action=ExperimentHelp, nargs=0, help="this help, or NAME's")
    experiment.add_argument("name", choices=EXPERIMENTS)
    add_options(experiment, [option for own in OWN.values() for option in own],
                ", ".join(f"{example} ({name})" for name, example in METHODS_EXAMPLE.items()),
                ", ".join(f"{out} ({name})" for name, out in DEFAULT_OUT.items()))
    # the folder a launch checks (cluster.launch.check_job_paths) where --out is not given: the experiment's default
    experiment.set_defaults(run=run, unset_paths=lambda args: {"--out": DEFAULT_OUT[args.name]}
                            if args.out is None and args.resume is None else {})


def add_options(parser: argparse.ArgumentParser, own: list, methods_example: str, out_default: str) -> None:
    """The shared options, ``own`` (an experiment's, or all of them), and the overrides; ``--methods`` with
    ``methods_example``, methods the experiment (or each) takes; ``--out`` with ``out_default``, its (or each's)."""
    methods = (("--methods",), {**METHODS, "help": f"run only these methods (e.g. {methods_example}); default: all"})
    for flags, options in [*SHARED, methods, *own]:
        if "{default}" in options.get("help", ""):
            options = {**options, "help": options["help"].format(default=out_default)}
        parser.add_argument(*flags, **options)
    parser.add_argument("overrides", **OVERRIDES)


class ExperimentHelp(argparse.Action):
    """``experiment NAME --help``: NAME's summary and the options it takes; ``experiment --help``: every option."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name = getattr(namespace, "name", None)
        if name not in OWN:
            parser.print_help()
            parser.exit()
        module = experiment_module(name)
        own = argparse.ArgumentParser(prog=f"{parser.prog} {name}", description=module.__doc__.split("\n\n", 1)[0].replace("``", ""),
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        add_options(own, OWN[name], METHODS_EXAMPLE[name], str(DEFAULT_OUT[name]))
        own.print_help()
        parser.exit()


def run(args: argparse.Namespace) -> int:
    """``nemo-jq experiment NAME``: each experiment takes the shared options and its own (another's is an error)."""
    from nemo_jq.config import ConfigError

    given = [flags[0] for name, options in OWN.items() if name != args.name for flags, _ in options if is_given(args, flags[0])]
    if given:
        raise ConfigError(f"experiment {args.name} takes no {', '.join(given)} (another experiment's option): drop it")
    if args.resume is not None:
        given = [flags[0] for flags, _ in [*SHARED, (("--methods",), None), *OWN[args.name]]
                 if flags[0] != "--resume" and is_given(args, flags[0])] + ["key=value overrides"] * bool(args.overrides)
        if given:
            raise ConfigError(f"--resume {args.resume} goes on with the experiment as it started: drop {', '.join(given)}")
        import inspect

        from nemo_jq.experiments.common import PROGRESS_FILE, Progress, recorded_options

        options, run_experiment = Progress.read(args.resume, args.name).options, experiment_module(args.name).run_experiment
        try:
            inspect.signature(run_experiment).bind(args.resume, **options, resume=True)
        except TypeError as err:  # an edited record
            raise ConfigError(f"{args.resume / PROGRESS_FILE} is not an experiment's record ({err}): restore it, or "
                              "start the experiment again with --out NEW_DIR") from None
        with recorded_options(args.resume / PROGRESS_FILE):
            run_experiment(args.resume, **options, resume=True)
        return 0
    try:
        return run_named(args)
    except ValueError as err:  # a key an option sets, named as the option it came from
        for option, key in option_keys(args.name).items():
            if key in str(err) and is_given(args, option):
                raise type(err)(f"{option} ({key} of its runs): {err}") from None
        raise


def option_keys(name: str) -> dict[str, str]:
    """The config key each of experiment ``name``'s own options sets in its runs, as its ``CONTROLLED`` table says
    (the option it names, or one its reason mentions: the adaptive method's schedule takes ``--adaptive``'s knobs)."""
    controlled = experiment_module(name).CONTROLLED
    return {flags[0]: key for flags, _ in OWN[name] for key, (reason, option) in controlled.items()
            if flags[0] in (option, *re.findall(r"--[\w-]+", reason))}


def is_given(args: argparse.Namespace, option: str) -> bool:
    return getattr(args, option.lstrip("-").replace("-", "_"), None) not in (None, {}, [], False)


def experiment_module(name: str) -> ModuleType:
    return importlib.import_module(f"nemo_jq.experiments.{name.replace('-', '_')}")


def run_named(args: argparse.Namespace) -> int:
    common = dict(quick=args.quick, overrides=args.overrides, overwrite=args.overwrite, only=args.methods)
    seeds = args.seeds or SEEDS
    if args.name == "noisy-cold-start":
        from nemo_jq.experiments.noisy_cold_start import run_experiment

        run_experiment(args.out or DEFAULT_OUT[args.name], seeds,
                       0.2 if args.label_noise is None else args.label_noise, adaptive=args.adaptive, **common)
    elif args.name == "escape-rates":
        from nemo_jq.experiments.escape_rates import run_experiment

        run_experiment(args.out or DEFAULT_OUT[args.name], seeds, widths=args.widths, cap=args.cap, **common)
    else:
        from nemo_jq.experiments.warm_start import TARGET_P1, run_experiment

        run_experiment(args.out or DEFAULT_OUT[args.name], seeds, dependences=args.dependences,
                       target_p1=TARGET_P1 if args.target_p1 is None else args.target_p1,
                       methods_overrides=args.methods_override or (), **common)
    return 0
