"""FinQA, HotPotQA, MuSiQue and custom JSONL: parsing, formats, caps, splits, scoring, bad rows."""

import json
from pathlib import Path

import pytest

from nemo_jq.data.answers import extract_final_answer, finqa_answer_match, parse_number, squad_normalize
from nemo_jq.data.base import Example
from nemo_jq.data.prepare import load_prepared, make_task, prepare, write_prepared
from nemo_jq.data.qa import CustomQA, FinQA, HotPotQA, MuSiQue

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def test_hotpotqa_column_list_and_pair_list_forms_parse_alike():
    column = json.loads((FIXTURES / "hotpotqa_hf" / "train.jsonl").read_text().splitlines()[0])
    pairs = json.loads((FIXTURES / "hotpotqa_raw" / "train.json").read_text())[0]
    task = HotPotQA()
    a, b = task.parse(column), task.parse(pairs)
    assert (a.question, a.answer, a.context) == (b.question, b.answer, b.context)
    assert a.context == "Eiffel Tower\nThe Eiffel Tower is a tower. It is in Paris.\n\nLouvre\nThe Louvre is a museum."


GOLDEN_USER = {
    "hotpotqa": "Eiffel Tower\nThe Eiffel Tower is a tower. It is in Paris.\n\nLouvre\nThe Louvre is a museum."
    "\n\nQuestion: Which city is the Eiffel Tower in?",
    "musique": "\n\n".join(
        f"Title 1-{k}\n" + ("The answer of record 1 is Barack Obama." if k == 1 else f"Paragraph {k} of record 1.")
        for k in range(20)
    ) + "\n\nQuestion: What is the answer of record 1?",
    "finqa": "interest rate risk . the company 's revenue grew .\n | 2009 | 2008\nrevenue | $ 1,234.5 | $ 1,100\n"
    "see note 4 .\n\nQuestion: what was the growth rate in revenue 1?",
}
FIRST_RECORD = {
    "hotpotqa": ("hotpotqa_hf", "train.jsonl"),
    "musique": ("musique", "train.jsonl"),
    "finqa": ("finqa", "train.json"),
}


def _first_record(name):
    folder, file = FIRST_RECORD[name]
    text = (FIXTURES / folder / file).read_text()
    return json.loads(text.splitlines()[0]) if file.endswith(".jsonl") else json.loads(text)[0]


@pytest.mark.parametrize("name", ["hotpotqa", "musique", "finqa"])
def test_golden_prompts_for_cold_and_warm(name):
    task = make_task(name)
    example = task.parse(_first_record(name))
    assert task.messages(example, "cold") == [{"role": "user", "content": GOLDEN_USER[name]}]
    warm = task.messages(example, "warm")
    assert warm == [{"role": "system", "content": task.warm_system}, {"role": "user", "content": GOLDEN_USER[name]}]
    assert "Think step by step" in task.warm_system and "only" in task.warm_system
    with pytest.raises(ValueError, match="prompt format"):
        task.messages(example, "hot")


@pytest.mark.slow
def test_prompts_render_through_the_chat_template_with_thinking_on():
    from helpers import tiny_setup

    _, tokenizer, chat, _ = tiny_setup()
    task = make_task("hotpotqa")
    example = task.parse(_first_record("hotpotqa"))
    text = tokenizer.decode(chat.prompt_ids(task.messages(example, "warm")))
    assert text == (
        f"<|im_start|>system\n{task.warm_system}<|im_end|>\n<|im_start|>user\n{GOLDEN_USER['hotpotqa']}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_musique_has_twenty_paragraphs_and_keeps_aliases():
    example = MuSiQue().parse(_first_record("musique"))
    assert example.context.count("\n\n") == 19
    assert example.aliases == ("Obama", "President Obama")


def test_finqa_keeps_the_executed_answer():
    example = FinQA().parse(_first_record("finqa"))
    assert example.answer == "12.2%" and example.meta["exe_ans"] == 0.12227


@pytest.mark.parametrize(
    "text, normalized",
    [("The Beatles", "beatles"), ("an apple, a pear.", "apple pear"), ("Yes.", "yes"), ("  New   York!! ", "new york"),
     ("Theatre", "theatre")],
)
def test_squad_normalisation(text, normalized):
    assert squad_normalize(text) == normalized


@pytest.mark.parametrize(
    "predicted, answer, executed, match",
    [
        ("14.1%", "14.1%", 0.141, True),
        ("14.1", "14.1%", 0.141, True),       # percent sign omitted
        ("0.141", "14.1%", 0.141, True),      # fraction for a percent
        ("14.2%", "14.1%", 0.141, False),
        ("1,234.5", "1234.5", 1234.5, True),  # thousands separator
        ("$1,000", "1000", None, True),
        ("-3.2", "(3.2)", -3.2, True),        # accounting negative
        ("3.2", "-3.2", -3.2, False),         # sign matters
        ("12.23", "12.2%", 0.12227, True),    # rounding at the reference's precision
        ("12.3", "12.2%", 0.12227, False),
        ("yes", "yes", "yes", True),
        ("No", "yes", "yes", False),
        ("", "1", 1.0, False),
    ],
)
def test_finqa_number_conventions(predicted, answer, executed, match):
    assert finqa_answer_match(predicted, answer, executed) is match


def test_number_parsing_and_answer_extraction():
    assert parse_number("-1,234.50%") == (-1234.5, True, 2, "")
    assert parse_number("12 percent") == (12.0, True, 0, "")
    assert parse_number("about 12") is None
    assert extract_final_answer("I think so.\n\nAnswer: Paris") == "Paris"
    assert extract_final_answer("\n  Final answer: 12%\n") == "12%"


def test_rewards_and_evaluation():
    hotpot = HotPotQA()
    example = Example("h", "Which city?", "Paris")
    assert hotpot.reward("The answer: paris.", example) == 0.0  # extracted line is "The answer: paris."
    assert hotpot.reward("Answer: Paris.", example) == 1.0
    assert hotpot.is_correct("It is in Paris, France.", example)  # substring, as the paper evaluates
    assert not hotpot.is_correct("Parisian", Example("h", "q", "Paris France"))
    yes = Example("y", "Is it?", "yes")
    assert hotpot.reward("Yes.", yes) == 1.0 and hotpot.reward("no", yes) == 0.0
    musique = MuSiQue()
    obama = Example("m", "Who?", "Barack Obama", aliases=("Obama",))
    assert musique.is_correct("It was Obama.", obama)  # a hit on an alias counts
    assert musique.reward("Obama", obama) == 1.0
    finqa = FinQA()
    growth = Example("f", "growth?", "12.2%", meta={"exe_ans": 0.12227})
    assert finqa.reward("Answer: 12.2 %", growth) == 1.0
    assert finqa.is_correct("the growth was 12.2%", growth) and not finqa.is_correct("12.3%", growth)
    assert finqa.is_correct("revenue of $1,234.5", Example("f", "q", "1234.5"))


def test_caps_drop_rows_at_the_boundary():
    example = HotPotQA().parse(_first_record("hotpotqa"))
    length = len(HotPotQA().linearize(example))
    record = _first_record("hotpotqa")
    for cap, kept in ((length, 0), (length + 1, 1)):
        task = HotPotQA(max_input_chars=cap)
        splits, manifest = prepare(task, str(FIXTURES / "hotpotqa_hf"), (0, 0, 0), seed=0)
        over = {row["id"] for row in manifest["sources"]["train"]["over_cap"]}
        assert (record["id"] in over) is (kept == 0)
    assert HotPotQA().max_input_chars == 4000 and MuSiQue().max_input_chars == 10000 and FinQA().max_input_chars == 8000


def test_splits_are_deterministic_disjoint_and_sized():
    source = str(FIXTURES / "hotpotqa_hf")
    a, _ = prepare(HotPotQA(), source, (3, 3, 3), seed=7)
    b, _ = prepare(HotPotQA(), source, (3, 3, 3), seed=7)
    c, _ = prepare(HotPotQA(), source, (3, 3, 3), seed=8)
    def ids(s):
        return [e.id for e in s.validation + s.test]
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert not {e.id for e in a.validation} & {e.id for e in a.test}
    assert [len(a.train), len(a.validation), len(a.test)] == [3, 3, 3]
    with pytest.raises(ValueError, match="test needs 4 rows from source split 'validation', but only 3 eligible rows remain"):
        prepare(HotPotQA(), source, (3, 3, 4), seed=7)


@pytest.mark.parametrize("name, folder, sizes", [("hotpotqa", "hotpotqa_hf", (3, 2, 2)), ("hotpotqa", "hotpotqa_raw", (1, 2, 2)),
                                                 ("musique", "musique", (2, 2, 2)), ("finqa", "finqa", (3, 3, 3))])
def test_manifest_accounts_for_every_row(tmp_path, name, folder, sizes):
    splits, manifest = prepare(make_task(name), str(FIXTURES / folder), sizes, seed=0)
    for entry in manifest["sources"].values():
        assert entry["rows"] == len(entry["bad"]) + len(entry["over_cap"]) + sum(entry["selected"].values()) + entry["unused"]
        assert len(entry["sha256"]) == 64 and Path(entry["file"]).exists()
    write_prepared(splits, manifest, tmp_path)
    assert load_prepared(tmp_path) == splits
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == 0


def test_bad_rows_are_reported_with_ids_or_stop_the_run():
    _, manifest = prepare(MuSiQue(), str(FIXTURES / "musique"), (2, 1, 1), seed=0)
    assert manifest["sources"]["train"]["bad"] == [
        {"id": "2hop__3", "row": 3, "reason": "unanswerable question (answerable=false)"},
        {"id": "2hop__4", "row": 4, "reason": "empty 'answer'"},
    ]
    _, manifest = prepare(FinQA(), str(FIXTURES / "finqa"), (3, 1, 1), seed=0)
    assert manifest["sources"]["train"]["bad"][0]["reason"] == "field 'pre_text' must be list, got str"
    with pytest.raises(ValueError, match=r"train.jsonl: row 3 \(id 2hop__3\): unanswerable question \(answerable=false\); "
                                         r"fix the row, or pass --on-bad-row skip"):
        prepare(MuSiQue(), str(FIXTURES / "musique"), (2, 1, 1), seed=0, on_bad_row="fail")
    _, manifest = prepare(HotPotQA(), str(FIXTURES / "hotpotqa_hf"), (3, 1, 1), seed=0)
    assert manifest["sources"]["train"]["bad"] == [{"id": "hp5", "row": 5, "reason": "missing field 'answer'"}]


def test_parquet_source_in_the_hf_schema(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split in ("train", "validation"):
        rows = [json.loads(line) for line in (FIXTURES / "hotpotqa_hf" / f"{split}.jsonl").read_text().splitlines()]
        good = [r for r in rows if "answer" in r]
        pq.write_table(pa.Table.from_pylist(good), tmp_path / f"{split}.parquet")
    from_parquet, _ = prepare(HotPotQA(), str(tmp_path), (3, 2, 2), seed=1)
    from_jsonl, _ = prepare(HotPotQA(), str(FIXTURES / "hotpotqa_hf"), (3, 2, 2), seed=1)
    assert from_parquet == from_jsonl


def test_hub_sources_are_the_papers(monkeypatch):
    calls = []

    def fake_hub(name, config, split):
        calls.append((name, config, split))
        folder = FIXTURES / "hotpotqa_hf"
        return [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines()], f"fp-{split}"

    monkeypatch.setattr("nemo_jq.data.prepare.read_hub", fake_hub)
    _, manifest = prepare(HotPotQA(), None, (1, 1, 1), seed=0)
    assert manifest["sources"]["train"]["fingerprint"] == "fp-train"
    assert calls == [("hotpotqa/hotpot_qa", "distractor", "train"), ("hotpotqa/hotpot_qa", "distractor", "validation")]
    with pytest.raises(ValueError, match="needs a source"):
        prepare(FinQA(), None, (1, 1, 1), seed=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(FinQA(), "./no/such/finqa", (1, 1, 1), seed=0)


def test_custom_jsonl_with_a_template(tmp_path):
    rows = [{"id": f"c{i}", "question": f"What is {i}+{i}?", "answer": str(2 * i), "context": f"Numbers: {i}"} for i in range(6)]
    rows.append({"id": "c-bad", "question": 3, "answer": "x"})
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = CustomQA(template="{context}\nQ: {question}", system="Reply with a number.")
    splits, manifest = prepare(task, str(path), (2, 2, 2), seed=0)
    assert manifest["sources"]["all"]["bad"] == [{"id": "c-bad", "row": 7, "reason": "field 'question' must be str, got int"}]
    example = splits.train[0]
    assert task.messages(example, "warm") == [
        {"role": "system", "content": "Reply with a number."},
        {"role": "user", "content": f"{example.context}\nQ: {example.question}"},
    ]
    with pytest.raises(ValueError, match="may only use"):
        CustomQA(template="{answer}")


def test_trainer_runs_on_a_prepared_dataset(tmp_path):
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    splits, manifest = prepare(HotPotQA(), str(FIXTURES / "hotpotqa_hf"), (3, 2, 2), seed=0)
    write_prepared(splits, manifest, tmp_path / "prepared")
    config = load_config(None, [*TINY_RUN, "data.name=hotpotqa", f"data.prepared_dir={tmp_path / 'prepared'}",
                                "data.format=warm", "train.max_steps=2", "train.batch_size=2", f"train.run_dir={tmp_path / 'run'}"])
    trainer = Trainer(config)
    assert trainer.components.splits.train == splits.train
    result = trainer.fit()
    assert set(result["test"]) == {"p@1", "p@4", "m@4"}


def test_finqa_rows_without_an_annotated_answer_are_kept_and_counted():
    splits, manifest = prepare(FinQA(), str(FIXTURES / "finqa"), (3, 4, 1), seed=0)
    dev = manifest["sources"]["dev"]
    assert dev["bad"] == [] and dev["reference_sources"] == {"answer": 3, "exe_ans": 1}
    assert manifest["splits"]["validation"]["reference_sources"] == {"answer": 3, "exe_ans": 1}
    derived = next(e for e in splits.validation if e.id == "ADI/2009/page_49.pdf-13")
    assert derived.answer == "1.12" and FinQA().reward("Answer: 1.122", derived) == 1.0


def test_a_custom_template_warns_of_rows_that_leave_its_fields_empty(tmp_path, capsys):
    """A row without the context a custom template uses would get a prompt with it blank: named, with the fix."""
    rows = [{"id": f"c{i}", "question": f"What is {i}?", "answer": str(i), **({"context": f"n={i}"} if i % 3 else {})}
            for i in range(8)]
    source = tmp_path / "mine.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prepare(make_task("jsonl", template="Passage: {context}\n\nQ: {question}"), str(source), (4, 2, 2), seed=0)
    err = capsys.readouterr().err
    assert f"{source}: 3 row(s) have no 'context' (rows 1, 4, 7), which the prompt template" in err
    assert "pass a --template without {context}" in err and len(err.splitlines()) == 1
    prepare(make_task("jsonl"), str(source), (4, 2, 2), seed=0)  # the default template: a row without context is a question
    prepare(make_task("jsonl", template="Q: {question}"), str(source), (4, 2, 2), seed=0)
    assert capsys.readouterr().err == ""
