"""Atomic checkpoints: the policy's weights and optimizer state, RNG states and trainer state.

A checkpoint is written into a temporary directory, flushed, and renamed into place; then
the ``latest`` pointer file is replaced atomically. A kill -9 at any moment therefore leaves
``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from nemo_jq.runtime import distributed
from nemo_jq.runtime.outputs import fsync, move_aside, write_atomic

RNG, STATE = "rng.pt", "state.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_file(rank: int) -> str:
    """Each rank's RNG states (rank 0's keeps the one-process name)."""
    return RNG if rank == 0 else f"rng-rank{rank}.pt"


class Checkpointed(Protocol):
    """What a checkpoint needs of a policy (``nemo_jq.models.interfaces.Policy`` has it): its own files in a folder."""

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path, *, with_optimizer: bool = True) -> None: ...


def damaged(file: Path, what: str) -> ValueError:
    """The one line for a checkpoint file (or a Megatron checkpoint's folder of files) that is there but cannot be read
    (cut short by a copy, or corrupt): the file, what is wrong, and the run's other steps to take instead."""
    checkpoint = Path(file).parent
    fix = other_checkpoints(checkpoint.parent, but=checkpoint.name) or ("the run holds no other checkpoint: restore "
                                                                        "this one from a copy of the run")
    return ValueError(f"checkpoint {'folder' if Path(file).is_dir() else 'file'} {file} is damaged ({what}): {fix}")


def other_checkpoints(root: Path, but: str | None = None) -> str | None:
    """How to go on from the run's complete checkpoints under ``root`` other than the folder ``but``, in words (None:
    there is none): eval's ``--step N``, and for a resume the newest's name written into ``latest``."""
    others = [step for step in saved_steps(root) if step_dir_name(step) != but]
    if not others:
        return None
    return (f"use {'another' if but else 'one'} of the run's checkpoints (step{'s' if len(others) > 1 else ''} "
            f"{', '.join(map(str, others))}): `nemo-jq eval` and `export` take one with --step N; to resume from one "
            f"(train --resume has no --step), write its folder's name ({step_dir_name(others[-1])}) into {root / 'latest'}")


def require_files(directory: Path, names: Sequence[str]) -> None:
    """Raise ``FileNotFoundError`` naming every file of ``names`` that ``directory`` lacks (all of them: the folder is
    gone), and the run's other checkpoints to take instead."""
    directory = Path(directory)
    missing = [name for name in names if not (directory / name).exists()]
    if missing:
        what = "is gone" if not directory.exists() else f"is missing {', '.join(missing)}"
        fix = other_checkpoints(directory.parent, but=directory.name) or "the run holds no other: restore it from a copy"
        raise FileNotFoundError(f"checkpoint {directory} {what}: {fix}")


def save_checkpoint(root: Path, step: int, policy: Checkpointed, state: dict[str, Any], rng: dict[str, Any], *,
                    written: bool = False) -> Path:
    """Write checkpoint ``step`` under ``root`` and point ``latest`` at it; returns its directory.

    ``written``: this run wrote (or resumed from) this step's checkpoint already (a step saved twice: for its validation
    and its ``save_every``), so ``latest`` is only pointed at it. Otherwise a folder of this step there is another
    life's (one resumed from an earlier step, past a damaged checkpoint): it is moved aside, and the step written anew.

    A collective: every rank writes its part (the policy's shards, its RNG states) into one
    temporary directory, which rank 0 completes with the trainer state and renames into place.
    """
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    if not distributed.on_writer(lambda: _begin(root, final, tmp, written)):
        return final
    try:
        distributed.everywhere(lambda: policy.save(tmp))
        distributed.everywhere(lambda: torch.save(rng, tmp / rng_file(distributed.rank())))
        distributed.on_writer(lambda: _complete(tmp, final, state))
    except Exception as err:  # torch reports a full disk as a RuntimeError
        space = out_of_space(err, root)  # before the temporary checkpoint is removed, which frees its space again
        distributed.on_writer(lambda: shutil.rmtree(tmp, ignore_errors=True))
        if space is not None:
            raise OSError(space[0], space[1], str(final)) from err
        raise
    return final


def _begin(root: Path, final: Path, tmp: Path, written: bool) -> bool:
    """Make an empty ``tmp``; False (and ``latest`` pointed at it) when this run wrote ``final`` already."""
    root.mkdir(parents=True, exist_ok=True)
    if final.exists() and written:
        _point_latest(root, final)
        return False
    if final.exists():
        move_aside(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return True


def _complete(tmp: Path, final: Path, state: dict[str, Any]) -> None:
    (tmp / STATE).write_text(json.dumps(state, indent=2))
    umask = _umask()
    for path in tmp.rglob("*"):
        if path.is_file():  # as the umask says (a writer such as safetensors makes its files owner-only)
            path.chmod(0o666 & ~umask)
        fsync(path)
    fsync(tmp)
    os.rename(tmp, final)
    _point_latest(final.parent, final)


def _point_latest(root: Path, final: Path) -> None:
    write_atomic(root / "latest", final.name)
    fsync(root)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``latest`` names (None: the run has none). A ``latest`` that is gone, or names no complete
    checkpoint, beside complete ones is one line naming them: the trainer writes it after every checkpoint, so only a
    hand or a copy lost it, and which step to go on from is the user's to say (the newest may be one they pointed
    ``latest`` away from)."""
    pointer = root / "latest"
    if not pointer.exists():
        if saved_steps(root):
            raise FileNotFoundError(f"{pointer} is missing, beside complete checkpoints: {other_checkpoints(root)}")
        return None
    named = pointer.read_text().strip()
    path = root / named
    if not (path / STATE).exists():
        wrong = f"names {path}, which is not a complete checkpoint" if named else "is empty"
        raise FileNotFoundError(f"{pointer} {wrong}: "
                                f"{other_checkpoints(root) or 'the run holds none: restore one from a copy of the run'}")
    return path


def saved_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under ``root``, in order."""
    return sorted(int(p.name.removeprefix("step_")) for p in step_folders(root) if (p / STATE).exists())


def step_folders(root: Path) -> list[Path]:
    """The checkpoint folders under ``root``, in step order: ``step_N`` only, not one moved aside (``step_N.old-...``)."""
    return sorted(p for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and p.is_dir())


#: The fields of ``state.json`` that choosing and loading a checkpoint read, and the JSON types they may have.
STATE_FIELDS = {"step": (int,), "best_step": (int, type(None)), "best_metric": (int, float, type(None))}


def read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json``; one that is no JSON object with its step (an edit, a copy cut short) is
    :func:`damaged`, here rather than as a ``KeyError`` wherever a field is first read."""
    file = Path(checkpoint) / STATE
    try:
        state = json.loads(file.read_text())
    except ValueError as err:  # not JSON, or not UTF-8
        raise damaged(file, f"not JSON: {err}") from None
    if not isinstance(state, dict):
        raise damaged(file, f"a JSON {type(state).__name__}, not the object a checkpoint writes")
    wrong = [key for key, kinds in STATE_FIELDS.items() if type(state.get(key)) not in kinds]  # JSON's true is no step
    if wrong:
        raise damaged(file, f"{', '.join(wrong)} missing or not a number")
    return state


def load_checkpoint(path: Path, policy: Checkpointed, *, with_optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights (and optimizer) into ``policy``; return (trainer state, this rank's RNG states, None without the
    optimizer: inference, which unpickles nothing of a checkpoint, whoever's run it is, and needs no RNG file).

    A rank with no RNG file of its own (the run was saved with fewer ranks) gets rank 0's.
    """
    path = Path(path)
    require_files(path, [STATE, RNG] if with_optimizer else [STATE])
    state = read_state(path)
    policy.load(path, with_optimizer=with_optimizer)
    if not with_optimizer:
        return state, None
    own = path / rng_file(distributed.rank())
    return state, load_torch_file(own if own.exists() else path / RNG, weights_only=False)


def load_torch_file(file: Path, *, weights_only: bool) -> Any:
    """``torch.load`` of a checkpoint's file; one cut short or corrupt is :func:`damaged`."""
    try:
        return torch.load(file, weights_only=weights_only)
    except (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError) as err:  # torch's for a file cut short
        if isinstance(err, OSError) and err.errno not in (None, errno.EINVAL):  # the disk's own failure, not the file's
            raise
        raise damaged(file, f"truncated or corrupt: {str(err).partition('. ')[0]}") from None


def prune_checkpoints(root: Path, keep: int, protect: set[str]) -> None:
    """Delete all but the newest ``keep`` checkpoints, never those named in ``protect``; clear stale temporaries."""
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    steps = step_folders(root)
    for path in steps[: max(len(steps) - keep, 0)]:
        if path.name not in protect:
            shutil.rmtree(path)


#: What a failed write for want of space says: the OS's messages, and torch's, which hides the OS's error (``[enforce
#: fail at inline_container.cc:672] . unexpected pos 1088 vs 1002``, ``PytorchStreamWriter failed writing file``).
NO_SPACE, OVER_QUOTA = "No space left on device", "Disk quota exceeded"
TORCH_WRITE_FAILED = ("unexpected pos", "failed writing file", "file write failed")


def out_of_space(err: BaseException, root: Path) -> tuple[int, str] | None:
    """``(errno, reason)`` when ``err`` is (or hides) a write that failed for want of space: a full disk (ENOSPC) or
    a quota reached (EDQUOT, usual on Lustre, where the disk itself has room); None for any other failure."""
    causes, cause = [], err
    while cause is not None and len(causes) < 8:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    for cause in causes:
        if getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return cause.errno, NO_SPACE if cause.errno == errno.ENOSPC else OVER_QUOTA
    text = " ".join(map(str, causes))
    if OVER_QUOTA in text:
        return errno.EDQUOT, OVER_QUOTA
    free = shutil.disk_usage(root).free
    if NO_SPACE in text or free < 1 << 20:
        return errno.ENOSPC, NO_SPACE
    if any(words in text for words in TORCH_WRITE_FAILED):  # the disk has room: a quota is what stops the write
        return errno.EDQUOT, f"{OVER_QUOTA} (most likely: a write failed and the disk has {free / 2**30:.1f} GiB free)"
    return None


def _umask() -> int:
    """This process's umask (read from /proc where Linux shows it, so no other thread sees it changed)."""
    try:
        return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask
