"""Qwen3 chat format at the token level, and a Qwen3-style tokenizer built in code.

A rollout is ``[prompt, z, </think>, answer, <|im_end|>]`` where the prompt ends with the
assistant header and ``<think>\\n`` (thinking on). Every span is kept as token ids: the
reference answer is tokenised once, and sequences are spliced from ids, never by
re-tokenising decoded text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

THINK_START = "<think>"
THINK_END = "</think>"
END_OF_TURN = "<|im_end|>"
PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = (PAD, IM_START, END_OF_TURN, THINK_START, THINK_END)

#: Qwen3's pre-tokeniser split: digits one by one, words, punctuation runs, new lines.
QWEN3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: The prompt part of Qwen3's template (system and user turns, generation prompt, thinking switch).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

#: Appended to a tokenizer's chat template so that, with thinking on (Qwen3's default), the
#: generation prompt ends in the ``<think>\\n`` opening that training prompts end in; with
#: ``enable_thinking=False`` it adds nothing. Its tags do not strip whitespace (no ``{%-``), so
#: the original template's output is kept verbatim.
THINKING_OPENING_TEMPLATE = (
    "{% if add_generation_prompt and not (enable_thinking is defined and enable_thinking is false) %}"
    "{{ '" + THINK_START + "\\n' }}{% endif %}"
)


def with_thinking_opening(chat_template: str) -> str:
    """The template training renders prompts with; idempotent, so an exported tokenizer's template is kept."""
    if chat_template.rstrip().endswith(THINKING_OPENING_TEMPLATE):
        return chat_template
    return chat_template + THINKING_OPENING_TEMPLATE


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 320) -> Any:
    """A byte-level BPE with Qwen3's split rule and special tokens, trained on ``corpus`` (~0.1 s)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=END_OF_TURN,
        pad_token=PAD,
        additional_special_tokens=[IM_START, THINK_START, THINK_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


@dataclass
class ChatFormat:
    """Token ids of the Qwen3 thinking format for one tokenizer."""

    tokenizer: Any

    def __post_init__(self) -> None:
        vocab = self.tokenizer.get_vocab()
        missing = [t for t in (THINK_START, THINK_END, END_OF_TURN) if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the Qwen3 special token(s) {missing}")
        self.think_end_id = vocab[THINK_END]
        self.end_of_turn_id = vocab[END_OF_TURN]
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.end_of_turn_id

    @property
    def chat_template(self) -> str:
        """The tokenizer's template with the thinking opening: what prompts are rendered with, and what export writes."""
        return with_thinking_opening(self.tokenizer.get_chat_template())

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat-rendered prompt with thinking on, ending in ``<think>\\n``: the rationale comes next."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, enable_thinking=True, tokenize=False, chat_template=self.chat_template
        )
        return self.encode(text)

    def rationale_ids(self, rationale: str) -> list[int]:
        """A given rationale as the thinking tokens before ``</think>`` (SFT targets)."""
        return self.encode(rationale.strip("\n") + "\n")

    def answer_ids(self, answer: str) -> list[int]:
        """The formatted reference answer after ``</think>``: ``\\n\\n`` + answer + ``<|im_end|>``.

        Scoring it includes the closing token, so ``exp(log p)`` is the probability that the
        model outputs exactly this answer and stops.
        """
        return self.encode("\n\n" + answer) + [self.end_of_turn_id]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode_answer(self, ids: list[int]) -> str:
        """Text of a sampled answer span, without the end-of-turn token."""
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False).strip()
