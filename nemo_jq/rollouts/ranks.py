"""Rollouts on ranks of their own (``rollout.placement=separate``): the training ranks ask, the rollout ranks sample.

The world is split (:func:`nemo_jq.runtime.distributed.init_from_env`): the training ranks hold the policy and its optimizer
and no inference copy; each rollout rank holds an engine (its own HF model, no optimizer). Every training call of
``generate`` first brings the rollout ranks the weights, if they moved since the last call (:class:`WeightSync`: from
the first training rank, gathered from the first replica's shards once, in buckets); then each replica's first rank
sends its prompts and its generator's state to the rollout engine that serves it (replica d: engine d mod the
engines; an engine is ``rollout.tensor_parallel`` consecutive rollout ranks, one vLLM engine over them, which all
take the request and sample it in step), whose first rank sends back the rollouts (token ids, log-probs, whether
``</think>`` was forced, a Qwen3-MoE's routes) and the generator's state after them. So a replica draws the same samples, and its
generator moves the same way, as it would sampling itself from the same weights: ``separate`` trains as ``colocated``
does.

The first training rank leads: its commands (sync, generate, stop) reach every rollout rank in one order, and every
replica calls ``generate`` alike (``lockstep``: evaluation pads the shorter shares). One step off
(``rollout.async_steps=1``, the recipe's :class:`~nemo_jq.recipe.experience.RolloutsAheadOnRanks`) the request for
step t+1 leaves before step t trains and its rollouts are taken when step t+1 starts: the rollout ranks sample while
the training ranks train.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Sequence

import torch

from nemo_jq.models.common import new_generator
from nemo_jq.models.interfaces import RefittablePolicy, Rollout, require
from nemo_jq.rollouts.budget import BudgetedRollouts
from nemo_jq.rollouts.process import engine_device
from nemo_jq.rollouts.refit import reporting_chunks, share_in_chunks, share_object
from nemo_jq.rollouts.sync import SyncStats, WeightSync
from nemo_jq.runtime import distributed
from nemo_jq.runtime.distributed import Roles, receive_object, send_object

#: The first training rank: it sends the weights and the commands.
LEAD = 0


class RemoteRollouts:
    """A training rank's rollout engine when rollouts are sampled on ranks of their own (see the module)."""

    #: Every replica makes the same calls (the rollout ranks serve them in one order); the rollouts come from the
    #: rollout ranks' own copy of the weights, in other processes, which ``objective.importance=auto`` corrects.
    lockstep, on_policy = True, False

    def __init__(self, policy: RefittablePolicy, roles: Roles, bucket_bytes: int):
        import torch.distributed as dist

        self.policy = require(policy, RefittablePolicy, "the policy whose weights reach the rollout ranks")
        self.roles, self.tokens_generated, self._version = roles, 0, None
        group = policy.model_parallel_group
        self.replica_lead = dist.get_rank() if group is None else dist.get_global_rank(group, 0)
        replica = policy.data_parallel.rank
        leads = dict(distributed.every_rank((replica, self.replica_lead)))
        self.leads = [leads[index] for index in range(len(leads))]  # each replica's first rank, by replica
        #: The ranks of the engine that serves this replica (replica d: engine d mod the engines); the first answers.
        self.servers = roles.engine_members(replica % roles.engines)
        self.weight_sync = WeightSync(roles.sync, source=0, bucket_bytes=bucket_bytes, device=roles.device) \
            if roles.sync is not None else None
        #: The syncs since :meth:`take_sync_record` last asked (on the first training rank).
        self.syncs: list[SyncStats] = []

    def generate(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool,
                 generator: torch.Generator, greedy: bool = False, routes: bool = True) -> list[list[Rollout]]:
        self.request(prompts, num_samples, sample_answers=sample_answers, generator=generator, greedy=greedy,
                     routes=routes, waited_for=True)
        return self.result()[0]

    def request(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool,
                generator: torch.Generator, greedy: bool = False, routes: bool = True,
                waited_for: bool = False) -> None:
        """Send the weights if they moved, then this replica's request; the rollout rank samples it meanwhile, and
        :meth:`result` takes the rollouts (one request in flight at a time). ``waited_for``: the replica waits for
        them at once, so the rollout rank reports each chunk of its sampling (the replica's ranks then wait one chunk
        at a time in each collective, never a whole call, which at 8B outlasts ``train.collective_timeout_minutes``);
        a request sent ahead is not waited for, and a report would stall the sampling until it was taken."""
        import torch.distributed as dist

        self._sync()
        bridge, device = self.roles.bridge, self.roles.device
        if dist.get_rank() == LEAD:
            for engine in range(self.roles.engines):
                for server in self.roles.engine_members(engine):
                    send_object(bridge, ("generate", self.leads[engine::self.roles.engines]), server, device)
        if dist.get_rank() == self.replica_lead:
            for server in self.servers:
                send_object(bridge, (list(prompts), num_samples, sample_answers, greedy, routes,
                                     generator_state(generator), waited_for), server, device)
        self._generator = generator

    def result(self) -> tuple[list[list[Rollout]], int, float]:
        """The requested rollouts on every rank of the replica, the tokens they hold and the seconds the rollout rank
        took; the request's generator moves as sampling moved it."""
        import torch.distributed as dist

        group = self.policy.model_parallel_group
        shared = group is not None and dist.get_world_size(group) > 1  # the replica trains on its first rank's rollouts
        reply = None
        if dist.get_rank() == self.replica_lead:
            while (message := receive_object(self.roles.bridge, self.servers[0], self.roles.device)) is None:
                if shared:  # a chunk sampled: the replica's other ranks wait for the next
                    share_object(None, self.replica_lead, group)
            rollouts, tokens, state, seconds = message
            self._generator.set_state(state)
            self.tokens_generated += tokens
            reply = (rollouts, tokens, seconds)
        return share_in_chunks(reply, self.replica_lead, group) if shared else reply

    def _sync(self) -> None:
        """The weights to the rollout ranks if they moved: the first replica's ranks gather them (a collective over
        the replica; over every replica where the policy says its gather takes them all: a Qwen3-MoE's experts, from
        the expert-parallel ranks), its first rank sends them."""
        import torch.distributed as dist

        if self._version == self.policy.weights_version:
            return
        self._version = self.policy.weights_version
        if self.policy.data_parallel.rank != 0 and not self.policy.gathers_over_replicas:
            return
        tensors = iter(self.policy.iter_hf())
        if dist.get_rank() == LEAD:
            for server in range(self.roles.rollout):
                send_object(self.roles.bridge, ("sync",), self.roles.training + server, self.roles.device)
            self.syncs.append(self.weight_sync.send(tensors))
        for _ in tensors:  # the replica's other ranks take part in each tensor's gather
            pass

    def take_sync_record(self) -> dict[str, float]:
        """The weight syncs since the last call, for the step's record: bytes, buckets and seconds (summed)."""
        syncs, self.syncs = self.syncs, []
        if not syncs:
            return {}
        return {"sync_bytes": sum(s.bytes for s in syncs), "sync_buckets": sum(s.buckets for s in syncs),
                "sync_seconds": sum(s.seconds for s in syncs)}

    def close(self) -> None:
        """Let the rollout ranks go (their :meth:`RolloutServer.serve` returns)."""
        import torch.distributed as dist

        if dist.get_rank() == LEAD:
            for server in range(self.roles.rollout):
                send_object(self.roles.bridge, ("stop",), self.roles.training + server, self.roles.device)


class RolloutServer:
    """A rollout rank: its engine (or its part of one over several rollout ranks), serving the first training rank's
    commands until it says stop."""

    def __init__(self, engine: BudgetedRollouts, roles: Roles, bucket_bytes: int):
        self.engine, self.roles = engine, roles
        #: Whether this rank answers the replicas: its engine's first; the engine's other ranks sample in step, silent.
        self.answers = (roles.rank - roles.training) % roles.engine_ranks == 0
        self.weight_sync = WeightSync(roles.sync, source=0, bucket_bytes=bucket_bytes, device=roles.device)
        #: Requests served and weight syncs taken.
        self.served, self.synced = 0, 0

    def serve(self) -> dict[str, Any]:
        bridge, device = self.roles.bridge, self.roles.device
        while True:
            try:
                command, *arguments = receive_object(bridge, LEAD, device)
            except RuntimeError as err:  # the training ranks are gone: one failed, and says why (--debug: this one)
                raise distributed.OtherRankFailed("the training ranks ended before they stopped the rollout ranks "
                                                  "(their own messages say why)") from err
            if command == "stop":
                return {"served": self.served, "synced": self.synced}
            if command == "sync":
                tensors = self.weight_sync.receive()
                with self.engine.awake():
                    self.engine.load_weights(tensors)
                for _ in tensors:
                    pass
                self.synced += 1
                continue
            self._answer(arguments[0])

    def _answer(self, leads: list[int]) -> None:
        """Take every replica's request (``leads``: their first ranks), then sample each with its generator's state and
        send back the rollouts, the tokens sampled, the generator's state after them and the seconds: at once where
        the replica waits for them (an empty message after each chunk), else once all are sampled. A request sent
        ahead (one step off) is taken before any is answered: a replica whose request waited while another's answer
        waited for that replica's next step held up the step's collectives, every rank waiting on another."""
        bridge, device = self.roles.bridge, self.roles.device
        requests = [(lead, receive_object(bridge, lead, device)) for lead in leads]
        ahead = []
        for lead, (prompts, num_samples, sample_answers, greedy, routes, state, waited_for) in requests:
            generator = generator_from(state, engine_device(self.engine))
            started, before = time.perf_counter(), self.engine.tokens_generated
            with reporting_chunks(self.engine, lambda lead=lead: send_object(bridge, None, lead, device)) \
                    if waited_for and self.answers else nullcontext():
                rollouts = self.engine.generate(prompts, num_samples, sample_answers=sample_answers,
                                                generator=generator, greedy=greedy, routes=routes)
            answer = (rollouts, self.engine.tokens_generated - before, generator.get_state(), time.perf_counter() - started)
            if waited_for:
                self._send(lead, answer)
            else:
                ahead.append((lead, answer))
            self.served += 1
        for lead, answer in ahead:
            self._send(lead, answer)

    def _send(self, lead: int, answer: tuple) -> None:
        if self.answers:  # the engine's other ranks sampled in step, silent
            send_object(self.roles.bridge, answer, lead, self.roles.device)


def generator_state(generator: torch.Generator) -> tuple[str, torch.Tensor]:
    """What a request carries of its generator: the device type with the state, whose layout depends on the type
    (a CUDA generator's is 16 bytes, its seed and offset; the CPU's 5,056)."""
    return generator.device.type, generator.get_state()


def generator_from(state: tuple[str, torch.Tensor], device: torch.device) -> torch.Generator:
    """A generator in ``state`` (:func:`generator_state`): on ``device`` where that is of the state's type, else on
    that type's current device (an engine without a ``device``, as vLLM's, samples wherever it runs; a CUDA state
    does not depend on the index)."""
    kind, values = state
    generator = new_generator(device if device.type == kind else torch.device(kind))
    generator.set_state(values)
    return generator

