"""Answer normalisation: SQuAD-style text (HotPotQA, MuSiQue) and FinQA's numbers."""

from __future__ import annotations

import math
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_NUMBER = re.compile(r"^\(?(-)?\$?\s*(\d[\d,]*\.?\d*|\.\d+)\s*(%|percent)?\)?$")


def squad_normalize(text: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse white space (SQuAD v1.1)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_final_answer(output: str) -> str:
    """The answer a sampled output commits to: its last non-empty line, without an "answer:" label."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return re.sub(r"^(final\s+)?answer\s*[:：]\s*", "", lines[-1], flags=re.IGNORECASE).strip()


def parse_number(text: str) -> tuple[float, bool, int] | None:
    """``(value, is_percent, decimals)`` for FinQA-style numbers, or None.

    Accepts thousands separators (``1,234.5``), a dollar sign, a percent sign or the word
    percent, a leading minus or accounting parentheses (``(3.2)`` is -3.2), and a trailing period.
    """
    cleaned = text.strip().lower().rstrip(".").strip()
    match = _NUMBER.match(cleaned)
    if not match:
        return None
    sign, digits, percent = match.groups()
    digits = digits.replace(",", "")
    negative = sign is not None or (cleaned.startswith("(") and cleaned.endswith(")"))
    value = float(digits) * (-1.0 if negative else 1.0)
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return value, percent is not None, decimals


def finqa_normalize(text: str) -> str:
    """Text form for substring checks: lower case, no dollar signs, thousands separators or spaces."""
    text = text.lower().replace("$", "")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return re.sub(r"\s+", "", text)


def finqa_answers_match(predicted: str, answer: str, executed: float | str | None = None) -> bool:
    """FinQA exact match with its conventions.

    Numbers match when equal at the reference's precision (``14.1%`` accepts ``14.1``, ``14.10%``
    and the fraction ``0.141``); the executed program value ``exe_ans`` is a second reference,
    compared at FinQA's 5-decimal rounding. Non-numeric answers (yes/no) compare normalised text.
    """
    guess = parse_number(predicted)
    if guess is None:
        return bool(predicted.strip()) and squad_normalize(predicted) in {squad_normalize(answer), squad_normalize(str(executed))}
    value = guess[0]
    references = []
    gold = parse_number(answer)
    if gold is not None:
        tolerance = 0.5 * 10.0 ** -gold[2] + 1e-9
        references += [(gold[0], tolerance), (gold[0] / 100.0, tolerance / 100.0), (gold[0] * 100.0, tolerance * 100.0)]
    if isinstance(executed, (int, float)) and not isinstance(executed, bool) and math.isfinite(executed):
        references += [(executed, 5e-6), (executed * 100.0, 5e-4)]
    return any(abs(value - ref) <= tol for ref, tol in references)
