"""Precision policy: loss and estimator arithmetic run in at least fp32, whatever the model's dtype."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 tensors, the tensor's own dtype when wider (fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`compute_dtype` (bf16/fp16 -> fp32, fp64 stays)."""
    return t.to(compute_dtype(t))


class MetaAutocast(torch.overrides.TorchFunctionMode):
    """bf16 autocast for the ``meta`` device, the dry run's stand-in GPU (``nemo_jq.dryrun``), which
    ``torch.autocast`` does not support: like CUDA's autocast, the matrix products and attention take their
    floating inputs in ``dtype`` (casts autograd sees), and everything else runs in its inputs' dtype."""

    LOWER_PRECISION = {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                       torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm,
                       torch.nn.functional.scaled_dot_product_attention}
    #: The dtype of the innermost active instance (None: no meta autocast now).
    active: torch.dtype | None = None

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.outer = dtype, None

    def __enter__(self):
        self.outer, MetaAutocast.active = MetaAutocast.active, self.dtype
        return super().__enter__()

    def __exit__(self, *exc):
        MetaAutocast.active = self.outer
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.LOWER_PRECISION:
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t, (args, kwargs))
        return func(*args, **kwargs)


def recompute_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn``: its recompute in backward runs under the meta autocast its forward
    ran under (torch re-enters a real device's autocast itself, not this mode, which backward runs outside of)."""
    dtype = MetaAutocast.active
    return contextlib.nullcontext(), MetaAutocast(dtype) if dtype is not None else contextlib.nullcontext()


def autocast_dtype_now(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` at this point of the program (None: autocast is off)."""
    if device_type == "meta":
        return MetaAutocast.active
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
