"""What the trainer needs from a task: examples, chat messages, a reward and a correctness test."""

from __future__ import annotations

import hashlib
import json
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from nemo_jq.registry import PluginFailed, blamed_on_plugin

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


def reward_of(task: Task, output: str, example: Example) -> float:
    """``task.reward(output, example)``, checked: a dataset plugin's reward that fails, or returns other than a number
    in [0, 1], is one line naming it (it was a traceback after the run's steps, or a reward of 5 optimised silently)."""
    return _scored(task, task.reward, output, example, lambda value: 0 <= value <= 1,
                   "a number in [0, 1] (1 for a right answer)")


def correct_of(task: Task, output: str, example: Example) -> bool:
    """``task.is_correct(output, example)``, checked as :func:`reward_of` checks a reward: true or false."""
    return bool(_scored(task, task.is_correct, output, example, lambda value: value in (0, 1), "true or false"))


def check_scoring(task: Task, examples: list[Example]) -> None:
    """The task's reward and correctness rules run once on the first example's own answer, before a run trains: a
    plugin's rule that fails or returns the wrong kind of value is said then, not at the first validation."""
    for example in examples[:1]:
        reward_of(task, example.answer, example)
        correct_of(task, example.answer, example)


def _scored(task: Task, rule: Callable[[str, Example], Any], output: str, example: Example,
            within: Callable[[Any], bool], wanted: str) -> Any:
    name = getattr(task, "name", type(task).__name__)
    what = f"the {rule.__name__} of dataset {name!r}"
    with blamed_on_plugin(task, what):
        value = rule(output, example)
    plain = value.item() if type(value).__module__ == "numpy" else value  # a NumPy scalar: its Python number
    if not isinstance(plain, numbers.Real) or not within(plain):  # NaN is within nothing
        code = getattr(rule, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
        raise PluginFailed(f"{what}{where} returned {value!r} ({type(value).__name__}) for the output {output[-80:]!r}: "
                           f"return {wanted}")
    return plain


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
