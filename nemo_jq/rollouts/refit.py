"""A rollout engine over its own copy of the policy's weights, refitted whenever they change."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch

from nemo_jq.models.interfaces import RefittablePolicy, Rollout, require
from nemo_jq.rollouts.budget import BudgetedRollouts
from nemo_jq.rollouts.sampling import Sample, seed_from
from nemo_jq.typed import ConfigError


class RefittedRolloutEngine:
    """Samples from ``engine`` (its own weights: vLLM's, or an HF copy beside a Megatron policy), reloading them
    from ``policy.iter_hf()`` whenever ``policy.weights_version`` has moved (an optimizer step, a weight load).

    The ranks of one model replica (``policy.model_parallel_group``; None in one process) must train on the
    same rollouts: the group's first ``engine.tensor_parallel`` ranks (consecutive: the first stage's first
    tensor-parallel ranks) refit and sample together, in step, and the first of them sends the rollouts to
    the others. An engine in ``lockstep`` (vLLM under torchrun: its engines are data-parallel ranks that step
    together) is on every rank; where a replica holds several (``rollout.tensor_parallel`` below the replica's
    ranks), each samples a distinct share of every call and every rank gets them all (:class:`ReplicaShares`).
    """

    on_policy = False

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
                 generator: torch.Generator, greedy: bool = False, routes: bool = True) -> list[list[Rollout]]:
        """The replica's rollouts on each of its ranks: its sampling ranks' (:meth:`_sampling_ranks`) own. A rank that
        samples none waits for them in one collective per chunk of the sampler's work (:func:`share_in_chunks`), never in one
        for the whole call, which at 8B outlasts the collective timeout (``train.collective_timeout_minutes``)."""
        import torch.distributed as dist

        samplers, group = self._sampling_ranks(), self.policy.model_parallel_group
        shared = group is not None and dist.get_world_size(group) > 1  # the replica trains on its first rank's rollouts
        rollouts = None
        with self.engine.awake():  # one wake and one sleep for the refit and both phases
            self._refit(samplers)
            if self.lockstep and shared and dist.get_world_size(group) > self.engine.tensor_parallel:
                with replica_shares(self.engine, group):  # every rank samples its engine's share, and gets them all
                    return self.engine.generate(prompts, num_samples, sample_answers=sample_answers,
                                                generator=generator, greedy=greedy, routes=routes)
            if samplers is None or dist.get_rank() in samplers:
                waited_for = shared and dist.get_world_size(group) > len(samplers)
                with reporting_chunks(self.engine, lambda: share_object(None, samplers[0], group)) if waited_for else \
                        nullcontext():
                    rollouts = self.engine.generate(prompts, num_samples, sample_answers=sample_answers,
                                                    generator=generator, greedy=greedy, routes=routes)
        return share_in_chunks(rollouts, samplers[0], group) if shared else rollouts

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


class ChunkReporting:
    """``sampler``, sampling each request in the chunks its own ``sample`` samples one after another (its
    ``prompts_per_chunk``: as many whole prompt groups as ``rollout.kv_cache_tokens`` holds; a sampler without one,
    as vLLM's, takes the request as one chunk) and calling ``report`` after each. The samples are the sampler's own:
    handed one of its chunks, it samples it as it would have inside the whole request, from the generator as it
    stands, and the chunks come in the same order."""

    def __init__(self, sampler: Any, report: Callable[[], None]):
        self.sampler, self.report = sampler, report

    def __getattr__(self, name: str) -> Any:  # the rest of the sampler (tensor_parallel, awake, load_weights...)
        return getattr(self.sampler, name)

    def sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
               generator: torch.Generator, greedy: bool = False, **options: Any) -> list[list[Sample]]:
        chunk = len(prompts)
        if prompts and hasattr(self.sampler, "prompts_per_chunk"):
            chunk = self.sampler.prompts_per_chunk(prompts, num_samples, max_new_tokens)
        groups = []
        for piece in [prompts[start:start + chunk] for start in range(0, len(prompts), chunk)] or [prompts]:
            groups += self.sampler.sample(piece, num_samples, stop_ids=stop_ids, max_new_tokens=max_new_tokens,
                                          generator=generator, greedy=greedy, **options)
            self.report()
        return groups


@contextmanager
def wrapped_sampler(engine: BudgetedRollouts, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """While it lasts, ``engine`` samples through ``wrap(its sampler)``; an engine without a sampler (a plugin's own)
    is left as it is."""
    sampler = getattr(engine, "sampler", None)
    if sampler is None:
        yield
        return
    engine.sampler = wrap(sampler)
    try:
        yield
    finally:
        engine.sampler = sampler


def reporting_chunks(engine: BudgetedRollouts, report: Callable[[], None]):
    """While it lasts, ``engine``'s sampler calls ``report`` after each chunk of its work (:class:`ChunkReporting`);
    an engine without a sampler (a plugin's own) reports nothing, and its whole call is one chunk."""
    return wrapped_sampler(engine, lambda sampler: ChunkReporting(sampler, report))


class ReplicaShares:
    """A lockstep ``sampler`` (vLLM under torchrun) on the ranks of one model replica (``group``) that hold several of
    its engines (``sampler.tensor_parallel`` consecutive ranks each): every call's prompts are cut into one contiguous
    share per engine (the first ones a prompt longer where they do not divide), each engine samples its own, and every
    rank gets them all (:func:`gather_shares`). Each prompt's seed is drawn from ``generator`` as one engine sampling
    the whole call draws it (:meth:`sample`, then ``sample_seeded``), so the samples are that engine's, and the replica
    decodes each prompt once where every engine decoding the whole call decoded it once per engine (issue 43's N5)."""

    def __init__(self, sampler: Any, group: Any):
        import torch.distributed as dist

        if not hasattr(sampler, "sample_seeded"):
            raise ConfigError(f"{type(sampler).__name__} samples in lockstep on every rank but has no sample_seeded("
                              "prompts, seeds, ...): the engines of one replica cannot split its prompts, and each would "
                              "decode all of them (docs/extending.md)")
        tp = sampler.tensor_parallel
        engines = sorted({rank // tp for rank in dist.get_process_group_ranks(group)})
        self.sampler, self.group = sampler, group
        self.share, self.engines = engines.index(dist.get_rank() // tp), len(engines)
        self.lead = dist.get_rank() % tp == 0  # the engine's first rank sends its share; its other ranks hold the same

    def __getattr__(self, name: str) -> Any:  # the rest of the sampler (tensor_parallel, awake, load_weights...)
        return getattr(self.sampler, name)

    def sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
               generator: torch.Generator, greedy: bool = False, **options: Any) -> list[list[Sample]]:
        seeds = [seed_from(generator) for _ in prompts]
        sizes = share_sizes(len(prompts), self.engines)
        start = sum(sizes[:self.share])
        end = start + sizes[self.share]
        own = self.sampler.sample_seeded(prompts[start:end], seeds[start:end], num_samples, stop_ids=stop_ids,
                                         max_new_tokens=max_new_tokens, greedy=greedy, **options)
        return [group for share in gather_shares(own, self.share, sizes, self.group, sends=self.lead) for group in share]


def share_sizes(prompts: int, engines: int) -> list[int]:
    """How many of ``prompts`` each of ``engines`` samples: as even as they go, the first ones the longer."""
    return [prompts // engines + (index < prompts % engines) for index in range(engines)]


def gather_shares(own: list[list[Sample]], share: int, sizes: list[int], group: Any, *,
                  sends: bool) -> list[list[list[Sample]]]:
    """Every engine's samples, by share, on every rank of ``group``, in one collective: ``own``, this rank's engine's
    (share ``share``), from the ranks that ``sends`` (each engine's first; its others hold the same). ``sizes``: each
    share's prompts."""
    import torch.distributed as dist

    slots: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(slots, (share, own if sends else None), group=group)
    shares: list[Any] = [None] * len(sizes)
    for index, samples in slots:
        if samples is not None:
            shares[index] = samples
    if any(found is None or len(found) != size for found, size in zip(shares, sizes)):
        raise RuntimeError(f"the replica's engines sent shares of {[None if f is None else len(f) for f in shares]} "
                           f"prompts where {sizes} were asked")
    return shares


def replica_shares(engine: BudgetedRollouts, group: Any):
    """While it lasts, ``engine``'s sampler samples this rank's engine's share of every call (:class:`ReplicaShares`)."""
    return wrapped_sampler(engine, lambda sampler: ReplicaShares(sampler, group))


def share_in_chunks(rollouts: Any, source: int, group: Any) -> Any:
    """``source``'s rollouts on every rank of ``group``. ``source`` sends an empty message after each chunk of its
    sampling (:func:`reporting_chunks`), then the rollouts; a rank that samples none takes every message, so that it
    waits at most one chunk in each; another sampling rank has taken the empty ones while it sampled."""
    import torch.distributed as dist

    message = share_object((rollouts,) if dist.get_rank() == source else None, source, group)
    while message is None:
        message = share_object(None, source, group)
    return message[0]


def share_object(message: Any, source: int, group: Any) -> Any:
    """``message`` from global rank ``source`` to every rank of ``group`` (the received one on the others)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]
