"""``nemo-jq experiment NAME``: the multi-run studies (not tests), each with its own options."""

from __future__ import annotations

import argparse
from pathlib import Path

EXPERIMENTS = ("noisy-cold-start", "escape-rates", "warm-start")


def add_parser(commands) -> None:
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
    experiment.add_argument("--methods-override", action="append", metavar="KEY=VALUE", help="warm-start: an override "
                            "of the methods' phase only, not the warm-up (repeatable; e.g. optim.lr=1e-3)")
    experiment.add_argument("--quick", action="store_true", help="a few-second smoke size (not a result)")
    experiment.add_argument("--overwrite", action="store_true", help="if --out holds an experiment, move it aside first")
    experiment.add_argument("--methods", type=lambda text: [name.strip() for name in text.split(",")], default=[],
                            metavar="NAME,NAME", help="run only these methods (e.g. adaptive,q=1); default: all")
    experiment.add_argument("--adaptive", type=knobs, default={}, metavar="KNOB=VALUE,...",
                            help="noisy-cold-start: the adaptive rule's knobs: q_max, q_min, cold_p, ema_decay (default: the "
                            "tuned ones, TUNED_ADAPTIVE)")
    experiment.add_argument("overrides", nargs="*", help="section.key=value overrides for every run (e.g. guard.enabled=true)")
    experiment.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``nemo-jq experiment NAME``: each experiment takes the shared options and its own (another's is an error)."""
    from nemo_jq.config import ConfigError

    own = {"noisy-cold-start": {"--label-noise": args.label_noise, "--adaptive": args.adaptive or None},
           "escape-rates": {"--widths": args.widths, "--cap": args.cap},
           "warm-start": {"--dependences": args.dependences, "--target-p1": args.target_p1,
                          "--methods-override": args.methods_override}}
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
                       target_p1=TARGET_P1 if args.target_p1 is None else args.target_p1,
                       methods_overrides=args.methods_override or (), **common)
    return 0


def knobs(text: str) -> dict[str, float]:
    """``name=number,...``, as ``--adaptive cold_p=0.0625,q_min=0.25`` gives it."""
    parsed = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            if not name.strip():
                raise ValueError
            parsed[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be KNOB=NUMBER,... (e.g. cold_p=0.0625,q_min=0.25); got {item!r}") from None
    return parsed
