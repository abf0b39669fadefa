"""Importance ratios for rollouts sampled by another policy than the one being trained (docs/off_policy.md).

With z_m ~ π (a rollout engine with other numerics, or the policy of a step ago) the estimators take
ρ_m = p_θ(z_m|x) / π(z_m|x), in log space and detached, from the policy's and the engine's log-probs of
the sampled tokens. :class:`Correction` turns it into the ρ̃ they use everywhere (``plain``: ρ as is;
``truncate``: min(ρ, cap); ``mask``: ρ inside [low, high], 0 outside, the mean still over M) and reports
how far the two policies are apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nemo_jq.precision import upcast

CORRECTIONS = ("plain", "truncate", "mask")


@dataclass(frozen=True)
class Ratios:
    """Detached log ratios, all one shape (``[B, M]`` sequence-level, or ``[B, M, T]`` token-level)."""

    #: log ρ, as sampled.
    log_ratio: torch.Tensor
    #: log ρ̃ (``-inf`` where masked).
    log_corrected: torch.Tensor
    #: 1 where the sample (or token) is kept, 0 where masked.
    keep: torch.Tensor
    #: Where the ratios count (token-level: the sampled tokens); None: everywhere.
    where: torch.Tensor | None = None

    @property
    def corrected(self) -> torch.Tensor:
        """ρ̃ (0 where masked)."""
        return torch.exp(self.log_corrected)

    def metrics(self) -> dict[str, float]:
        """The ratio's mean, min and max, and the share truncated or masked, over ``where`` (per sequence, or per
        token for a token-level correction)."""
        where = torch.ones_like(self.keep, dtype=torch.bool) if self.where is None else self.where
        if not bool(where.any()):
            return {}
        ratio = torch.exp(self.log_ratio[where].clamp(max=80.0))
        truncated = (self.log_corrected < self.log_ratio) & (self.keep > 0)
        return {"is_ratio_mean": ratio.mean().item(), "min_is_ratio": ratio.min().item(), "max_is_ratio": ratio.max().item(),
                "is_truncated_fraction": truncated[where].float().mean().item(),
                "is_masked_fraction": (1 - self.keep[where]).mean().item()}


@dataclass(frozen=True)
class Correction:
    """What is done to the importance ratio: ``plain`` uses it as is (unbiased at q=0, variance unbounded),
    ``truncate`` caps it at ``cap`` (TIS), ``mask`` zeroes it outside ``[low, high]`` (MIS, the mean still over M)."""

    mode: str = "truncate"
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTIONS:
            raise ValueError(f"correction mode must be one of {CORRECTIONS}; got {self.mode!r}")
        if not (self.cap >= 1.0 and 0.0 <= self.low <= 1.0 <= self.high):
            raise ValueError(f"need cap >= 1 and low <= 1 <= high; got cap={self.cap}, low={self.low}, high={self.high}")

    def ratios(self, logprob: torch.Tensor, behavior_logprob: torch.Tensor, where: torch.Tensor | None = None) -> Ratios:
        """ρ = exp(logprob - behavior_logprob), detached, corrected; ``where`` (a bool mask) limits what counts (0
        elsewhere). The one check of the behaviour log-probs every estimator relies on: the policy's shape, and
        neither NaN nor +inf where they count."""
        if behavior_logprob.shape != logprob.shape:
            raise ValueError(f"shape mismatch: behavior_logprob{list(behavior_logprob.shape)} must match the policy's "
                             f"log-probs{list(logprob.shape)}")
        behavior = upcast(behavior_logprob.detach())
        log_ratio = upcast(logprob.detach()) - behavior
        if where is not None:
            log_ratio, behavior = log_ratio.masked_fill(~where, 0.0), behavior.masked_fill(~where, 0.0)
        if torch.isnan(log_ratio).any() or (behavior == math.inf).any():
            raise ValueError("behavior_logprob has NaN or +inf where it counts: the rollout engine must report the "
                             "log-prob of every sampled token it is corrected for (or set objective.importance=none)")
        keep = torch.ones_like(log_ratio)
        corrected = log_ratio
        if self.mode == "truncate":
            corrected = log_ratio.clamp(max=math.log(self.cap))
        elif self.mode == "mask":
            keep = ((log_ratio >= math.log(self.low)) & (log_ratio <= math.log(self.high))).to(log_ratio.dtype)
            corrected = log_ratio.masked_fill(keep == 0, -math.inf)
        return Ratios(log_ratio, corrected, keep, where)


def k3_kl(policy_logprob: torch.Tensor, behavior_logprob: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Per-token ``r - 1 - log r`` with ``r = p_θ / π`` over the sampled tokens ``where``: under samples from π its
    sum over a sequence estimates KL(π ‖ p_θ) without bias (each term >= 0); the mean per token is returned."""
    log_r = (upcast(policy_logprob.detach()) - upcast(behavior_logprob.detach()))[where]
    return (torch.expm1(log_r) - log_r).mean() if log_r.numel() else log_r.new_zeros(())
