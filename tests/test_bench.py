"""The benchmark script stays runnable (timings are not asserted: they belong to bench/, not tests)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_run(tmp_path, script: str, *options: str) -> dict:
    """Run ``bench/SCRIPT --quick`` and return the JSON it wrote."""
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, f"bench/{script}", "--quick", *options, "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_step_overhead_quick_run_writes_every_ratio(tmp_path):
    report = quick_run(tmp_path, "step_overhead.py", "--skip-trl")
    assert set(report["step_seconds"]) == {"rb_rloo", "garl_q0.75", "paft_q0.75", "grpo"}
    assert all(v > 0 for v in report["ratios"].values())
    assert report["memory"]["naive_peak_gb"] > report["memory"]["chunked_peak_gb"] > 0
    assert "garl_within_2pct_of_rb_rloo" in report["targets_met"]
    for ratio in report["paired_step_ratios"].values():
        assert 0 < ratio["ci95_low"] <= ratio["median"] <= ratio["ci95_high"]
    assert all(0 < share < 1 for share in report["estimator_share_of_step"].values())


def test_megatron_backend_quick_run_writes_memory_and_step_ratio(tmp_path):
    report = quick_run(tmp_path, "megatron_backend.py")
    memory = report["head_memory"]
    assert memory["tp1_peak_gb"] > memory["tp2_peak_gb_per_rank"] > 0
    assert memory["tp2_over_tp1"] == memory["tp2_peak_gb_per_rank"] / memory["tp1_peak_gb"]
    ratio = report["megatron_tp1_over_hf_step"]
    assert 0 < ratio["ci95_low"] <= ratio["median"] <= ratio["ci95_high"]
    assert report["step_seconds"]["megatron_tp1"] > 0 and report["step_seconds"]["hf"] > 0


def test_rollouts_quick_run_writes_every_engines_rate_and_ratio(tmp_path):
    report = quick_run(tmp_path, "rollouts.py")
    [case] = report["models"][0]["cases"].values()
    assert set(case["tokens_per_s"]) == {"native", "hf", "generate"} and all(v > 0 for v in case["tokens_per_s"].values())
    for key in ("native_over_hf", "native_over_generate", "hf_over_generate"):
        assert 0 < case[key]["ci95_low"] <= case[key]["median"] <= case[key]["ci95_high"]
    # the engines sample the same distribution: their mean lengths agree (native and hf exactly, same seeds)
    assert case["mean_rationale_tokens"]["native"] == case["mean_rationale_tokens"]["hf"]
    assert report["sampling_step"]["inverse_cdf_s"] > 0


def test_rollouts_bandwidth_bound_counts_weights_and_live_kv_per_step_and_gpu_mode_needs_cuda():
    sys.path.insert(0, str(ROOT / "bench"))
    from rollouts import bandwidth_bound_seconds, build_model

    model = build_model(vocab=40, hidden=16, layers=2)
    weights = sum(p.numel() for p in model.parameters()) * 2
    kv_per_token = 2 * 2 * model.config.num_key_value_heads * model.config.head_dim * 2
    # rows of 2 and 1 new tokens after a 3-token prompt: step 0 reads both rows' 3 cached tokens, step 1 one row's 4
    expected = (weights + kv_per_token * 2 * 3) + (weights + kv_per_token * 1 * 4)
    assert bandwidth_bound_seconds(model, 3, [2, 1], 2, 10.0) == expected / 10.0
    if not __import__("torch").cuda.is_available():
        result = subprocess.run([sys.executable, "bench/rollouts.py", "--gpu"], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode != 0 and "--gpu needs a CUDA device" in result.stderr
