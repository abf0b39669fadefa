"""How Megatron runs fail, on CPU: a rank left waiting in any group fails after the configured timeout, a failing
rank waits for the others before it exits, and torchrun runs (a data-parallel run, and a bad layout named in one
line per rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import torch.distributed as dist  # noqa: E402

from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import (  # noqa: E402
    CPU,
    untied_qwen3,
)


def time_to_fail(group) -> tuple[float, str]:
    """On rank 0: how long a collective over ``group`` waits for a rank that never joins, and its error."""
    started = time.monotonic()
    try:
        dist.all_reduce(torch.zeros(1), group=group)
    except RuntimeError as err:
        return time.monotonic() - started, str(err)
    return time.monotonic() - started, "no error"


def waiting_in_the_backends_groups() -> list[tuple[float, str]]:
    """Rank 1 never joins: rank 0 waits on a megatron-core group (CP) and on the replica group nemo_jq makes."""
    from datetime import timedelta

    from nemo_jq.models.megatron.policy import MegatronPolicy
    from nemo_jq.runtime import distributed

    distributed.init_from_env(CPU, timedelta(seconds=2))  # one process group already: it records the timeout
    policy = MegatronPolicy.from_hf_model(untied_qwen3(), context_parallel=2)
    if dist.get_rank() == 1:
        time.sleep(7)
        return []
    return [time_to_fail(policy.cp_group), time_to_fail(policy.model_parallel_group)]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_left_waiting_in_a_backend_group_fails_after_the_configured_timeout():
    """megatron-core's groups took their own 30-minute default, and torch's new_group the backend's, whatever the
    world's timeout: train.collective_timeout_minutes now reaches every group."""
    waits = run_in_processes(waiting_in_the_backends_groups, 2)[0]
    assert len(waits) == 2
    for elapsed, error in waits:
        assert 1.5 < elapsed < 4.5 and "Timed out" in error, (elapsed, error)


def world_timeout_worker() -> tuple[float, str] | None:
    """The world group as ``nemo-jq train`` starts it under torchrun; rank 1 never joins a collective."""
    from datetime import timedelta

    from nemo_jq.runtime import distributed

    distributed.init_from_env(CPU, timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(7)
        return None
    return time_to_fail(None)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_world_group_takes_the_configured_timeout():
    waited, _ = run_in_processes(world_timeout_worker, 2, process_group=False)
    elapsed, error = waited
    assert 1.5 < elapsed < 4.5 and "Timed out" in error, (elapsed, error)


def closing_worker(own_group: bool) -> tuple[bool, bool]:
    """A command's end (``distributed.close``, as ``nemo-jq`` calls it after a command that succeeded): whether the
    world and megatron-core's groups are still there after it. ``own_group``: the groups are the caller's (started
    before nemo_jq was asked to), which it leaves alone."""
    from megatron.core import parallel_state

    from nemo_jq.runtime import distributed

    distributed.init_from_env(CPU)
    if not own_group:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    distributed.close()
    return dist.is_initialized(), parallel_state.model_parallel_is_initialized()


@pytest.mark.slow  # 7 s: two worlds of two processes
@pytest.mark.distributed
def test_a_command_that_succeeded_ends_the_groups_it_started_and_only_those():
    """Ended together (a barrier, megatron-core's groups, then the world's) instead of by their destructors at exit,
    where NCCL warns that they were never destroyed and gloo can end a process in "terminate called without an active
    exception" (tests/distributed/test_model_download.py's workers end this way, and failed 1 run in 2 without it)."""
    assert run_in_processes(closing_worker, 2, False, process_group=False) == [(False, False)] * 2
    assert run_in_processes(closing_worker, 2, True) == [(True, False)] * 2


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 nemo-jq train ARGS`` on CPU (``megatron_cpu`` applies the test patches first)."""
    from helpers import TINY_RUN
    from megatron_cpu import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "tests/megatron_cpu.py", "train", *TINY_RUN, "model.backend=megatron", "eval.every=1000", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(["tests", *sys.path])}
    return subprocess.run(command, cwd=Path(__file__).resolve().parents[3], env=env, capture_output=True, text=True,
                          timeout=300)


def failing_ranks_worker(rank1_fails_after: float | None, timeout: float) -> float:
    """Rank 0 fails at once, rank 1 ``rank1_fails_after`` seconds later (None: never); the seconds each rank
    then waited in ``await_failing_ranks`` before it would exit."""
    import time

    from nemo_jq.runtime import distributed

    if dist.get_rank() == 1:
        if rank1_fails_after is None:
            return 0.0
        time.sleep(rank1_fails_after)
    started = time.monotonic()
    distributed.await_failing_ranks(timeout)
    return time.monotonic() - started


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_rank_waits_for_the_others_to_fail_before_it_exits():
    """torchrun stops every rank once one exits: the first to fail waits (up to a timeout) until all have."""
    first, late = run_in_processes(failing_ranks_worker, 2, 1.0, 10.0)
    assert 0.9 <= first < 5.0 and late < 0.5, (first, late)
    alone, _ = run_in_processes(failing_ranks_worker, 2, None, 0.5)
    assert 0.5 <= alone < 2.0, alone


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_trains_a_data_parallel_run_and_names_a_bad_layout_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = torchrun("train.max_steps=2", f"train.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('"tested": "the ') == 1  # the summary, printed by rank 0 only
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == [1, 2]
    assert (run_dir / "checkpoints" / "step_00000002" / "rng-rank1.pt").exists()

    result = torchrun("train.batch_size=3", f"train.run_dir={tmp_path / 'bad'}")
    assert result.returncode != 0
    errors = sorted(line for line in result.stderr.splitlines() if line.startswith("nemo-jq train"))
    assert len(errors) == 2 and errors[0].startswith("nemo-jq train (rank 1): error: train.batch_size=3 "), errors
    assert errors[1].startswith("nemo-jq train: error: train.batch_size=3 "), errors
