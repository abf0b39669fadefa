"""``nemo-jq theory``: the paper's stylised results as tables, JSON and a plot of escape times."""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    theory = commands.add_parser("theory", help="print the paper's stylised results and plot escape times")
    theory.add_argument("--out", type=arguments.path, default=Path("runs/theory"), help="directory for theory.json and escape_time.png")
    theory.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.runtime.outputs import staged
    from nemo_jq.theory.report import REPORT_KEYS
    from nemo_jq.theory.report import run as write_report

    if args.out.exists() and not args.out.is_dir():
        raise FileExistsError(f"--out {args.out} is a file: give a folder for theory.json and escape_time.png")
    report, plot = args.out / "theory.json", args.out / "escape_time.png"
    earlier = report.is_file() and arguments.json_holding(*REPORT_KEYS)(report.read_text(errors="replace"))
    if not earlier and (report.exists() or plot.exists()):
        raise FileExistsError(f"--out {args.out} holds {'theory.json' if report.exists() else 'escape_time.png'}, which "
                              "is no earlier report of nemo-jq theory: give another folder (nothing was written)")
    with staged(args.out, last="theory.json") as staging:  # a stop part-way leaves --out as it was
        write_report(staging)
    print(f"wrote {args.out / 'theory.json'} and {args.out / 'escape_time.png'}")
    return 0
