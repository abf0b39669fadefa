"""Input validation shared by the estimators: every message names the bad value."""

from __future__ import annotations

import math

import torch


def check_q(q: float, name: str = "q") -> float:
    """Return ``q`` as a float, or raise if it is outside the J_Q range [0, 1] (``name``: what the message calls it, a
    schedule's ``q_after``)."""
    q_value = float(q)
    if math.isnan(q_value) or not 0.0 <= q_value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1] (0 = RLVR, 1 = log-marginal-likelihood); got {name}={q!r}")
    return q_value


def check_group_tensors(**tensors: torch.Tensor) -> tuple[int, int]:
    """Check that the named tensors are all ``[B, M]`` with the same shape; return (B, M)."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise ValueError(f"{name} must be a [B, M] tensor (B prompts x M samples); got shape {list(shape)}")
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed} must all be [B, M] with the same B and M")
    for name, t in tensors.items():
        if torch.isnan(t).any() or (t == float("inf")).any():
            raise ValueError(f"{name} contains NaN or +inf; log-probabilities must be finite or -inf")
    batch, samples = next(iter(shapes.values()))
    return batch, samples


def check_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Check that token-level tensors share the mask's shape."""
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"shape mismatch: {name}{list(t.shape)} vs mask{list(mask.shape)}")


def check_min_samples(samples: int, minimum: int, what: str) -> None:
    if samples < minimum:
        raise ValueError(f"{what} needs at least M={minimum} samples per prompt; got M={samples}")
