"""What the Megatron policy does differently for a Qwen3-MoE's experts (docs/moe.md).

Expert-parallel (EP) rank e holds experts ``e * E/EP`` onwards of every layer (:func:`expert_shard`); the
all-gather dispatcher sends each token to its experts' ranks and back, so an expert's gradient holds every token of
its EP group routed to it, and is summed over the expert-data-parallel ranks (the other groups holding the same
experts), as megatron-core's DDP keeps expert buffers apart. The gradient norm counts each expert once: on its EP
rank, summed over EP.

The load-balancing loss is megatron-core's: per layer and micro-batch, ``coeff * E / (T^2 k) * sum_e tokens_e * P_e``
over the micro-batch's real tokens (the padding is masked), attached to the router's output by
``MoEAuxLossAutoScaler``, whose backward scales it by a class-wide factor. megatron-core's pipeline schedule sets that
factor to 1/micro-batches (and its DDP averages over DP); the policy's losses are summed over micro-batches and DP
ranks, each already its share of the global batch, so :func:`with_load_balancing` sets it per micro-batch to the
micro-batch's share of the rows of all DP ranks: the aux gradient is the row-weighted mean over the batch's
micro-batches, as the main loss is a mean over its prompts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from nemo_jq.models.interfaces import LossFn, TokenBatch
from nemo_jq.models.megatron.mapping import ExpertShard
from nemo_jq.models.megatron.provider import Qwen3Architecture
from nemo_jq.models.megatron.replay import RoutingReplay


def expert_shard(arch: Qwen3Architecture) -> ExpertShard:
    """This rank's experts (megatron-core's expert-parallel rank); every EP rank's first expert."""
    from megatron.core import parallel_state

    size = parallel_state.get_expert_model_parallel_world_size() if arch.is_moe else 1
    per_rank = max(1, arch.num_experts // size)
    rank = parallel_state.get_expert_model_parallel_rank() if arch.is_moe else 0
    return ExpertShard(rank * per_rank, all_offsets=tuple(range(0, per_rank * size, per_rank)))


def with_load_balancing(loss_fn: LossFn, micro_batches: Sequence[TokenBatch], data_parallel_group: Any,
                        device: torch.device, replay: RoutingReplay | None = None,
                        tensor_parallel_group: Any = None) -> LossFn:
    """``loss_fn`` that first sets the load-balancing loss's backward scale for its micro-batch (its rows over the
    rows of every DP rank's micro-batches) and adds the micro-batch's ``load_balancing_loss`` (the layers' mean,
    without the coefficient) to its metrics, and its ``routing_disagreement`` where ``replay`` replayed routes (the
    TP ranks' counts summed). Called after the micro-batch's forward, before its backward."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    (rows,) = reduced([sum(micro.num_rows for micro in micro_batches)], data_parallel_group, dist.ReduceOp.SUM, device)

    def scaled(logprobs: torch.Tensor, index: int) -> tuple[torch.Tensor, dict[str, Any]]:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(micro_batches[index].num_rows / rows, device=device))
        loss, metrics = loss_fn(logprobs, index)
        measured = {"load_balancing_loss": load_balancing_loss(),
                    "routing_disagreement": None if replay is None else replay.disagreement(tensor_parallel_group)}
        return loss, {**metrics, **{key: value for key, value in measured.items() if value is not None}}

    return scaled


def reduced(values: list[int], group: Any, op: Any, device: torch.device) -> list[int]:
    """Small integers reduced over ``group`` (``op``: ``dist.ReduceOp``), read back: the rows of all DP ranks, the
    most rows and longest sequence of an EP group (the dry run, whose collectives carry no values, answers for it)."""
    if group is None or dist.get_world_size(group) == 1:
        return list(values)
    tensor = torch.tensor(values, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return [int(value) for value in tensor.tolist()]


def load_balancing_loss() -> float | None:
    """The load-balancing loss the routers logged since the last call (the mean over layers, its parts summed over the
    ranks that split the tokens; None: none logged), and megatron-core's tracker cleared for the next micro-batch."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if tracked is None:
        return None
    values, group = tracked["values"], tracked.get("reduce_group")
    if group is not None and dist.get_world_size(group) > 1:  # each TP (x CP) rank routed its part of the tokens
        values = values.clone()
        dist.all_reduce(values, group=group)
    value = float(values[values != 0].mean()) if bool((values != 0).any()) else 0.0
    clear_aux_losses_tracker()
    return value
