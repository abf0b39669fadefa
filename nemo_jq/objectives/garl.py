"""GARL: Gradient-Amplified RL (the paper's Algorithm 1).

Samples z_m from the prior, weights them by the teacher-forced reference-answer
likelihood w_m, and amplifies the RL gradient by the plug-in estimate w̄^{-q} of
P^{-q}. q=0 is VeriFree's Rao-Blackwellised RLOO; q=1 is the IWAE gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.checks import check_group_tensors, check_min_samples, check_q
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
) -> ObjectiveOutput:
    """GARL loss for B prompts x M sampled rationales.

    Args:
        rationale_logprob: ``[B, M]``, ``log p(z_m | x_b)`` summed over rationale tokens (differentiable).
        answer_logprob: ``[B, M]``, ``log p(y*_b | x_b, z_m)`` by teacher forcing (differentiable).
        q: commitment in [0, 1].
        baseline: ``"rloo"`` centres the score coefficient by ``(w̄_¬m)^{1-q}`` (Alg. 1, needs M>=2);
            ``"none"`` gives the plug-in estimator ``ḡ_M / w̄^q``.
        normalize: divide by ``M^q`` so that ``|c_m| / M^q <= 1`` for every q (Alg. 1's last line).

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

    stats = weight_stats(answer_logprob, q)
    pathwise = torch.exp(stats.log_ratio)  # w_m / w̄^q
    score = pathwise - stats.loo_baseline() if baseline == "rloo" else pathwise
    scale = (samples ** -q if normalize else 1.0) / samples
    surrogate = -scale * (score * finite_logprob(rationale_logprob) + pathwise * finite_logprob(answer_logprob)).sum(-1)
    per_example = with_value(surrogate, jq_loss(stats.log_mean, q))
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=stats.metrics())


def rb_rloo(rationale_logprob: torch.Tensor, answer_logprob: torch.Tensor, *, normalize: bool = True) -> ObjectiveOutput:
    """VeriFree's Rao-Blackwellised RLOO: GARL at q=0 (shapes as in :func:`garl`)."""
    return garl(rationale_logprob, answer_logprob, 0.0, baseline="rloo", normalize=normalize)


@dataclass(frozen=True)
class GarlOptions:
    baseline: str = option("rloo", "rloo: Alg. 1's leave-one-out control variate; none: the plug-in estimator",
                           choices=BASELINES)
    normalize: bool = option(True, "divide by M^q (Alg. 1's last line)")


@dataclass(frozen=True)
class RbRlooOptions:
    normalize: bool = option(True, "divide by M^q (1 at q=0)")


@register_objective("garl", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=True, min_samples=2, options=GarlOptions)
def garl_estimator(inputs: EstimatorInputs, options: GarlOptions) -> ObjectiveOutput:
    return garl(inputs.rationale_logprob, inputs.answer_logprob, inputs.q, baseline=options.baseline,
                normalize=options.normalize)


@register_objective("rb_rloo", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=False, min_samples=2, options=RbRlooOptions)
def rb_rloo_estimator(inputs: EstimatorInputs, options: RbRlooOptions) -> ObjectiveOutput:
    return rb_rloo(inputs.rationale_logprob, inputs.answer_logprob, normalize=options.normalize)
