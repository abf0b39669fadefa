"""Output folders that hold a user's earlier work (a run, a demo, prepared data) are never written over, and a run's
folder has one writer at a time (light to import: a process that only holds a folder needs no torch)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from nemo_jq.typed import first_few


def claim_dir(path: Path, markers: tuple[str, ...], *, overwrite: bool, what: str, advice: str) -> Path | None:
    """Refuse ``path`` if it holds any of ``markers`` (an earlier run, demo or prepared data), saying ``advice`` (or,
    where another process runs a run in it now, naming that process); with ``overwrite``, move it aside first (nothing
    is deleted). Returns where it was moved, if it was."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a folder: choose a folder that does not hold one")
    found = [name for name in markers if (path / name).exists()]
    if not found:
        return None
    if not overwrite:
        if held := held_runs_in(path):  # not to continue nor to move aside: it is running (a shared machine's)
            folder, holder = held[0]
            raise RunDirInUse(f"{path} already holds {what} ({', '.join(found)}), running now: {folder} is in use by "
                              f"another run ({holder}); wait for it to end (or stop it), or choose another folder")
        raise FileExistsError(f"{path} already holds {what} ({', '.join(found)}): {advice}")
    return move_aside(path)


#: Where :func:`staged` writes inside the folder it fills when it cannot write beside it.
STAGED_INSIDE = ".partial"


@contextlib.contextmanager
def staged(folder: Path, *, last: str, replaces: tuple[str, ...] | list[str] = (), writes: bool = True) -> Iterator[Path]:
    """A folder to write ``folder``'s files in (``.NAME.partial`` beside it, or inside it, ``.partial``, where only
    ``folder`` may be written: a user's folder in a shared project's), moved into ``folder`` once all are written,
    ``last`` (the file that marks it whole) the last; ``replaces``: an earlier write's files, deleted just before. A
    stop part-way leaves ``folder`` as it was: a half-written export or prepared folder blocked the same command next
    time, and an interrupted export had deleted the earlier one first; the move itself holds the stop signals until
    it is done. Staged only on ``folder``'s own file system (a mount point, a bind-mounted scratch: a rename from
    beside it fails) and where it is writable, which a read-only one is told at once, not after the work.
    ``writes``: this process writes (a collective export's other ranks do not)."""
    from nemo_jq.runtime.preemption import signals_held

    folder = Path(folder)
    beside = not folder.is_dir() or (os.access(folder.parent, os.W_OK) and os.access(folder, os.W_OK)
                                     and folder.stat().st_dev == folder.parent.stat().st_dev)
    staging = folder.parent / f".{folder.name}.partial" if beside else folder / STAGED_INSIDE
    if writes:  # held while written: a second write of the folder deleted the first's staged files and mixed them
        if (holder := holder_of(staging)) is not None:
            raise RunDirInUse(f"{folder} is being written now by another process ({holder}): wait for it to end, or "
                              "write elsewhere")
        shutil.rmtree(staging, ignore_errors=True)  # a killed write's
        hold_run_dir(staging)
    try:
        yield staging
    except BaseException:
        if writes:
            _drop_staging(staging)
        raise
    if writes:
        with signals_held():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                for name in replaces:
                    (folder / name).unlink(missing_ok=True)
                written = (path.name for path in staging.iterdir() if path.name != LOCK_FILE)
                for name in sorted(written, key=lambda name: name == last):
                    os.replace(staging / name, folder / name)
            finally:  # a move that fails (a full disk, a name taken meanwhile) leaves no copy of the whole write behind
                _drop_staging(staging)


def _drop_staging(staging: Path) -> None:
    """Let go of :func:`staged`'s folder and delete it."""
    release_run_dir(staging)
    shutil.rmtree(staging, ignore_errors=True)


#: The name :func:`move_aside` gives a folder it moves: ``NAME.old-YYYYmmdd-HHMMSS[-N]``.
MOVED_ASIDE = re.compile(r"\.old-\d{8}-\d{6}(-\d+)?$")


def move_aside(path: Path) -> Path:
    """Rename ``path`` to a fresh ``NAME.old-YYYYmmdd-HHMMSS[-N]`` beside it and say so; nothing is deleted. A path
    spelled ``.`` or ``x/..`` is the folder it names; the folder this process runs in (or one holding it) is refused:
    moved, it would take the shell's folder along, and a relative path would still lead into the old one."""
    path = Path(os.path.abspath(path))
    here = Path.cwd()  # a real path: compared with the real one
    if here == path.resolve() or path.resolve() in here.parents:
        raise FileExistsError(f"{path} holds the folder this command runs in ({here}), which moving it aside would move "
                              f"too: run the command from outside it (cd {path.parent}) and name the folder from there")
    if held := held_runs_in(path):
        folder, holder = held[0]
        raise RunDirInUse(f"{path} holds {folder}, in use by another run ({holder}): moved aside, that run would go on "
                          "writing into the moved folder and its next run into the new one; wait for it to end (or stop "
                          "it), or choose another folder")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, suffix = path.with_name(f"{path.name}.old-{stamp}"), 1
    while aside.exists():
        aside, suffix = path.with_name(f"{path.name}.old-{stamp}-{suffix}"), suffix + 1
    path.rename(aside)
    print(f"moved the earlier {path} to {aside}")
    return aside


#: The file a process holds an exclusive ``flock`` on while it writes the run directory it is in.
LOCK_FILE = ".nemo_jq.lock"
#: The one a sweep's process holds on the sweep's folder while it runs its runs (a folder of runs, not a run).
RUNS_LOCK = ".nemo_jq.runs.lock"


class RunDirInUse(FileExistsError):
    """Another process holds the run directory (see :func:`hold_run_dir`)."""


@dataclass
class _Held:
    fd: int
    #: This process made the folder: released with nothing else in it (a start that failed), it is removed again.
    created: bool
    lock: str = LOCK_FILE


#: The run directories this process holds, by absolute path.
_HELD: dict[Path, _Held] = {}


def hold_run_dir(run_dir: Path, lock: str = LOCK_FILE) -> None:
    """Hold ``run_dir`` (made if need be) until :func:`release_run_dir` or the end of this process: an exclusive
    ``flock`` on its lock file (``lock``: :data:`RUNS_LOCK` for a sweep's folder), which the OS drops when the process
    dies, however it dies, so a crash never leaves the directory locked. Held by another process:
    :class:`RunDirInUse`, naming the holder. Held by this one: nothing to do. Where the file system has no ``flock``,
    a warning says that nothing guards the directory."""
    key = Path(run_dir).absolute()
    if key in _HELD:
        return
    created = not key.exists()
    key.mkdir(parents=True, exist_ok=True)
    path = key / lock
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise RunDirInUse(f"{run_dir} is in use by another run ({holder}): wait for it to end (or stop it), or "
                              "choose another train.run_dir") from None
        except OSError as err:  # e.g. Lustre mounted without -o flock: held unlocked, and said once
            print(f"nemo-jq: warning: cannot lock {path} ({err.strerror}): nothing stops a second run from writing "
                  f"{run_dir} at the same time", file=sys.stderr)
            break
        try:  # the file an earlier holder removed as it let go is not the one to hold: open it anew
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else None}
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
    except OSError as err:  # a full disk: said with the file (os.write names none)
        os.close(fd)
        raise OSError(err.errno, err.strerror, str(path)) from None
    _HELD[key] = _Held(fd, created, lock)


#: How deep below a folder its runs are looked for (an experiment's runs are at ``OUT/method/seedS``, its warm
#: policies at ``OUT/warm/setting/policy``): a run in use before it is moved aside, one inside a new run's folder.
RUN_DEPTH = 4


def refuse_foreign_files(path: Path, holds_no: str) -> None:
    """A folder that holds anything (none of it what the command claims: ``holds_no``, e.g. "sweep") is refused: what
    the command writes would land among, and over, a user's files."""
    held = sorted(entry.name for entry in Path(path).iterdir() if entry.name != STAGED_INSIDE) if Path(path).is_dir() else []
    if held:
        raise FileExistsError(f"{path} is not empty ({first_few(held)}) and holds no "
                              f"{holds_no}: give a new or empty folder (what is there is left as it is)")


def held_runs_in(path: Path) -> list[tuple[Path, str]]:
    """The run folders at or below ``path`` (:func:`folders_below`) that another process holds now, each with its
    holder in words."""
    return [(folder, holder) for folder in (Path(path), *folders_below(path))
            if folder.absolute() not in _HELD and (holder := holder_of(folder) or holder_of(folder, RUNS_LOCK))]


def folders_below(folder: Path, depth: int = RUN_DEPTH) -> Iterator[Path]:
    """The folders under ``folder`` down to ``depth`` levels where a run may be: not hidden ones, not into a run's
    checkpoints (a link to a folder is listed, not entered)."""
    for parent, names, _ in os.walk(folder):
        names[:] = sorted(name for name in names if not name.startswith(".") and name != "checkpoints")
        yield from (Path(parent, name) for name in names)
        if len(Path(parent).relative_to(folder).parts) + 1 >= depth:
            names.clear()


def holder_of(folder: Path, lock: str = LOCK_FILE) -> str | None:
    """Who holds ``folder`` (:func:`hold_run_dir` by ``lock``; this process too), in words; None when no live process
    does."""
    try:
        fd = os.open(Path(folder) / lock, os.O_RDONLY)
    except OSError:
        return None
    try:  # the lock is taken for an instant only when nobody holds it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _describe_holder(fd)
    except OSError:  # no flock on this file system: nothing says whether it is held
        return None
    finally:
        os.close(fd)


def _describe_holder(fd: int) -> str:
    try:
        holder = json.loads(os.read(fd, 1 << 16))
        job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
        command = holder.get("command") or "?"
        return (f"pid {holder['pid']} on host {holder['host']}{job}, since {holder['since']}: "
                f"{command if len(command) <= 200 else command[:200] + ' ...'}")
    except (ValueError, KeyError, TypeError, OSError):  # written this instant, or by something else
        return "a process that has not said which"


def release_run_dir(run_dir: Path) -> None:
    """Let go of ``run_dir`` (held by :func:`hold_run_dir`): its lock file is removed, and the directory too where
    this process made it and nothing else is in it (a start that failed leaves nothing behind)."""
    let_go(Path(run_dir).absolute())


def let_go(key: Path, now_at: Path | None = None) -> None:
    """Release the hold on ``key``, whose folder is ``now_at`` if it has moved since (then it is kept, whatever
    is in it)."""
    held = _HELD.pop(key, None)
    if held is None:
        return
    folder = now_at or key
    try:
        if os.stat(folder / held.lock).st_ino == os.fstat(held.fd).st_ino:
            os.unlink(folder / held.lock)  # while still locked: a process waiting on this file opens the next one
    except OSError:
        pass
    os.close(held.fd)
    if held.created and now_at is None:
        try:
            key.rmdir()
        except OSError:  # not empty: the run wrote into it
            pass


@atexit.register
def release_run_dirs() -> None:
    """Let go of every run directory this process holds."""
    for run_dir in list(_HELD):
        release_run_dir(run_dir)


def write_atomic(path: Path, text: str) -> None:
    """``text`` in ``path``, whole or not at all (a kill or a full disk part-way leaves the earlier file)."""
    replace_whole(path, lambda tmp: tmp.write_text(text))


def replace_whole(path: Path, write: Callable[[Path], Any]) -> None:
    """What ``write`` writes to a file beside ``path``, moved over ``path`` once it is whole and on disk: a kill or a
    full disk part-way leaves the earlier file, and nothing half-written beside it."""
    os.replace(_whole_beside(path, write, path.with_name(path.name + ".tmp")), path)


def write_new(path: Path, text: str) -> bool:
    """``text`` in ``path``, whole, where no file is there; False (nothing written) where one is, even one another
    process wrote while this one wrote: two writers of one name never replace each other's file, as a check for a
    free name followed by a move can. The file is linked into place, which fails where the name is taken; where the
    filesystem has no hard links (vfat, exFAT, gcsfuse and other FUSE mounts), the name is taken by an exclusive
    create and the whole file moved over it (a kill between the two leaves it empty)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # this writer's own
    try:
        _whole_beside(path, lambda file: file.write_text(text), tmp)
        try:
            os.link(tmp, path)
        except OSError as err:
            if isinstance(err, FileExistsError) or err.errno not in NO_HARD_LINKS:
                raise
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # FileExistsError where taken
            os.replace(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


#: What ``link`` says on a filesystem without hard links.
NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK}


def _whole_beside(path: Path, write: Callable[[Path], Any], tmp: Path) -> Path:
    """``tmp``, where ``write`` wrote it whole and on disk (removed again if it could not, the error naming ``path``)."""
    try:
        write(tmp)
        fsync(tmp)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a full disk's write names no file: say which
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    return tmp


def fsync(path: Path) -> None:
    """``path`` (a file or a folder) on disk, not only in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
