"""Precision policy: estimator arithmetic runs in at least fp32, whatever the model's dtype."""

from __future__ import annotations

import torch


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or unchanged if it is already fp32 or wider (bf16/fp16 -> fp32, fp64 stays)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
