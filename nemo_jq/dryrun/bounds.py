"""The dry run's GPUs and the least time a phase can take on one: its FLOPs at the GPU's peak, a decode step's bytes
at its bandwidth (:func:`seconds_at_least`), counted by :func:`total_flops_counter`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from nemo_jq.config import Config
from nemo_jq.dryrun.memory import GiB


@dataclass(frozen=True)
class GpuProfile:
    """What the report holds a run against: memory, and the peaks that bound its time."""

    name: str
    memory_gib: float
    bf16_flops: float  # dense bf16 FLOP/s
    bandwidth: float  # memory bytes/s
    #: The most sequences vLLM runs at once on it by default (its ``max_num_seqs`` for the ``LLM`` class: 1024 on
    #: GPUs of 70 GiB or more but the A100, 256 on others; vllm/engine/arg_utils.py, 0.32).
    vllm_max_sequences: int = 256


#: The GPUs the shipped configs are checked against (dense bf16, no sparsity; SXM parts).
GPUS = {
    "a100-80gb": GpuProfile("A100 80GB", 80.0, 312e12, 2.0e12, vllm_max_sequences=256),
    "h100-80gb": GpuProfile("H100 80GB", 80.0, 989e12, 3.35e12, vllm_max_sequences=1024),
}


def gpu_profile(name: str) -> GpuProfile:
    """:data:`GPUS`' profile called ``name`` (``--gpu``), or a one-line error naming the choices."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[name]


def seconds_at_least(phase: str, flops: float, shape: dict[str, Any], config: Config, gpu: GpuProfile) -> float:
    """A lower bound on the phase's time in the run on ``gpu``. Training: the FLOPs counted on one micro-batch, times
    the replica's micro-batches (its share of the batch), at the bf16 peak, stretched by the pipeline's fill and
    drain (:func:`pipeline_stretch`). Sampling (the step's rollouts; an evaluation of the validation
    split): every decode step of every chunk reads the sampler's weights as it holds them and the keys and values so
    far, at the memory bandwidth (or its 2 FLOPs a parameter a token at the peak, where that is more), each GPU of an
    engine its share (:func:`sampling_seconds`); the dry run
    itself ran only a few of those steps, of the prompts this rank's engine decodes or waits for (its replica's share
    over the replica's engines: the shape's ``rollout_prompts`` and ``evaluate_prompts``). Other phases: their FLOPs at
    the peak."""
    seconds = flops / gpu.bf16_flops
    if phase == "train":
        stages = config.megatron.pipeline_parallel if config.model.backend == "megatron" else 1
        stretch = pipeline_stretch(stages, shape["replica_prompts"], shape["micro_batch_prompts"],
                                   config.rollout.num_samples, config.train.micro_batch_rows)
        return seconds * math.ceil(shape["replica_prompts"] / shape["micro_batch_prompts"]) * stretch
    if phase == "rollout":
        return sampling_seconds(shape, config, gpu, shape["rollout_prompts"], config.rollout.num_samples,
                                answers=shape["sampled_answers"])
    if phase == "evaluate":
        return shape["evaluate_calls"] * sampling_seconds(shape, config, gpu, shape["evaluate_prompts"],
                                                          config.eval.num_samples, answers=True)
    return seconds


def pipeline_stretch(stages: int, replica_prompts: int, prompts_per_micro_batch: int, samples: int,
                     rows_per_chunk: int | None) -> float:
    """How much longer a training pass takes than its busiest stage's work under megatron-core's 1F1B schedule
    (no interleaving): (m + P - 1) / m for m micro-batches through P stages, as the pipeline fills and drains. m is
    a step's row chunks (``train.micro_batch_rows``: both passes, each one run of the schedule) or else its
    micro-batches of whole groups."""
    group_rows = prompts_per_micro_batch * samples
    if rows_per_chunk is not None and rows_per_chunk < group_rows:
        runs = math.ceil(replica_prompts * samples / rows_per_chunk)
    else:
        runs = math.ceil(replica_prompts / prompts_per_micro_batch)
    return (runs + stages - 1) / runs


def sampling_seconds(shape: dict[str, Any], config: Config, gpu: GpuProfile, prompts: int, samples: int, *,
                     answers: bool) -> float:
    """The bound of :func:`seconds_at_least` for one sampling call of ``prompts`` x ``samples`` rows: the thinking
    phase, then (``answers``) the answer phase, each in chunks of the rows the engine runs at once
    (:func:`rows_at_once`); on each of the engine's GPUs (``plan.decode_shape``): its share of the weights a decode
    step reads (a Qwen3-MoE's experts that the step's rows route to, routing balanced), of the keys and values, and
    of the FLOPs."""
    rollout = config.rollout
    gpus, weights = shape["engine_gpus"], shape["sampler_weight_bytes"]
    per_token = shape["kv_bytes_per_token"] / shape["kv_shards"]
    experts = weights * shape["expert_parameters"] / shape["parameters"]

    def phase(rows: int, context: int, steps: int, rows_per_chunk: int) -> float:
        chunks, total = math.ceil(rows / rows_per_chunk), 0.0
        for chunk in range(chunks):
            r = min(rows_per_chunk, rows - chunk * rows_per_chunk)
            step_weights = (weights - experts * (1 - shape["expert_share"]) ** r) / gpus  # experts no row routes to
            kv = r * per_token * (steps * context + steps * (steps + 1) / 2)
            flops = 2 * shape["active_parameters"] / gpus * r * (context + steps)
            total += max((steps * step_weights + kv) / gpu.bandwidth, flops / gpu.bf16_flops)
        return total

    prompt, thinking = shape["prompt_tokens"], rollout.max_thinking_tokens
    rows = prompts * samples
    seconds = phase(rows, prompt, thinking, rows_at_once(shape, config, gpu, rows, samples, prompt + thinking))
    if answers:
        context = prompt + thinking + 1
        seconds += phase(rows, context, rollout.max_answer_tokens,
                         rows_at_once(shape, config, gpu, rows, 1, context + rollout.max_answer_tokens))
    return seconds


def rows_at_once(shape: dict[str, Any], config: Config, gpu: GpuProfile, rows: int, group: int, tokens: int) -> int:
    """How many of ``rows`` rows of up to ``tokens`` tokens an engine decodes at once. native and hf: as many whole
    groups of ``group`` rows as ``rollout.kv_cache_tokens`` holds (at least one). vLLM (which never reads that key):
    as many rows as its KV cache holds whole (its share of the GPU, or ``rollout.vllm_kv_cache_gb``, less its
    weights; its working memory not counted, so a bound), at most its ``max_num_seqs``
    (:attr:`GpuProfile.vllm_max_sequences`); its cache pages fill as rows grow, so early steps may run more."""
    rollout = config.rollout
    if rollout.engine == "vllm":
        weights = shape["sampler_weight_bytes"] / shape["engine_gpus"]
        cache = (rollout.vllm_kv_cache_gb * GiB if rollout.vllm_kv_cache_gb is not None
                 else rollout.vllm_memory_utilization * gpu.memory_gib * GiB - weights)
        held = int(cache * shape["kv_shards"] / shape["kv_bytes_per_token"]) // tokens
        return max(1, min(rows, gpu.vllm_max_sequences, held))
    if rollout.kv_cache_tokens is None:
        return rows
    return min(rows, group * max(1, rollout.kv_cache_tokens // (group * tokens)))


#: The share of a phase's bound this project measured on a real GPU (bench/results/real_gpu.json, run 9: an H200), by
#: phase and setting: (fraction, what was measured). A setting without one is "not measured" (vLLM, which no lent GPU
#: had; the Megatron backend's training, whose step was timed but not against its FLOPs; the hf engine's decode).
MEASURED = {
    ("rollout", "native"): (0.4217, "the native engine's compiled CUDA-graph decode, the paper's chunk (32 rows) at a "
                                    "3072-token context, of its bandwidth bound"),
    ("rollout", "native, uncompiled"): (0.3052, "the native engine's CUDA-graph decode, uncompiled (rollout.compile="
                                                "false), the same chunk, of its bandwidth bound"),
    ("rollout", "native, eager"): (0.0864, "the native engine's eager decode (rollout.cuda_graphs=false), the same "
                                           "chunk, of its bandwidth bound"),
    ("train", "hf"): (0.1709, "the hf backend's training, 8 rows of 5248 tokens a micro-batch, model FLOPs over the "
                              "bf16 peak"),
    ("train", "hf, compiled"): (0.2836, "the same with model.compile=true"),
}
#: Phases whose bound the evaluation's sampling shares.
SAMPLING_PHASES = ("rollout", "evaluate")


def measured_fraction(phase: str, config: Config) -> tuple[float, str] | None:
    """:data:`MEASURED`'s entry for ``phase`` under ``config`` (evaluation samples as the rollouts do), or None."""
    rollout, model = config.rollout, config.model
    if phase in SAMPLING_PHASES and rollout.engine == "native":
        setting = "native" if rollout.cuda_graphs and rollout.compile else \
            "native, uncompiled" if rollout.cuda_graphs else "native, eager"
        return MEASURED[("rollout", setting)]
    if phase == "train" and model.backend == "hf":
        return MEASURED[("train", "hf, compiled" if model.compile else "hf")]
    return None


def run_time(phases: dict[str, dict[str, Any]], config: Config, gpus: int, replicas: int) -> dict[str, Any] | None:
    """A whole run's time from its phases' bounds (``seconds_at_least``): its steps over ``replicas`` (rollouts,
    training, the optimizer step), its validations and the test split's evaluation; at least (the bounds) and
    expected (each sampling and training bound over its :func:`measured_fraction`; None, with what is not measured,
    where one is missing), in hours and GPU-hours over ``gpus``. None where the config leaves its steps to the data's
    size."""
    from nemo_jq.runtime.sweep import steps_of

    steps = steps_of(config, replicas)
    if steps is None:
        return None
    every, data = config.eval.every, config.data
    validations = steps // every + (steps % every != 0)
    evaluations = validations + data.test_size / data.validation_size  # in validations' worth
    counts = {"rollout": steps, "train": steps, "optimizer_step": steps, "evaluate": evaluations}
    least = {phase: phases[phase]["seconds_at_least"] * count for phase, count in counts.items() if phase in phases}
    fractions = {phase: measured_fraction(phase, config) for phase in least}
    missing, expected = [], {}
    for phase, seconds in least.items():
        fraction = fractions[phase]
        if fraction is None and phase != "optimizer_step":  # a memory-bound sweep over the state: its bound stands
            missing.append(phase)
        expected[phase] = seconds / fraction[0] if fraction else seconds
    hours = sum(least.values()) / 3600
    result = {"steps": steps, "validations": validations, "evaluations": round(evaluations, 2), "gpus": gpus,
              "hours_at_least": round(hours, 1),
              "gpu_hours_at_least": round(hours * gpus, 1),
              "fractions": fractions, "not_measured": missing}
    if not missing:
        expected_hours = sum(expected.values()) / 3600
        result.update(hours_expected=round(expected_hours, 1), gpu_hours_expected=round(expected_hours * gpus, 1))
    return result


class NoModules:
    """``FlopCounterMode``'s module tracker, tracking none: ``ModuleTracker`` hooks every module's inputs and outputs
    into autograd, and those hooks keep activation checkpointing's recomputed tensors alive past their use (on a GPU
    nothing holds them, and the dry run would count them). Only the total is read."""

    parents = {"Global"}

    def __enter__(self) -> "NoModules":
        return self

    def __exit__(self, *exc) -> None:
        return None


def total_flops_counter() -> FlopCounterMode:
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = NoModules()
    return counter
