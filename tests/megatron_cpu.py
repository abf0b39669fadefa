"""Run megatron-core on CPU in N gloo processes, for tests only.

``python tests/megatron_cpu.py ARGS`` is ``nemo-jq ARGS`` with the patches below applied, for
``torchrun`` to start on CPU.

megatron-core assumes CUDA in a few places that a CPU forward and backward reach. The patches
below replace exactly those, in the spawned test processes only (never in the package):

* ``RotaryEmbedding.get_emb`` moves its frequencies to the current CUDA device;
* ``CudaRNGStatesTracker.fork`` (around dropout) swaps CUDA RNG states;
* ``GlobalMemoryBuffer.get_tensor`` (sequence-parallel all-gathers) allocates on CUDA;
* ``torch.cuda.current_device`` places sequence-parallel reduce-scatter outputs (and a distributed
  checkpoint's failure flags);
* activation recomputation saves and restores the CUDA RNG state around each recomputed layer;
* ``torch.cuda.synchronize`` waits for the device-to-host copies of a distributed checkpoint;
* pipelines: the schedules count tokens in a tensor made with ``device="cuda"``, and a tied
  model's last stage moves its copy of the embedding with ``.cuda()`` before the all-reduce that
  initialises it (``p2p_communication`` places its buffers with ``torch.cuda.current_device``
  and waits with ``torch.cuda.synchronize``, both replaced above);
* context parallelism: ``get_pos_emb_on_this_cp_rank`` pins a CPU index tensor in memory (CUDA
  only), and megatron-core's local attention refuses CP, which only Transformer Engine's
  attention implements (a ring of key/value exchanges on GPU). The stand-in below all-gathers
  the keys and values over the CP group (backward: sums their gradients over it) and masks by
  the split sequence's true positions: the same attention, so everything around it (the split
  inputs, the rotary positions, the log-prob gather, the gradient sums over CP, checkpoints and
  the recipe) runs here as it would on GPU.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from nemo_jq.backends import MEGATRON_ON_CPU


def _rotary_emb_on_cpu(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` (non-interleaved) without the move to CUDA: ``[s, 1, 1, d]``."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def _buffer_on_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
    return torch.empty(tensor_shape, dtype=dtype)


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """``get_pos_emb_on_this_cp_rank`` without pinned memory."""
    from nemo_jq.models.megatron.context_parallel import split_for_rank

    return split_for_rank(pos_emb, cp_group.rank(), cp_group.size(), seq_dim)


class _KeysValuesOfAllRanks(torch.autograd.Function):
    """``[s / CP, ...]`` keys or values of this CP rank -> ``[s, ...]`` of all ranks, in sequence order. Every rank's
    queries attend to them, so backward sums their gradients over CP and keeps this rank's part."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        from nemo_jq.models.megatron.context_parallel import gather_sequence

        ctx.group = group
        return gather_sequence(local, group, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from nemo_jq.models.megatron.context_parallel import split_for_rank

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return split_for_rank(grad, ctx.group.rank(), ctx.group.size(), dim=0), None


def _context_parallel_attention():
    """megatron-core's local ``DotProductAttention`` made context-parallel by all-gathering keys and values."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from nemo_jq.models.megatron.context_parallel import split_for_rank

    class ContextParallelDotProductAttention(DotProductAttention):
        def __init__(self, config, *args: Any, **kwargs: Any):
            size, config.context_parallel_size = config.context_parallel_size, 1  # the parent refuses CP > 1
            try:
                super().__init__(config, *args, **kwargs)
            finally:
                config.context_parallel_size = size

        def forward(self, query, key, value, attention_mask, *args: Any, **kwargs: Any):
            group = parallel_state.get_context_parallel_group()
            if group.size() == 1:
                return super().forward(query, key, value, attention_mask, *args, **kwargs)
            key, value = _KeysValuesOfAllRanks.apply(key, group), _KeysValuesOfAllRanks.apply(value, group)
            positions = torch.arange(key.shape[0])
            query_positions = split_for_rank(positions, group.rank(), group.size(), dim=0)
            causal_mask = (positions[None, :] > query_positions[:, None])[None, None]  # True: masked
            return super().forward(query, key, value, causal_mask, *args, **kwargs)

    return ContextParallelDotProductAttention


class _TorchWithCpuZeros:
    """``torch`` for megatron-core's ``schedules`` module, whose ``torch.zeros`` calls name ``device="cuda"``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)


def patch_megatron_for_cpu() -> None:
    """Apply the CPU patches to this process (irreversibly: call it in spawned workers only)."""
    from megatron.core.models import backends
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.utils import GlobalMemoryBuffer

    RotaryEmbedding.get_emb = _rotary_emb_on_cpu
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    backends.DotProductAttention = _context_parallel_attention()  # the local spec's core attention
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    GlobalMemoryBuffer.get_tensor = _buffer_on_cpu
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    schedules.torch = _TorchWithCpuZeros()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, results: str, fn: Callable, args: tuple, process_group: bool) -> None:
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    os.environ[MEGATRON_ON_CPU] = "1"  # the recipe's megatron backend may now run on CPU
    if process_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    else:  # as torchrun leaves a rank, to start its own group from
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    try:
        torch.save(fn(*args), Path(results) / f"{rank}.pt")
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


#: What the fork server that starts the workers imports once, so that no worker imports it again: importing
#: transformers' Qwen3 and megatron-core costs each fresh process about 6 s of CPU. The server itself runs no
#: torch op (no thread pool to break by forking), and each worker applies the CPU patches to its own copy.
PRELOADED_MODULES = ["megatron_cpu", "helpers", "nemo_jq.recipe.trainer", "nemo_jq.models.megatron.policy",
                     "transformers.models.qwen3.modeling_qwen3"]


def run_in_processes(fn: Callable, world_size: int, *args: Any, process_group: bool = True) -> list[Any]:
    """``fn(*args)`` in ``world_size`` gloo processes forked from a server holding ``PRELOADED_MODULES``;
    returns each rank's result, by rank. ``process_group=False``: no group is started for ``fn``, which finds
    torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...) to start its own.

    ``fn`` must be importable by name (a module-level function). An exception in any rank is
    re-raised here with that rank's traceback, and the other ranks are stopped. Workers inherit the
    server's environment, as it was at the first call: pass what a worker needs as arguments.
    """
    multiprocessing.set_forkserver_preload(PRELOADED_MODULES)  # takes effect when the server first starts
    with tempfile.TemporaryDirectory() as results:
        torch.multiprocessing.start_processes(_worker, args=(world_size, free_port(), results, fn, args, process_group),
                                              nprocs=world_size, start_method="forkserver")
        return [torch.load(Path(results) / f"{rank}.pt", weights_only=False) for rank in range(world_size)]


if __name__ == "__main__":
    import sys

    from nemo_jq.cli import main

    patch_megatron_for_cpu()
    os.environ[MEGATRON_ON_CPU] = "1"
    raise SystemExit(main(sys.argv[1:]))
