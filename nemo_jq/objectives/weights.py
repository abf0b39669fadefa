"""Log-space statistics of the likelihood weights ``w_m = p(y*|x, z_m)`` shared by GARL and PAFT.

Every quantity is formed from ``log w`` with logsumexp: ``w`` itself underflows to 0
in fp32 once the reference answer is a few dozen tokens long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nemo_jq.objectives.qlog import jq_loss
from nemo_jq.precision import upcast

#: ``log w`` values are clamped here so that ``-inf`` inputs give finite coefficients.
LOG_W_FLOOR = -1e30
#: Below this, ``w̄`` is zero or subnormal in fp32: the group's weight "underflowed".
LOG_FP32_TINY = math.log(torch.finfo(torch.float32).tiny)


@dataclass
class WeightStats:
    """Detached fp32 weight statistics for a ``[B, M]`` pool."""

    q: float
    log_w: torch.Tensor  # [B, M] log w_m
    log_mean: torch.Tensor  # [B]    log w̄
    log_ratio: torch.Tensor  # [B, M] log(w_m / w̄^q): the pathwise coefficient, at most M^q

    @property
    def samples(self) -> int:
        return self.log_w.shape[-1]

    def loo_baseline(self) -> torch.Tensor:
        """``(w̄_¬m)^{1-q}``, ``[B, M]``: the leave-one-out control variate (needs M >= 2)."""
        m = self.samples
        eye = torch.eye(m, dtype=torch.bool, device=self.log_w.device)
        others = self.log_w.unsqueeze(-2).expand(*self.log_w.shape[:-1], m, m).masked_fill(eye, -math.inf)
        log_loo_mean = torch.logsumexp(others, dim=-1) - math.log(m - 1)
        return torch.exp((1.0 - self.q) * log_loo_mean)

    def centred_weight(self) -> torch.Tensor:
        """Algorithm 1's ``c_m = w_m / w̄^q - (w̄_¬m)^{1-q}``, ``[B, M]``."""
        return torch.exp(self.log_ratio) - self.loo_baseline()

    def effective_sample_size(self) -> torch.Tensor:
        """``(Σw)^2 / Σw^2`` per group, ``[B]``: 1 when one rationale holds all the weight, M when uniform."""
        return torch.exp(2 * torch.logsumexp(self.log_w, -1) - torch.logsumexp(2 * self.log_w, -1))

    def metrics(self) -> dict[str, float]:
        """Pool diagnostics the trainer logs whatever the estimator (the paper's Figure 3 panels), over the groups left a
        weight: ``objective.importance=mask`` may zero every sample of a group, whose log w̄ is the floor (-1e30 in
        log P̂, which fired the collapse guard and held an adaptive q), counted in ``masked_group_fraction`` instead."""
        kept = self.log_mean > LOG_W_FLOOR / 2
        log_mean, out = self.log_mean[kept], {}
        if log_mean.numel():
            out = {
                "log_p_hat": log_mean.mean().item(),
                "p_hat": torch.exp(log_mean).mean().item(),
                "jq_loss": jq_loss(log_mean, self.q).mean().item(),
                "w_underflow_fraction": (log_mean < LOG_FP32_TINY).float().mean().item(),
                "ess": self.effective_sample_size()[kept].mean().item(),
                "weighted_groups": int(kept.sum()),  # what the five above are means over
            }
        if not kept.all():
            out["masked_group_fraction"] = 1.0 - kept.float().mean().item()
        if self.samples >= 2:
            amplified = self.centred_weight().abs() / self.samples**self.q
            out["max_amplified_advantage"] = amplified.max().item()
        return out


def finite_logprob(logprob: torch.Tensor) -> torch.Tensor:
    """``logprob`` upcast and floored at ``LOG_W_FLOOR``, so that a zero coefficient times an
    impossible (``-inf``) sequence contributes 0 rather than NaN; the floor passes no gradient."""
    return upcast(logprob).clamp(min=LOG_W_FLOOR)


def weight_stats(answer_logprob: torch.Tensor, q: float) -> WeightStats:
    """Statistics of ``w = exp(answer_logprob)`` (``[B, M]``); no gradient flows through them."""
    log_w = finite_logprob(answer_logprob.detach())
    log_mean = torch.logsumexp(log_w, dim=-1) - math.log(log_w.shape[-1])
    log_ratio = log_w - q * log_mean.unsqueeze(-1)
    return WeightStats(q=q, log_w=log_w, log_mean=log_mean, log_ratio=log_ratio)


def with_value(surrogate: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``value`` whose gradient is that of ``surrogate``.

    Lets ``ObjectiveOutput.loss`` read as the plug-in estimate of l_q while
    backpropagating the estimator's gradient.
    """
    return surrogate - surrogate.detach() + value.detach()
