"""A rollout engine's twin in a child process, sampling while this process trains.

The twin is the engine itself, pickled into a spawned process (``torch.multiprocessing``): its model's
tensors are in shared memory (CPU) or shared through CUDA IPC, so a refit in this process, made while
the child is idle, is what the child samples from next. Only token ids cross the pipe. A second thread
would share this process's GIL, which a small model's decode loop holds most of the time: on CPU it
overlaps little; a process overlaps fully.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Sequence

import torch

from nemo_jq.models.interfaces import Rollout
from nemo_jq.rollouts.budget import BudgetedRollouts


def share_weights(engine: BudgetedRollouts) -> None:
    """Put the weights of an engine that decodes an HF model (the native and hf samplers) in shared memory."""
    model = getattr(engine.sampler, "model", None)
    if model is None:
        raise ValueError(f"{type(engine.sampler).__name__} holds no HF model to share with a sampling process")
    model.share_memory()


def publish_refit(device: torch.device) -> None:
    """Wait until this process's refit has written the weights on ``device``: the child reads them through CUDA IPC
    from its own context and stream, which nothing orders after this process's in-place copies."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def second_process_refused(device: torch.device) -> str | None:
    """Why a second process cannot open ``device`` (a GPU in EXCLUSIVE_PROCESS compute mode allows one CUDA context,
    so the sampling child's would fail), or None. Read from ``nvidia-smi``, by the GPU's ``CUDA_VISIBLE_DEVICES``
    name; a machine without it says nothing."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = [name.strip() for name in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
    gpu = visible[index] if index < len(visible) else str(index)
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", gpu],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if query.returncode == 0 and query.stdout.strip().lower().replace(" ", "_") == "exclusive_process":
        return f"GPU {gpu} is in EXCLUSIVE_PROCESS compute mode (one CUDA context at a time)"
    return None


class SamplingProcess:
    """``engine`` in a child process: :meth:`submit` a request, :meth:`result` waits for its rollouts."""

    def __init__(self, engine: BudgetedRollouts, *, threads: int):
        context = torch.multiprocessing.get_context("spawn")
        self.requests, responses = context.Pipe()
        self.process = context.Process(target=_serve, args=(engine, responses, threads), daemon=True,
                                       name="nemo_jq-rollouts")
        self.process.start()
        responses.close()
        self.waiting = False

    def submit(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool, seed: int) -> None:
        if self.waiting:
            raise RuntimeError("a sampling process takes one request at a time: collect the last one's result first")
        self.requests.send((list(prompts), num_samples, sample_answers, seed))
        self.waiting = True

    def result(self) -> tuple[list[list[Rollout]], int, float]:
        """The rollouts, the tokens they hold and the seconds they took (in the child)."""
        try:
            reply = self.requests.recv()
        except EOFError:
            raise RuntimeError(f"the sampling process died (exit code {self.process.exitcode})") from None
        self.waiting = False
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        if self.process.is_alive():
            self.requests.send(None)
            self.process.join(timeout=30)
        self.requests.close()


def _serve(engine: BudgetedRollouts, connection: Any, threads: int) -> None:
    torch.set_num_threads(threads)
    while (request := connection.recv()) is not None:
        prompts, num_samples, sample_answers, seed = request
        try:
            started, before = time.perf_counter(), engine.tokens_generated
            generator = torch.Generator(engine_device(engine)).manual_seed(seed)
            rollouts = engine.generate(prompts, num_samples, sample_answers=sample_answers, generator=generator)
            connection.send((rollouts, engine.tokens_generated - before, time.perf_counter() - started))
        except Exception as err:  # noqa: BLE001 - handed to the trainer, which raises it
            connection.send(err)


def engine_device(engine: BudgetedRollouts) -> torch.device:
    return getattr(engine.sampler, "device", torch.device("cpu"))
