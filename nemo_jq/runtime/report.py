"""The paper's tables and curves from finished runs, as each recorded them (``results.json``, ``metrics.jsonl``).

``nemo-jq report RUNS_OR_SWEEPS...`` groups the runs by dataset, prompt format and method (the estimator and its q, or
its q schedule; the seeds of one setting are one group; runs of a method whose configs differ in more than their seeds
are groups of their own, each labelled with the settings that tell it apart), and gives each group's test scores (its
best-validation checkpoint's, as ``results.json`` recorded them: nothing is evaluated again) as the mean and a 95%
t-interval over the seeds, with n. A run whose validation m@k falls to zero after its best is flagged (*peak before
collapse*, as the paper marks GARL on HotPotQA): its test scores are its peak's. Tables as markdown, CSV and JSON; the
curves (log P̂ with log(1/M) marked, validation m@k with the seeds' range, the train reward smoothed, q) one figure per
dataset.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jq.runtime.monitor import line_style, nonfinite_back, read_json_file, read_metrics, valid_json
from nemo_jq.runtime.outputs import MOVED_ASIDE
from nemo_jq.runtime.runs import CONFIG_FILE, RESULTS_FILE, UNSEEN_KEYS, has_finished, metric_keys, results_problem
from nemo_jq.runtime.sweep import FINISHED, SWEEP_FILE, Sweep


@dataclass
class RunRecord:
    """One finished run, as the report reads it."""

    run_dir: Path
    dataset: str
    format: str
    method: str
    seed: int
    samples: int
    results: dict[str, Any]
    records: list[dict[str, Any]]
    #: What it was trained and tested with (:func:`settings`): runs that differ in any of it are rows of their own.
    settings: dict[str, str]

    @property
    def collapsed_after_peak(self) -> bool:
        """Its validation m@k reached a best above zero, then ended at zero."""
        key = validation_key(self.records)
        values = [record[key] for record in self.records if record["kind"] == "validation" and key in record]
        return bool(values) and max(values) > 0 and values[-1] == 0


def validation_key(records: list[dict[str, Any]]) -> str:
    """The m@k key a run's validations logged (the largest k)."""
    keys = {key for record in records if record["kind"] == "validation" for key in record if key.startswith("m@")}
    return max(keys, key=lambda key: int(key[2:]), default="m@16")


def method_label(results: dict[str, Any]) -> str:
    """``GARL q=0.5``, ``PAFT q linear(start=1.0, end=0.5)``, ``GRPO``: the estimator and its q as the run recorded
    them."""
    objective = results["objective"]
    name = objective.upper() if "_" not in objective else objective
    if results.get("q_schedule"):
        schedule = dict(results["q_schedule"])
        kind = schedule.pop("name", "schedule")
        return f"{name} q {kind}({', '.join(f'{key}={_whole_numbers(value)}' for key, value in schedule.items())})"
    return f"{name} q={results['q']:g}" if results.get("q") is not None else name


#: Keys runs of one row differ in: their seeds (the training's, and the data split's, which the experiments draw with
#: it), each run's own folder, and what changes nothing a run computes (where it is saved, its layout, its trackers).
NOT_SETTINGS = ("train.seed", "data.seed", "train.run_dir", *UNSEEN_KEYS)


def settings(config: Any) -> dict[str, str]:
    """A run's config as ``key -> value`` text (``optim.lr -> 0.001``, as the typed config read it), less
    :data:`NOT_SETTINGS` and the keys it does not read (GRPO's ``objective.q``): runs alike in all of it are seeds of
    one setting."""
    from nemo_jq.config import unread_keys
    from nemo_jq.runtime.tracking import flat_config

    unread = {key for key, _ in unread_keys(config)}
    return {key: value if isinstance(value, str) else json.dumps(_whole_numbers(value))
            for key, value in flat_config(config).items() if key not in NOT_SETTINGS and key not in unread}


def _whole_numbers(value: Any) -> Any:
    """A mapping's or list's whole floats as ints (a q schedule's ``q_start: 1.0`` is its ``q_start: 1``: the typed
    config makes a float key's value a float, but a schedule's mapping is kept as written)."""
    if isinstance(value, dict):
        return {key: _whole_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(item) for item in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


def told_apart(runs: list[RunRecord]) -> list[RunRecord]:
    """The runs, each labelled (its ``method``) with the settings that tell it from the others of its dataset, format,
    method and metrics (``GRPO optim.lr=0.001``, ``GRPO optim.lr=0.05``): a row each, where runs alike but for their
    seeds share one. Runs alone in their group keep their method's label."""
    groups: dict[tuple[str, str, str, frozenset[str]], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault(_group(run), []).append(run)
    differing = {key: [setting for setting in dict.fromkeys(name for run in members for name in run.settings)
                       if len({run.settings.get(setting) for run in members}) > 1]
                 for key, members in groups.items()}
    return [dataclasses.replace(run, method=" ".join([run.method, *(f"{setting}={run.settings[setting]}"
                                                                    for setting in differing[_group(run)]
                                                                    if setting in run.settings)]))
            for run in runs]


def _group(run: RunRecord) -> tuple[str, str, str, frozenset[str]]:
    """What a table row of runs shares, besides their settings: dataset, prompt format, method and test metrics."""
    return run.dataset, run.format, run.method, frozenset(metric_keys(run.results["test"]))


def run_dirs(paths: list[Path]) -> list[Path]:
    """The run folders under ``paths``: a sweep's runs (its ``sweep.json`` order), a run folder itself, or the runs and
    sweeps anywhere below a folder (an experiment's ``<method>/seed<S>``; not in a folder ``--overwrite`` moved aside,
    ``NAME.old-<time>``, unless given), in name order; a path with none is an error naming it. A run found twice (a
    sweep, and one of its runs given too; a link to a folder already searched) is read once."""
    found: dict[Path, Path] = {}
    for path in map(Path, paths):
        below = _runs_in(path, set())
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist: give run folders, sweep folders or a folder of runs")
        if not below:
            raise FileNotFoundError(f"{path} holds no run ({CONFIG_FILE}) or sweep ({SWEEP_FILE}): give run folders, "
                                    "sweep folders or a folder of runs")
        for run_dir in below:
            found.setdefault(run_dir.resolve(), run_dir)
    return list(found.values())


def _runs_in(path: Path, searched: set[Path]) -> list[Path]:
    """The runs at or below ``path``; a folder in ``searched`` (reached again through a link) is not searched again."""
    if (path / SWEEP_FILE).exists():
        return [path / run.name for run in Sweep.load(path).runs]
    if (path / CONFIG_FILE).exists():
        return [path]
    if not path.is_dir() or path.resolve() in searched:
        return []
    searched.add(path.resolve())
    return [run for child in sorted(path.iterdir()) if child.is_dir() and not MOVED_ASIDE.search(child.name)
            for run in _runs_in(child, searched)]


def read_run(run_dir: Path) -> RunRecord | None:
    """A finished run's record (None: unfinished, as the sweep decides: no ``results.json`` yet, or one older than
    the run's last checkpoint, a run resumed to train on)."""
    from nemo_jq.config import ConfigError, PluginGone, load_config

    if not (run_dir / RESULTS_FILE).exists():
        return None
    try:
        config = load_config(run_dir / CONFIG_FILE, saved=True)
    except PluginGone as err:  # the config is as the run wrote it
        raise ConfigError(f"{run_dir}: {err}") from None
    except ConfigError as err:  # its own error names the file
        raise ConfigError(f"{run_dir / CONFIG_FILE} is not the run's saved config "
                          f"({str(err).removeprefix(f'{run_dir / CONFIG_FILE}: ')}): restore it from a copy of the run, "
                          "or leave the run out") from None
    results = read_json_file(run_dir / RESULTS_FILE, "a finished run's results", results_problem,
                             f"restore it, or move it aside and `nemo-jq train --resume {run_dir}` writes it again",
                             decode=nonfinite_back)
    if not has_finished(run_dir, results) or _sweep_goes_on(run_dir):
        return None
    return RunRecord(run_dir, config.data.name, config.data.format, method_label(results), config.train.seed,
                     config.rollout.num_samples, results, read_metrics(run_dir), settings(config))


def _sweep_goes_on(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a run of the sweep around it that the sweep has given more steps since its results
    (``sweep --resume DIR train.max_steps=...`` stopped before this run went on): unfinished, as the sweep decides."""
    if not (run_dir.parent / SWEEP_FILE).exists():
        return False
    sweep = Sweep.load(run_dir.parent)
    run = next((run for run in sweep.runs if run.name == run_dir.name), None)
    return run is not None and sweep.status(run) != FINISHED


def seed_stats(values: list[float | None]) -> dict[str, float | int | None]:
    """Over the seeds' values (a None left out: a seed that never got there): the mean, the sample sd, n, and ``ci95``,
    the half-width of the 95% Student-t interval (sd and ci95 None for one value: one seed shows no spread). The
    report's tables and the experiments' (noisy-cold-start, escape-rates, warm-start) all read it."""
    from scipy import stats

    present = [value for value in values if value is not None]
    n = len(present)
    if not n:
        return {"mean": None, "sd": None, "n": 0, "ci95": None}
    if n == 1:
        return {"mean": present[0], "sd": None, "n": 1, "ci95": None}
    sd = statistics.stdev(present)
    return {"mean": statistics.mean(present), "sd": sd, "n": n, "ci95": float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)}


def mean_sd(stats: dict[str, Any], style: str = ".1f") -> str:
    """``mean ± sd`` of :func:`seed_stats` (the mean alone for one seed), in ``style``."""
    return f"{stats['mean']:{style}}" + ("" if stats["sd"] is None else f" ± {stats['sd']:{style}}")


def table(runs: list[RunRecord]) -> list[dict[str, Any]]:
    """A row per dataset, format, method (as :func:`told_apart` labels the runs: a setting each) and set of test
    metrics (runs evaluated at another k are another row), in the order the runs come: each test metric's mean and
    interval half width over its seeds (None where no seed has it; ``KEY n``, the seeds that have it, where some lack
    it), n, the seeds, and how many runs collapsed after their peak. Runs of a row that share a seed are said: each counts."""
    groups: dict[tuple[str, str, str, frozenset[str]], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault(_group(run), []).append(run)
    rows = []
    for (dataset, fmt, method, _), members in groups.items():
        seeds = sorted(run.seed for run in members)
        for seed in sorted({seed for seed in seeds if seeds.count(seed) > 1}):
            alike = ", ".join(str(run.run_dir) for run in members if run.seed == seed)
            print(f"nemo-jq: warning: {alike} ({method}, {dataset}) share train.seed={seed}: each is counted as a seed "
                  "of its own", file=sys.stderr)
        row = {"dataset": dataset, "format": fmt, "method": method, "n": len(members), "seeds": seeds,
               "collapsed_after_peak": sum(run.collapsed_after_peak for run in members),
               # runs whose validation never rose above 0 test their latest checkpoint (results.json's "tested")
               "tested_latest": sum(run.results.get("best_step") is None for run in members)}
        for key in metric_keys(members[0].results["test"]):
            spread = seed_stats([run.results["test"][key] for run in members])
            row[key], row[f"{key} ±"] = (None if spread[part] is None else round(spread[part], 2) for part in ("mean", "ci95"))
            if 0 < spread["n"] < len(members):  # a score some seeds lack: its mean is over the others
                row[f"{key} n"] = spread["n"]
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """A table per dataset, format and set of metrics: each metric as ``mean ± half-width`` (percent; 95% t-interval
    over n seeds; a dash where no seed has it, "(k of n)" where only k seeds have it); a dagger where runs collapsed
    after their peak."""
    out = []
    for (dataset, fmt, _), members in _by_setting(rows).items():
        metrics = metric_keys(members[0])
        latest = sum(row.get("tested_latest", 0) for row in members)
        tested = ("best-validation checkpoint" if not latest else "latest checkpoint: no validation rose above 0"
                  if latest == sum(row["n"] for row in members) else
                  "best-validation checkpoint, or the latest where no validation rose above 0")
        out += [f"### {dataset}, {fmt} start (test, {tested}; mean ± 95% t-interval over n seeds)", "",
                "| method | n | " + " | ".join(metrics) + " |", "| --- " * (len(metrics) + 2) + "|"]
        for row in members:
            cells = ["—" if row[key] is None else f"{row[key]:.1f}" + (
                f" ± {row[key + ' ±']:.1f}" if row[f"{key} ±"] is not None else "") + (
                f" ({row[key + ' n']} of {row['n']})" if f"{key} n" in row else "") for key in metrics]
            flag = f" † ({row['collapsed_after_peak']}/{row['n']})" if row["collapsed_after_peak"] else ""
            out.append(f"| {row['method']}{flag} | {row['n']} | " + " | ".join(cells) + " |")
        out.append("")
    if any(row["collapsed_after_peak"] for row in rows):
        out.append("† peak before collapse: validation fell to zero after its best (the scores are the peak's); "
                   "(runs flagged / n)")
    return "\n".join(out).rstrip() + "\n"


#: How the CSV and JSON tables begin: a report replaces an existing file only where it begins so (an earlier one).
CSV_START, JSON_START = "dataset,format,method,n,seeds,", '{\n "rows": ['


def json_text(result: dict[str, Any]) -> str:
    return valid_json(result, indent=1) + "\n"


def csv_text(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows({**row, "seeds": " ".join(map(str, row["seeds"]))} for row in rows)
    return buffer.getvalue()


def _by_setting(rows: list[dict[str, Any]]) -> dict[tuple[str, str, frozenset[str]], list[dict[str, Any]]]:
    grouped: dict[tuple[str, str, frozenset[str]], list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["dataset"], row["format"], frozenset(metric_keys(row))), []).append(row)
    return grouped


def smoothed(values: list[float], window: int = 10) -> list[float]:
    """A trailing mean over ``window`` values."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def curve_lines(runs: list[RunRecord]) -> dict[str, list[RunRecord]]:
    """One dataset's runs by line of its figure: a line per table row (:func:`table`), labelled by its method (as
    :func:`told_apart` labels it), and by its prompt format and its k where the dataset's rows differ in them."""
    rows: dict[tuple[str, str, str, frozenset[str]], list[RunRecord]] = {}
    for run in runs:
        rows.setdefault(_group(run), []).append(run)
    formats, metric_sets = {key[1] for key in rows}, {key[3] for key in rows}

    def label(key: tuple[str, str, str, frozenset[str]]) -> str:
        ks = sorted({int(name.split("@")[1]) for name in key[3] if "@" in name and name.split("@")[1].isdigit()})
        return " ".join([key[2], *([key[1]] if len(formats) > 1 else []),
                         *([f"k={ks[-1]}"] if len(metric_sets) > 1 and ks else [])])

    return {label(key): members for key, members in rows.items()}


def plot_dataset(runs: list[RunRecord], path: Path) -> None:
    """One dataset's curves, a colour per line (:func:`curve_lines`: a table row each), each the mean over its seeds
    and the band their range: log P̂ (log(1/M) dashed), validation m@k, the train reward smoothed (P̂ for GARL/PAFT,
    the sampled reward otherwise), q. The legend stands beside the panels, whatever the labels' length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = curve_lines(runs)
    keys = {validation_key(run.records) for run in runs}  # each line its own runs' m@k (a row holds one k)
    title = f"validation {keys.pop()}" if len(keys) == 1 else "validation m@k (each line's k)"
    panels = [("log P̂", "train", "log_p_hat", False), (title, "validation", None, False),
              ("train reward (smoothed)", "train", None, True), ("q", "train", "q", False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6))
    for color, (method, members) in enumerate(methods.items()):
        for ax, (title, kind, field, smooth) in zip(axes, panels):
            curves = [_curve(run.records, kind, validation_key(run.records) if kind == "validation" else field, smooth)
                      for run in members]
            curves = [curve for curve in curves if curve[0]]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(steps) for steps, _ in curves)))
            if not steps:
                continue
            at = [dict(zip(*curve)) for curve in curves]
            values = [[point[step] for point in at] for step in steps]
            ax.plot(steps, [sum(v) / len(v) for v in values], **line_style(color), label=method,
                    marker="o" if kind == "validation" else None, ms=3)
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line_style(color)["color"], alpha=0.2)
    for samples in sorted({run.samples for run in runs}):  # log(1/M) of each M the runs sampled
        axes[0].axhline(math.log(1 / samples), color="grey", linestyle="--", linewidth=1)
        axes[0].annotate(f"log(1/{samples})", (1, math.log(1 / samples)), xycoords=("axes fraction", "data"),
                         ha="right", va="bottom", fontsize=7, color="grey")
    for ax, (title, *_rest) in zip(axes, panels):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], **line_style(color), label=textwrap.fill(method, 48))
               for color, method in enumerate(methods)]
    handles.append(plt.Line2D([], [], color="grey", linestyle="--", linewidth=1, label="log(1/M)"))
    fig.suptitle(f"{runs[0].dataset}: mean over seeds, band: their range", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": FIGURE_MARK})
    plt.close(fig)


#: What a figure of report's says it is (its PNG ``Software`` text): a report writes over such a file, and no other.
FIGURE_MARK = "nemo-jq report"


def refuse_foreign_figure(path: Path) -> None:
    """Before any figure is written: ``path`` holds nothing a user would lose (nothing, or a figure report wrote). A
    sweep's own folder is not asked (``sweep --out`` takes no folder of a user's files): its figures, written before
    they carried the mark, are the sweep's."""
    if path.exists() and (path.is_dir() or FIGURE_MARK.encode() not in path.read_bytes()):
        raise FileExistsError(f"{path} exists and is not a figure nemo-jq report wrote: give the figures another folder "
                              "(that file is left as it is)")


def _curve(records: list[dict[str, Any]], kind: str, field: str | None, smooth: bool) -> tuple[list[int], list[float]]:
    """A run's (steps, values) of ``field`` in ``kind`` records; the train reward where ``field`` is None: P̂ where the
    estimator logs it, else the sampled reward."""
    chosen = [record for record in records if record["kind"] == kind]
    if field is None:
        field = "p_hat" if any("p_hat" in record for record in chosen) else "reward"
    points = [(record["step"], record[field]) for record in chosen if record.get(field) is not None]
    steps, values = [step for step, _ in points], [value for _, value in points]
    return steps, smoothed(values) if smooth else values


def report(paths: list[Path], *, figures: Path | None = None) -> dict[str, Any]:
    """The table rows of the finished runs under ``paths``, the runs not finished (listed, not counted), and the
    figures written under ``figures`` (one per dataset: ``curves_<dataset>.png``)."""
    finished, unfinished = [], []
    for run_dir in run_dirs(paths):
        record = read_run(run_dir)
        (finished.append(record) if record else unfinished.append(str(run_dir)))
    if not finished:
        raise ValueError(f"none of the {len(unfinished)} runs under {', '.join(map(str, paths))} has finished "
                         f"({RESULTS_FILE} at its last checkpoint's step; a run given more steps by a resume has not "
                         "until it ends): report reads what finished runs recorded")
    finished = told_apart(finished)
    datasets = list(dict.fromkeys(run.dataset for run in finished))
    written = [] if figures is None else [figures / f"curves_{dataset}.png" for dataset in datasets]
    if figures is not None and not (figures / SWEEP_FILE).exists():  # a sweep's folder holds its files alone
        for path in written:
            refuse_foreign_figure(path)
    for dataset, path in zip(datasets, written):
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_dataset([run for run in finished if run.dataset == dataset], path)
    return {"rows": table(finished), "runs": [str(run.run_dir) for run in finished], "unfinished": unfinished,
            "figures": [str(path) for path in written]}
