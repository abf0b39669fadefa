"""What the experiments share: their run folders' names, the checks of their options and overrides that must pass
before anything is written or trained (a run that fails halfway leaves a half-built experiment), and their record
(:class:`Progress`), which ``--resume`` continues from."""

from __future__ import annotations

import contextlib
import json
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from nemo_jq.config import Config, ConfigError, current_key
from nemo_jq.runtime.monitor import nonfinite_back, read_json_file, valid_json
from nemo_jq.runtime.outputs import claim_dir, refuse_foreign_files
from nemo_jq.runtime.preemption import current_series
from nemo_jq.runtime.runs import RUN_FILES, holds_a_run, holds_this_run, run_above
from nemo_jq.runtime.sweep import EXPERIMENT_FILE, SWEEP_FILE, refuse_repeats
from nemo_jq.strict_yaml import parse_yaml

#: An experiment's record in its folder (:class:`Progress`).
PROGRESS_FILE = EXPERIMENT_FILE
Entry = TypeVar("Entry")

#: The keys every experiment sets for each run itself, after the user's overrides: key -> (what sets it, the option to
#: use instead, None where there is none). An override of one would be ignored, yet recorded among the settings.
PER_RUN = {"objective.name": ("per method", "--methods"), "objective.q": ("per method", "--methods"),
           "objective.q_schedule": ("per method", "--methods"), "train.seed": ("per seed", "--seeds"),
           "train.run_dir": ("per run, in a folder under --out", "--out")}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in ".=" else "_" for c in name).strip("_")


def chosen_methods(plan: dict[str, list[str]], only: Sequence[str]) -> dict[str, list[str]]:
    """The methods of ``plan`` that ``only`` (``--methods``) names, in the plan's order; all of them if it names none."""
    if any(not name.strip() for name in only):
        raise ConfigError(f"--methods: an empty name (a comma too many?); choose from {', '.join(map(repr, plan))}")
    refuse_repeats("--methods", only)
    unknown = sorted(set(only) - set(plan))
    if unknown:
        raise ConfigError(f"--methods: unknown method(s) {', '.join(map(repr, unknown))}; choose from {', '.join(map(repr, plan))}")
    return {name: overrides for name, overrides in plan.items() if not only or name in only}


def refuse_per_run_keys(experiment: str, overrides: Sequence[str], per_run: dict[str, tuple[str, str | None]],
                        given_as: str = "override") -> None:
    """An override that sets a key of ``per_run`` (:data:`PER_RUN` and the experiment's own), itself or inside a
    section's mapping (``train={seed: 3}``), is refused: each run would set that key over it."""
    for item in overrides:
        key, _, value = item.partition("=")
        try:
            parsed = parse_yaml(value, f"override {item!r}")
        except ConfigError:  # load_config refuses it, with its own advice
            parsed = None
        for given in keys_set(current_key(key), parsed):
            for controlled, (source, option) in per_run.items():
                if given == controlled or given.startswith(f"{controlled}."):
                    raise ConfigError(f"{given_as} {item}: experiment {experiment} sets {controlled} {source}: "
                                      + (f"use {option} instead" if option else "drop it"))


def keys_set(key: str, value: Any) -> list[str]:
    """The dotted keys an override of ``key`` with ``value`` sets: a section's mapping sets each key in it."""
    if isinstance(value, dict):
        return [leaf for name, inner in value.items() for leaf in keys_set(f"{key}.{name}", inner)]
    return [key]


#: Whether this command's experiment has begun its record (:meth:`Progress.begin`): an error before it is in the
#: options, which each experiment checks first.
_BEGUN: ContextVar[bool] = ContextVar("experiment_begun", default=False)


@contextlib.contextmanager
def recorded_options(record: Path) -> Iterator[None]:
    """A resumed experiment's options come from its ``record``: an error in loading them (the record edited, or a
    plugin, package or data folder they name changed since) is said naming it, not as if given on the command line;
    an error once its runs go on is theirs, as it is."""
    token = _BEGUN.set(False)
    try:
        yield
    except ValueError as err:  # ConfigError is one
        if _BEGUN.get():
            raise
        raise ConfigError(f"the options {record} records no longer load ({err}): fix what changed since the "
                          "experiment started (the record itself, or a plugin, package or data folder they name), or "
                          "start the experiment again with --out NEW_DIR") from None
    finally:
        _BEGUN.reset(token)


@dataclass
class Progress:
    """An experiment's record (``OUT/experiment.json``): the options it started with, and each finished run's entry
    (what the experiment keeps of it) as the run ends. ``nemo-jq experiment NAME --resume OUT`` starts the experiment
    again with those options: a recorded run is read back, not trained; the run a stop left continues from its
    checkpoint (:func:`start_run`); the others train."""

    out_dir: Path
    experiment: str
    options: dict[str, Any]
    runs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def begin(cls, out_dir: Path, experiment: str, options: dict[str, Any], *, markers: tuple[str, ...],
              overwrite: bool, resume: bool) -> Progress:
        """The record of an experiment starting in ``out_dir`` (an earlier one there, or any of ``markers``, is
        refused, or moved aside with ``overwrite``), or with ``resume`` the record there."""
        out_dir = Path(out_dir)
        _BEGUN.set(True)
        if resume:
            return cls.read(out_dir, experiment)
        if (above := run_above(out_dir)) is not None:  # before anything is written: nothing lands in that run
            raise ConfigError(f"--out {out_dir} is inside the run {above[0]} ({above[1]}), whose folder is its own: "
                              f"choose an --out outside it (e.g. {above[0].parent / out_dir.name})")
        try:
            held = json.loads((out_dir / PROGRESS_FILE).read_text())["experiment"]
        except (OSError, ValueError, TypeError, KeyError):
            held = None
        again = f"continue it with `nemo-jq experiment {held} --resume {out_dir}`, " if isinstance(held, str) else ""
        # a folder named as a method's runs are counts where it holds a run (a user's own ``SGD/`` is not one)
        markers = tuple(name for name in markers if not (out_dir / name).is_dir() or holds_a_run(out_dir / name))
        claim_dir(out_dir, (PROGRESS_FILE, *markers), overwrite=overwrite, what="an earlier experiment",
                  advice=f"{again}pass --out DIR for a new one, or --overwrite to move it aside first")
        claim_dir(out_dir, (SWEEP_FILE, *RUN_FILES), overwrite=overwrite, what="a sweep or a run", advice="an "
                  "experiment's runs go in a folder of their own: choose another, or pass --overwrite to move it aside first")
        refuse_foreign_files(out_dir, "experiment")
        out_dir.mkdir(parents=True, exist_ok=True)
        progress = cls(out_dir, experiment, options)
        progress.write()
        return progress

    @classmethod
    def read(cls, out_dir: Path, experiment: str) -> Progress:
        """The record in ``out_dir``: a folder without one, another experiment's, or one edited is one line."""
        path = Path(out_dir) / PROGRESS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{out_dir} holds no experiment to resume ({PROGRESS_FILE}): give the --out folder "
                                    "of an experiment that was stopped")
        saved = read_json_file(path, "an experiment's record", _record_problem, "restore it, or start the experiment "
                               "again with --out NEW_DIR", decode=nonfinite_back)
        if saved["experiment"] != experiment:
            raise ConfigError(f"{out_dir} holds experiment {saved['experiment']}, not {experiment}: `nemo-jq experiment "
                              f"{saved['experiment']} --resume {out_dir}` continues it")
        return cls(Path(out_dir), experiment, saved["options"], saved["runs"])

    def run(self, run_dir: Path, train: Callable[[], Entry]) -> Entry:
        """The entry of the run in ``run_dir``: the recorded one, or ``train()``'s, recorded. Either way as JSON reads
        it back, so an experiment resumed sums up what an unstopped one would."""
        key, series = Path(run_dir).relative_to(self.out_dir).as_posix(), current_series()
        if key not in self.runs:
            if series is not None and series.stop.received:  # came as the last run ended
                raise series.stopped_before(run_dir)
            self.runs[key] = nonfinite_back(json.loads(valid_json(train())))
            self.write()
            if series is not None:
                series.finished.append(Path(run_dir))
        return self.runs[key]

    def write(self) -> None:
        path = self.out_dir / PROGRESS_FILE
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(valid_json({"experiment": self.experiment, "options": self.options, "runs": self.runs},
                                      indent=1) + "\n")
        os.replace(partial, path)  # a stop while it is written leaves the record before it


def _record_problem(saved: dict[str, Any]) -> str | None:
    for key, kind in (("experiment", str), ("options", dict), ("runs", dict)):
        if not isinstance(saved.get(key), kind):
            return f"no {key} {kind.__name__}"
    seeds = saved["options"].get("seeds")  # every experiment's; each run's seed, used once its runs go on
    if not isinstance(seeds, list) or not all(isinstance(seed, int) and not isinstance(seed, bool) for seed in seeds):
        return f"options.seeds is {seeds!r}, not a list of whole numbers"
    return None


def start_run(config: Config, *, continues: bool = True) -> Any:
    """The trainer of one of an experiment's runs. Where its folder holds the run already (an experiment resumed), it
    continues from its checkpoint if ``continues`` (False: the run measures along the way, in memory, so it starts
    again); a start of it without a checkpoint, or not continued, is moved aside and the run starts anew."""
    from nemo_jq.cluster.rows import rows_on_this_machine
    from nemo_jq.recipe.trainer import Trainer

    held, _ = holds_this_run(config)
    if held == "resume" and continues:
        return Trainer.resume(config.train.run_dir, rows_for=rows_on_this_machine)
    return Trainer(config, overwrite=held != "new", rows_for=rows_on_this_machine)
