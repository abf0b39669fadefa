"""Chunked log-probs, the HF policy, export round trip, and the evaluation metrics."""

import contextlib
import itertools
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import tiny_setup
from nemo_jq.data import Example, SyntheticArithmetic
from nemo_jq.models.common import autocast_context
from nemo_jq.models.hf import HFPolicy
from nemo_jq.models.logprobs import chunked_token_logprobs
from nemo_jq.recipe.evaluation import majority_answer, pass_at_k, score_outputs
from nemo_jq.recipe.sequences import collate


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_logprobs_equal_naive_log_softmax_gather(chunk_size):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(97, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(97, (40,), generator=gen)
    upstream = torch.randn(40, generator=gen, dtype=torch.float64)
    ours = chunked_token_logprobs(hidden, weight, targets, chunk_size)
    naive = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(ours, naive)
    ours_grads = torch.autograd.grad((ours * upstream).sum(), (hidden, weight))
    naive_grads = torch.autograd.grad((naive * upstream).sum(), (hidden, weight))
    for a, b in zip(ours_grads, naive_grads):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(hidden, weight, targets, 0)


def _batch(chat, task):
    rows = []
    for example, extra in zip(task.splits(3, 0, 0, seed=4).train, ([], [7, 8], [9])):
        prompt = chat.prompt_ids(task.messages(example, "cold"))
        rows.append((prompt + extra + chat.answer_ids(example.answer),
                     [False] * (len(prompt) - 1) + [True] * len(extra) + [False] * 3,
                     [False] * (len(prompt) - 1 + len(extra)) + [True] * 3))
    return collate([(ids, r[: len(ids) - 1], a[: len(ids) - 1]) for ids, r, a in rows], chat.pad_id)


def test_policy_logprobs_equal_the_models_own_logits():
    task, _, chat, model = tiny_setup()
    policy = HFPolicy(model, device=torch.device("cpu"), logprob_chunk_size=5)
    batch = _batch(chat, task)
    ours = policy.token_logprobs(batch)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    naive = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(ours.detach(), naive * batch.target_mask, atol=1e-5, rtol=1e-5)
    assert ours[~batch.target_mask].eq(0).all()


def test_policy_step_changes_weights_and_clips():
    task, _, chat, model = tiny_setup()
    policy = HFPolicy(model, device=torch.device("cpu"), lr=1e-2, grad_clip=0.5)
    before = model.get_output_embeddings().weight.detach().clone()
    batch = _batch(chat, task)
    metrics = policy.forward_backward([batch, batch], lambda lp, index: (-lp.sum(), {"micro_batch": index}))
    assert metrics == [{"micro_batch": 0}, {"micro_batch": 1}]  # what each loss_fn call reported, in order
    stats = policy.optimizer_step()
    assert stats["grad_norm"] > 0.5  # reported before clipping
    assert not torch.equal(before, model.get_output_embeddings().weight)
    assert all(p.grad is None for p in model.parameters())


def test_export_round_trip_gives_the_same_logits(tmp_path):
    task, tokenizer, chat, model = tiny_setup()
    policy = HFPolicy(model, device=torch.device("cpu"))
    policy.export(tmp_path / "hf", tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    batch = _batch(chat, task)
    with torch.no_grad():
        a = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        b = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(a, b)
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "tokenizer.json").exists()


def test_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in [(16, 0, 1), (16, 16, 16), (16, 3, 1), (16, 3, 4), (10, 2, 9), (5, 5, 2)]:
        brute = sum(any(s) for s in itertools.combinations([True] * c + [False] * (n - c), k)) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(brute)
    with pytest.raises(ValueError, match="k must lie"):
        pass_at_k(4, 1, 5)


def test_majority_vote_and_scores():
    assert majority_answer(["1", "2", "2", "1"]) == "1"  # tie: first seen
    assert majority_answer(["3", "2", "2"]) == "2"
    task = SyntheticArithmetic()
    examples = [Example("a", "1+2+3", "6"), Example("b", "9+9+9", "27")]
    outputs = [["6", "5", "the answer is 6", "7"], ["27 ", "127", " 27", "2 7"]]
    scores = score_outputs(task, examples, outputs, k=4)
    # a: 2/4 hold the whole number 6, majority "6"; b: only "27" (twice, spaces aside) is 27, and it wins the vote.
    assert scores == {"p@1": pytest.approx(100 * (0.5 + 0.5) / 2), "p@4": 100.0, "m@4": 100.0}
    assert task.reward("6", examples[0]) == 1.0 and task.reward("the answer is 6", examples[0]) == 0.0
    assert task.reward("2 7", examples[1]) == 0.0 and task.reward(" 27\n", examples[1]) == 1.0


def test_bf16_autocast_path_runs_on_cpu():
    """The GPU precision path (bf16 autocast over fp32 master weights), exercised with CPU autocast."""
    task, _, chat, model = tiny_setup()
    policy = HFPolicy(model, device=torch.device("cpu"), precision="bf16", lr=1e-3)
    batch = _batch(chat, task)
    logprobs = policy.token_logprobs(batch)
    assert logprobs.dtype == torch.float32
    fp32 = HFPolicy(tiny_setup()[3], device=torch.device("cpu"), precision="fp32").token_logprobs(batch)
    torch.testing.assert_close(logprobs, fp32, atol=0.1, rtol=0.05)  # bf16 rounding only
    # autocast caches its weight casts only where a backward follows: without grad (a scoring pass, a sampler's
    # prefill) the cache held a bf16 copy of every weight until the forward ended, beside the KV cache
    cached = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: cached.append(torch.is_autocast_cache_enabled()))
    with torch.no_grad():
        policy.token_logprobs(batch)
    with torch.inference_mode(), autocast_context(torch.device("cpu"), "bf16"):
        model(batch.input_ids)
    policy.forward_backward([batch], lambda lp, _i: (-lp.sum(), {}))
    hook.remove()
    assert cached == [False, False, True]
    assert all(p.grad is None or (p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()) for p in model.parameters())
    assert policy.optimizer_step()["grad_norm"] > 0
    with pytest.raises(ValueError, match="precision"):
        HFPolicy(model, device=torch.device("cpu"), precision="fp8")


def test_the_optimizer_runs_a_gpus_kernels_on_any_accelerator_and_the_hosts_on_the_host():
    """Foreach AdamW on a GPU holds the square root of its second moment for the whole model at once (measured on an
    H100: the step's peak was 11.22 GiB, 1.12x the dry run's until the dry run's ``meta`` ran the same kernels)."""
    from nemo_jq.models.common import build_optimizer

    for device, foreach in (("cpu", False), ("meta", True)):
        params = [torch.nn.Parameter(torch.zeros(3, device=device))]
        for name in ("adamw", "sgd"):
            assert build_optimizer(params, name, lr=1e-3).defaults["foreach"] is foreach, (device, name)


def test_under_autocast_the_log_prob_head_s_backward_multiplies_in_the_forward_s_dtype():
    """Backward runs outside autocast: the head's products take the forward's bf16 explicitly (fp32 hidden states
    from Qwen3's final norm would otherwise make them fp32 products, off a GPU's bf16 matrix rate), accumulating the
    weight's gradient in fp32; the gradients stay those of fp32 within bf16 rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.dtypes.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=generator)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(50, (40,), generator=generator)
    grads = {}
    for name, context in (("fp32", contextlib.nullcontext()), ("bf16", torch.autocast("cpu", dtype=torch.bfloat16))):
        leaf = hidden.clone().requires_grad_()
        with context:
            out = chunked_token_logprobs(leaf, weight, targets, chunk_size=16)
        weight.grad = None
        with Products() as products:
            out.sum().backward()
        grads[name] = (leaf.grad, weight.grad, products.dtypes)
    assert set(grads["fp32"][2]) == {torch.float32} and set(grads["bf16"][2]) == {torch.bfloat16}
    assert grads["bf16"][1].dtype == torch.float32
    for ours, reference in zip(grads["bf16"][:2], grads["fp32"][:2]):
        torch.testing.assert_close(ours, reference, atol=0.05, rtol=0.05)


@pytest.mark.slow
def test_a_compiled_policy_scores_and_trains_as_the_plain_one():
    """``model.compile``: each layer's attention, MLP and norms under torch.compile (its CPU backend here) while the
    policy scores and trains, activation checkpointing's recomputation included; the sampler's own forwards of the
    same model stay plain."""
    task, _, chat, _ = tiny_setup()
    batch = _batch(chat, task)
    results = []
    for compiled in (False, True):
        model = tiny_setup()[3]
        policy = HFPolicy(model, device=torch.device("cpu"), compiled=compiled, activation_checkpointing=True)
        scored = policy.token_logprobs(batch)
        policy.forward_backward([batch], lambda lp, _i: (-lp.sum(), {}))
        results.append((scored, [p.grad.clone() for p in model.parameters()]))
        assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)  # plain outside
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    for ours, reference in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-3)
