"""Log-probabilities of chosen tokens without materialising the full-vocabulary log-softmax.

``chunked_token_logprobs(hidden, weight, targets)`` equals
``log_softmax(hidden @ weight.T).gather(targets)`` but projects ``chunk_size`` positions at a
time, reduces each chunk in fp32, and recomputes the chunk's logits in backward instead of
saving them. Peak memory is one chunk of logits (``chunk_size x V``) rather than ``T x V``;
at Qwen3's V = 151936 and T = 4096 the naive fp32 log-softmax alone is 2.5 GB.
"""

from __future__ import annotations

import torch

from nemo_jq.precision import autocast_dtype_now, compute_dtype, upcast


def _exponentiate_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, ``logits <- exp(logits - max)``; returns ``(max, sum)`` so that
    ``logsumexp = max + log(sum)`` and ``softmax = logits / sum``. One buffer per chunk, where
    ``torch.logsumexp`` or ``torch.softmax`` would allocate a second."""
    top = logits.max(1, keepdim=True).values
    total = logits.sub_(top).exp_().sum(1, keepdim=True)
    return top, total


class _ChunkedTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
        out = torch.empty(hidden.shape[0], dtype=compute_dtype(hidden), device=hidden.device)
        projection = weight.to(hidden.dtype)  # under bf16 autocast: bf16 hidden states, fp32 master weight
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = upcast(hidden[start:end] @ projection.T)
            chosen = logits.gather(1, targets[start:end, None])
            top, total = _exponentiate_(logits)
            out[start:end] = (chosen - top - total.log()).squeeze(1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size = chunk_size
        # backward runs outside autocast: its products take the forward's dtype explicitly (Qwen3's final norm gives
        # fp32 hidden states under bf16 autocast, and fp32 products would miss the GPU's bf16 matrix rate)
        ctx.matmul_dtype = autocast_dtype_now(hidden.device.type)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=compute_dtype(weight), device=weight.device) if ctx.needs_input_grad[1] else None
        low = ctx.matmul_dtype  # None: no autocast, the products in the inputs' own dtype
        projection = weight.to(low or hidden.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h, g = hidden[start:end], upcast(grad_out[start:end, None])
            h_low = h if low is None else h.to(low)
            # d logp_t / d logits = onehot(target) - softmax(logits), formed in place: one chunk-sized buffer
            logits = upcast(h_low @ projection.T)
            _, total = _exponentiate_(logits)
            grad_logits = logits.div_(total).mul_(-g)
            grad_logits.scatter_add_(1, targets[start:end, None], g)
            grad_low = grad_logits if low is None else grad_logits.to(low)
            if grad_weight is not None and low is None:  # accumulate without a [V, H] temporary
                grad_weight.addmm_(grad_logits.T, upcast(h))
            elif grad_weight is not None:  # the product in the forward's dtype, accumulated in fp32
                grad_weight += grad_low.T @ h_low
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_low.to(projection.dtype) @ projection
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 256
) -> torch.Tensor:
    """``[N]`` log-probs (fp32, or fp64 for fp64 inputs) of ``targets`` (``[N]``) under ``softmax(hidden @ weight.T)``.

    Args:
        hidden: ``[N, H]`` final hidden states at the positions that predict ``targets``.
        weight: ``[V, H]`` output projection (the LM head; tied embeddings are fine).
        chunk_size: positions projected at once; trades speed for peak memory.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N]; got {list(hidden.shape)} and {list(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    return _ChunkedTokenLogprob.apply(hidden, weight, targets, chunk_size)
