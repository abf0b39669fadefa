"""``nemo-jq report``: the paper's tables and curves from finished runs or sweeps (nothing is evaluated again)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    report = commands.add_parser(
        "report", help="tables (mean and 95%% t-interval over seeds) and curves from finished runs or sweeps",
        description="nemo-jq report runs/q_sweep [runs/other_run ...] --csv table.csv --json table.json --figures figs/")
    report.add_argument("paths", nargs="+", type=arguments.path, help="run folders, sweep folders, or folders of runs")
    report.add_argument("--csv", type=arguments.path, help="also write the table as CSV here")
    report.add_argument("--json", type=arguments.path, help="also write the table, the runs read and those unfinished as JSON here")
    report.add_argument("--figures", type=arguments.path, help="write the curves here, one figure per dataset")
    report.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return print_report(args.paths, figures=args.figures, csv_path=args.csv, json_path=args.json)


def print_report(paths: list[Path], *, figures: Path | None = None, csv_path: Path | None = None,
                 json_path: Path | None = None) -> int:
    """The table of the finished runs under ``paths`` (markdown; also CSV and JSON where asked), its figures written
    under ``figures``."""
    from nemo_jq.runtime.report import CSV_START, JSON_START, csv_text, json_text, markdown, report

    check_output("--csv", csv_path, CSV_START)
    check_output("--json", json_path, JSON_START)
    if csv_path and json_path and csv_path.resolve() == json_path.resolve():
        raise ValueError(f"--csv and --json both name {csv_path}: give each its own file")
    if figures is not None and figures.exists() and not figures.is_dir():
        raise ValueError(f"--figures {figures} is a file: give a folder for the figures")
    result = report(paths, figures=figures)
    print(markdown(result["rows"]), end="")
    if result["unfinished"]:
        print(f"not finished (left out): {', '.join(result['unfinished'])}")
    if csv_path:
        csv_path.write_text(csv_text(result["rows"]))
    if json_path:
        json_path.write_text(json_text(result))
    for path in [*result["figures"], *filter(None, [csv_path, json_path])]:
        print(f"wrote {path}")
    return 0


def check_output(flag: str, path: Path | None, start: str) -> None:
    """Before anything is read: ``path`` can take the table, and holds nothing a user would lose (a run's or a sweep's
    own file never; an existing file only where it is an earlier table of report's, beginning with ``start``, or
    empty)."""
    from nemo_jq.cli.arguments import output_problem
    from nemo_jq.runtime.runs import RUN_FILES
    from nemo_jq.runtime.sweep import SWEEP_FILE

    if path is None:
        return
    if path.name in (*RUN_FILES, SWEEP_FILE):
        raise ValueError(f"{flag} {path}: {path.name} is a run's or a sweep's own file: give the table another name "
                         f"(e.g. table.{flag[2:]})")
    problem = output_problem(path, "table nemo-jq report wrote", lambda text: text[:len(start)] in ("", start))
    if problem:
        raise ValueError(f"{flag}: {problem}")
