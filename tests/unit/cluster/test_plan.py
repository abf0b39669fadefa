"""`nemo-jq plan` against numbers computed by hand from the Qwen3 configs."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from nemo_jq.cli import main
from nemo_jq.cluster import plan
from nemo_jq.config import load_config

GiB = 1024**3


def test_parameter_counts_match_the_released_shapes():
    # 0.6B (tied): embedding 151936*1024 + 28 layers * (q 1024*2048 + k, v 1024*1024 each + o 2048*1024
    # + MLP 3*1024*3072 + norms 2*1024 + 2*128) + final norm 1024
    assert plan.parameter_count(plan.architecture("0.6b")) == 155_582_464 + 28 * 15_730_944 + 1024 == 596_049_920
    # 8B (untied): 2 * 151936*4096 + 36 * (2*4096*4096 + 2*4096*1024 + 3*4096*12288 + 2*4096 + 2*128) + 4096
    assert plan.parameter_count(plan.architecture("Qwen3-8B")) == 2 * 622_329_856 + 36 * 192_946_432 + 4096


def test_a_qwen3_moe_layout_by_hand(capsys):
    """Qwen3-30B-A3B at TP=2 (SP), EP=8, DP=32: each rank holds half the dense weights and an eighth of the experts,
    the dense AdamW state over DP x CP (32) and the experts' over the expert-DP ranks (TP x DP / EP = 8)."""
    arch = plan.architecture("Qwen/Qwen3-30B-A3B")
    # experts: 48 layers x 128 x 3 x 2048 x 768; the rest: embedding and head, 48 x (q 2048*4096 + k, v 2048*512 each
    # + o 4096*2048 + router 128*2048 + norms 2*2048 + 2*128), final norm
    experts, dense = 48 * 128 * 3 * 2048 * 768, 2 * 151936 * 2048 + 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 128 * 2048
                                                                           + 2 * 2048 + 2 * 128) + 2048
    assert plan.expert_parameters(arch) == experts and plan.parameter_count(arch) == experts + dense == 30_532_122_624
    work = plan.Workload(optimizer="bf16-distopt", expert_parallel=8)
    got = plan.estimate(arch, work, tp=2, pp=1, dp=32, gpu_gb=80, headroom=0.9)
    per_rank = dense / 2 + experts / 8
    assert (got.weights_gib, got.gradients_gib, got.expert_parallel) == (round(2 * per_rank / GiB, 2),
                                                                         round(4 * per_rank / GiB, 2), 8)
    assert got.optimizer_gib == round(12 * (dense / 2 / 32 + experts / 8 / 8) / GiB, 2)
    assert main(["plan", "--model", "30b-a3b", "--nodes", "8", "--gpus-per-node", "8", "--rollout-engine", "vllm",
                 "--rollout-tensor-parallel", "2", "--optimizer", "bf16-distopt", "--recompute"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:4] == ["TP", "PP", "DP", "EP"]
    assert "recommended: TP=2 PP=1 DP=32 EP=8" in out and "megatron.expert_parallel=8" in out


def test_an_8b_layout_by_hand():
    """TP=2, PP=1, DP=8 on 16 GPUs, bf16 weights with the distributed optimizer, 4096 tokens, M=32, 64 prompts, the
    native sampler (one bf16 HF copy on the sampling rank, a KV cache of at most 131072 tokens)."""
    work = plan.Workload(optimizer="bf16-distopt")
    got = plan.estimate(plan.architecture("8b"), work, tp=2, pp=1, dp=8, gpu_gb=80, headroom=0.9)
    params = 8_190_735_360
    assert got.weights_gib == round(2 * params / 2 / GiB, 2)
    assert got.gradients_gib == round(4 * params / 2 / GiB, 2)  # the fp32 gradient buffer: it stays all run
    assert got.optimizer_gib == round(12 * params / 2 / 8 / GiB, 2)
    # per layer: 2 bytes * 4096 tokens * (4*4096/2 norm terms + (2*(4096+2*1024) + 4096 + 3*12288)/2) = 285,212,672
    assert got.activations_gib == round(36 * 285_212_672 / GiB, 2)
    # chunked: the hidden states' bf16 gradient, the V/TP weight slice's fp32 gradient and its bf16 copy returned (larger
    # than the loop's chunks of 256 positions' logits)
    assert got.logprob_head_gib == round((2 * 4096 * 4096 + 4 * 75_968 * 4096 + 2 * 75_968 * 4096) / GiB, 2)
    assert got.rollout_copy_gib == round(2 * params / GiB, 2)  # the whole model, bf16
    # K and V, bf16, 36 layers x 8 heads x 128, for 131072 tokens (the replica's 8 prompts x 32 x 4096 are 1048576)
    # (the answer phase's 32 rows of 4096; a thinking chunk is one prompt's 32 x 4095), and a decode step's copies of
    # one of the 36 layers' keys or values (3 buffers)
    kv = 2 * 2 * 36 * 8 * 128 * 131072 * (1 + 3 / 72)
    assert got.kv_cache_gib == round(kv / GiB, 2) == 18.75 and got.vllm_gib == 0
    # an evaluation's answer phase prefills its 32 rows of 4096 beside that cache: 3 MLP and 5 query widths of bf16 a
    # position in the sampler's bf16 copy
    prefill = 2 * 32 * 4096 * (3 * 12288 + 5 * 32 * 128)
    assert got.prefill_gib == round(prefill / GiB, 2)
    staying = params + 2 * params + 12 * params / 16 + 2 * params  # weights, gradient buffer, optimizer, rollout copy
    assert got.total_gib == round((staying + kv + prefill) / GiB, 2) == 76.61  # the sampling phase is the larger
    assert not got.fits and got.largest == "kv_cache"


def test_a_06b_paper_config_by_hand():
    """The paper's 0.6B runs (4096 thinking tokens, M=32, 64 prompts) on one node, plain AdamW, TP=1 DP=8."""
    work = plan.Workload(seq_len=4608, samples=32)
    got = plan.estimate(plan.architecture("0.6b"), work, tp=1, pp=1, dp=8, gpu_gb=80, headroom=0.9)
    params = 596_049_920
    # at most 131072 tokens, but one prompt's 32 rows of prompt + thinking (4607) at least; a decode step's copies
    kv = 2 * 2 * 28 * 8 * 128 * 32 * 4607 * (1 + 3 / 56)
    per_layer = 2 * 4608 * (4 * 1024 + (2 * (2048 + 2 * 1024) + 2048 + 3 * 3072))
    training = 4 * params + 28 * per_layer + 2 * 2 * 4608 * 151936
    staying = 4 * params + 8 * params + 2 * params
    # an evaluation's answer phase (32 prompts x 16): 28 rows of 4608 (the cap), their keys and values and the prefill
    # of the sampler's bf16 copy beside them (3 MLP and 5 query widths a position)
    answering = 2 * 2 * 28 * 8 * 128 * 28 * 4608 * (1 + 3 / 56) + 2 * 28 * 4608 * (3 * 3072 + 5 * 2048)
    assert got.kv_cache_gib == round(kv / GiB, 2) and got.activations_gib == round(28 * per_layer / GiB, 2)
    assert got.total_gib == round((staying + max(training, kv, answering)) / GiB, 2) and got.fits


def test_a_32b_shape_needs_vllm_on_16_nodes_and_plan_says_so():
    """Qwen3-32B (64 layers, hidden 5120, MLP 25600, 64 heads) on 16 nodes x 8 x 80 GiB, bf16 distributed optimizer,
    recomputation, 4608 tokens, M=16, 64 prompts: the native sampler's HF copy (61 GiB) fits nowhere beside the
    training state; with vLLM at TP=8 the best layout is TP=8 DP=16, its peak the refit's: vLLM's share and the
    gathered embedding."""
    arch = plan.architecture("32b")
    params = plan.parameter_count(arch)
    assert params == 2 * 151936 * 5120 + 64 * (5120 * 64 * 128 * 2 + 5120 * 8 * 128 * 2 + 3 * 5120 * 25600 + 2 * 5120
                                               + 2 * 128) + 5120
    work = plan.Workload(seq_len=4608, samples=16, optimizer="bf16-distopt", recompute=True)
    native = plan.plan(arch, work, gpus_per_node=8, nodes=16, gpu_gb=80)
    assert not native[0].fits and native[0].largest == "rollout_copy" and "--rollout-engine vllm" in native[0].advice
    vllm = plan.plan(arch, plan.Workload(seq_len=4608, samples=16, optimizer="bf16-distopt", recompute=True,
                                         rollout_engine="vllm", vllm_tensor_parallel=8), gpus_per_node=8, nodes=16, gpu_gb=80)
    best = vllm[0]
    assert (best.tensor_parallel, best.pipeline_parallel, best.data_parallel, best.fits) == (8, 1, 16, True)
    per_rank = params / 8
    tokens = 4608
    inputs = 2 * tokens * 5120 / 8  # recomputation keeps each layer's bf16 input (split over TP by SP)
    layer = 2 * tokens * (4 * 5120 / 8 + (2 * (8192 + 2 * 1024) + 8192 + 3 * 25600) / 8)
    staying = 2 * per_rank + 4 * per_rank + 12 * per_rank / 16
    training = 64 * inputs + layer + 2 * 2 * tokens * 18992
    refit = 2 * 151936 * 5120 * 2  # the embedding gathered whole in bf16, and the HF tensor merged from its slices
    assert best.total_gib == round((staying + max(training, refit + 0.5 * 80 * GiB)) / GiB, 2)


def test_recomputation_and_sequence_parallel_shrink_activations_only():
    arch = plan.architecture("0.6b")
    base = plan.estimate(arch, plan.Workload(), 2, 1, 4, 80, 0.9)
    recompute = plan.estimate(arch, plan.Workload(recompute=True), 2, 1, 4, 80, 0.9)
    no_sp = plan.estimate(arch, plan.Workload(sequence_parallel=False), 2, 1, 4, 80, 0.9)
    assert recompute.activations_gib < base.activations_gib < no_sp.activations_gib
    assert recompute.weights_gib == base.weights_gib == no_sp.weights_gib


def test_context_parallel_splits_the_tokens_and_the_distributed_optimizer_state():
    """CP=2 on 16 GPUs at TP=2: each rank holds half of every sequence's activations and log-prob positions, and the
    distributed optimizer shards over DP x CP = 8; weights are whole per TP rank, as without CP."""
    arch, work = plan.architecture("8b"), plan.Workload(optimizer="bf16-distopt", seq_len=32768)
    base = plan.estimate(arch, work, tp=2, pp=1, dp=8, gpu_gb=80, headroom=0.9)
    split = plan.estimate(arch, plan.Workload(optimizer="bf16-distopt", seq_len=32768, context_parallel=2), tp=2, pp=1,
                          dp=4, gpu_gb=80, headroom=0.9)
    assert split.weights_gib == base.weights_gib and split.optimizer_gib == base.optimizer_gib
    assert split.activations_gib == pytest.approx(base.activations_gib / 2, abs=0.01)
    # the head's hidden-state gradient covers this rank's half of the positions; its weight and chunks are whole
    assert split.logprob_head_gib == pytest.approx(base.logprob_head_gib - 2 * 32768 * 4096 / 2 / GiB, abs=0.01)
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
    assert "8.191B parameters" in out and "recommended: TP=1 PP=4 DP=4" in out
    first = out.splitlines()[0]  # the workload in words, not a Python dict
    assert "{" not in first and "seq len 4096, micro batch 1, samples 32" in first
    assert main(["plan", "--model", "32b", "--nodes", "16", "--seq-len", "4608", "--samples", "16", "--optimizer",
                 "bf16-distopt", "--recompute"]) == 1  # the new user's command: nothing fits, so a script stops
    assert ("nothing fits in 72 GiB: the closest layout" in (out := capsys.readouterr().out)
            and "most of it the rollout copy" in out and "try --rollout-engine vllm" in out)
    assert "total GiB" in out and " GB" not in out
    assert main(["plan", "--model", "0.6b", "--gpus-per-node", "1", "--samples", "8", "--batch-prompts", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recommended"]["total_gib"] <= 72 and result["parameters"] == 596_049_920
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
        assert f"--gpu-memory: must be a number of GiB > 0; got '{memory}'" in capsys.readouterr().err



def test_rows_beyond_the_models_context_are_refused_as_train_refuses_them(capsys, tmp_path):
    """A plan or dry run of rows longer than the model's context (which train refuses) reported them as fitting;
    a config's unknown model.path was blamed on --model, which was not given."""
    from helpers import one_line_error

    paper = "configs/qwen3_0p6b/finqa_cold_garl_q0.75.yaml"
    one_line_error(main(["plan", "--config", paper, "--gpus-per-node", "1", "rollout.max_thinking_tokens=60000"]),
                   capsys.readouterr().err, "rows of 61153 tokens, beyond the model's context of 40960 tokens "
                   "(max_position_embeddings of Qwen/Qwen3-0.6B)", "lower rollout.max_thinking_tokens")
    assert main(["plan", "--config", paper, "--gpus-per-node", "1", "--prompt-tokens", "35000"]) == 1  # 40,225: in the context
    # (not refused), but past one GPU's memory
    capsys.readouterr()
    one_line_error(main(["plan", "--model", "8b", "--seq-len", "50000"]), capsys.readouterr().err,
                   "--seq-len is 50000 tokens, beyond the model's context of 40960 tokens (max_position_embeddings of 8b): "
                   "lower --seq-len")
    one_line_error(main(["dryrun", "--config", "configs/examples/synthetic_cold_paft_q0.75.yaml",
                         "rollout.max_thinking_tokens=2000"]), capsys.readouterr().err,
                   "beyond the model's context of 512 tokens (model.tiny.max_position_embeddings)")
    # what a plan without a config does not read, and a config's layout this model cannot take, are refused
    one_line_error(main(["plan", "--model", "8b", "--gpu", "foo", "--prompt-tokens", "100"]), capsys.readouterr().err,
                   "--prompt-tokens: read with --config only")
    one_line_error(main(["plan", "--model", "8b", "--gpu", "a100-80gb"]), capsys.readouterr().err,
                   "--gpu: the GPU whose peaks time the run", "--gpu-memory gives the memory")
    # a micro-batch of more rows than a step has: its activations were counted for 1,000 rows of a 32-row step
    one_line_error(main(["plan", "--model", "0.6b", "--samples", "8", "--batch-prompts", "4", "--micro-batch", "1000"]),
                   capsys.readouterr().err, "--micro-batch 1000 is more rows than a step trains (--samples 8 x "
                   "--batch-prompts 4 = 32): give at most that many")
    one_line_error(main(["plan", "--config", "configs/qwen3_8b/finqa_cold_garl_q0.75.yaml", "--optimizer", "fp32-adamw",
                         "--micro-batch", "2"]), capsys.readouterr().err,
                   "--micro-batch (train.micro_batch_rows), --optimizer (megatron.distributed_optimizer, "
                   "megatron.bf16_weights, megatron.optimizer_cpu_offload): --config gives the workload")
    from nemo_jq.cli.plan import CONFIG_KEYS, PLAN_WORKLOAD

    assert set(CONFIG_KEYS) == set(PLAN_WORKLOAD)  # every workload flag names the keys it stands for
    assert plan.architecture("Qwen/Qwen3-8B-Base") == plan.architecture("8b")  # a release of a size's shape
    assert plan.architecture("Qwen/Qwen3-30B-A3B-Instruct-2507") == plan.architecture("30b-a3b")
    one_line_error(main(["plan", "--config", "configs/qwen3_8b/finqa_cold_garl_q0.75.yaml", "megatron.tensor_parallel=3"]),
                   capsys.readouterr().err, "num_attention_heads=32")
    unknown = tmp_path / "nine.yaml"
    unknown.write_text("model: {path: Qwen/Qwen3-9B}\n")
    one_line_error(main(["plan", "--config", str(unknown)]), capsys.readouterr().err,
                   f"{unknown}: model.path 'Qwen/Qwen3-9B' is neither a Qwen3 size")

def test_the_readmes_plan_commands_say_what_they_print(capsys, monkeypatch):
    """Each ``nemo-jq plan`` command with a layout in its comment, in README.md and docs/ (docs/cluster.md has five, docs/moe.md two),
    run as written from the repository root, recommends the layout its comment says, to the GiB figure."""
    import re
    import shlex
    from pathlib import Path

    import doc_pages

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    text = doc_pages.text()
    commands = re.findall(r"^nemo-jq (plan .*?)\s+# (TP=\d+ PP=\d+ DP=\d+(?: EP=\d+)? \([\d.]+ of \d+ GiB\))$", text,
                          flags=re.M)
    assert len(commands) >= 3, commands
    for command, comment in commands:
        assert main(shlex.split(command)) == 0, command
        assert f"recommended: {comment}" in capsys.readouterr().out, command
    timed = re.findall(r"^nemo-jq (plan .*?)\s+# the run: at least ([\d.]+) h(?:, expected ([\d.]+) h)?$", text, flags=re.M)
    assert len(timed) >= 2, timed
    for command, least, expected in timed:
        assert main(shlex.split(command)) == 0, command
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("the run: "))
        assert f"take at least {least} h" in line and (f"; expected {expected} h" in line if expected else
                                                       "expected: not measured" in line), (command, line)


def test_advice_never_names_a_change_that_raises_the_figure():
    """8B on three GPUs: the bf16 distributed optimizer at DP=1 holds 18 bytes a parameter against plain AdamW's 16,
    so it is not advised (it was: 77.38 -> 82.47 GiB), but its state offloaded to the host is; whatever is advised
    lowers the closest layout's figure."""
    arch = plan.architecture("8b")
    work = plan.Workload()
    closest = plan.plan(arch, work, gpus_per_node=3, nodes=1, gpu_gb=80)[0]
    assert not closest.fits and closest.largest == "optimizer" and "--optimizer bf16-distopt " not in closest.advice
    assert closest.advice.startswith("--optimizer bf16-distopt-offload"), closest
    for layout_estimate in plan.plan(arch, work, gpus_per_node=8, nodes=1, gpu_gb=80, headroom=0.1):
        for text, changed in plan.remedies(layout_estimate.largest, work):
            if text == layout_estimate.advice and changed is not None:
                lowered = plan.estimate(arch, changed, layout_estimate.tensor_parallel,
                                        layout_estimate.pipeline_parallel, layout_estimate.data_parallel, 80, 0.1)
                assert lowered.total_gib < layout_estimate.total_gib, (text, layout_estimate)


def test_the_recommendations_overrides_train_that_layout(tmp_path, capsys):
    """``plan``'s ``overrides:`` line, given to a run config, is the workload and layout it recommended: planning that
    config again at the same layout gives the same figure."""
    from nemo_jq.config import load_config

    assert main(["plan", "--config", "configs/qwen3_8b/finqa_cold_garl_q0.75.yaml"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("overrides: "))
    recommended = next(line for line in out.splitlines() if line.startswith("recommended: "))
    config = load_config("configs/qwen3_8b/finqa_cold_garl_q0.75.yaml", line.removeprefix("overrides: ").split())
    layout = config.megatron
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    again = plan.estimate(plan.architecture(config.model.path), plan.Workload.from_config(config, 1024), tp, pp,
                          8 // (tp * pp), 80, 0.9)
    assert f"TP={layout.tensor_parallel} PP={layout.pipeline_parallel} DP={again.data_parallel} ({again.total_gib} of" in recommended


def test_a_peak_counts_the_optimizer_step_where_foreach_adamw_holds_the_square_root_of_v_at_once():
    """Measured on an H100 (bench/results/real_gpu.json): 0.6B steps peaked in their optimizer step, at weights +
    gradients + AdamW's state + sqrt(v) for every parameter at once with either backend's replicated AdamW (hf 11.22
    GiB, megatron 12.28 with its sampler's copy), and at the state + sqrt(v) of the distributed optimizer's shard."""
    parts = dict.fromkeys(plan.COMPONENTS, 0.0)
    parts.update(weights=4 * GiB, gradients=4 * GiB, optimizer=8 * GiB, activations=1 * GiB, kv_cache=2 * GiB,
                 sampling=2 * GiB)
    for backend in ("hf", "megatron"):
        peak, largest = plan._peak(parts, plan.Workload(backend=backend), 1)
        assert peak == 4 + 8 + 4 + 4 and largest == "optimizer"
    parts["kv_cache"] = parts["sampling"] = 9 * GiB
    assert plan._peak(parts, plan.Workload(backend="hf"), 1)[0] == 4 + 8 + 9  # the rollouts' is larger still
    parts.update(weights=2 * GiB, optimizer=12 * GiB, kv_cache=0.0, sampling=0.0)  # the distributed optimizer's master and moments
    assert plan._peak(parts, plan.Workload(backend="megatron", optimizer="bf16-distopt"), 1)[0] == 2 + 12 + 4 + 4


def test_rollout_ranks_of_their_own_take_the_sampler_off_the_training_layouts_and_are_planned_themselves(capsys, tmp_path):
    """``rollout.placement=separate``: the layouts are of the training GPUs (16 - 8 here), whose ranks hold no rollout
    copy or KV cache; a rollout rank holds the bf16 model, the KV cache of one replica's request, and the untied head
    put together from its buckets beside two of them; each step sends the model as the policy holds it, bf16 with bf16-distopt
    and fp32 otherwise (numbers by hand for the 8B)."""
    arch, params = plan.architecture("8b"), 8_190_735_360
    colocated = plan.Workload(optimizer="bf16-distopt", recompute=True)
    separate = plan.Workload(optimizer="bf16-distopt", recompute=True, rollout_ranks=8, sync_bucket_mb=64)
    trainers = plan.plan(arch, separate, gpus_per_node=8, nodes=2, gpu_gb=80)
    assert {e.tensor_parallel * e.pipeline_parallel * e.data_parallel for e in trainers} == {8}
    assert all(e.rollout_copy_gib == e.kv_cache_gib == e.vllm_gib == 0 for e in trainers)
    same = plan.estimate(arch, colocated, 2, 1, 4, 80, 0.9)
    split = plan.estimate(arch, separate, 2, 1, 4, 80, 0.9)
    assert (split.weights_gib, split.optimizer_gib, split.activations_gib) == (same.weights_gib, same.optimizer_gib,
                                                                              same.activations_gib)
    assert split.total_gib < same.total_gib
    result = plan.report(arch, separate, trainers, 80, 0.9, sync_gb_s=50)
    kv = 2 * 2 * 36 * 8 * 128 * 131072 * (1 + 3 / 72)  # 8 prompts x 32 rows per replica: the 131072-token cap
    receiving = 2 * 64 * 2**20 + 151936 * 4096 * 2  # the untied bf16 head put together, its last bucket and the one before
    # the answer phase's prefill of a chunk of 32 rows (the cap over 4,096-token rows) at once: 3 MLP and 5 query widths
    prefill = 2 * 32 * 4096 * (3 * 12288 + 5 * 32 * 128)
    # (both in the answer phase: the thinking phase's chunk, one prompt's 32 rows of 4,095, holds fewer keys and values)
    assert result["rollout_rank"] == {"weights": round(2 * params / GiB, 2), "kv_cache": round(kv / GiB, 2),
                                      "prefill": round(prefill / GiB, 2), "sampling": round((kv + prefill) / GiB, 2),
                                      "sync_buckets": round(receiving / GiB, 2), "fits": True,
                                      "total": round(round(2 * params / GiB, 2) + round((kv + prefill) / GiB, 2) + 1.28, 2)}
    assert result["weight_sync"] == {"bytes": 2 * params, "buckets": -(-2 * params // (64 * 2**20)), "gb_per_s": 50,
                                     "seconds": 2 * params / 50e9}
    fp32 = plan.weight_sync(arch, plan.Workload(optimizer="fp32-adamw", rollout_ranks=8), 50)  # fp32 weights, fp32 sent
    assert fp32["bytes"] == 4 * params
    assert result["overrides"].endswith("rollout.placement=separate rollout.ranks=8")

    code = main(["plan", "--config", "configs/qwen3_8b/finqa_cold_garl_q0.75.yaml", "--nodes", "2",
                 "rollout.placement=separate", "rollout.ranks=8", "rollout.engine=native"])
    out = capsys.readouterr().out
    assert code == 0 and "rollout ranks (the last 8 GPUs" in out and "weight sync per step: 16.38 GB" in out
    code = main(["plan", "--config", "configs/qwen3_8b/finqa_cold_garl_q0.75.yaml", "--nodes", "2",
                 "rollout.placement=separate", "rollout.ranks=8"])  # the config's own vLLM (docs/cluster.md)
    assert code == 0 and "each 40.0 GiB vLLM share (its weights and KV cache) + 1.66 sync buckets" in capsys.readouterr().out
    vllm = plan.report(arch, replace(separate, rollout_engine="vllm", vllm_memory_utilization=0.85), trainers, 80, 0.9)
    assert vllm["rollout_rank"] == {"vllm": 68.0, "sync_buckets": 1.28, "total": 69.28, "fits": True,  # 0.85 x 80 GiB
                                    "vllm_utilization_range": [0.2, 0.88]}  # weights and a sequence; 72 - 1.28 GiB
    assert vllm["overrides"] is not None
    starved = plan.report(arch, replace(separate, rollout_engine="vllm", vllm_memory_utilization=0.15), trainers, 80, 0.9)
    assert not starved["rollout_rank"]["fits"] and starved["overrides"] is None  # 12 GiB < the 15.26 GiB of bf16 weights
    # an engine over two rollout ranks: each holds half the bf16 weights in its share
    halved = plan.report(arch, replace(separate, rollout_engine="vllm", vllm_memory_utilization=0.15,
                                       vllm_tensor_parallel=2), trainers, 80, 0.9)
    assert halved["rollout_rank"]["fits"] and halved["overrides"].endswith("rollout.placement=separate rollout.ranks=8")
    assert "--vllm-memory-utilization (rollout.vllm_memory_utilization) from 0.2 (its share holds the bf16 weights" in \
        plan.format_report(starved)
    config = "configs/qwen3_8b/finqa_cold_garl_q0.75.yaml"
    broken = tmp_path / "config.json"
    for text in ("{bad", "[1]"):
        broken.write_text(text)
        assert main(["plan", "--model", str(broken)]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and f"{broken} is not an HF config.json" in error
    # each setting at fault is named as a flag with its key beside it, and for --config (whose flags are refused) as
    # its key alone
    for args, fragment in ((["--model", "8b", "--rollout-ranks", "8"], "--rollout-ranks 8 (rollout.ranks=8) of 8 GPUs "
                                                                        "leaves none to train"),
                           (["--config", config, "rollout.placement=separate", "rollout.ranks=8"],
                            "error: rollout.ranks=8 of 8 GPUs leaves none to train"),
                           (["--model", "8b", "--nodes", "2", "--rollout-ranks", "8", "--rollout-engine", "vllm",
                             "--rollout-tensor-parallel", "3"], "--rollout-ranks (rollout.ranks) a multiple of it"),

                           (["--model", "8b", "--rollout-engine", "vllm", "--rollout-tensor-parallel", "3"],
                            "a multiple of the vLLM engine's 3 GPUs: change --nodes/--gpus-per-node, --context-parallel "
                            "(megatron.context_parallel), --rollout-tensor-parallel (rollout.tensor_parallel)")):
        assert main(["plan", *args]) == 2
        assert fragment in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "8b", "--sync-bandwidth", "0"])
    assert "number of GB/s > 0" in capsys.readouterr().err


def test_auto_micro_batch_rows_is_the_most_rows_the_memory_model_fits():
    """``train.micro_batch_rows=auto`` (issue 44): the 0.6B FinQA config's rows on an 80 GB GPU are the most for which
    the estimate fits (one more does not, or all of micro_batch_size x M fit); a smaller GPU gets fewer; a GPU too
    small for one row is one line naming what takes the most."""
    from pathlib import Path

    from nemo_jq.cluster.plan import Workload, architecture, auto_micro_batch_rows, estimate
    from nemo_jq.config import load_config

    paper = Path(__file__).resolve().parents[3] / "configs" / "qwen3_0p6b" / "finqa_cold_garl_q0.75.yaml"
    config = load_config(paper, ["train.micro_batch_rows=auto"])
    rows, fitted = auto_micro_batch_rows(config, 1024, 80.0)
    group = config.train.micro_batch_size * config.rollout.num_samples
    assert 8 < rows <= group and fitted.fits and fitted.total_gib <= 72
    if rows < group:
        work = replace(Workload.from_config(config, 1024), micro_batch=rows + 1)
        assert not estimate(architecture(config.model.path), work, 1, 1, 1, 80.0, 0.9).fits
    assert auto_micro_batch_rows(config, 1024, 40.0)[0] < rows
    with pytest.raises(ValueError, match="train.micro_batch_rows=auto: even 1 row needs .* GiB of the 4.5 usable, most of "
                                         "it the kv cache: try a smaller rollout.kv_cache_tokens"):
        auto_micro_batch_rows(config, 1024, 5.0)


def test_plan_says_how_a_steps_decode_is_split_and_what_waits(capsys):
    """Issue 43's N5: at TP=2 PP=2 DP=2 with rollout.tensor_parallel=1 a replica holds 4 vLLM engines, each decoding a
    quarter of its 32 prompts; the native sampler decodes on the replica's first rank while the other 3 wait (plan
    names the setting that splits it); with fewer prompts than engines, the engines left without one are named."""
    vllm = plan.Workload(rollout_engine="vllm", batch_prompts=64, samples=16)
    assert plan.decode_work(vllm, 2, 2, 2) == {"replica_prompts": 32, "samples": 16, "replica_ranks": 4, "engines": 4,
                                               "prompts_per_engine": 8, "waiting_ranks": 0, "empty_engines": 0}
    assert plan.decode_work(replace(vllm, vllm_tensor_parallel=2), 2, 2, 2)["engines"] == 2
    native = plan.decode_work(replace(vllm, rollout_engine="native"), 2, 2, 2)
    assert native["engines"] == 1 and native["prompts_per_engine"] == 32 and native["waiting_ranks"] == 3
    assert "other 3 ranks wait while it decodes: --rollout-engine vllm (rollout.engine=vllm) splits" in \
        plan.format_decode(native, "native")
    assert "wait while it decodes: rollout.engine=vllm splits" in plan.format_decode(native, "native", config_keys=True)
    few = plan.decode_work(replace(vllm, batch_prompts=4), 2, 2, 2)
    assert few["empty_engines"] == 2 and "2 engines get no prompt" in plan.format_decode(few, "vllm")
    assert plan.decode_work(replace(vllm, rollout_ranks=2), 2, 2, 2) is None  # rollout ranks serve whole replicas
    main(["plan", "--model", "8b", "--rollout-engine", "vllm", "--samples", "16"])
    assert "decode: each replica's 32 prompts x 16 rollouts over its 4 vLLM engines (8 prompts each, none decoded " \
           "twice)" in capsys.readouterr().out


def test_plan_advice_under_a_config_names_its_keys_not_the_flags_refused_beside_it(capsys):
    """``plan --config`` refuses the workload flags, so its advice names the config's keys (and leaves out those the
    config has already set); without a config, each flag with its key beside it."""
    config = "configs/qwen3_8b/finqa_cold_garl_q0.75.yaml"
    assert main(["plan", "--config", config, "--gpu-memory", "40", "--nodes", "2", "rollout.placement=separate",
                 "rollout.ranks=8", "rollout.engine=native"]) == 1  # the rollout ranks do not fit: nothing recommended
    out = capsys.readouterr().out
    assert "does not fit in 36 GiB: try a smaller rollout.kv_cache_tokens\n" in out and " --kv-cache" not in out
    assert main(["plan", "--model", "8b", "--gpu-memory", "40", "--nodes", "2", "--rollout-ranks", "8"]) == 1
    assert "try a smaller --kv-cache-tokens (rollout.kv_cache_tokens)\n" in capsys.readouterr().out
    work = plan.Workload.from_config(load_config(config, []), 1024)
    assert work.config_keys and not plan.Workload().config_keys
    texts = [text for component in ("activations", "optimizer", "kv_cache", "vllm", "logprob_head")
             for text, _ in plan.remedies(component, replace(work, micro_batch=4, recompute=False))]
    assert texts and not any("--" in text for text in texts), texts
    assert "megatron.recompute_activations=true" in texts and any("train.micro_batch_rows=2" in text for text in texts)


def test_plan_of_an_hf_run_on_many_gpus_says_they_would_idle_and_the_two_ways_to_use_them(capsys):
    main(["plan", "--config", "configs/qwen3_0p6b/hotpotqa_cold_garl_q0.25.yaml", "--nodes", "2"])
    out = capsys.readouterr().out
    assert "model.backend=hf trains a run on one GPU: the other 15 of the 16 would idle" in out
    assert "nemo-jq sweep --slurm" in out and "model.backend=megatron" in out
    main(["plan", "--config", "configs/qwen3_0p6b/hotpotqa_cold_garl_q0.25.yaml", "--gpus-per-node", "1"])
    assert "would idle" not in capsys.readouterr().out


def test_a_colocated_vllm_share_that_cannot_hold_its_engines_weights_does_not_fit():
    """Qwen3-235B-A22B: attention's TP is at most its 4 KV heads and a colocated engine's TP divides it, so each vLLM
    engine holds a quarter of 470 GB in bf16: no share of an 80 GB GPU holds it, whatever the training layout needs."""
    work = plan.Workload(optimizer="bf16-distopt", recompute=True, rollout_engine="vllm", vllm_tensor_parallel=4,
                         samples=16, micro_batch=4)
    layouts = plan.plan(plan.architecture("Qwen/Qwen3-235B-A22B"), work, gpus_per_node=8, nodes=32, gpu_gb=80)
    assert not any(layout.fits for layout in layouts)
    assert layouts[0].largest == "vllm" and ("holds less than its engine's bf16 weights and one sequence's keys and "
                                             "values (109.7 GiB") in layouts[0].advice


def test_plans_hint_to_train_an_hf_run_over_its_gpus_with_megatron_gives_a_config_that_loads_and_plans(capsys):
    """An hf paper config (activation checkpointing on) on a node: the hint's `model.backend=megatron` alone was
    refused ("model.activation_checkpointing is the hf backend's"), and that error's fix was refused again."""
    config = "configs/qwen3_0p6b/hotpotqa_cold_garl_q0.25.yaml"
    assert main(["plan", "--config", config]) == 0
    hint = capsys.readouterr().out.split("(plan --config ... ")[1].split(" gives its layout")[0].split()
    assert load_config(config, hint).model.backend == "megatron"
    assert main(["plan", "--config", config, *hint]) == 0 and "recommended" in capsys.readouterr().out


def test_a_vllm_share_must_hold_its_weights_and_one_sequence_and_a_sized_cache_counts_as_given():
    """8B on a 40 GiB GPU at rollout.vllm_memory_utilization=0.382: 15.28 GiB held its 15.26 GiB of weights, and plan
    said it fit; vLLM refuses a cache that holds no sequence (here 0.72 GiB at 5,249 tokens). rollout.vllm_kv_cache_gb
    sizes the cache itself: plan ignored it."""
    arch = plan.architecture("8b")
    work = plan.Workload(seq_len=5249, rollout_engine="vllm", vllm_memory_utilization=0.382, batch_prompts=16, samples=8,
                         recompute=True, optimizer="bf16-distopt")
    least = plan.vllm_least_bytes(arch, work)
    assert least == 2 * plan.parameter_count(arch) + 5249 * 2 * 2 * 36 * 8 * 128
    tight = plan.estimate(arch, work, 8, 1, 1, 40.0, 0.9)
    assert not tight.fits and tight.largest == "vllm" and "one sequence's keys and values" in tight.advice
    roomy = plan.estimate(arch, replace(work, vllm_memory_utilization=0.45), 8, 1, 1, 40.0, 0.9)
    assert roomy.vllm_gib == 18.0
    sized = plan.estimate(arch, replace(work, vllm_kv_cache_gb=100.0), 8, 1, 1, 80.0, 0.9)
    assert sized.vllm_gib == round(2 * plan.parameter_count(arch) / GiB + 100, 2) and not sized.fits


def test_a_rollout_ranks_vllm_advice_gives_the_shares_that_work(capsys):
    """--rollout-ranks with a share past the headroom said "a share that holds the bf16 weights", which it did."""
    assert main(["plan", "--model", "8b", "--nodes", "2", "--rollout-ranks", "8", "--rollout-engine", "vllm",
                 "--rollout-tensor-parallel", "4", "--vllm-memory-utilization", "0.95"]) == 1  # the share: past the headroom
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout ranks"))
    low, high = re.search(r"from ([\d.]+) \(its share holds the bf16 weights and one sequence's keys and values\) to "
                          r"([\d.]+) \(the rank within the headroom\)", line).groups()
    assert float(low) < float(high) < 0.9, line
    for utilization, fits in ((low, True), (high, True), (str(float(high) + 0.02), False)):
        assert main(["plan", "--model", "8b", "--nodes", "2", "--rollout-ranks", "8", "--rollout-engine", "vllm",
                     "--rollout-tensor-parallel", "4", "--vllm-memory-utilization", utilization]) == (0 if fits else 1)
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout ranks"))
        assert ("does not fit" not in line) == fits, (utilization, line)


def test_where_nothing_fits_plan_also_names_the_fewest_nodes_that_fit(capsys):
    """The 32B example on one node: nothing fits; the advice was the optimizer's offload alone, though its own run
    fits on four nodes."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[3] / "configs" / "examples" / "qwen3_32b_hotpotqa_cold_garl_q0.75.yaml")
    assert main(["plan", "--config", config, "--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits in 72 GiB" in out and "\nor more GPUs: --nodes 4 fits TP=8 PP=2 DP=2 (65.78 of 72 GiB)\n" in out
    assert main(["plan", "--config", config, "--nodes", "4"]) == 0
    assert "or more GPUs" not in capsys.readouterr().out  # it fits: nothing to add


def test_fp32_sampling_is_counted_in_fp32_and_only_a_dense_qwen3s_graph_decode_under_autocast_casts_the_weights():
    """model.precision=fp32: the sampler decodes the fp32 weights themselves (its decode step casts only to autocast's
    dtype) into fp32 keys and values, and Megatron's sampler copy, a rollout rank's model and vLLM's weights are fp32;
    plan counted them all in bf16 and a bf16 cast beside them (the 0.6B paper config in fp32: 30.1 GiB, now 42.5). A
    Qwen3-MoE has no graph decode step: it decodes eagerly (no cast; a compaction's copies of the keys)."""
    arch, moe = plan.architecture("0.6b"), plan.architecture("Qwen/Qwen3-30B-A3B")
    params = plan.parameter_count(arch)
    bf16 = plan.Workload(seq_len=4608, backend="hf", graph_decode=True, decode_cast=True)
    fp32 = replace(bf16, autocast=False, decode_cast=False)
    held, fp32_held = (plan.component_bytes(arch, work, 1, 1, 1, 80) for work in (bf16, fp32))
    assert held["decode_cast"] == 2 * params and fp32_held["decode_cast"] == 0
    assert fp32_held["kv_cache"] == 2 * held["kv_cache"] and fp32_held["prefill"] > held["prefill"]
    megatron = replace(bf16, backend="megatron", decode_cast=False)
    assert plan.component_bytes(arch, megatron, 1, 1, 1, 80)["rollout_copy"] == 2 * params
    assert plan.component_bytes(arch, replace(megatron, autocast=False), 1, 1, 1, 80)["rollout_copy"] == 4 * params
    assert plan.rollout_rank_bytes(arch, fp32, 1, 80)["weights"] == 2 * plan.rollout_rank_bytes(arch, bf16, 1, 80)["weights"]
    assert plan.vllm_least_bytes(arch, fp32) == 2 * plan.vllm_least_bytes(arch, bf16)
    eager = replace(bf16, graph_decode=False)
    moe_held = plan.component_bytes(moe, bf16, 1, 1, 1, 80)
    assert moe_held["decode_cast"] == 0 and moe_held["kv_cache"] == plan.component_bytes(moe, eager, 1, 1, 1, 80)["kv_cache"]
    for precision, casts in (("auto", True), ("fp32", False)):
        assert plan.Workload.from_config(load_config(None, [f"model.precision={precision}"]), 32).decode_cast is casts


def test_rollouts_one_step_ahead_in_a_child_process_are_sampled_while_the_step_trains():
    """rollout.async_steps=1 in a world of one process (the hf backend's; megatron's on one GPU too): the copy samples
    the next step in a child process while this one trains (recipe/experience.py), so its KV cache joins the training
    working set; plan took the larger of the two (for megatron always). Over several processes, or from vLLM, the next
    step is sampled before the step trains."""
    parts = dict.fromkeys(plan.COMPONENTS, 0.0)
    parts.update(weights=4 * GiB, rollout_copy=4 * GiB, activations=3 * GiB, kv_cache=2 * GiB, sampling=2 * GiB)
    assert plan._peak(parts, plan.Workload(backend="hf"), 1)[0] == 4 + 4 + 3
    assert plan._peak(parts, plan.Workload(backend="hf", async_copy=True), 1)[0] == 4 + 4 + 3 + 2
    assert plan._peak(parts, plan.Workload(async_copy=True), 1)[0] == 4 + 4 + 3 + 2
    assert plan._peak(parts, plan.Workload(async_copy=True), 2)[0] == 4 + 4 + 3
    for engine, in_a_child in (("native", True), ("hf", True), ("vllm", False)):
        config = load_config(None, [f"rollout.engine={engine}", "rollout.async_steps=1", "model.backend=megatron"])
        assert plan.Workload.from_config(config, 32).async_copy is in_a_child


def test_a_qwen3_moe_without_sequence_parallelism_is_told_to_turn_it_on(capsys):
    """Every TP > 1 layout of a Qwen3-MoE without sequence parallelism is one the policy cannot train
    (MegatronLayout.check_trainable), so none was left: the line named nodes, CP and the batch, never the cause."""
    from pathlib import Path

    from helpers import one_line_error

    config = Path(__file__).resolve().parents[3] / "configs" / "examples" / "qwen3_30b_a3b_hotpotqa_cold_garl_q0.75.yaml"
    code = main(["plan", "--config", str(config), "--nodes", "8", "megatron.sequence_parallel=false"])
    one_line_error(code, capsys.readouterr().err, "a Qwen3-MoE takes TP > 1 only with sequence parallelism: "
                   "megatron.sequence_parallel=true")
