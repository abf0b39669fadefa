"""Token log-probs under a vocab-parallel LM head (as NeMo-RL's ``ChunkedDistributedLogprob``).

Under tensor parallelism each rank holds the LM head's rows of its slice of the vocabulary, so its
logits are ``[N, V/TP]``. The full-vocabulary log-softmax needs only two numbers per row from the other
ranks, the max and the sum of exponentials, so those are all-reduced in fp32 (the max first, for a
stable sum); the target's logit is contributed by the rank whose slice holds it and zero elsewhere,
riding along in the sum's all-reduce. Rows are processed ``chunk_size`` at a time, so the fp32
temporaries are one chunk, never ``[N, V/TP]``. Backward saves no softmax: it recomputes it per chunk
from the forward's log-sum-exp (``[N]``), which also spares backward's all-reduces. Columns past the
true vocabulary (Megatron's padding rows) are -inf.

:func:`vocab_parallel_head_logprobs` starts from the final hidden states and projects each chunk of
positions itself, in forward and again in backward, as the hf backend's ``chunked_token_logprobs``
does: no ``[N, V/TP]`` logits exist at any time, nor between forward and backward (the policy's path).
:func:`vocab_parallel_token_logprobs` starts from logits someone already holds.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from nemo_jq.precision import autocast_dtype_now, compute_dtype, upcast

#: ``logits_of(start, end)``: rows ``start:end`` of the logits, a fresh compute-dtype tensor, padding columns -inf.
ChunkLogits = Callable[[int, int], torch.Tensor]


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _mask_padding_(chunk: torch.Tensor, num_valid: int) -> torch.Tensor:
    chunk[:, num_valid:] = float("-inf")
    return chunk


def _copied_rows(logits: torch.Tensor, num_valid: int) -> ChunkLogits:
    return lambda start, end: _mask_padding_(logits[start:end].to(compute_dtype(logits), copy=True), num_valid)


def _projected_rows(hidden: torch.Tensor, projection: torch.Tensor, num_valid: int) -> ChunkLogits:
    return lambda start, end: _mask_padding_(upcast(hidden[start:end] @ projection.T), num_valid)


def _slice_targets(targets: torch.Tensor, vocab_start: int, num_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local ids, owned)``: each target's column in this rank's slice (0 where another rank owns it)."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < num_valid)
    return torch.where(owned, local, 0), owned


def _logprobs_by_chunk(logits_of: ChunkLogits, rows: int, chunk_size: int, local_targets: torch.Tensor,
                       owned: torch.Tensor, group: dist.ProcessGroup | None, dtype: torch.dtype,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, log-sum-exp)``, both ``[rows]``, one chunk of logits alive at a time."""
    out = torch.empty(rows, dtype=dtype, device=device)
    logsumexp = torch.empty_like(out)
    for start in range(0, rows, chunk_size):
        end = start + chunk_size
        chunk = logits_of(start, end)
        top = _all_reduce(chunk.max(1).values, dist.ReduceOp.MAX, group)
        chosen = torch.where(owned[start:end], chunk.gather(1, local_targets[start:end, None]).squeeze(1), 0.0)
        total = chunk.sub_(top[:, None]).exp_().sum(1)
        total, chosen = _all_reduce(torch.stack([total, chosen]), dist.ReduceOp.SUM, group)
        logsumexp[start:end] = top + total.log()
        out[start:end] = chosen - logsumexp[start:end]
    return out, logsumexp


def _logit_grads_by_chunk(logits_of: ChunkLogits, rows: int, chunk_size: int, local_targets: torch.Tensor,
                          owned: torch.Tensor, logsumexp: torch.Tensor,
                          grad_out: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, end, d loss / d logits[start:end])`` per chunk: ``grad_out * (onehot(target) - softmax)``, the
    softmax formed in place from the forward's log-sum-exp."""
    for start in range(0, rows, chunk_size):
        end = start + chunk_size
        g = upcast(grad_out[start:end, None])
        grad = logits_of(start, end).sub_(logsumexp[start:end, None]).exp_().mul_(-g)
        grad.scatter_add_(1, local_targets[start:end, None], g * owned[start:end, None])
        yield start, end, grad


class _VocabParallelTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                group: dist.ProcessGroup | None, chunk_size: int):
        num_valid = max(0, min(logits.shape[1], vocab_size - vocab_start))
        local_targets, owned = _slice_targets(targets, vocab_start, num_valid)
        out, logsumexp = _logprobs_by_chunk(_copied_rows(logits, num_valid), logits.shape[0], chunk_size, local_targets, owned, group,
                                            compute_dtype(logits), logits.device)
        ctx.save_for_backward(logits, local_targets, owned, logsumexp)
        ctx.num_valid, ctx.chunk_size = num_valid, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, local_targets, owned, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start, end, grad in _logit_grads_by_chunk(_copied_rows(logits, ctx.num_valid), logits.shape[0], ctx.chunk_size, local_targets,
                                                      owned, logsumexp, grad_out):
            grad_logits[start:end] = grad
        return grad_logits, None, None, None, None, None


class _VocabParallelHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                vocab_size: int, group: dist.ProcessGroup | None, chunk_size: int):
        num_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
        local_targets, owned = _slice_targets(targets, vocab_start, num_valid)
        # The products' dtype, fixed here so that backward (which runs outside autocast) recomputes the same logits.
        ctx.matmul_dtype = autocast_dtype_now(hidden.device.type) or hidden.dtype
        hidden_in, projection = hidden.to(ctx.matmul_dtype), weight.to(ctx.matmul_dtype)
        out, logsumexp = _logprobs_by_chunk(_projected_rows(hidden_in, projection, num_valid), hidden.shape[0], chunk_size,
                                            local_targets, owned, group, compute_dtype(hidden_in), hidden.device)
        ctx.save_for_backward(hidden, weight, local_targets, owned, logsumexp)
        ctx.num_valid, ctx.chunk_size = num_valid, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, local_targets, owned, logsumexp = ctx.saved_tensors
        hidden_in, projection = hidden.to(ctx.matmul_dtype), weight.to(ctx.matmul_dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=compute_dtype(weight), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        chunks = _logit_grads_by_chunk(_projected_rows(hidden_in, projection, ctx.num_valid), hidden.shape[0],
                                       ctx.chunk_size, local_targets, owned, logsumexp, grad_out)
        for start, end, grad in chunks:
            if grad_weight is not None:  # accumulated without a [V/TP, H] temporary
                grad_weight.addmm_(grad.T, upcast(hidden_in[start:end]))
            if grad_hidden is not None:  # this rank's vocabulary's part: the caller sums it over TP
                grad_hidden[start:end] = grad.to(ctx.matmul_dtype) @ projection
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, \
            None, None, None, None, None


def _check(rows_by: torch.Tensor, targets: torch.Tensor, chunk_size: int, what: str) -> None:
    if rows_by.dim() != 2 or targets.shape != rows_by.shape[:1]:
        raise ValueError(f"expected {what} and targets [N]; got {list(rows_by.shape)} and {list(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                                  vocab_size: int | None = None, group: dist.ProcessGroup | None = None,
                                  chunk_size: int = 256) -> torch.Tensor:
    """``[N]`` log-probs (fp32, fp64 for fp64 logits) of ``targets`` under the softmax over the whole vocabulary.

    Every rank of ``group`` calls it with the same ``targets`` and gets the same result; the
    gradient reaches each rank's own logits only. With ``group=None`` (or one rank) it equals
    ``log_softmax(logits).gather(targets)``. It saves ``logits`` for backward: from hidden states,
    :func:`vocab_parallel_head_logprobs` never forms them.

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary columns ``vocab_start : vocab_start + V_local``.
        targets: ``[N]`` global token ids, all below ``vocab_size``.
        vocab_size: the true vocabulary; columns at or past it are padding and get probability 0.
            Defaults to no padding.
        chunk_size: rows reduced at once; trades speed for peak memory.
    """
    _check(logits, targets, chunk_size, "logits [N, V_local]")
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[1]
    return _VocabParallelTokenLogprob.apply(logits, targets, vocab_start, vocab_size, group, chunk_size)


def vocab_parallel_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                 vocab_start: int = 0, vocab_size: int | None = None,
                                 group: dist.ProcessGroup | None = None, chunk_size: int = 256) -> torch.Tensor:
    """:func:`vocab_parallel_token_logprobs` of the logits ``hidden @ weight.T``, projected ``chunk_size``
    positions at a time in forward and again in backward: at most one chunk of logits ``[chunk_size, V_local]``
    exists at once, and none is saved for backward (``hidden``, ``weight`` and ``[N]`` vectors are).

    Under autocast the products run in its dtype, as the LM head's linear layer would. The gradient of
    ``hidden`` is this rank's vocabulary slice's part only: sum it over ``group`` (Megatron's
    ``copy_to_tensor_model_parallel_region`` around the input does).

    Args:
        hidden: ``[N, H]`` final hidden states at the positions that predict ``targets``, the same on every rank.
        weight: ``[V_local, H]`` this rank's rows of the LM head (or of the tied embedding).
    """
    _check(hidden, targets, chunk_size, "hidden [N, H]")
    if vocab_size is None:
        vocab_size = vocab_start + weight.shape[0]
    return _VocabParallelHeadLogprob.apply(hidden, weight, targets, vocab_start, vocab_size, group, chunk_size)
