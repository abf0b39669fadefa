"""nemo-jq dryrun: the instrument (fake world, memory tracker) checked against real allocation, the catches it
exists for, and the command.

The real GPU is the one thing these tests cannot have: the dry run's stand-in GPU is the ``meta`` device (see
nemo_jq/dryrun/world.py), and its numbers are checked here against a real CPU run of the same code.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_jq.config import load_config
from nemo_jq.dryrun import GPUS, DoesNotFit, GpuProfile, WrongDevice, check_fits, dry_run, on_gpu
from nemo_jq.dryrun.memory import KINDS, MemoryTracker
from nemo_jq.dryrun.report import format_report
from nemo_jq.dryrun.run import knob
from nemo_jq.dryrun.world import GPU, MOST, FakeWorld
from nemo_jq.models.interfaces import TokenBatch

ROOT = Path(__file__).resolve().parents[3]

HERE = Path(__file__).resolve().parent


def policy_step(device: torch.device, rows: int = 6) -> None:
    """Build an HF policy, train one micro-batch of ``rows`` and step AdamW (fp32, as the CPU runs it)."""
    from nemo_jq.models.hf import HFPolicy, tiny_qwen3

    model = tiny_qwen3(8192, hidden_size=768, num_layers=4, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                       max_position_embeddings=512, seed=0)
    policy = HFPolicy(model, device=device, precision="fp32", logprob_chunk_size=256)
    length = 256
    ids = torch.ones((rows, length), dtype=torch.long)
    mask = torch.ones((rows, length - 1), dtype=torch.bool)
    batch = TokenBatch(ids, torch.ones_like(ids), mask, torch.zeros_like(mask), None)
    policy.forward_backward([batch], lambda logprobs, index: (logprobs.sum(), {}))
    policy.optimizer_step()


def real_peak_bytes() -> int:
    """Run :func:`policy_step` on the CPU in this process: its peak resident bytes above those before it (after a
    one-row run, so that the libraries' one-time set-up is not counted)."""
    import ctypes

    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: resident pages are the bytes touched, not huge pages
    torch.set_num_threads(1)
    policy_step(torch.device("cpu"), rows=1)
    with open("/proc/self/statm") as statm:
        before = int(statm.read().split()[1]) * resource.getpagesize()
    policy_step(torch.device("cpu"))
    # the high-water mark of this process's own memory (ru_maxrss would keep the forking parent's across exec)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return peak * 1024 - before


@pytest.mark.slow
def test_the_dry_run_peak_is_the_real_peak():
    """The fake world's count of the same code's peak equals what the CPU really allocates, within 10% (the real
    figure is the resident-set growth of a fresh process, which also holds allocator slack and Python objects)."""
    script = f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_dryrun import real_peak_bytes; print(real_peak_bytes())"
    # freed tensors go back to the system (so the RSS is live bytes), one thread, nothing else inherited from the suite
    env = {"PATH": os.environ.get("PATH", ""), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1",
           "OMP_NUM_THREADS": "1"}
    real = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env=env).stdout.split()[-1])
    tracker = MemoryTracker(GPU.type)
    with FakeWorld(tracker), tracker.phase("step"):
        policy_step(GPU)
    dry = tracker.phases["step"].peak
    assert real > 500e6  # large enough that the process's own overheads are small beside it
    assert abs(dry - real) / real < 0.10, (dry, real)


def test_the_world_answers_with_the_most_memory():
    tracker = MemoryTracker(GPU.type)
    with FakeWorld(tracker) as world:
        mask = torch.ones(4, 8, dtype=torch.bool, device=GPU)
        assert mask.nonzero().shape == (32, 2)  # every element counts
        assert torch.ones(4, 8, device=GPU)[mask].shape == (32,)
        assert int(mask.sum()) == MOST and float(mask.float().mean()) == 1.0 and not bool(mask.all())
        with world.sampling_call():
            assert [bool(mask.any()) for _ in range(3)] == [True, True, False]  # world.decode_steps == 2
        assert torch.zeros(3, device=GPU).cpu().tolist() == [0.0, 0.0, 0.0]
        with pytest.raises(WrongDevice, match="phase build: a tensor on the host"):
            torch.nn.Linear(8, 8)(torch.ones(2, 8, device=GPU))  # the layer's weights never left the host
        before = tracker.total
        kept = torch.empty(1000, device=GPU)
        assert tracker.total - before == 4000
        del kept
        assert tracker.total == before


def test_garbage_from_before_the_world_is_freed_before_it_starts():
    """A finalizer that runs inside the world reads its answers: vLLM CPU's oneDNN handle, left for the collector by an
    engine run earlier in the process, was released as MOST there (a segfault in CI's worker order)."""
    released = []

    class Handle:
        def __init__(self):
            self.address, self.me = torch.tensor(7), self  # a cycle: only the collector frees it

        def __del__(self):
            released.append(int(self.address.item()))

    gc.disable()  # no collection but the world's
    try:
        Handle()
        with FakeWorld(MemoryTracker(GPU.type)):
            gc.collect()
    finally:
        gc.enable()
    assert released == [7]


def test_gpu_attention_keeps_no_scores():
    """On a GPU, SDPA never holds the [L, L] scores; torch's choice on meta would (the math path)."""
    tracker = MemoryTracker(GPU.type)
    with FakeWorld(tracker), tracker.phase("attention"):
        q = torch.empty(1, 8, 4096, 64, device=GPU, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(1, 2, 4096, 64, device=GPU, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).sum().backward()
    scores = 8 * 4096 * 4096 * 2
    assert tracker.phases["attention"].peak < scores / 4


def dry(tmp_path: Path, *overrides: str, gpu: str = "h100-80gb", **settings):
    return dry_run(load_config(None, ["train.batch_size=4", "train.micro_batch_size=2", "eval.batch_size=4",
                                      *overrides]), GPUS[gpu], prompt_tokens=24, **settings)


def test_a_sampler_left_on_the_host_is_named(tmp_path, monkeypatch):
    """A backend whose sampler decodes a model it never moved to the GPU (the megatron path's defect, D3, in a
    backend of its own) fails in one line naming the sampler's module and the phase."""
    from nemo_jq.backends import BACKENDS, engine_for, policy_options
    from nemo_jq.models.hf import HFPolicy

    def sampler_on_host(request):
        policy = HFPolicy(request.load_model(), device=request.device, **policy_options(request.config))
        return policy, engine_for(policy, request, own_copy=request.load_model)  # a copy built, never moved

    monkeypatch.setitem(BACKENDS, "sampler_on_host", sampler_on_host)
    with pytest.raises(WrongDevice, match=r"phase rollout: a tensor on the host \(cpu\) met one on the GPU in sampler"):
        dry(tmp_path, "model.backend=sampler_on_host")


def test_the_advice_of_a_run_that_does_not_fit_offers_no_setting_the_config_already_has():
    """A config with activation checkpointing and one row a chunk was told to set both; megatron's distributed
    optimizer likewise. Each kind's advice moves on to the next setting, and one to make smaller says its value now."""
    def fails_with(words: list[str], kind: str, rollout_rank: bool = False) -> str:
        phases = {"train": {"peak_gib": 90.0, "by_kind_gib": {**dict.fromkeys(KINDS, 0.0), kind: 80.0}}}
        report = {"fits": False, "peak_phase": "train", "phases": phases, "usable_gib": 75, "gpu": {"name": "H100"}}
        if rollout_rank:
            report = {**report, "phases": {}, "rollout_rank": {**report, "fits": False}}
        with pytest.raises(DoesNotFit) as error:
            check_fits(report, load_config(None, words))
        return str(error.value)

    assert "model.activation_checkpointing=true and a smaller train.micro_batch_rows (unset now" in fails_with(
        [], "activations")
    both = fails_with(["model.activation_checkpointing=true", "train.micro_batch_rows=1"], "activations")
    assert "activation_checkpointing" not in both and "micro_batch_rows" not in both and "context_parallel" in both
    mega = ["model.backend=megatron", "megatron.recompute_activations=true", "megatron.distributed_optimizer=true"]
    assert "recompute_activations" not in fails_with([*mega, "train.micro_batch_rows=2"], "activations")
    assert fails_with(mega, "optimizer").endswith("try megatron.optimizer_cpu_offload=true (the state in host memory), "
                                                  "or more GPUs (more DP shards)")
    assert "distributed_optimizer=true" in fails_with(["model.backend=megatron"], "optimizer")
    assert "megatron.tensor_parallel=1, megatron.pipeline_parallel=1 now" in fails_with(mega, "weights")
    # a Qwen3-MoE's experts, most of its weights and gradients, split over EP (its sharded AdamW state does not shrink)
    moe = [*mega, "model.path=Qwen/Qwen3-30B-A3B", "megatron.expert_parallel=2"]
    for kind in ("weights", "gradients"):
        assert "try megatron.expert_parallel above 2 (each rank a share of the experts), or " in fails_with(moe, kind)
        assert "expert_parallel" not in fails_with(mega, kind)
    assert "expert_parallel" not in fails_with([*moe, "megatron.optimizer_cpu_offload=true"], "optimizer")
    assert "try megatron.expert_parallel above 2" in fails_with([*moe, "megatron.distributed_optimizer=false"], "optimizer")
    assert "of a rollout rank" in fails_with([], "weights", rollout_rank=True)
    assert "cuda_graphs" not in fails_with(["rollout.cuda_graphs=false"], "sampler_copy")
    assert "(256 now)" in fails_with([], "logprob_head")
    config = load_config(None, [])
    assert all(knob(kind, config) for kind in KINDS)


@pytest.mark.slow
def test_the_command_reports_every_phase_and_refuses_what_does_not_fit(tmp_path):
    """The command as a person runs it, each call a process of its own."""

    def dryrun(words: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nemo_jq.cli", *words], capture_output=True, text=True, timeout=600)

    out = tmp_path / "dry.json"
    base = ["dryrun", "--prompt-tokens", "24", "train.batch_size=4", "train.micro_batch_size=2", "eval.batch_size=4"]
    done = dryrun([*base, "--json", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fits"] and "peak:" in done.stdout
    phases = report["phases"]
    assert list(phases) == ["build", "rollout", "train", "optimizer_step", "save", "guard_restore", "evaluate", "resume"]
    assert phases["optimizer_step"]["most_by_kind_gib"]["optimizer"] >= 2 * phases["build"]["by_kind_gib"]["weights"]
    # the AdamW state a guard's restore reads back is the optimizer's at the evaluation after it, not temporaries
    assert phases["evaluate"]["by_kind_gib"]["optimizer"] == phases["save"]["most_by_kind_gib"]["optimizer"] > 0
    assert phases["rollout"]["most_by_kind_gib"]["kv_cache"] > 0
    assert phases["train"]["most_by_kind_gib"]["activations"] > 0 and phases["train"]["flops"] > 0
    # the host: the save's safetensors serialises every weight at once there (fp32 on the hf backend: the GPU's)
    weights = phases["build"]["by_kind_gib"]["weights"]
    assert phases["save"]["host_peak_gib"] >= weights and report["host"]["processes"] == 1
    assert report["host"]["gib"] == max(phase["host_peak_gib"] for phase in phases.values())
    done = dryrun([*base, "--gpu-memory", "0.001"])
    error = done.stderr.strip()
    assert done.returncode == 2, error[-3000:]
    assert len(error.splitlines()) == 1 and "nemo-jq dryrun: error: phase" in error and "try " in error
    with pytest.raises(DoesNotFit):
        check_fits({**report, "fits": False}, load_config(None, base[3:]))
    # a split world: the training rank holds no sampler, no KV cache, and syncs; a rollout rank holds them
    done = dryrun([*base, "--json", str(out), "rollout.placement=separate"])
    assert done.returncode == 0, done.stderr[-3000:]
    split = json.loads(out.read_text())
    assert "a rollout rank's" in done.stdout
    phases, serving = split["phases"], split["rollout_rank"]["phases"]
    assert list(phases) == ["build", "rollout", "train", "optimizer_step", "sync", "save", "guard_restore", "evaluate",
                            "resume"]
    assert not any(phase["most_by_kind_gib"].get(kind) for phase in phases.values() for kind in ("kv_cache", "sampler_copy"))
    assert phases["sync"]["most_by_kind_gib"]["sync_buckets"] > 0
    assert list(serving) == ["build", "sync", "rollout", "evaluate"]
    assert serving["rollout"]["most_by_kind_gib"]["kv_cache"] > 0 and serving["sync"]["most_by_kind_gib"]["sync_buckets"] > 0
    assert not any(phase["most_by_kind_gib"].get(kind) for phase in serving.values() for kind in ("gradients", "optimizer"))
    # the node's host memory: the training process's and the rollout rank's, each at the fuller one's peak (the training
    # process, whose save serialises its weights on the host, was left out: the rollout rank's peak alone)
    host = split["host"]
    assert host["processes"] == 2 and split["host_peak_gib"] > split["rollout_rank"]["host_peak_gib"]
    assert host["per_process_gib"] == split["host_peak_gib"] and host["gib"] == pytest.approx(2 * split["host_peak_gib"])


@pytest.mark.parametrize("memory", [[], ["train.micro_batch_rows=4", "model.activation_checkpointing=true"],
                                    ["model.precision=fp32"]], ids=["whole_groups", "row_chunks_recomputed", "fp32"])
@pytest.mark.slow
def test_plan_agrees_with_the_dry_run_and_catches_a_micro_batch_counted_in_sequences(tmp_path, memory):
    """``nemo-jq plan --config`` and the dry run count the same workload: every component within 10%, with whole
    groups per forward/backward, with row chunks and recomputation, and in fp32 (its keys and values, prefill and
    activations; no bf16 cast of the weights to decode from, which plan counted). Counting the micro-batch in sequences
    (``train.micro_batch_size``) instead of the trainer's prompts x M (or its row chunks) is caught."""
    import dataclasses

    from helpers import small_qwen3
    from nemo_jq.cluster import plan
    from nemo_jq.dryrun.report import against_plan

    model = small_qwen3(tmp_path / "model", layers=2, tied=True)
    config = load_config(None, [f"model.path={model}", "rollout.num_samples=8", "rollout.max_thinking_tokens=48",
                                "rollout.max_answer_tokens=8", "train.batch_size=4", "train.micro_batch_size=2",
                                "eval.batch_size=4", "eval.num_samples=8", "model.logprob_chunk_size=128", *memory])
    report = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32)
    rows = against_plan(report, config)
    compared = {name: row["plan_over_dry_run"] for name, row in rows.items() if row["plan_over_dry_run"] is not None}
    assert {"weights", "gradients", "optimizer", "activations", "logprob_head", "kv_cache", "prefill", "sampling"} <= set(compared)
    assert all(0.9 <= ratio <= 1.1 for ratio in compared.values()), compared
    if memory == ["model.precision=fp32"]:  # no bf16 cast to decode from: plan counted one the run never made
        assert rows["decode_cast"]["dry_run_gib"] == rows["decode_cast"]["plan_gib"] == 0.0
    else:
        assert "decode_cast" in compared
    work = plan.Workload.from_config(config, 32)
    # in sequences, or whole groups where the trainer takes row chunks
    miscounted = dataclasses.replace(work, micro_batch=config.train.micro_batch_size * (8 if "train.micro_batch_rows=4" in memory else 1))
    wrong = plan.estimate(plan.architecture(str(model)), miscounted, 1, 1, 1, 80, 0.9).activations_gib
    assert not 0.9 <= wrong / rows["activations"]["dry_run_gib"] <= 1.1


@pytest.mark.parametrize("engine", ["native", "vllm"])
@pytest.mark.slow
def test_plan_agrees_with_the_dry_run_of_a_rollout_rank_and_catches_a_receiver_counted_as_two_buckets(tmp_path, engine):
    """``rollout.placement=separate``: plan's rollout rank (its bf16 weights and KV cache, or vLLM's share, and the
    sync's receiving side) within 10% of the rollout rank's dry run, which takes in what the training rank's dry run
    sent, and the training rank's sending side (two buckets: ``refit``) within 10% of its own. Buckets of 8 KiB, so
    that the embedding (and the fp32 MLP weights) spread over several and are put together whole: two buckets, what
    plan counted until this dry run showed otherwise, are far from it."""
    from helpers import small_qwen3
    from nemo_jq.cluster import plan
    from nemo_jq.dryrun.report import against_plan

    model = small_qwen3(tmp_path / "model", layers=2, tied=True)
    config = load_config(None, [f"model.path={model}", "rollout.num_samples=8", "rollout.max_thinking_tokens=48",
                                "rollout.max_answer_tokens=8", "train.batch_size=4", "train.micro_batch_size=2",
                                "eval.batch_size=4", "eval.num_samples=8", "model.logprob_chunk_size=128",
                                "rollout.placement=separate", "rollout.sync_bucket_mb=0.0078125", f"rollout.engine={engine}",
                                "rollout.vllm_memory_utilization=0.25"])
    report = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32)
    every_row = against_plan(report, config)
    assert 0.9 <= every_row["refit"]["plan_over_dry_run"] <= 1.1, every_row["refit"]
    rows = {name: row for name, row in every_row.items() if name.startswith("rollout_rank.")}
    expected = {"vllm", "sync_buckets"} if engine == "vllm" else {"weights", "kv_cache", "prefill", "sampling", "sync_buckets"}
    assert {name.removeprefix("rollout_rank.") for name in rows} == expected
    assert all(0.9 <= row["plan_over_dry_run"] <= 1.1 for row in rows.values()), rows
    two_buckets = 2 * config.rollout.bucket_bytes() / 2**30
    assert not 0.9 <= two_buckets / rows["rollout_rank.sync_buckets"]["dry_run_gib"] <= 1.1
    sent = plan.weight_sync(plan.architecture(str(model)), plan.Workload.from_config(config, 32), 25)["bytes"]
    assert sent == 4 * plan.parameter_count(plan.architecture(str(model)))  # the hf policy sends its fp32 weights


def test_vllm_holds_its_configured_share_while_it_samples_and_no_copy_beside_the_policy(tmp_path):
    """rollout.engine=vllm is not run: the dry run holds rollout.vllm_memory_utilization of the GPU while it samples
    (the refit and the rollouts), and the policy's process holds no HF copy for it."""
    report = dry(tmp_path, "rollout.engine=vllm", "rollout.vllm_memory_utilization=0.25", gpu="a100-80gb")
    phases = report["phases"]
    assert phases["rollout"]["most_by_kind_gib"]["vllm"] == pytest.approx(0.25 * 80, rel=1e-6)
    assert "vllm" not in phases["train"]["most_by_kind_gib"]  # it sleeps while the policy trains
    assert "sampler_copy" not in phases["build"]["most_by_kind_gib"] and "refit" in phases


def test_rollouts_one_step_ahead_in_a_child_process_are_one_line_not_a_traceback(capsys):
    """rollout.async_steps=1 in one process (hf's, or megatron's on one GPU): a child samples the next step beside the
    training, which one simulated process cannot show (it failed in a 60-line traceback: the stand-in tensors cannot be
    shared with a child)."""
    from helpers import one_line_error
    from nemo_jq.cli import main

    paper = str(Path(__file__).resolve().parents[3] / "configs" / "qwen3_0p6b" / "finqa_cold_garl_q0.75.yaml")
    megatron = ["model.backend=megatron", "model.activation_checkpointing=false", "megatron.recompute_activations=true"]
    for words in ([], [*megatron, "--gpus", "1"]):
        one_line_error(main(["dryrun", "--config", paper, "rollout.async_steps=1", *words]), capsys.readouterr().err,
                       "rollout.async_steps=1 with rollout.engine=native in one process: a child process samples the next "
                       "step's rollouts", "dry-run the step with rollout.async_steps=0", "nemo-jq plan --config")


def test_a_vllm_share_without_room_for_its_weights_and_a_sequence_is_refused_as_plan_refuses_it(capsys):
    """vLLM refuses to start in a share that holds less than its bf16 weights and one sequence's keys and values; the
    stand-in only holds the share, so the dry run says so in one line before it simulates, with plan's advice."""
    from helpers import one_line_error
    from nemo_jq.cli import main

    paper = str(Path(__file__).resolve().parents[3] / "configs" / "qwen3_8b" / "finqa_cold_grpo.yaml")
    one_line_error(main(["dryrun", "--config", paper, "rollout.vllm_memory_utilization=0.15"]), capsys.readouterr().err,
                   "rollout.engine=vllm does not start on the H100 80GB", "a larger rollout.vllm_memory_utilization",
                   "or rollout.placement=separate with rollout.ranks", "16.0 GiB a GPU at rollout.tensor_parallel=1")
    assert main(["plan", "--config", paper, "rollout.vllm_memory_utilization=0.15"]) == 1
    assert "nothing fits" in capsys.readouterr().out.split("16.0 GiB a GPU at rollout.tensor_parallel=1")[0]


def without_timings(report: dict) -> dict:
    """``report`` less what differs between two simulations of one run (seconds spent) or two GPUs (time bounds)."""
    kept = {key: value for key, value in report.items() if key not in ("gpu", "run_time")}
    kept["phases"] = {name: {key: value for key, value in phase.items() if key not in ("simulated_in_s", "seconds_at_least")}
                      for name, phase in report["phases"].items()}
    return kept


def small_row_chunked(tmp_path: Path):
    from helpers import small_qwen3

    model = small_qwen3(tmp_path / "model", layers=2, tied=True)
    return load_config(None, [f"model.path={model}", "rollout.num_samples=8", "rollout.max_thinking_tokens=48",
                              "rollout.max_answer_tokens=8", "train.batch_size=4", "train.micro_batch_size=2",
                              "eval.batch_size=4", "eval.num_samples=8", "model.logprob_chunk_size=128",
                              "train.micro_batch_rows=4", "model.activation_checkpointing=true"])


@pytest.mark.slow
def test_skipping_repeated_row_chunks_changes_nothing_in_the_report(tmp_path):
    """A micro-batch of 16 rows in chunks of 4: the scoring pass and the training pass each run 2 of their 4 chunks
    and count the other 2 chunks' FLOPs; every peak, kind and FLOP count equals the run of all 4 (reusing the first
    chunk's instead of the second's undercounts the training peak by the gradients it makes: seen failing)."""
    config = small_row_chunked(tmp_path)
    skipped = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32)
    every = dry_run(config, GPUS["a100-80gb"], prompt_tokens=32, skip_repeats=False)
    assert without_timings(skipped) == without_timings(every)
    assert skipped["phases"]["train"]["flops"] > 0


@pytest.mark.slow
def test_another_gpu_of_the_same_memory_changes_only_the_time_bounds(tmp_path):
    """What CI checks every config on: one simulation, on_gpu for the other profile, equal to simulating it there
    (a GPU a million times slower than an H100, so that this small shape's bounds differ before rounding)."""
    config = small_row_chunked(tmp_path)
    slow = GpuProfile("a slow 80 GB GPU", 80.0, 1e9, 1e6)
    h100 = dry_run(config, GPUS["h100-80gb"], prompt_tokens=32)
    simulated = dry_run(config, slow, prompt_tokens=32)
    moved = on_gpu(h100, config, slow)
    assert without_timings(moved) == without_timings(simulated) == without_timings(h100)
    assert moved["gpu"] == simulated["gpu"] and all(
        moved["phases"][name]["seconds_at_least"] == phase["seconds_at_least"] for name, phase in simulated["phases"].items())
    assert moved["phases"]["train"]["seconds_at_least"] > h100["phases"]["train"]["seconds_at_least"]
    assert moved["run_time"] == simulated["run_time"] != h100["run_time"]
    with pytest.raises(ValueError, match="not the 80.0 this report was simulated on"):
        on_gpu(h100, config, GpuProfile("A100 40GB", 40.0, 312e12, 1.6e12))


def test_the_dry_run_sees_a_generator_state_crossing_to_another_device_type(tmp_path, monkeypatch):
    """Issue 43's N1 seen by the dry run: a split world with vLLM on its rollout ranks carries each request's generator
    as the bridge does; on the stand-in GPU the state is a GPU generator's kind (16 bytes), so the code before N1's fix
    (a generator of the engine's device, the CPU for vLLM, fed that state) fails here as it failed on a GPU."""
    import torch

    from helpers import small_qwen3
    from nemo_jq.dryrun import split_world

    model = small_qwen3(tmp_path / "model", layers=2, tied=True)
    config = load_config(None, [f"model.path={model}", "rollout.num_samples=4", "rollout.max_thinking_tokens=16",
                                "rollout.max_answer_tokens=4", "train.batch_size=2", "train.micro_batch_size=1",
                                "eval.batch_size=2", "eval.num_samples=4", "rollout.placement=separate",
                                "rollout.engine=vllm", "rollout.vllm_memory_utilization=0.25"])
    assert dry_run(config, GPUS["a100-80gb"], prompt_tokens=16)["fits"]

    def before_the_fix(state, device):  # a521ab1's ranks.generator_from: the engine's device, whatever the state's
        generator = torch.Generator(device)
        generator.set_state(state[1])
        return generator

    monkeypatch.setattr(split_world, "generator_from", before_the_fix)
    with pytest.raises(RuntimeError, match="Expected a CPUGeneratorImplState of size 5056 but found the input RNG "
                                           "state size to be 16"):
        dry_run(config, GPUS["a100-80gb"], prompt_tokens=16)


def test_the_dry_run_resolves_auto_row_chunks_as_train_does_and_they_fit(tmp_path):
    """``train.micro_batch_rows=auto``: the dry run takes the rows plan's memory model fits on its GPU profile (as
    `nemo-jq train` does on a real GPU), says them, and the step it simulates with them fits."""
    from helpers import small_qwen3
    from nemo_jq.cluster.plan import auto_micro_batch_rows
    from nemo_jq.dryrun.report import format_report

    model = small_qwen3(tmp_path / "model", layers=2, tied=True)
    config = load_config(None, [f"model.path={model}", "rollout.num_samples=8", "rollout.max_thinking_tokens=48",
                                "rollout.max_answer_tokens=8", "train.batch_size=4", "train.micro_batch_size=2",
                                "eval.batch_size=4", "eval.num_samples=8", "train.micro_batch_rows=auto"])
    gpu = dataclasses.replace(GPUS["a100-80gb"], memory_gib=0.1)  # a GPU small enough that fewer rows than 16 fit
    expected = auto_micro_batch_rows(config, 32, gpu.memory_gib)[0]
    report = dry_run(config, gpu, prompt_tokens=32)
    assert report["micro_batch_rows"] == expected and 1 <= expected < 16 and report["fits"]
    assert f"train.micro_batch_rows=auto: {expected}" in format_report(report)
    assert config.train.micro_batch_rows == "auto"  # the caller's config is left as it was


def test_a_whole_runs_time_is_its_steps_and_evaluations_at_the_bounds_and_at_the_measured_fractions(tmp_path):
    """10 steps, validations at steps 4, 8 and 10 and a test split half the validation's: 3.5 evaluations. At least:
    the phases' bounds so many times; expected: the sampling bounds over the native decode's measured share of its
    bound, training's over the hf backend's MFU (the optimizer step's bound as it is); vLLM's is not measured."""
    from nemo_jq.dryrun.bounds import MEASURED

    slow = GpuProfile("a slow 80 GB GPU", 80.0, 1e9, 1e6)  # bounds of hours at this small shape
    config = load_config(None, ["train.batch_size=4", "train.micro_batch_size=2", "eval.batch_size=4",
                                "train.max_steps=10", "eval.every=4", "data.validation_size=8", "data.test_size=4"])
    report = dry_run(config, slow, prompt_tokens=24)
    bound = {name: report["phases"][name]["seconds_at_least"] for name in ("rollout", "train", "optimizer_step", "evaluate")}
    timed = report["run_time"]
    assert (timed["steps"], timed["evaluations"], timed["gpus"], timed["not_measured"]) == (10, 3.5, 1, [])
    least = 10 * (bound["rollout"] + bound["train"] + bound["optimizer_step"]) + 3.5 * bound["evaluate"]
    decode, train = MEASURED[("rollout", "native")][0], MEASURED[("train", "hf")][0]
    expected = 10 * (bound["rollout"] / decode + bound["train"] / train + bound["optimizer_step"]) + 3.5 * bound["evaluate"] / decode
    assert timed["hours_at_least"] == round(least / 3600, 1) > 0 and timed["hours_expected"] == round(expected / 3600, 1)
    line = format_report(report).splitlines()
    assert timed["validations"] == 3
    assert any(text.startswith("the run: 10 steps, 3 validations and the test split (3.5 validations' worth of "
                               "evaluating) take at least")
               and "rollout and evaluate at 0.42 of the bound" in text for text in line)
    vllm = dry_run(load_config(None, ["train.batch_size=4", "train.micro_batch_size=2", "eval.batch_size=4",
                                      "train.max_steps=10", "rollout.engine=vllm"]), slow, prompt_tokens=24)
    assert vllm["run_time"]["not_measured"] == ["rollout", "evaluate"] and "hours_expected" not in vllm["run_time"]


def test_the_measured_fractions_are_the_ones_bench_results_real_gpu_json_holds():
    from nemo_jq.dryrun.bounds import MEASURED

    runs = json.loads((ROOT / "bench" / "results" / "real_gpu.json").read_text())["runs"]
    run = next(value for key, value in runs.items() if key.startswith("run 9 "))
    decode = run["decode"]["paper_chunk"]["by_context"]["3072"]
    measured = {("rollout", "native"): decode["graphs_matmul_compiled"]["bound_over_measured"],
                ("rollout", "native, uncompiled"): decode["graphs_matmul"]["bound_over_measured"],
                ("rollout", "native, eager"): decode["eager"]["bound_over_measured"],
                ("train", "hf"): run["train_chunk2048"]["chunk_2048"]["mfu"],
                ("train", "hf, compiled"): run["train_chunk2048_compiled_layers"]["chunk_2048"]["mfu"]}
    assert {key: round(value, 4) for key, value in measured.items()} == {key: entry[0] for key, entry in MEASURED.items()}
