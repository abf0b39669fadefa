"""Rewards and correctness rules: the probe cases of real data, and properties over random golds and outputs.

A reward is what RL optimises, so each rule is checked both ways: a right answer in any accepted
form earns it, and nothing else does (prose around the answer, the wrong unit, a gold's
characters inside another word, a constant output).
"""

import json
import random
from decimal import Decimal
from pathlib import Path

import pytest

from nemo_jq.data.answers import (
    StatedNumber,
    extract_final_answer,
    finqa_answer_match,
    finqa_reference,
    parse_number,
    squad_normalize,
    text_exact_match,
    token_substring_match,
)
from nemo_jq.data.base import Example
from nemo_jq.data.qa import FinQA, HotPotQA, MuSiQue
from nemo_jq.data.synthetic import SyntheticArithmetic

WORDS = ["no", "yes", "us", "know", "not", "paris", "warner", "music", "group", "the", "a", "of", "new", "york",
         "1", "12", "2019", "obama", "barack", "city", "river", "an", "is", "and"]


# ----------------------------------------------------------------------------- the probe's cases
@pytest.mark.parametrize(
    "output, gold, executed",
    [
        ("4837", "48", 48.0),      # gold x100 with its tolerance x100
        ("127.40", "1%", 0.01),
        ("50", "0%", 0.0),
        ("-0.6%", "0%", 0.0),
        ("35%", "34.83%", 0.34824),  # coarser than the gold: no rescue by exe_ans
        ("0", "48", 0.48),          # exe_ans in another unit than the gold cannot widen the gold's window
        ("-130700", "1", 1.0),
        ("0.3", "0.00000", 0.000004),  # a tiny exe_ans as the gold: it was "0", which took anything within 0.5
        ("+2.40", "-2.40", -2.4),     # a plus sign is no minus
        ("3.4", "3", 3.0),            # finer than a gold the program agrees with: judged by exe_ans (the gold's
        ("0.004", "0", 0.0),          # window paid each of these)
        ("-0.49%", "0%", 0.0),
        ("13.6%", "14%", 0.1412),
        ("(+2.40)", "-2.40", -2.4),
    ],
)
def test_finqa_wrong_numbers_earn_nothing(output, gold, executed):
    assert not finqa_answer_match(output, gold, executed)
    assert not FinQA().reward(f"Answer: {output}", Example("f", "q", gold, meta={"exe_ans": executed}))


def test_finqa_no_integer_output_matches_zero_percent_but_zero():
    matched = [n for n in range(-50, 51) if finqa_answer_match(str(n), "0%", 0.0)]
    assert matched == [0]


@pytest.mark.parametrize(
    "output, gold, executed",
    [
        ("34.82%", "34.83%", 0.34824),   # exe_ans at the output's precision, which equals the gold's
        ("34.824%", "34.83%", 0.34824),
        ("0.3482", "34.83%", 0.34824),
        ("34.82", "34.83%", 34.824),     # a program that multiplies by 100
        ("34.83%", "34.83%", 0.34824),
        ("0.3483", "34.83%", 0.34824),   # fraction for a percent, same precision
        ("48%", "0.48", 0.48),           # percent for a fraction
        ("$-2.40", "-2.40", -2.4),
        ("-$2.40", "-2.40", -2.4),
        ("($2.40)", "-2.40", -2.4),
        ("−2.4", "-2.40", -2.4),         # unicode minus, and 2.4 lies within half a cent of -2.40
        ("\\boxed{14.1\\%}", "14.1%", 0.141),  # as Qwen3 writes it in LaTeX (it earned nothing)
        ("$14.1\\%$", "14.1%", 0.141),
        ("\\boxed{-\\$2.40}", "-2.40", -2.4),
        ("\\boxed{1{,}000}", "1000", 1000.0),
        ("+14.1%", "14.1%", 0.141),  # a growth written with its sign (the text reward took +5 for 5)
        ("$+2.40", "2.40", 2.4),
        ("14.12%", "14%", 0.1412),       # finer than the gold, at exe_ans's value
        ("3.0", "3", 3.0),
        ("14.1%", "14.1", 0.141),        # a gold written without its percent sign, exe_ans its fraction (the
        ("0.141", "14.1", 0.141),        # warm prompt asks for the sign: a right answer earned nothing)
    ],
)
def test_finqa_right_numbers_in_other_forms_earn_reward(output, gold, executed):
    assert finqa_answer_match(extract_final_answer(output), gold, executed)


@pytest.mark.parametrize(
    "output, expected",
    [
        ("Let me see.\n**Answer:** $-2.40", "$-2.40"),
        ("**Answer**: Paris", "Paris"),
        ("Answer: **Paris**", "Paris"),
        ("**Answer: Paris**", "Paris"),
        ("Final answer: `12%`", "12%"),
        ("so the total is $\\boxed{42}$.\n", "42"),
        ("\\boxed{\\text{Barack Obama}}", "Barack Obama"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("The answer is Paris", "The answer is Paris"),         # prose stays prose
        ("Answer: **Paris** is the capital", "Paris is the capital"),
        ("\\boxed{unclosed", "\\boxed{unclosed"),
        ("\\boxed{14.1\\%}", "14.1%"),  # LaTeX's escapes and math delimiters read as what they stand for
        ("so it is $14.1\\%$\nAnswer: $14.1\\%$", "14.1%"),
        ("\\boxed{\\$2.40}", "$2.40"),
        ("\\boxed{1{,}000}", "1,000"),
        ("\\boxed{1\\,000}", "1000"),
        ("Answer: \\(3.5\\)", "3.5"),
        ("Answer: $5", "$5"),
        ("", ""),
    ],
)
def test_extraction_forms(output, expected):
    assert extract_final_answer(output) == expected


def test_extracted_forms_earn_the_reward_and_prose_does_not():
    hotpot, example = HotPotQA(), Example("h", "Which city?", "Paris")
    for output in ("**Answer:** Paris", "Answer: **Paris**", "\\boxed{Paris}", "Paris."):
        assert hotpot.reward(output, example) == 1.0, output
    for output in ("The answer is Paris", "Answer: Paris, I think", "Paris or London", "Answer:", "**"):
        assert hotpot.reward(output, example) == 0.0, output
    finqa = FinQA()
    assert finqa.reward("**Answer:** $-2.40", Example("f", "q", "-2.40", meta={"exe_ans": -2.4})) == 1.0
    assert finqa.reward("The loss was $-2.40", Example("f", "q", "-2.40", meta={"exe_ans": -2.4})) == 0.0


@pytest.mark.parametrize(
    "output, references, correct",
    [
        ("I do not know", ("no",), False),
        ("Warner Music Group", ("US",), False),
        ("It was founded in the U.S. in 1958", ("US",), True),
        ("No, it is not.", ("no",), True),
        ("The Eiffel Tower is in Paris, France.", ("Paris",), True),
        ("Parisian cafés", ("Paris",), False),
        ("new york city", ("New York",), True),
        ("york new", ("New York",), False),
        ("anything", ("The",), False),  # a reference that normalises to nothing matches nothing
    ],
)
def test_substring_match_is_by_token(output, references, correct):
    assert token_substring_match(output, references) is correct


def test_finqa_evaluation_compares_numbers_not_characters():
    one = Example("f", "q", "1", meta={"exe_ans": 1.0})
    assert not FinQA().is_correct("-130700", one) and not FinQA().is_correct("10 or 21", one)
    assert FinQA().is_correct("so it is 1.", one)
    growth = Example("f", "q", "34.83%", meta={"exe_ans": 0.34824})
    assert FinQA().is_correct("growth of 34.82 %", growth) and not FinQA().is_correct("about 35%", growth)
    assert FinQA().is_correct("yes, it did", Example("f", "q", "yes", meta={"exe_ans": "yes"}))
    assert not FinQA().is_correct("I don't know", Example("f", "q", "no", meta={"exe_ans": "no"}))


def test_synthetic_correctness_needs_the_whole_number():
    task, example = SyntheticArithmetic(), Example("s", "7+5+8", "20")
    assert task.is_correct("7+5=12 12+8=20", example) and not task.is_correct("120", example)
    assert not task.is_correct("201", example)


# ----------------------------------------------------------------------------- FinQA references from exe_ans
@pytest.mark.parametrize(
    "executed, reference",
    [(0.34824, "0.348"), (3.8, "3.8"), (12.0, "12"), (-1234.5678, "-1234.57"), (0.0072345, "0.00723"), (0, "0"),
     (0.000001, "0.00000"), (-0.000004, "0.00000"), ("yes", "yes"), ("No", "no"), (None, ""), (float("nan"), ""), (True, "")],
)
def test_finqa_reference_from_the_executed_answer(executed, reference):
    assert finqa_reference("", executed) == reference


def test_finqa_rows_with_an_empty_answer_take_y_star_from_exe_ans():
    record = {"id": "x", "pre_text": ["a"], "post_text": [], "table": [["k", "1"]],
              "qa": {"question": "what is it?", "answer": "", "exe_ans": 0.34824, "program": "divide(1, 2)"}}
    example = FinQA().parse(record)
    assert example.answer == "0.348" and example.meta["reference_source"] == "exe_ans"
    assert FinQA().reward("34.8%", example) == 1.0 and FinQA().reward("34.82%", example) == 1.0
    assert FinQA().reward("35%", example) == 0.0 and FinQA().reward("0", example) == 0.0
    whole = FinQA().parse({**record, "qa": {**record["qa"], "exe_ans": 12.0}})  # exact: 12.4 is not 12 (it was paid)
    assert whole.answer == "12" and [FinQA().reward(out, whole) for out in ("12", "12.0", "12.4", "11.6")] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="no usable 'exe_ans'"):
        FinQA().parse({**record, "qa": {**record["qa"], "exe_ans": None}})


# ----------------------------------------------------------------------------- properties
def _random_stated(rng: random.Random, near: Decimal | None = None) -> tuple[Decimal, int, bool]:
    decimals = rng.choice([0, 0, 1, 2, 2, 3])
    if near is None:
        value = Decimal(rng.choice([1, 1, 10, 100, 10_000])) * Decimal(rng.uniform(-1, 1))
    else:  # near the gold, in one of the units it may be read in, so matches happen
        value = near * Decimal(rng.choice([1, 100, Decimal("0.01")])) + Decimal(rng.gauss(0, 1)) * Decimal(10) ** -rng.randint(0, 4)
    return value.quantize(Decimal(10) ** -decimals), decimals, rng.random() < 0.4


def _render(value: Decimal, decimals: int, percent: bool, rng: random.Random) -> str:
    text = f"{abs(value):,.{decimals}f}" if rng.random() < 0.5 else f"{abs(value):.{decimals}f}"
    if rng.random() < 0.3 and not percent:
        text = "$" + text
    sign = "-" if value < 0 else ""
    return f"{sign}{text}{'%' if percent else ''}"


def _base(value: Decimal, decimals: int, percent: bool) -> tuple[Decimal, Decimal]:
    unit = Decimal(10) ** -decimals
    return (value / 100, unit / 100) if percent else (value, unit)


def _allowed_readings(value: Decimal, decimals: int, percent: bool, gold_percent: bool) -> list[tuple[Decimal, Decimal]]:
    """The units an output may be read in, restated from the rule: only an explicit % divides by 100,
    except that a bare number for a percent gold may be that percent without its sign."""
    readings = [_base(value, decimals, percent)]
    if gold_percent and not percent:
        readings.append(_base(value, decimals, True))
    return readings


def test_property_finqa_numbers_match_only_within_half_a_gold_unit():
    rng = random.Random(0)
    matches = 0
    for _ in range(6000):
        gold_value, gold_decimals, gold_percent = _random_stated(rng)
        out_value, out_decimals, out_percent = _random_stated(rng, near=gold_value)
        gold_text, out_text = _render(gold_value, gold_decimals, gold_percent, rng), _render(out_value, out_decimals, out_percent, rng)
        gold_base, gold_unit = _base(gold_value, gold_decimals, gold_percent)
        within = any(abs(v - gold_base) <= gold_unit / 2
                     for v, _ in _allowed_readings(out_value, out_decimals, out_percent, gold_percent))
        got = finqa_answer_match(out_text, gold_text)
        matches += got
        assert got == within, (out_text, gold_text)
    assert matches > 300  # the generator reaches the boundary often enough to mean something


def test_property_exe_ans_rescues_only_finer_outputs_that_round_to_it():
    """Where the annotator's gold is exe_ans rounded, a finer output is judged by exe_ans alone (the gold's window
    paid 3.4 for a gold 3 whose program gives 3.0); where the annotation is off, the gold's window holds too."""
    rng = random.Random(1)
    rescued = refused = 0
    for _ in range(6000):
        executed = Decimal(rng.uniform(-2, 2)).quantize(Decimal("0.00001"))
        gold_decimals = rng.choice([0, 1, 2])
        # The annotator's gold: exe_ans as a percent at gold_decimals, sometimes off by one last digit.
        gold_value = (executed * 100).quantize(Decimal(10) ** -gold_decimals) + rng.choice([0, 0, 1, -1]) * Decimal(10) ** -gold_decimals
        out_decimals = rng.choice([0, 1, 2, 3])
        out_value = (executed * 100).quantize(Decimal(10) ** -out_decimals) + rng.choice([0, 0, 0, 1, -1, 5]) * Decimal(10) ** -out_decimals
        gold_text, out_text = f"{gold_value:.{gold_decimals}f}%", f"{out_value:.{out_decimals}f}%"
        got = finqa_answer_match(out_text, gold_text, float(executed))
        gold_base, gold_unit = _base(gold_value, gold_decimals, True)
        out_base, out_unit = _base(out_value, out_decimals, True)
        by_gold = abs(out_base - gold_base) <= gold_unit / 2
        by_exe = out_unit <= gold_unit and abs(out_base - executed) <= max(out_unit, Decimal("0.00001")) / 2
        judged_by_exe = out_unit < gold_unit and abs(gold_base - executed) <= gold_unit / 2  # finer, gold agrees
        assert got == (by_exe or (by_gold and not judged_by_exe)), (out_text, gold_text, executed)
        rescued += got and not by_gold
        refused += by_gold and not got
    assert rescued > 100 and refused > 100


def test_property_a_constant_output_earns_only_where_it_is_the_answer():
    rng = random.Random(2)
    golds = [_random_stated(rng) for _ in range(3000)]
    for constant in ("50", "0", "1", "100%", "0.5"):
        output = parse_number(constant)
        for value, decimals, percent in golds:
            gold_text = _render(value, decimals, percent, rng)
            if finqa_answer_match(constant, gold_text):
                gold_base, gold_unit = _base(value, decimals, percent)
                assert any(abs(v - gold_base) <= gold_unit / 2 for v, _ in _allowed_readings(
                    Decimal(constant.rstrip("%")), output.decimals, output.percent, percent)), (constant, gold_text)


def test_property_every_rendering_of_the_gold_earns_the_reward():
    rng = random.Random(3)
    finqa = FinQA()
    for _ in range(2000):
        value, decimals, percent = _random_stated(rng)
        gold = _render(value, decimals, percent, rng)
        example = Example("f", "q", gold, meta={"exe_ans": float(value / 100 if percent else value)})
        forms = [gold, f"Answer: {gold}", f"**Answer:** {gold}", f"\\boxed{{{gold}}}", f"Answer: **{gold}**"]
        if percent:  # the fraction, at the same precision, and the percent without its sign
            forms += [f"{value / 100:.{decimals + 2}f}", f"{value:.{decimals}f}"]
        for form in forms:
            assert finqa.reward(f"thinking...\n{form}", example) == 1.0, (form, gold)
        assert finqa.is_correct(f"So the change is {gold}.", example)


def test_property_text_reward_is_exact_match_of_the_extracted_answer():
    rng = random.Random(4)
    task = MuSiQue()
    for _ in range(3000):
        gold = " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))
        example = Example("m", "q", gold, aliases=tuple(" ".join(rng.choices(WORDS, k=2)) for _ in range(rng.randint(0, 2))))
        references = (gold, *example.aliases)
        output = " ".join(rng.choices(WORDS, k=rng.randint(0, 4)))
        expected = bool(squad_normalize(output)) and squad_normalize(output) in {squad_normalize(r) for r in references}
        assert task.reward(f"Answer: {output}", example) == float(expected)
        # The gold inside prose never earns it unless the prose normalises to the gold itself.
        prose = f"I believe it is {gold} because of the {rng.choice(WORDS)} paragraph"
        assert task.reward(prose, example) == 0.0
        assert text_exact_match(gold, references) is bool(squad_normalize(gold))


def written(value: Decimal, rng: random.Random) -> str:
    """``value`` as a person may write it: thousands separators or not, a Unicode minus, ``.5`` (trailing zeros are
    a precision, or a version's or a time's digits: ``3.10`` is not ``3.1``, and neither earns the other)."""
    sign, digits = ("-" if value < 0 else ""), f"{abs(value):f}"
    whole, _, fraction = digits.partition(".")
    if rng.random() < 0.5 and len(whole) > 3:
        whole = f"{int(whole):,}"
    text = (whole if whole != "0" or not fraction or rng.random() < 0.5 else "") + ("." + fraction if fraction else "")
    return (rng.choice(["-", "\u2212"]) if sign else "") + text


def test_property_a_text_answers_number_earns_the_reward_only_at_the_golds_value():
    """SQuAD's rule deletes a number's sign, point and slash: `-5`, `314` and `12` earned the golds `5`, `3.14` and
    `1/2` (HotPotQA, MuSiQue, your data). Any way of writing the gold's value earns it; no other value does."""
    rng = random.Random(7)
    values = [Decimal(text) for text in ("5", "-5", "3.14", "314", "0.5", "5.5", "1234.5", "-1234.5", "12345", "1.2345")]
    task = MuSiQue()
    for _ in range(3000):
        gold, guess = rng.choice(values), rng.choice(values)
        example = Example("m", "q", written(gold, rng))
        answer = written(guess, rng)
        assert task.reward(f"Answer: {answer}", example) == float(gold == guess), (answer, example.answer)
        assert task.reward(f"Answer: {answer} million", Example("m", "q", f"{example.answer} million")) == float(gold == guess)
    for guess, gold in (("-5", "5"), ("314", "3.14"), ("12", "1/2"), ("1.5", "15"), ("15 million", "1.5 million"),
                        ("12", "1,2"), ("0.5", "1/2"), ("3,5", "3.5"), ("1.000", "1"), ("1.000", "1000"), ("3.10", "3.1"),
                        ("5.30 pm", "5.3 pm"), ("10:30", "10.30"), ("1..2", "10.2"), ("--5", "-5"), ("-", "-5"),
                        (".", "0.5"), ("", "5"), ("10:30", "1030"), ("555-1234", "5551234"), ("1-2", "12"),
                        ("1+2", "12"), ("3-1", "31"), ("20-24", "2024"), ("1,2,3", "123"), ("1.2.3", "123"),
                        ("1,0,0,0", "1000"), ("1-000", "1000"), ("50", "50%"), ("20100305", "2010-03-05"),
                        ("2010-0305", "2010-03-05"), ("-$2.40", "$2.40"), ("$2.40", "-$2.40"), ("2.40", "-$2.40"),
                        ("- 5", "5"), ("\u2212$3", "3"), ("-$ 3", "3")):  # a sign before $ or a space was dropped
        assert task.reward(f"Answer: {guess}", Example("m", "q", gold)) == 0.0, (guess, gold)
        assert not task.is_correct(f"It is {guess}.", Example("m", "q", gold)), (guess, gold)
    for guess, gold in (("12%", "12"), ("1000%", "1000")):  # evaluation's substring match finds the number's token
        assert task.reward(f"Answer: {guess}", Example("m", "q", gold)) == 0.0, (guess, gold)
    for guess, gold in (("1,000", "1000"), ("1,234.5", "1234.5"), (".5", "0.5"), ("\u22123", "-3"), ("$5", "5"),
                        ("3.14.", "3.14"), ("2010-03-05", "2010/03/05"), ("5/3/2010", "5-3-2010"), ("10:30", "10:30"),
                        ("12%", "12 percent"), ("12 %", "12%"), ("-$2.40", "-2.40"), ("$-2.40", "-$2.40"),
                        ("- 5", "-5")):
        assert task.reward(f"Answer: {guess}", Example("m", "q", gold)) == 1.0, (guess, gold)  # a date's marks may differ
        assert task.is_correct(f"It is {guess}.", Example("m", "q", gold)), (guess, gold)
    # a piece of a date, a score or a list is not the gold (splitting it into words made each piece a hit)
    for output, gold in (("from 2009-2010", "2010"), ("It ended 3-2.", "2"), ("1,2,3", "2"), ("call 555-1234", "1234")):
        assert not task.is_correct(output, Example("m", "q", gold)), (output, gold)


def test_property_digits_earn_a_gold_only_joined_where_it_joins_them():
    """SQuAD's rule deleted the marks between digits: ``1-2``, ``1+2``, ``12:30`` and ``1,2,3`` earned ``12``,
    ``1230`` and ``123``. Digits split by marks anywhere else than the gold's, or not split where it is, earn
    nothing; the gold's own marks do, and where several join it (a date) others at the same places do too."""
    rng, task, marks = random.Random(11), MuSiQue(), "-:+/.,'_"
    for _ in range(3000):
        digits = "".join(rng.choices("0123456789", k=rng.randint(2, 8)))
        cuts = sorted(rng.sample(range(1, len(digits)), rng.randint(0, min(3, len(digits) - 1))))
        other = sorted(rng.sample(range(1, len(digits)), rng.randint(0, min(3, len(digits) - 1))))

        def joined(at, choose):
            pieces = [digits[i:j] for i, j in zip([0, *at], [*at, len(digits)])]
            return "".join(piece + (choose() if k < len(pieces) - 1 else "") for k, piece in enumerate(pieces))

        gold = joined(cuts, lambda: rng.choice(marks))
        example = Example("m", "q", gold)
        plain = not any(mark in gold for mark in ",.")  # a thousands separator or a point: their own rules, above
        if plain:
            assert task.reward(f"Answer: {gold}", example) == 1.0, gold
        guess = joined(other, lambda: rng.choice(marks))
        if other != cuts and plain and not any(mark in guess for mark in ",."):
            assert task.reward(f"Answer: {guess}", example) == 0.0, (guess, gold)
        if len(cuts) >= 2 and plain:  # a date's marks may be any others
            assert task.reward(f"Answer: {joined(cuts, lambda: rng.choice('-/:'))}", example) == 1.0, gold


def test_an_answer_the_reward_pays_counts_as_correct():
    """The substring match normalised ``\\boxed{Paris}`` to the one token ``boxedparis``: p@k counted the answers the
    reward paid as wrong."""
    paris, number = Example("h", "q", "Paris"), Example("f", "q", "12.5", meta={"exe_ans": 12.5})
    for output in ("\\boxed{Paris}", "The answer is \\boxed{Paris}.", "Answer:Paris", "**Answer:**Paris"):
        assert HotPotQA().reward(output, paris) == 1.0 and HotPotQA().is_correct(output, paris), output
    assert not HotPotQA().is_correct("\\boxed{London}", paris)
    assert FinQA().reward("\\boxed{12.5}", number) == 1.0 and FinQA().is_correct("\\boxed{12.5}", number)
    assert not FinQA().is_correct("\\boxed{13}", number)


def test_a_multiple_choice_letter_earns_the_reward_only_as_itself():
    """SQuAD's rule makes the gold ``A`` empty (an article), so no output matched it: it stays ``a``, and only the
    letter itself earns it, not another letter, another article, or prose around it."""
    task, example = MuSiQue(), Example("m", "q", "A")
    for output, reward in (("Answer: A", 1.0), ("Answer: (a).", 1.0), ("\\boxed{A}", 1.0), ("Answer: B", 0.0),
                           ("Answer: the", 0.0), ("Answer: an", 0.0), ("Answer: A or B", 0.0), ("A is right", 0.0),
                           ("Answer:", 0.0)):
        assert task.reward(output, example) == reward, output
    assert MuSiQue().reward("Answer: B", Example("m", "q", "B")) == 1.0 and text_exact_match("a B", ("B",))


def test_property_token_substring_matches_only_whole_token_runs():
    rng = random.Random(5)
    for _ in range(3000):
        reference = " ".join(rng.choices(WORDS, k=rng.randint(1, 2)))
        output_words = rng.choices(WORDS, k=rng.randint(0, 8))
        out, ref = squad_normalize(" ".join(output_words)).split(), squad_normalize(reference).split()
        expected = bool(ref) and any(out[i : i + len(ref)] == ref for i in range(len(out) - len(ref) + 1))
        assert token_substring_match(" ".join(output_words), (reference,)) is expected
        # Glued into a longer word, the reference's characters count for nothing.
        glued = "".join(ref) + rng.choice(["ish", "s", "x"])
        assert not token_substring_match(f"{glued} zzz", (reference,))


def test_parse_number_refuses_malformed_numbers():
    for text in ("1,23", "12,", "(3.2", "3.2)", "--3", "-$-3", "1.2.3", "12 %%", "about 12", "", "$", "."):
        assert parse_number(text) is None, text
    assert parse_number("(3.2)") == StatedNumber(-3.2, False, 1)
    assert parse_number("1,234,567.891") == StatedNumber(1234567.891, False, 3)


# ----------------------------------------------------------------------------- genuine records (tests/fixtures/real)
REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"


def _real_examples(task, file):
    text = (REAL / file).read_text()
    records = [json.loads(line) for line in text.splitlines()] if file.endswith(".jsonl") else json.loads(text)
    return [task.parse(record) for record in records]


@pytest.mark.parametrize("task, file", [(FinQA(), "finqa_dev.json"), (FinQA(), "finqa_test.json"),
                                        (HotPotQA(), "hotpotqa.json"), (MuSiQue(), "musique.jsonl")])
def test_every_genuine_gold_earns_the_reward_and_counts_as_correct(task, file):
    examples = _real_examples(task, file)
    assert len(examples) >= 9
    for example in examples:
        for reference in task.references(example) if isinstance(task, MuSiQue) else (example.answer,):
            for output in (reference, f"Reasoning first.\nAnswer: {reference}", f"**Answer:** {reference}"):
                assert task.reward(output, example) == 1.0, (example.id, output)
            assert task.is_correct(f"So it is {reference}.", example), (example.id, reference)
            assert task.is_correct(reference, example)


def test_genuine_finqa_rows_with_annotator_rounding_and_empty_answers():
    examples = {e.id: e for file in ("finqa_dev.json", "finqa_test.json") for e in _real_examples(FinQA(), file)}
    finqa = FinQA()
    # Empty qa.answer: y* from exe_ans, and the row is kept.
    assert examples["AWK/2013/page_132.pdf-4"].answer == "1393"
    assert examples["HIG/2011/page_53.pdf-4"].answer == "0.225"
    assert finqa.reward("22.5%", examples["HIG/2011/page_53.pdf-4"]) == 1.0
    # exe_ans at the output's own precision, at least the gold's; never coarser.
    for row, right, wrong in [
        ("AAP/2011/page_28.pdf-3", "71.9%", "72%"),       # 71.8% / 0.71886
        ("RSG/2015/page_126.pdf-1", "-33.0%", "-33%"),    # -32.9% / -0.32953
        ("CNP/2010/page_31.pdf-2", "8.37%", "8.4%"),      # 8.36% / 0.0837
        ("DISH/2011/page_122.pdf-2", "12.3%", "12%"),     # 12.2% / 0.12271
        ("HUM/2017/page_118.pdf-4", "81.67", "82"),       # 81.6 / 81.66667, not a percent
    ]:
        assert finqa.reward(f"Answer: {right}", examples[row]) == 1.0, (row, right)
        assert finqa.reward(f"Answer: {wrong}", examples[row]) == 0.0, (row, wrong)
    assert finqa.reward("Answer: 80%", examples["DVN/2014/page_85.pdf-2"]) == 1.0  # exe_ans 80.0, in percent units
    assert finqa.reward("Answer: 2.33", examples["ADI/2011/page_50.pdf-3"]) == 1.0  # "$ 2.33 million"
    assert finqa.reward("Answer: 2.33 billion", examples["ADI/2011/page_50.pdf-3"]) == 0.0
    # A constant answer earns nothing on these rows unless it is the answer.
    assert sum(finqa.reward(f"Answer: {c}", e) for c in ("50", "0", "1", "100%") for e in examples.values()) == 0


def test_genuine_short_aliases_match_whole_tokens_only():
    examples = {e.id: e for e in _real_examples(MuSiQue(), "musique.jsonl")}
    musique, us = MuSiQue(), examples["2hop__95878_88628"]  # aliases U.S., US, America
    assert not musique.is_correct("Warner Music Group", us) and musique.is_correct("the U.S. Marshal", us)
    maine = examples["2hop__80070_89752"]  # alias ME: a whole-token "me" is a hit, as the paper's rule has it
    assert not musique.is_correct("Merrimack Mechanic", maine) and musique.is_correct("ME", maine)
    hotpot = {e.id: e for e in _real_examples(HotPotQA(), "hotpotqa.json")}
    no_row = hotpot["5adbf0a255429947ff17385a"]
    assert no_row.answer == "no" and not HotPotQA().is_correct("I do not know", no_row)


def test_property_synthetic_reward_pays_only_the_sum():
    rng = random.Random(6)
    task = SyntheticArithmetic()
    for _ in range(3000):
        digits = [rng.randint(0, 9) for _ in range(3)]
        example = Example("s", "+".join(map(str, digits)), str(sum(digits)))
        guess = rng.choice([sum(digits), rng.randint(0, 40), sum(digits) * 10, sum(digits) + 100])
        form = rng.choice(["{g}", " {g} ", "{g}0", "1{g}", "{a}+{b}={g}", "{g} {g}", "{g}\n"])
        output = form.format(g=guess, a=digits[0], b=digits[1])
        right = output.strip() == str(sum(digits))
        assert task.reward(f"thinking\n{output}", example) == float(right), output
