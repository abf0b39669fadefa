"""The embedded default task: sums of single digits, written as a linearised expression.

``x* = "7+5+8"``, ``y* = "20"``. The answer needs intermediate results that a rationale can
hold (``7+5=12 12+8=20``, the gold rationale given only to SFT). In the cold format the
prompt is the bare expression, so a model must discover both the task and the answer format.

``rationale_dependence`` sets how far the answer follows from the rationale, so that the variance of
w(z) = p(y*|x, z) over rationales can be set (the warm-start experiment's knob): ``none``, the answer is the
expression's first digit (the rationale's sums are beside the point, so a model that has learnt the task
gives every rationale the same w); ``sum`` (the default), the sum, which the rationale's last result
holds but which a model may also compute without it; ``operations``, the question hides the operators
(``x* = "7?5?8"``) and the answer is the result of the operations the rationale writes (``7-5=2 2+8=10``:
subtract the next digit when the running result is at least as large, else add it), so only rationales
that write the right operations and results make y* likely.
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
#: The warm format's instructions for the other rationale dependences (``sum`` keeps :data:`WARM_SYSTEM`).
WARM_SYSTEMS = {
    "none": "Reply with the first number of the expression as digits only. You may think inside the thinking block first.",
    "sum": WARM_SYSTEM,
    "operations": "Replace each ? by - when the result so far is at least the next number, else by +. Think step by "
                  "step inside the thinking block, then reply with the result as digits only.",
}
#: The ``rationale_dependence`` values, from answers independent of the rationale to answers it decides.
RATIONALE_DEPENDENCES = tuple(WARM_SYSTEMS)


@dataclass
class SyntheticArithmetic:
    """``answer_width`` > 0 writes the sum zero-padded to that many digits (``"020"``): each digit is one more
    token to get right, so a model's initial success probability falls by about 1/V per digit."""

    num_operands: int = 3
    answer_width: int = 0
    rationale_dependence: str = "sum"

    def __post_init__(self) -> None:
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2; got {self.num_operands}")
        if self.rationale_dependence not in RATIONALE_DEPENDENCES:
            raise ValueError(f"rationale_dependence must be one of {', '.join(RATIONALE_DEPENDENCES)}; "
                             f"got {self.rationale_dependence!r}")
        largest = {"none": 9, "sum": 9 * self.num_operands, "operations": 17}[self.rationale_dependence]
        widest = len(str(largest))
        if 0 < self.answer_width < widest:
            what = "sums" if self.rationale_dependence == "sum" else f"{self.rationale_dependence} answers"
            raise ValueError(f"answer_width={self.answer_width} cannot hold {what} of {self.num_operands} digits "
                             f"(up to {largest}): use 0 or at least {widest}")

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
        operations = self.rationale_dependence == "operations"
        steps, total = [], digits[0]
        for d in digits[1:]:
            if operations and total >= d:
                steps.append(f"{total}-{d}={total - d}")
                total -= d
            else:
                steps.append(f"{total}+{d}={total + d}")
                total += d
        question = ("?" if operations else "+").join(map(str, digits))
        answer = digits[0] if self.rationale_dependence == "none" else total
        prefix = "sum" if self.rationale_dependence == "sum" else self.rationale_dependence
        return Example(id=f"{prefix}-{question}", question=question, answer=str(answer).zfill(self.answer_width),
                       rationale=" ".join(steps))

    def corpus(self, examples: list[Example]) -> list[str]:
        """Texts to train a tokenizer on: a grid of expressions with rationales and answers (covering
        every digit pattern, so ``examples`` adds nothing), and the warm prompt."""
        del examples
        samples = [self._example(code) for code in range(0, 10**self.num_operands, 7)]
        return [WARM_SYSTEMS[self.rationale_dependence]] + [f"{e.question}\n{e.rationale}\n\n{e.answer}" for e in samples]

    def messages(self, example: Example, prompt_format: str) -> list[dict[str, str]]:
        if check_format(prompt_format) == "cold":
            return [{"role": "user", "content": example.question}]
        return [{"role": "system", "content": WARM_SYSTEMS[self.rationale_dependence]},
                {"role": "user", "content": f"What is {example.question}?"}]

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
