"""Label noise for robustness experiments: a seeded share of training labels replaced by wrong answers."""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from nemo_jq.data.base import Example, Task, correct_of

#: Where a corrupted example keeps its clean answer, and the clean example whole (``Example.meta``).
CLEAN_ANSWER, CLEAN_EXAMPLE = "clean_answer", "clean_example"


def corrupt_labels(train: Sequence[Example], rate: float, seed: int, task: Task) -> list[Example]:
    """``train`` with exactly ``round(rate * len(train))`` answers replaced, chosen by ``seed``.

    A corrupted example takes the answer of another training example that the task does not
    count as correct for it (so it looks like a real answer, but is wrong), loses its aliases and
    what its meta says of the clean answer (FinQA's ``exe_ans``, which its reward accepts too: the
    clean answer kept earning the reward), and keeps its clean answer in ``meta[CLEAN_ANSWER]``
    (the clean example: :func:`clean_of`). Validation and test are never touched.
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"data.label_noise must be in [0, 1); got {rate}")
    rng = random.Random(f"label-noise-{seed}")
    chosen = set(rng.sample(range(len(train)), round(rate * len(train))))
    answers = sorted({example.answer for example in train})
    corrupted = []
    for index, example in enumerate(train):
        if index not in chosen:
            corrupted.append(example)
            continue
        corrupted.append(dataclasses.replace(example, answer=_wrong_answer(answers, example, task, rng), aliases=(),
                                             meta={CLEAN_ANSWER: example.answer, CLEAN_EXAMPLE: example}))
    return corrupted


def _wrong_answer(answers: Sequence[str], example: Example, task: Task, rng: random.Random) -> str:
    """A random training answer that the task does not accept for ``example`` (drawn, not searched: most are wrong)."""
    for _ in range(1000):
        candidate = rng.choice(answers)
        if not correct_of(task, candidate, example):
            return candidate
    raise ValueError(f"data.label_noise: no wrong answer found for training example {example.id!r} among the "
                     "training answers (nearly all of them count as correct for it)")


def clean_of(example: Example) -> Example:
    """A corrupted example as it was before :func:`corrupt_labels` (its answer, aliases and meta)."""
    return example.meta.get(CLEAN_EXAMPLE) or dataclasses.replace(example, answer=example.meta[CLEAN_ANSWER], aliases=(),
                                                                  meta={})


def noisy_examples(train: Sequence[Example]) -> list[Example]:
    """The training examples whose label was corrupted."""
    return [example for example in train if CLEAN_ANSWER in example.meta]
