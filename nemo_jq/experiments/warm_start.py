"""``nemo-jq experiment warm-start``: from a warm policy, does GARL collapse where PAFT stays, and does it follow Var_z[w]?

The paper (Table 2, Figure b) sees GARL at every q peak early and then fall to zero validation m@16 on HotPotQA
and MuSiQue, PAFT at the same q stay, and both stay on FinQA; it names two candidate mechanisms, pathwise-term
corruption and dataset-specific overfitting, and notes that collapse seems to come sooner the larger the
latent-rationale variance Var_z[w(z)] (w(z) = p(y*|x, z)) under the prior. Here the synthetic task's
``data.rationale_dependence`` sets that variance (none: the answer is independent of the rationale; sum; operations:
the answer is the result of the operations the rationale writes), and per setting:

1. **One warm policy**: the demo's tiny Qwen3 trained by SFT on the gold rationales (:data:`WARMUP`), validated every
   ``eval.every`` steps, stopped at the first validation whose p@1 reaches ``target_p1`` (or after
   its 24 epochs), exported once (``warm/<setting>/policy``) and the start of every method and seed.
2. **Every method** (:func:`methods`: GRPO, GARL at q in {0, 0.25, 0.75}, PAFT at q in {0.25, 0.75}, and the two
   ablations of GARL's pathwise term at q=0.25) from it for the same steps (:data:`SETTINGS`), per seed (``train.seed``:
   the rollouts and the optimizer's stream; the data split stays the warm-up's).

Per run: the validation m@16 curve (step 0: the warm policy's own validation, shared), its peak, final value and
collapse (:func:`collapse`: below :data:`COLLAPSE_FRACTION` of the peak from some step to the end), the test m@16 of
the best-validation checkpoint, and Var_z[w] (:func:`latent_variance`) on the validation prompts from M sampled
rationales, before training and at every validation. Writes ``summary.json``, ``table.md`` and ``curves_<setting>.png``
(validation m@16 and Var_z[w] against step, one line per method, the mean over seeds).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from nemo_jq.config import ConfigError, load_config
from nemo_jq.data.synthetic import RATIONALE_DEPENDENCES
from nemo_jq.experiments.common import PER_RUN, Progress, chosen_methods, refuse_per_run_keys, slug, start_run
from nemo_jq.models.export import record_source
from nemo_jq.runtime.monitor import read_metrics, valid_json
from nemo_jq.runtime.preemption import Series
from nemo_jq.runtime.report import mean_sd, seed_stats
from nemo_jq.runtime.sweep import refuse_repeats

if TYPE_CHECKING:
    from nemo_jq.recipe.components import Components

#: Every run, warm-up included: the demo's model and sums of three digits, a thinking budget that holds the gold
#: rationale (14 tokens), validation every 16 steps, no checkpoints but the best one.
COMMON = ["data.format=cold", "data.num_operands=3", "data.train_size=256", "data.validation_size=32", "data.test_size=64",
          "data.seed=0", "rollout.max_thinking_tokens=16", "eval.every=16", "train.tensorboard=false",
          "train.save_every=1000000", "train.keep_checkpoints=1"]
#: The methods' phase from the warm policy: 6 epochs of 32 steps.
SETTINGS = ["train.epochs=6"]
#: The pre-phase: SFT on the gold rationales, up to 24 epochs (768 steps; it stops at the target); it comes after the
#: user's overrides, which set the rest (the model, the data) for both phases.
WARMUP = ["objective.name=sft", "train.epochs=24"]
#: The validation p@1 (percent) the warm-up stops at: operations' SFT passed 20 after 512 steps (seed 0), none's sooner.
TARGET_P1 = 20.0
#: A few-second version for the smoke test (its numbers mean nothing), with a warm-up of one epoch.
QUICK = ["data.train_size=8", "data.validation_size=4", "data.test_size=4", "train.batch_size=4",
         "train.micro_batch_size=4", "train.epochs=1", "eval.every=1", "eval.num_samples=4",
         "rollout.max_thinking_tokens=3", "rollout.max_answer_tokens=3", "model.tiny.hidden_size=32",
         "model.tiny.intermediate_size=64"]
QUICK_WARMUP = ["objective.name=sft", "train.epochs=1"]
#: The rationale-dependence settings run by default.
DEPENDENCES = ("none", "operations")
#: A run has collapsed when its validation m@k falls below this share of its peak and stays there to the end.
COLLAPSE_FRACTION = 0.1
SUMMARY_FILE, TABLE_FILE = "summary.json", "table.md"
#: The keys each run sets (:data:`~nemo_jq.experiments.common.PER_RUN`), with its setting; a method's run also starts
#: from the warm policy (an override of model.path sets the warm-up's start).
CONTROLLED = {**PER_RUN, "data.rationale_dependence": ("per setting", "--dependences")}
METHODS_CONTROLLED = {**CONTROLLED, "model.path": ("to the warm policy", None)}


def methods() -> dict[str, list[str]]:
    garl = lambda q: ["objective.name=garl", f"objective.q={q}"]  # noqa: E731
    return {"GRPO": ["objective.name=grpo"], **{f"GARL q={q:g}": garl(q) for q in (0.0, 0.25, 0.75)},
            **{f"PAFT q={q:g}": ["objective.name=paft", f"objective.q={q}"] for q in (0.25, 0.75)},
            "GARL q=0.25 score only": ["objective.name=garl_score_only", "objective.q=0.25"],
            "GARL q=0.25 resampled pathwise": ["objective.name=garl_resampled_pathwise", "objective.q=0.25"]}


def collapse(curve: Sequence[tuple[int, float]], fraction: float = COLLAPSE_FRACTION) -> dict[str, Any]:
    """Peak (the first step that reaches the curve's largest value), final value, and the collapse: the first step
    after the peak from which every value to the end is below ``fraction`` of the peak (None: no collapse; a peak
    of 0 cannot collapse)."""
    if not curve:
        raise ValueError("an empty validation curve")
    peak_step, peak = max(curve, key=lambda point: (point[1], -point[0]))
    collapse_step = None
    if peak > 0:
        for step, value in reversed(curve):
            if step <= peak_step or value >= fraction * peak:
                break
            collapse_step = step
    return {"peak": peak, "peak_step": peak_step, "final": curve[-1][1], "collapse_step": collapse_step}


def latent_variance(answer_logprob: torch.Tensor) -> dict[str, float]:
    """Var_z[w(z)] from ``[B, M]`` log w = log p(y*|x, z_m) of M rationales sampled per prompt: the unbiased sample
    variance of w per prompt, averaged over prompts (``var_w``), and the squared coefficient of variation
    Var/w̄² = M/ESS - 1 (ESS the weights' effective sample size; ``cv2_w``, over the prompts whose w̄ did not underflow),
    which does not shrink with w̄ itself."""
    from nemo_jq.objectives.weights import LOG_FP32_TINY, weight_stats

    stats = weight_stats(answer_logprob, q=0.0)
    m = stats.samples
    if m < 2:
        raise ValueError("Var_z[w] needs at least 2 rationales per prompt (rollout.num_samples >= 2)")
    mean_square = torch.exp(torch.logsumexp(2 * stats.log_w, -1) - math.log(m))
    variance = (mean_square - torch.exp(2 * stats.log_mean)).clamp(min=0.0) * m / (m - 1)
    present = stats.log_mean > LOG_FP32_TINY
    cv2 = (m / stats.effective_sample_size()[present] - 1.0) * m / (m - 1)
    return {"var_w": variance.mean().item(), "cv2_w": cv2.mean().item() if present.any() else None,
            "mean_w": torch.exp(stats.log_mean).mean().item()}


def measure_variance(components: Components, seed: int) -> dict[str, float]:
    """:func:`latent_variance` of the policy on the validation prompts: M rationales each (``rollout.num_samples``),
    y* teacher-forced after each, sampled from a generator of its own (the training streams do not move)."""
    from nemo_jq.models.common import new_generator
    from nemo_jq.objectives import get_objective
    from nemo_jq.objectives.inputs import EstimatorInputs
    from nemo_jq.recipe.experience import experience_from

    examples = components.splits.validation
    generator = new_generator(components.device).manual_seed(seed)
    rollouts = components.engine.generate(components.prompt_ids(examples), components.config.rollout.num_samples,
                                          sample_answers=False, generator=generator)
    batch = experience_from(components, examples, get_objective("garl"), rollouts, 0, 0.0).batch
    with torch.no_grad():
        logprobs = components.policy.token_logprobs(batch)
    inputs = EstimatorInputs(logprobs, batch.rationale_mask, batch.answer_mask, components.config.rollout.num_samples)
    return latent_variance(inputs.answer_logprob)


def train_measured(overrides: list[str], *, stop_at_p1: float | None = None,
                   variance_seed: int = 0) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """One run with Var_z[w] measured before training and at every validation; with ``stop_at_p1``, stopped at the
    first validation whose p@1 reaches it. Returns the trainer, fit's result and the measurements."""
    config = load_config(None, overrides)
    trainer = start_run(config, continues=False)  # what it measured before a stop is not kept: it starts again
    components, every = trainer.components, config.eval.every
    measured = [{"step": 0, **measure_variance(components, variance_seed)}]

    def after_step(record: dict[str, Any]) -> bool:
        step = trainer.state.step
        if step % every and step != trainer.total_steps:
            return False
        measured.append({"step": step, **measure_variance(components, variance_seed + step)})
        validation = [r for r in read_metrics(trainer.run_dir) if r["kind"] == "validation"]
        return stop_at_p1 is not None and validation[-1]["p@1"] >= stop_at_p1

    result = trainer.fit(until=after_step)
    return trainer, result, measured


def warm_up(out_dir: Path, overrides: list[str], dependence: str, target_p1: float) -> dict[str, Any]:
    """The shared warm policy of one setting: SFT (``overrides``) until validation p@1 reaches ``target_p1``,
    exported to ``out_dir/warm/<setting>/policy``."""
    run_dir = out_dir / "warm" / dependence
    trainer, _, measured = train_measured([*overrides, f"train.run_dir={run_dir}"], stop_at_p1=target_p1)
    validation = [r for r in read_metrics(run_dir) if r["kind"] == "validation"]
    trainer.policy.export(run_dir / "policy", trainer.components.tokenizer)
    # its source, as `nemo-jq export` records one: another run's export over it (its runs' model.path) is refused
    record_source(run_dir / "policy", {"run_dir": str(run_dir.resolve()), "run_id": trainer.run_id,
                                       "step": trainer.state.step, "selected": "the warm-up's last step"})
    k = trainer.config.eval.num_samples
    return {"run_dir": str(run_dir), "policy": str(run_dir / "policy"), "steps": trainer.state.step,
            "validation_p@1": validation[-1]["p@1"], f"validation_m@{k}": validation[-1][f"m@{k}"],
            "target_p@1": target_p1, "reached": validation[-1]["p@1"] >= target_p1,
            "variance_before": measured[-1]}


@Series("experiment warm-start", again="`nemo-jq experiment warm-start --resume {out_dir}` goes on from there (that "
                                        "run starts again: what it measures along the way is not in its checkpoint)")
def run_experiment(out_dir: Path, seeds: Sequence[int], *, dependences: Sequence[str] | None = None,
                   target_p1: float = TARGET_P1, quick: bool = False, overrides: Sequence[str] = (),
                   overwrite: bool = False, only: Sequence[str] = (),
                   methods_overrides: Sequence[str] = (), resume: bool = False) -> dict[str, Any]:
    """Per rationale-dependence setting: the warm policy, then every method (or those in ``only``) over every seed
    into ``out_dir/<setting>/<method>/seed<S>``; then the table and figures. ``overrides`` set both phases,
    ``methods_overrides`` the methods' phase only (e.g. its learning rate: the warm-up's SFT keeps its own).
    ``resume``: go on with the experiment in ``out_dir`` (:class:`~nemo_jq.experiments.common.Progress`; its options
    are the ones given)."""
    out_dir = Path(out_dir)
    refuse_repeats("--seeds", seeds)
    refuse_repeats("--dependences", dependences or ())
    refuse_per_run_keys("warm-start", overrides, CONTROLLED)
    refuse_per_run_keys("warm-start", methods_overrides, METHODS_CONTROLLED, given_as="--methods-override")
    dependences = list(dependences or DEPENDENCES)
    unknown = sorted(set(dependences) - set(RATIONALE_DEPENDENCES))
    if unknown:
        raise ConfigError(f"--dependences: unknown setting(s) {', '.join(map(repr, unknown))}; choose from "
                          f"{', '.join(RATIONALE_DEPENDENCES)}")
    if not 0 <= target_p1 <= 100:
        raise ConfigError(f"--target-p1 is a validation p@1 in percent, in [0, 100]; got {target_p1:g}")
    plan = chosen_methods(methods(), only)
    size = QUICK if quick else []
    shaped = [item for item in size if not item.startswith("model.tiny.")]  # the methods start from the warm policy
    phases = {"warm-up": [*COMMON, *size, *overrides, *(QUICK_WARMUP if quick else WARMUP)],
              "methods": [*COMMON, *SETTINGS, *shaped, *overrides, *methods_overrides]}
    for dependence in dependences:  # every configuration is checked before anything is written or trained
        load_config(None, [*phases["warm-up"], f"data.rationale_dependence={dependence}"])
        for method in plan.values():
            load_config(None, [*phases["methods"], f"data.rationale_dependence={dependence}", *method])
    progress = Progress.begin(out_dir, "warm-start", dict(seeds=list(seeds), dependences=dependences, target_p1=target_p1,
                                                          quick=quick, overrides=list(overrides), only=list(only),
                                                          methods_overrides=list(methods_overrides)),
                              markers=(SUMMARY_FILE, TABLE_FILE, "warm", *dependences), overwrite=overwrite, resume=resume)
    probe = load_config(None, phases["methods"])
    k = probe.eval.num_samples
    warm, runs = {}, {}
    for dependence in dependences:
        setting = f"data.rationale_dependence={dependence}"
        warm[dependence] = progress.run(out_dir / "warm" / dependence,
                                        lambda: warm_up(out_dir, [*phases["warm-up"], setting], dependence, target_p1))
        print(f"{dependence}: warm policy after {warm[dependence]['steps']} SFT steps, validation p@1 "
              f"{warm[dependence]['validation_p@1']:.1f} (target {target_p1:g}), Var_z[w] "
              f"{warm[dependence]['variance_before']['var_w']:.4f}", flush=True)
        runs[dependence] = {name: [] for name in plan}
        for seed in seeds:
            for name, method in plan.items():
                run_dir = out_dir / dependence / slug(name) / f"seed{seed}"
                words = [*phases["methods"], setting, *method, f"model.path={warm[dependence]['policy']}",
                         f"train.seed={seed}", f"train.run_dir={run_dir}"]
                run = progress.run(run_dir, lambda: {"seed": seed, **describe_run(
                    run_dir, *train_measured(words, variance_seed=seed)[1:], warm[dependence][f"validation_m@{k}"], k)})
                runs[dependence][name].append(run)
                print(f"{dependence} {name} seed {seed}: peak {run['peak']:.1f} at {run['peak_step']}, final "
                      f"{run['final']:.1f}, " + (f"collapsed at {run['collapse_step']}" if run["collapse_step"] is not None
                                                 else "no collapse") + f", test m@{k} {run['test']:.1f}", flush=True)
    summary = {"settings": phases, "target_p@1": target_p1, "methods": plan, "seeds": list(seeds), "dependences": dependences, "k": k,
               "collapse_rule": f"validation m@{k} below {COLLAPSE_FRACTION:g} x its peak from some step after the peak "
                                "to the end", "warm": warm, "runs": runs,
               "aggregate": {d: {name: aggregate(per_seed) for name, per_seed in per_method.items()}
                             for d, per_method in runs.items()}}
    (out_dir / SUMMARY_FILE).write_text(valid_json(summary, indent=2) + "\n")
    (out_dir / TABLE_FILE).write_text(markdown_table(summary) + "\n")
    figures = [plot_curves(runs[d], k, d, out_dir / f"curves_{d}.png") for d in dependences]
    print(markdown_table(summary))
    print(f"wrote {out_dir / SUMMARY_FILE}, {out_dir / TABLE_FILE}" + "".join(f", {path}" for path in figures))
    return summary


def describe_run(run_dir: Path, result: dict[str, Any], measured: Sequence[dict[str, Any]], warm_validation: float,
                 k: int) -> dict[str, Any]:
    """One run's row: its validation m@k curve (step 0: the warm policy's), :func:`collapse` of it, the test m@k of
    the best-validation checkpoint, and Var_z[w] along the run."""
    records = read_metrics(run_dir)
    curve = [(0, warm_validation), *((r["step"], r[f"m@{k}"]) for r in records if r["kind"] == "validation")]
    return {"curve": curve, **collapse(curve), "test": result["test"][f"m@{k}"], "best_step": result["best_step"],
            "variance": list(measured)}


def aggregate(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean ± sd over seeds (collapse step: over the seeds that collapsed; ``n`` says how many)."""
    return {"peak": seed_stats([r["peak"] for r in per_seed]), "peak_step": seed_stats([r["peak_step"] for r in per_seed]),
            "final": seed_stats([r["final"] for r in per_seed]), "test": seed_stats([r["test"] for r in per_seed]),
            "collapse_step": seed_stats([r["collapse_step"] for r in per_seed]),
            "collapsed": sum(r["collapse_step"] is not None for r in per_seed), "runs": len(per_seed),
            "var_w_start": seed_stats([r["variance"][0]["var_w"] for r in per_seed]),
            "var_w_end": seed_stats([r["variance"][-1]["var_w"] for r in per_seed])}


def markdown_table(summary: dict[str, Any]) -> str:
    k = summary["k"]

    def cell(stats: dict[str, float | None], style: str = ".1f") -> str:
        if stats["mean"] is None:
            return "n/a"
        return mean_sd(stats, style)

    lines = [f"| setting | warm p@1 | method | peak val m@{k} | peak step | final val m@{k} | collapsed | collapse step "
             f"| test m@{k} (best val) | Var_z[w] start | Var_z[w] end |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dependence, per_method in summary["aggregate"].items():
        warm = summary["warm"][dependence]
        for name, stats in per_method.items():
            lines.append(f"| {dependence} | {warm['validation_p@1']:.1f} | {name} | {cell(stats['peak'])} | "
                         f"{cell(stats['peak_step'], '.0f')} | {cell(stats['final'])} | {stats['collapsed']}/{stats['runs']} | "
                         f"{cell(stats['collapse_step'], '.0f')} | {cell(stats['test'])} | {cell(stats['var_w_start'], '.2g')} | "
                         f"{cell(stats['var_w_end'], '.2g')} |")
    return "\n".join(lines)


def plot_curves(per_method: dict[str, list[dict[str, Any]]], k: int, dependence: str, path: Path) -> Path:
    """Validation m@k and Var_z[w] against step, one line per method (the mean over seeds; the seeds faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for index, (name, per_seed) in enumerate(per_method.items()):
        color = f"C{index % 10}"
        for ax, points in ((left, [r["curve"] for r in per_seed]),
                           (right, [[(v["step"], v["var_w"]) for v in r["variance"]] for r in per_seed])):
            for seed_points in points:
                ax.plot(*zip(*seed_points), color=color, alpha=0.2, linewidth=0.8)
            steps = [step for step, _ in points[0]]
            ax.plot(steps, [statistics.mean(p[i][1] for p in points) for i in range(len(steps))], color=color, label=name)
    left.set(xlabel="step", ylabel=f"validation m@{k} (%)", title=f"rationale dependence: {dependence}")
    right.set(xlabel="step", ylabel="Var_z[w(z)] (validation prompts)", title="latent-rationale variance")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
