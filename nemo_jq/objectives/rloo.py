"""RLOO: REINFORCE with a leave-one-out baseline over sampled answers' rewards (baseline)."""

from __future__ import annotations

import torch

from nemo_jq.objectives.checks import check_group_tensors, check_min_samples
from nemo_jq.objectives.importance import Correction, SampledTokens
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.registry import NoOptions, register_objective
from nemo_jq.precision import upcast


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``[B, M]`` advantages ``r_m - mean_{j != m} r_j``."""
    samples = rewards.shape[-1]
    return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (samples - 1)


def rloo(sequence_logprob: torch.Tensor, rewards: torch.Tensor, *,
         behavior_logprob: torch.Tensor | SampledTokens | None = None, correction: Correction = Correction()) -> ObjectiveOutput:
    """RLOO loss for B prompts x M sampled completions.

    Args:
        sequence_logprob: ``[B, M]`` ``log p(z_m, ŷ_m | x)`` of each whole sampled completion (differentiable).
        rewards: ``[B, M]`` reward per completion (binary exact match in the paper).
        behavior_logprob: ``[B, M]`` ``log π(z_m, ŷ_m | x)`` under the policy that sampled the completion (None: the
            policy itself); each advantage, its leave-one-out baseline included, is then multiplied by the corrected
            sequence ratio ρ̃_m (unbiased with ``Correction("plain")``: docs/off_policy.md, §5). Or the completion's
            tokens (:class:`SampledTokens`): ``geometric`` takes their geometric-mean ratio as ρ_m, ``token_truncate``
            multiplies each token's term by its own min(r_t, cap) instead (§11).

    Per-example gradient: ``-(1/M) Σ_m (r_m - mean_{j≠m} r_j) ∇log p(z_m, ŷ_m | x)``, unbiased for
    ``-∇E[r]``.
    """
    _, samples = check_group_tensors(sequence_logprob=sequence_logprob, rewards=rewards)
    check_min_samples(samples, 2, "RLOO's leave-one-out baseline")
    advantages = leave_one_out_advantages(upcast(rewards))
    metrics, score_logprob = {}, sequence_logprob
    if behavior_logprob is not None:
        sample = correction.for_samples(sequence_logprob, behavior_logprob)
        advantages, score_logprob, metrics = advantages * sample.weight, sample.score_logprob, sample.ratios.metrics()
    per_example = -(advantages * upcast(score_logprob)).mean(-1)
    metrics = {"reward": upcast(rewards).mean().item(), "max_abs_advantage": advantages.abs().max().item(), **metrics}
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


@register_objective("rloo", needs={Need.SAMPLED_ANSWER_REWARD}, uses_q=False, min_samples=2,
                    corrects_off_policy=True)
def rloo_estimator(inputs: EstimatorInputs, options: NoOptions) -> ObjectiveOutput:
    return rloo(inputs.sequence_logprob, inputs.rewards, **inputs.off_policy(inputs.target_mask))
