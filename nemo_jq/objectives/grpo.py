"""GRPO: group-normalised advantages with a PPO-clipped token-level ratio loss (baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.checks import check_group_tensors, check_min_samples, check_token_tensors
from nemo_jq.objectives.importance import Correction
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.registry import register_objective
from nemo_jq.precision import upcast
from nemo_jq.typed import option

AGGREGATIONS = ("token_mean", "sequence_mean")
#: What the centred rewards are divided by: each group's std, the whole batch's std, or nothing.
SCALINGS = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor, *, scale_rewards: str = "group", eps: float = 1e-6, batch_rewards: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, M]`` advantages ``(r - mean_M r) / (std + eps)`` with std (unbiased) per ``scale_rewards``.

    ``"group"``: each prompt's std over its M rewards; ``"batch"``: the std of every reward in
    ``batch_rewards`` (default ``rewards``: pass the whole optimizer batch's when this call sees a
    micro-batch); ``"none"``: ``r - mean`` unscaled (Dr. GRPO). These are TRL's ``scale_rewards``.

    A group whose rewards are all equal has no advantage: exactly 0, where its mean's rounding (12 rewards of 0.97 in
    fp32: 1.8e-7 off) over a std of the same size gave every sample -0.15.
    """
    if scale_rewards not in SCALINGS:
        raise ValueError(f"scale_rewards must be one of {SCALINGS}; got scale_rewards={scale_rewards!r}")
    tied = rewards.amax(-1, keepdim=True) == rewards.amin(-1, keepdim=True)
    centred = torch.where(tied, 0.0, rewards - rewards.mean(-1, keepdim=True))
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        return centred / (rewards.std(-1, keepdim=True) + eps)
    pool = rewards if batch_rewards is None else batch_rewards.to(rewards)
    return centred / (pool.std() + eps)


def grpo(
    logprob: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logprob: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    scale_rewards: str = "group",
    eps: float = 1e-6,
    aggregation: str = "token_mean",
    tokens_per_example: float | None = None,
    batch_rewards: torch.Tensor | None = None,
    behavior_logprob: torch.Tensor | None = None,
    correction: Correction = Correction(),
) -> ObjectiveOutput:
    """GRPO loss for B prompts x M sampled completions of up to T tokens.

    Args:
        logprob: ``[B, M, T]`` current-policy log-prob of each sampled token (differentiable).
        rewards: ``[B, M]`` scalar reward per completion (exact match in the paper).
        mask: ``[B, M, T]`` 1 on completion tokens that count, 0 on prompt and padding.
        old_logprob: ``[B, M, T]`` log-probs under the sampling policy; ``None`` means on-policy,
            where the ratio is 1 and the gradient is exactly ``-A ∇log p`` averaged over tokens.
        clip_eps, clip_eps_high: the PPO clip range ``[1 - clip_eps, 1 + clip_eps_high]``.
        scale_rewards, eps: advantages ``(r - group mean) / (std + eps)``, std per group
            (``"group"``), over the batch (``"batch"``) or none (``"none"``); see
            :func:`group_advantages`. TRL 1.16's defaults are ``scale_rewards="group", eps=1e-4``.
        aggregation: ``"token_mean"`` (every token of the batch weighs the same) or
            ``"sequence_mean"`` (token mean within a completion, then mean over completions).
        tokens_per_example: for ``token_mean``, the completion tokens per prompt averaged over the
            whole optimizer batch. A trainer that splits a batch into micro-batches passes it so
            that the summed micro-batch gradients equal the full batch's; default: this call's own.
        batch_rewards: ``[B_total, M]`` rewards of the whole optimizer batch, for
            ``scale_rewards="batch"`` under micro-batching; default: ``rewards``.
        behavior_logprob: ``[B, M, T]`` log-probs of the sampled tokens under the policy that sampled them (a rollout
            engine, an older policy); None: ``old_logprob``'s policy itself. Each token's loss is then multiplied by
            the corrected token ratio ``ρ̃_t`` of ``old_logprob`` (or the current policy) to it: the decoupled
            truncated importance sampling of verl and NeMo-RL (docs/off_policy.md, §5); ``token_truncate`` is
            ``truncate``, and ``geometric`` gives every token of a completion the geometric mean of its ratios,
            truncated (§11).

    TRL's ``loss_type``: ``aggregation="token_mean"`` with a trainer-supplied global
    ``tokens_per_example`` is TRL's ``"dapo"``; ``"sequence_mean"`` is TRL's ``"grpo"``.
    """
    batch, samples = check_group_tensors(rewards=rewards)
    check_min_samples(samples, 2, "GRPO's group normalisation")
    if old_logprob is None:
        old_logprob = logprob.detach()
    check_token_tensors(mask, logprob=logprob, old_logprob=old_logprob)
    if mask.shape[:2] != rewards.shape:
        raise ValueError(f"shape mismatch: mask{list(mask.shape)} must be [B, M, T] for rewards{list(rewards.shape)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got aggregation={aggregation!r}")

    mask = upcast(mask)
    advantages = group_advantages(
        upcast(rewards), scale_rewards=scale_rewards, eps=eps, batch_rewards=batch_rewards
    ).unsqueeze(-1)
    # padding's log-probs (-inf, -1e4 in old_logprob) never reach the exponential: its ratio is 1, its gradient 0
    ratio = torch.exp(torch.where(mask.bool(), upcast(logprob) - upcast(old_logprob), 0.0))
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    token_loss = torch.maximum(-ratio * advantages, -clipped * advantages) * mask
    off_policy = {}
    if behavior_logprob is not None:
        ratios = correction.ratios(old_logprob, behavior_logprob, where=mask.bool())
        weight = ratios.corrected
        if correction.mode == "geometric":  # one ratio per completion
            ratios = correction.per_sample(ratios)
            weight = ratios.corrected.unsqueeze(-1)
        token_loss, off_policy = token_loss * weight, ratios.metrics()

    if aggregation == "token_mean":
        if tokens_per_example is None:
            tokens_per_example = mask.sum().clamp(min=1.0) / batch
        per_example = token_loss.sum((-1, -2)) / tokens_per_example
    else:
        per_sequence = token_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)
        per_example = per_sequence.mean(-1)
    clipped_tokens = (-clipped * advantages > -ratio * advantages).float() * mask  # the clip taken: no gradient there
    metrics = {
        "reward": upcast(rewards).mean().item(),
        "clip_fraction": (clipped_tokens.sum() / mask.sum().clamp(min=1.0)).item(), "completion_tokens": int(mask.sum()),
        "max_abs_advantage": advantages.abs().max().item(),
        **off_policy,
    }
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


@dataclass(frozen=True)
class GrpoOptions:
    clip_eps: float = option(0.2, "PPO clip range below 1 (and above, unless clip_eps_high)", gt=0.0)
    clip_eps_high: float | None = option(None, "PPO clip range above 1 (DAPO's clip-higher); null = clip_eps", gt=0.0)
    scale_rewards: str = option("group", "divide centred rewards by the group's std, the batch's, or nothing",
                                choices=SCALINGS)
    eps: float = option(1e-6, "added to the std (TRL 1.16 uses 1e-4)", gt=0.0)
    aggregation: str = option("token_mean", "token_mean (TRL's dapo) or sequence_mean (TRL's grpo)",
                              choices=AGGREGATIONS)


@register_objective("grpo", needs={Need.SAMPLED_ANSWER_REWARD}, uses_q=False, min_samples=2, options=GrpoOptions,
                    corrects_off_policy=True)
def grpo_estimator(inputs: EstimatorInputs, options: GrpoOptions) -> ObjectiveOutput:
    """One optimizer step per batch of rollouts: PPO's ratio is to the policy before this step, 1 (its clip never
    acts); rollouts another policy sampled (one step off, another engine) are corrected by ``objective.importance``."""
    return grpo(inputs.per_sample(inputs.token_logprob), inputs.rewards, inputs.per_sample(inputs.target_mask),
                clip_eps=options.clip_eps, clip_eps_high=options.clip_eps_high, scale_rewards=options.scale_rewards,
                eps=options.eps, aggregation=options.aggregation, tokens_per_example=inputs.tokens_per_example,
                batch_rewards=inputs.batch_rewards, **inputs.off_policy_tokens())
