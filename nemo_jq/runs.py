"""Finding and loading a run's checkpoints for evaluation and export."""

from __future__ import annotations

import json
from pathlib import Path

from nemo_jq.checkpoint import STATE, latest_checkpoint, load_checkpoint, step_dir_name
from nemo_jq.config import load_config
from nemo_jq.trainer import CHECKPOINT_DIR, CONFIG_FILE, Trainer


def resolve_checkpoint(path: Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` for a checkpoint directory or a run directory (best, else latest)."""
    path = Path(path)
    if (path / STATE).exists():
        return path.parent.parent, path
    if (path / CONFIG_FILE).exists():
        root = path / CHECKPOINT_DIR
        latest = latest_checkpoint(root)
        if latest is None:
            raise FileNotFoundError(f"run {path} has no checkpoint")
        best = json.loads((latest / STATE).read_text()).get("best_step")
        return path, (root / step_dir_name(best)) if best is not None else latest
    raise FileNotFoundError(f"{path} is neither a checkpoint (no {STATE}) nor a run directory (no {CONFIG_FILE})")


def load_for_inference(path: Path, overrides=()) -> Trainer:
    """A Trainer whose policy holds the checkpoint's weights (optimizer state not loaded)."""
    run_dir, checkpoint = resolve_checkpoint(path)
    trainer = Trainer(load_config(run_dir / CONFIG_FILE, list(overrides)), run_dir=run_dir, existing=True)
    load_checkpoint(checkpoint, trainer.policy, with_optimizer=False)
    return trainer
