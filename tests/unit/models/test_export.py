"""HFPolicy.export: a folder that plain transformers code loads and generates from as training's rollouts did."""

import json
import os
import re
import stat
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from helpers import qwen3_tokenizer_dir, rollout_engine, tiny_setup
from nemo_jq.data.chat import ChatFormat
from nemo_jq.models.export import EXPORT_MARKER, sample_as
from nemo_jq.models.hf import HFPolicy
from nemo_jq.recipe.sequences import given_target_batch

CPU = torch.device("cpu")
MESSAGES = [{"role": "user", "content": "7+5+8"}]
WARM_MESSAGES = [{"role": "system", "content": "Add numbers."}, {"role": "user", "content": "What is 7+5+8?"}]
MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def trained():
    """A tiny Qwen3 fitted to one completion, so its greedy decoding is short and ends at ``<|im_end|>``."""
    _, tokenizer, chat, model = tiny_setup()
    policy = HFPolicy(model, device=CPU, lr=1e-2)
    prompt = chat.prompt_ids(MESSAGES)
    rationale, answer = chat.rationale_ids("7+5=12, 12+8=20"), chat.answer_ids("20")
    batch = given_target_batch([prompt], [rationale], [answer], chat.think_end_id, chat.pad_id)
    for _ in range(80):  # the logit margins of the fitted completion reach ~10
        policy.forward_backward([batch], lambda logprobs, _index: (-logprobs.sum(), {}))
        policy.optimizer_step()
    return tokenizer, chat, policy, prompt, rationale + [chat.think_end_id] + answer


def test_plain_generate_from_the_export_stops_at_end_of_turn_like_the_engine(trained, tmp_path):
    tokenizer, chat, policy, prompt, completion = trained
    policy.export(tmp_path / "hf", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    exported_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")

    inputs = exported_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert inputs["input_ids"][0].tolist() == prompt
    generated = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)[0, len(prompt):].tolist()

    engine = rollout_engine(policy.model, chat, budget=MAX_NEW_TOKENS, answers=MAX_NEW_TOKENS, top_k=1)
    [[rollout]] = engine.generate([prompt], 1, sample_answers=True, generator=torch.Generator().manual_seed(0))
    assert not rollout.think_end_forced
    assert generated == rollout.rationale_ids + [chat.think_end_id] + rollout.answer_ids == completion
    assert generated[-1] == chat.end_of_turn_id and len(generated) < MAX_NEW_TOKENS


def test_configs_stop_at_end_of_turn_pad_and_sample_like_the_rollouts(trained, tmp_path):
    tokenizer, chat, policy, _, _ = trained
    saved_by_transformers = {"architectures", "dtype"}  # what save_pretrained records on the model it saves

    def as_trained():
        return {key: value for key, value in policy.model.config.to_dict().items() if key not in saved_by_transformers}

    config_before = as_trained()
    policy.export(tmp_path / "hf", tokenizer)
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    generation = GenerationConfig.from_pretrained(tmp_path / "hf")
    for written in (config, generation):
        assert chat.end_of_turn_id in written.eos_token_id
        assert written.pad_token_id == chat.pad_id
    assert (generation.do_sample, generation.temperature, generation.top_k, generation.top_p) == (True, 1.0, 0, 1.0)
    assert as_trained() == config_before  # the trained model's stop and pad ids are left as they were
    unset = GenerationConfig()  # greedy leaves the sampling settings at transformers' defaults (unused)
    for rollout, sampled in [((0.7, 20, 0.95), (True, 0.7, 20, 0.95)),
                             ((0.0, 0, 1.0), (False, unset.temperature, unset.top_k, unset.top_p))]:
        sample_as(tmp_path / "hf", SimpleNamespace(temperature=rollout[0], top_k=rollout[1], top_p=rollout[2]))
        generation = GenerationConfig.from_pretrained(tmp_path / "hf")
        assert (generation.do_sample, generation.temperature, generation.top_k, generation.top_p) == sampled
        assert chat.end_of_turn_id in generation.eos_token_id and generation.pad_token_id == chat.pad_id


def test_every_exported_file_is_readable_by_group_and_others_whatever_the_umask(trained, tmp_path):
    tokenizer, _, policy, _, _ = trained
    umask = os.umask(0o077)
    try:
        policy.export(tmp_path / "hf", tokenizer)
    finally:
        os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert all(mode & 0o644 == 0o644 for mode in modes.values()), {name: oct(mode) for name, mode in modes.items()}
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) & 0o755 == 0o755


@pytest.mark.slow
def test_exported_real_qwen3_template_renders_the_training_prompt(tmp_path):
    qwen3 = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    original_template = qwen3.chat_template
    _, _, _, model = tiny_setup()
    HFPolicy(model, device=CPU).export(tmp_path / "hf", qwen3)
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")

    for messages in (MESSAGES, WARM_MESSAGES):
        def render(tokenizer, **kw):
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        assert render(exported) == render(qwen3) + "<think>\n"
        assert render(exported, enable_thinking=False) == render(qwen3, enable_thinking=False)  # Qwen3's empty think block
        ids = exported.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ids == ChatFormat(qwen3).prompt_ids(messages) == ChatFormat(exported).prompt_ids(messages)
    conversation = MESSAGES + [{"role": "assistant", "content": "20"}]
    assert exported.apply_chat_template(conversation, tokenize=False) == qwen3.apply_chat_template(conversation, tokenize=False)
    assert qwen3.chat_template == original_template
    assert ChatFormat(exported).chat_template == exported.chat_template  # exporting an export adds no second opening


def test_export_refuses_a_file_or_foreign_folder_and_replaces_an_earlier_export(trained, tmp_path):
    tokenizer, _, policy, _, _ = trained
    def refusal(path):
        return pytest.raises(ValueError, match=re.escape(str(path)) + ".*choose another --out or remove (it|them)")

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with refusal(a_file):
        policy.export(a_file, tokenizer)
    assert a_file.read_text() == "mine"

    foreign = tmp_path / "base_model"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with refusal(foreign):
        policy.export(foreign, tokenizer)
    assert [path.name for path in foreign.iterdir()] == ["config.json"] and (foreign / "config.json").read_text() == "{}"

    earlier = tmp_path / "earlier"
    policy.export(earlier, tokenizer)
    marker = json.loads((earlier / EXPORT_MARKER).read_text())
    (earlier / "stale-shard.safetensors").write_text("from the earlier export")
    (earlier / EXPORT_MARKER).write_text(json.dumps({"files": marker["files"] + ["stale-shard.safetensors"]}))
    policy.export(earlier, tokenizer)
    assert not (earlier / "stale-shard.safetensors").exists()
    assert json.loads((earlier / EXPORT_MARKER).read_text()) == marker
    AutoModelForCausalLM.from_pretrained(earlier)

    (earlier / "my_notes.txt").write_text("mine")
    with refusal(earlier):
        policy.export(earlier, tokenizer)
    assert (earlier / "my_notes.txt").read_text() == "mine" and (earlier / "model.safetensors").exists()


def test_a_streamed_export_writes_shards_and_an_index_that_load_as_the_same_model(trained, tmp_path):
    """HF-named tensors arriving one at a time (as from a sharded policy) become size-capped shards plus
    their index; plain transformers loads them to the same weights and logits as the whole-model export."""
    from nemo_jq.models.export import export_hf_stream

    tokenizer, policy = trained[0], trained[2]
    model = policy.model
    whole, streamed = tmp_path / "whole", tmp_path / "streamed"
    policy.export(whole, tokenizer)
    state = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}  # tied, as save_pretrained
    export_hf_stream(model.config, iter(state.items()), streamed, tokenizer, max_shard_bytes=16 * 1024)
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and sorted(index["weight_map"]) == sorted(state)
    for name in shards:  # at most the cap, unless one tensor alone is larger
        held = [k for k, v in index["weight_map"].items() if v == name]
        assert len(held) == 1 or sum(state[k].numel() * state[k].element_size() for k in held) <= 16 * 1024
    a, b = AutoModelForCausalLM.from_pretrained(whole), AutoModelForCausalLM.from_pretrained(streamed)
    assert all(torch.equal(t, b.state_dict()[name]) for name, t in a.state_dict().items())
    ids = torch.randint(len(tokenizer), (2, 7))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert sorted(p.name for p in streamed.iterdir() if p.name.endswith(".safetensors")) == shards  # no temporaries


def test_a_streamed_export_consumes_its_stream_even_when_it_fails(trained, tmp_path):
    from nemo_jq.models.export import export_hf_stream

    tokenizer, policy = trained[0], trained[2]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    consumed = []
    stream = ((consumed.append(name) or name, t) for name, t in policy.model.state_dict().items())
    with pytest.raises(ValueError, match="holds files that are not from an earlier export"):
        export_hf_stream(policy.model.config, stream, tmp_path / "foreign", tokenizer)
    assert len(consumed) == len(policy.model.state_dict())  # collective producers are never left waiting
