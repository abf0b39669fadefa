"""Thinking budgets, once, over any :class:`~nemo_jq.rollouts.sampling.Sampler`.

Phase 1 samples the rationale: up to ``max_thinking_tokens`` tokens, stopping at ``</think>``.
A row that reaches the budget without it gets ``</think>`` forced (s1-style budget forcing).
Phase 2, only when asked, samples the answer after ``prompt + rationale + </think>``, up to
``max_answer_tokens``, stopping at end-of-turn. Every engine (HF, native, vLLM) gets exactly
these semantics because none of them implements them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

import torch

from nemo_jq.models.interfaces import Rollout
from nemo_jq.models.routes import ROUTE_YOURSELF
from nemo_jq.registry import PluginFailed, blamed_on_plugin
from nemo_jq.rollouts.sampling import Sample, Sampler, as_groups
from nemo_jq.runtime.preemption import Stopped


class BudgetedRollouts:
    """A :class:`~nemo_jq.models.interfaces.RolloutEngine` from a sampler and the budgets."""

    #: The sampler decodes the model it was given: the policy's own where it decodes in place (an engine with weights
    #: of its own is wrapped in a RefittedRolloutEngine, which is not on-policy).
    on_policy = True

    def __init__(self, sampler: Sampler, *, think_end_id: int, end_of_turn_id: int, max_thinking_tokens: int,
                 max_answer_tokens: int):
        if max_thinking_tokens < 0 or max_answer_tokens < 1:
            raise ValueError(
                f"need max_thinking_tokens >= 0 and max_answer_tokens >= 1; got {max_thinking_tokens}, {max_answer_tokens}"
            )
        self.sampler = sampler
        self.think_end_id, self.end_of_turn_id = think_end_id, end_of_turn_id
        self.max_thinking_tokens, self.max_answer_tokens = max_thinking_tokens, max_answer_tokens
        #: Tokens the rollouts hold beyond their prompts (a forced ``</think>`` included), for throughput logging.
        self.tokens_generated = 0

    @property
    def tensor_parallel(self) -> int:
        """How many ranks run this engine together (its sampler's ``tensor_parallel``)."""
        return self.sampler.tensor_parallel

    @property
    def lockstep(self) -> bool:
        """Whether every rank of the world must sample, in step (its sampler's ``lockstep``; vLLM's external launcher)."""
        return getattr(self.sampler, "lockstep", False)

    def awake(self):
        """A context holding the sampler's memory between calls (vLLM's sleep mode), or none."""
        return self.sampler.awake() if hasattr(self.sampler, "awake") else contextlib.nullcontext()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.sampler.load_weights(tensors)

    def generate(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool,
                 generator: torch.Generator, greedy: bool = False, routes: bool = True) -> list[list[Rollout]]:
        # a plugin's sampler that fails, or returns other than Samples, is one line naming it (a traceback)
        with self.awake(), blamed_on_plugin(self.sampler, f"rollout engine {type(self.sampler).__name__}'s sample",
                                            passes=(Stopped,)):
            return self._generate(prompts, num_samples, sample_answers=sample_answers, generator=generator, greedy=greedy,
                                  routes=routes)

    def _checked(self, groups: Any, prompts: int, num_samples: int) -> list[list[Sample]]:
        """What the sampler returned, if it is a group of ``num_samples`` Samples per prompt (a plugin's sampler that
        returned other was an AttributeError deep in here)."""
        if not (isinstance(groups, (list, tuple)) and len(groups) == prompts and all(
                isinstance(group, (list, tuple)) and len(group) == num_samples and all(isinstance(s, Sample) for s in group)
                for group in groups)):
            raise PluginFailed(f"rollout engine {type(self.sampler).__name__}'s sample returned {str(groups)[:80]} for "
                               f"{prompts} prompts of {num_samples} samples: return a list per prompt of {num_samples} "
                               "Sample(token_ids, stopped, logprobs) (nemo_jq.rollouts.Sample)")
        return groups

    def _generate(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool,
                  generator: torch.Generator, greedy: bool, routes: bool) -> list[list[Rollout]]:
        # only a sampler that records routes takes the word not to (a plugin's, or the dry run's, may not)
        options = {} if routes or not getattr(self.sampler, "record_routes", False) else {"routes": False}
        if self.max_thinking_tokens == 0:  # no thinking: </think> forced at once
            thoughts = as_groups([Sample([], False, []) for _ in range(len(prompts) * num_samples)], num_samples)
        else:
            thoughts = self._checked(self.sampler.sample(prompts, num_samples, stop_ids=[self.think_end_id],
                                                         max_new_tokens=self.max_thinking_tokens, generator=generator,
                                                         greedy=greedy, **options), len(prompts), num_samples)
        rollouts = []
        for prompt, group in zip(prompts, thoughts):
            for thought in group:
                ends = thought.stopped and thought.token_ids[-1] == self.think_end_id
                rationale = thought.token_ids[:-1] if ends else thought.token_ids
                rollouts.append(Rollout(
                    prompt_ids=list(prompt),
                    rationale_ids=rationale,
                    think_end_forced=not ends,
                    rationale_logprobs=thought.logprobs,
                    # the prompt and rationale as the engine ran them (it never fed the </think> back)
                    routes=None if thought.routes is None else thought.routes[:len(prompt) + len(rationale)],
                ))
        if sample_answers:
            contexts = [r.prompt_ids + r.rationale_ids + [self.think_end_id] for r in rollouts]
            answers = self._checked(self.sampler.sample(contexts, 1, stop_ids=[self.end_of_turn_id],
                                                        max_new_tokens=self.max_answer_tokens, generator=generator,
                                                        greedy=greedy, **options), len(contexts), 1)
            for rollout, [answer] in zip(rollouts, answers):
                rollout.answer_ids, rollout.answer_logprobs = answer.token_ids, answer.logprobs
                if answer.routes is not None:  # the rationale as its pass ran it, the rest as the answer's did, and
                    # a forced </think>'s last rationale token, which its pass never fed back, as the answer's ran it
                    kept = rollout.routes if rollout.routes is not None else answer.routes[:0]
                    kept = torch.where(kept == ROUTE_YOURSELF, answer.routes[:len(kept)], kept)
                    rollout.routes = torch.cat([kept, answer.routes[len(kept):]])
        self.tokens_generated += sum(len(r.rationale_ids) + 1 + len(r.answer_ids or ()) for r in rollouts)
        return as_groups(rollouts, num_samples)
