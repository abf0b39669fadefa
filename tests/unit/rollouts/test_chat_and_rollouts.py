"""Chat format, token-level splicing, and the rollout engine's thinking budget."""

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from helpers import SAMPLERS, qwen3_tokenizer_dir, rollout_engine, tiny_setup
from nemo_jq.data.chat import ChatFormat
from nemo_jq.models.interfaces import Rollout
from nemo_jq.recipe.sequences import collate, reference_answer_batch, sampled_answer_batch, splice


@pytest.fixture(scope="module")
def qwen3():
    return PreTrainedTokenizerFast.from_pretrained(qwen3_tokenizer_dir())


def test_built_tokenizer_renders_prompts_like_the_real_qwen3_template(qwen3):
    _, tokenizer, _, _ = tiny_setup()
    for messages in (
        [{"role": "user", "content": "7+5+8"}],
        [{"role": "system", "content": "Add numbers."}, {"role": "user", "content": "What is 7+5+8?"}],
    ):
        for thinking in (True, False):
            ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking, tokenize=False)
            real = qwen3.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking, tokenize=False)
            assert ours == real


def test_chat_format_on_the_real_qwen3_tokenizer(qwen3):
    chat = ChatFormat(qwen3)
    assert chat.think_end_id == qwen3.convert_tokens_to_ids("</think>")
    prompt = chat.prompt_ids([{"role": "user", "content": "7+5+8"}])
    assert qwen3.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    answer = chat.answer_ids("20")
    assert answer[-1] == qwen3.convert_tokens_to_ids("<|im_end|>")
    assert qwen3.decode(answer) == "\n\n20<|im_end|>"
    assert chat.decode_answer(answer) == "20"


def test_splice_marks_spans_and_skips_a_forced_think_end():
    ids, in_rationale, in_answer = splice([1, 2, 3], [10, 11], 99, False, [20, 21])
    assert ids == [1, 2, 3, 10, 11, 99, 20, 21]
    targets = ids[1:]
    assert [t for t, r in zip(targets, in_rationale) if r] == [10, 11, 99]
    assert [t for t, a in zip(targets, in_answer) if a] == [20, 21]
    _, forced_rationale, _ = splice([1, 2, 3], [10, 11], 99, True, [20, 21])
    assert [t for t, r in zip(targets, forced_rationale) if r] == [10, 11]


def test_padded_batch_keeps_each_rows_spans():
    rollouts = [
        [Rollout([5, 6, 7, 8, 9], [30, 31, 32], False), Rollout([5, 6, 7, 8, 9], [33], True)],
        [Rollout([5, 6], [], True), Rollout([5, 6], [34, 35], False)],
    ]
    answers = [[40, 41, 2], [42, 2]]
    batch = reference_answer_batch(rollouts, answers, think_end_id=99, pad_id=0)
    expected = [
        ([5, 6, 7, 8, 9, 30, 31, 32, 99, 40, 41, 2], [30, 31, 32, 99], [40, 41, 2]),
        ([5, 6, 7, 8, 9, 33, 99, 40, 41, 2], [33], [40, 41, 2]),
        ([5, 6, 99, 42, 2], [], [42, 2]),
        ([5, 6, 34, 35, 99, 42, 2], [34, 35, 99], [42, 2]),
    ]
    for row, (ids, rationale, answer) in enumerate(expected):
        length = int(batch.attention_mask[row].sum())
        assert batch.input_ids[row, :length].tolist() == ids
        assert batch.input_ids[row, length:].eq(0).all()
        targets = batch.input_ids[row, 1:]
        assert targets[batch.rationale_mask[row]].tolist() == rationale
        assert targets[batch.answer_mask[row]].tolist() == answer
    with pytest.raises(ValueError, match="sample_answers=True"):
        sampled_answer_batch(rollouts, 99, 0)
    assert collate([([1, 2], [True], [False])], 0).rows(0, 1).input_ids.tolist() == [[1, 2]]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_budget_inserts_think_end_exactly_at_the_budget(sampler):
    task, _, chat, model = tiny_setup(num_heads=1 if sampler == "vllm" else 4)
    examples = task.splits(6, 0, 0, seed=1).train
    prompts = [chat.prompt_ids(task.messages(e, "cold")) for e in examples]
    with torch.no_grad():  # point </think>'s output row along the mean hidden state: some rows end on their own
        hidden = model.get_decoder()(input_ids=torch.tensor([prompts[0]])).last_hidden_state.mean((0, 1))
        model.get_output_embeddings().weight[chat.think_end_id] = 2.0 * hidden / hidden.norm()
    engine = rollout_engine(model, chat, budget=4, sampler=sampler)
    groups = engine.generate(prompts, 8, sample_answers=True, generator=torch.Generator().manual_seed(0))
    rollouts = [r for g in groups for r in g]
    assert len(groups) == 6 and all(len(g) == 8 for g in groups)
    assert {r.think_end_forced for r in rollouts} == {True, False}
    for r in rollouts:
        assert (len(r.rationale_ids) == 4) == r.think_end_forced and len(r.rationale_ids) <= 4
        assert chat.think_end_id not in r.rationale_ids
        assert 1 <= len(r.answer_ids) <= 3
        assert r.answer_ids[-1] == chat.end_of_turn_id or len(r.answer_ids) == 3
    row = sampled_answer_batch(groups, chat.think_end_id, chat.pad_id).rows(0, 1)
    forced_row = next(r for r in groups[0] if r.think_end_forced)
    ids = forced_row.prompt_ids + forced_row.rationale_ids + [chat.think_end_id]
    assert ids[len(forced_row.prompt_ids) + 4] == chat.think_end_id
    assert row.input_ids.shape[0] == 1


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_zero_budget_forces_think_end_at_once_and_sampling_is_reproducible(sampler):
    task, _, chat, model = tiny_setup(num_heads=1 if sampler == "vllm" else 4)
    prompts = [chat.prompt_ids(task.messages(e, "cold")) for e in task.splits(3, 0, 0, seed=2).train]
    engine = rollout_engine(model, chat, budget=0, sampler=sampler)
    groups = engine.generate(prompts, 2, sample_answers=False, generator=torch.Generator().manual_seed(0))
    assert all(r.think_end_forced and r.rationale_ids == [] and r.answer_ids is None for g in groups for r in g)
    engine = rollout_engine(model, chat, budget=5, sampler=sampler)
    a = engine.generate(prompts, 3, sample_answers=True, generator=torch.Generator().manual_seed(7))
    b = engine.generate(prompts, 3, sample_answers=True, generator=torch.Generator().manual_seed(7))
    assert a == b
