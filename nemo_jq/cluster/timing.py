"""How long a run takes at a layout, from shapes: ``nemo-jq plan``'s time and cost.

Each phase's least time on one GPU is the dry run's bound (:mod:`nemo_jq.dryrun.bounds`) with the dry run's counts
replaced by formulas: a step's rollouts and an evaluation call decode the prompts a rank's engine gets (its replica's
share of the batch, over the replica's engines; a rollout rank of its own serves its replicas in turn) in
:func:`~nemo_jq.dryrun.bounds.sampling_seconds`, the same function the dry run calls, with the same shape; training
is :func:`train_flops` of the replica's micro-batches on its busiest rank at the bf16 peak, stretched by the pipeline's
fill and drain (:func:`~nemo_jq.dryrun.bounds.pipeline_stretch`).
The expected time divides each bound by the share of it the project measured on a real GPU for that phase and engine
(:data:`~nemo_jq.dryrun.bounds.MEASURED`), through :func:`~nemo_jq.dryrun.bounds.run_time`, the dry run's own sum:
steps x (rollouts + training) + validations and the test split's evaluation, in hours and GPU-hours.
"""

from __future__ import annotations

import math
from typing import Any

from nemo_jq.cluster import plan
from nemo_jq.config import Config
from nemo_jq.dryrun.bounds import GpuProfile, pipeline_stretch, run_time, sampling_seconds
from nemo_jq.models.megatron.provider import Qwen3Architecture


def train_flops(arch: Qwen3Architecture, work: plan.Workload, rows: int, two_pass: bool, tp: int = 1, pp: int = 1) -> float:
    """The FLOPs of training ``rows`` rows of ``work.seq_len`` tokens as torch's ``FlopCounterMode`` counts them (the
    dry run's count: matrix products, attention over the whole square whatever its mask), on the busiest rank of a
    TP x PP x CP layout: the last pipeline stage, its share of the layers and of the head's vocabulary. A
    forward: the layers' projections, attention, and the log-prob head over every target position; the backward:
    twice a forward's products and 2.5 times its attention. ``two_pass`` (``train.micro_batch_rows`` below a
    micro-batch's rows) adds the no-grad forward that scores the rows first; recomputation (``work.recompute``) runs
    the layers' forward again in the backward; the head's chunks always project again in the backward. The dry run
    counts a little less: 1-3% at the shipped configs' shapes (tests/unit/cluster/test_timing.py holds it within 3%).
    A Qwen3-MoE's layers have its router and k of its experts where the MLP was, split over TP as the projections are:
    under sequence parallelism each TP rank routes its own part of the tokens, and runs k experts for each of those
    its EP group routed to its experts (balanced routing), whatever EP."""
    tokens, q = work.seq_len, arch.num_attention_heads * arch.head_dim
    kv, h = arch.num_key_value_heads * arch.head_dim, arch.hidden_size
    mlp = (h * arch.num_experts + arch.num_experts_per_tok * 3 * h * arch.moe_intermediate_size if arch.is_moe
           else 3 * h * arch.intermediate_size)
    layers = 2 * arch.num_layers * tokens * (h * (2 * q + 2 * kv) + mlp)
    attention = 4 * arch.num_layers * q * tokens * tokens
    head = 2 * h * arch.vocab_size * (tokens - 1)
    forwards = 1 + two_pass
    layer_passes = (forwards + work.recompute) * (layers + attention) + 2 * layers + 2.5 * attention
    cp = work.context_parallel
    return rows * (layer_passes / (tp * pp * cp) + (forwards + 1 + 2) * head / (tp * cp))


def phase_bounds(arch: Qwen3Architecture, work: plan.Workload, config: Config, gpu: GpuProfile,
                 layout: tuple[int, int, int]) -> dict[str, dict[str, float]]:
    """The least seconds of a step's rollouts, its training and an evaluation (all its calls) on the layout's busiest
    GPU, as :func:`~nemo_jq.dryrun.bounds.seconds_at_least` gives them (its ``phases`` form, for ``run_time``)."""
    from nemo_jq.objectives import Need, get_objective

    tp, pp, dp = layout
    train, rollout = config.train, config.rollout
    replica_prompts = math.ceil(train.batch_size / dp)
    validation = math.ceil(config.data.validation_size / dp)
    shares = {"rollout": replica_prompts, "evaluate": min(config.eval.batch_size, validation)}
    if work.rollout_ranks:  # the busiest rollout engine (of rollout.tensor_parallel ranks) serves its replicas in turn
        engines = work.rollout_ranks // work.engine_gpus
        decoded = {phase: math.ceil(dp / engines) * prompts for phase, prompts in shares.items()}
    else:
        engines = plan.decode_engines(work, tp, pp)
        decoded = {phase: math.ceil(prompts / engines) for phase, prompts in shares.items()}
    parameters = plan.parameter_count(arch)
    shape = {"parameters": parameters, "prompt_tokens": work.seq_len - rollout.max_thinking_tokens - 1
             - rollout.max_answer_tokens, "sampler_weight_bytes": 2 * parameters,
             **plan.decode_shape(arch, work.engine_gpus)}
    answers = Need.SAMPLED_ANSWER_REWARD in get_objective(config.objective.name).needs
    group_rows = train.micro_batch_size * rollout.num_samples
    micro_batches = math.ceil(replica_prompts / train.micro_batch_size)
    flops = train_flops(arch, work, group_rows, work.micro_batch < group_rows, tp, pp) * micro_batches
    stretch = pipeline_stretch(pp, replica_prompts, train.micro_batch_size, rollout.num_samples, work.micro_batch)
    calls = math.ceil(validation / config.eval.batch_size)
    return {
        "rollout": {"seconds_at_least": sampling_seconds(shape, config, gpu, decoded["rollout"], rollout.num_samples,
                                                         answers=answers)},
        "train": {"seconds_at_least": flops * stretch / gpu.bf16_flops},
        "evaluate": {"seconds_at_least": calls * sampling_seconds(shape, config, gpu, decoded["evaluate"],
                                                                  config.eval.num_samples, answers=True)},
    }


def layout_time(arch: Qwen3Architecture, work: plan.Workload, config: Config, gpu: GpuProfile,
                layout: tuple[int, int, int]) -> dict[str, Any]:
    """A layout's phases (seconds at least) and its whole run (:func:`~nemo_jq.dryrun.bounds.run_time` over its GPUs,
    rollout ranks included)."""
    phases = phase_bounds(arch, work, config, gpu, layout)
    tp, pp, dp = layout
    gpus = tp * pp * dp * work.context_parallel + work.rollout_ranks
    return {"layout": list(layout), "phases": {name: round(phase["seconds_at_least"], 3) for name, phase in phases.items()},
            "run": run_time(phases, config, gpus, dp)}


def across_nodes(arch: Qwen3Architecture, work: plan.Workload, config: Config, gpu: GpuProfile, *,
                 gpus_per_node: int, nodes: int, gpu_gb: float) -> list[dict[str, Any]]:
    """The recommended layout's run at 1, 2, 4 ... nodes up to twice ``nodes`` (the hf backend: one GPU whatever
    the nodes, so none): the node counts where a layout fits."""
    if work.backend == "hf":
        return []
    counts = sorted({1, nodes, 2 * nodes} | {2 ** k for k in range(1, 8) if 2 ** k < 2 * nodes})
    rows = []
    for count in counts:
        try:
            layouts = plan.plan(arch, work, gpus_per_node=gpus_per_node, nodes=count, gpu_gb=gpu_gb)
        except ValueError:  # no layout divides this world
            continue
        best = layouts[0]
        if best.fits:
            layout = (best.tensor_parallel, best.pipeline_parallel, best.data_parallel)
            rows.append({"nodes": count, **layout_time(arch, work, config, gpu, layout)})
    return rows


def hours(run: dict[str, Any]) -> tuple[float, float, bool]:
    """A run's hours and GPU-hours: expected where every phase's fraction is measured (True), else at least."""
    if "hours_expected" in run:
        return run["hours_expected"], run["gpu_hours_expected"], True
    return run["hours_at_least"], run["gpu_hours_at_least"], False


def format_time(timed: dict[str, Any], gpu: GpuProfile) -> list[str]:
    """``plan``'s time lines: the layout's phases, the whole run (the dry run's line) and the node counts."""
    from nemo_jq.dryrun.report import format_run_time

    shown, run = timed["layout"], timed["layout"]["run"]
    tp, pp, dp = shown["layout"]
    phases = shown["phases"]
    fractions = run["fractions"] if run else {}

    def phase(name: str, what: str) -> str:
        entry = fractions.get(name)
        expected = f" -> {phases[name] / entry[0]:.1f} s expected" if entry else " (expected: not measured)"
        return f"{what} >= {phases[name]:.1f} s{expected}"

    lines = [f"time on {gpu.name} ({gpu.bf16_flops / 1e12:.0f} bf16 TFLOP/s, {gpu.bandwidth / 1e12:.2f} TB/s; --gpu) at "
             f"TP={tp} PP={pp} DP={dp}: " + "; ".join([phase("rollout", "a step's rollouts"), phase("train", "training"),
                                                      phase("evaluate", "an evaluation")])]
    if run:
        lines.append(format_run_time(run, gpu.name))
    else:
        lines.append("the run's length: the config leaves its steps to the data's size (set data.train_size or "
                     "train.max_steps)")
    if len(timed["nodes"]) > 1 and run:
        parts = []
        for row in timed["nodes"]:
            hour, gpu_hours, expected = hours(row["run"])
            parts.append(f"{row['nodes']} node{'s' * (row['nodes'] > 1)}: {hour:.1f} h ({gpu_hours:.0f} GPU-hours)")
        which = "expected" if all(hours(row["run"])[2] for row in timed["nodes"]) else "at least"
        lines.append(f"across nodes ({which}, each at its recommended layout): " + ", ".join(parts))
    return lines


def plan_time(arch: Qwen3Architecture, work: plan.Workload, config: Config, gpu: GpuProfile,
              layouts: list[plan.LayoutEstimate], *, gpus_per_node: int, nodes: int, gpu_gb: float) -> dict[str, Any]:
    """``plan``'s time: every layout's phases and run (the first, recommended or closest, is ``layout``), and the
    run across node counts."""
    timed = [layout_time(arch, work, config, gpu, (layout.tensor_parallel, layout.pipeline_parallel,
                                                     layout.data_parallel)) for layout in layouts]
    return {"gpu": gpu.name, "layout": timed[0], "layouts": timed,
            "nodes": across_nodes(arch, work, config, gpu, gpus_per_node=gpus_per_node, nodes=nodes, gpu_gb=gpu_gb)}
