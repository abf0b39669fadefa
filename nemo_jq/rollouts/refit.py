"""A rollout engine over its own copy of the policy's weights, refitted whenever they change."""

from __future__ import annotations

from typing import Sequence

import torch

from nemo_jq.models.interfaces import RefittablePolicy, Rollout, require
from nemo_jq.rollouts.budget import BudgetedRollouts


class RefittedRolloutEngine:
    """Samples from ``engine`` (its own weights: vLLM's, or an HF copy beside a Megatron policy), reloading them
    from ``policy.iter_hf()`` whenever ``policy.weights_version`` has moved (an optimizer step, a weight load).

    The ranks of one model replica (``policy.model_parallel_group``; None in one process) must train on the
    same rollouts: the group's first ``engine.tensor_parallel`` ranks (consecutive: the first stage's first
    tensor-parallel ranks) refit and sample together, in step, and the first of them sends the rollouts to
    the others. An engine in ``lockstep`` (vLLM under torchrun: its engines are data-parallel ranks that step
    together) has every rank sample, each replica's ranks with the same prompts and seeds.
    """

    def __init__(self, engine: BudgetedRollouts, policy: RefittablePolicy):
        self.engine, self.policy, self._version = engine, require(policy, RefittablePolicy, "the policy a rollout "
                                                                   "engine with its own weights refits from"), None

    @property
    def tokens_generated(self) -> int:
        return self.engine.tokens_generated

    @property
    def lockstep(self) -> bool:
        return self.engine.lockstep

    def generate(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool,
                 generator: torch.Generator, greedy: bool = False) -> list[list[Rollout]]:
        import torch.distributed as dist

        group = self.policy.model_parallel_group
        sampling = self.engine.tensor_parallel if not self.lockstep or group is None else dist.get_world_size(group)
        samplers = [dist.get_global_rank(group, index) for index in range(sampling)] if group is not None else []
        samples = group is None or dist.get_rank() in samplers
        with self.engine.awake():  # one wake and one sleep for the refit and both phases
            if self._version != self.policy.weights_version:
                tensors = self.policy.iter_hf()  # a collective over the replica's ranks: all of them consume it
                if samples:
                    self.engine.load_weights(tensors)
                for _ in tensors:
                    pass
                self._version = self.policy.weights_version
            rollouts = [self.engine.generate(prompts, num_samples, sample_answers=sample_answers, generator=generator,
                                             greedy=greedy) if samples else None]
        if group is not None and dist.get_world_size(group) > 1:  # the replica trains on its first rank's rollouts
            dist.broadcast_object_list(rollouts, src=samplers[0], group=group)
        return rollouts[0]
