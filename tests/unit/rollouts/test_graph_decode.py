"""The decode under CUDA graphs (``nemo_jq/rollouts/graphs.py``), checked on the CPU by running its steps eagerly: the
same static cache, row buckets, length buckets and compaction, the same code a GPU captures. What only a GPU shows
(the capture and its speed) is bench/real_gpu.py's ``speed`` part (bench/results/real_gpu.json)."""

import warnings

import pytest
import torch

from helpers import tiny_setup
from nemo_jq.config import Config
from nemo_jq.dryrun.world import patched
from nemo_jq.models.hf import tiny_qwen3
from nemo_jq.rollouts import SAMPLERS, SamplerRequest, graphs, qwen3_decode
from nemo_jq.rollouts.graphs import GraphSampler, StaticDecode, length_bucket, row_bucket
from nemo_jq.rollouts.hf import NativeSampler

CPU = torch.device("cpu")


def _model(vocab: int = 48, seed: int = 0):
    return tiny_qwen3(vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                      max_position_embeddings=512, seed=seed).eval()


def _prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(8, 48, (length,), generator=generator).tolist() for length in (3, 7, 5, 9, 4)]


def _sample(sampler, prompts, *, greedy=False, budget=80):
    """Two stop ids a random 48-token model samples often: rows stop at many different steps."""
    return sampler.sample(prompts, 6, stop_ids=[5, 7], max_new_tokens=budget, generator=torch.Generator().manual_seed(1),
                          greedy=greedy)


@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
@pytest.mark.parametrize("kv_cache_tokens,greedy", [(None, False), (200, False), (None, True)])
def test_the_static_decode_samples_what_the_native_sampler_samples(attention, kv_cache_tokens, greedy):
    """Token for token, stop for stop, with the same log-probs, while compaction moves rows into smaller buckets and
    the length grows through several buckets (every chunk of a chunked request too)."""
    model, prompts = _model(), _prompts()
    expected = _sample(NativeSampler(model, pad_id=0, device=CPU, kv_cache_tokens=kv_cache_tokens), prompts, greedy=greedy)
    sampler = GraphSampler(model, pad_id=0, device=CPU, kv_cache_tokens=kv_cache_tokens, attention=attention)
    buckets, compactions = set(), []
    real_step, real_compact = StaticDecode._step, StaticDecode._compact

    def step(self, batch, length):
        buckets.add((batch, length))
        return real_step(self, batch, length)

    def compact(self, batch, column):
        compactions.append(batch)
        return real_compact(self, batch, column)

    with patched(StaticDecode, "_step", step), patched(StaticDecode, "_compact", compact):
        got = _sample(sampler, prompts, greedy=greedy)
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in expected]
    assert [[s.stopped for s in g] for g in got] == [[s.stopped for s in g] for g in expected]
    for group, reference in zip(got, expected):
        for sample, other in zip(group, reference):
            assert sample.logprobs == pytest.approx(other.logprobs, abs=1e-5)
    if not greedy:  # greedy rows of a random model never stop: nothing to compact
        assert compactions and len({batch for batch, _ in buckets}) > 1
    assert len({length for _, length in buckets}) > 1


def test_buckets_hold_what_they_must_and_read_at_most_an_eighth_more():
    for rows in (1, 5, 32, 96):
        for count in range(1, rows + 1):
            bucket = row_bucket(count, rows)
            assert count <= bucket <= rows and (bucket == rows or bucket & (bucket - 1) == 0)
    for need in range(1, 9000, 7):
        length = length_bucket(need, capacity=8192)
        assert length == 8192 if need > 8192 - 512 else need <= length <= max(need + 63, need * 9 // 8)
    assert length_bucket(5000, capacity=5100) == 5100


def test_the_step_reads_the_model_s_own_weights_so_a_refit_in_place_is_seen():
    """Where the model holds its weights in the compute dtype, the step holds those tensors, no copies: a refit that
    writes into them (as ``load_weights`` does) changes what the next step (a graph's next replay) computes."""
    model = _model()
    sampler = GraphSampler(model, pad_id=0, device=CPU)
    step = sampler.decode_step()
    assert step.copies == []
    state = StaticDecode(sampler, step, rows=2, capacity=16, max_new_tokens=4, stop_ids=[5], settings=sampler.settings)

    def logits():
        return step(torch.tensor([9, 10]), torch.tensor([0, 0]), torch.zeros(1, dtype=torch.long),
                    torch.ones(2, 1, dtype=torch.bool), [k[:2] for k in state.keys], [v[:2] for v in state.values],
                    sampler.attention)

    before = logits()
    sampler.load_weights([(name, tensor * 1.5) for name, tensor in model.state_dict().items()
                          if name != "lm_head.weight"])
    assert not torch.allclose(before, logits())


def test_an_fp32_policy_decodes_from_weights_cast_once_a_call():
    """Under bf16 (the GPU's autocast), the step's matrix products read bf16 copies of the fp32 policy's weights, made
    when the step is built (once a sampling call), not at every step as autocast would; q/k/v and gate/up each cast
    into one matrix, whose products are the separate ones'."""
    model = _model()
    step = GraphSampler(model, pad_id=0, device=CPU, precision="bf16").decode_step()
    matrices = 4 * len(model.model.layers) + 1  # qkv, o, gate_up, down per layer, and the (tied) head
    assert len(step.copies) == matrices and all(copy.dtype == torch.bfloat16 for copy in step.copies)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert torch.equal(step.layers[0]["qkv"][0], torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                                            attention.v_proj.weight]).bfloat16())
    assert torch.equal(step.layers[0]["gate_up"][0], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).bfloat16())
    h = torch.randn(3, 1, model.config.hidden_size).bfloat16()
    q, k, v = qwen3_decode.project(h, step.layers[0]["qkv"], [64, 32, 32])
    torch.testing.assert_close(q, torch.nn.functional.linear(h, attention.q_proj.weight.bfloat16()))
    torch.testing.assert_close(v, torch.nn.functional.linear(h, attention.v_proj.weight.bfloat16()))


def _request(model, device, **rollout):
    config = Config()
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    return SamplerRequest(model=model, model_dir=None, config=config, pad_id=0, device=torch.device(device))


def test_the_native_engine_is_the_graph_path_on_a_gpu_and_the_eager_loop_elsewhere():
    """On the dry run's stand-in GPU (``meta``) as on a GPU: the graph path, uncompiled there; ``rollout.cuda_graphs=false``,
    a CPU, or a model family without a decode step: the eager native sampler, as before."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = _model()
    on_gpu = SAMPLERS["native"](_request(model, "meta"))
    assert type(on_gpu) is GraphSampler and not on_gpu.compiled
    assert type(SAMPLERS["native"](_request(model, "meta", cuda_graphs=False))) is NativeSampler
    assert type(SAMPLERS["native"](_request(model, "cpu"))) is NativeSampler
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert type(SAMPLERS["native"](_request(llama, "meta"))) is NativeSampler
    with pytest.raises(ValueError, match="no decode step is registered for model_type 'llama'"):
        GraphSampler(llama, pad_id=0, device=CPU)


def test_a_compiler_failure_leaves_the_step_unfused_and_says_so(monkeypatch):
    def failing(*args):
        raise RuntimeError("no C compiler here\nmore")

    monkeypatch.setattr(torch, "compile", lambda function, **options: failing)
    fused = graphs.Fused(qwen3_decode.rms_norm)
    x, weight = torch.randn(3, 8), torch.rand(8)
    with pytest.warns(UserWarning, match="rms_norm failed .RuntimeError: no C compiler here.; the decode runs unfused"):
        out = fused(x, weight, 1e-6)
    assert torch.equal(out, qwen3_decode.rms_norm(x, weight, 1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        fused(x, weight, 1e-6)


def test_a_refused_capture_leaves_the_sampler_decoding_eagerly_with_the_same_samples(monkeypatch):
    """Where torch refuses to record a step (a fake CUDA stands in: this CPU has none), that step has run all the same:
    the call goes on eagerly, draws what the eager sampler draws, says so once, and the sampler stays eager."""
    import contextlib
    from types import SimpleNamespace

    def refused(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    stream = SimpleNamespace(wait_stream=lambda other: None)
    for name, fake in (("graph_pool_handle", lambda: None), ("Stream", lambda device: stream),
                       ("current_stream", lambda device: stream), ("stream", lambda s: contextlib.nullcontext()),
                       ("CUDAGraph", object), ("graph", refused)):
        monkeypatch.setattr(torch.cuda, name, fake)
    model, prompts = _model(), _prompts()
    expected = _sample(NativeSampler(model, pad_id=0, device=CPU), prompts)
    sampler = GraphSampler(model, pad_id=0, device=CPU, graphs=True)
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph .operation not permitted"):
        got = _sample(sampler, prompts)
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in expected]
    assert sampler.graphs is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sample(sampler, prompts)


@pytest.mark.slow
def test_the_compiled_step_samples_what_the_native_sampler_samples():
    """``torch.compile`` (here its CPU backend) fuses the step's elementwise work; the samples stay the same."""
    model, prompts = _model(), _prompts()
    expected = _sample(NativeSampler(model, pad_id=0, device=CPU), prompts, budget=24)
    got = _sample(GraphSampler(model, pad_id=0, device=CPU, compiled=True), prompts, budget=24)
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in expected]


def test_the_budget_core_over_the_graph_path_gives_the_native_engine_s_rollouts():
    """Through the budget core (thinking, forced ``</think>``, answers) with the tiny task's real chat format."""
    from nemo_jq.rollouts.budget import BudgetedRollouts

    _, _, chat, model = tiny_setup()
    prompts = [[chat.pad_id + 1] * 3, [chat.pad_id + 2] * 5]

    def rollouts(sampler):
        engine = BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                                  max_thinking_tokens=8, max_answer_tokens=3)
        groups = engine.generate(prompts, 4, sample_answers=True, generator=torch.Generator().manual_seed(5))
        return [(r.rationale_ids, r.think_end_forced, r.answer_ids) for g in groups for r in g]

    assert rollouts(GraphSampler(model, pad_id=chat.pad_id, device=CPU)) == \
        rollouts(NativeSampler(model, pad_id=chat.pad_id, device=CPU))
