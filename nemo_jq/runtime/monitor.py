"""Run outputs people read: metrics JSONL, TensorBoard events, and the Figure-3 style plot."""

from __future__ import annotations

import json
import math
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nemo_jq.runtime.outputs import replace_whole, write_atomic
from nemo_jq.runtime.tracking import first_line, is_number

METRICS_FILE = "metrics.jsonl"
#: What each validation's first prompts were answered with (``eval.samples_shown``): a line a prompt, with its step.
SAMPLES_FILE = "samples.jsonl"
#: The columns of the samples' table the trackers get: a row a sample.
SAMPLE_COLUMNS = ("step", "id", "question", "reference", "sample", "rationale", "think_end_forced", "answer", "correct")
#: How ``metrics.jsonl`` writes a number that is not finite, which JSON has no word for: as a string (the names
#: JavaScript gives them); :func:`read_metrics` reads them back as floats (and a bare ``NaN`` of older files too).
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
#: The paper's Figure 3 panels: (record kind, key, panel title).
#: Below this, a KL between the engine's and the policy's log-probs is float rounding (an on-policy run).
KL_NOISE = 1e-6


@dataclass
class Panel:
    """One panel of :func:`plot_runs`: its title and, per run label, the (steps, values) logged."""

    title: str
    lines: dict[str, tuple[list[int], list[float]]]
    validation: bool = False
    #: Written in the panel: what is logged but not drawn.
    note: str = ""


def panels(runs: dict[str, list[dict[str, Any]]]) -> list[Panel]:
    """What was logged, a panel per quantity that some run logged: the sampled reward (GRPO, RLOO, SFT; GARL and PAFT
    log P̂ instead, in the log P̂ panel), log P̂, the largest amplified advantage, validation m@k (k as logged), the
    engine/policy KL (a run whose KL never leaves float rounding is named in the title, not drawn), and q where it
    changes during a run (a schedule, the guard)."""
    def series(kind: str, key: str) -> dict[str, tuple[list[int], list[float]]]:
        found = {}
        for label, records in runs.items():
            points = [(r["step"], r[key]) for r in records if r["kind"] == kind and r.get(key) is not None]
            if points:
                found[label] = tuple(map(list, zip(*points)))
        return found

    validation_keys = sorted({key for records in runs.values() for r in records if r["kind"] == "validation"
                              for key in r if key.startswith("m@")}, key=lambda key: int(key[2:]))
    out = [Panel("sampled reward (mean over rollouts)", series("train", "reward")),
           Panel("log P̂ (mean log w̄)", series("train", "log_p_hat")),
           Panel("max amplified advantage |c_m|/M^q\n(GARL with objective.normalize=false: |c_m|)",
                 series("train", "max_amplified_advantage"))]
    out += [Panel(f"validation {key}", series("validation", key), validation=True) for key in validation_keys]
    kl = series("train", "kl_k3")
    quiet = sorted(label for label, (_, values) in kl.items() if max(values) < KL_NOISE)
    out.append(Panel("KL(engine ‖ policy) per token, k3", {label: line for label, line in kl.items() if label not in quiet},
                     note=f"below {KL_NOISE:g} (float rounding), not drawn: {', '.join(quiet)}" if quiet else ""))
    q = {label: line for label, line in series("train", "q").items() if len(set(line[1])) > 1}
    out.append(Panel("q", q))
    return [panel for panel in out if panel.lines or panel.note]


def line_style(index: int) -> dict[str, str]:
    """The ``index``-th line's colour and dash: matplotlib's ten colours, then again dashed, dotted... (a q sweep of
    more than ten runs drew two in one colour, their legend entries alike)."""
    return {"color": f"C{index % 10}", "linestyle": ("-", "--", ":", "-.")[index // 10 % 4]}


class RunLogger:
    """Appends records to ``metrics.jsonl`` (and TensorBoard), and the validations' samples to ``samples.jsonl``.

    On resume it drops the records and samples after ``resume_step`` (the steps between the last checkpoint
    and the stop, which the resumed run logs again) and rebuilds the TensorBoard events from the
    records it keeps, so no step shows twice. A new run starts them afresh.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool, resume_step: int = 0, writes: bool = True,
                 trackers: Any = ()):
        self.path, self.writes, self.writer = run_dir / METRICS_FILE, writes, None
        #: W&B, MLflow (nemo_jq.runtime.tracking): they get the records logged from now on.
        self.trackers = list(trackers)
        if not writes:  # another rank of a multi-process run writes them
            return
        # a resume's cut, whole or not at all: a kill or a full disk part-way left the run's history cut short
        kept = [r for r in read_metrics(run_dir) if r["step"] <= resume_step and r["kind"] != "test"] if resume_step else []
        write_atomic(self.path, "".join(map(metrics_line, kept)))
        self.samples = run_dir / SAMPLES_FILE
        shown = read_records(self.samples, ("step",)) if resume_step else []
        write_atomic(self.samples, "".join(json.dumps(prompt) + "\n" for prompt in shown if prompt["step"] <= resume_step))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            events = run_dir / "tensorboard"
            shutil.rmtree(events, ignore_errors=True)  # derived from metrics.jsonl, rebuilt just below
            self.writer = SummaryWriter(log_dir=str(events))
            for record in kept:
                self._add_scalars(record)
            self.writer.flush()

    def log(self, record: dict[str, Any]) -> None:
        if not self.writes:
            return
        try:
            with self.path.open("a") as f:
                f.write(metrics_line(record))
        except OSError as err:  # a failed write names no file: say which
            raise OSError(err.errno, err.strerror, str(self.path)) from err
        if self.writer is not None:
            self._add_scalars(record)
            self.writer.flush()
        self._to_trackers(f"step {record['step']}'s {record['kind']} record", lambda tracker: tracker.log(record))

    def log_samples(self, step: int, shown: list[dict[str, Any]]) -> None:
        """A validation's shown prompts (``Evaluator.shown``): a line each in ``samples.jsonl``, and a table of their
        samples to the trackers."""
        if not self.writes or not shown:
            return
        with self.samples.open("a") as f:
            f.write("".join(json.dumps({"step": step, **prompt}) + "\n" for prompt in shown))
        rows = [[step, prompt["id"], prompt["question"], prompt["reference"], index, sample["rationale"],
                 sample["think_end_forced"], sample["answer"], sample["correct"]]
                for prompt in shown for index, sample in enumerate(prompt["samples"])]
        self._to_trackers(f"step {step}'s samples", lambda tracker: tracker.table("samples", step, list(SAMPLE_COLUMNS), rows))

    def attach(self, path: Path) -> None:
        """Hand a file the run wrote (its Figure-3 plot) to the trackers."""
        if self.writes:
            self._to_trackers(path.name, lambda tracker: tracker.attach(path))

    def _to_trackers(self, what: str, send: Callable[[Any], None]) -> None:
        """``send(tracker)`` for each tracker. One that fails (its server gone, its store deleted, a full disk) is
        dropped with a line on stderr, and the run trains on: metrics.jsonl holds every record, and a resume
        continues the tracker's run."""
        for tracker in list(self.trackers):
            try:
                send(tracker)
            except Exception as err:  # a tracker's failure is its library's, of any kind: it must not end the run
                self.trackers.remove(tracker)
                print(f"nemo-jq: {tracker.name} failed on {what} ({first_line(err)}): the run goes on without it (metrics.jsonl keeps "
                      f"every record; --resume once it is back continues its {tracker.name} run)", file=sys.stderr)

    def _add_scalars(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                self.writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self, outcome: str) -> None:
        """Close TensorBoard, and the trackers' runs as ``outcome`` (:data:`~nemo_jq.runtime.tracking.OUTCOMES`)."""
        if self.writer is not None:
            self.writer.close()
        self._to_trackers("closing its run", lambda tracker: tracker.close(outcome))
        self.trackers = []


def duration(seconds: float) -> str:
    """``40 s``, ``12 min``, ``3.4 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def pace(count: int, seconds: float, left: int, unit: str) -> str:
    """``2.5 steps/s, 40 s left`` or, slower than one a second (a real run's steps), ``28.4 s/step, 3.1 h left``
    (``count`` > 0 done in ``seconds``, ``left`` to do)."""
    per_second = count / max(seconds, 1e-9)
    each = seconds / count
    rate = f"{per_second:.3g} {unit}s/s" if per_second >= 1 else f"{each:.3g} s/{unit}" if each < 90 else f"{duration(each)}/{unit}"
    return f"{rate}, {duration(left / per_second)} left" if left else rate


class ProgressLines:
    """Progress for a log without a terminal (a batch job's): one plain line every tenth of the way and at the end,
    with the pace so far, the time left at it and the bar's latest figures, instead of a bar redrawn with carriage
    returns."""

    def __init__(self, total: int, initial: int, desc: str, unit: str = "step"):
        self.total, self.count, self.desc, self.started, self.figures = total, initial, desc, time.perf_counter(), ""
        self.every, self.start, self.due, self.unit = max(1, total // 10), initial, False, unit

    def update(self, n: int = 1) -> None:
        """Count ``n`` more; a line that falls due waits for the figures of the step it counts (``set_postfix``)."""
        self._print_due()
        self.count += n
        self.due = self.count % self.every == 0 or self.count == self.total

    def set_postfix(self, figures: dict[str, str]) -> None:
        self.figures = "".join(f", {key}={value}" for key, value in figures.items())
        self._print_due()

    def _print_due(self) -> None:
        if self.due:
            self.due = False
            rate = pace(self.count - self.start, time.perf_counter() - self.started, self.total - self.count, self.unit)
            print(f"{self.desc}: {self.count}/{self.total} ({rate}){self.figures}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._print_due()

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


def progress(total: int, desc: str, *, unit: str, initial: int = 0, shows: bool = True, transient: bool = False) -> Any:
    """A tqdm bar counting ``unit`` on a terminal; without one, :class:`ProgressLines` (none at all for a
    ``transient`` bar, such as an evaluation's, or where ``shows`` is False: another rank's)."""
    from tqdm import tqdm

    if shows and sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=not transient, dynamic_ncols=True)
    if shows and not transient:
        return ProgressLines(total, initial, desc, unit)
    return tqdm(total=total, disable=True)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl`` records (none where it has logged none yet); see :func:`read_records`."""
    return read_records(Path(run_dir) / METRICS_FILE, ("kind", "step"), decode=nonfinite_back, problem=metrics_problem)


#: What figures and reports read of each kind of record besides its scores (``p@k``, ``m@k``): numbers where logged.
PLOTTED = {"train": ("reward", "log_p_hat", "max_amplified_advantage", "kl_k3", "q")}


def metrics_problem(record: dict[str, Any]) -> str | None:
    """What in a ``metrics.jsonl`` record is not as a run logs it, of what is read back (None: nothing): a
    hand-edited ``"m@16": "x"`` failed the report in a traceback."""
    step = record["step"]
    if isinstance(step, bool) or not isinstance(step, int):
        return f"its step is {step!r}"
    read = [key for key in record
            if key in PLOTTED.get(record["kind"], ()) or (key.startswith(("p@", "m@")) and not key.endswith("±"))]
    wrong = [key for key in read if record[key] is not None and not is_number(record[key])]
    return f"{wrong[0]} is {record[wrong[0]]!r}, not a number" if wrong else None


def read_records(path: Path, keys: tuple[str, ...], decode: Callable[[Any], Any] | None = None,
                 problem: Callable[[dict[str, Any]], str | None] | None = None) -> list[dict[str, Any]]:
    """The records of a JSONL file a run appends to, each holding ``keys`` (each through ``decode``), in which
    ``problem`` finds nothing wrong. A last line cut short (no newline: a write caught in progress, or one a kill
    stopped) is left out, as a resumed run's rewrite of the file drops it; any other line that is not such a record
    is an error naming the file, the line and the fix."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").split("\n")  # a byte that is not UTF-8 fails its line, named
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record = decode(record) if decode is not None else record
            wrong = None if isinstance(record, dict) else "not a JSON object"
        except json.JSONDecodeError as err:
            wrong = f"not JSON: {err.msg}, column {err.colno}"
        if wrong is None and (missing := [key for key in keys if key not in record]):
            wrong = f"no {', '.join(map(repr, missing))}"
        if wrong is None and problem is not None:
            wrong = problem(record)
        if wrong is None:
            records.append(record)
        elif number < len(lines):  # a whole line, not the unfinished last one
            raise ValueError(f"{path} line {number} is not a record the run logged ({wrong}): repair that line or "
                             "delete it")
    return records


def read_json_file(path: Path, what: str, problem: Callable[[dict[str, Any]], str | None], fix: str,
                   decode: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """``path``'s JSON object (through ``decode``: :func:`nonfinite_back` for a file :func:`valid_json` wrote), in
    which ``problem`` finds nothing wrong (else it says what is). A file edited, or cut short by a kill or a full disk,
    is one line: ``PATH is not WHAT (what is wrong): FIX``."""
    text = path.read_text(errors="replace")
    try:
        value = json.loads(text)
        value = decode(value) if decode is not None else value
    except json.JSONDecodeError as err:
        wrong = "it is empty" if not text.strip() else f"not JSON: {err.msg}, line {err.lineno} column {err.colno}"
    else:
        wrong = problem(value) if isinstance(value, dict) else f"it holds {json.dumps(value)[:30]}, not an object"
    if wrong:
        raise ValueError(f"{path} is not {what} ({wrong}): {fix}")
    return value


def metrics_line(record: dict[str, Any]) -> str:
    """``record`` as one line of valid JSON (:func:`valid_json`)."""
    return valid_json(record) + "\n"


def valid_json(value: Any, indent: int | None = None) -> str:
    """``value`` as JSON that every reader takes (``jq``, a browser, not only Python): a NaN or infinite number as its
    :data:`NONFINITE` string, which :func:`nonfinite_back` reads back."""
    return json.dumps(_finite_json(value), allow_nan=False, indent=indent)


def _finite_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(item) for item in value]
    return value


def nonfinite_back(value: Any) -> Any:
    """``value`` (read from :func:`valid_json`'s text) with its :data:`NONFINITE` strings numbers again."""
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {key: nonfinite_back(item) for key, item in value.items()}
    if isinstance(value, list):
        return [nonfinite_back(item) for item in value]
    return value


def plot_runs(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """:func:`panels` against step, one colour per run (label -> records) in every panel; a dashed vertical line
    where the collapse guard acted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = panels(runs)
    columns = max(1, -(-len(shown) // 2))
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 7.5), sharex=True, squeeze=False)
    styles = {label: line_style(i) for i, label in enumerate(runs)}
    colors = {label: style["color"] for label, style in styles.items()}
    for ax, panel in zip(axes.flat, shown):
        for label, (steps, values) in panel.lines.items():
            ax.plot(steps, values, label=label, **styles[label], marker="o" if panel.validation else None, ms=3)
        for label, records in runs.items():  # the collapse guard's interventions
            for record in records:
                if record["kind"] == "guard":
                    ax.axvline(record["step"], color=colors[label], linestyle="--", linewidth=1)
        ax.set_title(panel.title, fontsize=9)
        ax.grid(alpha=0.3)
        if not panel.lines:
            ax.set_yticks([])
        if panel.note:
            ax.text(0.5, 0.5 if not panel.lines else 0.95, textwrap.fill(panel.note, 50), transform=ax.transAxes,
                    ha="center", va="center" if not panel.lines else "top", fontsize=8)
    for ax in axes.flat[len(shown):]:
        ax.set_visible(False)
    for upper, lower in zip(axes[0], axes[1]):  # the step axis under each column's lowest panel (shared axes hide it above)
        bottom = lower if lower.get_visible() else upper
        bottom.set_xlabel("step")
        bottom.xaxis.set_tick_params(labelbottom=True)
    handles = [plt.Line2D([], [], **styles[label], label=label) for label in runs]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(runs), 5), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    try:  # whole or not at all
        replace_whole(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)


#: Means over a count other than a micro-batch's prompts, and the count each is over (a metric of its own, summed):
#: merged weighted by that count, as one mean over the step's tokens, ratios or weighted groups (a micro-batch of long
#: rows holds more tokens than its prompts say; one whose every group ``mask`` zeroed holds no weight to average).
COUNTED_MEANS = {"logprob_gap": "scored_tokens", "kl_k3": "scored_tokens", "nll_per_token": "target_tokens",
                 "clip_fraction": "completion_tokens",
                 **dict.fromkeys(("is_ratio_mean", "is_truncated_fraction", "is_masked_fraction"), "ratio_terms"),
                 **dict.fromkeys(("log_p_hat", "p_hat", "jq_loss", "w_underflow_fraction", "ess"), "weighted_groups")}
#: Shares of a sum, and what that sum is (the product of metrics): the ratios' mass truncated, Σ(ρ − ρ̃)/Σρ, is
#: weighted by Σρ, the ratios' mean times their count.
SHARES_OF_SUMS = {"is_truncated_mass": ("is_ratio_mean", "ratio_terms")}
#: Shares of a micro-batch's prompts it reports only where they are not 0: merged over every micro-batch.
SAID_WHEN_NONZERO = ("masked_group_fraction",)


def merge_metrics(micro_metrics: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Prompt-weighted means of ``(prompts, metrics)`` pairs (micro-batches', or every replica's), each over the
    micro-batches that report it; ``max_*`` metrics take the maximum, ``min_*`` the minimum, :data:`COUNTED_MEANS`
    are weighted by their counts, and :data:`SAID_WHEN_NONZERO` count 0 where a micro-batch left them out: the same
    step's record whatever ``train.micro_batch_size`` or the replicas split it into."""
    keys = dict.fromkeys(key for _, metrics in micro_metrics for key in metrics)
    counts = set(COUNTED_MEANS.values())
    merged: dict[str, float] = {}
    for key in keys:
        values = [(_weight(key, n, m), m[key]) for n, m in micro_metrics if key in m]
        if sum(w for w, _ in values) == 0:  # counted over nothing anywhere (no completion token): as many prompts
            values = [(n, m[key]) for n, m in micro_metrics if key in m]
        if key.startswith("max_"):
            merged[key] = max(v for _, v in values)
        elif key.startswith("min_"):
            merged[key] = min(v for _, v in values)
        elif key in counts:
            merged[key] = sum(v for _, v in values)
        elif key in SAID_WHEN_NONZERO:
            merged[key] = sum(n * m.get(key, 0.0) for n, m in micro_metrics) / sum(n for n, _ in micro_metrics)
        else:
            merged[key] = sum(n * v for n, v in values) / sum(n for n, _ in values)
    return merged


def _weight(key: str, prompts: int, metrics: dict[str, float]) -> float:
    """What ``key``'s value in one micro-batch's ``metrics`` weighs in the merge: its count, else its prompts."""
    factors = SHARES_OF_SUMS.get(key) or (COUNTED_MEANS.get(key),)
    if not all(factor in metrics for factor in factors):
        return prompts
    return math.prod(metrics[factor] for factor in factors)
