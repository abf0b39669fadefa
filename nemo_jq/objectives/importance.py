"""Importance ratios for rollouts sampled by another policy than the one being trained (docs/off_policy.md).

With z_m ~ π (a rollout engine with other numerics, or the policy of a step ago) the estimators take
ρ_m = p_θ(z_m|x) / π(z_m|x), in log space and detached, from the policy's and the engine's log-probs of
the sampled tokens. :class:`Correction` turns it into the ρ̃ they use everywhere (``plain``: ρ as is;
``truncate``: min(ρ, cap); ``mask``: ρ inside [low, high], 0 outside, the mean still over M) and reports
how far the two policies are apart. Over rationales of thousands of tokens ρ spreads over e^±several, so two
forms work from the per-token ratios r_t instead (docs/off_policy.md, §11): ``token_truncate`` gives each
sampled token's term its own min(r_t, cap) and no sample a weight (TIS at token level, as verl, NeMo-RL and
TRL's ``token_truncate``), ``geometric`` weights each sample by min(exp(mean_t log r_t), cap) (GSPO's
length-normalised ratio). Both are biased; neither concentrates the group's weight on a few samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nemo_jq.corrections import CORRECTIONS, PER_TOKEN_CORRECTIONS
from nemo_jq.precision import upcast


@dataclass(frozen=True)
class SampledTokens:
    """The sampled tokens an importance ratio covers, one log-prob each (``[B, M, T]``, samples as the estimators'
    ``[B, M]``): what the per-token corrections need, where the others take the span's sums."""

    #: p_θ's log-probs (differentiable); summed over ``mask`` they are the estimator's sequence log-prob.
    policy_logprob: torch.Tensor
    #: π's log-probs (anything off ``mask``).
    behavior_logprob: torch.Tensor
    #: bool: the span's sampled tokens.
    mask: torch.Tensor


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

    def sample_log_weight(self) -> torch.Tensor:
        """``[B, M]`` log of the weight each sample carries: ρ̃_m, or for token-level ratios the mean of ρ̃_t over
        the sample's tokens (0 for a sample without any: ratio 1)."""
        if self.where is None:
            return self.log_corrected
        tokens = self.where.sum(-1)
        log_sum = torch.logsumexp(self.log_corrected.masked_fill(~self.where, -math.inf), -1)
        return torch.where(tokens > 0, log_sum - torch.log(tokens.clamp(min=1).to(log_sum.dtype)), 0.0)

    def metrics(self) -> dict[str, float]:
        """The ratio's mean, min and max, the share truncated or masked and the ratios' mass truncated, over ``where``
        (per sequence, or per token for a token-level correction); and the effective sample size of each group's sample weights,
        ``(Σw)² / Σw²`` over M, as a fraction of M: its mean over groups and the least (1/M: one sample holds the
        group's weight; 0: none does)."""
        where = torch.ones_like(self.keep, dtype=torch.bool) if self.where is None else self.where
        if not bool(where.any()):
            return {}
        ratio = torch.exp(self.log_ratio[where].clamp(max=80.0))
        truncated = (self.log_corrected < self.log_ratio) & (self.keep > 0)
        ess = effective_sample_fraction(self.sample_log_weight())
        # the ratios' mass the cap took off, Σ(ρ − ρ̃)/Σρ (masked ones left out: the masked fraction counts them)
        whole = ratio.double()
        cut = (whole - torch.exp(self.log_corrected[where].double())) * truncated[where]
        return {"is_ratio_mean": ratio.mean().item(), "min_is_ratio": ratio.min().item(), "max_is_ratio": ratio.max().item(),
                "is_truncated_fraction": truncated[where].float().mean().item(),
                "is_truncated_mass": (cut.sum() / whole.sum()).item(),
                "is_masked_fraction": (1 - self.keep[where]).mean().item(),
                "is_ess_fraction": ess.mean().item(), "min_is_ess_fraction": ess.min().item(),
                "ratio_terms": int(where.sum())}  # what the four means above are over: samples, or tokens


def effective_sample_fraction(log_weight: torch.Tensor) -> torch.Tensor:
    """``(Σw)² / (M Σw²)`` per group (``[B]``) of weights ``[B, M]`` given as logs, in log space: 1 when even, 1/M
    when one sample holds all; 0 for a group whose every weight is 0. At most 1 (Cauchy-Schwarz): an even group's
    rounding, a hair above it on some CPUs' kernels (1 + 3e-8 on an AVX-512 machine), is clamped."""
    log_ess = 2 * torch.logsumexp(log_weight, -1) - torch.logsumexp(2 * log_weight, -1)
    return (torch.exp(log_ess).nan_to_num(nan=0.0) / log_weight.shape[-1]).clamp(max=1.0)


@dataclass(frozen=True)
class SampleCorrection:
    """What a correction does to an estimator of whole samples (GARL, PAFT, RLOO; ``[B, M]``)."""

    #: log ρ̃_m, the weight of sample m in v_m = ρ̃_m w_m, in P̂ and on the baseline (0 for ``token_truncate``).
    log_weight: torch.Tensor
    #: 1 where the sample is kept, 0 where masked.
    keep: torch.Tensor
    #: What the sample's score coefficient multiplies: its log-prob, or for ``token_truncate``
    #: Σ_t sg(ρ̃_t) log p_θ(z_t) over its tokens (differentiable through log p_θ).
    score_logprob: torch.Tensor
    #: The ratios the correction worked from (per sample, or per token), for the metrics.
    ratios: Ratios

    @property
    def weight(self) -> torch.Tensor:
        """ρ̃_m (0 where masked)."""
        return torch.exp(self.log_weight)


@dataclass(frozen=True)
class Correction:
    """What is done to the importance ratio: ``plain`` uses it as is (unbiased at q=0, variance unbounded),
    ``truncate`` caps it at ``cap`` (TIS), ``mask`` zeroes it outside ``[low, high]`` (MIS, the mean still over M);
    from the per-token ratios, ``token_truncate`` caps each token's at ``cap`` and ``geometric`` their geometric
    mean over the sample (both biased, neither growing in variance with the length: docs/off_policy.md, §11)."""

    mode: str = "truncate"
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTIONS:
            raise ValueError(f"correction mode must be one of {CORRECTIONS}; got {self.mode!r}")
        if not (self.cap >= 1.0 and 0.0 <= self.low <= 1.0 <= self.high):
            raise ValueError(f"need cap >= 1 and low <= 1 <= high; got cap={self.cap}, low={self.low}, high={self.high}")

    @property
    def per_token(self) -> bool:
        """Whether it works from the per-token ratios (the estimators then take :class:`SampledTokens`)."""
        return self.mode in PER_TOKEN_CORRECTIONS

    def ratios(self, logprob: torch.Tensor, behavior_logprob: torch.Tensor, where: torch.Tensor | None = None) -> Ratios:
        """ρ = exp(logprob - behavior_logprob), detached, corrected elementwise; ``where`` (a bool mask) limits what
        counts (0 elsewhere). The one check of the behaviour log-probs every estimator relies on: the policy's
        shape, and neither NaN nor +inf where they count."""
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
        return Ratios(log_ratio, *self.corrected(log_ratio), where)

    def corrected(self, log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log ρ̃, keep)`` of each ratio: truncated at the cap (``truncate`` and the per-token forms), masked
        outside the bounds (``mask``), or as is (``plain``)."""
        keep = torch.ones_like(log_ratio)
        corrected = log_ratio
        if self.mode == "mask":
            keep = ((log_ratio >= math.log(self.low)) & (log_ratio <= math.log(self.high))).to(log_ratio.dtype)
            corrected = log_ratio.masked_fill(keep == 0, -math.inf)
        elif self.mode != "plain":
            corrected = log_ratio.clamp(max=math.log(self.cap))
        return corrected, keep

    def per_sample(self, tokens: Ratios) -> Ratios:
        """``[B, M]`` ratios of whole samples from their tokens' (``tokens``, token-level): the product, ρ; or for
        ``geometric`` its geometric mean per token, exp(mean_t log r_t); each corrected as :meth:`corrected`."""
        log_ratio = tokens.log_ratio.sum(-1)
        if self.mode == "geometric":
            log_ratio = log_ratio / tokens.where.sum(-1).clamp(min=1)
        return Ratios(log_ratio, *self.corrected(log_ratio))

    def for_samples(self, logprob: torch.Tensor, behavior: torch.Tensor | SampledTokens) -> SampleCorrection:
        """The correction of an estimator of whole samples, whose sequence log-probs are ``logprob`` (``[B, M]``),
        from π's: summed over the span (``[B, M]``, the sequence forms only) or per token (:class:`SampledTokens`)."""
        if isinstance(behavior, torch.Tensor):
            if self.per_token:
                raise ValueError(f"importance correction {self.mode!r} works from the per-token ratios: pass the "
                                 "sampled tokens' log-probs (SampledTokens), not their sum")
            ratios = self.ratios(logprob, behavior)
            return SampleCorrection(ratios.log_corrected, ratios.keep, logprob, ratios)
        tokens = self.ratios(behavior.policy_logprob, behavior.behavior_logprob, where=behavior.mask)
        if self.mode == "token_truncate":
            weighted = torch.where(behavior.mask, tokens.corrected * behavior.policy_logprob, 0.0).sum(-1)
            return SampleCorrection(torch.zeros_like(tokens.log_ratio[..., 0]), torch.ones_like(tokens.log_ratio[..., 0]),
                                    weighted, tokens)
        ratios = self.per_sample(tokens)
        return SampleCorrection(ratios.log_corrected, ratios.keep, logprob, ratios)


def k3_kl(policy_logprob: torch.Tensor, behavior_logprob: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Per-token ``r - 1 - log r`` with ``r = p_θ / π`` over the sampled tokens ``where``: under samples from π its
    sum over a sequence estimates KL(π ‖ p_θ) without bias (each term >= 0); the mean per token is returned."""
    log_r = (upcast(policy_logprob.detach()) - upcast(behavior_logprob.detach()))[where]
    return (torch.expm1(log_r) - log_r).mean() if log_r.numel() else log_r.new_zeros(())
