"""The Tsallis q-logarithm and the per-example J_Q loss, computed from log P."""

from __future__ import annotations

import torch

from nemo_jq.objectives.checks import check_q


def log_q(u: torch.Tensor, q: float) -> torch.Tensor:
    """Tsallis q-log ``(u^{1-q} - 1) / (1 - q)``; equals ``log u`` at q=1 and is continuous there.

    Computed as ``expm1((1-q) log u) / (1-q)`` so that q close to 1 loses no precision.
    """
    return _log_q_from_log(torch.log(u), check_q(q))


def jq_loss(log_p: torch.Tensor, q: float) -> torch.Tensor:
    """Per-example loss ``l_q = -log_q P = (1 - P^{1-q}) / (1 - q)``, from ``log_p = log P``.

    Taking log P rather than P keeps the loss finite and its gradient exact when
    log P is far below the float range (long answers): at q<1 it tends to 1/(1-q),
    at q=1 it is ``-log_p``. Shape: any; returned elementwise.
    """
    return -_log_q_from_log(log_p, check_q(q))


def _log_q_from_log(log_u: torch.Tensor, q: float) -> torch.Tensor:
    if q == 1.0:
        return log_u
    return torch.expm1((1.0 - q) * log_u) / (1.0 - q)
