"""``nemo-jq plan``'s time (nemo_jq/cluster/timing.py) against the dry run's bounds, phase by phase, and the run's
hours at the fractions measured on a real GPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from helpers import one_line_error, run_cli, small_qwen3
from nemo_jq.cluster import plan, timing
from nemo_jq.config import load_config
from nemo_jq.dryrun import GPUS, dry_run
from nemo_jq.dryrun.bounds import MEASURED, GpuProfile, pipeline_stretch

ROOT = Path(__file__).resolve().parents[3]
#: How far plan's counted training FLOPs may stray from the dry run's (1-3% at the shipped configs' shapes).
TRAIN_TOLERANCE = 0.03


#: A GPU slow enough that the small model's bounds are seconds (the report rounds them to milliseconds).
SLOW = GpuProfile("a slow 80 GB GPU", 80.0, 1e9, 1e6)


def planned_phases(config, prompt_tokens, gpu, layout=(1, 1, 1)):
    work = plan.Workload.from_config(config, prompt_tokens)
    phases = timing.phase_bounds(plan.architecture(str(config.model.path)), work, config, gpu, layout)
    return {name: phase["seconds_at_least"] for name, phase in phases.items()}


def assert_agree(planned, report):
    dry = {name: report["phases"][name]["seconds_at_least"] for name in planned}
    assert planned["rollout"] == pytest.approx(dry["rollout"], abs=2e-3) and dry["rollout"] > 0, (planned, dry)
    assert planned["evaluate"] == pytest.approx(dry["evaluate"], abs=2e-3) and dry["evaluate"] > 0, (planned, dry)
    assert planned["train"] == pytest.approx(dry["train"], rel=TRAIN_TOLERANCE), (planned, dry)


@pytest.mark.parametrize("overrides", [[], ["train.micro_batch_rows=4", "model.activation_checkpointing=true"],
                                       ["objective.name=grpo", "rollout.max_answer_tokens=6"]],
                         ids=["one_pass", "two_passes_recomputed", "grpo_samples_answers"])
def test_plans_phase_bounds_are_the_dry_runs(tmp_path, overrides):
    """The sampling bounds equal (the same function on the same shape); training's FLOPs, counted from the shapes,
    within 3% of the dry run's ``FlopCounterMode`` (one pass, two passes with recomputation; sampled answers)."""
    model = small_qwen3(tmp_path / "model", layers=2, tied=False)
    config = load_config(None, [f"model.path={model}", "rollout.num_samples=8", "rollout.max_thinking_tokens=48",
                                "rollout.max_answer_tokens=8", "train.batch_size=4", "train.micro_batch_size=2",
                                "eval.batch_size=4", "eval.num_samples=8", "data.validation_size=12", *overrides])
    assert_agree(planned_phases(config, 32, SLOW), dry_run(config, SLOW, prompt_tokens=32))


def test_the_training_count_misses_a_pass_left_out():
    """Each pass counts: without the scoring pass (or recomputation) the count falls far outside the tolerance."""
    config = load_config(ROOT / "configs" / "qwen3_0p6b" / "finqa_cold_garl_q0.25.yaml")
    arch, work = plan.architecture(config.model.path), plan.Workload.from_config(config, 1024)
    full = timing.train_flops(arch, work, 64, True)
    assert timing.train_flops(arch, work, 64, False) < full * (1 - 3 * TRAIN_TOLERANCE)
    assert timing.train_flops(arch, dataclasses.replace(work, recompute=False), 64, True) < full * (1 - 3 * TRAIN_TOLERANCE)


def test_a_decode_bound_splits_over_an_engines_gpus_and_reads_the_experts_its_rows_route_to():
    """Each GPU of a tensor-parallel engine reads its share of the weights and of the keys and values (vLLM replicates
    KV heads past their count); a Qwen3-MoE's decode step runs k of E experts a token and reads only the experts its
    rows route to: one row, its k of every layer's E; many rows, nearly all."""
    from nemo_jq.dryrun.bounds import sampling_seconds

    config = load_config(ROOT / "configs" / "examples" / "qwen3_30b_a3b_hotpotqa_cold_garl_q0.75.yaml")
    arch, gpu = plan.architecture(config.model.path), GPUS["h100-80gb"]
    parameters = plan.parameter_count(arch)

    def step(engine_gpus, rows):  # one decode step of ``rows`` rows
        shape = {"parameters": parameters, "prompt_tokens": 0, "sampler_weight_bytes": 2 * parameters,
                 **plan.decode_shape(arch, engine_gpus)}
        one_step = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, max_thinking_tokens=1,
                                                                           vllm_kv_cache_gb=20.0))  # every row at once
        return sampling_seconds(shape, one_step, gpu, rows, 1, answers=False)

    experts = plan.expert_parameters(arch)
    routed = (parameters - experts + experts * arch.num_experts_per_tok / arch.num_experts) * 2 / gpu.bandwidth
    assert step(1, 1) == pytest.approx(routed, rel=1e-3)
    assert step(1, 512) == pytest.approx(2 * parameters / gpu.bandwidth, rel=1e-3)
    assert step(2, 512) == pytest.approx(step(1, 512) / 2, rel=1e-6)
    assert [plan.decode_shape(arch, gpus)["kv_shards"] for gpus in (1, 2, 4, 8)] == [1, 2, 4, 4]  # 4 KV heads
    assert plan.decode_shape(arch, 1)["active_parameters"] < parameters / 8  # 30B-A3B: ~3.3B a token


@pytest.mark.slow
def test_plans_time_for_the_06b_paper_config_is_the_dry_runs_bounds_over_the_stated_fractions(capsys):
    """The 0.6B config at its real size (the dry run: ~25 s): plan's phases are the dry run's bounds, its run's
    expected hours the bounds over MEASURED's fractions (native decode, hf training), the same sum the dry run gives."""
    path = ROOT / "configs" / "qwen3_0p6b" / "hotpotqa_cold_garl_q0.25.yaml"
    config = load_config(path)
    report = dry_run(config, GPUS["h100-80gb"], prompt_tokens=1024)
    code, out, _ = run_cli(capsys, "plan", "--config", path, "--gpus-per-node", "1", "--json")
    timed = json.loads(out)["time"]["layout"]
    assert code == 0 and timed["layout"] == [1, 1, 1]
    assert_agree(timed["phases"], report)
    decode, train = MEASURED[("rollout", "native")][0], MEASURED[("train", "hf")][0]
    run, dry_run_time = timed["run"], report["run_time"]
    assert (run["steps"], run["evaluations"]) == (dry_run_time["steps"], dry_run_time["evaluations"])
    phases = timed["phases"]
    expected = run["steps"] * (phases["rollout"] / decode + phases["train"] / train) \
        + run["evaluations"] * phases["evaluate"] / decode
    assert run["hours_expected"] == pytest.approx(expected / 3600, abs=0.06)
    assert run["hours_expected"] == pytest.approx(dry_run_time["hours_expected"], rel=0.02)
    assert run["hours_at_least"] == pytest.approx(dry_run_time["hours_at_least"], rel=0.02)


def test_plan_prints_each_layouts_hours_the_phases_and_the_run_across_node_counts(capsys):
    code, out, _ = run_cli(capsys, "plan", "--config", ROOT / "configs" / "qwen3_8b" / "finqa_cold_garl_q0.75.yaml")
    lines = out.splitlines()
    # 2 epochs of 6,145 prompts: 96 batches of 64 over DP >= 2, the 97th's one prompt skipped (194 by one replica)
    assert next(line for line in lines if line.startswith("the run: ")).startswith("the run: 192 steps")
    assert code == 0 and lines[1].split()[-2:] == ["least", "h"]  # vLLM's decode is not measured: at least
    time_line = next(line for line in lines if line.startswith("time on H100 80GB"))
    assert "a step's rollouts >= " in time_line and "(expected: not measured)" in time_line
    nodes = next(line for line in lines if line.startswith("across nodes (at least"))
    one, two = (float(part.split(": ")[1].split(" h")[0]) for part in nodes.split(": ", 1)[1].split(", "))
    assert "1 node: " in nodes and "2 nodes: " in nodes and 0.45 * one <= two < 0.55 * one  # twice the GPUs, about half the time
    assert lines[-1].startswith("assumptions:")
    code, out, _ = run_cli(capsys, "plan", "--config", ROOT / "configs" / "qwen3_0p6b" / "finqa_cold_garl_q0.25.yaml",
                           "--gpu", "a100-80gb")
    assert "expected" in out.splitlines()[1] and "time on A100 80GB" in out and "across nodes" not in out
    code, out, _ = run_cli(capsys, "plan", "--model", "8b")
    assert "time: give --config" in out
    code, _, err = run_cli(capsys, "plan", "--config", ROOT / "configs" / "qwen3_0p6b" / "finqa_cold_garl_q0.25.yaml",
                           "--gpu", "b200")
    one_line_error(code, err, "--gpu 'b200': choose one of a100-80gb, h100-80gb")


def test_vllms_decode_runs_the_rows_its_cache_holds_and_never_reads_kv_cache_tokens():
    """vLLM sizes its batch by its own cache (its share less its weights, or rollout.vllm_kv_cache_gb) and its
    max_num_seqs (A100 256, H100 1024), not by rollout.kv_cache_tokens, which bounds the native and hf samplers'
    chunks of whole groups."""
    from nemo_jq.dryrun.bounds import rows_at_once

    config = load_config(ROOT / "configs" / "qwen3_8b" / "finqa_cold_grpo.yaml")
    arch, h100, a100 = plan.architecture(config.model.path), GPUS["h100-80gb"], GPUS["a100-80gb"]
    parameters = plan.parameter_count(arch)
    shape = {"parameters": parameters, "sampler_weight_bytes": 2 * parameters, **plan.decode_shape(arch, 1)}

    def rows(gpu=h100, tokens=5120, **rollout):
        changed = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, **rollout))
        return rows_at_once(shape, changed, gpu, 4096, 16, tokens)

    held = int((0.5 * 80 * 2**30 - 2 * parameters) / plan.kv_bytes_per_token(arch)) // 5120
    assert config.rollout.engine == "vllm" and 16 < held < 256
    assert rows() == rows(kv_cache_tokens=5120) == rows(kv_cache_tokens=None) == held
    assert rows(tokens=64) == 1024 and rows(a100, tokens=64) == 256  # vLLM's max_num_seqs
    assert rows(vllm_memory_utilization=0.15) == 1  # no room beside its weights: a row at a time (plan refuses it)
    assert rows(vllm_kv_cache_gb=1.0) == 2**30 // plan.kv_bytes_per_token(arch) // 5120
    assert rows(engine="native") == 16 * (131072 // (16 * 5120)) and rows(engine="native", kv_cache_tokens=1) == 16
    assert rows(engine="native", kv_cache_tokens=None) == 4096


def test_a_pipelines_fill_and_drain_take_its_stages_less_one_more_micro_batch_times():
    """megatron-core's 1F1B schedule: m micro-batches through P stages take m + P - 1 of a stage's micro-batch
    times. One micro-batch a step passes the 4 stages in turn (4 times); 8 take 11, not 32; at PP=1 there is nothing
    to fill. In chunks of rows (two passes) each pass is one run of the schedule over the step's chunks."""
    config = load_config(ROOT / "configs" / "qwen3_8b" / "finqa_cold_garl_q0.75.yaml", ["train.micro_batch_rows=null"])
    arch = plan.architecture(str(config.model.path))

    def train(layout, prompts, rows=None):
        changed = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=prompts,
                                                                         micro_batch_rows=rows))
        work = plan.Workload.from_config(changed, 1024)
        return timing.phase_bounds(arch, work, changed, GPUS["h100-80gb"], layout)["train"]["seconds_at_least"]

    assert train((1, 4, 2), 16) == pytest.approx(train((1, 4, 2), 2) * 11 / 4)
    assert train((1, 1, 8), 64) == pytest.approx(train((1, 1, 8), 8) * 8)
    assert train((2, 2, 2), 64, 4) == pytest.approx(train((2, 2, 2), 2, 4) * 32 * (128 + 1) / 128 / ((4 + 1) / 4))
    assert pipeline_stretch(2, 32, 1, 16, 4) == (128 + 1) / 128 and pipeline_stretch(4, 8, 1, 16, None) == 11 / 8
