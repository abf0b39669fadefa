"""PAFT: Posterior-Attenuated Fine-Tuning (the paper's Algorithm 2).

Resamples K rationales in proportion to w_m (importance resampling toward the
posterior p(z|x,y*)) and fine-tunes on (z_r, y*), attenuated by w̄^{1-q}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.checks import check_group_tensors, check_q
from nemo_jq.objectives.importance import Correction, SampledTokens
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.qlog import jq_loss
from nemo_jq.objectives.registry import register_objective
from nemo_jq.objectives.weights import finite_logprob, weight_stats, with_value
from nemo_jq.typed import option


def resample_indices(log_w: torch.Tensor, num_resamples: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B, K]`` indices drawn with replacement from Categorical(logits = log w) (``log_w``: ``[B, M]``).

    The softmax subtracts the row maximum, so groups whose every w underflows still resample.
    """
    probs = torch.softmax(finite_logprob(log_w), dim=-1)
    return torch.multinomial(probs, num_resamples, replacement=True, generator=generator)


def paft(
    rationale_logprob: torch.Tensor,
    answer_logprob: torch.Tensor,
    q: float,
    *,
    num_resamples: int | None = None,
    normalize: bool = True,
    generator: torch.Generator | None = None,
    behavior_logprob: torch.Tensor | SampledTokens | None = None,
    correction: Correction = Correction(),
) -> ObjectiveOutput:
    """PAFT loss for B prompts x M sampled rationales.

    Args:
        rationale_logprob: ``[B, M]``, ``log p(z_m | x_b)`` (differentiable).
        answer_logprob: ``[B, M]``, ``log p(y*_b | x_b, z_m)`` (differentiable).
        q: commitment in [0, 1].
        num_resamples: K, the number of indices resampled per prompt (default M).
        normalize: divide by ``M^q`` as GARL does, so both share one learning rate scale.
        generator: RNG for the resampling, for reproducible runs.
        behavior_logprob, correction: rationales sampled by another policy π, as in :func:`~nemo_jq.objectives.garl`:
            indices are resampled in proportion to v_m = ρ̃_m w_m, which targets the same posterior p_θ(z|x,y*), and
            the attenuation is v̄^{1-q}; its expectation equals off-policy GARL's (docs/off_policy.md, §4). With
            ``token_truncate`` (the rationale's tokens given) ρ̃_m = 1 and each resampled rationale token's term is
            multiplied by its own min(r_t, cap) (§11).

    Per-example gradient: ``-(w̄^{1-q} / (M^q K)) Σ_k ∇[log p(z_{r_k}|x) + log p(y*|x, z_{r_k})]``.
    ``metrics["ess"]`` is the effective sample size of the weights (1 = degenerate).
    """
    q = check_q(q)
    _, samples = check_group_tensors(rationale_logprob=rationale_logprob, answer_logprob=answer_logprob)
    k = samples if num_resamples is None else int(num_resamples)
    if k < 1:
        raise ValueError(f"num_resamples must be >= 1; got num_resamples={num_resamples!r}")

    sample = None if behavior_logprob is None else correction.for_samples(rationale_logprob, behavior_logprob)
    stats = weight_stats(answer_logprob if sample is None else answer_logprob.detach() + sample.log_weight, q)
    picks = resample_indices(stats.log_w, k, generator)
    counts = torch.zeros_like(stats.log_w).scatter_add_(-1, picks, torch.ones_like(picks, dtype=stats.log_w.dtype))
    if sample is not None:
        counts = counts * sample.keep  # an all-masked group would resample among its masked samples
    attenuation = torch.exp((1.0 - q) * stats.log_mean)  # w̄^{1-q}
    scale = attenuation * (samples ** -q if normalize else 1.0) / k
    score_logprob = rationale_logprob if sample is None else sample.score_logprob
    joint_logprob = finite_logprob(score_logprob) + finite_logprob(answer_logprob)
    surrogate = -scale * (counts * joint_logprob).sum(-1)
    per_example = with_value(surrogate, jq_loss(stats.log_mean, q))
    metrics = stats.metrics() if sample is None else {**stats.metrics(), **sample.ratios.metrics()}
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


@dataclass(frozen=True)
class PaftOptions:
    num_resamples: int | None = option(None, "K, indices resampled per prompt (null = M)", ge=1)
    normalize: bool = option(True, "divide by M^q, as GARL does")


@register_objective("paft", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=True, min_samples=1, options=PaftOptions,
                    corrects_off_policy=True)
def paft_estimator(inputs: EstimatorInputs, options: PaftOptions) -> ObjectiveOutput:
    return paft(inputs.rationale_logprob, inputs.answer_logprob, inputs.q, num_resamples=options.num_resamples,
                normalize=options.normalize, generator=inputs.generator, **inputs.off_policy(inputs.rationale_mask))
