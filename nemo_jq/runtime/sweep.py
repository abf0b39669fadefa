"""A sweep: a grid of runs under one folder that records it, run here a few at a time and resumable as a whole.

``nemo-jq sweep --out DIR [--config C ...] key=value key=a,b,c --seeds 0,1,2`` makes one run per config x swept values
x seed (``train.seed``; the data split stays ``data.seed``'s), each ``DIR/<name>``, and writes the grid to
``DIR/sweep.json``. Each run is ``nemo-jq train --requeue ... train.run_dir=DIR/<name>`` in a process of its own (a
finished run is left alone; one stopped with a checkpoint continues from it; one never started, or started without a
checkpoint, starts), so ``nemo-jq sweep --resume DIR`` continues a sweep whatever stopped it, and a SLURM array task
runs the same command (``launchers/slurm.sbatch``: ``nemo-jq sweep --task DIR``). Here, ``parallel`` runs at once,
each with ``threads`` torch threads (default: the free cores shared out: two processes with all the cores each run
several times slower), its output in ``DIR/logs/<name>.log``; a first line with the runs and their steps, one line a
run as it starts and ends, and the running runs' steps and the time left at the step rate measured so far: once every running run's rate is
measured (a few seconds past its first step), then every ``report_every`` seconds. A stop signal reaches every
running run once (each writes its checkpoint and stops), no further run starts, and the line says how to continue.

Why one file (near 700 lines): the grid, the sweep's record of it (``sweep.json``, the copied configs) and the
loop that runs it here share the record's rules (what a resume or ``--overwrite`` may change); ``launch`` submits
the same :class:`Sweep` to SLURM.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from nemo_jq.runtime.distributed import batches_per_epoch
from nemo_jq.runtime.monitor import duration, read_json_file, read_metrics
from nemo_jq.runtime.outputs import (
    RUNS_LOCK,
    RunDirInUse,
    claim_dir,
    held_runs_in,
    hold_run_dir,
    refuse_foreign_files,
    release_run_dir,
    write_atomic,
)
from nemo_jq.runtime.runs import (
    RESUMABLE_KEYS,
    RUN_FILES,
    failed_start,
    has_finished,
    last_checkpoint_state,
    refuse_overrides,
    refuse_shared_run_dir,
)
from nemo_jq.typed import ConfigError

SWEEP_FILE, LOGS_DIR = "sweep.json", "logs"
#: The sweep's copies of its ``--config`` files, taken at its start, which its runs read (:meth:`SweepRun.config_file`).
CONFIGS_DIR = "configs"
#: An experiment's record in its folder (:class:`nemo_jq.experiments.common.Progress`), whose runs are
#: ``METHOD/seedS`` under it: the trackers group them as a sweep's (:func:`nemo_jq.runtime.tracking.group_of`).
EXPERIMENT_FILE = "experiment.json"
#: A run's state in its sweep: results written; a checkpoint to continue from; nothing to continue (a new start).
FINISHED, STOPPED, NEW = "finished", "stopped", "new"


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its folder's name, its config file as given (None: the embedded defaults), its overrides,
    and the sweep's copy of the file (relative to the sweep's folder; None in a sweep from before copies)."""

    name: str
    config: str | None
    overrides: tuple[str, ...]
    config_copy: str | None = None

    def config_file(self, sweep_dir: Path) -> str | None:
        """The config file the run reads: the copy the sweep took at its start, so that an edit of the file since
        changes none of its runs, nor whether one has finished; ``config`` itself in a sweep from before copies."""
        return str(Path(sweep_dir) / self.config_copy) if self.config_copy else self.config

    def train_words(self, sweep_dir: Path) -> list[str]:
        """``nemo-jq train`` that starts this run, or continues it where its folder holds it (``--requeue``)."""
        config = self.config_file(sweep_dir)
        return ["train", "--requeue", *(["--config", config] if config else []), *self.overrides,
                f"train.run_dir={Path(sweep_dir) / self.name}"]


@dataclass
class Sweep:
    """The runs under ``directory`` and the grid they came from (``sweep.json``)."""

    directory: Path
    runs: list[SweepRun]
    grid: dict[str, Any] = field(default_factory=dict)
    #: How it runs on this machine (``parallel``, ``threads``) as first asked, for ``--resume`` to go on alike.
    here: dict[str, Any] = field(default_factory=dict)
    #: Where :meth:`write` moved an earlier sweep or run in its folder aside (``--overwrite``), for :meth:`withdraw`.
    moved_aside: Path | None = field(default=None, compare=False)

    @classmethod
    def from_grid(cls, directory: Path, configs: Sequence[str | None], words: Sequence[str],
                  seeds: Sequence[int] | None) -> Sweep:
        """Every config x value of each swept key (``key=a,b``; ``key=value`` is the same for every run) x seed; a value
        given twice is refused (it would train one point twice). Each run is named by what it sweeps, its values as a
        folder name may hold them (:func:`folder_labels`)."""
        fixed, axes = split_words(words)
        refuse_own_keys([*(word.split("=", 1)[0] for word in fixed), *axes], seeds)
        refuse_repeats("--config", list(configs), lambda config: Path(config).resolve())
        refuse_repeats("--seeds", list(seeds or []), lambda seed: seed)
        for key, values in axes.items():
            refuse_repeats(key, values, lambda value, key=key: as_a_config_reads(key, value))
        configs = list(configs) or [None]
        config_label = dict(zip(configs, config_labels(configs))) if len(configs) > 1 else {}
        value_label = {key: dict(zip(values, folder_labels(values))) for key, values in axes.items()}
        lasts = [key.rsplit(".", 1)[-1] for key in axes]  # a key by its last part, unless two share it
        key_label = {key: last if lasts.count(last) == 1 else key for key, last in zip(axes, lasts)}
        runs = []
        for config, values, seed in itertools.product(configs, itertools.product(*axes.values()), seeds or [None]):
            chosen = [f"{key}={value}" for key, value in zip(axes, values)]
            parts = ([config_label[config]] if config_label else []) + [
                f"{key_label[key]}={value_label[key][value]}" for key, value in zip(axes, values)]
            parts += [f"seed={seed}"] if seed is not None else []
            runs.append(SweepRun("_".join(parts) or "run", config, tuple([*fixed, *chosen,
                                                                          *([f"train.seed={seed}"] if seed is not None else [])])))
        check_names(runs)
        grid = {"configs": configs, "fixed": fixed, "axes": axes, "seeds": list(seeds) if seeds else None}
        return cls(Path(directory), runs, grid)

    @classmethod
    def load(cls, directory: Path) -> Sweep:
        """The sweep ``directory/sweep.json`` records (``--resume``, ``--task`` and ``report`` read it here): one edited
        or cut short is refused in one line saying what is wrong with it."""
        path = Path(directory) / SWEEP_FILE
        if not path.exists():
            raise FileNotFoundError(f"{directory} holds no sweep ({SWEEP_FILE}): give the folder `nemo-jq sweep --out` made")
        saved = read_json_file(path, "a sweep record", record_problem, "restore it or start a new sweep with --out")
        runs = [SweepRun(run["name"], run["config"], tuple(run["overrides"]), run.get("config_copy"))
                for run in saved["runs"]]
        return cls(Path(directory), runs, saved.get("grid", {}), saved.get("here", {}))

    def write(self, *, overwrite: bool = False, markers: tuple[str, ...] = (), what: str = "a sweep",
              advice: str | None = None) -> None:
        """Claim the folder (an earlier sweep there, or any of ``markers``, is refused saying ``advice``, or moved
        aside with ``overwrite``; so is a run's folder, whose run a report would no longer find; a folder holding
        anything else is refused: the sweep's runs, logs and figures would land among, and over, a user's files) and
        record the grid. Each run's config is loaded first, as its run will load it, so a bad key or value is refused
        in one line naming the run before anything is written."""
        configs = self.check()
        moved = claim_dir(self.directory, (SWEEP_FILE, *markers, *(run.name for run in self.runs)), overwrite=overwrite,
                          what=what, advice=advice or f"continue it with `nemo-jq sweep --resume {self.directory}`, write "
                          "the new one elsewhere (--out), or pass --overwrite to move the old one aside first")
        self.moved_aside = moved or claim_dir(self.directory, RUN_FILES, overwrite=overwrite, what="a run", advice="a "
                                              "sweep's runs go in a folder of their own: choose another, or pass "
                                              "--overwrite to move the run aside first")
        try:
            refuse_foreign_files(self.directory, "sweep")
            for run, config in zip(self.runs, configs):  # a folder its run's start would refuse: inside another run's...
                try:
                    refuse_shared_run_dir(self.directory / run.name, config)
                except ValueError as err:
                    raise ConfigError(f"run {run.name} of the sweep: {err}") from None
            self.directory.mkdir(parents=True, exist_ok=True)
            self._copy_configs()
            self.save()
        except BaseException:
            if self.moved_aside is not None:  # what --overwrite moved aside goes back
                self.withdraw()
            raise

    def _copy_configs(self) -> None:
        """Copy each ``--config`` file into ``DIR/configs/`` (named as its runs are), for the runs to read."""
        given = list(dict.fromkeys(run.config for run in self.runs if run.config))
        if not given:
            return
        (self.directory / CONFIGS_DIR).mkdir()
        copies = {}
        for config, label in zip(given, config_labels(given)):
            copies[config] = f"{CONFIGS_DIR}/{label}{Path(config).suffix}"
            shutil.copyfile(config, self.directory / copies[config])
        self.runs = [replace(run, config_copy=copies[run.config]) if run.config else run for run in self.runs]

    def work_from_start(self) -> None:
        """Work from the folder the sweep was started in (``here["started_in"]``), where its runs' relative paths (a
        ``--config``, a config's ``data.source``) are read, saying so: a ``--resume`` from another folder found none of
        them, and every run failed. Left as it is where that folder is not here (a SLURM task in a container, whose
        working folder is that folder's mount)."""
        started = self.here.get("started_in")
        if started and Path(started).is_dir() and Path(started).resolve() != Path.cwd().resolve():
            self.directory = self.directory.absolute()
            os.chdir(started)
            print(f"nemo-jq sweep: working from {started}, where the sweep was started (its runs' paths are read from "
                  "there)", flush=True)

    def withdraw(self) -> None:
        """Undo :meth:`write` of a sweep none of whose runs started (SLURM refused its array): its record, its empty
        logs folder, and its folder if that is left empty; what ``--overwrite`` moved aside goes back in its place."""
        (self.directory / SWEEP_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.directory / CONFIGS_DIR, ignore_errors=True)
        for folder in (self.directory / LOGS_DIR, self.directory):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if self.moved_aside is not None and not self.directory.exists():
            self.moved_aside.rename(self.directory)
            print(f"moved {self.moved_aside} back to {self.directory}")

    def save(self) -> None:
        record = {"grid": self.grid, "here": self.here, "runs": [asdict(run) for run in self.runs]}
        write_atomic(self.directory / SWEEP_FILE, json.dumps(record, indent=1) + "\n")  # a full disk: the last one

    def go_on_with(self, overrides: Sequence[str], command: str = "sweep") -> None:
        """``--resume DIR key=value``: every run goes on with ``overrides``, of :data:`~nemo_jq.runtime.runs.RESUMABLE_KEYS`
        only (how long it trains, how it is evaluated and saved, where it runs), each replacing the run's own value;
        ``sweep.json`` records them, for a later resume to keep. A finished run given more steps goes on too
        (:meth:`status`); one already past the steps they give it is refused, as is a key the grid sweeps (its runs'
        names say their values) and a sweep still running. Nothing is recorded unless every check passes."""
        from nemo_jq.config import current_key

        refuse_running(self, command)
        refuse_overrides(list(overrides), RESUMABLE_KEYS, "--resume", "a resumed sweep's runs keep what they train")
        given = {current_key(word.partition("=")[0]) for word in overrides}
        finished = {run.name for run in self.runs if self.status(run) == FINISHED}
        swept = sorted(given & {current_key(key) for key in self.grid.get("axes", {})})
        if swept:
            raise ConfigError(f"--resume {self.directory} {swept[0]}=...: the sweep's runs differ in {swept[0]} (their "
                              "names say their values): a new sweep sweeps other values")
        self.runs = [replace(run, overrides=(*(word for word in run.overrides if current_key(word.partition("=")[0])
                                               not in given), *overrides)) for run in self.runs]
        ended = []
        for run, config in zip(self.runs, self.check()):
            saved = last_checkpoint_state(self.directory / run.name) or {}
            step, steps = saved.get("step"), steps_of(config, saved.get("replicas", 1))
            if step is not None and steps is not None and step > steps:
                raise ConfigError(f"run {run.name} of the sweep is at step {step}, beyond the {steps} steps "
                                  f"{' '.join(overrides)} gives it: give it at least {step}")
            if run.name in finished and (step is None or (steps or 0) <= step):  # as status() says FINISHED
                ended.append(run.name)
        if ended and given & {"train.epochs", "train.max_steps"}:  # the other of the two ends them where they are
            print(f"nemo-jq: warning: {' '.join(overrides)} gives {len(ended)} finished run(s) no more steps ({ended[0]} "
                  "included): a run ends at train.epochs or train.max_steps, whichever comes first; raise the other "
                  "to train them on", file=sys.stderr)
        self.save()

    def check(self) -> list[Any]:
        """Load every run's config (a key its run will not use is said once a config file, not once a run), and its
        data where this machine's files hold it (:func:`check_data`); the configs, in the runs' order."""
        from nemo_jq.config import load_config

        seen: set[str | None] = set()
        data_seen: set[str] = set()
        configs: list[Any] = []
        for run in self.runs:
            file = run.config_file(self.directory)
            try:
                config = load_config(file, list(run.overrides), saved=file in seen)
                configs.append(config)
                check_data(config.data, data_seen)
            except (ValueError, OSError) as err:
                raise ConfigError(f"run {run.name} of the sweep: {err}") from None
            seen.add(file)
        return configs

    def status(self, run: SweepRun) -> str:
        """FINISHED where the run wrote its results at its last checkpoint's step (older results name no step) and its
        config gives it no more steps; one stopped in its end's evaluation, with results of an earlier step, or given
        more steps (:meth:`go_on_with`), is STOPPED: its resume trains on and evaluates again."""
        run_dir = self.directory / run.name
        saved = last_checkpoint_state(run_dir) or {}
        step = saved.get("step")
        steps = total_steps(run, self.directory, saved.get("replicas", 1))
        if has_finished(run_dir) and (step is None or (steps or 0) <= step):  # not given more steps since
            return FINISHED
        return STOPPED if step is not None else NEW


def check_data(data: Any, seen: set[str]) -> None:
    """Build the splits a run will train on from its config's ``data``, as its start does (a split larger than the
    data, a prepared folder or a source file that is missing or damaged: one error), once for each section ``seen``.
    Only data this machine's files hold (the synthetic task, a prepared folder, a local source): a hub dataset is
    read by its runs."""
    from nemo_jq.data.prepare import build_task

    key = json.dumps(asdict(data), sort_keys=True, default=str)
    if key in seen or not (data.name == "synthetic" or data.prepared_dir or (data.source and Path(data.source).exists())):
        return
    build_task(data)
    seen.add(key)


def record_problem(saved: dict[str, Any]) -> str | None:
    """What keeps ``saved`` from being a sweep record as :meth:`Sweep.write` writes it (None: nothing)."""
    runs, here = saved.get("runs"), saved.get("here", {})
    if not isinstance(runs, list) or not runs:
        return "no list of runs"
    for index, run in enumerate(runs):
        if not (isinstance(run, dict) and isinstance(run.get("name"), str) and run["name"] not in ("", ".", "..")
                and "/" not in run["name"] and isinstance(run.get("config"), (str, type(None)))
                and isinstance(run.get("overrides"), list) and all(isinstance(word, str) for word in run["overrides"])):
            return f"run {index} is not a folder name, a config and a list of overrides"
    names = [run["name"] for run in runs]
    if len(set(names)) < len(names):
        return "two runs share a name"
    if not isinstance(saved.get("grid", {}), dict) or not isinstance(here, dict):
        return "its grid and here are not both objects"
    for key in ("parallel", "threads"):
        if here.get(key) is not None and (type(here[key]) is not int or here[key] < 1):
            return f"here.{key} is {here[key]!r}, not a whole number >= 1"
    if not isinstance(here.get("failed", []), list) or not all(isinstance(name, str) for name in here.get("failed", [])):
        return f"here.failed is {here['failed']!r}, not a list of run names"
    if not isinstance(here.get("sbatch", []), list) or not all(isinstance(option, str) for option in here.get("sbatch", [])):
        return f"here.sbatch is {here['sbatch']!r}, not a list of sbatch options"
    return None


def refuse_repeats(what: str, values: Sequence[Any], same: Callable[[Any], Any] = lambda value: value) -> None:
    """Two of an axis's values (a sweep's, an experiment's option's) that are one (``0,0``, or ``0.5,.5`` as a config
    reads them) would train one point twice, the second time into the first's folders: refused, naming them."""
    for index, value in enumerate(values):
        earlier = next((other for other in values[:index] if same(other) == same(value)), None)
        if earlier is not None:
            count = sum(same(other) == same(value) for other in values)
            times = "twice" if count == 2 else f"{count} times"
            alike = f"{value} is given {times}" if str(earlier) == str(value) else f"{earlier} and {value} are the same"
            raise ConfigError(f"{what}: {alike}, which would train one run {times}: drop "
                              f"{'one' if count == 2 else 'all but one'}")


def refuse_own_keys(keys: Sequence[str], seeds: Sequence[int] | None) -> None:
    """A key the sweep sets for each run, given too, would be dropped: ``train.run_dir`` (each run's is ``DIR/NAME``),
    and ``train.seed`` beside ``--seeds``. Refused, naming it."""
    from nemo_jq.config import current_key

    for key in keys:
        if current_key(key) == "train.run_dir":
            raise ConfigError(f"{key}: the sweep sets train.run_dir for each of its runs (--out DIR, each run DIR/NAME): "
                              "drop it, and give the sweep's folder as --out")
        if current_key(key) == "train.seed" and seeds:
            raise ConfigError(f"{key}: --seeds sets train.seed for each run: give the seeds once, either as --seeds "
                              "or as train.seed=a,b")


def as_a_config_reads(key: str, value: str) -> Any:
    """A ``key=value`` word's value as the typed config reads it (``1e-3`` and ``0.001`` are one float; one it cannot
    read alone is itself: the run's config, loaded, says what is wrong with it)."""
    from nemo_jq.config import current_key, load_config

    try:
        return operator.attrgetter(current_key(key))(load_config(None, [f"{key}={value}"], saved=True))
    except (ValueError, OSError, AttributeError):
        return value


def folder_labels(values: Sequence[str]) -> list[str]:
    """Each value as part of a run folder's name: a path (``Qwen/Qwen3-0.6B``, ``/data/models/qwen3``) by as few of its
    last parts as tell the values apart, joined by ``-``; a character other than a letter, a digit or ``._+=-`` (a
    space, ``:``, ``#``) as ``-``, a flow list's or mapping's outer brackets dropped. Values still alike are refused
    as the runs are named (:func:`check_names`)."""
    parts = [[part for part in value.split("/") if part] or [value] for value in values]
    for depth in range(1, max(map(len, parts)) + 1):
        labels = [re.sub(r"[^\w.+=-]+", "-", "-".join(path[-depth:]).strip("[]{}'\" ")) for path in parts]
        if len(set(labels)) == len(labels):
            break
    return labels


#: The longest run name: a file name's 255 bytes, less the ``.log`` of its log.
LONGEST_NAME = 255 - len(".log")


def config_labels(configs: Sequence[str]) -> list[str]:
    """The config files' labels: in their runs' names (several configs) and their copies' names in the sweep."""
    return folder_labels([str(Path(config).with_suffix("")) for config in configs])


def check_names(runs: Sequence[SweepRun]) -> None:
    """Each run's name can name its folder and its log, and no two are alike (they would share a folder), nor the
    sweep's own folders: refused, naming the run, or what tells the two apart."""
    first: dict[str, SweepRun] = {}
    for run in runs:
        if run.name in (LOGS_DIR, CONFIGS_DIR):
            raise ValueError(f"run {run.name} would be named as the sweep's own folder {run.name}/: rename its config "
                             "file")
        if len(run.name.encode()) > LONGEST_NAME:
            raise ValueError(f"run {run.name[:60]}... would have a name of {len(run.name.encode())} bytes, longer than a "
                             f"file name may be ({LONGEST_NAME}): sweep fewer keys at once, or shorter values")
        other = first.setdefault(run.name, run)
        if other is not run:
            differ = [f"{a} and {b}" for a, b in zip([other.config, *other.overrides], [run.config, *run.overrides])
                      if a != b]
            raise ValueError(f"{'; '.join(differ)} would name one run folder ({run.name}): rename one (the file, or a "
                             "path's folder), or sweep them in two sweeps (--out)")


def split_words(words: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``key=value`` overrides (the same for every run) and swept keys (``key=a,b,c``; a comma inside brackets, braces
    or quotes is the value's own: ``[1,2]`` and ``{name: linear, num_steps: 200}`` are one value each); a word without
    ``=``, or a key given twice, is an error naming it."""
    fixed, axes = [], {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ValueError(f"{word!r}: a sweep takes section.key=value (or section.key=a,b,c to sweep it)")
        if key in axes or any(item.split("=", 1)[0] == key for item in fixed):
            raise ValueError(f"{key} is given twice: give it once (key=a,b,c sweeps it)")
        items = top_level_items(value)
        if len(items) > 1:
            axes[key] = [item.strip() for item in items]
            if any(not item for item in axes[key]):
                raise ValueError(f"{word!r}: an empty value in a swept list")
        else:
            fixed.append(word)
    return fixed, axes


def top_level_items(value: str) -> list[str]:
    """``value`` cut at each comma outside brackets, braces and quotes (YAML's flow lists, mappings and quoted strings;
    a quote within a word, ``don't``, quotes nothing)."""
    items, depth, quote, start = [], 0, None, 0
    for index, char in enumerate(value):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"" and not value[start:index].strip():
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(0, depth - 1)
        elif char == "," and depth == 0:
            items.append(value[start:index])
            start = index + 1
    return [*items, value[start:]]


def free_cores(window: float = 0.5) -> int:
    """This process's cores less those kept busy now (the machine's busy share over ``window`` seconds, from
    ``/proc/stat``, in cores, rounded), at least 1. Where there is no ``/proc/stat``, the 1-minute load average."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    stat = Path("/proc/stat")
    if not stat.exists():
        return max(1, cores - int(os.getloadavg()[0]))

    def sample() -> tuple[int, int]:
        ticks = [int(value) for value in stat.read_text().split("\n", 1)[0].split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, and idle + iowait

    (total, idle), _ = sample(), time.sleep(window)
    total_after, idle_after = sample()
    busy = 1 - (idle_after - idle) / max(1, total_after - total)
    return max(1, cores - round(busy * (os.cpu_count() or cores)))


@dataclass
class _Running:
    run: SweepRun
    process: subprocess.Popen
    started: float
    total_steps: int | None
    #: The step its log held when first read: a resumed run's earlier life, which its rate does not count.
    logged_before: int | None = None
    #: (seconds, step) when a step of its own was first seen: the step rate is measured from there, past the run's
    #: start-up (a resumed run's old steps, seen at once, took its start-up into the rate: 3 steps/s for 30).
    first_seen: tuple[float, int] | None = None
    #: Steps a second at the last reading (None until the run has moved past its first seen step).
    rate: float | None = None


class RunFailed(ValueError):
    """A run of the sweep failed (its log says why); one line."""


#: Seconds between two readings of the running runs' steps. The first progress line comes once every running run's
#: step rate is measured (a few seconds past its first step), the next ones every ``report_every``.
MEASURE_EVERY = 2.0


def run_here(sweep: Sweep, *, parallel: int = 1, threads: int | None = None, report_every: float = 30.0,
             command: str = "sweep", say: Callable[[str], None] | None = None,
             python: Sequence[str] = (sys.executable, "-m", "nemo_jq.cli")) -> None:
    """Run the sweep's unfinished runs on this machine, ``parallel`` at a time with ``threads`` threads each (see the
    module docstring); the lines name ``nemo-jq command`` (whose ``--resume`` continues the sweep). Raises
    :class:`~nemo_jq.runtime.preemption.Stopped` after a stop signal, or :class:`RunFailed` naming a run that failed
    and its log (the runs already running finish first; no further one starts). The sweep's folder is held all the
    while: another `--resume` or `--overwrite` of it is refused."""
    say = say or (lambda line: print(line, flush=True))
    refuse_running(sweep, command)
    hold_run_dir(sweep.directory, RUNS_LOCK)  # all along: between runs, or as one starts, no run holds one
    # (`sweep --overwrite` moved a running sweep aside, its runs then landing in the new one's folder)
    try:
        _run_all(sweep, parallel, threads, report_every, command, say, python)
    finally:
        release_run_dir(sweep.directory)


def _run_all(sweep: Sweep, parallel: int, threads: int | None, report_every: float, command: str,
             say: Callable[[str], None], python: Sequence[str]) -> None:
    """:func:`run_here`'s work, while it holds the sweep's folder."""
    from nemo_jq.runtime.preemption import STOP_WITH_ENV, Stopped, release_terminal, signal_name, stop_signals_here

    threads = threads or max(1, free_cores() // parallel)
    states = {run.name: sweep.status(run) for run in sweep.runs}
    pending = [run for run in sweep.runs if states[run.name] != FINISHED]
    # a run that failed goes last (before it saved a checkpoint, or after: sweep.json's here.failed), so that one whose
    # own settings fail, at its start or at a later step, does not block the others
    pending.sort(key=lambda run: run.name in sweep.here.get("failed", []) or failed_start(sweep.directory / run.name))
    counts = {state: list(states.values()).count(state) for state in (FINISHED, STOPPED, NEW)}
    logs = sweep.directory / LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    steps = {run.name: total_steps(run, sweep.directory) for run in pending}
    say(f"nemo-jq {command}: {len(sweep.runs)} runs in {sweep.directory} ({counts[FINISHED]} finished, {counts[STOPPED]} to "
        f"continue, {counts[NEW]} to start{steps_words(steps)}), {parallel} at a time with {threads} "
        f"thread{'s' * (threads > 1)} each; each run's output in {logs}/NAME.log")
    number = {run.name: index + 1 for index, run in enumerate(sweep.runs)}
    running: list[_Running] = []
    took: list[float] = []  # seconds each run that finished here took, start-up and evaluations included
    received: list[int] = []
    failed: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            release_terminal()
        received.append(signum)
        for entry in running:  # each run its own signal, once per signal the sweep gets (a second one stops it now)
            entry.process.send_signal(signum)

    def on_suspend(signum: int, _frame: Any) -> None:
        """Ctrl-Z: the runs (sessions of their own, which the terminal's SIGTSTP does not reach) stop with the sweep,
        freeing the cores, and go on with it after ``fg`` / ``bg`` (SIGCONT)."""
        for entry in running:
            entry.process.send_signal(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped here until SIGCONT (SIGTSTP itself is dropped where no terminal waits)
        for entry in running:
            entry.process.send_signal(signal.SIGCONT)

    handlers = {sig: signal.signal(sig, on_signal) for sig in stop_signals_here() if sig != signal.SIGUSR1}
    if signal.getsignal(signal.SIGTSTP) is signal.SIG_DFL:
        handlers[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, on_suspend)
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                   STOP_WITH_ENV: str(os.getpid())}
    next_report, next_measure, reported = time.monotonic() + report_every, 0.0, False
    try:
        while (pending and not received and not failed) or running:
            while pending and len(running) < parallel and not received and not failed:
                run = pending.pop(0)
                log = open(logs / f"{run.name}.log", "a")  # noqa: SIM115 - the child writes it; closed when it ends
                process = subprocess.Popen([*python, *run.train_words(sweep.directory)], stdout=log,
                                           stderr=subprocess.STDOUT, env=environment, start_new_session=True)
                log.close()
                running.append(_Running(run, process, time.monotonic(), steps[run.name]))
                say(f"run {number[run.name]}/{len(sweep.runs)} {run.name}: "
                    f"{'continuing' if states[run.name] == STOPPED else 'started'}")
            time.sleep(0.2)
            for entry in [entry for entry in running if entry.process.poll() is not None]:
                running.remove(entry)
                finished = _ended(sweep, entry, number, len(sweep.runs), say, failed, stopping=bool(received))
                if finished and states[entry.run.name] == NEW:  # a whole run's time (a continued one's is part of it)
                    took.append(time.monotonic() - entry.started)
            if running and time.monotonic() >= next_measure:  # each run's first step, seen soon: its rate is from there
                next_measure = time.monotonic() + MEASURE_EVERY
                for entry in running:
                    _measure(sweep, entry, time.monotonic())
            measured = not reported and all(entry.rate for entry in running)
            if running and (measured or time.monotonic() >= next_report):
                next_report, reported = time.monotonic() + report_every, True
                say(progress_line(sweep, running, pending, parallel, took))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if received:
        left = [run.name for run in sweep.runs if sweep.status(run) != FINISHED]
        raise Stopped(received[0], f"nemo-jq {command}: stopped by {signal_name(received[0])}; {len(left)} of "
                                   f"{len(sweep.runs)} runs unfinished ({', '.join(left)}), each kept with its checkpoint "
                                   f"where it had one; `nemo-jq {command} --resume {sweep.directory}` continues them")
    if failed:
        raise RunFailed(f"{'; '.join(failed)}; the others are kept: fix it and `nemo-jq {command} "
                        f"--resume {sweep.directory}` goes on, the runs that have not failed first (a run whose own "
                        "swept value fails every time is left out by a new sweep without that value)")


def refuse_running(sweep: Sweep, command: str) -> None:
    """A sweep another process runs now (a run of it held): a second start's runs would fail one by one."""
    if held := held_runs_in(sweep.directory):
        folder, holder = held[0]
        raise RunDirInUse(f"{folder} is in use by another run ({holder}): {sweep.directory} is being run already; wait "
                          f"for it to end (or stop it) before `nemo-jq {command} --resume {sweep.directory}`")


def _ended(sweep: Sweep, entry: _Running, number: dict[str, int], total: int, say: Callable[[str], None],
           failed: list[str], *, stopping: bool) -> bool:
    """Say how a run's process ended: finished (its results written: True), stopped with a checkpoint, or failed."""
    run, code = entry.run, entry.process.returncode
    took = duration(time.monotonic() - entry.started)
    state = sweep.status(run)
    if state == FINISHED:
        _list_failed(sweep, run.name, False)
        say(f"run {number[run.name]}/{total} {run.name}: finished in {took}")
    elif stopping or code == 0:
        if not stopping:  # it went on (a stop signal's end says nothing of it)
            _list_failed(sweep, run.name, False)
        say(f"run {number[run.name]}/{total} {run.name}: stopped after {took} "
            f"({'with a checkpoint' if state == STOPPED else 'before its first checkpoint'})")
    else:
        _list_failed(sweep, run.name, True)
        log = sweep.directory / LOGS_DIR / f"{run.name}.log"
        failed.append(f"run {run.name} failed (exit {code}); its output: {log}")
        say(f"run {number[run.name]}/{total} {run.name}: FAILED (exit {code}), see {log}")
    return state == FINISHED


def _list_failed(sweep: Sweep, name: str, failed: bool) -> None:
    """Put run ``name`` in ``sweep.json``'s ``here.failed`` (what a resume starts last), or take it out, as ``failed``
    says; saved where that changes it."""
    listed = set(sweep.here.get("failed", []))
    if (name in listed) != failed:
        sweep.here["failed"] = sorted(listed ^ {name})
        sweep.save()


def steps_words(steps: dict[str, int | None]) -> str:
    """``; 96 steps each`` or ``; 96 to 768 steps a run``, of the runs to run (nothing where none is known)."""
    known = sorted({count for count in steps.values() if count})
    if not known:
        return ""
    return f"; {known[0]} steps each" if len(known) == 1 else f"; {known[0]} to {known[-1]} steps a run"


def total_steps(run: SweepRun, sweep_dir: Path, replicas: int = 1) -> int | None:
    """The run's steps as its config gives them (:func:`steps_of`) over ``replicas``; None where the config leaves the
    split's size to the data."""
    from nemo_jq.config import load_config

    try:
        config = load_config(run.config_file(sweep_dir), list(run.overrides))
    except Exception:  # noqa: BLE001 - the run itself reports a bad config, in its log
        return None
    return steps_of(config, replicas)


def steps_of(config: Any, replicas: int = 1) -> int | None:
    """A config's optimizer steps over ``replicas`` (data-parallel), as its trainer counts them: ``train.max_steps``,
    or the epochs over ``data.train_size`` prompts in batches (None where the config leaves the split's size to the
    data)."""
    train, size = config.train, config.data.train_size
    epochs = train.epochs * batches_per_epoch(size, train.batch_size, replicas) if size else None
    return min(filter(None, [epochs, train.max_steps]), default=None)


def progress_line(sweep: Sweep, running: list[_Running], pending: list[SweepRun], parallel: int,
                  took: Sequence[float] = ()) -> str:
    """The running runs' steps and time left at the step rate measured so far, and the sweep's: the longest running
    run's, then the pending runs, ``parallel`` at once, each as long as the runs that finished here took (start-up and
    evaluations included), or before any has, as the running runs' steps at their rates."""
    now, parts, lefts, wholes = time.monotonic(), [], [], []
    for entry in running:
        step, rate = _measure(sweep, entry, now)
        text = f"{entry.run.name} step {step}" + (f"/{entry.total_steps}" if entry.total_steps else "")
        if rate and entry.total_steps:
            lefts.append((entry.total_steps - step) / rate)
            wholes.append(entry.total_steps / rate)
            text += f" ({rate:.1f} steps/s, {duration(lefts[-1])} left)"
        parts.append(text)
    line = "sweep: " + "; ".join(parts)
    wholes = list(took) or wholes
    if lefts and wholes:
        left = max(lefts) + sum(wholes) / len(wholes) * math.ceil(len(pending) / parallel)
        line += f"; about {duration(left)} left in all"
    return line


def _measure(sweep: Sweep, entry: _Running, now: float) -> tuple[int, float | None]:
    """A running run's last logged step and its steps a second since a step was first seen (None until it moves); the
    rate is kept on the entry."""
    records = [record for record in read_metrics(sweep.directory / entry.run.name) if record.get("kind") == "train"]
    step = records[-1]["step"] if records else 0
    if entry.logged_before is None:
        entry.logged_before = step
    if step > entry.logged_before and entry.first_seen is None:
        entry.first_seen = (now, step)
    if entry.first_seen is not None and step > entry.first_seen[1]:
        entry.rate = (step - entry.first_seen[1]) / (now - entry.first_seen[0])
    return step, entry.rate
