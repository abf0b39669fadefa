"""What the trainer needs from a task: examples, chat messages, a reward and a correctness test."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

FORMATS = ("cold", "warm")


@dataclass(frozen=True)
class Example:
    """One supervised pair (x*, y*).

    ``rationale`` is a gold rationale, used only by the SFT baseline; ``aliases`` are extra
    answers that evaluation also accepts; ``meta`` keeps dataset-specific fields (FinQA's
    executed answer ``exe_ans``).
    """

    id: str
    question: str
    answer: str
    context: str = ""
    rationale: str | None = None
    aliases: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


class Task(Protocol):
    """A dataset's formatting and scoring rules."""

    def messages(self, example: Example, prompt_format: str) -> list[dict[str, str]]:
        """Chat messages for ``prompt_format`` "cold" (linearised x*, no instructions) or "warm"."""
        ...

    def extract_answer(self, output: str) -> str:
        """The answer a sampled output commits to."""
        ...

    def normalize(self, text: str) -> str:
        """Canonical form for exact match and majority voting."""
        ...

    def reward(self, output: str, example: Example) -> float:
        """Training reward: exact match of the normalised extracted answer (1.0 or 0.0)."""
        ...

    def is_correct(self, output: str, example: Example) -> bool:
        """Evaluation: normalised y* (or an alias) is a substring of the normalised output."""
        ...

    def corpus(self, examples: list[Example]) -> list[str]:
        """Texts to train a tokenizer on when a model is built from scratch."""
        ...


@dataclass
class Splits:
    train: list[Example]
    validation: list[Example]
    test: list[Example]

    def digests(self) -> dict[str, str]:
        """Each split's SHA-256 over its examples' ids, questions, answers, contexts and aliases, in order: what a run
        records at its start, so that a reopened run can tell data that has changed under it."""
        return {name: hashlib.sha256(json.dumps([[e.id, e.question, e.answer, e.context, list(e.aliases)]
                                                 for e in self.get(name)]).encode()).hexdigest()
                for name in ("train", "validation", "test")}

    def get(self, name: str) -> list[Example]:
        if name not in ("train", "validation", "test"):
            raise ValueError(f"split must be 'train', 'validation' or 'test'; got {name!r}")
        return getattr(self, name)


def check_format(prompt_format: str) -> str:
    if prompt_format not in FORMATS:
        raise ValueError(f"prompt format must be one of {FORMATS}; got {prompt_format!r}")
    return prompt_format
