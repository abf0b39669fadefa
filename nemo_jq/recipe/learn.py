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

from nemo_jq.models.interfaces import Policy, TokenBatch, token_logprobs_each
from nemo_jq.objectives import EstimatorInputs, ObjectiveOutput, ObjectiveSpec
from nemo_jq.recipe.components import Components
from nemo_jq.recipe.experience import Experience, MicroBatch, mismatch_metrics
from nemo_jq.registry import blamed_on_plugin
from nemo_jq.runtime.monitor import merge_metrics

#: ``estimate(token_logprobs, micro_batch) -> (loss to backpropagate, metrics)``: the estimator on one micro-batch.
Estimate = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def estimator_gradient(parts: Components, estimator: ObjectiveSpec, options: Any, experience: Experience, *,
                       q: float | None, batch_prompts: int, generator: torch.Generator) -> list[tuple[int, dict[str, Any]]]:
    """The gradient of ``estimator`` on this replica's share of a step's ``experience`` (:func:`learn`: micro-batches of
    whole groups, or ``train.micro_batch_rows`` rows at a time); returns each micro-batch's prompt count and metrics.

    Each prompt's loss is divided by the global batch's prompt count, so the replicas' gradients sum to the
    full batch's mean; the estimator's normalisers (token count, reward pool) are the global batch's too.
    """
    data_parallel, device = parts.data_parallel, parts.device
    tokens_per_example = data_parallel.sum(float(experience.batch.target_mask.sum())) / batch_prompts
    batch_rewards = None if experience.rewards is None else torch.tensor(
        data_parallel.gather(experience.rewards.tolist()), device=device)
    correction = parts.correction if estimator.corrects_off_policy else None
    if correction is not None and experience.batch.engine_logprobs is None:
        raise ValueError(f"objective.importance={correction.mode} needs the log-probs of the sampled tokens, which "
                         f"rollout.engine={parts.config.rollout.engine} does not report: set objective.importance=none")

    def estimate(logprobs: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        batch = micro.batch.to(device)
        inputs = EstimatorInputs(logprobs, batch.rationale_mask, batch.answer_mask, experience.group, q=q,
                                 rewards=micro.rewards, tokens_per_example=tokens_per_example,
                                 batch_rewards=batch_rewards, generator=generator,
                                 behavior_token_logprob=batch.engine_logprobs if correction else None,
                                 correction=correction)
        with blamed_on_plugin(estimator, f"objective {estimator.name!r}"):
            out = estimator(inputs, options)
        check_output(estimator.name, out, inputs)
        metrics = {"loss": float(out.per_example.detach().mean()), **out.metrics,
                   **mismatch_metrics(logprobs.detach(), batch)}
        return out.per_example.sum() / batch_prompts, metrics

    train = parts.config.train
    return learn(parts.policy, experience, estimate, prompts_per_micro_batch=train.micro_batch_size,
                 rows_per_chunk=train.micro_batch_rows)


#: What a step's record holds besides an estimator's metrics (the trainer's, the optimizer's, the engine's
#: mismatch metrics, ``step.rollout_record``'s, a rollout rank's syncs): an estimator's metric of one of these names
#: would overwrite it or be overwritten, and a run's ``step`` or ``kind`` so written loses its history on resume
#: (tests/e2e/test_extending.py holds it to a trained step's record).
RECORD_KEYS = frozenset({"kind", "step", "epoch", "q", "loss", "train_reward", "step_time", "gpu_peak_gib", "grad_norm",
                         "lr", "logprob_gap", "max_logprob_gap", "kl_k3", "scored_tokens", "rollout_lag", "rollout_tokens",
                         "rollout_tokens_per_s", "sync_bytes", "sync_buckets", "sync_seconds"})


def check_output(name: str, out: Any, inputs: EstimatorInputs) -> None:
    """An estimator's output as the trainer takes it, else one line naming the estimator: a loss a prompt
    (``per_example`` of shape [B]: a [B, M] one trained with M times the gradient), and metrics that are numbers
    under names of their own."""
    if not isinstance(out, ObjectiveOutput):
        raise ValueError(f"objective {name!r} returned {type(out).__name__}: an estimator returns "
                         "ObjectiveOutput(loss, per_example, metrics)")
    if not isinstance(out.per_example, torch.Tensor) or not isinstance(out.metrics, dict):
        raise ValueError(f"objective {name!r} returned per_example as {type(out.per_example).__name__} and metrics as "
                         f"{type(out.metrics).__name__}: per_example is a tensor of one loss a prompt, metrics a dict "
                         "of numbers ({} for none)")
    if torch.is_grad_enabled() and inputs.token_logprob.requires_grad and not out.per_example.requires_grad:
        raise ValueError(f"objective {name!r} returned a per_example loss with no gradient: compute it from the inputs' "
                         "log-probs without .detach() (weights made of them may be detached)")
    shape = list(out.per_example.shape)
    if shape != [inputs.num_prompts]:
        raise ValueError(f"objective {name!r} returned per_example of shape {shape}: it must hold one loss a prompt, "
                         f"shape [{inputs.num_prompts}] (average a prompt's M samples: .mean(-1))")
    for key, value in out.metrics.items():
        if key in RECORD_KEYS:
            raise ValueError(f"objective {name!r} reports a metric {key!r}, a name a step's record holds itself: "
                             "rename it")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"objective {name!r} reports its metric {key!r} as {type(value).__name__}: report a "
                             "number (float(...))")


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
    metrics = policy.forward_backward([micro.batch for micro in micro_batches],
                                      lambda logprobs, index: estimate(logprobs, micro_batches[index]))
    return [(micro.num_prompts, micro_metrics) for micro, micro_metrics in zip(micro_batches, metrics)]


def _in_row_chunks(policy: Policy, experience: Experience, micro_batches: list[MicroBatch], estimate: Estimate,
                   rows_per_chunk: int) -> list[tuple[int, dict]]:
    """The two passes. Every rank scores and estimates (under pipeline parallelism ``token_logprobs`` is the
    same on every stage), so the coefficients and metrics need no collective. Each chunk is ``rows_per_chunk`` rows
    of like length (:func:`chunks_by_length`): a chunk's rows are padded to its longest."""
    chunks = chunks_by_length(experience.batch.attention_mask.sum(1), rows_per_chunk)
    batches = [experience.batch.rows(chunk) for chunk in chunks]
    scored: torch.Tensor | None = None
    for chunk, batch, logprobs in zip(chunks, batches, token_logprobs_each(policy, batches), strict=True):
        if scored is None:
            scored = logprobs.new_zeros(experience.batch.target_mask.shape)
        scored[chunk.to(scored.device), :_width(batch)] = logprobs
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

    def loss_fn(logprobs: torch.Tensor, index: int) -> tuple[torch.Tensor, dict]:
        rows = chunks[index].to(coefficients.device)
        return (logprobs * coefficients[rows, :logprobs.shape[1]]).sum(), {}  # the metrics came from the estimator

    # what the policy adds of its own (a Qwen3-MoE's load-balancing loss and routing disagreement), per chunk: their
    # mean over the rows, with each micro-batch's estimator metrics (it was dropped: those runs logged none)
    own = merge_metrics([(len(chunk), metrics) for chunk, metrics in zip(chunks, policy.forward_backward(batches, loss_fn))])
    return [(prompts, {**metrics, **own}) for prompts, metrics in collected]


def chunks_by_length(lengths: torch.Tensor, rows_per_chunk: int) -> list[torch.Tensor]:
    """The rows (their indices) in chunks of ``rows_per_chunk``, longest first: rows of like length share a chunk, so
    the padding to each chunk's longest row is the least any chunking of that size gives (in the rows' own order a
    chunk mixed a row that stopped early with one that ran to the budget), and the largest chunk comes first. Each
    row's coefficient is its own, so the sum over chunks is the same gradient in any order."""
    order = torch.sort(lengths.cpu(), descending=True, stable=True).indices
    return list(order.split(rows_per_chunk))


def _width(batch: TokenBatch) -> int:
    """Target positions of ``batch``'s rows (one fewer than its tokens)."""
    return batch.target_mask.shape[1]
