"""The dry run of ``rollout.placement=separate``: the training ranks' rollouts sent and weights synced to rollout ranks
that are not there (:class:`RolloutRanks`), and a rollout rank's own phases (:class:`SamplingRank`)."""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from nemo_jq.dryrun.memory import MemoryTracker
from nemo_jq.dryrun.standins import full_budget_samples
from nemo_jq.dryrun.world import GPU
from nemo_jq.rollouts import BudgetedRollouts
from nemo_jq.rollouts.process import engine_device
from nemo_jq.rollouts.ranks import generator_from, generator_state
from nemo_jq.rollouts.sync import ALIGNMENT, WeightSync


class RolloutRanks:
    """A training rank's engine in a split world, in :class:`~nemo_jq.rollouts.ranks.RemoteRollouts`' place, whose
    requests and rollouts are values a fake process group cannot carry: the rollouts arrive as a rollout rank's dry
    run samples them (every row to its full budget: token ids, nothing on this GPU), through the budget core.
    :meth:`sync` is the sending side of the weight sync: the real ``WeightSync.send`` over a group without peers."""

    lockstep, on_policy = True, False

    def __init__(self, policy: Any, budgets: BudgetedRollouts, weight_sync: WeightSync, sends: bool):
        self.policy, self.engine, self.weight_sync, self.sends = policy, budgets, weight_sync, sends

    @property
    def sampler(self) -> Any:
        return self.engine.sampler

    @property
    def tokens_generated(self) -> int:
        return self.engine.tokens_generated

    def generate(self, prompts, num_samples, *, generator: torch.Generator, **kwargs) -> list:
        """The rollouts, with the request's generator carried as the bridge carries it: its state out
        (``ranks.generator_state``), a generator of the rollout rank's engine made from it (``ranks.generator_from``),
        its state back. On the stand-in GPU the state is a GPU generator's kind, so a state that crosses to a
        generator of another device type fails here as on a GPU (issue 43's N1)."""
        served = generator_from(generator_state(generator), engine_device(self.engine))
        rollouts = self.engine.generate(prompts, num_samples, generator=served, **kwargs)
        generator.set_state(served.get_state())
        return rollouts

    def sync(self) -> torch.dtype | None:
        """As ``RemoteRollouts._sync``: the first replica's ranks gather each weight from its shards (the policy's
        ``iter_hf``), and the first training rank (``sends``) packs and sends them; the other replicas take no part.
        The dtype of what was sent, on the rank that sent it (else None)."""
        if self.policy.data_parallel.rank != 0:
            return None
        tensors, sent = iter(self.policy.iter_hf()), set()

        def noting_dtypes() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                sent.add(tensor.dtype)
                yield name, tensor

        if self.sends:
            self.weight_sync.send(noting_dtypes())
        for _ in tensors:
            pass
        return next(iter(sent), None)


class LabelledSync(WeightSync):
    """The weight sync on the stand-in GPU, over a group without peers (its broadcasts done at once), its buckets
    counted as ``sync_buckets``."""

    def __init__(self, tracker: MemoryTracker, bucket_bytes: int):
        super().__init__(NoPeers(), source=0, bucket_bytes=bucket_bytes, device=GPU)
        self.tracker = tracker

    def _new_bucket(self) -> torch.Tensor:
        with self.tracker.label("sync_buckets"):
            return super()._new_bucket()


class NoPeers:
    """A process group of one: its broadcasts are done when made."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        return self

    def wait(self) -> None:
        return None


def received(sent: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int,
             tracker: MemoryTracker) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``WeightSync.receive`` hands a rollout rank's engine for the tensors ``sent``, allocated as it allocates
    them on the GPU: each bucket's bytes (one alive at a time, counted as ``sync_buckets``), a whole tensor as a view
    of its bucket, a tensor spread over buckets put together in one of its own. The packing is ``WeightSync.send``'s;
    the real receive reads it from the bucket's table of contents, a value fake tensors do not carry."""
    bucket, filled = None, bucket_bytes
    for name, dtype, shape in sent:
        total, start, whole = math.prod(shape) * dtype.itemsize, 0, None
        while start < total:
            filled = -(-filled // ALIGNMENT) * ALIGNMENT
            if filled >= bucket_bytes:
                bucket = None
                with tracker.label("sync_buckets"):
                    bucket, filled = torch.empty(bucket_bytes, dtype=torch.uint8, device=GPU), 0
            size = min(total - start, bucket_bytes - filled)
            if size == total:
                yield name, bucket[filled:filled + size].view(dtype).view(shape)
            else:
                if whole is None:
                    with tracker.label("sync_buckets"):
                        whole = torch.empty(shape, dtype=dtype, device=GPU)
                whole.view(-1).view(torch.uint8)[start:start + size].copy_(bucket[filled:filled + size])
            start, filled = start + size, filled + size
        if whole is not None:
            yield name, whole


class SamplingRank:
    """A replica's sampling rank, as a rank that samples none sees it: the rollouts it sends, every row to its full
    budget (as that rank's own dry run samples them); the sampler's other attributes are this rank's (None: a training
    rank of a split world, which has no sampler of its own)."""

    def __init__(self, sampler: Any):
        self.sampler = sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False, routes=True):
        return full_budget_samples(prompts, num_samples, max_new_tokens)
