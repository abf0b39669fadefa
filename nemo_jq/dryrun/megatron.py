"""The Megatron backend in the dry run: one rank of a TP x PP x CP x DP world at a time, in this one process.

:func:`as_rank` makes this process rank ``r`` of ``world_size`` with torch's fake process group (backend ``fake``
over a ``FakeStore``: every collective completes at once, without peers, and leaves its output as it was, which
on fake tensors is only a shape) and megatron-core's parallel state laid out as the config's ``megatron:`` section
says, so the policy builds exactly this rank's shard (its stage's layers, its TP slice, its DP share of the
distributed optimizer) and runs its part of the 1F1B schedule. What a fake group cannot carry, values, the dry run
does not read, except objects (pickled collectives), which :class:`_ObjectCollectives` answers.

megatron-core 0.16.1 assumes CUDA in a few places the policy reaches; :func:`megatron_on_stand_in_gpu` replaces
exactly those while a rank is simulated (each with why). ``tests/megatron_cpu.py`` patches the same places for
its CPU runs, with CPU in place of the stand-in GPU.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from nemo_jq.dryrun.world import GPU, active_world, patched
from nemo_jq.models.megatron.layout import MegatronLayout


@dataclass(frozen=True)
class RankPlace:
    """Where a global rank sits, in megatron-core's default order (``tp-cp-ep-dp-pp``: TP fastest, PP slowest)."""

    rank: int
    tensor_parallel: int
    context_parallel: int
    data_parallel: int
    pipeline_stage: int
    pipeline_stages: int

    @classmethod
    def of(cls, rank: int, layout: MegatronLayout, world_size: int) -> RankPlace:
        tp, cp = layout.tensor_parallel, layout.context_parallel
        dp = layout.data_parallel(world_size)
        return cls(rank, rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp),
                   layout.pipeline_parallel)

    def describe(self) -> str:
        stage = ("the first and last pipeline stage" if self.pipeline_stages == 1 else "the first pipeline stage"
                 if self.pipeline_stage == 0 else "the last pipeline stage" if self.pipeline_stage == self.pipeline_stages - 1
                 else f"pipeline stage {self.pipeline_stage}")
        return (f"rank {self.rank}: {stage}, TP rank {self.tensor_parallel}, CP rank {self.context_parallel}, "
                f"DP rank {self.data_parallel}")


def default_ranks(config: Any, world_size: int) -> list[int]:
    """Replica 0's first rank of the first pipeline stage (its sampling rank) and, where it samples too (vLLM) or no
    training rank samples (a split world), of the last stage: the stages that differ (the embedding and the most
    micro-batches in flight; the final norm, the LM head and the log-probs)."""
    layout = config.megatron
    last = (layout.pipeline_parallel - 1) * world_size // layout.pipeline_parallel
    alike = samples(config, RankPlace.of(last, layout, world_size)) or config.rollout.placement == "separate"
    return sorted({0, last} if alike else {0})


def check_ranks(config: Any, ranks: list[int], world_size: int) -> None:
    wrong = [rank for rank in ranks if not 0 <= rank < world_size]
    if wrong:
        raise ValueError(f"--ranks {','.join(map(str, wrong))}: a rank of {world_size} GPUs is 0 to {world_size - 1}")
    colocated = config.rollout.placement == "colocated"  # rollout ranks of their own take any names (sent, not refitted)
    if colocated and config.rollout.engine != "vllm" and config.megatron.pipeline_parallel > 1:
        raise ValueError(f"rollout.engine={config.rollout.engine} with megatron.pipeline_parallel="
                         f"{config.megatron.pipeline_parallel} is not dry-run yet: its refit names every stage's weights "
                         "from the other stages (an object the fake process group cannot carry); dry-run "
                         "rollout.engine=vllm, or megatron.pipeline_parallel=1")


@contextlib.contextmanager
def as_rank(rank: int, world_size: int, layout: MegatronLayout) -> Iterator[None]:
    """Inside, this process is ``rank`` of ``world_size`` (fake process group, megatron-core's parallel state of
    ``layout``), with megatron-core's CUDA assumptions answered on the stand-in GPU."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nemo_jq.backends import MEGATRON_ON_CPU
    from nemo_jq.runtime import distributed

    if dist.is_initialized():
        raise RuntimeError("the Megatron dry run makes this process a rank of its own fake world: it cannot run inside "
                           "a process group (run nemo-jq dryrun without torchrun)")
    # "meta:fake" too: batch_isend_irecv (the pipeline's p2p) looks the backend up by the tensors' device.
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with contextlib.ExitStack() as stack:
            # the backend refuses a device other than CUDA unless megatron-core's CUDA calls are patched: they are
            stack.enter_context(_environment(MEGATRON_ON_CPU, "1"))
            stack.enter_context(megatron_on_stand_in_gpu())
            stack.enter_context(_ObjectCollectives())
            stack.enter_context(_DistributedCheckpoints())
            # every simulated rank writes the run's files as global rank 0 does (a checkpoint's folder, its rename, the
            # RNG file every rank can fall back on): on a real run they are on one shared disk, here the simulated
            # rank's own checkpoint is the one it reads back
            stack.enter_context(patched(distributed, "is_writer", lambda: True))
            stack.enter_context(patched(distributed, "rank", lambda: 0))
            # no gloo groups: gloo would wait for peers that do not exist (the policy uses none of them)
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tensor_parallel, pipeline_model_parallel_size=layout.pipeline_parallel,
                context_parallel_size=layout.context_parallel, expert_model_parallel_size=layout.expert_parallel,
                expert_tensor_parallel_size=layout.expert_tensor_parallel, create_gloo_process_groups=False)
            stack.callback(parallel_state.destroy_model_parallel)
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def megatron_on_stand_in_gpu() -> Iterator[None]:
    """megatron-core 0.16.1's CUDA assumptions, answered on the stand-in GPU (:data:`~nemo_jq.dryrun.world.GPU`)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter

    from nemo_jq.models.megatron import experts

    with contextlib.ExitStack() as stack:
        for owner, name, replacement in (
            # on a GPU the policy takes Transformer Engine's fused attention, which keeps no [s, s] scores; the CPU
            # build has no TE, and megatron-core's local attention keeps the scores and the probabilities of every
            # head (quadratic in the length): it attends as TE does instead (see _fused_attention)
            (DotProductAttention, "forward", _fused_attention),
            # weights (without use_cpu_initialization), rotary frequencies, the pipeline's shape and activation
            # buffers and the global memory buffer are made on torch.cuda.current_device()
            (torch.cuda, "current_device", lambda: GPU),
            # the pipeline's p2p waits for its batched sends and receives; nothing runs asynchronously here
            (torch.cuda, "synchronize", lambda device=None: None),
            # CudaRNGStatesTracker.fork swaps the CUDA RNG state around dropout (Qwen3 has none), and recomputation
            # saves and restores it around each recomputed layer: the CPU build has no CUDA generator
            (random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext()),
            (random, "_get_cuda_rng_state", lambda *args, **kwargs: None),
            (random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
            # the schedules count tokens in torch.zeros(..., device="cuda")
            (schedules, "torch", _TorchWithGpuZeros()),
            # a tied model's last stage moves its copy of the embedding with .cuda() before initialising it
            (torch.Tensor, "cuda", lambda self, *args, **kwargs: self.to(GPU)),
            # a Qwen3-MoE's small reductions read values a fake group does not carry: the simulated ranks hold alike
            # batches (and what the routers logged is not read)
            (experts, "reduced", _reduced_alike),
            (experts.RouterLog, "metrics", lambda self, groups: [{} for _ in self.shares]),
            # which tokens go to which expert is data: routing balanced, k of the E experts each token, each local
            # expert an equal share of what its rank gets
            (TopKRouter, "routing", _routing_balanced(TopKRouter.routing)),
            (SequentialMLP, "forward", _balanced(SequentialMLP.forward)),
        ):
            stack.enter_context(patched(owner, name, replacement))
        yield


def _routing_balanced(routing: Any) -> Any:
    """``TopKRouter.routing`` telling the world the share of (token, expert) pairs it routes, top-k of the experts:
    what the dispatcher's ``masked_select`` over the routing map keeps (:attr:`FakeWorld.selected_share`)."""
    def balanced(self: Any, *args: Any, **kwargs: Any) -> Any:
        active_world().selected_share = self.topk / self.config.num_moe_experts
        return routing(self, *args, **kwargs)
    return balanced


def _balanced(forward: Any) -> Any:
    """``SequentialMLP.forward`` with ``tokens_per_expert`` (data a fake tensor lacks) as an even split of its
    tokens over the local experts: routing balanced."""
    def balanced(self: Any, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        count, experts = hidden.shape[0], self.num_local_experts
        with unset_fake_temporarily():  # a real host tensor: its values are read
            even = torch.tensor([count // experts + (index < count % experts) for index in range(experts)])
        return forward(self, hidden, even, probs)
    return balanced


def _reduced_alike(values: list[int], group: Any, op: Any, device: Any) -> list[int]:
    """``experts.reduced`` where every rank of ``group`` holds this one's values."""
    size = 1 if group is None else dist.get_world_size(group)
    return [value * size for value in values] if op == dist.ReduceOp.SUM else list(values)


def _fused_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                     attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
    """``DotProductAttention.forward`` (``[s, b, heads, d]`` in, ``[s, b, heads x d]`` out) as causal SDPA, which the
    world answers with CUDA's FlashAttention (:func:`~nemo_jq.dryrun.world.gpu_attention`: grouped KV heads as they
    are, the output and its log-sum-exp kept). Rows are right-padded, so the causal mask is the policy's whole mask
    (the one TE builds for itself)."""
    q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                           enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


class _TorchWithGpuZeros:
    """``torch`` for megatron-core's ``schedules`` module, whose ``torch.zeros`` name ``device="cuda"``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=GPU if device == "cuda" else device, **kwargs)


class _ObjectCollectives:
    """Pickled collectives, which carry values a fake group cannot: every rank holds what this one holds.

    The ranks run one program (SPMD), so their objects are alike: metrics, failure reports, a pipeline stage's
    parameter names and dtypes (another stage's layers have the same shapes, and the weights refit and exported one
    at a time have the largest, the embedding's or the LM head's, on either stage). ``all_gather_object`` fills every
    rank's slot with this rank's object; ``broadcast_object_list`` leaves the list as this rank holds it. A replica's
    rollouts, which its first rank sends to the others, are this rank's own; where vLLM's engines of a replica each
    sample a share of its prompts, the other shares are full-budget rows (``phases.DryRun._other_shares``); a rank that
    samples none (the native or hf sampler's replicas but their first rank) is sent what the sampling rank's dry run
    samples (``phases.DryRun._rollouts_from_the_sampling_rank``).
    """

    def __enter__(self) -> _ObjectCollectives:
        from nemo_jq.rollouts import refit

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(patched(dist, "all_gather_object", _all_gather_own_object))
        self._stack.enter_context(patched(dist, "broadcast_object_list", _broadcast_own_objects))
        self._stack.enter_context(patched(refit, "share_in_chunks", _own_rollouts))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class _DistributedCheckpoints:
    """megatron-core's distributed checkpoints (``dist_checkpointing``), kept as the dry run keeps ``torch.save``'s
    files: its validation gathers every rank's shards, which on a fake group are this rank's alone (its integrity
    check fails: "Invalid access pattern"), and its writers and readers move bytes a fake tensor has not. A save keeps
    the common (non-sharded) state and each sharded tensor's key, after megatron-core's own preprocessing (its
    factories applied); a load reads each tensor into the one it is given, in place (as the ``torch_dist`` format
    loads), and merges the factories' parts with megatron-core's own code. What the project does around them (the
    distributed optimizer's gathered state in ``MegatronPolicy.save``, ``_zero_shard_reads``' reads) runs as it is."""

    def __enter__(self) -> _DistributedCheckpoints:
        from megatron.core import dist_checkpointing

        from nemo_jq.models.megatron import checkpoint

        self.saved: dict[str, tuple[dict, set[str]]] = {}
        self._stack = contextlib.ExitStack()
        for name, replacement in (("save", self._save), ("load", self._load), ("load_common_state_dict", self._common),
                                  ("load_tensors_metadata", self._keys)):
            self._stack.enter_context(patched(dist_checkpointing, name, replacement))
        # the writer's helper processes, which nothing here writes with
        self._stack.enter_context(patched(checkpoint, "_start_writer_helpers", lambda: None))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _save(self, state: dict, checkpoint_dir: str, *args: Any, **kwargs: Any) -> None:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import apply_factories, is_main_replica
        from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

        apply_factories(state)
        _, state = extract_nonpersistent(state)
        sharded, common = extract_sharded_base(state)
        # its writer copies this rank's main-replica shards to the host before it writes them (those on the GPU)
        staged = sum(value.data.nbytes for value in nested_values(sharded) if is_main_replica(value.replica_id)
                     and isinstance(getattr(value, "data", None), torch.Tensor) and value.data.device.type != "cpu")
        key = f"dry run checkpoint {len(self.saved)}"  # in the folder, so that it survives the checkpoint's rename
        with active_world().tracker.host_reserved(staged):
            self.saved[key] = (common, {value.key for value in nested_values(sharded)})
        (Path(checkpoint_dir) / "metadata.json").write_text(key)

    def _of(self, checkpoint_dir: str) -> tuple[dict, set[str]]:
        return self.saved[(Path(checkpoint_dir) / "metadata.json").read_text()]

    def _common(self, checkpoint_dir: str) -> dict:
        """A copy of the saved common state's nesting (its values, a few scalars and the step count, as they are)."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace

        return dict_list_map_outplace(lambda value: value, self._of(checkpoint_dir)[0])

    def _keys(self, checkpoint_dir: str, *args: Any, **kwargs: Any) -> dict[str, None]:
        return dict.fromkeys(self._of(checkpoint_dir)[1])

    def _load(self, request: dict, checkpoint_dir: str, *args: Any, **kwargs: Any) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge, nested_values
        from megatron.core.dist_checkpointing.mapping import apply_factory_merges
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
        from megatron.core.dist_checkpointing.utils import extract_sharded_base

        common = self._common(checkpoint_dir)
        request, nonpersistent, factories = load_preprocess(request)
        merge(common, nonpersistent)
        request, _ = extract_sharded_base(request)
        missing = {value.key for value in nested_values(request)} - self._of(checkpoint_dir)[1]
        if missing:
            raise KeyError(f"the dry run's checkpoint {checkpoint_dir} lacks {sorted(missing)[:3]}")
        dict_list_map_inplace(lambda value: value.data, request)  # read in place; a ShardedObject's value as it is
        merge(common, request)
        return apply_factory_merges(common, factories)


def _all_gather_own_object(object_list: list, obj: Any, group: Any = None) -> None:
    object_list[:] = [obj] * len(object_list)


def _broadcast_own_objects(object_list: list, src: int | None = None, group: Any = None, device: Any = None,
                           group_src: int | None = None) -> None:
    return None


def _own_rollouts(rollouts: Any, source: int, group: Any) -> Any:
    if rollouts is None:
        raise AssertionError("a rank that samples none waits for its rollouts (the dry run stands in its sampling rank)")
    return rollouts


def samples(config: Any, place: RankPlace) -> bool:
    """Whether ``place`` samples: every rank with vLLM (lockstep under torchrun), else each replica's first rank."""
    return config.rollout.engine == "vllm" or place.tensor_parallel == place.context_parallel == place.pipeline_stage == 0


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
