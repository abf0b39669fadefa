"""One optimizer batch's gradient: micro-batches of whole prompt groups, or row chunks of any size.

Every estimator sees the policy only through the token log-probs of its rows, and its gradient is linear in
them once the group's detached statistics are known (w_m and w̄, the leave-one-out baselines, PAFT's
resampled indices, GRPO's advantages, the importance ratios). So with ``train.micro_batch_rows`` the
gradient is taken in two passes and training memory no longer grows with M: a no-grad pass scores every row,
a chunk of rows at a time; the estimator runs on those log-probs of whole groups, as detached leaves, and
gives each token's coefficient ``∂L/∂log p``; a second pass backpropagates ``Σ coefficient · log p`` chunk by
chunk. By the chain rule that is the whole-group gradient, for every estimator and correction (the two-pass
trick of GradCache, Gao et al. 2021, applied to log-probs); it costs one more forward pass.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nemo_jq.models.interfaces import Policy, TokenBatch
from nemo_jq.recipe.experience import Experience, MicroBatch

#: ``estimate(token_logprobs, micro_batch) -> (loss to backpropagate, metrics)``: the estimator on one micro-batch.
Estimate = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def learn(policy: Policy, experience: Experience, estimate: Estimate, *, prompts_per_micro_batch: int,
          rows_per_chunk: int | None = None) -> list[tuple[int, dict[str, Any]]]:
    """Accumulate the gradient of ``estimate`` over ``experience`` (the estimator called once per micro-batch of
    ``prompts_per_micro_batch`` whole groups either way); returns each call's prompt count and metrics.
    ``rows_per_chunk``: forward/backward over that many rows at a time (two passes); None: a micro-batch at once."""
    micro_batches = experience.micro_batches(prompts_per_micro_batch)
    if rows_per_chunk is None or rows_per_chunk >= max(micro.batch.num_rows for micro in micro_batches):
        return _in_micro_batches(policy, micro_batches, estimate)
    return _in_row_chunks(policy, experience, micro_batches, estimate, rows_per_chunk)


def _in_micro_batches(policy: Policy, micro_batches: list[MicroBatch], estimate: Estimate) -> list[tuple[int, dict]]:
    collected: list[tuple[int, dict]] = []

    def loss_fn(logprobs: torch.Tensor, index: int) -> torch.Tensor:
        loss, metrics = estimate(logprobs, micro_batches[index])
        collected.append((micro_batches[index].num_prompts, metrics))
        return loss

    policy.forward_backward([micro.batch for micro in micro_batches], loss_fn)
    return policy.from_loss_stage(collected)


def _in_row_chunks(policy: Policy, experience: Experience, micro_batches: list[MicroBatch], estimate: Estimate,
                   rows_per_chunk: int) -> list[tuple[int, dict]]:
    """The two passes. Every rank scores and estimates (under pipeline parallelism ``token_logprobs`` is the
    same on every stage), so the coefficients and metrics need no collective."""
    rows = experience.batch.num_rows
    chunks = [(start, min(start + rows_per_chunk, rows)) for start in range(0, rows, rows_per_chunk)]
    batches = [experience.batch.rows(start, end) for start, end in chunks]
    scored: torch.Tensor | None = None
    with torch.no_grad():
        for (start, end), batch in zip(chunks, batches):
            logprobs = policy.token_logprobs(batch)
            if scored is None:
                scored = logprobs.new_zeros(experience.batch.target_mask.shape)
            scored[start:end, :_width(batch)] = logprobs
    coefficients = torch.zeros_like(scored)
    collected: list[tuple[int, dict]] = []
    first = 0
    for micro in micro_batches:
        last, width = first + micro.batch.num_rows, _width(micro.batch)
        leaf = scored[first:last, :width].clone().requires_grad_()
        loss, metrics = estimate(leaf, micro)
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        if grad is not None:
            coefficients[first:last, :width] = grad
        collected.append((micro.num_prompts, metrics))
        first = last

    def loss_fn(logprobs: torch.Tensor, index: int) -> torch.Tensor:
        start, end = chunks[index]
        return (logprobs * coefficients[start:end, :logprobs.shape[1]]).sum()

    policy.forward_backward(batches, loss_fn)
    return collected


def _width(batch: TokenBatch) -> int:
    """Target positions of ``batch``'s rows (one fewer than its tokens)."""
    return batch.target_mask.shape[1]
