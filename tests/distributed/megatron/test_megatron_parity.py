"""The Megatron-core backend against the HF backend on tiny Qwen3s, on CPU: logits, log-probs, the GARL loss,
gradients and a step at TP / SP / CP / DP / PP, and the vocabulary-parallel log-prob kernel.

Parallel runs use gloo processes (``megatron_cpu.run_in_processes``); each worker compares
against ``HFPolicy`` on the same weights and returns max abs differences, asserted here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import torch.distributed as dist  # noqa: E402

from helpers import tiny_setup  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import (  # noqa: E402
    CPU,
    OPTIM,
    PROMPTS,
    SAMPLES,
    garl_batch,
    garl_loss_fn,
    garl_step,
    max_diff,
    megatron_names,
    untied_qwen3,
)
from nemo_jq.models.hf import HFPolicy  # noqa: E402
from nemo_jq.models.megatron.logprobs import vocab_parallel_token_logprobs  # noqa: E402


def full_vocab_logits(policy, input_ids: torch.Tensor) -> torch.Tensor:
    """``[N, L, V]`` logits of a MegatronPolicy, gathered over its TP ranks."""
    length = input_ids.shape[1]
    positions = torch.arange(length).expand_as(input_ids)
    local = policy.model(input_ids, positions, torch.ones(length, length, dtype=torch.bool).triu(1)[None, None])
    pieces = [torch.empty_like(local) for _ in range(policy.tp_size)]
    dist.all_gather(pieces, local.contiguous(), group=policy.tp_group)
    return torch.cat(pieces, dim=-1)[..., : policy.arch.vocab_size]


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
