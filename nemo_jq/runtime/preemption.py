"""Stopping a run cleanly: SIGTERM, SIGUSR1 (SLURM's warning before the time limit), Ctrl-C and SIGHUP (the terminal
went away: a closed window, a dropped ssh session; left ignored under ``nohup``) ask the training loop to finish its
current step and write a checkpoint; a second Ctrl-C stops at once.

Only SIGUSR1 asks for a requeue (the launchers' ``--signal=USR1@300``): ``train --requeue`` then exits with
:data:`REQUEUE_EXIT_CODE` after its checkpoint, and the batch script, on the host (a pyxis container has no
``scontrol``), requeues the job, which resumes. SIGTERM (``scancel``, a requeue or preemption from outside) ends
the run for good: SLURM itself decides whether the job comes back.

A command of several trainings (the demo, an experiment) runs them inside one :class:`Series`: a stop signal
ends the current run (checkpoint written) and the command, which says what finished and how to continue. A sweep's
runs, processes of their own sessions, get each signal from the sweep, and SIGTERM if the sweep dies without passing
one on (:func:`stop_with_parent`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Any, Callable

#: The signals that ask for a clean stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
#: The signal that asks ``train --requeue`` for a requeue: SLURM's before the time limit (``--signal=USR1@300``).
REQUEUE_SIGNAL = signal.SIGUSR1
#: ``train --requeue``'s exit status after :data:`REQUEUE_SIGNAL` and its checkpoint: the batch script requeues the
#: job on it (EX_TEMPFAIL), on the host; docs/cluster.md shows the lines. Under srun, rank 0 exits with it and the
#: other ranks with 0, just before.
REQUEUE_EXIT_CODE = 75


class StopSignals:
    """While entered (on the main thread), records the stop signals this process receives."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._on_signal) for signum in stop_signals_here()}
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        if signum == signal.SIGINT and _writes():  # one line, not one a rank
            print("\nCtrl-C: finishing this step and writing a checkpoint (press again to stop at once)", flush=True)
        if signum == signal.SIGHUP:
            release_terminal()
        self.received = signum

    def requested(self) -> bool:
        """Whether a stop signal reached any rank (a collective); every rank then agrees on the largest signal number."""
        from nemo_jq.runtime import distributed

        self.received = distributed.largest(self.received or 0) or None
        return self.received is not None


class Terminated(BaseException):
    """A stop signal other than Ctrl-C ended a command that takes none itself (:func:`ended_by_signals`); as
    ``KeyboardInterrupt``, no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def ended_by_signals() -> Any:
    """While a command of one process runs: SIGTERM, SIGUSR1 and SIGHUP (where not ignored) end it as Ctrl-C does,
    raising :class:`Terminated`, so it says so in one line and what it writes is left whole (their default ended eval,
    generate, export and data prepare without a word); a training's :class:`StopSignals` take them over for its
    steps. Under torchrun the defaults stay: a rank blocked in a collective could not run a Python handler, and the
    agent's SIGTERM would wait for its SIGKILL."""
    world = os.environ.get("WORLD_SIZE", "1")  # one that is no number is not torchrun's: what reads it says so
    if threading.current_thread() is not threading.main_thread() or (world.isdigit() and int(world) > 1):
        yield
        return

    def end(signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            release_terminal()
        raise Terminated(signum)

    previous = {signum: signal.signal(signum, end) for signum in stop_signals_here() if signum != signal.SIGINT}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_held() -> Any:
    """The stop signals that arrive in the block take effect as it ends, each as its handler then takes it: a few
    renames that must all happen (an export moved into its folder), which a stop part-way would leave half done. On
    the main thread, where Python's handlers run; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, _frame: arrived.append(signum)) for signum in stop_signals_here()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


def stop_signals_here() -> tuple[int, ...]:
    """:data:`STOP_SIGNALS` less SIGHUP where this process was started to ignore it (``nohup``: a closed terminal
    must not stop the run then)."""
    return tuple(signum for signum in STOP_SIGNALS
                 if signum != signal.SIGHUP or signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN)


def release_terminal() -> None:
    """After SIGHUP the terminal is gone and a write to it fails (EIO): the lines still to come (the stop's, the
    command's last) go to /dev/null instead of failing the checkpoint's way out; the run's files say the same."""
    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            descriptor = stream.fileno()
        except (AttributeError, OSError, ValueError):  # replaced by a caller (a test's capture): not a terminal
            continue
        if stat.S_ISCHR(os.fstat(descriptor).st_mode):  # a terminal (a hung-up one no longer says isatty), not a file
            os.dup2(null, descriptor)
    os.close(null)


class TerminalStream:
    """``sys.stdout`` or ``sys.stderr`` on a terminal: a write or flush the terminal refuses because it hung up (EIO,
    possibly a moment before SIGHUP arrives) sends it and the rest to /dev/null (:func:`release_terminal`) instead of
    failing the command on its way to a checkpoint."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        written = self._unless_hung_up(self.stream.write, text)
        return len(text) if written is None else written

    def flush(self) -> None:
        self._unless_hung_up(self.stream.flush)

    def _unless_hung_up(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``; None where the terminal hung up (EIO), whose output goes to /dev/null from then on."""
        try:
            return call(*args)
        except OSError as error:
            if error.errno != errno.EIO:
                raise
            release_terminal()
            return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def guard_terminal_streams() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`TerminalStream` where they are terminals."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, TerminalStream) and stream is not None and stream.isatty():
            setattr(sys, name, TerminalStream(stream))


#: The variable a sweep sets for the runs it starts: its pid (:func:`stop_with_parent`).
STOP_WITH_ENV = "NEMO_JQ_STOP_WITH"
#: Linux's prctl option that signals a process when its parent ends.
PR_SET_PDEATHSIG = 1


def stop_with_parent() -> None:
    """In a run a sweep started (a session of its own, so a terminal's signals reach it only through the sweep): if
    the sweep ends without passing a signal on (SIGKILL, a crash), SIGTERM comes here, and the run stops with a
    checkpoint instead of going on unseen, holding its folder from a later ``--resume``. Linux only (prctl)."""
    parent = os.environ.pop(STOP_WITH_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # the sweep ended before the request took: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """A stop signal ended a command of several trainings, after the current run's checkpoint."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # 130 for Ctrl-C


_series: Series | None = None


class Series(contextlib.ContextDecorator):
    """Several trainings in one command: one :class:`StopSignals` for all of them (``Trainer.fit`` takes it while a
    series is entered), and a stop signal raises :class:`Stopped` from the current run's ``fit`` once its checkpoint
    is written, so no further run starts; a second Ctrl-C raises it at once. ``again`` says how to go on, ``{out_dir}``
    in it the folder the command writes. A decorator of the function that runs the command, whose first argument is
    that folder."""

    def __init__(self, command: str, again: str):
        self.command, self.again = command, again
        self.stop = StopSignals()
        #: The runs finished so far (an experiment's record adds each as it ends).
        self.finished: list[Path] = []
        self.out_dir: Path | None = None

    def __call__(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def run(out_dir: Path, *args: Any, **kwargs: Any) -> Any:
            with self:
                self.out_dir = Path(out_dir)
                try:
                    result = function(out_dir, *args, **kwargs)
                except KeyboardInterrupt:
                    raise Stopped(signal.SIGINT, f"nemo-jq {self.command}: interrupted by a second Ctrl-C (no checkpoint "
                                                 f"of the step it stopped); finished runs: {self._finished()}; "
                                                 f"{self._again()}") from None
                if self.stop.received:  # after the last run, while the command wrote what it sums up: it ends there
                    raise Stopped(self.stop.received, f"nemo-jq {self.command}: {signal_name(self.stop.received)} came "
                                                      f"after its last run; every run and what sums them up are written "
                                                      f"in {out_dir}")
                return result
        return run

    def __enter__(self) -> Series:
        global _series
        self.stop, self.finished = StopSignals(), []
        self.stop.__enter__()
        _series = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _series
        _series = None
        self.stop.__exit__(*exc)

    def stopped(self, run_dir: Path, step: int) -> Stopped:
        return self._stopped(f"{run_dir} stopped at step {step} with a checkpoint; no further run started")

    def stopped_before(self, run_dir: Path) -> Stopped:
        """A stop that came between two runs: the next one, ``run_dir``, is not started (it was, to checkpoint an
        untrained step 0 inside the signal's grace period)."""
        return self._stopped(f"{run_dir} not started")

    def _stopped(self, where: str) -> Stopped:
        signum = self.stop.received or signal.SIGTERM
        return Stopped(signum, f"nemo-jq {self.command}: stopped by {signal_name(signum)}; finished runs: "
                               f"{self._finished()}; {where}; {self._again()}")

    def _finished(self) -> str:
        return ", ".join(str(path) for path in self.finished) or "none"

    def _again(self) -> str:
        return self.again.format(out_dir=self.out_dir)


def current_series() -> Series | None:
    """The series this process is running (None: a single training)."""
    return _series


def _writes() -> bool:
    """Whether this process speaks for the command: rank 0 of a world (or no world yet: torchrun's ``RANK`` says)."""
    from nemo_jq.runtime import distributed

    return distributed.is_writer() and os.environ.get("RANK", "0") == "0"


def end_stopped_run(signum: int, step: int, run_dir: Path, *, requeue: bool) -> int:
    """``train``'s exit status after ``signum`` stopped it and its checkpoint at ``step`` was written; rank 0 says so in
    one line. With ``requeue`` and :data:`REQUEUE_SIGNAL`: :data:`REQUEUE_EXIT_CODE`, for the batch script to requeue
    the job; any other signal ends the run (0): ``scancel`` must not bring a job back, and a job requeued from outside
    (``scontrol requeue``) comes back by itself and resumes. Outside a SLURM job (a local sweep's runs take
    ``--requeue`` too) the line says how to continue the run."""
    from nemo_jq.runtime import distributed

    name = signal_name(signum)
    if requeue and signum == REQUEUE_SIGNAL:
        distributed.on_writer(lambda: print(f"nemo-jq train: {name} at step {step}: checkpoint written; exit "
                                            f"{REQUEUE_EXIT_CODE} asks the batch script to requeue the job, which "
                                            "resumes from it", flush=True))
        return _exit_for_requeue()
    in_a_job = requeue and "SLURM_JOB_ID" in os.environ  # a local sweep's runs take --requeue too
    advice = ("not requeued: only SIGUSR1 (the time-limit signal) requeues; a job requeued from outside resumes when "
              "it restarts" if in_a_job else f"`nemo-jq train --resume {run_dir}` continues")
    distributed.on_writer(lambda: print(f"nemo-jq train: stopped by {name} at step {step} with a checkpoint; {advice}",
                                        flush=True))
    return 0


def _exit_for_requeue(linger: float = 3.0) -> int:
    """Under srun with ``--kill-on-bad-exit``, the first task that exits non-zero has the others killed, which turns
    srun's status into 143 and loses the request. So every rank waits for the others (the whole world's: a split
    one's rollout ranks end their process groups too, :func:`~nemo_jq.runtime.distributed.close`), the other ranks
    end at once with 0, and rank 0 returns :data:`REQUEUE_EXIT_CODE` a moment later, when nothing is left to kill.
    Before it ends, a rank shuts down its multiprocessing helpers (megatron-core's checkpoint writer's), as a normal
    exit would: left running, they would outlive the job step and hold its output open."""
    import multiprocessing.util
    import os
    import sys
    import time

    from nemo_jq.runtime import distributed

    if distributed.world_size() > 1 or distributed.roles() is not None:
        writer = distributed.is_writer()
        distributed.close()
        distributed.barrier()  # process groups a caller started, close() leaves: their ranks wait here
        if not writer:
            multiprocessing.util._exit_function()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        time.sleep(linger)
    return REQUEUE_EXIT_CODE
