"""Output folders that hold a user's earlier work (a run, a demo, prepared data) are never written over."""

from __future__ import annotations

import time
from pathlib import Path


def claim_dir(path: Path, markers: tuple[str, ...], *, overwrite: bool, what: str, advice: str) -> Path | None:
    """Refuse ``path`` if it holds any of ``markers`` (an earlier run, demo or prepared data), saying ``advice``;
    with ``overwrite``, move it aside first (nothing is deleted). Returns where it was moved, if it was."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a folder: choose a folder that does not hold one")
    found = [name for name in markers if (path / name).exists()]
    if not found:
        return None
    if not overwrite:
        raise FileExistsError(f"{path} already holds {what} ({', '.join(found)}): {advice}")
    return move_aside(path)


def move_aside(path: Path) -> Path:
    """Rename ``path`` to a fresh ``NAME.old-YYYYmmdd-HHMMSS[-N]`` beside it and say so; nothing is deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, suffix = path.with_name(f"{path.name}.old-{stamp}"), 1
    while aside.exists():
        aside, suffix = path.with_name(f"{path.name}.old-{stamp}-{suffix}"), suffix + 1
    path.rename(aside)
    print(f"moved the earlier {path} to {aside}")
    return aside
