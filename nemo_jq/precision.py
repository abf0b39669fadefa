"""Precision policy: loss and estimator arithmetic run in at least fp32, whatever the model's dtype."""

from __future__ import annotations

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 tensors, the tensor's own dtype when wider (fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`compute_dtype` (bf16/fp16 -> fp32, fp64 stays)."""
    return t.to(compute_dtype(t))
