"""MaxRL: Maximum Likelihood Reinforcement Learning's advantage on verifier rewards (baseline, issue 33).

Tajwar, Zeng et al. 2026, "Maximum Likelihood Reinforcement Learning", arXiv:2602.02710
(https://zanette-labs.github.io/MaxRL): the group-mean-normalised advantage ``(r_m - r̄)/r̄``, 0 where ``r̄ = 0``.
With P counted from verifier hits (w_m = r_m), it is GARL's q=1 score coefficient ``w_m/w̄ - (w̄_¬m)^0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.checks import check_group_tensors, check_min_samples
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.registry import register_objective
from nemo_jq.precision import upcast
from nemo_jq.typed import option


def maxrl(sequence_logprob: torch.Tensor, rewards: torch.Tensor, *, control_variate: bool = True) -> ObjectiveOutput:
    """MaxRL loss for B prompts x M sampled completions scored by a verifier.

    Per-example gradient ``-(1/M) Σ_m A_m ∇log p(z_m, ŷ_m | x)`` with ``A_m = (r_m - r̄)/r̄`` (``control_variate``,
    the form MaxRL trains with) or ``A_m = r_m/r̄`` (the mean score of the hits alone, MaxRL's Theorem), both 0 in a
    group without a hit. For binary rewards with success probability P, exactly (tests/unit/objectives/test_estimator_variants.py):

    - without the control variate, ``E[ĝ] = -(1 - (1-P)^M)/P ∇P``: the gradient of MaxRL's order-M truncation
      ``-Σ_{k≤M} (1-P)^k/k`` of ``log P``, unbiased for it;
    - with it, ``E[ĝ] = -(1 - (1-P)^{M-1})/P ∇P``, the order-(M-1) truncation: subtracting the group's mean score only
      where some sample hit is not mean-zero (it removes ``(1-P)^{M-1} ∇P``); at M=1 the gradient is 0.

    Both tend to ``-∇log P`` (ℓ_1) as M grows. Rewards must be >= 0 (a hit's reward divides by the group mean).

    Args:
        sequence_logprob: ``[B, M]`` ``log p(z_m, ŷ_m | x)`` of each whole sampled completion (differentiable).
        rewards: ``[B, M]`` the verifier's reward of each completion (binary exact match here).
    """
    _, samples = check_group_tensors(sequence_logprob=sequence_logprob, rewards=rewards)
    if control_variate:
        check_min_samples(samples, 2, "MaxRL's centred advantage (control_variate=True)")
    rewards = upcast(rewards)
    if (rewards < 0).any():
        raise ValueError(f"MaxRL divides by the group's mean reward, so rewards must be >= 0; got min "
                         f"{rewards.min().item()}")
    mean = rewards.mean(-1, keepdim=True)
    hit = mean > 0
    centred = rewards - mean if control_variate else rewards
    advantages = torch.where(hit, centred / torch.where(hit, mean, 1.0), 0.0)
    per_example = -(advantages * upcast(sequence_logprob)).mean(-1)
    metrics = {"reward": mean.mean().item(), "max_abs_advantage": advantages.abs().max().item(),
               "groups_with_a_hit": hit.to(rewards.dtype).mean().item()}
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


@dataclass(frozen=True)
class MaxrlOptions:
    control_variate: bool = option(True, "(r - r̄)/r̄ as MaxRL trains; false: r/r̄, the hits' mean score alone (the "
                                   "trainer asks rollout.num_samples >= 2 either way)")


@register_objective("maxrl", needs={Need.SAMPLED_ANSWER_REWARD}, uses_q=False, min_samples=2, options=MaxrlOptions)
def maxrl_estimator(inputs: EstimatorInputs, options: MaxrlOptions) -> ObjectiveOutput:
    return maxrl(inputs.sequence_logprob, inputs.rewards, control_variate=options.control_variate)
