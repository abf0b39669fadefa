"""GARL: Gradient-Amplified RL (the paper's Algorithm 1).

Samples z_m from the prior, weights them by the teacher-forced reference-answer
likelihood w_m, and amplifies the RL gradient by the plug-in estimate w̄^{-q} of
P^{-q}. q=0 is VeriFree's Rao-Blackwellised RLOO; q=1 is the IWAE gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.checks import check_group_tensors, check_min_samples, check_q
from nemo_jq.objectives.importance import Correction, SampledTokens
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.qlog import jq_loss
from nemo_jq.objectives.registry import register_objective
from nemo_jq.objectives.weights import finite_logprob, weight_stats, with_value
from nemo_jq.typed import option

BASELINES = ("rloo", "none")


def garl(
    rationale_logprob: torch.Tensor,
    answer_logprob: torch.Tensor,
    q: float,
    *,
    baseline: str = "rloo",
    normalize: bool = True,
    behavior_logprob: torch.Tensor | SampledTokens | None = None,
    correction: Correction = Correction(),
) -> ObjectiveOutput:
    """GARL loss for B prompts x M sampled rationales.

    Args:
        rationale_logprob: ``[B, M]``, ``log p(z_m | x_b)`` summed over rationale tokens (differentiable).
        answer_logprob: ``[B, M]``, ``log p(y*_b | x_b, z_m)`` by teacher forcing (differentiable).
        q: commitment in [0, 1].
        baseline: ``"rloo"`` centres the score coefficient by ``(w̄_¬m)^{1-q}`` (Alg. 1, needs M>=2);
            ``"none"`` gives the plug-in estimator ``ḡ_M / w̄^q``.
        normalize: divide by ``M^q`` so that ``|c_m| / M^q <= 1`` for every q (Alg. 1's last line).
        behavior_logprob: ``[B, M]``, ``log π(z_m | x)`` under the policy that sampled z_m (a rollout engine, an older
            policy), summed over the rationale span; None: z_m ~ p_θ. Then ρ̃_m = ``correction`` of
            p_θ(z_m|x) / π(z_m|x) reweights every sample (log w_m + log ρ̃_m), and the leave-one-out baseline is
            multiplied by ρ̃_m, without which the score term is biased even at q=0 (docs/off_policy.md, §2). Or the
            rationale's tokens (:class:`SampledTokens`), which ``token_truncate`` and ``geometric`` need.
        correction: what is done to the ratio (``plain``, ``truncate`` at a cap, ``mask`` outside bounds; from the
            tokens' ratios, ``geometric``: their geometric mean as ρ_m, and ``token_truncate``: no ρ_m, each
            rationale token's score times its own min(r_t, cap), the baseline's share included: §11).

    Returns:
        ``loss`` and ``per_example`` (``[B]``) whose values are the plug-in estimate of l_q and
        whose gradients are Algorithm 1's per-example estimate (``loss`` averages over B).
    """
    q = check_q(q)
    _, samples = check_group_tensors(rationale_logprob=rationale_logprob, answer_logprob=answer_logprob)
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}; got baseline={baseline!r}")
    if baseline == "rloo":
        check_min_samples(samples, 2, "GARL's leave-one-out baseline (baseline='rloo')")

    if behavior_logprob is None:
        stats = weight_stats(answer_logprob, q)
        pathwise = torch.exp(stats.log_ratio)  # w_m / w̄^q
        loo_baseline = stats.loo_baseline() if baseline == "rloo" else 0.0
        score_logprob = rationale_logprob
    else:
        sample = correction.for_samples(rationale_logprob, behavior_logprob)
        stats = weight_stats(answer_logprob.detach() + sample.log_weight, q)  # of v_m = ρ̃_m w_m
        pathwise = torch.exp(stats.log_ratio) * sample.keep  # v_m / v̄^q (0 where masked, whatever v̄)
        loo_baseline = sample.weight * stats.loo_baseline() if baseline == "rloo" else 0.0
        score_logprob = sample.score_logprob
    score = pathwise - loo_baseline
    scale = (samples ** -q if normalize else 1.0) / samples
    surrogate = -scale * (score * finite_logprob(score_logprob) + pathwise * finite_logprob(answer_logprob)).sum(-1)
    per_example = with_value(surrogate, jq_loss(stats.log_mean, q))
    metrics = stats.metrics() if behavior_logprob is None else {**stats.metrics(), **sample.ratios.metrics()}
    if samples >= 2:  # of the score coefficients applied, under this baseline and normalisation (the pool's: rloo's, /M^q)
        metrics["max_amplified_advantage"] = (score.detach().abs() * (samples ** -q if normalize else 1.0)).max().item()
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


def rb_rloo(rationale_logprob: torch.Tensor, answer_logprob: torch.Tensor, *, normalize: bool = True,
            behavior_logprob: torch.Tensor | SampledTokens | None = None, correction: Correction = Correction()) -> ObjectiveOutput:
    """VeriFree's Rao-Blackwellised RLOO: GARL at q=0 (shapes and off-policy arguments as in :func:`garl`)."""
    return garl(rationale_logprob, answer_logprob, 0.0, baseline="rloo", normalize=normalize,
                behavior_logprob=behavior_logprob, correction=correction)


@dataclass(frozen=True)
class GarlOptions:
    baseline: str = option("rloo", "rloo: Alg. 1's leave-one-out control variate; none: the plug-in estimator",
                           choices=BASELINES)
    normalize: bool = option(True, "divide by M^q (Alg. 1's last line)")


@dataclass(frozen=True)
class RbRlooOptions:
    normalize: bool = option(True, "divide by M^q (1 at q=0)")


@register_objective("garl", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=True, min_samples=2, options=GarlOptions,
                    corrects_off_policy=True)
def garl_estimator(inputs: EstimatorInputs, options: GarlOptions) -> ObjectiveOutput:
    return garl(inputs.rationale_logprob, inputs.answer_logprob, inputs.q, baseline=options.baseline,
                normalize=options.normalize, **inputs.off_policy(inputs.rationale_mask))


@register_objective("rb_rloo", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=False, min_samples=2, options=RbRlooOptions,
                    corrects_off_policy=True)
def rb_rloo_estimator(inputs: EstimatorInputs, options: RbRlooOptions) -> ObjectiveOutput:
    return rb_rloo(inputs.rationale_logprob, inputs.answer_logprob, normalize=options.normalize,
                   **inputs.off_policy(inputs.rationale_mask))
