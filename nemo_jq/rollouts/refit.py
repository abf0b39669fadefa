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

    def refit(self) -> None:
        """Reload the engine's weights from the policy if they have moved since the last refit (a collective over
        the replica's ranks)."""
        with self.engine.awake():
            self._refit(self._sampling_ranks())

    def generate(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool,
                 generator: torch.Generator, greedy: bool = False) -> list[list[Rollout]]:
        import torch.distributed as dist

        samplers = self._sampling_ranks()
        with self.engine.awake():  # one wake and one sleep for the refit and both phases
            self._refit(samplers)
            rollouts = [self.engine.generate(prompts, num_samples, sample_answers=sample_answers, generator=generator,
                                             greedy=greedy) if samplers is None or dist.get_rank() in samplers else None]
        group = self.policy.model_parallel_group
        if group is not None and dist.get_world_size(group) > 1:  # the replica trains on its first rank's rollouts
            dist.broadcast_object_list(rollouts, src=samplers[0], group=group)
        return rollouts[0]

    def _sampling_ranks(self) -> list[int] | None:
        """The global ranks of this replica that run the engine (None: one process)."""
        import torch.distributed as dist

        group = self.policy.model_parallel_group
        if group is None:
            return None
        sampling = self.engine.tensor_parallel if not self.lockstep else dist.get_world_size(group)
        return [dist.get_global_rank(group, index) for index in range(sampling)]

    def _refit(self, samplers: list[int] | None) -> None:
        """Reload the engine's weights on the ``samplers`` (:meth:`_sampling_ranks`) if they have moved."""
        import torch.distributed as dist

        if self._version == self.policy.weights_version:
            return
        tensors = self.policy.iter_hf()  # a collective over the replica's ranks: all of them consume it
        if samplers is None or dist.get_rank() in samplers:
            self.engine.load_weights(tensors)
        for _ in tensors:
            pass
        self._version = self.policy.weights_version
