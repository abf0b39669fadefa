"""What the Megatron backend allocates: its log-prob head, and its optimizer-state loads, measured on CPU.

Each check runs megatron-core in gloo processes (``megatron_cpu.run_in_processes``) and counts bytes with the
profiler's allocation events (``helpers.peak_allocated``) or the tensors autograd saves for backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from helpers import peak_allocated  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.models.interfaces import TokenBatch  # noqa: E402
from nemo_jq.models.megatron.logprobs import vocab_parallel_token_logprobs  # noqa: E402

pytestmark = pytest.mark.megatron

HIDDEN = 32


def qwen3(vocab_size: int, *, tied: bool, num_layers: int = 1, hidden_size: int = HIDDEN, seed: int = 0) -> Any:
    """A tiny Qwen3 (4 heads, 2 key-value heads); by default one layer of hidden size ``HIDDEN``, so that at a large
    vocabulary the LM head dominates memory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden_size // 4, max_position_embeddings=256, tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)


def scored_batch(vocab_size: int, rows: int, length: int, seed: int = 1) -> TokenBatch:
    """``rows`` right-padded rows whose every real token after the first is a target (rationale or answer)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length - 3, length + 1, (rows,), generator=generator)
    attention = (torch.arange(length) < lengths[:, None]).long()
    input_ids = torch.randint(vocab_size, (rows, length), generator=generator) * attention
    real = attention[:, 1:].bool()
    half = torch.arange(1, length) < length // 2
    return TokenBatch(input_ids, attention, real & half, real & ~half)


# ----------------------------------------------------------------- L3: the log-prob head
def head_memory_worker(tensor_parallel: int, vocab_sizes: list[int], rows: int, length: int, chunk: int) -> dict[str, Any]:
    """Per vocabulary size: the most bytes ``token_logprobs`` + backward allocates at once, and the bytes of the
    non-parameter tensors with a vocabulary dimension that autograd saves for backward."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    peaks, saved_vocab_bytes = [], []
    for vocab_size in vocab_sizes:
        policy = MegatronPolicy.from_hf_model(qwen3(vocab_size, tied=False), tensor_parallel=tensor_parallel,
                                              logprob_chunk_size=chunk)
        batch = scored_batch(vocab_size, rows, length)
        policy.token_logprobs(batch).sum().backward()  # first-call caches (rotary tables) out of the measurement
        policy.model.zero_grad(set_to_none=True)
        params = {param.data_ptr() for param in policy.model.parameters()}
        local_vocab = vocab_size // tensor_parallel
        saved = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if local_vocab in tensor.shape and tensor.data_ptr() not in params:
                saved.append(tensor.numel() * tensor.element_size())
            return tensor

        def step() -> None:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                logprobs = policy.token_logprobs(batch)
            logprobs.sum().backward()

        _, peak = peak_allocated(step)
        peaks.append(peak)
        saved_vocab_bytes.append(sum(saved))
    return {"peaks": peaks, "saved_vocab_bytes": saved_vocab_bytes}


@pytest.mark.parametrize("tensor_parallel", [1, 2])
@pytest.mark.distributed
def test_the_logprob_head_holds_one_chunk_of_logits_not_the_whole_vocabulary(tensor_parallel):
    """The head's memory per vocabulary entry (of this rank's slice), measured as the growth of the peak of a
    forward and backward from 1024 to 2048 entries, all else equal: one fp32 chunk of logits (``chunk``
    positions) and the [V, H] gradients of the LM head and the embedding (with the head's fp32 accumulator), at
    most ``4 * (chunk + 4 * H)`` = 640 bytes; measured 128. It was 4038 to 4304 bytes, over two fp32 copies of
    all N = 500 target positions' logits at once (the LM head's output, its [b, s, V] transpose, the targets' copy,
    their gradients, in turn), and autograd kept one copy (4 * N * V bytes) from forward to backward: now none."""
    rows, length, chunk = 4, 128, 32
    positions = rows * (length - 1)
    vocab_sizes = [1024, 2048]  # multiples of 128: no vocabulary padding
    for rank in run_in_processes(head_memory_worker, tensor_parallel, tensor_parallel, vocab_sizes, rows, length, chunk):
        per_entry = (rank["peaks"][1] - rank["peaks"][0]) / ((vocab_sizes[1] - vocab_sizes[0]) // tensor_parallel)
        assert per_entry <= 4 * (chunk + 4 * HIDDEN) < 4 * positions, (per_entry, rank)
        assert rank["saved_vocab_bytes"] == [0, 0], rank


def head_parity_worker(tensor_parallel: int, sequence_parallel: bool, tied: bool) -> dict[str, float]:
    """The policy's chunked head against the logits path it replaced: ``policy.model`` (which still returns
    vocab-parallel logits) and the logits kernel; log-probs and every parameter's gradient."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    vocab_size = 317  # Megatron pads it to 384: the padding columns must get probability 0
    policy = MegatronPolicy.from_hf_model(qwen3(vocab_size, tied=tied), tensor_parallel=tensor_parallel,
                                          sequence_parallel=sequence_parallel, logprob_chunk_size=5)
    batch = scored_batch(vocab_size, rows=3, length=12)
    weights = torch.randn(batch.target_mask.shape, generator=torch.Generator().manual_seed(2))
    params = [param for param in policy.model.parameters()]

    chunked = policy.token_logprobs(batch)
    chunked_grads = torch.autograd.grad((chunked * weights).sum(), params)

    length = batch.input_ids.shape[1]
    positions = torch.arange(length).expand_as(batch.input_ids)
    logits = policy.model(batch.input_ids, positions, torch.ones(length, length, dtype=torch.bool).triu(1)[None, None])
    targets = batch.target_mask
    picked = vocab_parallel_token_logprobs(logits[:, :-1][targets], batch.input_ids[:, 1:][targets],
                                           vocab_start=policy.vocab_start, vocab_size=vocab_size,
                                           group=policy.tp_group, chunk_size=5)
    whole = torch.zeros(targets.shape).index_put((targets,), picked)
    whole_grads = torch.autograd.grad((whole * weights).sum(), params)
    return {"logprobs": float((chunked - whole).abs().max()),
            "grads": max(float((a - b).abs().max()) for a, b in zip(chunked_grads, whole_grads)),
            "scale": max(float(grad.abs().max()) for grad in whole_grads)}


@pytest.mark.parametrize(("tensor_parallel", "sequence_parallel", "tied"),
                         [(1, False, True), (2, False, False), (2, True, True)])
@pytest.mark.distributed
def test_the_chunked_head_gives_the_logits_paths_logprobs_and_gradients(tensor_parallel, sequence_parallel, tied):
    for rank in run_in_processes(head_parity_worker, tensor_parallel, tensor_parallel, sequence_parallel, tied):
        assert rank["logprobs"] < 1e-5 and rank["grads"] < 1e-5 * max(1.0, rank["scale"]), rank


def test_the_head_kernel_is_log_softmax_of_the_projection_with_its_gradients():
    from nemo_jq.models.megatron.logprobs import vocab_parallel_head_logprobs

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(13, 6, dtype=torch.float64, generator=generator, requires_grad=True)  # 3 padding rows
    targets = torch.randint(10, (23,), generator=generator)
    expected = torch.log_softmax((hidden @ weight.T)[:, :10], -1).gather(1, targets[:, None]).squeeze(1)
    got = vocab_parallel_head_logprobs(hidden, weight, targets, vocab_size=10, chunk_size=5)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(
        lambda h, w: vocab_parallel_head_logprobs(h, w, targets, vocab_size=10, chunk_size=4), (hidden, weight))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        vocab_parallel_head_logprobs(hidden, weight, targets, chunk_size=0)


# ----------------------------------------------------------------- L2: loading the distributed optimizer's state
def optimizer_load_worker(scratch_dir: str, weights_dtype: str) -> dict[str, Any]:
    """With the distributed optimizer over 2 data-parallel ranks: a step and a checkpoint, loaded by a new policy
    (a resume) and by the first after another step (the collapse guard's restore). The most bytes each load
    allocates at once, this rank's shard of the AdamW state and the whole (replicated) state; and the largest
    difference between the state after each load and the state saved."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    vocab_size = 128
    batch = scored_batch(vocab_size, rows=2, length=8, seed=1 + dist.get_rank())

    def new_policy() -> MegatronPolicy:
        # the ranks' shards meet 32 elements into a row of layer 3's linear_fc2 (rows of 128): a row read in part
        return MegatronPolicy.from_hf_model(qwen3(vocab_size, tied=True, num_layers=8, hidden_size=64),
                                            distributed_optimizer=True, bf16_weights=weights_dtype == "bfloat16", lr=1e-2)

    def step(policy: MegatronPolicy) -> None:
        policy.forward_backward([batch], lambda logprobs, index: (-logprobs.sum() / 32, {}))
        policy.optimizer_step()

    def state(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
        optimizer = policy.optimizer
        return {"master": optimizer.master.detach().clone(),
                **{key: value.clone() for key, value in optimizer.state[optimizer.master].items()}}

    def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[key] - b[key]).abs().max()) for key in a)

    trained = new_policy()
    step(trained)
    saved = state(trained)
    trained.save(Path(scratch_dir))
    step(trained)
    resumed = new_policy()
    _, resume_peak = peak_allocated(lambda: resumed.load(Path(scratch_dir)))
    _, restore_peak = peak_allocated(lambda: trained.load(Path(scratch_dir)))
    optimizer = trained.optimizer
    state_bytes = 4 * (3 if optimizer.holds_more_than_params else 2)  # moments, and master weights under bf16
    return {"resume_peak": resume_peak, "restore_peak": restore_peak,
            "resume_diff": difference(state(resumed), saved), "restore_diff": difference(state(trained), saved),
            "shard_state_bytes": state_bytes * optimizer.shard, "whole_state_bytes": state_bytes * optimizer.total}


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.slow
@pytest.mark.distributed
def test_resume_reads_only_this_ranks_shard_of_the_optimizer_state(weights, tmp_path):
    """A resume allocated the whole replicated state on every rank (zeros to load into, then a copy of each moment:
    1.5 to 1.65 times it here), whatever DP. Now a restore into a running optimizer reads into its moments in place
    and allocates only what the weights' load does (megatron-core reads each SwiGLU ``linear_fc1`` weight in two
    halves and concatenates them: a copy of those weights); a resume allocates on top of that this rank's shard
    of the moments (a bf16 run's master weights go straight into the optimizer's own), never the whole. Both leave
    the state exactly as saved."""
    for rank in run_in_processes(optimizer_load_worker, 2, str(tmp_path), weights):
        assert rank["resume_diff"] == 0 and rank["restore_diff"] == 0, rank
        assert rank["restore_peak"] < 0.5 * rank["whole_state_bytes"], rank
        assert rank["resume_peak"] <= rank["restore_peak"] + rank["shard_state_bytes"] + 0.05 * rank["whole_state_bytes"], rank
        assert rank["resume_peak"] < rank["whole_state_bytes"], rank


# ----------------------------------------------------------------- L7: the local spec's core attention on GPU
def attention_worker(tensor_parallel: int) -> dict[str, float]:
    """megatron-core's local ``DotProductAttention`` (with the causal mask the policy passes it) against
    ``SDPADotProductAttention`` (causal without a mask, and with it), on one TP rank's heads: outputs, input
    gradients, and the bytes of ``[.., s, s]`` tensors each saves for backward."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from nemo_jq.models.megatron.attention import SDPADotProductAttention
    from nemo_jq.models.megatron.layout import MegatronLayout
    from nemo_jq.models.megatron.provider import read_qwen3_config, transformer_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    config = transformer_config(read_qwen3_config(qwen3(128, tied=True).config), MegatronLayout(tensor_parallel))
    length, rows, heads, groups, head_dim = 24, 3, 4 // tensor_parallel, 2 // tensor_parallel, HIDDEN // 4
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs = [torch.randn(length, rows, count, head_dim, generator=generator, requires_grad=True)
              for count in (heads, groups, groups)]
    causal_mask = torch.ones(length, length, dtype=torch.bool).triu(1)[None, None]  # True: masked

    def run(module_class, mask) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        module = module_class(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        saved = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() >= 2 and tensor.shape[-2:] == (length, length) and tensor.numel() > length * length:
                saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = module(*inputs, mask)
        return out, torch.autograd.grad(out.square().sum(), inputs), sum(saved)

    local, local_grads, local_saved = run(DotProductAttention, causal_mask)
    results = {"local_saved_scores_bytes": local_saved}
    for name, mask in (("causal", None), ("masked", causal_mask)):
        out, grads, saved = run(SDPADotProductAttention, mask)
        results[f"{name}_out"] = float((out - local).abs().max())
        results[f"{name}_grads"] = max(float((a - b).abs().max()) for a, b in zip(grads, local_grads))
        results[f"{name}_saved_scores_bytes"] = saved
    return results


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_sdpa_core_attention_equals_the_local_one_without_keeping_the_scores(tensor_parallel):
    """The local spec's attention keeps the [b, heads / TP, s, s] softmax for backward (here 3 x 4/TP x 24 x 24
    fp32); SDPA, the core attention on GPU without TE (``provider.uses_sdpa_attention``), gives the same outputs
    and gradients (grouped queries included) and keeps nothing of that size."""
    for rank in run_in_processes(attention_worker, tensor_parallel, tensor_parallel):
        assert rank["local_saved_scores_bytes"] >= 3 * (4 // tensor_parallel) * 24 * 24 * 4, rank
        for name in ("causal", "masked"):
            assert rank[f"{name}_out"] < 1e-5 and rank[f"{name}_grads"] < 1e-4, rank
            assert rank[f"{name}_saved_scores_bytes"] == 0, rank


def core_attention_of_builds() -> dict[str, bool]:
    """Whether the core attention is SDPA in a CPU build and in a build as on a GPU (the "current CUDA device"
    standing in as ``meta``), TE absent."""
    from megatron.core import parallel_state

    from nemo_jq.models.megatron.attention import SDPADotProductAttention
    from nemo_jq.models.megatron.provider import build_gpt_model, read_qwen3_config

    parallel_state.initialize_model_parallel()
    arch = read_qwen3_config(qwen3(128, tied=True).config)
    cpu = build_gpt_model(arch)
    torch.cuda.current_device = lambda: "meta"
    gpu = build_gpt_model(arch, use_cpu_initialization=False)
    return {name: isinstance(model.decoder.layers[0].self_attention.core_attention, SDPADotProductAttention)
            for name, model in (("cpu", cpu), ("gpu", gpu))}


def test_the_local_spec_attends_with_sdpa_on_gpu_only():
    """On CPU the local spec keeps megatron-core's attention (the CPU tests' context-parallel stand-in replaces it)."""
    assert run_in_processes(core_attention_of_builds, 1) == [{"cpu": False, "gpu": True}]
