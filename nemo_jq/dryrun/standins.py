"""What the dry run puts in place of what it cannot have: the model's folder as shapes, a task and a tokenizer of the
right sizes, samples at their full budget, a reserved share of the GPU."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from nemo_jq.config import Config
from nemo_jq.data import Example
from nemo_jq.dryrun.memory import MemoryTracker
from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.rollouts.sampling import Sample


def shapes_of(batch: TokenBatch) -> tuple:
    return tuple(None if tensor is None else tuple(tensor.shape) for tensor in vars(batch).values())


def like(result: Any) -> tuple | None:
    return (tuple(result.shape), result.dtype, result.device) if isinstance(result, torch.Tensor) else None


class ReservedShare:
    """vLLM in the dry run: its memory is its own (weights, KV cache, CUDA graphs inside
    ``vllm_memory_utilization`` of the GPU), held while it is awake; it samples every row to its full budget."""

    def __init__(self, request, tracker: MemoryTracker, share: int):
        from nemo_jq.runtime import distributed

        self.tracker, self.share, self.depth = tracker, share, 0
        self.tensor_parallel = request.config.rollout.tensor_parallel
        self.lockstep = distributed.world_size() > 1  # as vLLM's: under torchrun every rank samples, in step

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Held once however the wakes nest (a refitted engine wakes it around the budget core's own wake)."""
        self.depth += 1
        try:
            with self.tracker.reserved("vllm", self.share) if self.depth == 1 else contextlib.nullcontext():
                yield
        finally:
            self.depth -= 1

    def load_weights(self, tensors) -> None:
        for _ in tensors:
            pass

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
        return full_budget_samples(prompts, num_samples, max_new_tokens)

    def sample_seeded(self, prompts, seeds, num_samples, *, stop_ids, max_new_tokens, greedy=False):
        return full_budget_samples(prompts, num_samples, max_new_tokens)


def full_budget_samples(prompts, num_samples: int, max_new_tokens: int) -> list[list[Sample]]:
    """Every row run to its full budget without stopping: the longest rollouts (their token values are unknown)."""
    full = Sample([0] * max_new_tokens, False, [0.0] * max_new_tokens)
    return [[full] * num_samples for _ in prompts]


def model_config(config: Config, folder: Path) -> Any:
    """The HF config of ``model.path`` (a Qwen3 size name, a local folder, or the tiny model), written to ``folder``
    as a model folder without weights (what an engine that loads a folder is given)."""
    from transformers import AutoConfig, Qwen3Config

    from nemo_jq.cluster.plan import hf_config_dict

    path = config.model.path
    if path is None:
        tiny = config.model.tiny
        hf = Qwen3Config(vocab_size=tiny.tokenizer_vocab_size, hidden_size=tiny.hidden_size,
                         intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_layers,
                         num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads,
                         head_dim=tiny.hidden_size // tiny.num_heads,
                         max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=True)
    elif Path(path).expanduser().exists():
        hf = AutoConfig.from_pretrained(Path(path).expanduser())
    else:  # a released size: a Qwen3's or a Qwen3-MoE's config class, as its model_type says
        values = hf_config_dict(path)
        hf = AutoConfig.for_model(values.pop("model_type"), **values)
    hf.save_pretrained(folder)
    return hf


def parameter_count(hf_config) -> int:
    from nemo_jq.cluster.plan import parameter_count
    from nemo_jq.models.megatron.provider import read_qwen3_config

    return parameter_count(read_qwen3_config(hf_config))


def sampler_of(engine: Any) -> Any:
    return (engine.engine if hasattr(engine, "engine") else engine).sampler


@contextlib.contextmanager
def patched_item(mapping: dict, key: str, value: Any) -> Iterator[None]:
    original = mapping[key]
    dict.__setitem__(mapping, key, value)
    try:
        yield
    finally:
        dict.__setitem__(mapping, key, original)


class FolderOfShapes(Mapping):
    """A model folder's weights as the Megatron backend reads them (``SafetensorsFolder``): each an HF tensor of the
    config's shape in bf16 (the released checkpoints' dtype), read on the (fake) host when asked for. It lists the
    weights this rank has read: a real folder lists every stage's, which the policy checks against every stage's
    parameter names, gathered from the other stages; here those are this stage's own (``.megatron``)."""

    def __init__(self, arch: Any):
        self.arch, self.read = arch, []

    def __getitem__(self, name: str) -> torch.Tensor:
        from nemo_jq.models.megatron.mapping import hf_shape

        self.read.append(name)
        with torch.device("cpu"):
            return torch.empty(hf_shape(name, self.arch), dtype=torch.bfloat16)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(self.read))

    def __len__(self) -> int:
        return len(dict.fromkeys(self.read))


class StandInTask:
    """No data: every example's reward is 0 (the dry run reads no values)."""

    def messages(self, example: Example, prompt_format: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": ""}]

    def extract_answer(self, output: str) -> str:
        return output

    def normalize(self, text: str) -> str:
        return text

    def reward(self, output: str, example: Example) -> float:
        return 0.0

    def is_correct(self, output: str, example: Example) -> bool:
        return False

    def corpus(self, examples: list[Example]) -> list[str]:
        return []


class StandInTokenizer:
    """Prompts of ``prompt_tokens`` tokens and answers of ``answer_tokens`` (with the end of turn): the longest."""

    PROMPT = "<dry-run prompt>"
    pad_token_id = 0

    def __init__(self, prompt_tokens: int, answer_tokens: int):
        self.prompt_tokens, self.answer_tokens = prompt_tokens, answer_tokens

    def get_vocab(self) -> dict[str, int]:
        from nemo_jq.data.chat import END_OF_TURN, THINK_END, THINK_START

        return {THINK_START: 1, THINK_END: 2, END_OF_TURN: 3}

    def get_chat_template(self) -> str:
        return ""

    def apply_chat_template(self, messages, **kwargs) -> str:
        return self.PROMPT

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [4] * (self.prompt_tokens if text == self.PROMPT else max(1, self.answer_tokens - 1))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""

    def __len__(self) -> int:
        return 5
