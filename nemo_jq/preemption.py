"""Stopping a run cleanly: SIGTERM, SIGUSR1 (SLURM's warning before the time limit) and Ctrl-C ask the
training loop to finish its current step and write a checkpoint; a second Ctrl-C stops at once."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import Any

from nemo_jq import distributed

#: The signals that ask for a clean stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """While entered (on the main thread), records the stop signals this process receives."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            print("\nCtrl-C: finishing this step and writing a checkpoint (press again to stop at once)", flush=True)
        self.received = signum

    def requested(self) -> bool:
        """Whether a stop signal reached any rank (a collective); every rank then agrees on the largest signal number."""
        self.received = distributed.largest(self.received or 0) or None
        return self.received is not None


def requeue_this_job() -> None:
    """Put this SLURM job back in the queue (it reruns the same command, which resumes; see ``train --requeue``)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        print("nemo-jq: stopped by a signal outside SLURM: nothing to requeue; `nemo-jq train --resume RUN_DIR` "
              "continues", flush=True)
        return
    subprocess.run(["scontrol", "requeue", job], check=True)
    print(f"nemo-jq: requeued SLURM job {job}; it resumes from the checkpoint just written", flush=True)
