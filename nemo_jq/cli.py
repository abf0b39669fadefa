"""The ``nemo-jq`` command."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo-jq", description="Post-train reasoning LLMs on the J_Q loss continuum.")
    commands = parser.add_subparsers(dest="command", required=True)
    theory = commands.add_parser("theory", help="print the paper's stylised results and plot escape times")
    theory.add_argument("--out", type=Path, default=Path("runs/theory"), help="directory for theory.json and escape_time.png")
    args = parser.parse_args(argv)

    if args.command == "theory":
        from nemo_jq.theory.report import run

        run(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
