"""Verifier-free baselines that users compare GARL and PAFT against (issue 33), on the same rollouts: M rationales
per prompt with the reference answer y* teacher-forced after each. Neither estimates a J_Q gradient.

- :func:`rlpr`: RLPR's probability reward (Yu et al. 2025, "RLPR: Extrapolating RLVR to General Domains without
  Verifiers", arXiv:2506.18254) with a group baseline.
- :func:`garl_length_normalized`: GARL on the per-token geometric mean of p(y*|x,z), a length-normalised likelihood.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.checks import check_group_tensors, check_min_samples, check_token_tensors
from nemo_jq.objectives.garl import GarlOptions, garl
from nemo_jq.objectives.grpo import group_advantages
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.qlog import jq_loss
from nemo_jq.objectives.registry import register_objective
from nemo_jq.objectives.weights import finite_logprob, weight_stats, with_value
from nemo_jq.precision import upcast
from nemo_jq.typed import option

#: RLPR's group baselines: GRPO's mean and std of the group ("group": verl's GRPO advantage, which RLPR's released
#: trainer uses with its std filter), or the mean alone ("none").
RLPR_SCALINGS = ("group", "none")


def rlpr(rationale_logprob: torch.Tensor, answer_token_logprob: torch.Tensor, answer_mask: torch.Tensor, *,
         no_reasoning_reward: torch.Tensor | None = None, scale_rewards: str = "group", eps: float = 1e-6,
         min_reward_std: float = 0.0) -> ObjectiveOutput:
    """RLPR's reward as a REINFORCE reward on the sampled rationales, with a group baseline.

    Reward (Yu et al. 2025, arXiv:2506.18254, "probability-based reward" and "reward debiasing"): the mean per-token
    probability of y* after z, ``r_m = (1/|y*|) Σ_t p(y*_t | x, z_m, y*_<t)``, minus ``r'``, the same with no
    reasoning, clipped: ``r̂_m = clip(r_m - r', 0, 1)``. Advantage: ``(r̂_m - mean r̂) / (std r̂ + eps)`` (GRPO's
    group normalisation, ``scale_rewards="group"``, the advantage of RLPR's released verl trainer) or
    ``r̂_m - mean r̂`` (``"none"``); a group whose std of r̂ is below ``min_reward_std`` gets none (RLPR's std
    filter, with a fixed threshold where RLPR moves it by an EMA).

    The reward is detached: the gradient is ``-(1/M) Σ_m A_m ∇log p(z_m|x)``. With ``"none"`` its expectation is
    ``-(1 - 1/M) ∇_θ E_{z~p(z|x)}[r̂(z)]`` with r̂ held fixed (the mean baseline includes the sample itself); nothing
    trains p(y*|x,z) directly. RLPR's own rollouts also sample an answer and train on it; these rollouts sample z
    only. ``r'`` is a constant of the prompt, so it cancels in the group baseline except through the clip at 0.

    Args:
        rationale_logprob: ``[B, M]`` ``log p(z_m|x)`` (differentiable).
        answer_token_logprob: ``[B, M, T]`` teacher-forced log-prob of each y* token after z_m (only its value is used).
        answer_mask: ``[B, M, T]`` true on y*'s tokens.
        no_reasoning_reward: ``[B]`` r', the mean per-token probability of y* right after the prompt with an empty
            thinking block; None: 0 (no debiasing; the registered estimator has no such rows to score).
    """
    batch, samples = check_group_tensors(rationale_logprob=rationale_logprob)
    check_min_samples(samples, 2, "RLPR's group baseline and std filter")
    check_token_tensors(answer_mask, answer_token_logprob=answer_token_logprob)
    if answer_mask.shape[:2] != rationale_logprob.shape:
        raise ValueError(f"shape mismatch: answer_mask{list(answer_mask.shape)} must be [B, M, T] for "
                         f"rationale_logprob{list(rationale_logprob.shape)}")
    if scale_rewards not in RLPR_SCALINGS:
        raise ValueError(f"scale_rewards must be one of {RLPR_SCALINGS}; got scale_rewards={scale_rewards!r}")
    mask = upcast(answer_mask)
    token_probs = torch.exp(upcast(answer_token_logprob.detach())) * mask
    reward = token_probs.sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B, M]
    baseline = torch.zeros(batch, 1, dtype=reward.dtype, device=reward.device) if no_reasoning_reward is None else \
        upcast(no_reasoning_reward.detach()).to(reward.device).view(batch, 1)
    debiased = (reward - baseline).clamp(0.0, 1.0)
    kept = debiased.std(-1, keepdim=True) >= min_reward_std
    advantages = group_advantages(debiased, scale_rewards=scale_rewards, eps=eps) * kept
    per_example = -(advantages * finite_logprob(rationale_logprob)).mean(-1)
    answer_stats = weight_stats((upcast(answer_token_logprob.detach()) * mask).sum(-1), 0.0)
    metrics = {"reward": debiased.mean().item(), "probability_reward": reward.mean().item(),
               "filtered_fraction": 1.0 - kept.to(reward.dtype).mean().item(),
               "max_abs_advantage": advantages.abs().max().item(),
               "log_p_hat": answer_stats.log_mean.mean().item(), "p_hat": torch.exp(answer_stats.log_mean).mean().item()}
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


def garl_length_normalized(rationale_logprob: torch.Tensor, answer_logprob: torch.Tensor, answer_tokens: torch.Tensor,
                           q: float, *, baseline: str = "rloo", normalize: bool = True) -> ObjectiveOutput:
    """GARL (Alg. 1) with w_m replaced by its geometric mean per token, ``w̃_m = w_m^{1/|y*|}``.

    **Not ℓ_q**: it is GARL's gradient of ``-log_q P̃`` with ``P̃ = E_{z~p(z|x)}[p(y*|x,z)^{1/|y*|}]``, which is no
    probability of y* (P̃ ≥ P, as w^{1/|y*|} ≥ w). Against ∇ℓ_q, whenever |y*| > 1: the score term follows a flatter
    posterior, ``w̃_m/w̃_j = (w_m/w_j)^{1/|y*|}``, with coefficients ``w̃_m/w̃̄^q - (w̃̄_¬m)^{1-q}``, and the pathwise
    term is ``(w̃_m/w̃̄^q)(1/|y*|) ∇log p(y*|x,z_m)``. It is unbiased for ∇(-log_q P̃) at q=0 and has GARL's finite-M
    bias for it otherwise; with a one-token y* it is GARL. The value and ``log_p_hat`` are the true plug-in l_q and
    log P̂ (of w, not w̃), comparable with GARL's; ``per_token_log_p_hat`` is the log of the mean w̃.

    Args:
        rationale_logprob, answer_logprob: ``[B, M]`` as :func:`~nemo_jq.objectives.garl` (differentiable).
        answer_tokens: ``[B, M]`` |y*|, the tokens ``answer_logprob`` sums over.
    """
    check_group_tensors(answer_logprob=answer_logprob, answer_tokens=answer_tokens)
    per_token = garl(rationale_logprob, answer_logprob / upcast(answer_tokens).clamp(min=1.0), q, baseline=baseline,
                     normalize=normalize)
    true = weight_stats(answer_logprob, q)
    per_example = with_value(per_token.per_example, jq_loss(true.log_mean, q))
    metrics = {**true.metrics(), "per_token_log_p_hat": per_token.metrics["log_p_hat"]}
    if "max_amplified_advantage" in per_token.metrics:  # the coefficients applied are w̃'s
        metrics["max_amplified_advantage"] = per_token.metrics["max_amplified_advantage"]
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


@dataclass(frozen=True)
class RlprOptions:
    scale_rewards: str = option("group", "group: GRPO's (r̂ - mean) / (std + eps), as RLPR's trainer; none: r̂ - mean",
                                choices=RLPR_SCALINGS)
    eps: float = option(1e-6, "added to the group's std", gt=0.0)
    min_reward_std: float = option(0.0, "RLPR's std filter: groups whose r̂ std is below it get no gradient (0 = off)",
                                   ge=0.0)


@register_objective("rlpr", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=False, min_samples=2, options=RlprOptions)
def rlpr_estimator(inputs: EstimatorInputs, options: RlprOptions) -> ObjectiveOutput:
    return rlpr(inputs.rationale_logprob, inputs.per_sample(inputs.token_logprob), inputs.per_sample(inputs.answer_mask),
                scale_rewards=options.scale_rewards, eps=options.eps, min_reward_std=options.min_reward_std)


@register_objective("garl_length_normalized", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=True, min_samples=2,
                    options=GarlOptions)
def garl_length_normalized_estimator(inputs: EstimatorInputs, options: GarlOptions) -> ObjectiveOutput:
    answer_tokens = inputs.answer_mask.sum(-1).view(inputs.num_prompts, -1)
    return garl_length_normalized(inputs.rationale_logprob, inputs.answer_logprob, answer_tokens, inputs.q,
                                  baseline=options.baseline, normalize=options.normalize)
