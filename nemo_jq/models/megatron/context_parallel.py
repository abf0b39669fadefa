"""Context parallelism (CP): each rank of a CP group holds part of every sequence, load-balanced.

Under causal attention a late token attends to more tokens than an early one, so megatron-core
(``get_batch_on_this_cp_rank``, ``get_pos_emb_on_this_cp_rank``) and Transformer Engine's
context-parallel attention cut the sequence into ``2 * CP`` equal chunks and give rank ``r``
chunks ``r`` and ``2 * CP - 1 - r``: every rank then does the same attention work. The policy
splits its inputs that way (``split_for_rank``) and puts the per-token log-probs back in order
(``gather_sequence``) before the loss, which needs whole sequences (per-span sums).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def split_for_rank(tensor: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """CP rank ``rank``'s part of ``tensor`` along ``dim``: chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size``.

    ``tensor.shape[dim]`` must be a multiple of ``2 * size``; ``size == 1`` returns ``tensor`` itself.
    """
    if size == 1:
        return tensor
    if tensor.shape[dim] % (2 * size):
        raise ValueError(f"a sequence of {tensor.shape[dim]} does not split into 2 x {size} equal chunks for context "
                         f"parallelism: pad it to a multiple of {2 * size}")
    chunks = tensor.chunk(2 * size, dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim)


def _in_sequence_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of ``split_for_rank`` over all ranks: ``parts[r]`` is rank ``r``'s part."""
    size = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * size - 1 - rank] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.rank, ctx.size, ctx.dim = dist.get_rank(group), dist.get_world_size(group), dim
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return _in_sequence_order(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_for_rank(grad, ctx.rank, ctx.size, ctx.dim), None, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Every CP rank's ``split_for_rank`` part of a sequence, all-gathered and put back in order along ``dim``.

    Differentiable. Backward keeps this rank's part of the incoming gradient and sends nothing: it
    assumes what every rank of the group computes from the gathered tensor is the same (the loss
    of whole sequences), so this rank's part of that gradient is already the whole of it, and the
    gradients of the weights, each rank's from its own tokens, are summed over CP afterwards.
    """
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherSequence.apply(local, group, dim)
