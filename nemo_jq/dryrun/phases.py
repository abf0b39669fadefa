"""The dry run's phases (:class:`DryRun`): the run's own code through build, rollouts, refit, train, optimizer step,
save, restore, evaluate and resume, each phase's peak, FLOPs and time bound into the report. Why one file of over 500
lines: the phases share one world and one report, and read top to bottom as the run does them."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_jq.backends import BackendRequest
from nemo_jq.cluster.plan import Workload, decode_engines, decode_shape
from nemo_jq.config import Config
from nemo_jq.data import Example, Splits
from nemo_jq.dryrun.bounds import GpuProfile, total_flops_counter
from nemo_jq.dryrun.memory import GiB
from nemo_jq.dryrun.split_world import LabelledSync, RolloutRanks, SamplingRank, received
from nemo_jq.dryrun.standins import (
    FolderOfShapes,
    ReservedShare,
    StandInTask,
    StandInTokenizer,
    full_budget_samples,
    like,
    model_config,
    parameter_count,
    patched_item,
    sampler_of,
    shapes_of,
)
from nemo_jq.dryrun.world import GPU, FakeWorld, WrongDevice, patched
from nemo_jq.models.common import checkpoint_state
from nemo_jq.models.hf import hf_tensors
from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.models.megatron.provider import read_qwen3_config
from nemo_jq.objectives import Need, get_objective
from nemo_jq.rollouts import SAMPLERS, BudgetedRollouts, refit
from nemo_jq.rollouts.hf import NativeSampler


class DryRun:
    """One dry run's phases, in a run's order, each under the tracker's phase of the same name."""

    def __init__(self, config: Config, world: FakeWorld, scratch: Path, prompt_tokens: int, flops: dict[str, float],
                 gpu: GpuProfile, place: Any = None, skip_repeats: bool = True):
        self.config, self.world, self.scratch, self.flops, self.gpu = config, world, scratch, flops, gpu
        self.skip_repeats = skip_repeats
        #: The simulated Megatron rank (:class:`.megatron.RankPlace`); None: the hf backend's one process.
        self.place = place
        self.tracker = world.tracker
        self.prompt_tokens = prompt_tokens
        #: Seconds this process spent simulating each phase.
        self.wall: dict[str, float] = {}
        #: The current phase's FLOP counter, and the FLOPs of the repeats each phase skipped (:meth:`_repeats_skipped`).
        self.counter: FlopCounterMode | None = None
        self.skipped_flops: dict[str, float] = {}
        self.model_dir = scratch / "model"
        self.model_dir.mkdir()
        self.hf_config = model_config(config, self.model_dir)
        self.stack = contextlib.ExitStack()
        #: A training rank of a split world (``rollout.placement=separate``): its rollouts come from the rollout ranks.
        self.separate = config.rollout.placement == "separate"
        #: The dtype of the weights this rank sent the rollout ranks (None: it sent none).
        self.sent_dtype: torch.dtype | None = None
        #: The prompts this rank's engine decoded in each phase's first sampling call (:meth:`_counted`), of the
        #: replicas' (``replicas``) shares of a call; and the current call's rows a prompt and budget.
        self.decoded_prompts: dict[str, int] = {}
        self.replicas = 1
        self.sampling_call: tuple[int, int] = (1, 1)

    def first_step(self) -> None:
        from nemo_jq.recipe.trainer import Trainer

        with self.stack:
            self._label_kernels()
            trainer = Trainer(self.config, run_dir=self.scratch / "run", components=self._components())
            watching = self._watch(trainer)
            self.replicas = trainer.data_parallel.size
            self.sampler_bytes = self._weight_bytes(sampler_of(trainer.components.engine))
            self.sampled_answers = Need.SAMPLED_ANSWER_REWARD in trainer.objective.estimator.needs
            examples = trainer.components.splits.train
            if self.samples:
                trainer.components.engine.generate(
                    trainer.components.prompt_ids(trainer.data_parallel.shard(examples)),
                    self.config.rollout.num_samples, sample_answers=self.sampled_answers, generator=trainer.random.rollout)
            trainer.train_step(examples[:self._trained_prompts(trainer.data_parallel.size)])
            trainer.state.step = 1
            if self.separate:
                with self._phase("sync"):
                    self.sent_dtype = trainer.components.engine.sync()
            elif hasattr(trainer.components.engine, "refit"):
                with self._phase("refit"):
                    trainer.components.engine.refit()
            with self._phase("save"):
                checkpoint = trainer.save()
            with self._phase("guard_restore"):
                trainer.policy.load(checkpoint, with_optimizer=True)
                self._optimizer_state_as_such(trainer.policy)
            with self._phase("evaluate"):
                trainer.evaluator.evaluate("validation")
            watching.close()
            del trainer, watching
            gc.collect()
            with self._phase("resume"):
                resumed = Trainer(self.config, run_dir=self.scratch / "run", components=self._components())
                resumed.restore(checkpoint)
                self._optimizer_state_as_such(resumed.policy)

    def _optimizer_state_as_such(self, policy) -> None:
        """The state a ``torch.optim`` optimizer's ``load_state_dict`` read back is counted as the optimizer's from
        then on, as the step's was (it allocates it anew, unlabelled: the evaluation that follows a guard's restore
        counted AdamW's moments as temporaries). ``DistributedAdamW`` reads into the buffers it holds already."""
        optimizer = getattr(policy, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer):
            self.tracker.relabel([value for state in optimizer.state.values() for value in state.values()
                                  if isinstance(value, torch.Tensor)], "optimizer")

    def _trained_prompts(self, replicas: int) -> int:
        """The prompts of the trained batch: one micro-batch (``train.micro_batch_size`` prompts) for each replica,
        or, under pipeline parallelism, enough for the first stage to hold as many micro-batches (or row chunks) in
        flight as the step's (``min(PP, the replica's micro-batches)`` under 1F1B), up to the replica's share."""
        train, samples = self.config.train, self.config.rollout.num_samples
        share = -(-train.batch_size // replicas)
        prompts = train.micro_batch_size
        if self.place is not None and self.place.pipeline_stages > 1:
            rows = train.micro_batch_rows or train.micro_batch_size * samples
            prompts = max(prompts, math.ceil(self.place.pipeline_stages * rows / samples))
        return replicas * min(share, prompts)

    def serve(self, replicas: int, sent_dtype: torch.dtype | None) -> None:
        """A rollout rank of a split world: its engine built as the run builds it (``rollout_rank_engine``), the whole
        HF model taken in (:func:`received`) in the dtype a training rank sent (its names and shapes are the model's:
        a pipeline stage's dry run sends its own stage's for every stage), then one replica's request of the step (the
        batch's share of one of ``replicas``) and an evaluation call, each row to its full budget."""
        from transformers import AutoModelForCausalLM

        from nemo_jq.data.chat import ChatFormat
        from nemo_jq.recipe.components import rollout_rank_engine
        from nemo_jq.rollouts import IN_PLACE

        config, rollout = self.config, self.config.rollout
        self.replicas = replicas
        with self.stack:
            self._label_kernels()
            chat = ChatFormat(StandInTokenizer(self.prompt_tokens, rollout.max_answer_tokens))
            host = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)  # on the fake host: no memory
            # as the training ranks send them: a Qwen3-MoE's experts one tensor each, as its checkpoint holds them
            whole = [(name, sent_dtype or torch.float32, tuple(tensor.shape))
                     for name, tensor in checkpoint_state(dict(hf_tensors(host))).items()]
            if rollout.engine not in IN_PLACE:  # vLLM loads its folder itself: this model only names what is sent
                self.tracker.forget(host.parameters())
            with self._phase("build"), self.tracker.label("weights"):
                engine = rollout_rank_engine(config, GPU, chat, self.model_dir, lambda: host)
            if hasattr(engine.sampler, "model"):
                self.world.name_modules(engine.sampler.model, "sampler")
            self.sampler_bytes = self._weight_bytes(engine.sampler)
            self.sampled_answers = Need.SAMPLED_ANSWER_REWARD in get_objective(config.objective.name).needs
            with patched(engine.sampler, "sample", self._full_budget(engine.sampler)):
                with self._phase("sync"), engine.awake():
                    engine.load_weights(received(whole, rollout.bucket_bytes(), self.tracker))
                prompt = chat.prompt_ids(StandInTask().messages(Example("dry", "", ""), config.data.format))
                generator = torch.Generator()
                with self._phase("rollout"):
                    engine.generate([prompt] * -(-config.train.batch_size // replicas), rollout.num_samples,
                                    sample_answers=self.sampled_answers, generator=generator)
                with self._phase("evaluate"):
                    engine.generate([prompt] * config.eval.batch_size, config.eval.num_samples, sample_answers=True,
                                    generator=generator, routes=False)

    def _weight_bytes(self, sampler: Any) -> int:
        """The bytes of the weights a sampling call reads: as the sampler reads them (the graph path: in the compute
        dtype), else its HF model's, or (vLLM, or none here) the bf16 model's."""
        model = getattr(sampler, "model", None)
        if hasattr(sampler, "weight_bytes"):
            return sampler.weight_bytes()
        return 2 * parameter_count(self.hf_config) if model is None else sum(p.numel() * p.element_size() for p in model.parameters())

    @property
    def samples(self) -> bool:
        """Whether this process samples: the hf backend's one, or the simulated Megatron rank (``.megatron.samples``); in
        a split world every training rank takes its rollouts from the stand-in (:class:`RolloutRanks`) alike."""
        from nemo_jq.dryrun.megatron import samples

        return self.place is None or self.separate or samples(self.config, self.place)

    def _decode_work(self) -> dict[str, int]:
        """The replica's engines (``decode_engines``; 0 with rollout ranks of their own), the prompts this rank's
        engine decodes (or waits for) in a step's rollouts and in each evaluation call, and the evaluation's calls:
        each replica's share of the batch (of the validation split, in calls of ``eval.batch_size``), over its engines,
        at least what was counted (:meth:`_counted`); with rollout ranks of their own, the busiest one's replicas'
        (the training ranks wait for it)."""
        config, replicas = self.config, self.replicas
        validation = -(-config.data.validation_size // replicas)
        shares = {"rollout": -(-config.train.batch_size // replicas), "evaluate": min(config.eval.batch_size, validation)}
        if self.separate:
            engines, served = 0, -(-replicas // (config.rollout.ranks // self._workload.engine_gpus))  # an engine's replicas
            decoded = {phase: served * prompts for phase, prompts in shares.items()}
        else:
            engines = decode_engines(self._workload, *self._model_parallel())
            decoded = {phase: max(self.decoded_prompts.get(phase, 0), -(-prompts // engines))
                       for phase, prompts in shares.items()}
        return {"decode_engines": engines, "replica_prompts": shares["rollout"], "rollout_prompts": decoded["rollout"],
                "evaluate_prompts": decoded["evaluate"], "evaluate_calls": -(-validation // config.eval.batch_size)}

    def _model_parallel(self) -> tuple[int, int]:
        """TP and PP of the simulated Megatron rank's layout; (1, 1) for the hf backend's one process."""
        layout = self.config.megatron
        return (1, 1) if self.place is None else (layout.tensor_parallel, layout.pipeline_parallel)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Phase ``name``; inside another phase (evaluation's rollouts, a resume's build), part of that one."""
        if self.tracker.current is not None:
            yield
            return
        outer, self.world.phase_name = self.world.phase_name, name
        started = time.perf_counter()
        with self.tracker.phase(name), total_flops_counter() as counter:
            self.counter = counter
            try:
                yield
            finally:
                counted = counter.get_total_flops() + self.skipped_flops.pop(name, 0.0)
                self.flops[name] = max(self.flops.get(name, 0.0), counted)
                self.world.phase_name, self.counter = outer, None
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - started

    def _components(self):
        """The run's components as ``build_components`` makes them, from a stand-in task and tokenizer and the model
        built from its config on the (fake) host, as ``load_model`` builds it."""
        from nemo_jq.data.chat import ChatFormat
        from nemo_jq.recipe.components import assemble_components

        chat = ChatFormat(StandInTokenizer(self.prompt_tokens, self.config.rollout.max_answer_tokens))
        examples = [Example(f"dry-{i}", "", "") for i in range(max(self.config.train.batch_size, self.config.eval.batch_size))]
        splits = Splits(examples[:self.config.train.batch_size], examples[:self.config.eval.batch_size], examples[:1])

        def load_model():
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)

        request = BackendRequest(load_model=load_model, model_dir=self.model_dir, config=self.config, chat=chat, device=GPU)
        with self._phase("build"), self.tracker.label("weights"), self._megatron_folder(), self._optimizer_labels(), \
                self._rollout_ranks(chat):
            components = assemble_components(self.config, GPU, StandInTask(), splits, chat, request)
        sampler_model = getattr(sampler_of(components.engine), "model", None)
        policy_model = components.policy.model
        if sampler_model is not None and sampler_model is not policy_model:
            if self.samples:
                self.tracker.relabel(sampler_model.parameters(), "sampler_copy")
            else:  # the backend leaves a rank that does not sample its copy on the (real) meta device: nothing
                self.tracker.forget(sampler_model.parameters())
        optimizer = components.policy.optimizer
        if hasattr(optimizer, "grad_buffer"):  # the distributed optimizer's: check that _optimizer_labels found them
            assert self.tracker.kind_of(optimizer.grad_buffer) == "gradients", "DistributedAdamW allocates otherwise"
            if optimizer.host_grad is None:  # else offloaded (megatron.optimizer_cpu_offload): host memory
                assert self.tracker.kind_of(optimizer.master) == "optimizer", "DistributedAdamW allocates otherwise"
        self.world.name_modules(policy_model, "policy")
        if sampler_model is not None and sampler_model is not policy_model:
            self.world.name_modules(sampler_model, "sampler")
        return components

    def _rollout_ranks(self, chat: Any):
        """In a split world the backend composes the engine of a training rank (``compose_engine``), which asks the
        rollout ranks: here :class:`RolloutRanks` in :class:`~nemo_jq.rollouts.ranks.RemoteRollouts`' place."""
        if not self.separate:
            return contextlib.nullcontext()
        from nemo_jq.rollouts import wiring
        from nemo_jq.runtime import distributed

        rollout, sends = self.config.rollout, self.place is None or self.place.rank == 0
        budgets = BudgetedRollouts(SamplingRank(None), think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                                   max_thinking_tokens=rollout.max_thinking_tokens, max_answer_tokens=rollout.max_answer_tokens)
        roles = distributed.Roles(0, 1, rollout.ranks, None, None, GPU)  # what compose_engine asks: is the world split
        stack = contextlib.ExitStack()
        stack.enter_context(patched(distributed, "roles", lambda: roles))
        stack.enter_context(patched(wiring, "RemoteRollouts", lambda policy, roles, bucket_bytes: RolloutRanks(
            policy, budgets, LabelledSync(self.tracker, bucket_bytes), sends)))
        return stack

    def _megatron_folder(self):
        """The Megatron backend reads ``model.path``'s folder one tensor at a time, as a real run does: from the
        stand-in folder (:class:`FolderOfShapes`) while the backend is built."""
        if self.place is None:
            return contextlib.nullcontext()
        from nemo_jq.models.megatron import policy
        from nemo_jq.models.megatron.provider import read_qwen3_config

        arch = read_qwen3_config(self.hf_config)
        return patched(policy, "SafetensorsFolder", lambda folder: FolderOfShapes(arch))

    def _optimizer_labels(self):
        """The Megatron backend's distributed optimizer allocates its fp32 gradient buffer, then its fp32 master
        weights (``torch.zeros`` in ``DistributedAdamW.__init__``, in that order; checked once it is built): each is
        counted as what it is from its allocation on, so the build's peak shows them apart from the weights."""
        if self.place is None:
            return contextlib.nullcontext()
        from nemo_jq.models.megatron import zero

        tracker, real_init = self.tracker, zero.DistributedAdamW.__init__

        def init(optimizer, *args, **kwargs):
            kinds = iter(["gradients", "optimizer"])

            class TorchLabellingZeros:
                def __getattr__(self, name: str) -> Any:
                    return getattr(torch, name)

                @staticmethod
                def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
                    with tracker.label(next(kinds, "optimizer")):
                        return torch.zeros(*args, **kwargs)

            with patched(zero, "torch", TorchLabellingZeros()):
                real_init(optimizer, *args, **kwargs)

        return patched(zero.DistributedAdamW, "__init__", init)

    def _watch(self, trainer) -> contextlib.ExitStack:
        """Phases inside the trainer's own step, and gradients counted as such once accumulated; closing the stack
        returns the sampler its own ``sample`` and the trainer its gradient."""
        from nemo_jq.recipe import trainer as trainer_module

        parts = trainer.components
        for parameter in parts.policy.model.parameters():
            parameter.register_post_accumulate_grad_hook(lambda p: self.tracker.relabel([p.grad], "gradients"))
        self._wrap(parts.engine, "generate", "rollout")
        self._wrap(parts.policy, "optimizer_step", "optimizer_step", label="optimizer")
        if self.skip_repeats:
            self._repeats_skipped(parts.policy)
        if not self.samples:
            self._rollouts_from_the_sampling_rank(parts.engine)
        sampler = sampler_of(parts.engine)
        watching = contextlib.ExitStack()
        watching.enter_context(patched(sampler, "sample", self._counted(self._full_budget(sampler))))
        if hasattr(sampler, "sample_seeded"):  # vLLM's: each engine of a replica samples a share (refit.ReplicaShares)
            watching.enter_context(patched(sampler, "sample_seeded", self._counted(sampler.sample_seeded)))
            watching.enter_context(patched(refit, "gather_shares", self._other_shares))
        # row chunks score every row first: activations until the gradients are accumulated
        gradient = self._in_phase(trainer_module.estimator_gradient, "train", "activations")
        watching.enter_context(patched(trainer_module, "estimator_gradient", gradient))
        return watching

    def _repeats_skipped(self, policy) -> None:
        """The training step's row chunks, each run only as often as its peak needs: the scoring pass's no-grad
        calls, and the hf policy's forward/backward of each chunk (a loop of independent calls), run for real for
        the first two chunks and for any of another shape. A later chunk of the second's shape meets exactly the
        second's state (the first chunk's call made what persists: the scores' buffer, the gradients), so its peak is
        the second's; its FLOPs, the second's, are added to the phase's. ``tests/unit/dryrun/test_dryrun.py`` holds the report
        equal to one that runs every chunk."""
        from nemo_jq.models.hf import HFPolicy

        real_logprobs, real_forward_backward = policy.token_logprobs, policy.forward_backward
        seen: dict[str, tuple] = {}  # per kind of call: the second call's batch shapes, FLOPs and result

        def repeat_of(kind: str, batch: TokenBatch) -> tuple | None:
            shapes = shapes_of(batch)
            known = seen.get(kind)
            return known if known is not None and known[0] == shapes else None

        def counted(kind: str, index: int, batch: TokenBatch, call) -> Any:
            before = self.counter.get_total_flops()
            result = call()
            if index == 1:
                seen[kind] = (shapes_of(batch), self.counter.get_total_flops() - before, like(result))
            return result

        scoring = iter(range(1 << 62))

        def token_logprobs(batch: TokenBatch) -> torch.Tensor:
            if torch.is_grad_enabled() or self.world.phase_name != "train" or self.counter is None:
                return real_logprobs(batch)
            index, repeat = next(scoring), repeat_of("score", batch)
            if repeat is None:
                return counted("score", index, batch, lambda: real_logprobs(batch))
            self.skipped_flops["train"] = self.skipped_flops.get("train", 0.0) + repeat[1]
            shape, dtype, device = repeat[2]
            return torch.empty(shape, dtype=dtype, device=device)  # what the call returns, its values unknown anyway

        def forward_backward(micro_batches, loss_fn) -> list[dict[str, Any]]:
            if self.counter is None:
                return real_forward_backward(micro_batches, loss_fn)
            metrics = []
            for index, micro in enumerate(micro_batches):
                repeat = repeat_of("train", micro)
                if repeat is not None:
                    self.skipped_flops["train"] = self.skipped_flops.get("train", 0.0) + repeat[1]
                    metrics.append({})  # a repeat runs in its FLOPs only: no loss to report
                    continue

                def one(micro=micro, index=index):
                    return real_forward_backward([micro], lambda logprobs, _: loss_fn(logprobs, index))

                metrics += counted("train", index, micro, one)
            return metrics

        policy.token_logprobs = token_logprobs
        if type(policy).forward_backward is HFPolicy.forward_backward:  # its calls are independent, one per chunk
            policy.forward_backward = forward_backward

    def _rollouts_from_the_sampling_rank(self, engine) -> None:
        """A Megatron rank that samples none (``rollout.engine`` native or hf: each replica's first rank samples)
        receives its replica's rollouts, values the fake process group cannot carry: they are the ones the sampling
        rank's dry run makes (every row to its full budget), made here by the engine's own code from a stand-in for
        that rank's sampler. This rank's own sampler, whose weights are absent (the meta device), is never called."""
        real_generate = engine.generate

        def generate(prompts, num_samples, **kwargs):
            def sent_by_the_sampling_rank(rollouts, source, group):
                with patched(engine.engine, "sampler", SamplingRank(engine.engine.sampler)):
                    return engine.engine.generate(prompts, num_samples, **kwargs)

            with patched(refit, "share_in_chunks", sent_by_the_sampling_rank):
                return real_generate(prompts, num_samples, **kwargs)

        engine.generate = generate

    def _wrap(self, owner: Any, method: str, phase: str, label: str | None = None) -> None:
        setattr(owner, method, self._in_phase(getattr(owner, method), phase, label))

    def _in_phase(self, real: Callable, phase: str, label: str | None = None) -> Callable:
        """``real``, run in ``phase``, what it allocates labelled ``label`` (else by the tracker's own rules)."""
        def wrapped(*args, **kwargs):
            with self._phase(phase), self.tracker.label(label) if label else contextlib.nullcontext():
                return real(*args, **kwargs)

        return wrapped

    def _counted(self, sample: Callable) -> Callable:
        """``sample`` (a sampler's, or its ``sample_seeded``) counting the prompts of each phase's first call: what
        this rank's engine decodes of its replica's (the shape's ``decoded_prompts``)."""
        def counted(prompts, *args, **kwargs):
            self.decoded_prompts.setdefault(self.world.phase_name, len(prompts))
            self.sampling_call = (args[-1], kwargs["max_new_tokens"])  # num_samples: both signatures' last positional
            return sample(prompts, *args, **kwargs)

        return counted

    def _other_shares(self, own, share, sizes, group, *, sends):
        """``refit.gather_shares`` on the fake group, which carries no peer's object: this rank's engine's share as it
        sampled it, the replica's other engines' as rows at their full budget."""
        num_samples, max_new_tokens = self.sampling_call
        row_group = full_budget_samples([[0]], num_samples, max_new_tokens)[0]
        return [own if index == share else [row_group] * size for index, size in enumerate(sizes)]

    def _full_budget(self, sampler):
        """The sampler's ``sample``: its real code on the largest chunk it samples at once (the peak is the same for
        every chunk), for the world's decode steps; every row then runs to its full budget (the longest rows)."""
        real = sampler.sample
        # the native sampler drops finished rows from its cache once an eighth has finished: a copy of the cache
        # beside the cache. Its first decode step does so here, keeping every row (the copy at its largest).
        def compacting():
            if isinstance(sampler, NativeSampler):
                return patched(sampler, "_compact", lambda cache, keep, batch_rows: True)
            return contextlib.nullcontext()

        def sample(prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False, **options):
            if not self.samples:
                raise WrongDevice(f"phase {self.world.phase_name}: {self.place.describe()} samples nothing "
                                  f"(rollout.engine={self.config.rollout.engine}: each replica's first rank samples) and "
                                  "holds its sampler's weights on the meta device, yet its sampler was called")
            chunk = prompts
            if hasattr(sampler, "prompts_per_chunk"):
                chunk = prompts[:sampler.prompts_per_chunk(prompts, num_samples, max_new_tokens)]
            with self.world.sampling_call(), compacting():
                real(chunk, num_samples, stop_ids=stop_ids, max_new_tokens=max_new_tokens, generator=generator,
                     greedy=greedy, **options)
            return full_budget_samples(prompts, num_samples, max_new_tokens)

        return sample

    def _label_kernels(self) -> None:
        """Storages the KV cache and the log-prob head allocate are counted as theirs."""
        from transformers.cache_utils import DynamicLayer

        from nemo_jq.models.logprobs import _ChunkedTokenLogprob
        from nemo_jq.rollouts.graphs import GraphSampler, StaticDecode
        from nemo_jq.rollouts.hf import PreallocatedCacheLayer

        kernels = [(PreallocatedCacheLayer, "update", "kv_cache"), (PreallocatedCacheLayer, "_rebuild", "kv_cache"),
                   (StaticDecode, "allocate_cache", "kv_cache"), (GraphSampler, "decode_step", "sampler_copy"),
                   (DynamicLayer, "update", "kv_cache"), (_ChunkedTokenLogprob, "forward", "logprob_head"),
                   (_ChunkedTokenLogprob, "backward", "logprob_head")]
        if self.place is not None:
            from nemo_jq.models.megatron.logprobs import _VocabParallelHeadLogprob

            kernels += [(_VocabParallelHeadLogprob, "forward", "logprob_head"),
                        (_VocabParallelHeadLogprob, "backward", "logprob_head")]
        for owner, name, kind in kernels:
            self.stack.enter_context(patched(owner, name, self._labelled(owner.__dict__[name], kind)))
        share = int(self.config.rollout.vllm_memory_utilization * self.gpu.memory_gib * GiB)
        self.stack.enter_context(patched_item(SAMPLERS, "vllm", lambda request: ReservedShare(request, self.tracker, share)))

    def _labelled(self, attribute: Any, kind: str) -> Any:
        """``attribute`` (a function, or a static method) with its allocations counted as ``kind`` (a training
        forward's keys and values stay activations)."""
        function = attribute.__func__ if isinstance(attribute, staticmethod) else attribute

        def labelled(*args, **kwargs):
            training = kind == "kv_cache" and self.tracker.labels[-1] == "activations"
            with contextlib.nullcontext() if training else self.tracker.label(kind):
                return function(*args, **kwargs)

        return staticmethod(labelled) if isinstance(attribute, staticmethod) else labelled

    @property
    def shape(self) -> dict[str, Any]:
        """What the time bounds and the report need of the run's shape."""
        rollout, hf = self.config.rollout, self.hf_config
        return {"parameters": parameter_count(hf), "prompt_tokens": self.prompt_tokens,
                "sequence_tokens": self.prompt_tokens + rollout.max_thinking_tokens + 1 + rollout.max_answer_tokens,
                "samples": rollout.num_samples, "batch_prompts": self.config.train.batch_size,
                "micro_batch_prompts": self.config.train.micro_batch_size, "sampled_answers": self.sampled_answers,
                "sampler_weight_bytes": self.sampler_bytes, "replicas": self.replicas,
                "decoded_prompts": dict(self.decoded_prompts), **self._decode_work(),
                **decode_shape(read_qwen3_config(hf), self._workload.engine_gpus)}

    @property
    def _workload(self) -> Workload:
        """The run as ``nemo-jq plan`` sees it (its engines, the GPUs one spans)."""
        return Workload.from_config(self.config, self.prompt_tokens)
