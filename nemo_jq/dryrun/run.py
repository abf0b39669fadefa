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
This file is the entry (:func:`dry_run`, :func:`on_gpu`, :func:`check_fits`); the phases are :mod:`.phases`'.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_jq.cluster.plan import (
    HEADROOM,
    PROMPT_TOKENS,
    Workload,
    architecture,
    auto_micro_batch_rows,
    check_context,
    model_context,
    vllm_bytes,
    vllm_share_short,
)
from nemo_jq.config import Config
from nemo_jq.dryrun.bounds import GpuProfile, run_time, seconds_at_least
from nemo_jq.dryrun.memory import MemoryTracker, gib
from nemo_jq.dryrun.phases import DryRun
from nemo_jq.dryrun.report import decode_work, host_sum
from nemo_jq.dryrun.world import GPU, FakeWorld
from nemo_jq.typed import ConfigError


def knob(kind: str, config: Config, *, rollout_rank: bool = False) -> str:
    """The setting that shrinks ``kind``'s bytes, for the one line a run that does not fit gets; a setting ``config``
    already has is not offered again (the next one is), and one to make smaller says its value now."""
    model, layout, train, rollout = config.model, config.megatron, config.train, config.rollout
    megatron = model.backend == "megatron"
    parallel = (f"more tensor or pipeline parallelism (megatron.tensor_parallel={layout.tensor_parallel}, "
                f"megatron.pipeline_parallel={layout.pipeline_parallel} now)")
    # a Qwen3-MoE's experts are most of its weights: EP splits them, and their gradients, over more ranks (their
    # distributed optimizer's state is split over EP x expert-DP, the same GPUs whatever EP)
    experts = (f"megatron.expert_parallel above {layout.expert_parallel} (each rank a share of the experts), or "
               if megatron and is_moe(model.path) else "")
    if kind == "weights":
        if rollout_rank:
            return ("rollout.engine=vllm within its rollout.vllm_memory_utilization share (over rollout.tensor_parallel "
                    "rollout ranks), or a GPU that holds the whole model in bf16")
        return experts + parallel if megatron else f"model.backend=megatron with {parallel.replace(' now', '')}"
    if kind in ("gradients", "optimizer"):
        if not megatron:
            return "model.backend=megatron with megatron.distributed_optimizer=true (the state sharded over DP) and more GPUs"
        if not layout.distributed_optimizer:
            return (f"{experts}megatron.distributed_optimizer=true (the state sharded over the data-parallel ranks) and "
                    "more GPUs")
        if kind == "optimizer" and not layout.optimizer_cpu_offload:
            return "megatron.optimizer_cpu_offload=true (the state in host memory), or more GPUs (more DP shards)"
        return f"{experts if kind == 'gradients' else ''}more GPUs (more data-parallel shards), or {parallel}"
    if kind == "activations":
        rows = train.micro_batch_rows
        steps = [*([] if megatron or model.activation_checkpointing else ["model.activation_checkpointing=true"]),
                 *([] if not megatron or layout.recompute_activations else ["megatron.recompute_activations=true"]),
                 *([] if rows == 1 else [f"a smaller train.micro_batch_rows ({rows if rows is not None else 'unset'} "
                                         "now; rows per forward/backward, whatever M; the same gradient)"])]
        more = (f"megatron.context_parallel above {layout.context_parallel} (each rank a share of every sequence)"
                if megatron else "model.backend=megatron with megatron.context_parallel (each rank a share of every "
                                 "sequence)")
        return f"{' and '.join(steps)}, or {more}" if steps else more
    if kind == "sampler_copy":
        graphs = (", or rollout.cuda_graphs=false (the native decode's weights cast to bf16 once a sampling call)"
                  if rollout.cuda_graphs and rollout.engine == "native" else "")
        return f"rollout.engine=vllm (no HF copy of the model beside the policy){graphs}"
    return {"logprob_head": f"a smaller model.logprob_chunk_size ({model.logprob_chunk_size} now)",
            "kv_cache": f"a smaller rollout.kv_cache_tokens ({rollout.kv_cache_tokens} now)",
            "vllm": f"a smaller rollout.vllm_memory_utilization ({rollout.vllm_memory_utilization:g} now)",
            "temporaries": f"a smaller rollout.kv_cache_tokens ({rollout.kv_cache_tokens} now) or eval.batch_size "
                           f"({config.eval.batch_size} now): fewer rows sampled at once",
            "sync_buckets": f"a smaller rollout.sync_bucket_mb ({rollout.sync_bucket_mb:g} now)"}[kind]


def is_moe(model_path: str | None) -> bool:
    """Whether ``model.path`` names a Qwen3-MoE (False where its config cannot be read here)."""
    try:
        return bool(model_path) and architecture(model_path).is_moe
    except (ValueError, OSError):
        return False


def check_one_process(config: Config, world_size: int) -> None:
    """The dry run simulates each process apart: rollouts one step ahead sampled by a child process beside the training
    one on its GPU (``rollout.async_steps=1`` in a world of one process whose engine decodes an HF copy: hf, or
    megatron on one GPU) are not simulated; one line says so and what to run instead (a child could not take its
    stand-in tensors: a traceback)."""
    from nemo_jq.rollouts import samples_in_a_child

    rollout = config.rollout
    if samples_in_a_child(config, world_size):
        raise ValueError(f"rollout.async_steps={rollout.async_steps} with rollout.engine={rollout.engine} in one process: "
                         "a child process samples the next step's rollouts beside this one's training on its GPU, which "
                         "the dry run (one process) does not simulate: dry-run the step with rollout.async_steps=0, and "
                         "`nemo-jq plan --config` gives the peak with the child's keys and values beside the training")


def check_vllm_share(config: Config, prompt_tokens: int, gpu: GpuProfile) -> None:
    """vLLM starts in its share of ``gpu`` (its weights and one sequence's keys and values: ``plan``'s check);
    else one line, as vLLM would fail at its first sampling call (the stand-in only holds the share)."""
    if config.rollout.engine != "vllm" or config.model.path is None:
        return
    arch, work = architecture(str(config.model.path), "model.path"), Workload.from_config(config, prompt_tokens)
    short = vllm_share_short(arch, work, vllm_bytes(arch, work, gpu.memory_gib))
    if short:
        raise ConfigError(f"rollout.engine=vllm does not start on the {gpu.name}: try {short}")


class DoesNotFit(ValueError):
    """One line: the phase, the GPU, the kind that takes the most, and the knob that shrinks it."""


def dry_run(config: Config, gpu: GpuProfile, *, prompt_tokens: int | None = None, decode_steps: int = 2,
            headroom: float = HEADROOM, world_size: int | None = None, ranks: list[int] | None = None,
            skip_repeats: bool = True, gpus_per_node: int = 8, host_memory_gib: float | None = None) -> dict[str, Any]:
    """The report of ``config``'s first step on ``gpu`` (see the module docstring); ``prompt_tokens``: the longest
    prompt the data holds (None: :data:`PROMPT_TOKENS`, or as many as the model's context leaves beside the budgets,
    where fewer: a tiny model's); ``skip_repeats``: run a training chunk of a shape already seen twice only in its FLOPs
    (the same report, sooner: ``DryRun._repeats_skipped``). ``model.backend=megatron``: ``ranks`` (default:
    :func:`.megatron.default_ranks`) of a world of ``world_size`` GPUs (default: one replica), each simulated apart;
    the report's phases are the fullest one's. ``host_memory_gib``: a node's host memory, which the processes of a
    node (``gpus_per_node`` at most) must fit in (``host_per_node``)."""
    context, where = model_context(config)
    if prompt_tokens is None:
        rollout = config.rollout
        prompt_tokens = max(1, min(PROMPT_TOKENS, context - rollout.max_thinking_tokens - 1 - rollout.max_answer_tokens))
    check_context(config, prompt_tokens, context, where)
    check_vllm_share(config, prompt_tokens, gpu)
    world_size = world_size or config.megatron.replica_size
    check_one_process(config, 1 if config.model.backend != "megatron" else world_size)
    separate = config.rollout.placement == "separate"
    config = copy.deepcopy(config)
    if separate:  # a training rank holds the same with rollouts sampled a step ahead: token ids, sent by the rollout ranks
        config.rollout.async_steps = 0
    usable = gpu.memory_gib * headroom
    report = {"gpu": asdict(gpu), "usable_gib": usable, "prompt_tokens": prompt_tokens, "decode_steps": decode_steps}
    if config.train.micro_batch_rows == "auto":  # as nemo-jq train resolves it on this GPU (whole groups: no Qwen3 size)
        config.train.micro_batch_rows = auto_micro_batch_rows(
            config, prompt_tokens, gpu.memory_gib, world_size, headroom)[0] \
            if config.model.path else None
        report["micro_batch_rows"] = config.train.micro_batch_rows
    if config.model.backend != "megatron":
        simulated = _simulate(config, gpu, prompt_tokens, decode_steps, None, skip_repeats)
        simulated["rank"] = ("the training process of model.backend=hf: it trains and asks the rollout ranks" if separate
                             else "the one process of model.backend=hf: it samples and trains")
        replicas, sent_dtype = 1, simulated.pop("sent_dtype")
        report = {**report, **simulated, "fits": simulated["peak_gib"] <= usable}
    else:
        from nemo_jq.dryrun import megatron

        layout = config.megatron
        layout.validate(world_size=world_size, processes_from="nemo-jq dryrun --gpus")  # before its ranks are named
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
    replica_of = None if config.model.backend != "megatron" else \
        (lambda rank: megatron.RankPlace.of(rank, config.megatron, report["world_size"]).data_parallel)
    report["decode"] = decode_work(report)
    report["run_time"] = whole_run(report, config)
    report["host"] = {**host_per_node(report, gpus_per_node, replica_of), "memory_gib": host_memory_gib}
    report["host"]["fits"] = host_memory_gib is None or report["host"]["gib"] <= host_memory_gib
    return report


def _simulate(config: Config, gpu: GpuProfile, prompt_tokens: int, decode_steps: int, place: Any,
              skip_repeats: bool, serves: tuple[int, torch.dtype | None] | None = None) -> dict[str, Any]:
    """One process's (or simulated rank's) phases: each one's peak by kind, FLOPs, time bound and simulation time, and
    the dtype of the weights it sent the rollout ranks (``sent_dtype``; None: it sent none). ``serves``: a rollout
    rank's, of that many replicas, taking in weights of that dtype (None: fp32)."""
    tracker = MemoryTracker(GPU.type)
    flops: dict[str, float] = {}
    with FakeWorld(tracker, decode_steps=decode_steps) as world, tempfile.TemporaryDirectory() as scratch:
        run = DryRun(config, world, Path(scratch), prompt_tokens, flops, gpu, place, skip_repeats)
        run.serve(*serves) if serves is not None else run.first_step()
        shape, wall = run.shape, run.wall
    phases = {name: {"peak_gib": gib(peak.peak), "by_kind_gib": {k: gib(v) for k, v in peak.by_kind.items() if v},
                     "most_by_kind_gib": {k: gib(v) for k, v in peak.most_by_kind.items() if v},
                     "host_peak_gib": gib(peak.host_peak),
                     "flops": flops.get(name, 0.0), "simulated_in_s": round(wall.get(name, 0.0), 1)}
              for name, peak in tracker.phases.items()}
    for name, phase in phases.items():
        phase["seconds_at_least"] = round(seconds_at_least(name, phase["flops"], shape, config, gpu), 3)
    worst = max(phases, key=lambda name: phases[name]["peak_gib"])
    host = max(phases, key=lambda name: phases[name]["host_peak_gib"])
    return {"shape": shape, "phases": phases, "peak_gib": phases[worst]["peak_gib"], "peak_phase": worst,
            "host_peak_gib": phases[host]["host_peak_gib"], "host_peak_phase": host, "sent_dtype": run.sent_dtype}


def host_per_node(report: dict[str, Any], gpus_per_node: int, data_parallel_rank: Callable[[int], int] | None = None
                  ) -> dict[str, Any]:
    """The host memory the first node needs: its processes (one a GPU: the world's, or one for model.backend=hf),
    each at the fullest simulated process's host peak (a rollout rank's too); under data parallelism
    (``data_parallel_rank`` of a global rank) the ranks of the other replicas at that process's peak outside the save,
    the one phase where the writing
    replica's ranks hold more (they gather the optimizer's state and stage what they write). A bound where a node's
    processes differ otherwise."""
    training = list(report.get("ranks", {}).values()) or [report]  # the hf backend's one training process: the report
    simulated = [*training, *([report["rollout_rank"]] if "rollout_rank" in report else [])]
    fullest = max(simulated, key=lambda part: part["host_peak_gib"])
    processes = min(gpus_per_node, report.get("world_size", 1) + (1 if "rollout_rank" in report else 0))
    writing = processes if data_parallel_rank is None else sum(data_parallel_rank(rank) == 0 for rank in range(processes))
    outside_save = max(phase["host_peak_gib"] for name, phase in fullest["phases"].items() if name != "save")
    total = writing * fullest["host_peak_gib"] + (processes - writing) * outside_save
    return {"processes": processes, "per_process_gib": fullest["host_peak_gib"], "phase": fullest["host_peak_phase"],
            "writing_replica_processes": writing, "outside_save_gib": outside_save, "gib": round(total, 6)}



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
    moved["run_time"] = whole_run(moved, config)
    return moved


def whole_run(report: dict[str, Any], config: Config) -> dict[str, Any] | None:
    """:func:`.bounds.run_time` of the report's run: the fullest rank's phases (a rollout rank's sampling, with rollout
    ranks of their own), over the world's GPUs."""
    phases = dict(report["phases"])
    serving = report.get("rollout_rank")
    if serving:
        phases.update({name: serving["phases"][name] for name in ("rollout", "evaluate") if name in serving["phases"]})
    world = report.get("world_size", 1)
    replicas = config.megatron.data_parallel(world) if config.model.backend == "megatron" else 1
    return run_time(phases, config, world + (config.rollout.ranks if serving else 0), replicas)


def check_fits(report: dict[str, Any], config: Config) -> None:
    """Raise :class:`DoesNotFit` naming the worst phase's largest kind and the setting of ``config`` that shrinks it
    (:func:`knob`), when the peak is over; or the host's phase, when a node's processes need more host memory than it
    has."""
    host = report.get("host", {})
    if report["fits"] and not host.get("fits", True):
        raise DoesNotFit(f"phase {host['phase']} needs {host['gib']:.1f} GiB of host memory on a node ({host_sum(host, 1)}), "
                         f"more than --host-memory {host['memory_gib']:g}: fewer "
                         "processes a node (--gpus-per-node), or a node with more memory")
    if report["fits"]:
        return
    serving = report.get("rollout_rank")
    where = serving if serving and not serving["fits"] else report
    phase = where["phases"][where["peak_phase"]]
    kind = max(phase["by_kind_gib"], key=phase["by_kind_gib"].get)
    raise DoesNotFit(f"phase {where['peak_phase']}{' of a rollout rank' if where is serving else ''} needs "
                     f"{phase['peak_gib']:.1f} GiB of the {report['usable_gib']:.4g} usable on {report['gpu']['name']}, "
                     f"{phase['by_kind_gib'][kind]:.1f} GiB of it {kind.replace('_', ' ')}: try "
                     f"{knob(kind, config, rollout_rank=where is serving)}")
