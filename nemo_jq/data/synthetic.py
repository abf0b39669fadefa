"""The embedded default task: sums of single digits, written as a linearised expression.

``x* = "7+5+8"``, ``y* = "20"``. The answer needs intermediate results that a rationale can
hold (``7+5=12 12+8=20``, the gold rationale given only to SFT). In the cold format the
prompt is the bare expression, so a model must discover both the task and the answer format.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from nemo_jq.data.base import Example, Splits, check_format

WARM_SYSTEM = (
    "You add single-digit numbers. Think step by step inside the thinking block, "
    "then reply with the sum as digits only."
)


@dataclass
class SyntheticArithmetic:
    """``answer_width`` > 0 writes the sum zero-padded to that many digits (``"020"``): each digit is one more
    token to get right, so a model's initial success probability falls by about 1/V per digit."""

    num_operands: int = 3
    answer_width: int = 0

    def __post_init__(self) -> None:
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2; got {self.num_operands}")
        widest = len(str(9 * self.num_operands))
        if 0 < self.answer_width < widest:
            raise ValueError(f"answer_width={self.answer_width} cannot hold sums of {self.num_operands} digits (up to "
                             f"{9 * self.num_operands}): use 0 or at least {widest}")

    def splits(self, train_size: int, validation_size: int, test_size: int, seed: int) -> Splits:
        """Disjoint splits of distinct expressions, deterministic in ``seed``."""
        total = train_size + validation_size + test_size
        available = 10**self.num_operands
        if total > available:
            raise ValueError(
                f"{total} distinct examples requested but only {available} exist with num_operands={self.num_operands}"
            )
        codes = random.Random(seed).sample(range(available), total)
        examples = [self._example(code) for code in codes]
        return Splits(
            train=examples[:train_size],
            validation=examples[train_size : train_size + validation_size],
            test=examples[train_size + validation_size :],
        )

    def _example(self, code: int) -> Example:
        digits = [int(c) for c in f"{code:0{self.num_operands}d}"]
        steps, total = [], digits[0]
        for d in digits[1:]:
            steps.append(f"{total}+{d}={total + d}")
            total += d
        question = "+".join(map(str, digits))
        return Example(id=f"sum-{question}", question=question, answer=str(total).zfill(self.answer_width),
                       rationale=" ".join(steps))

    def corpus(self, examples: list[Example]) -> list[str]:
        """Texts to train a tokenizer on: a grid of expressions with rationales and answers (covering
        every digit pattern, so ``examples`` adds nothing), and the warm prompt."""
        del examples
        samples = [self._example(code) for code in range(0, 10**self.num_operands, 7)]
        return [WARM_SYSTEM] + [f"{e.question}\n{e.rationale}\n\n{e.answer}" for e in samples]

    def messages(self, example: Example, prompt_format: str) -> list[dict[str, str]]:
        if check_format(prompt_format) == "cold":
            return [{"role": "user", "content": example.question}]
        return [{"role": "system", "content": WARM_SYSTEM}, {"role": "user", "content": f"What is {example.question}?"}]

    def extract_answer(self, output: str) -> str:
        lines = [line for line in output.strip().splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    def normalize(self, text: str) -> str:
        """Outer white space only: ``2 7`` is two numbers, not 27."""
        return text.strip()

    def reward(self, output: str, example: Example) -> float:
        return float(self.normalize(self.extract_answer(output)) == self.normalize(example.answer))

    def is_correct(self, output: str, example: Example) -> bool:
        """Correct when the sum is one of the whole numbers written in the output (``120`` does not hold ``20``)."""
        return example.answer in re.findall(r"\d+", output)
