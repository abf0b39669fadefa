"""Answers: what an output commits to, canonical forms, and the match rules behind rewards and evaluation.

Each rule is one function whose docstring states it in a sentence:

* :func:`extract_final_answer` — the answer an output commits to;
* :func:`text_exact_match` — training reward for text answers (HotPotQA, MuSiQue, your data);
* :func:`token_substring_match` — evaluation for text answers (the paper's substring match, by token);
* :func:`finqa_number_match` — FinQA's numbers, for both reward and evaluation;
* :func:`finqa_reference` — the teacher-forced y* of a FinQA row.

A reward is what RL optimises, so each rule accepts nothing but a right answer: prose around an
answer, a number in the wrong unit, or a gold's characters inside another word earn nothing.
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from decimal import Decimal
from typing import NamedTuple

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_LABEL = re.compile(r"^(?:final\s+)?answer\s*[:：]\s*", re.IGNORECASE)
_WRAPPERS = (("`", "`"), ("*", "*"), ("_", "_"), ("\\text{", "}"), ("\\textbf{", "}"), ("\\mathrm{", "}"))
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_SCALE_WORDS = "thousand|million|billion|trillion"
_NUMBER = re.compile(
    rf"^(\()?([-−+])?\$?\s*([-−+])?\s*({_DIGITS})\s*(%|percent)?\s*({_SCALE_WORDS})?(\))?$", re.IGNORECASE
)
_YES_NO = ("yes", "no")


#: Number punctuation SQuAD's rule deletes, which changes the number (``3.14`` -> ``314``, ``-5`` -> ``5``, ``1/2``
#: -> ``12``, ``12:30`` -> ``1230``, ``1-2-3`` -> ``123``): kept as private-use stand-ins while the rest is dropped
#: (each mark its own; the joiner: the marks of digits joined by several, which may differ: a date's ``-`` or ``/``).
_STAND_IN = {mark: chr(0xE000 + index) for index, mark in enumerate(string.punctuation)}
_JOINER = chr(0xE000 + len(string.punctuation))
_RESTORE = {ord(stand_in): mark for mark, stand_in in _STAND_IN.items()} | {ord(_JOINER): "-"}
_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")
#: Dashes and the minus sign as ``-`` (hyphen, non-breaking hyphen, figure dash, en and em dash, bar, minus).
_DASHES = str.maketrans({dash: "-" for dash in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"})


def _is_punctuation(ch: str) -> bool:
    """ASCII's punctuation (SQuAD's rule), or any other script's (Unicode's P categories)."""
    return ch in _PUNCTUATION or (ch > "\x7f" and unicodedata.category(ch).startswith("P"))
_MARK = rf"[{re.escape(string.punctuation)}]"
_NUMBER_RUN = re.compile(rf"\d+(?:{_MARK}+\d+)+")
_MARKS = re.compile(rf"{_MARK}+")
_GROUPED = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LEADING_POINT = re.compile(r"(?<![\w.])\.(?=\d)")  # not a second point (``1..2`` read as ``10.2``)
# a minus before digits, or before a dollar sign or spaces and then digits (``-$2.40``, ``- 5``: what lies between
# goes, as a ``$`` does anywhere); not a second minus (``--5`` read as ``-5``)
_SIGN = re.compile(r"(?<![\w-])-\s*(?:\$\s*)?(?=\d)")
_PERCENT = re.compile(r"(?<=\d)\s*%")


def squad_normalize(text: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse white space (SQuAD v1.1), except within
    numbers, where a deleted mark would change the answer: a mark between digits stays (``3.14`` is not ``314``,
    ``1/2`` not ``12``, ``12:30`` not ``1230``, ``1-2`` not ``12``), as does a sign (``-5`` is not ``5``); digits
    joined by several marks keep where they are joined, whatever the marks (``2010-03-05`` is ``2010/03/05``, not
    ``20100305``); thousands separators go (``1,234.5`` is ``1234.5``); ``.5`` is ``0.5``; a percent sign is the word
    (``12%`` is ``12 percent``, not ``12``). An answer that is nothing but articles keeps them (a multiple-choice
    ``A``, which SQuAD's rule makes empty: no output matched it). Unicode forms read as what they write (NFKC:
    ``２０`` is ``20``; a dash is ``-``; any punctuation goes as ASCII's does: ``“Paris”`` and ``Paris。`` are
    ``paris``), where SQuAD's rule knows ASCII only."""
    text = _PRIVATE_USE.sub("", unicodedata.normalize("NFKC", text).lower().translate(_DASHES))
    text = _NUMBER_RUN.sub(lambda run: _number_run(run.group()), _PERCENT.sub(" percent", text))
    text = _SIGN.sub(_STAND_IN["-"], _LEADING_POINT.sub("0" + _STAND_IN["."], text))
    text = " ".join("".join(ch for ch in text if not _is_punctuation(ch)).split()).translate(_RESTORE)
    return " ".join(_ARTICLES.sub(" ", text).split()) or text


def _number_run(run: str) -> str:
    """Digits with marks between them, as :func:`squad_normalize` keeps them."""
    if _GROUPED.fullmatch(run):
        return run.replace(",", "").replace(".", _STAND_IN["."])
    marks = _MARKS.findall(run)
    if len(marks) == 1 and len(marks[0]) == 1:
        return run.replace(marks[0], _STAND_IN[marks[0]])
    return _MARKS.sub(_JOINER, run)


def extract_final_answer(output: str) -> str:
    """The content of the last ``\\boxed{…}`` in the output, else its last non-empty line without an answer label.

    Accepted forms: ``Answer: X``, ``Final answer: X``, ``**Answer:** X``, ``Answer: **X**``,
    ``\\boxed{X}`` (``\\text{X}`` inside it unwrapped), and X wrapped whole in ``*``, ``_`` or
    backticks. Anything else on the line stays part of the answer, so prose around an answer
    does not match it.
    """
    boxed = _last_boxed(output)
    if boxed is not None:
        return _unlatex(_unwrap(boxed))
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1].replace("**", "").replace("__", "").strip()
    return _unlatex(_unwrap(_LABEL.sub("", line)))


#: LaTeX's spellings of what an answer means (``\boxed{14.1\%}``, ``\$2.40``, ``1{,}000``, ``1\,000``).
_LATEX = (("\\%", "%"), ("\\$", "$"), ("{,}", ","), ("\\,", ""), ("\\ ", " "))


def _unlatex(text: str) -> str:
    """An answer written in LaTeX as it reads: its escapes as the marks they stand for, and math delimiters
    (``$…$``, ``\\(…\\)``) around the whole of it gone."""
    for latex, plain in _LATEX:
        text = text.replace(latex, plain)
    for left, right in (("$", "$"), ("\\(", "\\)")):
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : len(text) - len(right)].strip()
    return text


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth < 0:
            return text[begin:index]
    return None  # unbalanced: no committed answer


def _unwrap(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for left, right in _WRAPPERS:
            if len(text) > len(left) + len(right) - 1 and text.startswith(left) and text.endswith(right):
                text, changed = text[len(left) : len(text) - len(right)].strip(), True
    return text


def text_exact_match(output_answer: str, references: tuple[str, ...]) -> bool:
    """An extracted answer is right when its SQuAD normalisation is non-empty and equals a reference's."""
    guess = squad_normalize(output_answer)
    return bool(guess) and any(guess == squad_normalize(ref) for ref in references)


def token_substring_match(output: str, references: tuple[str, ...]) -> bool:
    """An output is correct when a non-empty normalised reference's tokens appear as a contiguous run of its tokens."""
    tokens = squad_normalize(output).split()
    for reference in references:
        wanted = squad_normalize(reference).split()
        if wanted and any(tokens[i : i + len(wanted)] == wanted for i in range(len(tokens) - len(wanted) + 1)):
            return True
    return False


class StatedNumber(NamedTuple):
    """A number as written: its value, whether it carried a percent sign, its decimals, and a scale word.

    ``scale`` is ``million`` in ``$ 2.33 million``: part of the unit, so the value stays 2.33.
    """

    value: float
    percent: bool
    decimals: int
    scale: str = ""

    def readings(self, gold_is_percent: bool) -> list[tuple[float, float]]:
        """``(value, resolution)`` in base units (a percent as its fraction) for every unit it may mean.

        A percent sign divides by 100; a bare number for a percent gold may be the fraction or the
        percent with its sign left out. Resolution is one unit of the last stated digit.
        """
        own = (self.value, 10.0 ** -self.decimals)
        as_percent = (self.value / 100.0, 10.0 ** -self.decimals / 100.0)
        if self.percent:
            return [as_percent]
        return [own, as_percent] if gold_is_percent else [own]


def parse_number(text: str) -> StatedNumber | None:
    """A FinQA-style number, or None when ``text`` is anything else.

    Accepts well-formed thousands separators (``1,234.5``), a dollar sign before or after the
    sign (``-$2.40``, ``$-2.40``; a plus sign too, ``+14.1%``), a percent sign or the word percent, accounting parentheses
    (``(3.2)`` is −3.2), a scale word (``$ 2.33 million``) and a trailing period.
    """
    cleaned = text.strip().rstrip(".").strip()
    match = _NUMBER.match(cleaned)
    if not match:
        return None
    opened, sign, late_sign, digits, percent, scale, closed = match.groups()
    if bool(opened) != bool(closed) or (sign and late_sign) or (opened and "+" in (sign or late_sign or "")):
        return None
    digits = digits.replace(",", "")
    negative = (sign or late_sign or "+") != "+" or bool(opened)
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return StatedNumber(float(digits) * (-1.0 if negative else 1.0), percent is not None, decimals, (scale or "").lower())


def numbers_in(text: str) -> list[StatedNumber]:
    """Every number written in ``text`` (``12.2 %`` and ``$ 1,234`` included), in order."""
    text = re.sub(r"\$\s+", "$", text)
    text = re.sub(rf"(\d)\s+(%|percent\b|(?:{_SCALE_WORDS})\b)", r"\1\2", text, flags=re.IGNORECASE)
    found = []
    for word in text.split():
        word = word.replace("**", "").strip("\"'`*_,;:!?[]{}")
        if word.count("(") != word.count(")"):
            word = word.strip("()")
        number = parse_number(word)
        if number is not None:
            found.append(number)
    return found


def _decimals_of(value: float) -> int:
    return max(0, -Decimal(repr(float(value))).as_tuple().exponent)


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * (1 + 1e-9) + 1e-12


def executed_number(executed: object) -> float | None:
    """FinQA's ``exe_ans`` as a finite float, or None (yes/no answers, missing values)."""
    if isinstance(executed, bool) or not isinstance(executed, (int, float)):
        return None
    return float(executed) if math.isfinite(executed) else None


def finqa_reference(answer: str, executed: object) -> str:
    """y* of a FinQA row: its annotated answer, else ``exe_ans`` at 2 decimals (3 significant digits below 1, at most
    5 decimals), trailing zeros removed (but those of a value that rounds to zero there: ``0.00000``, whose
    tolerance is the fifth decimal's).

    Yes/no programs give ``yes``/``no``. Returns "" when neither gives an answer.
    """
    if answer.strip():
        return answer.strip()
    if isinstance(executed, str) and executed.strip().lower() in _YES_NO:
        return executed.strip().lower()
    value = executed_number(executed)
    if value is None:
        return ""
    magnitude = math.floor(math.log10(abs(value))) if value else 0
    decimals = 2 if abs(value) >= 1 else min(5, max(2, 2 - magnitude))
    text = f"{value:.{decimals}f}"
    if value and not float(text):  # a nonzero value below the decimals: "0" would accept anything within 0.5
        return f"{0:.{decimals}f}"
    text = text.rstrip("0").rstrip(".") if "." in text else text
    return "0" if text in ("-0", "") else text


def finqa_number_match(output: StatedNumber, gold: StatedNumber, executed: float | None = None) -> bool:
    """A number is right when it equals the gold within half a unit of the gold's last stated digit in the gold's
    unit, or equals ``exe_ans`` rounded at its own stated precision when that precision is at least the gold's. Where
    the gold is ``exe_ans`` rounded (the annotation agrees with the program), a number stated finer than the gold is
    judged by ``exe_ans`` alone: ``3.4`` is not the gold ``3`` of a program that gives 3.0, nor ``13.6%`` the gold
    ``14%`` of one that gives 0.1412 (the gold's window took both).

    Percent and fraction convert into each other with their tolerance (``14.1%`` accepts ``0.141``,
    never a wider window); a bare number for a percent gold may also be the percent without its sign, and a gold
    written without its percent sign whose ``exe_ans`` is its fraction (``14.1`` of 0.141) is that percent.
    A scale word is part of the unit: ``2.33`` answers ``$ 2.33 million``, ``2.33 billion`` does not.
    """
    if output.scale and output.scale != gold.scale:
        return False
    if executed and gold.value and not gold.percent and _close(executed * 100, gold.value, 10.0 ** -gold.decimals / 2):
        gold = gold._replace(percent=True)
    scale = 100.0 if gold.percent else 1.0
    gold_value, gold_resolution = gold.value / scale, 10.0 ** -gold.decimals / scale
    exact = None if executed is None else _executed_reading(executed, gold.percent, gold_value)
    agrees = exact is not None and _close(exact[0], gold_value, gold_resolution / 2)
    for value, resolution in output.readings(gold.percent):
        by_gold = _close(value, gold_value, gold_resolution / 2)
        finer = resolution < gold_resolution * (1 - 1e-9)
        by_exe = (exact is not None and resolution <= gold_resolution * (1 + 1e-9)
                  and _close(value, exact[0], max(resolution, exact[1]) / 2))
        if by_exe or (by_gold and not (finer and agrees)):
            return True
    return False


def _executed_reading(executed: float, gold_percent: bool, gold_value: float) -> tuple[float, float]:
    """``exe_ans`` in the gold's base unit, and its resolution. It is a plain float: a fraction for most percent golds,
    the percent itself where a program multiplies by 100, a fraction where the annotator wrote a percent without its
    sign. Read at the scale whose ratio to the gold is nearest 1 (as is, for a zero gold); it is known to FinQA's five
    decimals (more where its value shows more)."""
    scales = (1.0, 0.01) if gold_percent else (1.0, 100.0)
    scale = min(scales, key=lambda s: abs(math.log(abs(executed * s / gold_value)))) if executed and gold_value else 1.0
    return executed * scale, 10.0 ** -max(5, _decimals_of(executed)) * scale


def finqa_answer_match(output_answer: str, reference: str, executed: object = None) -> bool:
    """An extracted FinQA answer is right when it is one number that passes :func:`finqa_number_match`, or, for a
    yes/no question, the same word."""
    gold = parse_number(reference)
    if gold is None:
        return text_exact_match(output_answer, (reference,))
    guess = parse_number(output_answer)
    return guess is not None and finqa_number_match(guess, gold, executed_number(executed))


def finqa_output_match(output: str, reference: str, executed: object = None) -> bool:
    """A FinQA output is correct when any number written in it passes :func:`finqa_number_match` (yes/no: by token)."""
    gold = parse_number(reference)
    if gold is None:
        return token_substring_match(output, (reference,))
    value = executed_number(executed)
    return any(finqa_number_match(number, gold, value) for number in numbers_in(output))


def finqa_normalize(text: str) -> str:
    """Canonical form for majority voting: the number in base units when ``text`` is one, else SQuAD-normalised text."""
    number = parse_number(text)
    if number is None:
        return squad_normalize(text)
    return repr(number.value / 100.0 if number.percent else number.value)
