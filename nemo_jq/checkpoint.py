"""Atomic checkpoints: weights (safetensors), optimizer, RNG states and trainer state.

A checkpoint is written into a temporary directory, flushed, and renamed into place; then
the ``latest`` pointer file is replaced atomically. A kill -9 at any moment therefore leaves
``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from nemo_jq.models.interfaces import Policy

WEIGHTS, OPTIMIZER, RNG, STATE = "model.safetensors", "optimizer.pt", "rng.pt", "state.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(root: Path, step: int, policy: Policy, state: dict[str, Any], rng: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` under ``root`` and point ``latest`` at it; returns its directory."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if not final.exists():
        tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            policy.save_weights(tmp / WEIGHTS)
            torch.save(policy.state_dict(), tmp / OPTIMIZER)
            torch.save(rng, tmp / RNG)
            (tmp / STATE).write_text(json.dumps(state, indent=2))
            for path in tmp.iterdir():
                _fsync(path)
            _fsync(tmp)
        except Exception as err:  # torch reports a full disk as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            if _disk_full(err, root):
                raise OSError(errno.ENOSPC, "No space left on device", str(final)) from err
            raise
        os.rename(tmp, final)
    _write_atomic(root / "latest", final.name)
    _fsync(root)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not (path / STATE).exists():
        raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: Path, policy: Policy, *, with_optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights (and optimizer) into ``policy``; return (trainer state, RNG states)."""
    path = Path(path)
    missing = [name for name in (WEIGHTS, STATE, RNG) + ((OPTIMIZER,) if with_optimizer else ()) if not (path / name).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {path} is missing {missing}")
    policy.load_weights(path / WEIGHTS)
    if with_optimizer:
        policy.load_state_dict(torch.load(path / OPTIMIZER, weights_only=False))
    return json.loads((path / STATE).read_text()), torch.load(path / RNG, weights_only=False)


def prune_checkpoints(root: Path, keep: int, protect: set[str]) -> None:
    """Delete all but the newest ``keep`` checkpoints, never those named in ``protect``; clear stale temporaries."""
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for path in steps[: max(len(steps) - keep, 0)]:
        if path.name not in protect:
            shutil.rmtree(path)


def _disk_full(err: BaseException, root: Path) -> bool:
    return getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err) or shutil.disk_usage(root).free < 1 << 20


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
