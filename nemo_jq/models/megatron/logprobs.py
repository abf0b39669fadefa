"""Token log-probs from vocab-parallel logits (as NeMo-RL's ``ChunkedDistributedLogprob``).

Under tensor parallelism each rank holds the logits of its slice of the vocabulary,
``[N, V/TP]``. The full-vocabulary log-softmax needs only two numbers per row from the other
ranks, the max and the sum of exponentials, so those are all-reduced in fp32 (the max first,
for a stable sum); the target's logit is contributed by the rank whose slice holds it and zero
elsewhere, riding along in the sum's all-reduce. Rows are processed ``chunk_size`` at a time, so
the fp32 temporaries are one chunk, never ``[N, V/TP]``. Backward saves no softmax: it recomputes
it per chunk from the saved logits and the forward's log-sum-exp (``[N]``), which also spares
backward's all-reduces. Columns past the true vocabulary (Megatron's padding rows) are -inf.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_jq.precision import compute_dtype, upcast


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _masked_logits(logits: torch.Tensor, num_valid: int) -> torch.Tensor:
    """A compute-dtype copy of a chunk, its padding columns (``num_valid:``) set to -inf."""
    chunk = logits.to(compute_dtype(logits), copy=True)
    chunk[:, num_valid:] = float("-inf")
    return chunk


class _VocabParallelTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                group: dist.ProcessGroup | None, chunk_size: int):
        local_vocab = logits.shape[1]
        num_valid = max(0, min(local_vocab, vocab_size - vocab_start))
        local_targets = targets - vocab_start
        owned = (local_targets >= 0) & (local_targets < num_valid)
        local_targets = torch.where(owned, local_targets, 0)
        out = torch.empty(logits.shape[0], dtype=compute_dtype(logits), device=logits.device)
        logsumexp = torch.empty_like(out)
        for start in range(0, logits.shape[0], chunk_size):
            end = start + chunk_size
            chunk = _masked_logits(logits[start:end], num_valid)
            top = _all_reduce(chunk.max(1).values, dist.ReduceOp.MAX, group)
            chosen = torch.where(owned[start:end], chunk.gather(1, local_targets[start:end, None]).squeeze(1), 0.0)
            total = chunk.sub_(top[:, None]).exp_().sum(1)
            total, chosen = _all_reduce(torch.stack([total, chosen]), dist.ReduceOp.SUM, group)
            logsumexp[start:end] = top + total.log()
            out[start:end] = chosen - logsumexp[start:end]
        ctx.save_for_backward(logits, local_targets, owned, logsumexp)
        ctx.num_valid, ctx.chunk_size = num_valid, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, local_targets, owned, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            g = upcast(grad_out[start:end, None])
            # d logp / d logits = onehot(target) - softmax, softmax formed in place from the saved log-sum-exp
            grad = _masked_logits(logits[start:end], ctx.num_valid).sub_(logsumexp[start:end, None]).exp_().mul_(-g)
            grad.scatter_add_(1, local_targets[start:end, None], g * owned[start:end, None])
            grad_logits[start:end] = grad
        return grad_logits, None, None, None, None, None


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                                  vocab_size: int | None = None, group: dist.ProcessGroup | None = None,
                                  chunk_size: int = 256) -> torch.Tensor:
    """``[N]`` log-probs (fp32, fp64 for fp64 logits) of ``targets`` under the softmax over the whole vocabulary.

    Every rank of ``group`` calls it with the same ``targets`` and gets the same result; the
    gradient reaches each rank's own logits only. With ``group=None`` (or one rank) it equals
    ``log_softmax(logits).gather(targets)``.

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary columns ``vocab_start : vocab_start + V_local``.
        targets: ``[N]`` global token ids, all below ``vocab_size``.
        vocab_size: the true vocabulary; columns at or past it are padding and get probability 0.
            Defaults to no padding.
        chunk_size: rows reduced at once; trades speed for peak memory.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [N, V_local] and targets [N]; got {list(logits.shape)} and {list(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[1]
    return _VocabParallelTokenLogprob.apply(logits, targets, vocab_start, vocab_size, group, chunk_size)
