"""``nemo-jq experiment escape-rates``: does the cold-start escape-time separation survive a real optimizer?

The paper's gradient-flow result (Thm 3.2 on the sigmoid model, :mod:`nemo_jq.theory.escape`): leaving
p0 takes T_q(p0) = Θ(p0^{-(1-q)}/(1-q)) for q < 1 and Θ(log 1/p0) at q = 1. Here the demo's tiny Qwen3
learns the demo's synthetic sums from scratch, with the initial success probability p0 set by the
task's answer width (``data.answer_width``: the sum written zero-padded to W digits; every digit is one
more token a random model gives about 1/V, so log(1/p0) grows by about log V per digit) and measured,
not assumed: p0 = exp(the first step's log P̂), per width and seed. For GARL at q in
{0, 0.25, 0.5, 0.75, 1} and GRPO, under plain SGD (no momentum, no clipping, one learning rate chosen so
q = 1 is stable) and under the demo's AdamW, over seeds: the steps until log P̂ first exceeds
:data:`THRESHOLD`, a run that never does by ``cap`` steps recorded as censored. log P̂ is the step's
GARL metric (the mean over the batch's prompts of log of the mean teacher-forced p(y*|x,z_m)); GRPO
teacher-forces nothing, so its P̂ is the step's mean reward (a sampled estimate of the same P).

Per optimizer: escape steps against log(1/p0) for each q; fitted growth (steps linear in log(1/p0) at
q = 1; log steps linear in log(1/p0) for q < 1, whose slope the theory puts at 1 - q); and the theory's
T_q(p0, δ = e^THRESHOLD) in steps, with one time scale per optimizer (steps per unit of gradient-flow
time) fitted to that optimizer's q = 1 runs. Writes ``summary.json``, ``table.md``, ``escape_rates.png`` and
``curves_<optimizer>.png`` (the Figure-3 panels of every method at the middle width and the first seed).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from nemo_jq.config import ConfigError, load_config
from nemo_jq.experiments.common import PER_RUN, Progress, chosen_methods, refuse_per_run_keys, slug, start_run
from nemo_jq.runtime.monitor import read_metrics, valid_json
from nemo_jq.runtime.preemption import Series
from nemo_jq.runtime.report import mean_sd, seed_stats
from nemo_jq.runtime.sweep import refuse_repeats

#: log P̂ a run must exceed to have escaped: e^-5 ≈ 0.7%, the noisy cold-start experiment's "left P̂ ≈ 0".
THRESHOLD = -5.0
QS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: The answer widths (digits, zero-padded): the p0 knob. The demo's sums (3 operands) have 1 or 2 digits.
WIDTHS = (2, 3, 4)
#: Steps before a run that has not escaped counts as censored.
CAP = 200
#: SGD's learning rate, chosen once on seed 0 with q = 1: 1 and 0.3 diverged (log P̂ to -inf, then NaN), 0.1 escaped
#: with swings of 20 nats at width 4, 0.05 rose steadily at widths 2 and 4 (docs/results/escape_rates/README.md).
SGD_LR = 0.05
OPTIMIZERS = {"SGD": ["optim.name=sgd", f"optim.lr={SGD_LR}", "optim.grad_clip=0"], "AdamW": []}
#: Every run: the demo's model, task and rollouts; no validation or checkpoints along the way (only P̂ is read).
SETTINGS = ["train.tensorboard=false", "eval.every=1000000", "train.save_every=1000000", "train.keep_checkpoints=1"]
QUICK = ["data.train_size=24", "data.validation_size=4", "data.test_size=4", "train.batch_size=4",
         "train.micro_batch_size=4", "rollout.max_thinking_tokens=3", "model.tiny.hidden_size=32",
         "model.tiny.intermediate_size=64"]
SUMMARY_FILE, TABLE_FILE, FIGURE_FILE = "summary.json", "table.md", "escape_rates.png"
#: The keys each run sets (:data:`~nemo_jq.experiments.common.PER_RUN`), with its width and its optimizer's settings.
CONTROLLED = {**PER_RUN, "data.seed": ("per seed", "--seeds"), "data.answer_width": ("per width", "--widths"),
              # a run stopped before the cap would count as censored at it
              "train.max_steps": ("to --cap (a run that has not escaped by then is censored there)", "--cap"),
              **dict.fromkeys({item.partition("=")[0] for settings in OPTIMIZERS.values() for item in settings},
                              ("per optimizer (SGD's own, AdamW's defaults)", None))}


def methods() -> dict[str, list[str]]:
    return {"GRPO": ["objective.name=grpo"], **{f"q={q:g}": ["objective.name=garl", f"objective.q={q}"] for q in QS}}


def step_log_p(record: dict[str, Any]) -> float:
    """The step's log P̂: GARL's teacher-forced estimate, else (GRPO) the log of its mean reward."""
    if record.get("log_p_hat") is not None:
        return record["log_p_hat"]
    reward = record.get("train_reward")
    return math.log(reward) if reward else -math.inf


def escape(records: Sequence[dict[str, Any]], threshold: float, cap: int) -> dict[str, Any]:
    """The first step whose log P̂ exceeds ``threshold``, or ``cap`` censored when none up to it did; with the
    first step's log P̂ (log p0)."""
    train = [r for r in records if r["kind"] == "train" and r["step"] <= cap]
    if not train:
        raise ValueError("a run without train records")
    step = next((r["step"] for r in train if step_log_p(r) > threshold), None)
    return {"steps": cap if step is None else step, "censored": step is None, "log_p0": step_log_p(train[0])}


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float] | None:
    """Least squares y = intercept + slope·x; None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return {"slope": slope, "intercept": mean_y - slope * mean_x, "points": len(xs)}


def theory_time(q: float, log_p0: float, threshold: float = THRESHOLD) -> float:
    """T_q(p0, δ) of gradient flow on the sigmoid model, δ = e^threshold (units of gradient-flow time)."""
    from nemo_jq.theory.escape import escape_time_quadrature

    return escape_time_quadrature(q, math.exp(log_p0), math.exp(threshold))


def time_scale(q1_runs: Sequence[dict[str, Any]], threshold: float = THRESHOLD) -> float | None:
    """Steps per unit of gradient-flow time, by least squares through 0 of q = 1's escape steps on T_1(p0)."""
    points = [(theory_time(1.0, r["log_p0"], threshold), r["steps"]) for r in q1_runs
              if not r["censored"] and r["log_p0"] < threshold]
    if not points:
        return None
    return sum(t * s for t, s in points) / sum(t * t for t, _ in points)


def method_q(method: str) -> float:
    """A method's q; GRPO is read as q = 0 (RLVR)."""
    return 0.0 if method == "GRPO" else float(method.removeprefix("q="))


def growth(q: float, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The fitted growth of escape steps in log(1/p0) over the runs that escaped: linear at q = 1, log-linear
    (slope against the theory's 1 - q) for q < 1. Escapes at one width only fit nothing (the seeds' p0 differ too
    little to carry a slope)."""
    escaped = [r for r in runs if not r["censored"]]
    if len({r["width"] for r in escaped}) < 2:
        escaped = []
    xs = [-r["log_p0"] for r in escaped]
    if q == 1.0:
        return {"form": "steps = a + b·log(1/p0)", "fit": fit_line(xs, [r["steps"] for r in escaped]), "theory_slope": None}
    return {"form": "log steps = a + b·log(1/p0)", "fit": fit_line(xs, [math.log(r["steps"]) for r in escaped]),
            "theory_slope": 1.0 - q}


def measured_p0(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[tuple[int, int], float]:
    """log p0 per (width, seed): the mean first-step log P̂ of the GARL runs (within a seed they share the initial
    weights, the first batch and its rollouts, so they agree; GRPO's sampled P̂ is usually log 0)."""
    values: dict[tuple[int, int], list[float]] = {}
    for per_method in runs.values():
        for method, method_runs in per_method.items():
            for r in method_runs:
                if method != "GRPO" and math.isfinite(r["log_p0"]):
                    values.setdefault((r["width"], r["seed"]), []).append(r["log_p0"])
    return {key: statistics.mean(v) for key, v in values.items()}


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]], widths: Sequence[int], cap: int,
              threshold: float = THRESHOLD) -> dict[str, Any]:
    """``runs[optimizer][method]``: per run ``{"width", "seed", "steps", "censored", "log_p0"}``. Every run is placed
    at its (width, seed)'s measured log p0 (:func:`measured_p0`); per width its spread over seeds; per optimizer and
    method the escape steps' spread per width (``report.seed_stats``: mean, sample sd, n, 95% t-interval), the
    growth fit, and the theory's steps at the width's p0."""
    p0 = measured_p0(runs)
    placed = {optimizer: {method: [{**r, "log_p0": p0.get((r["width"], r["seed"]), r["log_p0"])} for r in method_runs]
                          for method, method_runs in per_method.items()} for optimizer, per_method in runs.items()}
    log_p0 = {}
    for width in widths:
        here = [value for (w, _), value in p0.items() if w == width]
        log_p0[str(width)] = seed_stats(here) if here else None
    by_optimizer = {}
    for optimizer, per_method in placed.items():
        scale = time_scale(per_method.get("q=1", []), threshold)
        rows = {}
        for method, method_runs in per_method.items():
            cells = {}
            for width in widths:
                here = [r for r in method_runs if r["width"] == width]
                escaped = [r["steps"] for r in here if not r["censored"]]
                at = log_p0[str(width)]
                predicted = (scale * theory_time(method_q(method), at["mean"], threshold)
                             if scale is not None and at and at["mean"] < threshold else None)
                spread = seed_stats(escaped)
                cells[str(width)] = {"escaped": len(escaped), "runs": len(here), "mean": spread["mean"],
                                     "sd": spread["sd"], "ci95": spread["ci95"], "theory_steps": predicted}
            rows[method] = {"widths": cells, "growth": growth(method_q(method), method_runs)}
        by_optimizer[optimizer] = {"steps_per_unit_time": scale, "methods": rows}
    return {"cap": cap, "threshold": threshold, "widths": list(widths), "log_p0": log_p0, "runs": placed,
            "optimizers": by_optimizer}


@Series("experiment escape-rates", again="`nemo-jq experiment escape-rates --resume {out_dir}` goes on from there")
def run_experiment(out_dir: Path, seeds: Sequence[int], *, widths: Sequence[int] | None = None, cap: int | None = None,
                   quick: bool = False, overrides: Sequence[str] = (), overwrite: bool = False,
                   only: Sequence[str] = (), train: Callable[[list[str], int], list[dict]] | None = None,
                   resume: bool = False) -> dict[str, Any]:
    """Every optimizer x method x width x seed into ``out_dir/<optimizer>/<method>/w<W>_seed<S>``, then the table
    and figure. ``widths`` and ``cap`` default to :data:`WIDTHS` and :data:`CAP` (``quick``: 2, 3 and 4 steps).
    ``train(overrides, cap)`` runs one configuration and returns its metrics records (default: the trainer, stopped
    at escape). ``resume``: go on with the experiment in ``out_dir`` (:class:`~nemo_jq.experiments.common.Progress`;
    its options are the ones given)."""
    out_dir = Path(out_dir)
    refuse_repeats("--seeds", seeds)
    refuse_repeats("--widths", widths or ())
    refuse_per_run_keys("escape-rates", overrides, CONTROLLED)
    widths = widths or ((2, 3) if quick else WIDTHS)
    cap = (4 if quick else CAP) if cap is None else cap
    plan = chosen_methods(methods(), only)
    if cap < 1:
        raise ConfigError(f"--cap must be at least 1 step; got {cap}")
    base = [*SETTINGS, *(QUICK if quick else []), *overrides]
    for optimizer in OPTIMIZERS.values():  # every configuration is checked before anything is written or trained
        for method in plan.values():
            for width in widths:
                load_config(None, [*base, *optimizer, *method, f"data.answer_width={width}"])
    progress = Progress.begin(out_dir, "escape-rates", dict(seeds=list(seeds), widths=list(widths), cap=cap, quick=quick,
                                                            overrides=list(overrides), only=list(only)),
                              markers=(SUMMARY_FILE, TABLE_FILE, FIGURE_FILE, *OPTIMIZERS), overwrite=overwrite,
                              resume=resume)
    train = train or _train
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {method: [] for method in plan} for name in OPTIMIZERS}
    for seed in seeds:
        for width in widths:
            for optimizer, optimizer_overrides in OPTIMIZERS.items():
                for method, method_overrides in plan.items():
                    run_dir = out_dir / optimizer / slug(method) / f"w{width}_seed{seed}"
                    words = [*base, *optimizer_overrides, *method_overrides, f"data.answer_width={width}",
                             f"train.seed={seed}", f"data.seed={seed}", f"train.run_dir={run_dir}"]
                    result = progress.run(run_dir, lambda: escape(train(words, cap), THRESHOLD, cap))
                    runs[optimizer][method].append({"width": width, "seed": seed, **result})
                    print(f"{optimizer:5s} {method:6s} width {width} seed {seed}: log p0 {result['log_p0']:.1f}, "
                          f"{'censored at' if result['censored'] else 'escaped at'} step {result['steps']}", flush=True)
    summary = {"settings": base, "optimizer_settings": OPTIMIZERS, "methods": plan, "seeds": list(seeds),
               **summarise(runs, widths, cap)}
    (out_dir / SUMMARY_FILE).write_text(valid_json(summary, indent=2) + "\n")
    (out_dir / TABLE_FILE).write_text(markdown_table(summary) + "\n")
    plot(summary, out_dir / FIGURE_FILE)
    curves = plot_curves(out_dir, plan, widths[len(widths) // 2], seeds[0])
    print(markdown_table(summary))
    print(f"wrote {out_dir / SUMMARY_FILE}, {out_dir / TABLE_FILE}, {out_dir / FIGURE_FILE}"
          + "".join(f", {path}" for path in curves))
    return summary


def plot_curves(out_dir: Path, plan: dict[str, list[str]], width: int, seed: int) -> list[Path]:
    """The Figure-3 panels of every method at one width and seed, one figure per optimizer (``curves_<opt>.png``),
    from the runs' own metrics; an optimizer without such runs is skipped."""
    from nemo_jq.runtime.monitor import plot_runs

    written = []
    for optimizer in OPTIMIZERS:
        runs = {method: read_metrics(out_dir / optimizer / slug(method) / f"w{width}_seed{seed}") for method in plan
                if (out_dir / optimizer / slug(method) / f"w{width}_seed{seed}").is_dir()}
        if runs:
            plot_runs(runs, out_dir / f"curves_{optimizer}.png")
            written.append(out_dir / f"curves_{optimizer}.png")
    return written


def _train(overrides: list[str], cap: int) -> list[dict[str, Any]]:
    """One run of at most ``cap`` steps, stopped after the first step past :data:`THRESHOLD`."""
    config = load_config(None, overrides)
    epochs = max(config.train.epochs, math.ceil(cap * config.train.batch_size / config.data.train_size))
    config = load_config(None, [*overrides, f"train.epochs={epochs}"])
    start_run(config).fit(max_steps=cap, until=lambda record: step_log_p(record) > THRESHOLD)
    return read_metrics(Path(config.train.run_dir))


def markdown_table(summary: dict[str, Any]) -> str:
    """Escape steps per optimizer, method and width (mean ± sd over the seeds that escaped; ``>cap``: none did;
    [the theory's steps at the width's measured p0]), and the fitted growth against the theory's."""
    widths = summary["widths"]
    p0 = summary["log_p0"]
    head = " | ".join(f"W={w}: log p0 {p0[str(w)]['mean']:.1f}" if p0.get(str(w)) else f"W={w}" for w in widths)
    lines = [f"| optimizer | method | {head} | fitted growth | theory |",
             "| --- | --- |" + " --- |" * len(widths) + " --- | --- |"]
    for optimizer, block in summary["optimizers"].items():
        for method, row in block["methods"].items():
            cells = []
            for width in widths:
                cell = row["widths"][str(width)]
                text = f">{summary['cap']}" if cell["mean"] is None else mean_sd(cell, ".0f")
                if cell["mean"] is not None and cell["escaped"] < cell["runs"]:
                    text += f" ({cell['escaped']}/{cell['runs']})"
                if cell["theory_steps"] is not None:
                    text += f" [{_steps(cell['theory_steps'])}]"
                cells.append(text)
            fit, theory_slope = row["growth"]["fit"], row["growth"]["theory_slope"]
            fitted = "n/a" if fit is None else f"slope {fit['slope']:.2f} ({fit['points']} runs)"
            scale = block["steps_per_unit_time"]
            expected = (f"log-slope {theory_slope:g}" if theory_slope is not None else
                        "linear" + ("" if scale is None else f", slope {scale:.2f} (the fitted time scale)"))
            lines.append(f"| {optimizer} | {method} | {' | '.join(cells)} | {fitted} | {expected} |")
    return "\n".join(lines)


def _steps(value: float) -> str:
    return f"{value:.0f}" if value < 1e5 else f"{value:.1e}"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Escape steps against log(1/p0), one panel per optimizer: a point per run (open triangles at the cap, each
    method nudged up a little so all show: censored), the theory's steps as a dashed line per q; the theory's
    minimum for the q whose line lies above the panel is written in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimizers = list(summary["optimizers"])
    fig, axes = plt.subplots(1, len(optimizers), figsize=(6 * len(optimizers), 4.8), squeeze=False, sharey=True)
    cap, top = summary["cap"], summary["cap"] * 40
    methods_seen = list(summary["runs"][optimizers[0]])
    colors = {method: f"C{index}" for index, method in enumerate(methods_seen)}
    for ax, optimizer in zip(axes[0], optimizers):
        block, above = summary["optimizers"][optimizer], []
        for index, (method, method_runs) in enumerate(summary["runs"][optimizer].items()):
            for censored, marker in ((False, "o"), (True, "^")):
                points = [(-r["log_p0"], r["steps"] * (1.07 ** index if censored else 1.0)) for r in method_runs
                          if r["censored"] == censored]
                if points:
                    xs, ys = zip(*points)
                    ax.scatter(xs, ys, marker=marker, s=26, alpha=0.8, edgecolors=colors[method],
                               facecolors="none" if censored else colors[method])
            theory = sorted((-summary["log_p0"][w]["mean"], cell["theory_steps"]) for w, cell in
                            block["methods"][method]["widths"].items() if cell["theory_steps"] is not None)
            if theory and method != "GRPO":
                ax.plot(*zip(*theory), color=colors[method], linestyle="--", linewidth=1)
                if theory[0][1] > top:
                    above.append(f"{method} ≥ {_steps(theory[0][1])}")
        if above:
            ax.text(0.02, 0.97, "theory above the panel: " + ", ".join(above), transform=ax.transAxes, fontsize=7,
                    va="top")
        ax.axhline(cap, color="grey", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylim(5, top)
        ax.set_title(f"{optimizer}: steps until log P̂ > {summary['threshold']:g} (dashed: theory)", fontsize=10)
        ax.set_xlabel("log(1/p0), measured")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"steps (open triangles: censored at {cap})")
    handles = [plt.Line2D([], [], color=color, marker="o", linestyle="", label=method) for method, color in colors.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)

