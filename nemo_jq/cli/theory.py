"""``nemo-jq theory``: the paper's stylised results as tables, JSON and a plot of escape times."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    theory = commands.add_parser("theory", help="print the paper's stylised results and plot escape times")
    theory.add_argument("--out", type=Path, default=Path("runs/theory"), help="directory for theory.json and escape_time.png")
    theory.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.theory.report import run as write_report

    write_report(args.out)
    return 0
