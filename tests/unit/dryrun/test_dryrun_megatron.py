"""nemo-jq dryrun on the Megatron backend: one rank of a TP x PP x DP world at a time, in this process, on torch's
fake process group (no peers: nemo_jq/dryrun/megatron.py), its memory held against ``nemo-jq plan``'s estimate of
the same layout. megatron-core's real GPTModel and the project's MegatronPolicy run; the GPU is the dry run's
stand-in (``meta``), as in tests/unit/dryrun/test_dryrun.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import small_qwen3
from nemo_jq.cli import main
from nemo_jq.config import load_config
from nemo_jq.dryrun import GPUS, dry_run
from nemo_jq.dryrun.report import against_plan
from nemo_jq.models.megatron import zero

LAYOUT = ["model.backend=megatron", "megatron.tensor_parallel=2", "megatron.pipeline_parallel=2",
          "megatron.sequence_parallel=true", "megatron.recompute_activations=true",
          "megatron.distributed_optimizer=true", "megatron.bf16_weights=true"]


def megatron_config(model: Path, *overrides: str):
    """A megatron run of ``model``'s shapes small enough to dry-run in seconds: 4 prompts of 8 samples, 48 thinking and
    8 answer tokens."""
    return load_config(None, [f"model.path={model}", "model.backend=megatron", "rollout.num_samples=8",
                              "rollout.max_thinking_tokens=48", "rollout.max_answer_tokens=8", "train.batch_size=4",
                              "train.micro_batch_size=1", "eval.batch_size=4", "eval.num_samples=8", *overrides])


def small_config(tmp_path: Path, *overrides: str):
    model = small_qwen3(tmp_path / "model", layers=4, tied=False)  # untied, as the 8B's
    return megatron_config(model, *LAYOUT, "train.micro_batch_rows=4", "model.logprob_chunk_size=128", *overrides)


@pytest.mark.slow  # 12 s: two ranks of TP=2 PP=2 DP=2
def test_the_first_and_last_stage_hold_what_plan_estimates_for_their_layout(tmp_path, monkeypatch):
    """TP=2 PP=2 DP=2 with the bf16 distributed optimizer and vLLM (every rank samples): the first and the last
    stage's ranks are simulated, and plan's weights, gradient buffer, optimizer state (sharded over DP) and vLLM share
    are within 10% of the dry run's; the last stage alone holds the log-prob head; a save gathers the replicated AdamW
    state a piece at a time (pieces of 16 KiB here, far below the tiny model's vector). Each replica's 2 prompts are
    decoded once, over its 4 engines (issue 43's N5): rank 0's engine decodes 1, rank 4's (the third share) none,
    where every engine decoded both before."""
    monkeypatch.setattr(zero, "SAVE_PIECE_BYTES", 16 * 2**10)
    config = small_config(tmp_path, "rollout.engine=vllm", "rollout.vllm_memory_utilization=0.25")
    report = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32, world_size=8)
    assert list(report["ranks"]) == ["0", "4"]
    first, last = report["ranks"]["0"], report["ranks"]["4"]
    assert report["decode"] == {"replica_prompts": 2, "engines": 4, "share": 1, "most_decoded": 1, "duplicated": False}
    assert first["shape"]["decoded_prompts"]["rollout"] == 1 and last["shape"]["decoded_prompts"]["rollout"] == 0
    assert "first pipeline stage" in first["rank"] and "last pipeline stage" in last["rank"]
    assert list(first["phases"]) == ["build", "rollout", "train", "optimizer_step", "refit", "save", "guard_restore",
                                     "evaluate", "resume"]
    assert "logprob_head" in last["phases"]["train"]["most_by_kind_gib"]
    assert "logprob_head" not in first["phases"]["train"]["most_by_kind_gib"]
    rows = against_plan(report, config)
    compared = {name: rows[name]["plan_over_dry_run"] for name in ("weights", "gradients", "optimizer", "vllm", "refit")}
    assert all(0.9 <= ratio <= 1.1 for ratio in compared.values()), compared
    # the refit gathers the (untied) embedding and head whole, beside vLLM's share: the slices and the merged tensor
    assert rows["refit"]["dry_run_gib"] * 2**30 == pytest.approx(2 * 4096 * 256 * 2, rel=0.01)
    assert first["phases"]["refit"]["by_kind_gib"]["vllm"] > 0
    # nothing of the training pass sits beside vLLM's share: megatron-core's sequence-parallel gather buffer and, on
    # the last stage, the last activation received from the stage before (and its gradient) are let go after the
    # step; each is at least a layer's input on a TP rank (4 rows x 16 of the 32 prompt tokens x 256 wide, bf16). What
    # stays is megatron-core's rotary table (22 KiB).
    layer_input = 4 * 16 * 256 * 2
    assert all(rank["phases"]["refit"]["most_by_kind_gib"].get("activations", 0.0) * 2**30 < layer_input
               for rank in (first, last)), [rank["phases"]["refit"]["most_by_kind_gib"] for rank in (first, last)]
    # the distributed optimizer's fp32 master weights and moments are sharded over DP: 12 / 2 bytes a parameter
    weights = first["phases"]["build"]["by_kind_gib"]["weights"]  # bf16: 2 bytes a parameter
    assert rows["optimizer"]["dry_run_gib"] == pytest.approx(3 * weights, rel=0.01)
    assert rows["gradients"]["dry_run_gib"] == pytest.approx(2 * weights, rel=0.01)  # the fp32 gradient buffer
    # the checkpoint stores the replicated AdamW state, put together in host memory: the GPU holds one piece of it at
    # a time (gathered whole, one fp32 vector: 2 x the bf16 weights, the 8B config's peak)
    phases = first["phases"]
    assert phases["save"]["most_by_kind_gib"]["temporaries"] == pytest.approx(16 / 2**20, rel=0.05)
    # a resume builds the run afresh (one model, one gradient buffer: the old run's are gone) and reads only this
    # rank's DP shard of the moments (1 x weights each in fp32 / DP=2), never the whole replicated state
    resumed = phases["resume"]["most_by_kind_gib"]
    assert resumed["weights"] == pytest.approx(weights, rel=0.01) and resumed["gradients"] == pytest.approx(2 * weights, rel=0.01)
    assert resumed["temporaries"] < 2.5 * weights


@pytest.mark.slow  # 30 s
def test_a_split_worlds_pipeline_trains_syncs_and_its_rollout_rank_holds_what_plan_says(tmp_path):
    """rollout.placement=separate at TP=2 PP=2 DP=2 (8 training GPUs) with the native engine on rollout ranks: both
    stages are simulated, hold no sampler and no KV cache, and sync (the first replica's ranks gather, rank 0 sends
    bf16); the rollout rank takes the whole model in, in bf16. Every component within 10% of plan's."""
    config = small_config(tmp_path, "rollout.engine=native", "rollout.placement=separate",
                          "rollout.sync_bucket_mb=0.0078125")
    report = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32, world_size=8)
    assert list(report["ranks"]) == ["0", "4"]
    for rank in report["ranks"].values():
        assert list(rank["phases"]) == ["build", "rollout", "train", "optimizer_step", "sync", "save", "guard_restore",
                                        "evaluate", "resume"]
        assert not {"kv_cache", "sampler_copy"} & {kind for phase in rank["phases"].values() for kind in phase["most_by_kind_gib"]}
    assert list(report["rollout_rank"]["phases"]) == ["build", "sync", "rollout", "evaluate"]
    rows = {name: row["plan_over_dry_run"] for name, row in against_plan(report, config).items()
            if row["plan_over_dry_run"] is not None}
    assert {"weights", "optimizer", "rollout_rank.weights", "rollout_rank.kv_cache", "rollout_rank.sync_buckets"} <= set(rows)
    assert all(0.9 <= ratio <= 1.1 for ratio in rows.values()), rows


@pytest.mark.parametrize("distributed", ["true", "false"])
@pytest.mark.slow  # 7-12 s
def test_the_optimizer_step_holds_the_square_root_of_v_once_as_a_gpus_foreach_adamw(tmp_path, distributed):
    """Measured on an H100 (docs/results/real_gpu.md): a 0.6B Megatron step peaks in its optimizer step with AdamW's
    state plus sqrt(v) once, for the replicated AdamW (12.28 GiB) and the distributed optimizer's shard (13.39). On
    ``meta`` torch picked the host's per-tensor kernels: the largest tensor's sqrt(v) only (11.15, x1.10 low), and
    for the shard's one flat tensor sqrt(v) twice (15.54, x0.86); the dry run now says 12.21 and 13.32."""
    config = small_config(tmp_path, "megatron.tensor_parallel=1", "megatron.pipeline_parallel=1",
                          "megatron.sequence_parallel=false", f"megatron.distributed_optimizer={distributed}",
                          f"megatron.bf16_weights={distributed}")
    phases = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32)["phases"]
    state = phases["refit"]["by_kind_gib"]["optimizer"]  # after the step: moments (and master weights)
    square_root_of_v = state / (3 if distributed == "true" else 2)  # 4 bytes of its 12 or 8 a parameter
    assert phases["optimizer_step"]["by_kind_gib"]["optimizer"] == pytest.approx(state + square_root_of_v, rel=0.02)


@pytest.mark.slow  # 9 s
def test_an_offloaded_optimizers_state_is_host_memory(tmp_path):
    """megatron.optimizer_cpu_offload=true: the distributed optimizer's fp32 master weights and moments (12 bytes a
    parameter at DP=1) and the gradient shard's host copy (4) are host memory, none of them on the GPU."""
    from nemo_jq.cluster.plan import parameter_count
    from nemo_jq.models.megatron.provider import read_qwen3_config

    single = ["megatron.tensor_parallel=1", "megatron.pipeline_parallel=1", "megatron.sequence_parallel=false"]
    (tmp_path / "resident").mkdir()
    (tmp_path / "offloaded").mkdir()
    resident_config = small_config(tmp_path / "resident", *single)
    resident = dry_run(resident_config, GPUS["a100-80gb"], prompt_tokens=32)["phases"]
    offloaded = dry_run(small_config(tmp_path / "offloaded", *single, "megatron.optimizer_cpu_offload=true"),
                        GPUS["a100-80gb"], prompt_tokens=32)["phases"]
    params = parameter_count(read_qwen3_config(resident_config.model.path))
    assert resident["refit"]["by_kind_gib"]["optimizer"] == pytest.approx(12 * params / 2**30, rel=0.01)
    assert offloaded["refit"]["by_kind_gib"].get("optimizer", 0.0) == 0.0
    moved = offloaded["refit"]["host_peak_gib"] - resident["refit"]["host_peak_gib"]
    assert moved == pytest.approx(16 * params / 2**30, rel=0.02)


@pytest.mark.slow
def test_plan_activations_agree_with_the_dry_run(tmp_path):
    """A recomputed layer's backward holds its forward tensors, their gradients and the sequence-parallel gathered
    inputs: plan's RECOMPUTED_LAYER_BACKWARD (it counted the forward tensors alone: 0.36 of the dry run here)."""
    config = small_config(tmp_path, "rollout.engine=vllm", "rollout.max_thinking_tokens=400")
    report = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32, world_size=8)
    assert 0.9 <= against_plan(report, config)["activations"]["plan_over_dry_run"] <= 1.1


@pytest.mark.slow
@pytest.mark.parametrize("bf16_weights", ["true", "false"])
def test_plan_log_prob_head_agrees_with_the_dry_run(tmp_path, bf16_weights):
    """The last stage's log-prob head in backward: the hidden states' bf16 gradient, the fp32 gradient of the head's
    V/TP slice and its bf16 copy returned (bf16 weights), or the slice's bf16 copy for the products (fp32 weights).
    A small chunk and short rows make those copies count, as at 8B (plan counted fp32 hidden-state gradients and
    neither copy: 0.85 of the dry run at 8B, 0.82 and 0.74 here)."""
    config = small_config(tmp_path, "rollout.engine=vllm", f"megatron.bf16_weights={bf16_weights}",
                          "model.logprob_chunk_size=16")
    report = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32, world_size=8, ranks=[4])
    assert 0.95 <= against_plan(report, config)["logprob_head"]["plan_over_dry_run"] <= 1.05


@pytest.mark.slow
def test_the_command_simulates_a_rank_that_samples_none_and_refuses_a_pipelines_refit(tmp_path, capsys):
    """rollout.engine=native at TP=2 DP=2: rank 0 holds the one HF copy and its KV cache (as plan says); rank 1 samples
    none: it holds no copy (its sampler's weights are on the meta device) and no KV cache, and trains on the rollouts
    rank 0 sends, which the dry run makes as rank 0's own. A pipeline's refit of that copy names every stage's
    weights from the other stages (an object the fake group cannot carry): refused in one line."""
    model = small_qwen3(tmp_path / "model", layers=4, tied=False)  # untied, as the 8B's
    out = tmp_path / "dry.json"
    layout = [key for key in LAYOUT if not key.startswith("megatron.pipeline_parallel")]
    common = ["dryrun", "--prompt-tokens", "32", "--gpus", "4", f"model.path={model}", *layout,
              "rollout.engine=native", "rollout.num_samples=8", "rollout.max_thinking_tokens=48",
              "rollout.max_answer_tokens=8", "train.batch_size=4", "train.micro_batch_size=1",
              "train.micro_batch_rows=4", "eval.batch_size=4", "eval.num_samples=8"]
    assert main([*common, "--ranks", "0,1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["ranks"]) == ["0", "1"] and "peak:" in capsys.readouterr().out
    config = load_config(None, common[5:])
    rows = against_plan(report, config)
    assert 0.9 <= rows["rollout_copy"]["plan_over_dry_run"] <= 1.1, rows
    sampling, idle = report["ranks"]["0"]["phases"], report["ranks"]["1"]["phases"]
    assert sampling["rollout"]["most_by_kind_gib"]["kv_cache"] > 0 and sampling["rollout"]["most_by_kind_gib"]["sampler_copy"] > 0
    assert not {"kv_cache", "sampler_copy"} & {kind for phase in idle.values() for kind in phase["most_by_kind_gib"]}
    assert idle["train"]["most_by_kind_gib"]["activations"] == sampling["train"]["most_by_kind_gib"]["activations"]
    assert main([*common, "megatron.pipeline_parallel=2"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "megatron.pipeline_parallel=2 is not dry-run yet" in error
    # fewer GPUs than a replica (TP=2 here): one line naming the option, before any rank is named from the layout
    assert main([*common[:3], "--gpus", "1", *common[5:]]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "does not divide the 1 processes: use a multiple of 2 (nemo-jq dryrun --gpus)" in error


def test_a_rank_that_samples_none_has_no_sampler_to_call(tmp_path, monkeypatch):
    """Were rank 1's native sampler called (here: an engine that takes every rank of the replica for a sampling one),
    the dry run fails naming the rank: its copy of the weights is absent."""
    from nemo_jq.dryrun import WrongDevice
    from nemo_jq.rollouts.refit import RefittedRolloutEngine

    model = small_qwen3(tmp_path / "model", layers=2, tied=False)
    layout = [key for key in LAYOUT if not key.startswith("megatron.pipeline_parallel")]
    config = load_config(None, [f"model.path={model}", *layout, "rollout.engine=native", "rollout.num_samples=4",
                                "rollout.max_thinking_tokens=16", "rollout.max_answer_tokens=4", "train.batch_size=2",
                                "train.micro_batch_size=1", "eval.batch_size=2", "eval.num_samples=4"])
    monkeypatch.setattr(RefittedRolloutEngine, "_sampling_ranks", lambda self: [0, 1])
    with pytest.raises(WrongDevice, match="phase rollout: rank 1: .* samples nothing .* its sampler was called"):
        dry_run(config, GPUS["a100-80gb"], prompt_tokens=16, world_size=2, ranks=[1])


@pytest.mark.slow  # 5 s
def test_the_host_memory_of_a_save_is_the_writing_replica_s_and_a_node_that_cannot_hold_it_is_one_line(tmp_path, capsys):
    """Issue 43's N6 seen by the dry run: at TP=2 PP=2 DP=2 the save puts the replicated AdamW state (fp32 moments and
    master weights: 3 x 4 bytes a parameter of the rank's shard) in DP rank 0's host memory, beside its writer's copy
    of the rank's bf16 weights (megatron-core's writer stages what it writes on the host), and none in DP rank 1's,
    which writes nothing (not the main replica); a node's host memory is its processes' (8 here: the writing
    replica's at the fullest's peak, the others' at their peak outside the save), and ``--host-memory`` below it
    exits 2."""
    config = small_config(tmp_path, "rollout.engine=vllm", "rollout.vllm_memory_utilization=0.25")
    report = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32, world_size=8, ranks=[0, 2])
    writer, other = report["ranks"]["0"], report["ranks"]["2"]
    assert "DP rank 0" in writer["rank"] and "DP rank 1" in other["rank"]
    weights = writer["phases"]["build"]["by_kind_gib"]["weights"]  # bf16: 2 bytes a parameter
    assert writer["phases"]["save"]["host_peak_gib"] == pytest.approx(6 * weights + weights, rel=0.05)
    assert other["phases"]["save"]["host_peak_gib"] < 0.05 * writer["phases"]["save"]["host_peak_gib"]
    host = report["host"]  # ranks 0, 1, 4, 5 of the node are DP rank 0's: they gather; 2, 3, 6, 7 hold their peak elsewhere
    outside_save = max(phase["host_peak_gib"] for name, phase in writer["phases"].items() if name != "save")
    assert host["processes"] == 8 and host["writing_replica_processes"] == 4
    assert host["gib"] == pytest.approx(4 * host["per_process_gib"] + 4 * outside_save, rel=1e-3)
    model = config.model.path
    code = main(["dryrun", "--gpu", "a100-80gb", "--prompt-tokens", "32", "--gpus", "8", "--ranks", "0",
                 "--host-memory", "0.0001", *[f"{key}={value}" for key, value in (("model.path", model),)],
                 *LAYOUT, "rollout.num_samples=8", "rollout.max_thinking_tokens=48", "rollout.max_answer_tokens=8",
                 "train.batch_size=4", "train.micro_batch_size=1", "train.micro_batch_rows=4", "eval.batch_size=4",
                 "eval.num_samples=8", "model.logprob_chunk_size=128", "rollout.engine=vllm",
                 "rollout.vllm_memory_utilization=0.25"])
    err = capsys.readouterr().err
    assert code == 2 and "more than --host-memory 0.0001" in err
    # the sum as it is made (it said "8 processes x" the writer's peak, whose product is not the total)
    assert "GiB of host memory on a node (4 processes of the saving replica x" in err and "+ 4 of other replicas x" in err


@pytest.mark.slow  # three dry runs
def test_a_qwen3_moe_rank_holds_the_dense_weights_and_its_share_of_the_experts_and_their_state(tmp_path):
    """EP=2 over 2 ranks: each holds the dense weights and half of every layer's experts; EP=1: all of them. With the
    distributed optimizer the dense state is split over DP (12 / 2 bytes a weight), the experts' over the expert-DP
    ranks (here 1: 12 bytes). The dispatcher's routing is data: the dry run routes balanced (k of E experts a token); the
    routes replayed in training are host memory."""
    from helpers import small_qwen3
    from nemo_jq.cluster.plan import expert_parameters, parameter_count
    from nemo_jq.models.megatron.provider import read_qwen3_config

    model = small_qwen3(tmp_path / "moe", layers=4, tied=False, experts=8)
    arch = read_qwen3_config(model)
    experts, dense = expert_parameters(arch), parameter_count(arch) - expert_parameters(arch)

    def rank_zero(*overrides, world_size=2):
        config = megatron_config(model, *overrides)
        report = dry_run(config, GPUS["h100-80gb"], prompt_tokens=32, world_size=world_size)
        return report["ranks"]["0"]["phases"], report, config

    (split, split_report, split_config), (whole, _, _) = rank_zero("megatron.expert_parallel=2"), rank_zero(
        "megatron.expert_parallel=1")
    # plan counts the same weights, gradients and optimizer state (its activations: tests/unit/config/test_paper_configs.py)
    compared = against_plan(split_report, split_config)
    assert all(compared[part]["plan_over_dry_run"] == pytest.approx(1, abs=0.01)
               for part in ("weights", "gradients", "optimizer")), compared
    assert split["train"]["by_kind_gib"]["weights"] == pytest.approx(4 * (dense + experts / 2) / 2**30, rel=1e-3)
    assert whole["train"]["by_kind_gib"]["weights"] == pytest.approx(4 * (dense + experts) / 2**30, rel=1e-3)
    assert split["train"]["by_kind_gib"]["activations"] > 0
    sharded = rank_zero("megatron.expert_parallel=2", "megatron.distributed_optimizer=true")[0]
    assert sharded["refit"]["most_by_kind_gib"]["optimizer"] == pytest.approx(
        (12 * dense / 2 + 12 * experts / 2) / 2**30, rel=0.02)
    # expert-TP=2 over 2 ranks: each holds half of every expert; plan counts it so
    sliced, sliced_report, sliced_config = rank_zero("megatron.expert_tensor_parallel=2")
    assert sliced["train"]["by_kind_gib"]["weights"] == pytest.approx(4 * (dense + experts / 2) / 2**30, rel=1e-3)
    compared = against_plan(sliced_report, sliced_config)
    assert all(compared[part]["plan_over_dry_run"] == pytest.approx(1, abs=0.01) for part in ("weights", "gradients")), compared
    # routing replay: the rollouts' routes (uint8 expert ids: the rank's 16 rows, prompt and thinking positions,
    # 4 layers x top-2) are host memory the rollout phase reports
    unrecorded = rank_zero("megatron.expert_parallel=2", "rollout.routing_replay=false")[0]
    routes = (split["rollout"]["host_peak_gib"] - unrecorded["rollout"]["host_peak_gib"]) * 2**30
    assert routes == pytest.approx(16 * (32 + 48) * 4 * 2, rel=0.2)
    # over 2 pipeline stages of 2 ranks (EP=2 on each; vLLM, which the dry run simulates beside a pipeline): the
    # stages' first ranks hold every dense weight once and half of every layer's experts between them
    _, staged, _ = rank_zero("megatron.expert_parallel=2", "megatron.pipeline_parallel=2", "rollout.engine=vllm",
                             "rollout.vllm_memory_utilization=0.3", world_size=4)
    held = sum(staged["ranks"][rank]["phases"]["train"]["by_kind_gib"]["weights"] for rank in ("0", "2"))
    assert held == pytest.approx(4 * (dense + experts / 2) / 2**30, rel=1e-3)


@pytest.mark.slow  # two dry runs, ~20 s
def test_a_refit_gathers_one_batch_of_experts_at_a_time_as_plan_counts_it(tmp_path, monkeypatch):
    """64 experts 1024 wide (2 MiB a pair a rank in bf16, 4 in fp32), EP=2, the batch limit cut to 64 MiB so that a
    layer's experts take several gathers and outweigh the embedding: the refit holds the batch's pieces, the HF tensors
    merged from them and this rank's share (2.5 batches), never the previous batch beside them (it held 3.5 in fp32),
    and plan says so within 2%."""
    from nemo_jq.cluster import plan
    from nemo_jq.models.megatron import mapping, policy

    monkeypatch.setattr(mapping, "EXPERT_GATHER_BYTES", 64 * 2**20)
    monkeypatch.setattr(policy, "EXPERT_GATHER_BYTES", 64 * 2**20)
    model = small_qwen3(tmp_path / "moe", layers=4, tied=False, experts=64, expert_width=1024)
    for weights in (["megatron.distributed_optimizer=true", "megatron.bf16_weights=true"], []):
        config = megatron_config(model, "megatron.expert_parallel=2", "rollout.engine=vllm",
                                 "rollout.vllm_memory_utilization=0.25", *weights)
        report = dry_run(config, GPUS["h100-80gb"], prompt_tokens=32, world_size=2)
        row = against_plan(report, config)["refit"]
        batch = 64 * 2**20 if not weights else 63 * 2**20  # fp32: 10 pairs of 6 MiB gathered and an fc1; bf16: 21 pairs of 3
        assert row["dry_run_gib"] * 2**30 == pytest.approx(2.5 * batch, rel=0.02), row
        assert row["plan_over_dry_run"] == pytest.approx(1, abs=0.02), row
        assert plan.refit_bytes(plan.architecture(str(model)), plan.Workload.from_config(config, 32)) > 2 * 4096 * 256 * 4

