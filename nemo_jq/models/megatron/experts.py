"""What the Megatron policy does differently for a Qwen3-MoE's experts (docs/moe.md).

Expert-parallel (EP) rank e holds experts ``e * E/EP`` onwards of every layer (:func:`expert_shard`); the
all-gather dispatcher sends each token to its experts' ranks and back, so an expert's gradient holds every token of
its EP group routed to it, and is summed over the expert-data-parallel ranks (the other groups holding the same
experts), as megatron-core's DDP keeps expert buffers apart. The gradient norm counts each expert once: on its EP
rank, summed over the ranks holding one replica's experts (EP x PP).

The load-balancing loss is megatron-core's: per layer and micro-batch, ``coeff * E / (T^2 k) * sum_e tokens_e * P_e``
over the micro-batch's real tokens (the padding is masked), attached to the router's output by
``MoEAuxLossAutoScaler``, whose backward scales it by a class-wide factor read when the backward runs. megatron-core's
pipeline schedule sets that factor to 1/micro-batches after each forward (and its DDP averages over DP); the policy's
losses are summed over micro-batches and DP ranks, each already its share of the global batch, so :class:`RouterLog`
sets it, as each micro-batch's forward and backward begin, to the micro-batch's share of the rows of all DP ranks:
the aux gradient is the row-weighted mean over the batch's micro-batches, as the main loss is a mean over its prompts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.models.megatron.mapping import ExpertShard
from nemo_jq.models.megatron.provider import Qwen3Architecture
from nemo_jq.models.megatron.replay import RoutingReplay


def expert_shard(arch: Qwen3Architecture) -> ExpertShard:
    """This rank's experts (megatron-core's expert-parallel rank) and its slice of each (its expert-TP rank); every EP
    rank's first expert."""
    from megatron.core import parallel_state

    if not arch.is_moe:
        return ExpertShard()
    size = parallel_state.get_expert_model_parallel_world_size()
    per_rank = max(1, arch.num_experts // size)
    return ExpertShard(parallel_state.get_expert_model_parallel_rank() * per_rank,
                       parallel_state.get_expert_tensor_parallel_world_size(),
                       parallel_state.get_expert_tensor_parallel_rank(),
                       all_offsets=tuple(range(0, per_rank * size, per_rank)))


class RouterLog:
    """The routers' side of one ``forward_backward``, micro-batch by micro-batch. :meth:`enter` runs as a micro-batch's
    forward begins and again as its backward begins: under pipeline parallelism (1F1B) later micro-batches' forwards
    run in between, and under ``megatron.recompute_activations`` the backward runs the layers again (megatron-core
    computes the load-balancing loss only where grad is on: there, not in the checkpointed forward). Each time it sets
    the load-balancing loss's scale for the micro-batch (its rows over all DP ranks' rows) and files what the routers
    logged since the call before (the loss per layer, the replayed choices and those their own top-k would not make)
    under the micro-batch that ran them. :meth:`metrics` (a collective) sums those over the ranks that split the tokens
    (TP under sequence parallelism, CP) and the layers (PP) into each micro-batch's ``load_balancing_loss`` (the layers'
    mean, without the coefficient) and ``routing_disagreement``."""

    def __init__(self, micro_batches: Sequence[TokenBatch], data_parallel_group: Any, device: torch.device,
                 replay: RoutingReplay | None, num_layers: int):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

        (rows,) = reduced([sum(micro.num_rows for micro in micro_batches)], data_parallel_group, dist.ReduceOp.SUM, device)
        self.shares = [micro.num_rows / rows for micro in micro_batches]
        self.replay, self.device, self.num_layers = replay, device, num_layers
        #: Per micro-batch: each layer's logged loss, then the disagreeing and the replayed choices.
        self.logged = torch.zeros(len(micro_batches), num_layers + 2, device=device)
        self.current: int | None = None
        # megatron-core's tracker and aux-loss scale are the process's, shaped and placed by the first pass that set
        # them (the dry run of several configs builds models of other depths in one process, on another device than
        # a run's): this pass's start afresh
        get_moe_layer_wise_logging_tracker().clear()
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        self._file()  # what an earlier pass counted belongs to none of these

    def enter(self, index: int) -> None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        self._file()
        self.current = index
        # shaped [1] as megatron-core's schedule sets it: the first call makes the tensor later calls copy into
        MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), self.shares[index], device=self.device))

    def _file(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        counts = self.replay.take_counts() if self.replay is not None else None
        if self.current is not None:
            if tracked is not None:
                self.logged[self.current, : self.num_layers] += tracked["values"].detach().to(self.device)
            if counts is not None:
                self.logged[self.current, self.num_layers:] += counts.to(self.device)
        clear_aux_losses_tracker()

    def metrics(self, groups: Sequence[Any]) -> list[dict[str, float]]:
        """Each micro-batch's logged metrics, summed over ``groups`` (every rank of each takes part)."""
        self._file()
        self.current = None
        logged = self.logged
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(logged, group=group)
        out = []
        for row in logged.tolist():
            losses, (disagreeing, replayed) = [value for value in row[: self.num_layers] if value], row[self.num_layers:]
            out.append({**({"load_balancing_loss": sum(losses) / len(losses)} if losses else {}),
                        **({"routing_disagreement": disagreeing / replayed} if replayed else {})})
        return out


def reduced(values: list[int], group: Any, op: Any, device: torch.device) -> list[int]:
    """Small integers reduced over ``group`` (``op``: ``dist.ReduceOp``), read back: the rows of all DP ranks, the
    most rows and longest sequence of an EP group (the dry run, whose collectives carry no values, answers for it)."""
    if group is None or dist.get_world_size(group) == 1:
        return list(values)
    tensor = torch.tensor(values, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return [int(value) for value in tensor.tolist()]
