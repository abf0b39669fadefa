"""Argument types the commands share: each names what it takes and what it got."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from nemo_jq.typed import LARGEST_SEED

STEP_HELP = ("for a run directory: best (the best validation m@k; ties keep the earliest, as training does), latest, "
             "or a step number; the output names the step and why")


def with_escapes(text: str) -> str:
    """``\\n`` and ``\\t`` typed in a shell argument mean a new line and a tab."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def path(text: str) -> Path:
    """A path, a leading ``~`` the home folder: a shell leaves ``--out=~/x`` as it is (a folder named ``~`` was made);
    an empty one is refused (``Path("")`` is the current folder)."""
    return Path(given(text)).expanduser()


def given(text: str) -> str:
    """A value that is not empty: ``--source "$DATA"`` with ``DATA`` unset read the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset shell variable?): give a value")
    return text


path.names_a_path = True  # a launch checks where it points from where its job runs (cluster.launch.check_job_paths)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return int(text)


def positive_amount(unit: str):
    """A finite number > 0 of ``unit`` (GiB, MiB, GB/s)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a number of {unit} > 0; got {text!r}")
        return value

    return parse


positive_gb = positive_amount("GiB")


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1); got {text!r}")
    return value


def whole_number(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0; got {text!r}")
    return int(text)


def seed(text: str) -> int:
    """A random seed: a whole number the run's generators all take."""
    if not text.isdigit() or int(text) > LARGEST_SEED:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to {LARGEST_SEED}; got {text!r}")
    return int(text)


def json_holding(*keys: str) -> Callable[[str], bool]:
    """Whether a file's text is a JSON object holding ``keys``: how a command knows a report it wrote earlier (which
    a later run of it may replace)."""
    import json

    def holds(text: str) -> bool:
        try:
            report = json.loads(text)
        except ValueError:
            return False
        return isinstance(report, dict) and set(keys) <= set(report)

    return holds


def output_problem(path: Path, what: str, is_earlier: Callable[[str], bool]) -> str | None:
    """What keeps a command from writing ``what`` to ``path`` (None: nothing), checked before its work: the path is a
    file's in a folder that exists, and a file already there is an earlier ``what`` (``is_earlier`` of its text),
    never anything else of the user's."""
    if path.is_dir():
        return f"{path} is a folder: give the path of a file in it"
    if not path.parent.is_dir():
        return f"the folder {path.parent} does not exist: create it (mkdir -p {path.parent}), or give a path in another"
    if path.exists():
        try:
            earlier = is_earlier(path.read_text())
        except (OSError, UnicodeDecodeError):
            earlier = False
        if not earlier:
            return f"{path} exists and is not an earlier {what}: give another path (that file is left as it is)"
    return None


def output_file(what: str, is_earlier: Callable[[str], bool]):
    """An argument naming a file the command writes ``what`` to (:func:`output_problem`)."""

    def parse(text: str) -> Path:
        problem = output_problem(Path(text), what, is_earlier)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return Path(text)

    parse.names_a_path = True  # a launch checks it as it checks a Path option (cluster.launch.check_job_paths)
    return parse
