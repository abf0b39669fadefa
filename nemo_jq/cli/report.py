"""``nemo-jq report``: the paper's tables and curves from finished runs or sweeps (nothing is evaluated again)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(commands) -> None:
    report = commands.add_parser(
        "report", help="tables (mean and 95%% t-interval over seeds) and curves from finished runs or sweeps",
        description="nemo-jq report runs/q_sweep [runs/other_run ...] --csv table.csv --json table.json --figures figs/")
    report.add_argument("paths", nargs="+", type=Path, help="run folders, sweep folders, or folders of runs")
    report.add_argument("--csv", type=Path, help="also write the table as CSV here")
    report.add_argument("--json", type=Path, help="also write the table, the runs read and those unfinished as JSON here")
    report.add_argument("--figures", type=Path, help="write the curves here, one figure per dataset")
    report.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return print_report(args.paths, figures=args.figures, csv_path=args.csv, json_path=args.json)


def print_report(paths: list[Path], *, figures: Path | None = None, csv_path: Path | None = None,
                 json_path: Path | None = None) -> int:
    """The table of the finished runs under ``paths`` (markdown; also CSV and JSON where asked), its figures written
    under ``figures``."""
    from nemo_jq.runtime.report import csv_text, markdown, report

    result = report(paths, figures=figures)
    print(markdown(result["rows"]), end="")
    if result["unfinished"]:
        print(f"not finished (left out): {', '.join(result['unfinished'])}")
    if csv_path:
        csv_path.write_text(csv_text(result["rows"]))
    if json_path:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    for path in [*result["figures"], *filter(None, [csv_path, json_path])]:
        print(f"wrote {path}")
    return 0
