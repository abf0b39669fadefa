"""How a run hears that it must stop, short of training: SIGHUP (a closed terminal) asks for a clean stop unless the
process was started to ignore it (``nohup``), and a run a sweep started gets SIGTERM when the sweep dies without
passing a signal on (``stop_with_parent``: real processes, a real SIGKILL). The stops themselves, checkpoint and exit
status, are tests/recipe/test_trainer.py's and tests/e2e/test_sweep.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import process_stat
from nemo_jq.runtime.preemption import STOP_WITH_ENV, StopSignals

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal", "nohup"])
def test_sighup_asks_for_a_stop_unless_the_process_was_started_to_ignore_it(ignored):
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)  # the handler runs between bytecodes
            assert stop.received == (None if ignored else signal.SIGHUP)
            assert (signal.getsignal(signal.SIGHUP) is signal.SIG_IGN) == ignored
    finally:
        signal.signal(signal.SIGHUP, previous)


#: A sweep stand-in: starts a run stand-in that calls ``stop_with_parent`` as ``nemo-jq`` does first thing, then
#: waits for a SIGTERM and says it got one; prints the run's pid and sleeps until killed.
PARENT = textwrap.dedent('''
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, sys.argv[2]: sys.argv[3] or str(os.getpid())},
                             start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(60)
''')
CHILD = textwrap.dedent('''
    import signal, time
    from nemo_jq.runtime.preemption import stop_with_parent
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))
    stop_with_parent()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:  # ends when, and only when, SIGTERM came (or after a minute)
        time.sleep(0.05)
''')


def _run_under_a_parent(parent_pid: str = "") -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, STOP_WITH_ENV, parent_pid], stdout=subprocess.PIPE,
                              text=True)
    return parent, int(parent.stdout.readline())


def _ended(pid: int, timeout: float = 20) -> bool:
    """Whether ``pid`` (not our child: watched in /proc) ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_stat(pid)[:1] in ([], ["Z"]):
            return True
        time.sleep(0.05)
    return False


def test_a_run_gets_sigterm_when_the_sweep_that_started_it_is_killed():
    """SIGKILL of the parent: the run, in a session of its own (no terminal's signal reaches it), gets SIGTERM."""
    parent, child = _run_under_a_parent()
    time.sleep(1.5)  # the child has set its request
    assert not _ended(child, timeout=0.5)  # alive while the parent is
    parent.kill()
    parent.wait()
    assert _ended(child), "the run outlived the sweep"


def test_a_run_whose_sweep_had_already_ended_stops_at_once():
    """The parent named is not this process's parent (it ended before the request took): SIGTERM at once."""
    parent, child = _run_under_a_parent(parent_pid="1")
    try:
        assert _ended(child, timeout=10)
    finally:
        parent.kill()
        parent.wait()


def test_a_signal_after_a_series_last_run_ends_the_command_with_its_line(tmp_path):
    """A Ctrl-C (or SIGTERM) while an experiment wrote its summary, after its last run, was said as "finishing this
    step and writing a checkpoint", then the command ended 0 without a word."""
    from nemo_jq.runtime.preemption import Series, Stopped

    @Series("experiment mine", again="`--resume {out_dir}` goes on")
    def experiment(out_dir):
        signal.raise_signal(signal.SIGTERM)  # while it sums up its runs (a real signal, taken by the series' handler)
        return "summary"

    with pytest.raises(Stopped) as stopped:
        experiment(tmp_path)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert str(stopped.value) == (f"nemo-jq experiment mine: SIGTERM came after its last run; every run and what sums "
                                  f"them up are written in {tmp_path}")
