"""Making the training experience, in one place: rollouts, rewards and the token batch of one step.

What the estimator declares it needs decides what is made: given targets (SFT) are spliced from the
examples; otherwise M rationales per prompt are sampled under the thinking budget, and then either the
reference answer y* is spliced after each (GARL, PAFT: teacher-forced, no answer sampled) or an answer
is sampled and scored by the task's reward (GRPO, RLOO). Rows are prompt-major (row ``b * M + m``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nemo_jq.data import Example
from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.objectives import Need, ObjectiveSpec
from nemo_jq.sequences import given_target_batch, reference_answer_batch, sampled_answer_batch

if TYPE_CHECKING:
    from nemo_jq.components import Components


@dataclass
class MicroBatch:
    """Whole prompt groups of an :class:`Experience`: one forward/backward."""

    batch: TokenBatch
    rewards: torch.Tensor | None
    num_prompts: int


@dataclass
class Experience:
    """This replica's share of one optimizer batch, ready for the loss."""

    batch: TokenBatch
    #: Rows per prompt: M rollouts, or 1 given target.
    group: int
    #: ``[B, M]`` rewards of the sampled answers (None when none were sampled).
    rewards: torch.Tensor | None
    #: Tokens the rollouts sampled, and the seconds that took (prompt formatting and splicing included).
    rollout_tokens: int
    rollout_seconds: float

    @property
    def num_prompts(self) -> int:
        return self.batch.num_rows // self.group

    def micro_batches(self, prompts_per_micro_batch: int) -> list[MicroBatch]:
        """Consecutive runs of whole prompt groups, each trimmed to its longest sequence."""
        bounds = [(s, min(s + prompts_per_micro_batch, self.num_prompts))
                  for s in range(0, self.num_prompts, prompts_per_micro_batch)]
        return [MicroBatch(self.batch.rows(s * self.group, e * self.group),
                           self.rewards[s:e] if self.rewards is not None else None, e - s) for s, e in bounds]


def make_experience(components: Components, examples: list[Example], estimator: ObjectiveSpec,
                    generator: torch.Generator) -> Experience:
    """The experience ``estimator`` needs for ``examples`` (this replica's prompts), sampled with ``generator``."""
    started = time.perf_counter()
    chat, engine = components.chat, components.engine
    prompts = components.prompt_ids(examples)
    tokens_before = engine.tokens_generated
    group, rewards = 1, None
    if Need.GIVEN_TARGET in estimator.needs:
        batch = given_target_batch(prompts, [chat.rationale_ids(e.rationale or "") for e in examples],
                                   [chat.answer_ids(e.answer) for e in examples], chat.think_end_id, chat.pad_id)
    else:
        group = components.config.rollout.num_samples
        sample_answers = Need.SAMPLED_ANSWER_REWARD in estimator.needs
        rollouts = engine.generate(prompts, group, sample_answers=sample_answers, generator=generator)
        if sample_answers:
            batch = sampled_answer_batch(rollouts, chat.think_end_id, chat.pad_id)
            rewards = torch.tensor([[components.task.reward(chat.decode_answer(r.answer_ids), e) for r in group_rollouts]
                                    for group_rollouts, e in zip(rollouts, examples)], device=components.device)
        else:
            batch = reference_answer_batch(rollouts, [chat.answer_ids(e.answer) for e in examples], chat.think_end_id,
                                           chat.pad_id)
    return Experience(batch, group, rewards, engine.tokens_generated - tokens_before, time.perf_counter() - started)


def logprob_gap(policy_logprobs: torch.Tensor, batch: TokenBatch) -> dict[str, float]:
    """Mean and largest |engine − policy| log-prob over the sampled tokens the engine scored
    (how off-policy the rollouts are; the loss always uses the policy's own log-probs)."""
    if batch.engine_logprobs is None:
        return {}
    engine = batch.engine_logprobs.to(policy_logprobs.device)
    gaps = (policy_logprobs - engine)[~engine.isnan()].abs()
    return {"logprob_gap": float(gaps.mean()), "max_logprob_gap": float(gaps.max())} if gaps.numel() else {}


def warn_if_off_policy(record: dict, max_gap: float, step: int) -> None:
    """Say so (once, on the writer) when the engine's log-probs stray more than ``max_gap`` from the policy's."""
    from nemo_jq import distributed

    gap = record.get("max_logprob_gap", 0.0)
    if gap > max_gap and distributed.is_writer():
        print(f"warning: step {step}: the rollout engine's log-probs differ from the policy's by up to {gap:.3g} "
              f"(mean {record['logprob_gap']:.3g}; rollout.max_logprob_gap={max_gap}): the samples are off-policy; "
              "check the engine's precision and its refit", flush=True)
