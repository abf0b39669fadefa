"""Stopping a run cleanly: SIGTERM, SIGUSR1 (SLURM's warning before the time limit) and Ctrl-C ask the
training loop to finish its current step and write a checkpoint; a second Ctrl-C stops at once."""

from __future__ import annotations

import signal
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
