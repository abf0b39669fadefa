"""The Megatron-core backend against the HF backend on tiny Qwen3s, on CPU.

Parallel runs use gloo processes (``megatron_cpu.run_in_processes``); each worker compares
against ``HFPolicy`` on the same weights and returns max abs differences, asserted here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import torch.distributed as dist  # noqa: E402

from helpers import peak_allocated, tiny_setup  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.models.hf import HFPolicy  # noqa: E402
from nemo_jq.models.interfaces import TokenBatch  # noqa: E402
from nemo_jq.models.megatron.layout import MegatronLayout  # noqa: E402
from nemo_jq.models.megatron.logprobs import vocab_parallel_token_logprobs  # noqa: E402
from nemo_jq.models.megatron.mapping import hf_to_megatron, megatron_to_hf  # noqa: E402
from nemo_jq.models.megatron.provider import read_qwen3_config  # noqa: E402
from nemo_jq.objectives import garl  # noqa: E402
from nemo_jq.rollouts import Sample  # noqa: E402

CPU = torch.device("cpu")
PROMPTS, SAMPLES, LENGTH = 2, 4, 14  # one micro-batch per prompt group
#: Optimizer settings for the step comparison: clipping active, and an Adam eps that keeps the
#: first step (~ lr * g / (|g| + eps)) smooth in g, so float-level gradient differences stay small.
OPTIM = {"lr": 1e-2, "eps": 1e-3, "grad_clip": 0.1}


def untied_qwen3(seed: int = 0):
    """Like Qwen3-8B in the ways that matter here: untied LM head, head_dim != hidden/heads, rope base 1e6;
    and a vocabulary (317) that Megatron must pad."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=317, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                         max_position_embeddings=128, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)


def megatron_names(num_layers: int, tied: bool, fused_norms: bool = False) -> list[str]:
    """The GPTModel parameter names of a Qwen3: the local spec's, or Transformer Engine's (norms fused into linears)."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", *([] if tied else ["output_layer.weight"])]
    for layer in range(num_layers):
        prefix = f"decoder.layers.{layer}."
        names += [prefix + name for name in (
            "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight",
            "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
            "self_attention.linear_proj.weight",
            "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
        )]
    return names


def garl_batch(vocab_size: int, seed: int = 1) -> TokenBatch:
    """``PROMPTS x SAMPLES`` right-padded rows: a 3-token prompt, rationale targets at 3..7, answer targets from 8."""
    generator = torch.Generator().manual_seed(seed)
    rows = PROMPTS * SAMPLES
    lengths = torch.randint(LENGTH - 4, LENGTH + 1, (rows,), generator=generator)
    attention = (torch.arange(LENGTH) < lengths[:, None]).long()
    input_ids = torch.randint(vocab_size, (rows, LENGTH), generator=generator) * attention
    predicted = torch.arange(1, LENGTH)  # the position each target token sits at
    real = attention[:, 1:].bool()
    return TokenBatch(input_ids, attention, real & (predicted >= 3) & (predicted < 8), real & (predicted >= 8))


def garl_loss_fn(micro_batches: list[TokenBatch], losses: list[float]):
    """The trainer's loss: GARL(q=0.75) per prompt group, summed and divided by all prompts (over all DP ranks)."""
    def loss_fn(logprobs: torch.Tensor, index: int) -> tuple[torch.Tensor, dict[str, float]]:
        micro = micro_batches[index]
        rationale = (logprobs * micro.rationale_mask).sum(-1).view(-1, SAMPLES)
        answer = (logprobs * micro.answer_mask).sum(-1).view(-1, SAMPLES)
        loss = garl(rationale, answer, q=0.75).per_example.sum() / PROMPTS
        losses.append(float(loss.detach()))  # the calls on this rank
        return loss, {"loss": float(loss.detach()), "micro_batch": index}
    return loss_fn


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def full_vocab_logits(policy, input_ids: torch.Tensor) -> torch.Tensor:
    """``[N, L, V]`` logits of a MegatronPolicy, gathered over its TP ranks."""
    length = input_ids.shape[1]
    positions = torch.arange(length).expand_as(input_ids)
    local = policy.model(input_ids, positions, torch.ones(length, length, dtype=torch.bool).triu(1)[None, None])
    pieces = [torch.empty_like(local) for _ in range(policy.tp_size)]
    dist.all_gather(pieces, local.contiguous(), group=policy.tp_group)
    return torch.cat(pieces, dim=-1)[..., : policy.arch.vocab_size]


# ----------------------------------------------------------------- workers (run in gloo processes)
def parity_worker(tensor_parallel: int, sequence_parallel: bool, weights_dir: str,
                  recompute_activations: bool = False, context_parallel: int = 1) -> dict[str, float]:
    """Logits, log-probs, GARL loss and gradients, one optimizer step, and weight files, against HFPolicy.

    Data-parallel ranks (world size / TP / CP) each take their share of the prompt-group micro-batches.
    Under context parallelism each rank holds part of every sequence, so the logits are compared through
    the log-probs (gathered over CP) only.
    """
    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, _, _, model = tiny_setup()
    hf = HFPolicy(copy.deepcopy(model), device=CPU, **OPTIM)
    policy = MegatronPolicy.from_hf_model(model, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
                                          context_parallel=context_parallel, recompute_activations=recompute_activations,
                                          **OPTIM)
    assert sorted(name for name, _ in policy.model.named_parameters()) == sorted(megatron_names(2, tied=True))
    assert policy.model.config.recompute_granularity == ("full" if recompute_activations else None)
    batch = garl_batch(model.config.vocab_size)
    real = batch.attention_mask.bool()
    diffs = {}
    with torch.no_grad():
        if context_parallel == 1:
            hf_logits = hf.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            diffs["logits"] = float((full_vocab_logits(policy, batch.input_ids) - hf_logits)[real].abs().max())
        diffs["logprobs"] = float((policy.token_logprobs(batch) - hf.token_logprobs(batch)).abs().max())

    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    hf_losses, losses = [], []
    hf.forward_backward(micro_batches, garl_loss_fn(micro_batches, hf_losses))
    dp_rank, dp_size = policy.data_parallel.rank, policy.data_parallel.size
    mine = micro_batches[dp_rank::dp_size]
    policy.forward_backward(mine, garl_loss_fn(mine, losses))
    diffs["loss"] = max(abs(a - b) for a, b in zip(losses, hf_losses[dp_rank::dp_size]))
    hf_grads = {name: param.grad for name, param in hf.model.named_parameters()}
    diffs["grads"] = max_diff(policy.gather_hf({name: p.grad for name, p in policy.model.named_parameters()}), hf_grads)

    diffs["grad_norm"] = abs(policy.optimizer_step()["grad_norm"] - hf.optimizer_step()["grad_norm"])
    diffs["weights_after_step"] = max_diff(policy.hf_state_dict(), dict(hf.model.named_parameters()))

    # HFPolicy's weight file (a tied model stores lm_head.weight only) loads into every shard, bit-exact.
    if dist.get_rank() == 0:
        hf.save(weights_dir)
    dist.barrier()
    policy.load(weights_dir, with_optimizer=False)
    diffs["hf_weight_file"] = max_diff(policy.hf_state_dict(), dict(hf.model.named_parameters()))
    if tensor_parallel > 1:
        diffs.update(split_vocab_logprobs(policy.tp_group, policy.tp_rank, tensor_parallel))
    return diffs


def split_vocab_logprobs(group, rank: int, size: int) -> dict[str, float]:
    """The kernel on vocabulary slices (11 columns padded to 12) against log_softmax + gather on the whole."""
    torch.manual_seed(0)
    logits = torch.randn(9, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(11, (9,))
    expected = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    expected.sum().backward()
    width = -(-11 // size)
    local = torch.nn.functional.pad(logits.detach(), (0, width * size - 11))[:, rank * width : (rank + 1) * width]
    local.requires_grad_(True)
    got = vocab_parallel_token_logprobs(local, targets, vocab_start=rank * width, vocab_size=11, group=group, chunk_size=4)
    got.sum().backward()
    own = slice(rank * width, min((rank + 1) * width, 11))
    return {"split_logprobs": float((got - expected).abs().max()),
            "split_grads": float((local.grad[:, : own.stop - own.start] - logits.grad[:, own]).abs().max())}


def export_worker(out_dir: str, scratch_dir: str) -> dict[str, float | bool]:
    """Untied odd-vocabulary model at TP=2: log-probs, HF -> shards -> HF round trip, export, state dicts."""
    from transformers import AutoModelForCausalLM

    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, tokenizer, _, _ = tiny_setup()
    model = untied_qwen3()
    policy = MegatronPolicy.from_hf_model(model, tensor_parallel=2)
    assert sorted(name for name, _ in policy.model.named_parameters()) == sorted(megatron_names(2, tied=False))
    batch = garl_batch(model.config.vocab_size)
    hf_state, round_trip = model.state_dict(), policy.hf_state_dict()
    results = {
        "logprobs": float((policy.token_logprobs(batch) - HFPolicy(model, device=CPU).token_logprobs(batch)).abs().max()),
        "round_trip_bit_exact": round_trip.keys() == hf_state.keys()
        and all(torch.equal(tensor, hf_state[name]) for name, tensor in round_trip.items()),
    }
    policy.export(out_dir, tokenizer)
    if dist.get_rank() == 0:
        exported = AutoModelForCausalLM.from_pretrained(out_dir)
        results["export_bit_exact"] = all(torch.equal(a, hf_state[name]) for name, a in exported.state_dict().items())
        with torch.no_grad():
            results["export_logits"] = float((exported(batch.input_ids).logits - model(batch.input_ids).logits).abs().max())
    refuse_foreign_weights(policy, scratch_dir, hf_state)
    return results


def refuse_foreign_weights(policy, scratch_dir: str, hf_state: dict[str, torch.Tensor]) -> None:
    """Weight files that do not fit the policy's model are errors that name the weight."""
    from safetensors.torch import save_file

    directory = Path(scratch_dir) / f"rank{dist.get_rank()}"
    directory.mkdir()
    save_file({name: tensor for name, tensor in hf_state.items() if name != "lm_head.weight"}, directory / "model.safetensors")
    with pytest.raises(ValueError, match="missing 'lm_head.weight'"):  # an untied model needs its own head
        policy.load(directory, with_optimizer=False)
    save_file({**hf_state, "model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 48)}, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight' has shape \[32, 48\]; the config implies \[32, 64\]"):
        policy.load(directory, with_optimizer=False)


# ----------------------------------------------------------------- parity over processes
@pytest.mark.parametrize("tensor_parallel, sequence_parallel, recompute, context_parallel, world_size",
                         [(1, False, False, 1, 2), (2, False, False, 1, 2), (2, True, False, 1, 2), (2, True, True, 1, 2),
                          (2, True, False, 2, 4), (1, False, False, 2, 4)],
                         ids=["tp1-dp2", "tp2", "tp2-sp", "tp2-sp-recompute", "tp2-sp-cp2", "cp2-dp2"])
@pytest.mark.distributed
def test_matches_hf_logits_logprobs_garl_gradients_and_step(tensor_parallel, sequence_parallel, recompute, context_parallel,
                                                            world_size, tmp_path):
    """Context parallelism runs on CPU under the test patches' all-gather attention (TE's is GPU only)."""
    for rank, diffs in enumerate(run_in_processes(parity_worker, world_size, tensor_parallel, sequence_parallel, str(tmp_path),
                                                  recompute, context_parallel)):
        assert diffs.get("logits", 0.0) < 2e-5 and diffs["logprobs"] < 2e-5, (rank, diffs)
        assert ("logits" in diffs) == (context_parallel == 1)
        assert diffs["loss"] < 2e-5 and diffs["grads"] < 2e-6, (rank, diffs)
        assert diffs["grad_norm"] < 1e-5 and diffs["weights_after_step"] < 1e-6, (rank, diffs)
        assert diffs["hf_weight_file"] == 0, (rank, diffs)
        if tensor_parallel > 1:
            assert diffs["split_logprobs"] < 1e-12 and diffs["split_grads"] < 1e-12, (rank, diffs)


def pipeline_parity_worker(tensor_parallel: int, pipeline_parallel: int, scratch_dir: str,
                           sequence_parallel: bool = False, untied: bool = False, context_parallel: int = 1) -> dict[str, float]:
    """One replica of the tied tiny model in pipeline stages against HFPolicy: log-probs, GARL loss, gradients and a
    step (as ``parity_worker``); then a distributed checkpoint, loaded back after a further step, and that step again."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    model = untied_qwen3() if untied else tiny_setup()[3]
    hf = HFPolicy(copy.deepcopy(model), device=CPU, **OPTIM)
    policy = MegatronPolicy.from_hf_model(model, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                                          sequence_parallel=sequence_parallel, context_parallel=context_parallel, **OPTIM)
    batch = garl_batch(model.config.vocab_size)
    with torch.no_grad():
        diffs = {"logprobs": float((policy.token_logprobs(batch) - hf.token_logprobs(batch)).abs().max())}

    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]  # of different lengths
    hf_losses, losses = [], []
    hf_metrics = hf.forward_backward(micro_batches, garl_loss_fn(micro_batches, hf_losses))
    metrics = policy.forward_backward(micro_batches, garl_loss_fn(micro_batches, losses))
    diffs["loss_calls"] = len(losses)  # the last stage's
    diffs["loss"] = max((abs(a - b) for a, b in zip(losses, hf_losses)), default=0.0)
    # every stage has the last stage's metrics, in micro-batch order
    diffs["metrics_order"] = [micro["micro_batch"] for micro in metrics]
    diffs["metrics_loss"] = max(abs(a["loss"] - b["loss"]) for a, b in zip(metrics, hf_metrics))
    hf_grads = {name: param.grad for name, param in hf.model.named_parameters()}
    diffs["grads"] = max_diff(policy.gather_hf({name: p.grad for name, p in policy.model.named_parameters()}), hf_grads)
    diffs["grad_norm"] = abs(policy.optimizer_step()["grad_norm"] - hf.optimizer_step()["grad_norm"])
    diffs["weights_after_step"] = max_diff(policy.hf_state_dict(), dict(hf.model.named_parameters()))

    checkpoint = Path(scratch_dir) / "checkpoint"
    policy.save(checkpoint)
    garl_step(policy, batch)
    policy.load(checkpoint)
    diffs["checkpoint_round_trip"] = max_diff(policy.hf_state_dict(), dict(hf.model.named_parameters()))
    garl_step(policy, batch)
    garl_step(hf, batch)
    diffs["weights_after_resumed_step"] = max_diff(policy.hf_state_dict(), dict(hf.model.named_parameters()))
    return diffs


@pytest.mark.parametrize("tensor_parallel, sequence_parallel, untied, context_parallel",
                         [(1, False, False, 1), (1, False, True, 1), (2, False, False, 1), (2, True, False, 1), (1, False, False, 2)],
                         ids=["pp2", "pp2-untied", "tp2xpp2", "tp2-sp-x-pp2", "cp2xpp2"])
@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_parallel_matches_hf_and_resumes_from_its_checkpoint(tensor_parallel, sequence_parallel, untied,
                                                                      context_parallel, tmp_path):
    ranks = run_in_processes(pipeline_parity_worker, 2 * tensor_parallel * context_parallel, tensor_parallel, 2,
                             str(tmp_path), sequence_parallel, untied, context_parallel)
    for rank, diffs in enumerate(ranks):
        assert diffs["logprobs"] < 2e-5 and diffs["loss"] < 2e-5 and diffs["grads"] < 2e-6, (rank, diffs)
        assert diffs["grad_norm"] < 1e-5 and diffs["weights_after_step"] < 1e-6, (rank, diffs)
        assert diffs["checkpoint_round_trip"] < 1e-6 and diffs["weights_after_resumed_step"] < 1e-6, (rank, diffs)
        assert diffs["metrics_order"] == list(range(PROMPTS)) and diffs["metrics_loss"] < 2e-5, (rank, diffs)
    # the loss runs on the last stage (ranks are TP-, then CP-major: stage 0 holds the first TP x CP ranks)
    stage = tensor_parallel * context_parallel
    assert [diffs["loss_calls"] for diffs in ranks] == [0] * stage + [PROMPTS] * stage


@pytest.mark.distributed
def test_untied_tp2_round_trip_and_export_are_bit_exact(tmp_path):
    out_dir = tmp_path / "hf"
    results = run_in_processes(export_worker, 2, str(out_dir), str(tmp_path))
    for rank, result in enumerate(results):
        assert result["logprobs"] < 2e-5 and result["round_trip_bit_exact"], (rank, result)
    assert results[0]["export_bit_exact"] and results[0]["export_logits"] == 0, results[0]
    assert json.loads((out_dir / "config.json").read_text())["tie_word_embeddings"] is False


def garl_step(policy, batch: TokenBatch) -> None:
    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    policy.forward_backward(micro_batches, garl_loss_fn(micro_batches, []))
    policy.optimizer_step()


def train_and_save_worker(checkpoint_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Untied odd-vocabulary model at TP=2: a GARL step, a distributed checkpoint, a second step."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf_model(untied_qwen3(), tensor_parallel=2, **OPTIM)
    batch = garl_batch(policy.arch.vocab_size)
    garl_step(policy, batch)
    policy.save(Path(checkpoint_dir))
    after_one = policy.hf_state_dict()
    garl_step(policy, batch)
    return {"after_one": after_one, "after_two": policy.hf_state_dict()}


def resume_at_tp1_worker(checkpoint_dir: str, out_dir: str, scratch_dir: str) -> dict[str, Any]:
    """The TP=2 checkpoint resumed at TP=1 into other weights: loaded weights, the second step, the export;
    then the errors for a checkpoint without optimizer state, one that lacks a weight, one of another model."""
    from megatron.core import dist_checkpointing

    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, tokenizer, _, tied_model = tiny_setup()
    policy = MegatronPolicy.from_hf_model(untied_qwen3(seed=5), tensor_parallel=1, **OPTIM)
    policy.load(Path(checkpoint_dir))
    loaded = policy.hf_state_dict()
    garl_step(policy, garl_batch(policy.arch.vocab_size))
    policy.export(Path(out_dir), tokenizer)

    untrained = Path(scratch_dir) / "untrained"
    MegatronPolicy.from_hf_model(untied_qwen3(), **OPTIM).save(untrained)
    with pytest.raises(FileNotFoundError, match="holds no optimizer state"):
        policy.load(untrained)
    without_final_norm = Path(scratch_dir) / "without_final_norm"
    (without_final_norm / "megatron").mkdir(parents=True)
    dist_checkpointing.save({"model": {key: value for key, value in policy.model.sharded_state_dict().items()
                                       if "final_layernorm" not in key},
                             "hf_config": policy.arch.hf_config, "has_optimizer_state": False}, str(without_final_norm / "megatron"))
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\) this model needs: 'decoder.final_layernorm.weight'"):
        policy.load(without_final_norm, with_optimizer=False)
    tied = MegatronPolicy.from_hf_model(tied_model, **OPTIM)
    with pytest.raises(ValueError, match=r"saved from another model: vocab_size 317 there, \d+ here, .*"
                                         r"tie_word_embeddings False there, True here"):
        tied.load(untrained, with_optimizer=False)
    return {"loaded": loaded, "after_two": policy.hf_state_dict()}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tp2_checkpoint_resumes_at_tp1_and_exports_the_same_model(tmp_path):
    """HF -> Megatron TP=2 -> distributed checkpoint -> resume at TP=1 (weights and AdamW moments resharded)
    -> the next step equals TP=2's own -> the export loads in plain transformers with the same logits."""
    from transformers import AutoModelForCausalLM

    checkpoint, out_dir = tmp_path / "checkpoint", tmp_path / "hf"
    trained = run_in_processes(train_and_save_worker, 2, str(checkpoint))
    assert max_diff(trained[0]["after_one"], untied_qwen3().state_dict()) > 1e-3  # the step moved the weights
    (resumed,) = run_in_processes(resume_at_tp1_worker, 1, str(checkpoint), str(out_dir), str(tmp_path))
    assert max_diff(resumed["loaded"], trained[0]["after_one"]) == 0
    assert max_diff(resumed["after_two"], trained[0]["after_two"]) < 1e-6
    exported, expected = AutoModelForCausalLM.from_pretrained(out_dir), untied_qwen3()
    expected.load_state_dict(trained[0]["after_two"])
    input_ids = garl_batch(317).input_ids
    with torch.no_grad():
        assert float((exported(input_ids).logits - expected(input_ids).logits).abs().max()) < 1e-5


# ----------------------------------------------------------------- single process: mapping, kernel, errors
@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-spec", "te-spec"])
def test_mapping_layouts_and_bit_exact_round_trip(fused_norms):
    model = untied_qwen3()
    arch = read_qwen3_config(model.config)
    hf_state = model.state_dict()
    names = megatron_names(2, tied=False, fused_norms=fused_norms)
    shards = [hf_to_megatron(hf_state, names, arch, tp_size=2, tp_rank=rank) for rank in range(2)]

    attention, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    d, q = arch.head_dim, hf_state[attention + "q_proj.weight"]
    k, v = hf_state[attention + "k_proj.weight"], hf_state[attention + "v_proj.weight"]
    # rank 1 holds query group 1: its two query heads, then its key head, then its value head
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"],
                       torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))
    gate, up = hf_state[mlp + "gate_proj.weight"], hf_state[mlp + "up_proj.weight"]
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[32:], up[32:]]))
    assert torch.equal(shards[0]["decoder.layers.0.mlp.linear_fc2.weight"], hf_state[mlp + "down_proj.weight"][:, :32])
    # 317 rows pad to 384 (a multiple of 128, whatever the TP size): rank 1 holds rows 192..383, the last 67 zero
    embedding = shards[1]["embedding.word_embeddings.weight"]
    assert embedding.shape[0] == 192 and torch.equal(embedding[:125], hf_state["model.embed_tokens.weight"][192:])
    assert not embedding[125:].any()

    back = megatron_to_hf(shards, arch)
    assert back.keys() == hf_state.keys() and all(torch.equal(back[name], hf_state[name]) for name in back)


def test_mapping_names_missing_misshapen_and_unused_weights():
    _, _, _, model = tiny_setup()
    arch = read_qwen3_config(model.config)
    hf_state = {name: t for name, t in model.state_dict().items() if name != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 'model\.layers\.1\.mlp\.up_proj\.weight' .*decoder\.layers\.1\.mlp\.linear_fc1\.weight"):
        hf_to_megatron(hf_state, megatron_names(2, tied=True), arch, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.2\.mlp\.down_proj\.weight'\]"):
        hf_to_megatron({**model.state_dict(), "model.layers.2.mlp.down_proj.weight": torch.zeros(1)},
                       megatron_names(2, tied=True), arch)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_norm.weight' has shape \[16\]; the config implies \[8\]"):
        hf_to_megatron({**model.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(16)},
                       megatron_names(2, tied=True), arch)
    with pytest.raises(ValueError, match="no HF mapping for Megatron parameter 'decoder.layers.0.mlp.router.weight'"):
        hf_to_megatron(model.state_dict(), ["decoder.layers.0.mlp.router.weight"], arch)


def test_logprobs_equal_log_softmax_gather_without_tensor_parallelism():
    torch.manual_seed(0)
    logits = torch.randn(23, 13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(10, (23,))
    expected = torch.log_softmax(logits[:, :10], -1).gather(1, targets[:, None]).squeeze(1)
    # the last 3 columns are vocabulary padding
    got = vocab_parallel_token_logprobs(logits, targets, vocab_size=10, chunk_size=5)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_token_logprobs(x, targets, vocab_size=10, chunk_size=4), (logits,))
    fp32 = logits.detach().float()
    assert got.dtype == torch.float64 and vocab_parallel_token_logprobs(fp32, targets, vocab_size=10).dtype == torch.float32
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        vocab_parallel_token_logprobs(fp32, targets, chunk_size=0)


def test_config_errors_name_what_is_missing_or_unsupported(tmp_path):
    _, _, _, model = tiny_setup()
    config = model.config.to_dict()
    for name in ("hidden_size", "rope_parameters"):
        del config[name]
    with pytest.raises(ValueError, match=r"not a Qwen3-like config: missing hidden_size, rope_theta"):
        read_qwen3_config(config)

    good = model.config.to_dict()
    for change, message in [({"model_type": "llama"}, "model_type 'llama'"), ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                            ({"attention_bias": True}, "attention_bias"), ({"use_sliding_window": True}, "sliding"),
                            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope type 'yarn'")]:
        with pytest.raises(ValueError, match=message):
            read_qwen3_config({**good, **change})

    (tmp_path / "config.json").write_text(json.dumps({**good, "rope_theta": 5e5, "rope_parameters": None}))
    assert read_qwen3_config(tmp_path).rope_theta == 5e5  # a folder, and the transformers 4 form of the rope base
    with pytest.raises(FileNotFoundError, match="no HF config"):
        read_qwen3_config(tmp_path / "absent")


def test_impossible_layouts_are_refused_by_the_one_validate():
    arch = read_qwen3_config(untied_qwen3().config)  # 4 heads, 2 KV groups, intermediate 64, 2 layers
    cases = [(MegatronLayout(tensor_parallel=3), "megatron.tensor_parallel=3 does not divide num_attention_heads=4"),
             (MegatronLayout(tensor_parallel=4), "megatron.tensor_parallel=4 does not divide num_key_value_heads=2"),
             (MegatronLayout(sequence_parallel=True), "megatron.sequence_parallel needs megatron.tensor_parallel > 1"),
             (MegatronLayout(pipeline_parallel=3), "megatron.pipeline_parallel=3 does not divide num_hidden_layers=2"),
             (MegatronLayout(context_parallel=0), "megatron.context_parallel must be >= 1; got 0"),
             (MegatronLayout(bf16_weights=True), "megatron.bf16_weights=true keeps the fp32 master weights")]
    for layout, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            layout.validate(arch)
        assert not layout.divides(arch, 8)
    with pytest.raises(ValueError, match=r"megatron.tensor_parallel=2 x pipeline_parallel=1 x context_parallel=1 does not "
                                         r"divide the 3 processes"):
        MegatronLayout(tensor_parallel=2).validate(arch, world_size=3)
    assert MegatronLayout(tensor_parallel=2, pipeline_parallel=2).divides(arch, 8)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_context_parallel_split_gives_each_rank_a_balanced_share_of_every_position(size):
    from nemo_jq.models.megatron.context_parallel import _in_sequence_order, split_for_rank

    length = 2 * size * 3
    positions = torch.arange(length).expand(2, length)
    parts = [split_for_rank(positions, rank, size) for rank in range(size)]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(length))  # every position once
    # causal work (the number of earlier positions each attends to) is equal on every rank
    assert len({int(part[0].sum()) for part in parts}) == 1
    assert torch.equal(_in_sequence_order(parts, 1), positions)
    if size > 1:
        with pytest.raises(ValueError, match=f"a sequence of {length + 1} does not split into 2 x {size} equal chunks"):
            split_for_rank(torch.arange(length + 1)[None], 0, size)


def context_parallel_worker() -> dict[str, bool]:
    """The split against megatron-core's own (``get_batch_on_this_cp_rank``), and the gather with its gradient."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from nemo_jq.models.megatron.context_parallel import gather_sequence, split_for_rank

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    whole = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mine = split_for_rank(whole, group.rank(), 2).clone().requires_grad_()
    gathered = gather_sequence(mine, group)
    weights = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (gathered * weights).sum().backward()  # the same loss on both ranks
    return {"as_megatron": torch.equal(mine, get_batch_on_this_cp_rank({"tokens": whole.clone()})["tokens"]),
            "gathered": torch.equal(gathered, whole), "grad": torch.equal(mine.grad, split_for_rank(weights, group.rank(), 2))}


@pytest.mark.distributed
def test_context_parallel_split_is_megatrons_and_the_gather_undoes_it():
    assert run_in_processes(context_parallel_worker, 2) == [{"as_megatron": True, "gathered": True, "grad": True}] * 2


def test_context_parallel_without_transformer_engine_is_a_clear_error():
    """megatron-core's local attention asserts CP == 1 deep inside the model build; the provider says why first.
    (This test process has none of the test patches, whose stand-in attention makes CP run on CPU.)"""
    from nemo_jq.models.megatron.provider import build_gpt_model

    with pytest.raises(ValueError, match=r"context_parallel=2 needs Transformer Engine's attention on GPU .*"
                                         r"or set context_parallel=1"):
        build_gpt_model(read_qwen3_config(untied_qwen3().config), MegatronLayout(context_parallel=2))


def test_policy_needs_torch_distributed():
    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, _, _, model = tiny_setup()
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        MegatronPolicy.from_hf_model(model)


#: Ways an installed Transformer Engine breaks (its 2.x top-level package swallows an ImportError from .pytorch):
#: what its top-level ``__init__`` and its ``pytorch`` subpackage do, and what the reason must name.
BROKEN_TE = {
    "extension-abi": ("try:\n    from . import pytorch\nexcept ImportError:\n    pass\n",
                      "raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c10')", "undefined symbol"),
    "cuda-library": ("", "raise OSError('libcudnn_graph.so.9: cannot open shared object file')", "libcudnn_graph"),
    "common-library": ("raise OSError('libcudart.so.13: cannot open shared object file')\n", "", "libcudart"),
    "version-check": ("", "raise AssertionError('TransformerEngine package version mismatch')", "version mismatch"),
    "driver": ("raise RuntimeError('CUDA driver too old')\n", "", "CUDA driver too old"),
    "missing-dependency": ("try:\n    from . import pytorch\nexcept ImportError:\n    pass\n",
                           "import flash_attn_not_installed_here", "flash_attn_not_installed_here"),
}


BROKEN_TE_CHECK = """
import sys, warnings
import torch
torch.cuda.is_available = lambda: True  # as on a GPU node: only TE's breakage decides the spec
import nemo_jq.models.megatron as backend
assert "megatron.core" not in sys.modules
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    status = backend.transformer_engine_status()
assert status.startswith("unusable (") and {reason!r} in status, status
assert any({reason!r} in str(w.message) for w in caught)
import megatron.core
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import transformer_block
from nemo_jq.models.megatron.provider import uses_transformer_engine
assert not gpt_layer_specs.HAVE_TE and not transformer_block.HAVE_TE and not uses_transformer_engine()
"""


def broken_te_script(folder: Path, mode: str) -> dict:
    """The check of one way TE breaks: its packages written under ``folder``, first on the script's import path."""
    top, subpackage, reason = BROKEN_TE[mode]
    (folder / "transformer_engine" / "pytorch").mkdir(parents=True)
    (folder / "transformer_engine" / "__init__.py").write_text(top)
    (folder / "transformer_engine" / "pytorch" / "__init__.py").write_text(subpackage + "\n")
    return {"code": BROKEN_TE_CHECK.format(reason=reason), "path": [folder],
            "env": {"PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}}


@pytest.fixture(scope="module")
def scripts_in_their_own_processes(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The checks below that need a process that has not imported megatron-core (nor TE) yet, each in its own, run
    together: forked from one Python (``helpers.run_scripts``) rather than a new interpreter each. Every test that
    takes this fixture is marked slow, since any one of them runs them all."""
    from helpers import run_scripts

    scripts = {f"broken-te:{mode}": broken_te_script(tmp_path_factory.mktemp("te"), mode) for mode in BROKEN_TE}
    scripts["no-te"] = {"code": NO_TE_CHECK}
    scripts["recompute"] = {"code": RECOMPUTE_UNDER_AUTOCAST.format(tests=str(Path(__file__).resolve().parent))}
    return dict(zip(scripts, run_scripts(list(scripts.values())), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(BROKEN_TE))
def test_a_broken_transformer_engine_is_reported_and_never_half_used(mode, scripts_in_their_own_processes):
    """Whatever breaks TE, megatron.core still imports with none of its TE paths, and the policy picks the
    local layer spec even where CUDA is available (the check imports transformer_engine.pytorch itself)."""
    result = scripts_in_their_own_processes[f"broken-te:{mode}"]
    assert result.returncode == 0, result.stderr[-2000:]


NO_TE_CHECK = ("import sys, nemo_jq.models.megatron as b; assert 'megatron.core' not in sys.modules; "
               "print(b.transformer_engine_status())")


@pytest.mark.slow
def test_no_transformer_engine_is_not_installed_and_imports_nothing(scripts_in_their_own_processes):
    result = scripts_in_their_own_processes["no-te"]
    assert result.returncode == 0 and result.stdout.strip() == "not installed", result.stderr[-2000:]


def devices_of_a_gpu_build() -> list[str]:
    """Build as on a GPU (no CPU initialisation), with the "current CUDA device" standing in as ``meta``."""
    from megatron.core import parallel_state

    from nemo_jq.models.megatron.provider import build_gpt_model

    parallel_state.initialize_model_parallel()
    torch.cuda.current_device = lambda: "meta"
    model = build_gpt_model(read_qwen3_config(untied_qwen3().config), use_cpu_initialization=False)
    return sorted({str(tensor.device) for tensor in [*model.parameters(), *model.buffers()]})


@pytest.mark.distributed
def test_the_local_spec_builds_every_module_on_the_models_device():
    """megatron-core's WrappedTorchNorm builds its norms on CPU whatever the device (the first GPU forward then mixes
    devices); the package's own norm follows the device the rest of the model is built on."""
    assert run_in_processes(devices_of_a_gpu_build, 1) == [["meta"]]


RECOMPUTE_UNDER_AUTOCAST = """
import sys, tempfile
import torch
# As on a GPU: megatron-core's linears re-enter the forward's autocast in their own backward (custom_fwd/custom_bwd
# name device "cuda"); pointing them at CPU autocast makes this CPU run take the GPU's code path.
_fwd, _bwd = torch.amp.custom_fwd, torch.amp.custom_bwd
torch.amp.custom_fwd = lambda fwd=None, *, device_type, cast_inputs=None: _fwd(fwd, device_type="cpu", cast_inputs=cast_inputs)
torch.amp.custom_bwd = lambda bwd=None, *, device_type: _bwd(bwd, device_type="cpu")
sys.path.insert(0, {tests!r})
from megatron_cpu import patch_megatron_for_cpu
patch_megatron_for_cpu()
torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
from test_megatron_backend import garl_batch, garl_loss_fn, untied_qwen3, SAMPLES, PROMPTS
from nemo_jq.models.megatron.policy import MegatronPolicy

def gradients(recompute):
    model = untied_qwen3()
    policy = MegatronPolicy.from_hf_model(model, recompute_activations=recompute, precision="bf16")
    batch = garl_batch(model.config.vocab_size)
    policy.forward_backward([batch], garl_loss_fn([batch], []))  # forward under bf16 autocast, backward outside
    return {{name: param.grad.clone() for name, param in policy.model.named_parameters()}}

plain, recomputed = gradients(False), gradients(True)
worst = max(float((plain[name] - recomputed[name]).abs().max()) for name in plain)
print("worst", worst)
assert worst == 0.0, worst
"""


@pytest.mark.slow
def test_recomputed_layers_run_under_the_forwards_autocast(scripts_in_their_own_processes):
    """Full recomputation under bf16 autocast (the GPU default, fp32 weights): megatron-core's checkpoint re-ran the
    layers outside autocast, on bf16 saved inputs (a dtype error in the local spec's linears); the gradients now
    equal those without recomputation, bit for bit."""
    result = scripts_in_their_own_processes["recompute"]
    assert result.returncode == 0, result.stderr[-3000:]


def pipeline_logprobs_under_autocast(pipeline_parallel: int) -> torch.Tensor:
    from nemo_jq.models.megatron.policy import MegatronPolicy

    model = untied_qwen3()
    policy = MegatronPolicy.from_hf_model(model, pipeline_parallel=pipeline_parallel, precision="bf16")
    with torch.no_grad():
        return policy.token_logprobs(garl_batch(model.config.vocab_size))


@pytest.mark.distributed
def test_pipeline_stages_exchange_activations_in_the_autocast_dtype():
    """Under bf16 autocast over fp32 weights a stage's output is bf16: the receiving stage's buffer must be too
    (an fp32 buffer took the bf16 bytes as garbage, half of it never written)."""
    one_stage = run_in_processes(pipeline_logprobs_under_autocast, 1, 1)[0]
    two_stages = run_in_processes(pipeline_logprobs_under_autocast, 2, 2)
    assert torch.equal(two_stages[0], two_stages[1])
    assert float((two_stages[1] - one_stage).abs().max()) < 0.05  # bf16 rounding, not garbage


def time_to_fail(group) -> tuple[float, str]:
    """On rank 0: how long a collective over ``group`` waits for a rank that never joins, and its error."""
    started = time.monotonic()
    try:
        dist.all_reduce(torch.zeros(1), group=group)
    except RuntimeError as err:
        return time.monotonic() - started, str(err)
    return time.monotonic() - started, "no error"


def waiting_in_the_backends_groups() -> list[tuple[float, str]]:
    """Rank 1 never joins: rank 0 waits on a megatron-core group (CP) and on the replica group nemo_jq makes."""
    from datetime import timedelta

    from nemo_jq.models.megatron.policy import MegatronPolicy
    from nemo_jq.runtime import distributed

    distributed.init_from_env(CPU, timedelta(seconds=2))  # one process group already: it records the timeout
    policy = MegatronPolicy.from_hf_model(untied_qwen3(), context_parallel=2)
    if dist.get_rank() == 1:
        time.sleep(7)
        return []
    return [time_to_fail(policy.cp_group), time_to_fail(policy.model_parallel_group)]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_left_waiting_in_a_backend_group_fails_after_the_configured_timeout():
    """megatron-core's groups took their own 30-minute default, and torch's new_group the backend's, whatever the
    world's timeout: train.collective_timeout_minutes now reaches every group."""
    waits = run_in_processes(waiting_in_the_backends_groups, 2)[0]
    assert len(waits) == 2
    for elapsed, error in waits:
        assert 1.5 < elapsed < 4.5 and "Timed out" in error, (elapsed, error)


def world_timeout_worker() -> tuple[float, str] | None:
    """The world group as ``nemo-jq train`` starts it under torchrun; rank 1 never joins a collective."""
    from datetime import timedelta

    from nemo_jq.runtime import distributed

    distributed.init_from_env(CPU, timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(7)
        return None
    return time_to_fail(None)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_world_group_takes_the_configured_timeout():
    waited, _ = run_in_processes(world_timeout_worker, 2, process_group=False)
    elapsed, error = waited
    assert 1.5 < elapsed < 4.5 and "Timed out" in error, (elapsed, error)


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view pins its whole storage)."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor an object holds in its attributes (lists, dicts and tuples walked), and its AdamW state."""
    found, stack = [], list(vars(obj).values()) + list(obj.optimizer.state.values())
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            found.append(item)
        elif isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
    return found


def zero_memory_worker(weights_dtype: str) -> dict[str, float]:
    """Bytes per parameter the distributed optimizer holds after a step, and the most it allocates to start."""
    from nemo_jq.models.megatron.zero import DistributedAdamW

    dtype = getattr(torch, weights_dtype)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in [(256, 256)] * 8 + [(37,)]]
    count = sum(param.numel() for param in params)
    optimizer, init_peak = peak_allocated(lambda: DistributedAdamW(
        params, dist.group.WORLD, counted_in_norm=[True] * len(params), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8))
    sum((param.float() ** 2).sum() for param in params).backward()
    optimizer.step(1.0, None)
    assert all(param.grad is None for param in params)  # the gradients live in the buffer only
    weights = {param.untyped_storage().data_ptr() for param in params}  # the model's, which plan counts apart
    held = [tensor for tensor in tensors_of(optimizer) if tensor.untyped_storage().data_ptr() not in weights]
    return {"held": held_bytes(held) / count, "init_peak": init_peak / count}


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.slow
@pytest.mark.distributed
def test_the_distributed_optimizer_holds_what_plan_says(weights):
    """4 bytes per parameter of gradients (one fp32 buffer) and 12 / DP of master weights and moments, within 5% at
    DP = 1, 2 and 4 (the norm's mask used to pin 4 more bytes per parameter at any DP), and no full-length copies
    at construction (it allocated 16 bytes per parameter transiently)."""
    from nemo_jq.cluster.plan import OPTIMIZER_MODES

    _, gradient_bytes, optimizer_bytes, sharded = OPTIMIZER_MODES["bf16-distopt" if weights == "bfloat16" else "fp32-distopt"]
    assert sharded
    for size in (1, 2, 4):
        measured = run_in_processes(zero_memory_worker, size, weights)
        planned = gradient_bytes + optimizer_bytes / size
        for rank in measured:
            assert rank["held"] == pytest.approx(planned, rel=0.05), (size, rank, planned)
            assert rank["init_peak"] <= 1.05 * (4 + 4 / size), (size, rank)


def train_steps(run_dir, overrides: list[str], steps: int = 3, resume: bool = False) -> list[dict[str, float]]:
    """``steps`` steps of the recipe (a new run, or ``resume``d with ``overrides``); the per-step training metrics
    from metrics.jsonl."""
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.monitor import read_metrics

    if resume:
        Trainer.resume(run_dir, [f"train.max_steps={steps}", *overrides]).fit()
    else:
        Trainer(load_config(None, [*TINY_RUN, f"train.max_steps={steps}", "eval.every=1000", f"train.run_dir={run_dir}",
                                   *overrides])).fit()
    keys = ("loss", "grad_norm", "rollout_tokens")
    return [{key: record.get(key) for key in keys} for record in read_metrics(run_dir) if record["kind"] == "train"]


@pytest.fixture(scope="module")
def hf_training(tmp_path_factory):
    """``hf_training(objective)``: three steps of the recipe on the hf backend, run once per objective for this
    module (every layout below compares against them)."""
    runs: dict[str, list[dict[str, float]]] = {}

    def metrics(objective: str) -> list[dict[str, float]]:
        if objective not in runs:
            runs[objective] = train_steps(tmp_path_factory.mktemp("hf"), [f"objective.name={objective}"])
        return runs[objective]

    return metrics


def assert_same_training(ours: list[dict], theirs: list[dict]) -> None:
    assert [r["rollout_tokens"] for r in ours] == [r["rollout_tokens"] for r in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(other[key], rel=1e-4, abs=1e-5), (key, mine, other)


@pytest.mark.parametrize("world_size, layout", [(1, []), (2, ["megatron.tensor_parallel=2"]), (2, ["megatron.pipeline_parallel=2"]),
                                                (2, ["megatron.context_parallel=2"])],
                         ids=["one-process", "tp2", "pp2", "cp2"])
@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_trains_alike_on_either_backend(world_size, layout, hf_training, tmp_path):
    """The trainer never branches on the backend: three GARL steps match the HF backend's, in one process and
    at TP=2 (where the replica's first rank samples the rollouts from its refitted HF copy and shares them)."""
    hf = hf_training("garl")
    ranks = run_in_processes(train_steps, world_size, tmp_path / "megatron", ["objective.name=garl", "model.backend=megatron", *layout])
    assert all(metrics == ranks[0] for metrics in ranks)  # every rank reads the one metrics.jsonl rank 0 wrote
    assert_same_training(ranks[0], hf)


@pytest.mark.parametrize("layout", [["megatron.distributed_optimizer=true"],
                                    ["megatron.distributed_optimizer=true", "megatron.context_parallel=2"],
                                    ["megatron.pipeline_parallel=2"]],
                         ids=["dp2-distributed-optimizer", "cp2-distributed-optimizer", "pp2-adamw"])
@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_process_recipe_equals_one_process_and_resumes_in_one(layout, hf_training, tmp_path):
    """SFT trains on given targets, so no sampling differs: at DP=2 each replica takes half of each batch,
    losses are divided by the global prompt count, and two steps equal the HF backend's two steps, with the
    distributed optimizer stepping half of AdamW's state on each replica (plain AdamW at DP=2 is checked by
    the parity test and the DP=2 GARL test below); at CP=2 the two ranks are one replica that splits each
    sequence, and the optimizer's state is split over them; at PP=2 each holds one layer. The checkpoint then
    resumes in one process (``--resume`` changing the layout) for a third step that equals the HF run's third."""
    hf = hf_training("sft")
    megatron = ["objective.name=sft", "model.backend=megatron", *layout]
    ranks = run_in_processes(train_steps, 2, tmp_path / "dp2", megatron, 2)
    assert ranks[0] == ranks[1] and len(ranks[0]) == 2  # logged once, by rank 0
    assert_same_training(ranks[0], hf[:2])
    checkpoint = tmp_path / "dp2" / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "megatron", "rng-rank1.pt", "rng.pt", "state.json"]
    one_process = ["megatron.context_parallel=1", "megatron.pipeline_parallel=1"]
    (resumed,) = run_in_processes(train_steps, 1, tmp_path / "dp2", one_process, 3, True)
    assert_same_training(resumed, hf)


def garl_at_two_replicas(run_dir) -> dict[str, Any]:
    """One GARL step at DP=2: what each replica trained on, and its weights before and after."""
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    trainer = Trainer(load_config(None, [*TINY_RUN, "train.max_steps=1", "eval.every=1000", "objective.name=garl",
                                         "model.backend=megatron", f"train.run_dir={run_dir}"]))
    examples, before = trainer.prompts.upcoming(trainer.state), trainer.policy.hf_state_dict()
    trainer.fit()
    return {"ids": [e.id for e in trainer.data_parallel.shard(examples)], "before": before,
            "after": trainer.policy.hf_state_dict()}


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_replicas_split_each_batch_and_stay_identical(tmp_path):
    first, second = run_in_processes(garl_at_two_replicas, 2, tmp_path / "run")
    assert len(first["ids"]) == len(second["ids"]) == 2 and not set(first["ids"]) & set(second["ids"])
    assert max_diff(first["after"], first["before"]) > 1e-4
    assert max_diff(first["after"], second["after"]) == 0.0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "checkpoints", "config.yaml", "metrics.jsonl", "results.json", "tokenizer", "training.png"]


def refuse_a_layout(run_dir, overrides: list[str]) -> None:
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    Trainer(load_config(None, [*TINY_RUN, "model.backend=megatron", f"train.run_dir={run_dir}", *overrides]))


@pytest.mark.parametrize("world_size, overrides, message", [
    (2, ["megatron.tensor_parallel=3"], "tensor_parallel=3 does not divide num_attention_heads=4"),
    (3, ["megatron.tensor_parallel=2"],
     "megatron.tensor_parallel=2 x pipeline_parallel=1 x context_parallel=1 does not divide the 3 processes"),
    (2, ["train.batch_size=3"], "train.batch_size=3 does not split over 2 data-parallel replicas"),
])
@pytest.mark.distributed
def test_impossible_layouts_are_named(world_size, overrides, message, tmp_path):
    with pytest.raises(Exception, match=message):
        run_in_processes(refuse_a_layout, world_size, tmp_path / "run", overrides)


def test_a_one_process_run_on_a_gpu_joins_an_nccl_group_as_torchrun_ranks_do(tmp_path, monkeypatch):
    """Without torchrun the backend makes its own one-process group: NCCL for a GPU (gloo would move every CUDA
    tensor of a collective through the host), gloo on CPU. This CPU build has no NCCL: the group's start is
    stood in for by a recorder that stops the build there (on the H100, calls 5-7 of docs/results/real_gpu.md)."""
    import torch.distributed as dist

    from helpers import small_qwen3
    from nemo_jq.backends import BackendRequest, megatron_backend
    from nemo_jq.config import load_config

    class Started(Exception):
        pass

    def record(backend, **_):
        raise Started(backend)

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", record)
    monkeypatch.setenv("NEMO_JQ_MEGATRON_ON_CPU", "1")
    folder = small_qwen3(tmp_path / "model", layers=2, tied=True)  # its config is all the build reads first
    config = load_config(None, [f"model.path={folder}", "model.backend=megatron"])
    for device, backend in (("cuda", "nccl"), ("cpu", "gloo")):
        request = BackendRequest(load_model=None, model_dir=folder, config=config, chat=None, device=torch.device(device))
        with pytest.raises(Started, match=f"^{backend}$"):
            megatron_backend(request)


def test_the_megatron_backend_on_cpu_without_the_patches_is_a_clear_error(tmp_path, capsys):
    from helpers import TINY_RUN
    from nemo_jq.cli import main

    code = main(["train", *TINY_RUN, "model.backend=megatron", f"train.run_dir={tmp_path / 'run'}"])
    assert code == 2 and "model.backend=megatron needs a CUDA device" in capsys.readouterr().err


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 nemo-jq train ARGS`` on CPU (``megatron_cpu`` applies the test patches first)."""
    from helpers import TINY_RUN
    from megatron_cpu import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "tests/megatron_cpu.py", "train", *TINY_RUN, "model.backend=megatron", "eval.every=1000", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(["tests", *sys.path])}
    return subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=300)


def failing_ranks_worker(rank1_fails_after: float | None, timeout: float) -> float:
    """Rank 0 fails at once, rank 1 ``rank1_fails_after`` seconds later (None: never); the seconds each rank
    then waited in ``await_failing_ranks`` before it would exit."""
    import time

    from nemo_jq.runtime import distributed

    if dist.get_rank() == 1:
        if rank1_fails_after is None:
            return 0.0
        time.sleep(rank1_fails_after)
    started = time.monotonic()
    distributed.await_failing_ranks(timeout)
    return time.monotonic() - started


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_rank_waits_for_the_others_to_fail_before_it_exits():
    """torchrun stops every rank once one exits: the first to fail waits (up to a timeout) until all have."""
    first, late = run_in_processes(failing_ranks_worker, 2, 1.0, 10.0)
    assert 0.9 <= first < 5.0 and late < 0.5, (first, late)
    alone, _ = run_in_processes(failing_ranks_worker, 2, None, 0.5)
    assert 0.5 <= alone < 2.0, alone


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_trains_a_data_parallel_run_and_names_a_bad_layout_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = torchrun("train.max_steps=2", f"train.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('"best_step": 2') == 1  # the summary, printed by rank 0 only
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == [1, 2]
    assert (run_dir / "checkpoints" / "step_00000002" / "rng-rank1.pt").exists()

    result = torchrun("train.batch_size=3", f"train.run_dir={tmp_path / 'bad'}")
    assert result.returncode != 0
    errors = sorted(line for line in result.stderr.splitlines() if line.startswith("nemo-jq train"))
    assert len(errors) == 2 and errors[0].startswith("nemo-jq train (rank 1): error: train.batch_size=3 "), errors
    assert errors[1].startswith("nemo-jq train: error: train.batch_size=3 "), errors


# ----------------------------------------------------------------- HF folders read shard by shard
def sharded_hf_folder(folder: Path, model, tokenizer=None) -> Path:
    """``model`` as an HF folder whose weights are split over several safetensors files and an index."""
    from nemo_jq.models.export import write_safetensors_shards

    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_safetensors_shards(((n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"), folder, 10_000)
    assert len(list(folder.glob("model-*.safetensors"))) > 5
    return folder


def folder_import_worker(folder: str) -> dict[str, float]:
    """The policy from the sharded folder against the one from the in-memory model, at TP=2; then broken folders."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, _, _, model = tiny_setup()
    from_folder = MegatronPolicy.from_hf_folder(Path(folder), tensor_parallel=2, **OPTIM)
    from_model = MegatronPolicy.from_hf_model(model, tensor_parallel=2, **OPTIM)
    diffs = {"weights": max_diff(from_folder.hf_state_dict(), from_model.hf_state_dict())}
    broken = Path(folder).parent / f"broken{dist.get_rank()}"
    shutil.copytree(folder, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="checkpoint is missing 'model.norm.weight'"):
        MegatronPolicy.from_hf_folder(broken, tensor_parallel=2, **OPTIM)
    (broken / index["weight_map"]["model.embed_tokens.weight"]).unlink()
    with pytest.raises(FileNotFoundError, match="lists weight files that do not exist: .*model-00001-of"):
        MegatronPolicy.from_hf_folder(broken, tensor_parallel=2, **OPTIM)
    return diffs


@pytest.mark.distributed
def test_an_hf_folder_is_read_shard_by_shard_bit_exact_and_names_what_is_missing(tmp_path):
    _, _, _, model = tiny_setup()
    folder = sharded_hf_folder(tmp_path / "hf", model)
    for rank, diffs in enumerate(run_in_processes(folder_import_worker, 2, str(folder))):
        assert diffs["weights"] == 0, (rank, diffs)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_from_a_sharded_hf_folder_at_tp2_trains_as_the_hf_backend(tmp_path):
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    source = Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'source'}"]))
    folder = sharded_hf_folder(tmp_path / "hf", source.policy.model, source.components.tokenizer)
    hf = train_steps(tmp_path / "hf_run", ["objective.name=garl", f"model.path={folder}"])
    ranks = run_in_processes(train_steps, 2, tmp_path / "megatron", ["objective.name=garl", "model.backend=megatron",
                                                                    "megatron.tensor_parallel=2", f"model.path={folder}"])
    assert_same_training(ranks[0], hf)


# ----------------------------------------------------------------- bf16 weights, fp32 masters
def bf16_weights_worker(scratch_dir: str) -> dict[str, Any]:
    """DP=2, bf16 weights: against HFPolicy in fp32, the masters' precision, and a checkpoint round trip."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, _, _, model = tiny_setup()
    hf = HFPolicy(copy.deepcopy(model), device=CPU, **OPTIM)
    policy = MegatronPolicy.from_hf_model(model, distributed_optimizer=True, bf16_weights=True, **OPTIM)
    batch = garl_batch(model.config.vocab_size)
    out: dict[str, Any] = {"dtypes": {param.dtype for param in policy.model.parameters()},
                           "master_dtype": policy.optimizer.master.dtype}
    with torch.no_grad():
        real = batch.target_mask
        out["logprobs"] = float((policy.token_logprobs(batch) - hf.token_logprobs(batch))[real].abs().max())
    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    hf.forward_backward(micro_batches, garl_loss_fn(micro_batches, []))
    mine = micro_batches[dist.get_rank()::2]
    policy.forward_backward(mine, garl_loss_fn(mine, []))
    out["grad_dtypes"] = {param.main_grad.dtype for param in policy.model.parameters()}
    out["bf16_grads_left"] = sum(param.grad is not None for param in policy.model.parameters())
    grads = policy.gather_hf({name: param.main_grad for name, param in policy.model.named_parameters()})
    for grad in grads.values():  # the distributed optimizer sums over DP only at its step
        dist.all_reduce(grad)
    out["grad_error"] = max(float((grads[name] - param.grad).norm() / param.grad.norm())
                            for name, param in hf.model.named_parameters())
    policy.optimizer_step()
    hf.optimizer_step()
    masters = policy.gather_hf(_masters(policy))
    out["master_after_step"] = max_diff(masters, dict(hf.model.named_parameters()))
    # A step far below bf16's resolution: the fp32 masters move, the bf16 weights are those masters rounded.
    policy.set_learning_rate(1e-6)
    policy.forward_backward(mine, garl_loss_fn(mine, []))
    policy.optimizer_step()
    small = policy.gather_hf(_masters(policy))
    out["small_step_master_moved"] = max_diff(small, masters)
    out["weights_are_rounded_masters"] = max_diff(policy.hf_state_dict(), {n: t.to(torch.bfloat16) for n, t in small.items()})

    checkpoint = Path(scratch_dir) / "bf16"
    policy.save(checkpoint)
    policy.forward_backward(mine, garl_loss_fn(mine, []))
    policy.optimizer_step()
    after = policy.gather_hf(_masters(policy))
    other = MegatronPolicy.from_hf_model(tiny_setup(seed=3)[3], distributed_optimizer=True, bf16_weights=True, **OPTIM)
    other.load(checkpoint)
    other.set_learning_rate(1e-6)
    out["resumed_masters"] = max_diff(other.gather_hf(_masters(other)), small)
    other.forward_backward(mine, garl_loss_fn(mine, []))
    other.optimizer_step()
    out["resumed_step"] = max_diff(other.gather_hf(_masters(other)), after)
    return out


def _masters(policy) -> dict[str, torch.Tensor]:
    """The distributed optimizer's fp32 master weights, gathered over DP, per parameter (megatron names)."""
    optimizer = policy.optimizer
    full = optimizer._gather(optimizer.master.detach())[:optimizer.total]
    pieces = full.split([param.numel() for param in optimizer.params])
    by_param = {id(param): piece.view_as(param) for param, piece in zip(optimizer.params, pieces)}
    return {name: by_param[id(param)] for name, param in policy.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_weights_train_on_fp32_masters_and_resume_them_bit_exact(tmp_path):
    """bf16 parameters with fp32 gradient accumulation and fp32 master weights in the distributed optimizer, at DP=2:
    log-probs and gradients within bf16's precision of HFPolicy in fp32, the masters after a step within a few bf16
    ulps of HF's weights; a step of 1e-6 moves the masters while the weights stay their bf16 rounding; a checkpoint
    restores the masters bit for bit, and the step after it equals the uninterrupted run's."""
    ranks = run_in_processes(bf16_weights_worker, 2, str(tmp_path))
    for out in ranks:
        assert out["dtypes"] == {torch.bfloat16} and out["master_dtype"] == torch.float32
        assert out["grad_dtypes"] == {torch.float32} and out["bf16_grads_left"] == 0
        assert out["logprobs"] < 0.02, out
        assert out["grad_error"] < 0.05, out
        assert out["master_after_step"] < 1e-3, out
        assert 5e-7 < out["small_step_master_moved"] < 2e-5, out
        assert out["weights_are_rounded_masters"] == 0
        assert out["resumed_masters"] == 0 and out["resumed_step"] == 0, out


@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_trains_with_bf16_weights_close_to_fp32(tmp_path):
    """The recipe with megatron.bf16_weights=true (one process): the steps' losses and gradient norms within bf16's
    precision of the HF backend's fp32 steps; the refit carries the bf16 weights into the fp32 rollout copy."""
    hf = train_steps(tmp_path / "hf", ["objective.name=sft"], 2)
    (bf16,) = run_in_processes(train_steps, 1, tmp_path / "bf16", ["objective.name=sft", "model.backend=megatron",
                                                                   "megatron.distributed_optimizer=true", "megatron.bf16_weights=true"], 2)
    for mine, other in zip(bf16, hf, strict=True):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(other[key], rel=0.03), (key, mine, other)
            assert mine[key] != other[key]  # bf16 did run


# ----------------------------------------------------------------- a tensor-parallel rollout engine's refit and sampling
class ScriptedSampler:
    """Stands for one rank of a tensor-parallel engine (vLLM's external launcher): samples drawn from the
    generator and shifted by the weights it was refitted with, so both the draws and the refit show."""

    def __init__(self, tensor_parallel: int):
        self.tensor_parallel, self.weights, self.calls = tensor_parallel, None, 0

    def load_weights(self, tensors):
        self.weights = {name: tensor.clone() for name, tensor in tensors}

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
        self.calls += 1
        shift = int(self.weights["w"].sum())
        return [[Sample([int(torch.randint(5, (1,), generator=generator)) + shift + len(prompt), stop_ids[0]], True)
                 for _ in range(num_samples)] for prompt in prompts]


class ScriptedPolicy:
    """The refit's view of a policy: one replica over the whole world, its weights streamed under HF names."""

    weights_version = 1
    model_parallel_group = None

    def iter_hf(self):
        for name, value in (("w", 20.0), ("v", 1.0)):
            yield name, torch.full((2,), value)


def tensor_parallel_refit_worker(tensor_parallel: int) -> dict[str, Any]:
    from nemo_jq.rollouts import BudgetedRollouts
    from nemo_jq.rollouts.refit import RefittedRolloutEngine

    policy = ScriptedPolicy()
    policy.model_parallel_group = dist.group.WORLD
    sampler = ScriptedSampler(tensor_parallel)
    engine = RefittedRolloutEngine(BudgetedRollouts(sampler, think_end_id=1, end_of_turn_id=2, max_thinking_tokens=4,
                                                    max_answer_tokens=3), policy)
    rollouts = engine.generate([[5, 6], [7]], 3, sample_answers=True, generator=torch.Generator().manual_seed(0))
    return {"calls": sampler.calls, "refitted": sampler.weights is not None, "rollouts": rollouts}


@pytest.mark.distributed
def test_a_tensor_parallel_rollout_engine_refits_and_samples_on_each_of_its_ranks():
    """rollout.tensor_parallel=2: both ranks of the replica take the refit and sample in step (as vLLM's external
    launcher needs), and the replica trains on the first one's rollouts; with one sampling rank only rank 0 does."""
    spread = run_in_processes(tensor_parallel_refit_worker, 2, 2)
    single = run_in_processes(tensor_parallel_refit_worker, 2, 1)
    assert [(r["calls"], r["refitted"]) for r in spread] == [(2, True), (2, True)]  # thinking, then answers
    assert [(r["calls"], r["refitted"]) for r in single] == [(2, True), (0, False)]
    rollouts = [r["rollouts"] for r in spread + single]
    assert all(r == rollouts[0] for r in rollouts)
    assert all(20 * 2 + 2 <= rollout.rationale_ids[0] < 20 * 2 + 2 + 5 for rollout in rollouts[0][0])  # refitted weights


def sampler_placement(precision: str) -> tuple[str, str]:
    """Where the megatron backend puts its sampler's HF model (a tiny model built in memory: no model.path)."""
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.components import build_components

    config = load_config(None, [*TINY_RUN, "model.backend=megatron", "megatron.tensor_parallel=2",
                                f"model.precision={precision}"])
    parts = build_components(config, torch.device("cpu"))
    weight = next(parts.engine.engine.sampler.model.parameters())
    return weight.device.type, str(weight.dtype)


@pytest.mark.distributed
def test_the_sampler_built_in_memory_is_on_its_rank_in_the_compute_dtype():
    """Without model.path the megatron backend's sampler decoded the model it built in memory, left on the host in
    fp32 on every rank (issue 29, D3): it is moved to the sampling rank's device in the compute dtype (bf16 here),
    and the other rank holds none."""
    assert run_in_processes(sampler_placement, 2, "bf16") == [("cpu", "torch.bfloat16"), ("meta", "torch.bfloat16")]
