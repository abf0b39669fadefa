"""`nemo-jq plan` against numbers computed by hand from the Qwen3 configs."""

from __future__ import annotations

import json

import pytest

from nemo_jq import plan
from nemo_jq.cli import main

GB = 1024**3


def test_parameter_counts_match_the_released_shapes():
    # 0.6B (tied): embedding 151936*1024 + 28 layers * (q 1024*2048 + k, v 1024*1024 each + o 2048*1024
    # + MLP 3*1024*3072 + norms 2*1024 + 2*128) + final norm 1024
    assert plan.parameter_count(plan.architecture("0.6b")) == 155_582_464 + 28 * 15_730_944 + 1024 == 596_049_920
    # 8B (untied): 2 * 151936*4096 + 36 * (2*4096*4096 + 2*4096*1024 + 3*4096*12288 + 2*4096 + 2*128) + 4096
    assert plan.parameter_count(plan.architecture("Qwen3-8B")) == 2 * 622_329_856 + 36 * 192_946_432 + 4096


def test_an_8b_layout_by_hand():
    """TP=2, PP=1, DP=8 on 16 GPUs, bf16 weights with the distributed optimizer, 4096 tokens, M=32, 64 prompts."""
    work = plan.Workload(optimizer="bf16-distopt")
    got = plan.estimate(plan.architecture("8b"), work, tp=2, pp=1, dp=8, gpu_gb=80, headroom=0.9)
    params = 8_190_735_360
    assert got.weights_gb == round(2 * params / 2 / GB, 2)
    assert got.gradients_gb == round(4 * params / 2 / GB, 2)
    assert got.optimizer_gb == round(12 * params / 2 / 8 / GB, 2)
    # per layer: 2 bytes * 4096 tokens * (4*4096/2 norm terms + (2*(4096+2*1024) + 4096 + 3*12288)/2) = 285,212,672
    assert got.activations_gb == round(36 * 285_212_672 / GB, 2)
    assert got.logprob_head_gb == round(2 * 2 * 4096 * 75_968 / GB, 2)
    # K and V, bf16, 36 layers x 8 heads x 128, 4096 tokens, (64/8 prompts) x 32 samples
    kv = 2 * 2 * 36 * 8 * 128 * 4096 * 256
    assert got.kv_cache_gb == round(kv / GB, 2) == 144.0
    assert got.total_gb == round((params + 12 * params / 16 + 4 * params + kv) / GB, 2)  # the KV cache is the larger phase
    assert not got.fits


def test_recomputation_and_sequence_parallel_shrink_activations_only():
    arch = plan.architecture("0.6b")
    base = plan.estimate(arch, plan.Workload(), 2, 1, 4, 80, 0.9)
    recompute = plan.estimate(arch, plan.Workload(recompute=True), 2, 1, 4, 80, 0.9)
    no_sp = plan.estimate(arch, plan.Workload(sequence_parallel=False), 2, 1, 4, 80, 0.9)
    assert recompute.activations_gb < base.activations_gb < no_sp.activations_gb
    assert recompute.weights_gb == base.weights_gb == no_sp.weights_gb


def test_context_parallel_splits_the_tokens_and_the_distributed_optimizer_state():
    """CP=2 on 16 GPUs at TP=2: each rank holds half of every sequence's activations and log-prob rows, and the
    distributed optimizer shards over DP x CP = 8; weights are whole per TP rank, as without CP."""
    arch, work = plan.architecture("8b"), plan.Workload(optimizer="bf16-distopt", seq_len=32768)
    base = plan.estimate(arch, work, tp=2, pp=1, dp=8, gpu_gb=80, headroom=0.9)
    split = plan.estimate(arch, plan.Workload(optimizer="bf16-distopt", seq_len=32768, context_parallel=2), tp=2, pp=1,
                          dp=4, gpu_gb=80, headroom=0.9)
    assert split.weights_gb == base.weights_gb and split.optimizer_gb == base.optimizer_gb
    assert split.activations_gb == pytest.approx(base.activations_gb / 2, abs=0.01)
    assert split.logprob_head_gb == pytest.approx(base.logprob_head_gb / 2, abs=0.01)
    layouts = plan.plan(arch, plan.Workload(context_parallel=4), gpus_per_node=8, nodes=2, gpu_gb=80)
    assert all(e.tensor_parallel * e.pipeline_parallel * e.data_parallel * 4 == 16 for e in layouts)
    with pytest.raises(ValueError, match="no TP x PP x DP layout of 8 GPUs at CP=16"):
        plan.plan(arch, plan.Workload(context_parallel=16), gpus_per_node=8, nodes=1, gpu_gb=80)


def test_only_feasible_layouts_are_listed_and_the_recommendation_fits():
    arch = plan.architecture("0.6b")
    layouts = plan.plan(arch, plan.Workload(samples=8, batch_prompts=8, seq_len=1024), gpus_per_node=8, nodes=1, gpu_gb=80)
    assert all(16 % e.tensor_parallel == 0 and 28 % e.pipeline_parallel == 0 for e in layouts)
    assert all(e.tensor_parallel * e.pipeline_parallel * e.data_parallel == 8 for e in layouts)
    assert layouts[0].fits and layouts[0].data_parallel == 8 and layouts[0].tensor_parallel == 1


def test_cli_prints_a_table_or_json_and_names_bad_input(capsys):
    assert main(["plan", "--model", "8b", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "8.191B parameters" in out and "nothing fits in 72 GB" in out
    assert main(["plan", "--model", "0.6b", "--gpus-per-node", "1", "--samples", "8", "--batch-prompts", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recommended"]["total_gb"] <= 72 and result["parameters"] == 596_049_920
    assert main(["plan", "--model", "0.6b", "--nodes", "2", "--context-parallel", "2", "--seq-len", "32768", "--samples", "4",
                 "--batch-prompts", "8"]) == 0
    assert "recommended: TP=1 PP=1 CP=2 DP=8" in capsys.readouterr().out
    assert main(["plan", "--model", "9b"]) == 2
    assert "--model '9b' is neither a Qwen3 size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "8b", "--nodes", "0"])
    for memory in ("-1", "0", "nan", "inf", "eighty"):
        with pytest.raises(SystemExit):
            main(["plan", "--model", "8b", "--gpu-memory", memory])
        assert f"--gpu-memory: must be a number of GB > 0; got '{memory}'" in capsys.readouterr().err
