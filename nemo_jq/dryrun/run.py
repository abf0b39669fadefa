"""``nemo-jq dryrun``: a run's first step at its real size, on fake tensors, phase by phase.

The run's own code builds the policy and its optimizer, samples one rollout call with the engine's real budgets
(the prefill and the first decode steps of the largest chunk the KV budget allows, every row then taken to its full
budget: the longest micro-batch the config allows), refits the engine, trains one step on that micro-batch
(forward, backward, optimizer step), saves a checkpoint, restores it as the collapse guard does, evaluates, and
resumes the run in a fresh process's place. Nothing is allocated: :mod:`nemo_jq.dryrun.world` says how. Each
phase's peak GPU bytes by kind and its FLOPs (``torch.utils.flop_counter.FlopCounterMode``) go into the report,
with the lower bound on its time those FLOPs and the bytes a decode step reads imply on the named GPU.
model.backend=megatron: one rank of the layout's world at a time (--gpus, --ranks; :mod:`nemo_jq.dryrun.megatron`),
each through the same phases on its part of the 1F1B schedule, its distributed checkpoint kept as shapes.
rollout.placement=separate: the training ranks (their rollouts sent, their weights synced) and a rollout rank apart.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_jq.backends import BackendRequest
from nemo_jq.config import Config
from nemo_jq.data import Example, Splits
from nemo_jq.dryrun.memory import KINDS, MemoryTracker
from nemo_jq.dryrun.world import GPU, FakeWorld, WrongDevice, patched
from nemo_jq.models.hf import hf_tensors
from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.objectives import Need, get_objective
from nemo_jq.rollouts import SAMPLERS, BudgetedRollouts, refit
from nemo_jq.rollouts.hf import NativeSampler
from nemo_jq.rollouts.sampling import Sample
from nemo_jq.rollouts.sync import ALIGNMENT, WeightSync

GiB = 1024**3


@dataclass(frozen=True)
class GpuProfile:
    """What the report holds a run against: memory, and the peaks that bound its time."""

    name: str
    memory_gib: float
    bf16_flops: float  # dense bf16 FLOP/s
    bandwidth: float  # memory bytes/s


#: The GPUs the shipped configs are checked against (dense bf16, no sparsity; SXM parts).
GPUS = {
    "a100-80gb": GpuProfile("A100 80GB", 80.0, 312e12, 2.0e12),
    "h100-80gb": GpuProfile("H100 80GB", 80.0, 989e12, 3.35e12),
}

#: The knob that shrinks each kind of bytes, for the one line a run that does not fit gets.
KNOBS = {
    "weights": "model.backend=megatron with tensor/pipeline parallelism (megatron.tensor_parallel, "
               "megatron.pipeline_parallel)",
    "gradients": "model.backend=megatron with megatron.distributed_optimizer=true and more GPUs",
    "optimizer": "model.backend=megatron with megatron.distributed_optimizer=true (the state sharded over DP)",
    "activations": "model.activation_checkpointing=true and a small train.micro_batch_rows (rows per forward/backward, "
                   "whatever M; the same gradient), or model.backend=megatron with megatron.recompute_activations=true",
    "logprob_head": "a smaller model.logprob_chunk_size",
    "kv_cache": "a smaller rollout.kv_cache_tokens",
    "sampler_copy": "rollout.engine=vllm (no HF copy of the model beside the policy); with an fp32 policy, "
                    "rollout.cuda_graphs=false (the native decode's weights cast to bf16 once a sampling call)",
    "vllm": "a smaller rollout.vllm_memory_utilization",
    "temporaries": "a smaller rollout.kv_cache_tokens or eval.batch_size (fewer rows sampled at once)",
    "sync_buckets": "a smaller rollout.sync_bucket_mb",
}
#: A rollout rank's knobs, where they differ: it holds one whole engine.
ROLLOUT_RANK_KNOBS = {"weights": "rollout.engine=vllm within its rollout.vllm_memory_utilization share, or a GPU that "
                                 "holds the whole model in bf16 (a rollout rank holds one whole engine)"}


class DoesNotFit(ValueError):
    """One line: the phase, the GPU, the kind that takes the most, and the knob that shrinks it."""


def dry_run(config: Config, gpu: GpuProfile, *, prompt_tokens: int = 1024, decode_steps: int = 2,
            headroom: float = 0.9, world_size: int | None = None, ranks: list[int] | None = None,
            skip_repeats: bool = True) -> dict[str, Any]:
    """The report of ``config``'s first step on ``gpu`` (see the module docstring); ``prompt_tokens``: the longest
    prompt the data holds; ``skip_repeats``: run a training chunk of a shape already seen twice only in its FLOPs
    (the same report, sooner: ``_DryRun._repeats_skipped``). ``model.backend=megatron``: ``ranks`` (default:
    :func:`.megatron.default_ranks`) of a world of ``world_size`` GPUs (default: one replica), each simulated apart;
    the report's phases are the fullest one's."""
    separate = config.rollout.placement == "separate"
    if separate:  # a training rank holds the same with rollouts sampled a step ahead: token ids, sent by the rollout ranks
        config = copy.deepcopy(config)
        config.rollout.async_steps = 0
    usable = gpu.memory_gib * headroom
    report = {"gpu": asdict(gpu), "usable_gib": usable, "prompt_tokens": prompt_tokens, "decode_steps": decode_steps}
    if config.model.backend != "megatron":
        simulated = _simulate(config, gpu, prompt_tokens, decode_steps, None, skip_repeats)
        simulated["rank"] = ("the training process of model.backend=hf: it trains and asks the rollout ranks" if separate
                             else "the one process of model.backend=hf: it samples and trains")
        replicas, sent_dtype = 1, simulated.pop("sent_dtype")
        report = {**report, **simulated, "fits": simulated["peak_gib"] <= usable}
    else:
        from nemo_jq.dryrun import megatron

        layout = config.megatron
        world_size = world_size or layout.replica_size
        ranks = sorted(set(ranks)) if ranks else megatron.default_ranks(config, world_size)
        megatron.check_ranks(config, ranks, world_size)
        by_rank = {}
        for rank in ranks:
            place = megatron.RankPlace.of(rank, layout, world_size)
            with megatron.as_rank(rank, world_size, layout):
                by_rank[str(rank)] = {**_simulate(config, gpu, prompt_tokens, decode_steps, place, skip_repeats), "rank": place.describe()}
        sent_dtype = next(filter(None, [simulated.pop("sent_dtype") for simulated in by_rank.values()]), None)
        fullest = max(by_rank.values(), key=lambda simulated: simulated["peak_gib"])
        report = {**report, **fullest, "world_size": world_size, "ranks": by_rank, "fits": fullest["peak_gib"] <= usable}
        replicas = layout.data_parallel(world_size)
    if separate:
        serving = _simulate(config, gpu, prompt_tokens, decode_steps, None, skip_repeats, serves=(replicas, sent_dtype))
        del serving["sent_dtype"]
        report["rollout_rank"] = {**serving, "rank": f"a rollout rank: it samples one of the {replicas} replicas' requests at "
                                  "a time, and takes the weights each step sends", "fits": serving["peak_gib"] <= usable}
        report["fits"] = report["fits"] and report["rollout_rank"]["fits"]
    return report


def _simulate(config: Config, gpu: GpuProfile, prompt_tokens: int, decode_steps: int, place: Any,
              skip_repeats: bool, serves: tuple[int, torch.dtype | None] | None = None) -> dict[str, Any]:
    """One process's (or simulated rank's) phases: each one's peak by kind, FLOPs, time bound and simulation time, and
    the dtype of the weights it sent the rollout ranks (``sent_dtype``; None: it sent none). ``serves``: a rollout
    rank's, of that many replicas, taking in weights of that dtype (None: fp32)."""
    tracker = MemoryTracker(GPU.type)
    flops: dict[str, float] = {}
    with FakeWorld(tracker, decode_steps=decode_steps) as world, tempfile.TemporaryDirectory() as scratch:
        run = _DryRun(config, world, Path(scratch), prompt_tokens, flops, gpu, place, skip_repeats)
        run.serve(*serves) if serves is not None else run.first_step()
        shape, wall = run.shape, run.wall
    phases = {name: {"peak_gib": _gib(peak.peak), "by_kind_gib": {k: _gib(v) for k, v in peak.by_kind.items() if v},
                     "most_by_kind_gib": {k: _gib(v) for k, v in peak.most_by_kind.items() if v},
                     "flops": flops.get(name, 0.0), "simulated_in_s": round(wall.get(name, 0.0), 1)}
              for name, peak in tracker.phases.items()}
    for name, phase in phases.items():
        phase["seconds_at_least"] = round(seconds_at_least(name, phase["flops"], shape, config, gpu), 3)
    worst = max(phases, key=lambda name: phases[name]["peak_gib"])
    return {"shape": shape, "phases": phases, "peak_gib": phases[worst]["peak_gib"], "peak_phase": worst, "sent_dtype": run.sent_dtype}


def on_gpu(report: dict[str, Any], config: Config, gpu: GpuProfile) -> dict[str, Any]:
    """``report`` (of ``config``) as :func:`dry_run` makes it on ``gpu``, a GPU of the same memory, without simulating
    again: what the run holds depends on the GPU's memory alone (what is usable, vLLM's share), so only the profile
    and the time bounds differ (``tests/unit/dryrun/test_dryrun.py`` holds the two equal)."""
    if gpu.memory_gib != report["gpu"]["memory_gib"]:
        raise ValueError(f"{gpu.name} has {gpu.memory_gib} GiB, not the {report['gpu']['memory_gib']} this report was "
                         "simulated on: dry-run it on that GPU")
    moved = copy.deepcopy(report)
    moved["gpu"] = asdict(gpu)
    for simulated in [moved, *moved.get("ranks", {}).values(), *([moved["rollout_rank"]] if "rollout_rank" in moved else [])]:
        for name, phase in simulated["phases"].items():
            phase["seconds_at_least"] = round(seconds_at_least(name, phase["flops"], simulated["shape"], config, gpu), 3)
    return moved


def check_fits(report: dict[str, Any]) -> None:
    """Raise :class:`DoesNotFit` naming the worst phase's largest kind and its knob, when the peak is over."""
    if report["fits"]:
        return
    serving = report.get("rollout_rank")
    where, knobs = (serving, {**KNOBS, **ROLLOUT_RANK_KNOBS}) if serving and not serving["fits"] else (report, KNOBS)
    phase = where["phases"][where["peak_phase"]]
    kind = max(phase["by_kind_gib"], key=phase["by_kind_gib"].get)
    raise DoesNotFit(f"phase {where['peak_phase']}{' of a rollout rank' if where is serving else ''} needs "
                     f"{phase['peak_gib']:.1f} GiB of the {report['usable_gib']:.0f} usable on {report['gpu']['name']}, "
                     f"{phase['by_kind_gib'][kind]:.1f} GiB of it {kind.replace('_', ' ')}: try {knobs[kind]}")


#: Where each of ``nemo-jq plan``'s components is seen in a dry run: the phases, and the kind at its most there.
PLAN_COMPONENTS = {"weights": (("build",), "weights"), "gradients": (("optimizer_step",), "gradients"),
                   "optimizer": (("save",), "optimizer"), "activations": (("train",), "activations"),
                   "logprob_head": (("train",), "logprob_head"), "rollout_copy": (("build",), "sampler_copy"),
                   "kv_cache": (("rollout", "evaluate"), "kv_cache"), "decode_cast": (("rollout", "evaluate"), "sampler_copy"),
                   "vllm": (("rollout",), "vllm")}
#: The same for a Megatron rank: the optimizer's state at rest after the step is seen in the refit (or a split
#: world's sync) that follows it, before the save gathers it, the KV cache in the rollouts; the weights and the
#: sampler's copy after the build, which counts the copy as weights until the backend has made it (its peak shows
#: them together).
MEGATRON_PLAN_COMPONENTS = {**PLAN_COMPONENTS, "weights": (("train",), "weights"), "optimizer": (("refit", "sync"), "optimizer"),
                            "rollout_copy": (("rollout",), "sampler_copy"), "kv_cache": (("rollout",), "kv_cache")}


#: Where each of ``plan``'s parts of a rollout rank is seen in its dry run.
ROLLOUT_RANK_COMPONENTS = {"weights": (("build",), "weights"), "kv_cache": (("rollout", "evaluate"), "kv_cache"),
                           "vllm": (("rollout",), "vllm"), "sync_buckets": (("sync",), "sync_buckets")}


def against_plan(report: dict[str, Any], config: Config) -> dict[str, dict[str, float]]:
    """``nemo-jq plan --config``'s estimate of each component beside the dry run's (GiB), and their ratio. Megatron:
    the plan's layout is the config's over the report's world, and its figure is the layout's fullest rank's, so the
    dry run's is the most any simulated rank holds."""
    from nemo_jq.cluster import plan

    work = plan.Workload.from_config(config, report["prompt_tokens"])
    layout, simulated, where = (1, 1, 1), [report], PLAN_COMPONENTS
    if "ranks" in report:
        megatron = config.megatron
        layout = (megatron.tensor_parallel, megatron.pipeline_parallel, megatron.data_parallel(report["world_size"]))
        simulated, where = list(report["ranks"].values()), MEGATRON_PLAN_COMPONENTS
    planned_bytes = plan.component_bytes(plan.architecture(config.model.path or ""), work, *layout,
                                         report["gpu"]["memory_gib"])
    rows = {}
    for component, (phases, kind) in where.items():
        dry = max(rank["phases"][phase]["most_by_kind_gib"].get(kind, 0.0) for rank in simulated for phase in phases
                  if phase in rank["phases"])
        planned = _gib(planned_bytes[component])
        rows[component] = {"dry_run_gib": dry, "plan_gib": planned,
                           "plan_over_dry_run": round(planned / dry, 3) if dry else None}
    serving = report.get("rollout_rank")
    if serving:  # what plan says of a rollout rank (at the layout's DP), beside its dry run
        planned_bytes = plan.rollout_rank_bytes(plan.architecture(config.model.path or ""), work, layout[2],
                                                report["gpu"]["memory_gib"])
        for component, size in planned_bytes.items():
            phases, kind = ROLLOUT_RANK_COMPONENTS[component]
            dry = max(serving["phases"][phase]["most_by_kind_gib"].get(kind, 0.0) for phase in phases)
            rows[f"rollout_rank.{component}"] = {"dry_run_gib": dry, "plan_gib": _gib(size),
                                                 "plan_over_dry_run": round(_gib(size) / dry, 3) if dry else None}
    return rows


def format_report(report: dict[str, Any]) -> str:
    simulated = list(report["ranks"].values()) if "ranks" in report else [report]
    world = f"rank(s) of {report['world_size']} GPUs, each simulated apart" if "ranks" in report else report["rank"]
    lines = [f"{report['shape']['parameters'] / 1e9:.3f}B parameters on {report['gpu']['name']} "
             f"({report['usable_gib']:.0f} GiB usable); {world}; prompts of {report['prompt_tokens']} tokens"]
    serving = report.get("rollout_rank")
    for rank in [*simulated, *([serving] if serving else [])]:
        if "ranks" in report or serving:
            lines.append(f"{rank['rank']} (peak {rank['peak_gib']:.2f} GiB in phase {rank['peak_phase']})")
        lines += _phase_table(rank["phases"])
    verdict = "fits" if report["fits"] else "does NOT fit"
    lines.append(f"peak: {report['peak_gib']:.2f} GiB in phase {report['peak_phase']}"
                 + (f" of {report['rank'].split(':')[0]}" if "ranks" in report else "")
                 + (f"; a rollout rank's {serving['peak_gib']:.2f} GiB in phase {serving['peak_phase']}" if serving else "")
                 + f": {verdict}. TFLOP run: what "
                 f"the dry run executed ({report['decode_steps']} decode steps a sampling call, one micro-batch"
                 f"{' (PP of them under pipeline parallelism)' if 'ranks' in report else ''}); s at least: the whole "
                 "step's bound (docs/dryrun.md)")
    return "\n".join(lines)


def _phase_table(phases: dict[str, Any]) -> list[str]:
    kinds = [kind for kind in KINDS if any(kind in phase["by_kind_gib"] for phase in phases.values())]
    lines = [f"{'phase':<14}{'peak GiB':>10}" + "".join(f"{k.replace('_', ' '):>14}" for k in kinds)
             + f"{'TFLOP run':>10}{'s at least':>12}"]
    for name, phase in phases.items():
        lines.append(f"{name:<14}{phase['peak_gib']:>10.2f}" + "".join(f"{phase['by_kind_gib'].get(k, 0.0):>14.2f}" for k in kinds)
                     + f"{phase['flops'] / 1e12:>10.1f}{phase['seconds_at_least']:>12.2f}")
    return lines


def _gib(size: int) -> float:
    return round(size / GiB, 6)


class _DryRun:
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

    def first_step(self) -> None:
        from nemo_jq.recipe.trainer import Trainer

        with self.stack:
            self._label_kernels()
            trainer = Trainer(self.config, run_dir=self.scratch / "run", components=self._components())
            watching = self._watch(trainer)
            self.sampler_bytes = self._weight_bytes(_sampler(trainer.components.engine))
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
            with self._phase("evaluate"):
                trainer.evaluator.evaluate("validation")
            watching.close()
            del trainer, watching
            gc.collect()
            with self._phase("resume"):
                resumed = Trainer(self.config, run_dir=self.scratch / "run", components=self._components())
                resumed.restore(checkpoint)

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

        config, rollout = self.config, self.config.rollout
        with self.stack:
            self._label_kernels()
            chat = ChatFormat(_StandInTokenizer(self.prompt_tokens, rollout.max_answer_tokens))
            host = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)  # on the fake host: no memory
            whole = [(name, sent_dtype or torch.float32, tuple(tensor.shape)) for name, tensor in hf_tensors(host)]
            with self._phase("build"), self.tracker.label("weights"):
                engine = rollout_rank_engine(config, GPU, chat, self.model_dir, lambda: host)
            if hasattr(engine.sampler, "model"):
                self.world.name_modules(engine.sampler.model, "sampler")
            self.sampler_bytes = self._weight_bytes(engine.sampler)
            self.sampled_answers = Need.SAMPLED_ANSWER_REWARD in get_objective(config.objective.name).needs
            with patched(engine.sampler, "sample", self._full_budget(engine.sampler)):
                with self._phase("sync"), engine.awake():
                    engine.load_weights(received(whole, rollout.bucket_bytes(), self.tracker))
                prompt = chat.prompt_ids(_StandInTask().messages(Example("dry", "", ""), config.data.format))
                generator = torch.Generator()
                with self._phase("rollout"):
                    engine.generate([prompt] * -(-config.train.batch_size // replicas), rollout.num_samples,
                                    sample_answers=self.sampled_answers, generator=generator)
                with self._phase("evaluate"):
                    engine.generate([prompt] * config.eval.batch_size, config.eval.num_samples, sample_answers=True,
                                    generator=generator)

    def _weight_bytes(self, sampler: Any) -> int:
        """The bytes of the weights a sampling call reads: as the sampler reads them (the graph path: in the compute
        dtype), else its HF model's, or (vLLM, or none here) the bf16 model's."""
        model = getattr(sampler, "model", None)
        if hasattr(sampler, "weight_bytes"):
            return sampler.weight_bytes()
        return 2 * _parameters(self.hf_config) if model is None else sum(p.numel() * p.element_size() for p in model.parameters())

    @property
    def samples(self) -> bool:
        """Whether this process samples: the hf backend's one, or the simulated Megatron rank (``.megatron.samples``); in
        a split world every training rank takes its rollouts from the stand-in (:class:`_RolloutRanks`) alike."""
        from nemo_jq.dryrun.megatron import samples

        return self.place is None or self.separate or samples(self.config, self.place)

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

        chat = ChatFormat(_StandInTokenizer(self.prompt_tokens, self.config.rollout.max_answer_tokens))
        examples = [Example(f"dry-{i}", "", "") for i in range(max(self.config.train.batch_size, self.config.eval.batch_size))]
        splits = Splits(examples[:self.config.train.batch_size], examples[:self.config.eval.batch_size], examples[:1])

        def load_model():
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)

        request = BackendRequest(load_model=load_model, model_dir=self.model_dir, config=self.config, chat=chat, device=GPU)
        with self._phase("build"), self.tracker.label("weights"), self._megatron_folder(), self._optimizer_labels(), \
                self._rollout_ranks(chat):
            components = assemble_components(self.config, GPU, _StandInTask(), splits, chat, request)
        sampler_model = getattr(_sampler(components.engine), "model", None)
        policy_model = components.policy.model
        if sampler_model is not None and sampler_model is not policy_model:
            if self.samples:
                self.tracker.relabel(sampler_model.parameters(), "sampler_copy")
            else:  # the backend leaves a rank that does not sample its copy on the (real) meta device: nothing
                self.tracker.forget(sampler_model.parameters())
        optimizer = components.policy.optimizer
        if hasattr(optimizer, "grad_buffer"):  # the distributed optimizer's: check that _optimizer_labels found them
            assert self.tracker.kind_of(optimizer.grad_buffer) == "gradients", "DistributedAdamW allocates otherwise"
            assert self.tracker.kind_of(optimizer.master) == "optimizer", "DistributedAdamW allocates otherwise"
        self.world.name_modules(policy_model, "policy")
        if sampler_model is not None and sampler_model is not policy_model:
            self.world.name_modules(sampler_model, "sampler")
        return components

    def _rollout_ranks(self, chat: Any):
        """In a split world the backend composes the engine of a training rank (``compose_engine``), which asks the
        rollout ranks: here :class:`_RolloutRanks` in :class:`~nemo_jq.rollouts.ranks.RemoteRollouts`' place."""
        if not self.separate:
            return contextlib.nullcontext()
        from nemo_jq.rollouts import wiring
        from nemo_jq.runtime import distributed

        rollout, sends = self.config.rollout, self.place is None or self.place.rank == 0
        budgets = BudgetedRollouts(_SamplingRank(None), think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                                   max_thinking_tokens=rollout.max_thinking_tokens, max_answer_tokens=rollout.max_answer_tokens)
        roles = distributed.Roles(0, 1, rollout.ranks, None, None, GPU)  # what compose_engine asks: is the world split
        stack = contextlib.ExitStack()
        stack.enter_context(patched(distributed, "roles", lambda: roles))
        stack.enter_context(patched(wiring, "RemoteRollouts", lambda policy, roles, bucket_bytes: _RolloutRanks(
            policy, budgets, _LabelledSync(self.tracker, bucket_bytes), sends)))
        return stack

    def _megatron_folder(self):
        """The Megatron backend reads ``model.path``'s folder one tensor at a time, as a real run does: from the
        stand-in folder (:class:`_FolderOfShapes`) while the backend is built."""
        if self.place is None:
            return contextlib.nullcontext()
        from nemo_jq.models.megatron import policy
        from nemo_jq.models.megatron.provider import read_qwen3_config

        arch = read_qwen3_config(self.hf_config)
        return patched(policy, "SafetensorsFolder", lambda folder: _FolderOfShapes(arch))

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
        sampler = _sampler(parts.engine)
        watching = contextlib.ExitStack()
        watching.enter_context(patched(sampler, "sample", self._full_budget(sampler)))
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
            shapes = _shapes(batch)
            known = seen.get(kind)
            return known if known is not None and known[0] == shapes else None

        def counted(kind: str, index: int, batch: TokenBatch, call) -> Any:
            before = self.counter.get_total_flops()
            result = call()
            if index == 1:
                seen[kind] = (_shapes(batch), self.counter.get_total_flops() - before, _like(result))
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
                with patched(engine.engine, "sampler", _SamplingRank(engine.engine.sampler)):
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

        def sample(prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
            if not self.samples:
                raise WrongDevice(f"phase {self.world.phase_name}: {self.place.describe()} samples nothing "
                                  f"(rollout.engine={self.config.rollout.engine}: each replica's first rank samples) and "
                                  "holds its sampler's weights on the meta device, yet its sampler was called")
            chunk = prompts
            if hasattr(sampler, "prompts_per_chunk"):
                chunk = prompts[:sampler.prompts_per_chunk(prompts, num_samples, max_new_tokens)]
            with self.world.sampling_call(), compacting():
                real(chunk, num_samples, stop_ids=stop_ids, max_new_tokens=max_new_tokens, generator=generator,
                     greedy=greedy)
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
        self.stack.enter_context(_patched_item(SAMPLERS, "vllm", lambda request: ReservedShare(request, self.tracker, share)))

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
        return {"parameters": _parameters(hf), "prompt_tokens": self.prompt_tokens,
                "sequence_tokens": self.prompt_tokens + rollout.max_thinking_tokens + 1 + rollout.max_answer_tokens,
                "samples": rollout.num_samples, "batch_prompts": self.config.train.batch_size,
                "micro_batch_prompts": self.config.train.micro_batch_size, "sampled_answers": self.sampled_answers,
                "sampler_weight_bytes": self.sampler_bytes,
                "kv_bytes_per_token": 2 * 2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim}


class _RolloutRanks:
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

    def generate(self, prompts, num_samples, **kwargs) -> list:
        return self.engine.generate(prompts, num_samples, **kwargs)

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


class _LabelledSync(WeightSync):
    """The weight sync on the stand-in GPU, over a group without peers (its broadcasts done at once), its buckets
    counted as ``sync_buckets``."""

    def __init__(self, tracker: MemoryTracker, bucket_bytes: int):
        super().__init__(_NoPeers(), source=0, bucket_bytes=bucket_bytes, device=GPU)
        self.tracker = tracker

    def _new_bucket(self) -> torch.Tensor:
        with self.tracker.label("sync_buckets"):
            return super()._new_bucket()


class _NoPeers:
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


class _SamplingRank:
    """A replica's sampling rank, as a rank that samples none sees it: the rollouts it sends, every row to its full
    budget (as that rank's own dry run samples them); the sampler's other attributes are this rank's (None: a training
    rank of a split world, which has no sampler of its own)."""

    def __init__(self, sampler: Any):
        self.sampler = sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
        return full_budget_samples(prompts, num_samples, max_new_tokens)


def _shapes(batch: TokenBatch) -> tuple:
    return tuple(None if tensor is None else tuple(tensor.shape) for tensor in vars(batch).values())


def _like(result: Any) -> tuple | None:
    return (tuple(result.shape), result.dtype, result.device) if isinstance(result, torch.Tensor) else None


class ReservedShare:
    """vLLM in the dry run: its memory is its own (weights, KV cache, CUDA graphs inside
    ``vllm_memory_utilization`` of the GPU), held while it is awake; it samples every row to its full budget."""

    def __init__(self, request, tracker: MemoryTracker, share: int):
        from nemo_jq.runtime import distributed

        self.tracker, self.share, self.depth = tracker, share, 0
        self.tensor_parallel = request.config.rollout.tensor_parallel
        self.lockstep = distributed.world_size() > 1  # as vLLM's: under torchrun every rank samples, in step

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Held once however the wakes nest (a refitted engine wakes it around the budget core's own wake)."""
        self.depth += 1
        try:
            with self.tracker.reserved("vllm", self.share) if self.depth == 1 else contextlib.nullcontext():
                yield
        finally:
            self.depth -= 1

    def load_weights(self, tensors) -> None:
        for _ in tensors:
            pass

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
        return full_budget_samples(prompts, num_samples, max_new_tokens)


def full_budget_samples(prompts, num_samples: int, max_new_tokens: int) -> list[list[Sample]]:
    """Every row run to its full budget without stopping: the longest rollouts (their token values are unknown)."""
    full = Sample([0] * max_new_tokens, False, [0.0] * max_new_tokens)
    return [[full] * num_samples for _ in prompts]


def model_config(config: Config, folder: Path) -> Any:
    """The HF config of ``model.path`` (a Qwen3 size name, a local folder, or the tiny model), written to ``folder``
    as a model folder without weights (what an engine that loads a folder is given)."""
    from transformers import AutoConfig, Qwen3Config

    from nemo_jq.cluster.plan import hf_config_dict

    path = config.model.path
    if path is None:
        tiny = config.model.tiny
        hf = Qwen3Config(vocab_size=tiny.tokenizer_vocab_size, hidden_size=tiny.hidden_size,
                         intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_layers,
                         num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads,
                         head_dim=tiny.hidden_size // tiny.num_heads,
                         max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=True)
    elif Path(path).expanduser().exists():
        hf = AutoConfig.from_pretrained(Path(path).expanduser())
    else:
        hf = Qwen3Config(**hf_config_dict(path))
    hf.save_pretrained(folder)
    return hf


def _parameters(hf_config) -> int:
    from nemo_jq.cluster.plan import parameter_count
    from nemo_jq.models.megatron.provider import read_qwen3_config

    return parameter_count(read_qwen3_config(hf_config))


def seconds_at_least(phase: str, flops: float, shape: dict[str, Any], config: Config, gpu: GpuProfile) -> float:
    """A lower bound on the phase's time in the run on ``gpu``. Training: the FLOPs counted on one micro-batch, times
    the replica's micro-batches, at the bf16 peak. Sampling (the step's rollouts; an evaluation of the validation
    split): every decode step of every chunk reads the sampler's weights as it holds them and the keys and values so
    far, at the memory bandwidth (or its 2 FLOPs a parameter a token at the peak, where that is more); the dry run
    itself ran only a few of those steps. Other phases: their FLOPs at the peak."""
    seconds = flops / gpu.bf16_flops
    if phase == "train":
        return seconds * math.ceil(shape["batch_prompts"] / shape["micro_batch_prompts"])
    if phase == "rollout":
        return sampling_seconds(shape, config, gpu, shape["batch_prompts"], config.rollout.num_samples,
                                answers=shape["sampled_answers"])
    if phase == "evaluate":
        calls = math.ceil(config.data.validation_size / config.eval.batch_size)
        return calls * sampling_seconds(shape, config, gpu, config.eval.batch_size, config.eval.num_samples, answers=True)
    return seconds


def sampling_seconds(shape: dict[str, Any], config: Config, gpu: GpuProfile, prompts: int, samples: int, *,
                     answers: bool) -> float:
    """The bound of :func:`seconds_at_least` for one sampling call of ``prompts`` x ``samples`` rows: the thinking
    phase in chunks of whole groups, then (``answers``) the answer phase in chunks of rows, as the samplers chunk."""
    rollout, kv_budget = config.rollout, config.rollout.kv_cache_tokens
    weights, per_token = shape["sampler_weight_bytes"], shape["kv_bytes_per_token"]

    def phase(rows: int, context: int, steps: int, rows_per_chunk: int) -> float:
        chunks, total = math.ceil(rows / rows_per_chunk), 0.0
        for chunk in range(chunks):
            r = min(rows_per_chunk, rows - chunk * rows_per_chunk)
            kv = r * per_token * (steps * context + steps * (steps + 1) / 2)
            flops = 2 * shape["parameters"] * r * (context + steps)
            total += max((steps * weights + kv) / gpu.bandwidth, flops / gpu.bf16_flops)
        return total

    prompt, thinking = shape["prompt_tokens"], rollout.max_thinking_tokens
    group = samples * (prompt + thinking)
    prompts_per_chunk = prompts if kv_budget is None else max(1, kv_budget // group)
    seconds = phase(prompts * samples, prompt, thinking, prompts_per_chunk * samples)
    if answers:
        context = prompt + thinking + 1
        rows = prompts * samples if kv_budget is None else max(1, kv_budget // (context + rollout.max_answer_tokens))
        seconds += phase(prompts * samples, context, rollout.max_answer_tokens, rows)
    return seconds


class _NoModules:
    """``FlopCounterMode``'s module tracker, tracking none: ``ModuleTracker`` hooks every module's inputs and outputs
    into autograd, and those hooks keep activation checkpointing's recomputed tensors alive past their use (on a GPU
    nothing holds them, and the dry run would count them). Only the total is read."""

    parents = {"Global"}

    def __enter__(self) -> "_NoModules":
        return self

    def __exit__(self, *exc) -> None:
        return None


def total_flops_counter() -> FlopCounterMode:
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _NoModules()
    return counter


def _sampler(engine: Any) -> Any:
    return (engine.engine if hasattr(engine, "engine") else engine).sampler


@contextlib.contextmanager
def _patched_item(mapping: dict, key: str, value: Any) -> Iterator[None]:
    original = mapping[key]
    dict.__setitem__(mapping, key, value)
    try:
        yield
    finally:
        dict.__setitem__(mapping, key, original)


class _FolderOfShapes(Mapping):
    """A model folder's weights as the Megatron backend reads them (``SafetensorsFolder``): each an HF tensor of the
    config's shape in bf16 (the released checkpoints' dtype), read on the (fake) host when asked for. It lists the
    weights this rank has read: a real folder lists every stage's, which the policy checks against every stage's
    parameter names, gathered from the other stages; here those are this stage's own (``.megatron``)."""

    def __init__(self, arch: Any):
        self.arch, self.read = arch, []

    def __getitem__(self, name: str) -> torch.Tensor:
        from nemo_jq.models.megatron.mapping import hf_shape

        self.read.append(name)
        with torch.device("cpu"):
            return torch.empty(hf_shape(name, self.arch), dtype=torch.bfloat16)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(self.read))

    def __len__(self) -> int:
        return len(dict.fromkeys(self.read))


class _StandInTask:
    """No data: every example's reward is 0 (the dry run reads no values)."""

    def messages(self, example: Example, prompt_format: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": ""}]

    def extract_answer(self, output: str) -> str:
        return output

    def normalize(self, text: str) -> str:
        return text

    def reward(self, output: str, example: Example) -> float:
        return 0.0

    def is_correct(self, output: str, example: Example) -> bool:
        return False

    def corpus(self, examples: list[Example]) -> list[str]:
        return []


class _StandInTokenizer:
    """Prompts of ``prompt_tokens`` tokens and answers of ``answer_tokens`` (with the end of turn): the longest."""

    PROMPT = "<dry-run prompt>"
    pad_token_id = 0

    def __init__(self, prompt_tokens: int, answer_tokens: int):
        self.prompt_tokens, self.answer_tokens = prompt_tokens, answer_tokens

    def get_vocab(self) -> dict[str, int]:
        from nemo_jq.data.chat import END_OF_TURN, THINK_END, THINK_START

        return {THINK_START: 1, THINK_END: 2, END_OF_TURN: 3}

    def get_chat_template(self) -> str:
        return ""

    def apply_chat_template(self, messages, **kwargs) -> str:
        return self.PROMPT

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [4] * (self.prompt_tokens if text == self.PROMPT else max(1, self.answer_tokens - 1))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""

    def __len__(self) -> int:
        return 5
