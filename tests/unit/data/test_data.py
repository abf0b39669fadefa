"""FinQA, HotPotQA, MuSiQue and custom JSONL: parsing, formats, caps, splits, scoring, bad rows."""

import json
import re
from pathlib import Path

import pytest

from helpers import one_line_error, run_cli
from nemo_jq.data.answers import extract_final_answer, finqa_answer_match, parse_number, squad_normalize
from nemo_jq.data.base import Example
from nemo_jq.data.prepare import PREPARE_FLAGS, load_prepared, make_task, prepare, write_prepared
from nemo_jq.data.qa import BadRow, CustomQA, FinQA, HotPotQA, MuSiQue

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


def test_a_finqa_answer_written_as_a_json_number_keeps_its_last_digit():
    """``"answer": 3.10`` was y* ``3.1``, whose tolerance (half of 0.1) paid ``3.14``; NaN was the answer ``nan``."""
    from nemo_jq.data.sources import WrittenFloat

    record = _first_record("finqa")
    example = FinQA().parse({**record, "qa": {**record["qa"], "answer": WrittenFloat("3.10")}})
    assert example.answer == "3.10" and FinQA().reward("Answer: 3.10", example) == 1.0
    assert FinQA().reward("Answer: 3.14", example) == 0.0
    with pytest.raises(BadRow, match="'qa.answer' is the number nan"):
        FinQA().parse({**record, "qa": {**record["qa"], "answer": float("nan")}})


@pytest.mark.parametrize(
    "text, normalized",
    [("The Beatles", "beatles"), ("an apple, a pear.", "apple pear"), ("Yes.", "yes"), ("  New   York!! ", "new york"),
     ("Theatre", "theatre"), ("A", "a"), ("(B)", "b"), ("The.", "the"), ("?!", ""),
     ("“Paris”", "paris"), ("Paris。", "paris"), ("２０", "20"), ("1990–1995", "1990-1995"), ("Saint‐Denis", "saintdenis"),
     ("«Le Monde»", "le monde")],  # other scripts' forms and punctuation as ASCII's (they earned nothing)
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
        prepare(MuSiQue(), str(FIXTURES / "musique"), (2, 1, 1), seed=0, on_bad_row="fail", options=PREPARE_FLAGS)
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
    (tmp_path / "train.parquet").write_bytes((tmp_path / "train.parquet").read_bytes()[:-20])  # cut short
    with pytest.raises(ValueError, match=r"train.parquet is not a readable Parquet file \(.*\): write it again, or give"):
        prepare(HotPotQA(), str(tmp_path), (3, 2, 2), seed=1)


def test_hub_sources_are_the_papers(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_hub(name, config, split):
        calls.append((name, config, split))
        folder = FIXTURES / "hotpotqa_hf"
        return [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines()], f"fp-{split}"

    monkeypatch.setattr("nemo_jq.data.prepare.read_hub", fake_hub)
    _, manifest = prepare(HotPotQA(), None, (1, 1, 1), seed=0)
    assert manifest["sources"]["train"]["fingerprint"] == "fp-train"
    assert calls == [("hotpotqa/hotpot_qa", "distractor", "train"), ("hotpotqa/hotpot_qa", "distractor", "validation")]
    # a hub configuration given is the one read (the paper's replaced it), and one no hub reads is refused, not dropped
    prepare(HotPotQA(), None, (1, 1, 1), seed=0, hub_config="fullwiki")
    assert calls[-2:] == [("hotpotqa/hotpot_qa", "fullwiki", "train"), ("hotpotqa/hotpot_qa", "fullwiki", "validation")]
    with pytest.raises(ValueError, match="data.hub_config distractor names a configuration of a hub dataset, but "
                                         "data.source .* is a local path \\(hotpotqa\\): drop data.hub_config"):
        prepare(HotPotQA(), str(FIXTURES / "hotpotqa_hf"), (1, 1, 1), seed=0, hub_config="distractor")
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", "mine.jsonl", "--sizes", "1,1,1",
                           "--hub-config", "distractor", "--out", tmp_path / "out")
    one_line_error(code, err, "--hub-config distractor names a configuration", "is read from local files (jsonl)",
                   "drop --hub-config")
    assert not (tmp_path / "out").exists()
    for sizes in ("10,5,\u00b2", "10,5,\u0665"):  # a superscript two (int() refused it, naming nothing), an Arabic-Indic 5
        code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", "mine.jsonl", "--sizes", sizes,
                               "--out", tmp_path / "out")
        one_line_error(code, err, "--sizes needs three whole numbers >= 1", repr(sizes))
    with pytest.raises(ValueError, match="needs a source"):
        prepare(FinQA(), None, (1, 1, 1), seed=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(FinQA(), "./no/such/finqa", (1, 1, 1), seed=0)
    # the paper configs' relative data/finqa, missing, was looked up on the hub: FinQA has no hub source
    monkeypatch.setattr("nemo_jq.data.prepare.read_hub", lambda *args: pytest.fail("finqa asked the hub"))
    with pytest.raises(FileNotFoundError, match="data/finqa does not exist: finqa reads a local file .* no hub source"):
        prepare(FinQA(), "data/finqa", (1, 1, 1), seed=0)


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
    with pytest.raises(ValueError, match=r"a brace of its own written \{\{ or \}\}"):
        CustomQA(template="{question} {")
    with pytest.raises(ValueError, match="does not use {question}: every prompt would be the same"):
        CustomQA(template="Answer this.")  # it was taken, and every prompt was one
    # each passed the check: every prompt the literal text {question}, or the context's type name beside it
    with pytest.raises(ValueError, match="does not use {question}"):
        CustomQA(template="{{question}}")
    for template, field in (("{question}{context.__class__}", "{context.__class__}"), ("{question!r}", "{question!r}"),
                            ("{question:>9}", "{question:>9}"), ("{question} {0}", "{0}"), ("{question} {}", "{}")):
        with pytest.raises(ValueError, match=f"may only use {{question}} and {{context}} as they are .*got {re.escape(field)}"):
            CustomQA(template=template)
    assert CustomQA(template="{question} {{literal}}").template == "{question} {{literal}}"


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



def test_a_prepared_folder_gives_the_split_sizes_that_plans_and_dry_runs_count_steps_from(tmp_path, capsys):
    """With data.prepared_dir, a plan and a dry run counted the run's steps from data.train_size's default (768
    prompts: 192 steps, where the run trains 2), and its evaluations from the default validation and test sizes."""
    from nemo_jq.cli import main
    from nemo_jq.config import load_config

    splits, manifest = prepare(HotPotQA(), str(FIXTURES / "hotpotqa_hf"), (3, 2, 2), seed=0)
    write_prepared(splits, manifest, tmp_path / "prepared")
    config = load_config(None, [f"data.prepared_dir={tmp_path / 'prepared'}", "train.batch_size=2"])
    assert (config.data.train_size, config.data.validation_size, config.data.test_size) == (3, 2, 2)
    assert main(["plan", "--config", "configs/qwen3_0p6b/hotpotqa_warm_paft_q0.75.yaml", "--gpus-per-node", "1",
                 f"data.prepared_dir={tmp_path / 'prepared'}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time"]["layout"]["run"]["steps"] == 2  # 2 epochs of 3 prompts, batches of 32
    # a size given beside the folder is said to be the folder's (it was replaced without a word)
    assert load_config(None, [f"data.prepared_dir={tmp_path / 'prepared'}", "data.train_size=5"]).data.train_size == 3
    assert (f"nemo-jq: warning: data.train_size=5 is ignored: data.prepared_dir={tmp_path / 'prepared'} holds 3 train "
            "rows (its manifest.json), which the run takes") in capsys.readouterr().err
    # a source beside the folder (a config's, with the folder given over it) is not read: said, as is a hub config
    config = load_config(None, [f"data.prepared_dir={tmp_path / 'prepared'}", f"data.source={FIXTURES / 'finqa'}",
                                "data.hub_config=fullwiki"])
    err = capsys.readouterr().err
    for key, value in (("source", (FIXTURES / "finqa").resolve()), ("hub_config", "fullwiki")):
        assert (f"nemo-jq: warning: data.{key}={value} is ignored: data.prepared_dir={tmp_path / 'prepared'} gives the data "
                "(its manifest.json names the source it was prepared from)") in err, err
    assert config.data.name == "hotpotqa" and "on_bad_row" not in err

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
    assert "pass a data.template without {context}" in err and len(err.splitlines()) == 1
    prepare(make_task("jsonl"), str(source), (4, 2, 2), seed=0)  # the default template: a row without context is a question
    prepare(make_task("jsonl", template="Q: {question}"), str(source), (4, 2, 2), seed=0)
    assert capsys.readouterr().err == ""


def _write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _questions(count):
    return [{"id": f"q{i}", "question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(count)]


def _edit_first_row(path, edit):
    lines = path.read_text().splitlines()
    lines[0] = edit(json.loads(lines[0]))
    path.write_text("".join(line + "\n" for line in lines))


@pytest.mark.parametrize("edit, problem", [
    (lambda row: json.dumps({**row, "extra": 1}), "unknown key 'extra'"),
    (lambda row: json.dumps({k: v for k, v in row.items() if k != "answer"}), "missing key 'answer'"),
    (lambda row: "[1, 2]", "a row must be a JSON object, got list"),
    (lambda row: json.dumps({**row, "answer": None, "question": 5}), "key 'question' must be str, got int"),
    (lambda row: json.dumps({**row, "answer": None}), "key 'answer' must be str, got null"),
    (lambda row: json.dumps({**row, "aliases": [1]}), "key 'aliases' must be a list of str"),
    (lambda row: json.dumps({**row, "question": " "}), "empty 'question'"),
    (lambda row: json.dumps({**row, "answer": "!!!"}), "'answer' '!!!' is empty once normalised"),
    (lambda row: '{"id": ', "not valid JSON"),
    (lambda row: "[" * 100_000 + "]" * 100_000, "not JSON this reader takes (arrays or objects nested too deep)"),
    (lambda row: json.dumps(row)[:-1] + ', "n": ' + "9" * 5000 + "}", "not JSON this reader takes (Exceeds the limit"),
])
def test_a_hand_edited_prepared_row_is_one_line_naming_file_row_and_fix(tmp_path, capsys, edit, problem):
    """Training on a prepared folder edited into another shape used to end in a TypeError deep in the run."""
    prepared = tmp_path / "prepared"
    write_prepared(*prepare(make_task("jsonl"), str(_write_jsonl(tmp_path / "mine.jsonl", _questions(12))), (4, 4, 4), seed=0),
                   prepared)
    _edit_first_row(prepared / "train.jsonl", edit)
    with pytest.raises(ValueError, match="prepare the data again") as raised:
        load_prepared(prepared)
    assert str(raised.value).startswith(f"{prepared / 'train.jsonl'}:1: {problem}")
    code, _, err = run_cli(capsys, "train", f"data.prepared_dir={prepared}", f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, f"{prepared / 'train.jsonl'}:1: {problem}",  # the command that made it, in full
                   f"nemo-jq data prepare --dataset jsonl --source {tmp_path / 'mine.jsonl'} --sizes 4,4,4 --seed 0 "
                   f"--out {prepared} --overwrite")


def test_a_prepared_folder_with_a_corrupt_manifest_or_no_split_file_names_it_and_the_fix(tmp_path, capsys):
    prepared = tmp_path / "prepared"
    write_prepared(*prepare(make_task("jsonl"), str(_write_jsonl(tmp_path / "mine.jsonl", _questions(12))), (4, 4, 4), seed=0),
                   prepared)
    (prepared / "train.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=f"{prepared} is not a complete prepared dataset: it has no train.jsonl; "
                                                "prepare the data again"):
        load_prepared(prepared)
    (prepared / "manifest.json").write_text("{not json")
    code, _, err = run_cli(capsys, "train", f"data.prepared_dir={prepared}", f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, f"{prepared / 'manifest.json'}: not valid JSON", "prepare the data again")


def test_a_prepared_folder_edited_to_other_sizes_a_missing_one_or_a_run_are_named_with_a_fix_that_works(
        tmp_path, capsys, monkeypatch):
    """A split edited to fewer rows trained silently on them (the config's split sizes, and the steps counted from them,
    were the manifest's); a missing folder was "no manifest.json"; a run's folder was offered `--overwrite`, which
    would move the run aside; the fix's `--source` was the relative path prepare was given, from another folder."""
    monkeypatch.chdir(tmp_path)
    _write_jsonl(tmp_path / "mine.jsonl", _questions(12))
    prepared = tmp_path / "prepared"
    assert run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", "mine.jsonl", "--sizes", "4,4,4",
                   "--out", prepared)[0] == 0
    lines = (prepared / "train.jsonl").read_text().splitlines()
    (prepared / "train.jsonl").write_text("".join(line + "\n" for line in lines[:3]))
    monkeypatch.chdir(tmp_path.parent)
    code, _, err = run_cli(capsys, "train", f"data.prepared_dir={prepared}", f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, f"{prepared / 'train.jsonl'} holds 3 rows where manifest.json says 4",
                   f"--source {tmp_path / 'mine.jsonl'} --sizes 4,4,4", "set manifest.json's sizes.train to 3")
    (tmp_path / "a_run").mkdir()
    from nemo_jq.config import load_config, save_config

    save_config(load_config(None), tmp_path / "a_run" / "config.yaml")  # a run's saved config
    for folder, said in ((tmp_path / "none", f"{tmp_path / 'none'} does not exist"),
                         (tmp_path / "a_run", f"{tmp_path / 'a_run'} is a run's folder, not prepared data")):
        code, _, err = run_cli(capsys, "train", f"data.prepared_dir={folder}", f"train.run_dir={tmp_path / 'run'}")
        assert "--overwrite" not in one_line_error(code, err, said)
    # prepare's own --out: a run's folder, or the source's, is refused before anything is read or moved
    (tmp_path / "splits").mkdir()
    (tmp_path / "splits" / "train.jsonl").write_text((tmp_path / "mine.jsonl").read_text())
    for out, source, said in ((tmp_path / "a_run", tmp_path / "mine.jsonl", "already holds a run (config.yaml)"),
                              (tmp_path / "splits", tmp_path / "splits", "holds --source"),
                              (tmp_path / "a_run" / "prepared", tmp_path / "mine.jsonl", f"is inside the run {tmp_path / 'a_run'}")):
        code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", source, "--sizes", "4,4,4",
                               "--out", out, "--overwrite")
        one_line_error(code, err, said)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_run", "mine.jsonl", "prepared", "splits"]
    assert not (tmp_path / "a_run" / "prepared").exists()


def test_a_run_from_a_source_with_bad_rows_says_which_it_dropped(tmp_path, capsys):
    """``data prepare`` lists bad rows in its manifest; a run reading the source itself dropped them without a word."""
    source = _write_jsonl(tmp_path / "bad.jsonl", [*_questions(9), '{"id": "broken", ',
                                                    {"id": "q10", "question": "no answer"}])
    code, _, err = run_cli(capsys, "train", "data.name=jsonl", f"data.source={source}", "data.train_size=3",
                           "data.validation_size=2", "data.test_size=2", "train.max_steps=1", "eval.num_samples=2",
                           "train.batch_size=3", "train.micro_batch_size=3", f"train.run_dir={tmp_path / 'run'}")
    assert code == 0, err
    assert f"nemo-jq: warning: data.source {source} (all): 2 bad rows dropped (row 10: not valid JSON" in err
    assert "row 11: missing field 'answer'" in err


def test_a_run_whose_source_changed_under_it_is_neither_evaluated_nor_resumed_on_other_splits(tmp_path, capsys):
    """A run trained from data.source redrew its splits from the file as it is when evaluated or resumed: rows
    reordered and added put training examples into its test split, without a word. The splits' digests, recorded at
    its start (splits.json), are checked; a run that only samples (generate) or exports is not held to them."""
    source = _write_jsonl(tmp_path / "mine.jsonl", _questions(12))
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "data.name=jsonl", f"data.source={source}", "data.train_size=4",
                           "data.validation_size=2", "data.test_size=2", "train.max_steps=1", "eval.num_samples=2",
                           "train.batch_size=2", "train.micro_batch_size=2", f"train.run_dir={run_dir}")
    assert code == 0, err
    assert set(json.loads((run_dir / "splits.json").read_text())) == {"train", "validation", "test"}
    assert run_cli(capsys, "eval", run_dir)[0] == 0  # the same source: the same splits
    _write_jsonl(source, list(reversed(_questions(20))))
    for command in (["eval", run_dir], ["train", "--resume", run_dir, "train.max_steps=2"]):
        code, _, err = run_cli(capsys, *command)
        one_line_error(code, err, f"{run_dir}: its train and validation and test splits as built now from {source} "
                       "differ from those it recorded at its start (splits.json)", "restore it as it was")
    code, _, err = run_cli(capsys, "generate", run_dir, "What is 3+1?")
    assert code == 0, err


def test_fixes_name_the_option_of_the_command_that_prepares(tmp_path, capsys):
    """``data prepare`` takes flags and ``train`` config keys: a fix names the one the person typed a command with."""
    source = _write_jsonl(tmp_path / "bad.jsonl", [*_questions(7), '{"id": "broken", '])
    prepare_command = ["data", "prepare", "--dataset", "jsonl", "--source", source, "--out", tmp_path / "out"]
    train_command = ["train", "data.name=jsonl", f"data.source={source}", f"train.run_dir={tmp_path / 'run'}"]
    code, _, err = run_cli(capsys, *prepare_command, "--sizes", "3,2,2", "--on-bad-row", "fail")
    one_line_error(code, err, f"{source}: row 8", "not valid JSON", "pass --on-bad-row skip")
    code, _, err = run_cli(capsys, *train_command, "data.on_bad_row=fail", "data.train_size=3", "data.validation_size=2",
                           "data.test_size=2")
    line = one_line_error(code, err, f"{source}: row 8", "not valid JSON", "pass data.on_bad_row=skip")
    assert "--on-bad-row" not in line
    code, _, err = run_cli(capsys, *prepare_command, "--sizes", "8,1,1")
    one_line_error(code, err, f"{source}: train needs 8 rows", "only 7 eligible rows remain", "lower --sizes")
    code, _, err = run_cli(capsys, *train_command, "data.train_size=3", "data.validation_size=2", "data.test_size=3")
    one_line_error(code, err, f"{source}: test needs 3 rows", "only 2 eligible rows remain", "lower data.test_size")
    assert not (tmp_path / "out").exists()


def test_an_empty_source_is_named_as_empty_with_the_fix(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "empty.jsonl", [])
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", source, "--sizes", "3,2,2",
                           "--out", tmp_path / "out")
    one_line_error(code, err, f"{source} is empty", "train needs 3 rows", "--source")
    with pytest.raises(ValueError, match=f"{source} is empty: .* data.source"):
        prepare(make_task("jsonl"), str(source), (3, 2, 2), seed=0)


def test_a_source_or_prepared_folder_of_the_wrong_kind_is_named_with_the_fix(tmp_path, capsys):
    """A folder without split files named no fix; with train.jsonl and train.parquet, one was left unread without a
    word; /dev/null "did not exist"; a file as data.prepared_dir "did not exist"; a manifest hand-edited to say
    synthetic trained on generated sums instead of the prepared rows; a bad template in it was not said to be its."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "splits"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=f"{folder} holds no train split file .*add one \\(e.g. "
                                                f"{folder / 'train.jsonl'}\\), or give a single file"):
        prepare(make_task("jsonl"), str(folder), (3, 2, 2), seed=0)
    source = _write_jsonl(folder / "train.jsonl", _questions(7))
    pq.write_table(pa.Table.from_pylist(_questions(7)), folder / "train.parquet")
    with pytest.raises(ValueError, match=f"{folder} holds train.jsonl and train.parquet: .*keep one of them there"):
        prepare(make_task("jsonl"), str(folder), (3, 2, 2), seed=0)
    with pytest.raises(ValueError, match="data.source /dev/null is neither a file nor a folder"):
        prepare(make_task("jsonl"), "/dev/null", (3, 2, 2), seed=0)
    code, _, err = run_cli(capsys, "train", f"data.prepared_dir={source}", f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, f"{source} is a file, not a prepared folder", f"data.name=jsonl data.source={source}")
    prepared = tmp_path / "prepared"
    write_prepared(*prepare(make_task("jsonl"), str(source), (3, 2, 2), seed=0), prepared)
    manifest = json.loads((prepared / "manifest.json").read_text())
    (prepared / "manifest.json").write_text(json.dumps({**manifest, "dataset": "synthetic", "template": None}))
    code, _, err = run_cli(capsys, "train", f"data.prepared_dir={prepared}", f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, f"{prepared / 'manifest.json'}: 'dataset' 'synthetic' is not a prepared dataset's name")
    # its prompt template edited wrong: the error named the template, not the file it is in
    for template, wrong in (("Q: {questoin}", "prompt template 'Q: {questoin}' may only use {question} and {context}"),
                            (3, "'template' and 'system' are text or null")):
        (prepared / "manifest.json").write_text(json.dumps({**manifest, "template": template}))
        code, _, err = run_cli(capsys, "train", f"data.prepared_dir={prepared}", f"train.run_dir={tmp_path / 'run'}")
        one_line_error(code, err, f"{prepared / 'manifest.json'}: {wrong}", "prepare the data again (nemo-jq data prepare")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-le", "UTF-16 or UTF-32")])
def test_a_utf16_or_utf32_source_is_named_with_the_fix(tmp_path, encoding, name):
    """Every line of a UTF-16 file used to be a bad row, with a hint that the schema was wrong."""
    for suffix, text in ((".jsonl", "".join(json.dumps(r) + "\n" for r in _questions(7))), (".json", json.dumps(_questions(7)))):
        source = tmp_path / f"wide{suffix}"
        source.write_bytes(text.encode(encoding))
        with pytest.raises(ValueError, match=f"{source} .*{name}.*save it as UTF-8"):
            prepare(make_task("jsonl"), str(source), (3, 2, 2), seed=0)


def test_the_prompt_options_of_jsonl_are_refused_for_other_datasets(tmp_path, capsys, monkeypatch):
    """A --template for hotpotqa was ignored: the manifest said template null and nothing told the person."""
    with pytest.raises(ValueError, match="data.template is for a dataset whose prompts it shapes"):
        make_task("hotpotqa", template="{question}")
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "hotpotqa", "--source", FIXTURES / "hotpotqa_hf",
                           "--sizes", "2,2,2", "--template", "{question}", "--system", "hi", "--out", tmp_path / "out")
    one_line_error(code, err, "--template and --system are for a dataset whose prompts they shape (jsonl): hotpotqa builds its own")
    assert not (tmp_path / "out").exists()
    # a plugin's dataset built on jsonl's takes them, under its own name
    from dataclasses import dataclass

    from nemo_jq.data.qa import DATASETS, CustomQA

    @dataclass
    class MyQA(CustomQA):
        name: str = "my_qa"

    monkeypatch.setitem(DATASETS, "my_qa", MyQA)
    assert make_task("my_qa", template="Q: {question}", system="hi").template == "Q: {question}"


def test_empty_questions_and_true_or_false_answers_are_bad_rows(tmp_path):
    rows = [*_questions(6), {"id": "blank", "question": "", "answer": "1"}, {"id": "spaces", "question": " \t", "answer": "1"},
            {"id": "marks", "question": "???", "answer": "1"}, {"id": "invisible", "question": "\u200b", "answer": "1"},
            {"id": "kanji", "question": "\u4f55?", "answer": "1"},
            {"id": "yes", "question": "Is it?", "answer": True}, {"id": "number", "question": "How many?", "answer": 7},
            # numbers no answer is written as (NaN and Infinity, which Python's JSON reads, became "nan" and "inf");
            # a null context, as a data frame writes a missing one, is none (it was a bad row)
            '{"id": "nan", "question": "Q?", "answer": NaN}', '{"id": "big", "question": "Q?", "answer": 1e20}',
            {"id": "no_context", "question": "Q?", "answer": "2", "context": None}]
    _, manifest = prepare(make_task("jsonl"), str(_write_jsonl(tmp_path / "mine.jsonl", rows)), (3, 2, 2), seed=0)
    assert manifest["sources"]["all"]["bad"] == [
        {"id": "blank", "row": 7, "reason": "empty 'question'"},
        {"id": "spaces", "row": 8, "reason": "empty 'question'"},
        {"id": "marks", "row": 9, "reason": "'question' '???' has no letter or digit: it asks nothing"},
        {"id": "invisible", "row": 10, "reason": "'question' '\\u200b' has no letter or digit: it asks nothing"},
        {"id": "yes", "row": 12, "reason": "field 'answer' must be str/int/float, got bool"},
        {"id": "nan", "row": 14, "reason": "'answer' is the number nan, which no answer is written as: give it as a string"},
        {"id": "big", "row": 15, "reason": "'answer' is the number 1e20, which no answer is written as: give it as a string"},
    ]
    assert manifest["sources"]["all"]["eligible"] == 9


def test_a_number_answer_is_the_text_it_was_written_as(tmp_path):
    """JSON's ``3.10`` read as the float 3.1 made the gold ``3.1``, which ``Answer: 3.10`` did not earn; a Parquet
    column of whole numbers with one missing (floats, as a data frame writes it) made the golds ``12.0``, which
    ``Answer: 12`` did not earn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = make_task("jsonl")
    lines = [json.dumps({"id": f"q{i}", "question": f"How much is {i}?", "answer": "x"}).replace('"x"', text)
             for i, text in enumerate(["3.10", "2.50", "12", "-0.5", "1.0", "7", "8"])]
    (tmp_path / "written.jsonl").write_text("\n".join(lines) + "\n")
    splits, _ = prepare(task, str(tmp_path / "written.jsonl"), (5, 1, 1), seed=0)
    golds = sorted(example.answer for split in (splits.train, splits.validation, splits.test) for example in split)
    assert golds == sorted(["3.10", "2.50", "12", "-0.5", "1.0", "7", "8"])
    answers = [12.0, None, 4.0, 2.5, 16.0, 20.0, 24.0, 28.0]
    pq.write_table(pa.table({"question": [f"Q{i}?" for i in range(8)], "answer": answers}), tmp_path / "typed.parquet")
    splits, manifest = prepare(task, str(tmp_path / "typed.parquet"), (5, 1, 1), seed=0)
    golds = {example.question: example.answer for split in (splits.train, splits.validation, splits.test) for example in split}
    assert sorted(golds.values()) == sorted(["12", "4", "2.5", "16", "20", "24", "28"])
    example = next(example for split in (splits.train, splits.validation, splits.test) for example in split if example.answer == "12")
    assert task.reward("Answer: 12", example) == 1.0 and manifest["sources"]["all"]["bad"][0]["row"] == 2


def test_rows_asking_the_same_under_other_ids_are_named(tmp_path, capsys):
    """A file written twice without ids: each copy took its row's id, and 8 of 12 validation and test questions were
    also in train, with no word; one id on two rows is the duplicate-id warning's alone."""
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(12)]
    prepare(make_task("jsonl"), str(_write_jsonl(tmp_path / "twice.jsonl", rows + rows)), (12, 6, 6), seed=0)
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"nemo-jq: warning: {tmp_path / 'twice.jsonl'}: 12 question(s) on more than one row: "
                              "rows 1, 13; rows 2, 14;") and warning.endswith("(leakage); remove them")
    prepare(make_task("jsonl"), str(_write_jsonl(tmp_path / "ids.jsonl", [*_questions(6), _questions(1)[0]])), (3, 2, 2),
            seed=0)
    assert "question(s) on more than one row" not in capsys.readouterr().err


def test_an_empty_or_true_id_is_no_id(tmp_path, capsys):
    """``"id": ""`` on six rows was warned of as one id shared by them, named as a blank; ``true`` became ``True``."""
    rows = [{**row, "id": ["", True, " "][i % 3]} for i, row in enumerate(_questions(7))]
    splits, _ = prepare(make_task("jsonl"), str(_write_jsonl(tmp_path / "ids.jsonl", rows)), (3, 2, 2), seed=0)
    ids = sorted(example.id for split in (splits.train, splits.validation, splits.test) for example in split)
    assert ids == sorted(f"all:{row}" for row in range(1, 8)) and "warning" not in capsys.readouterr().err


def test_ids_shared_between_source_split_files_are_named(tmp_path, capsys):
    """The same rows in train and validation files would land in prepared train and test (leakage)."""
    train = _write_jsonl(tmp_path / "train.jsonl", _questions(8))
    validation = _write_jsonl(tmp_path / "validation.jsonl", _questions(8))
    prepare(make_task("jsonl"), str(tmp_path), (4, 2, 2), seed=0)
    err = capsys.readouterr().err
    assert f"{train} and {validation}: 8 example id(s) in both: q0, q1, q2, q3, q4; ..." in err
    assert "remove them from one" in err and len(err.splitlines()) == 1  # the questions alike too: said once
    # rows without ids, copied from one file into the other: each took its file's own id, and nothing was said
    _write_jsonl(tmp_path / "train.jsonl", [{k: v for k, v in row.items() if k != "id"} for row in _questions(8)])
    _write_jsonl(tmp_path / "validation.jsonl", [{k: v for k, v in row.items() if k != "id"} for row in _questions(8)][2:])
    prepare(make_task("jsonl"), str(tmp_path), (4, 2, 2), seed=0)
    err = capsys.readouterr().err
    assert f"{train} and {validation}: 6 question(s) in both, under other ids (rows 3, 4, 5, 6, 7, ... of the first)" in err
    assert len(err.splitlines()) == 1


def test_a_jsonl_source_that_is_not_a_local_file_fails_at_once(monkeypatch, tmp_path, capsys):
    """A bare name went to the Hugging Face hub, retried for about 25 s, then failed: jsonl has no hub form."""
    monkeypatch.setattr("nemo_jq.data.prepare.read_hub", lambda *args: pytest.fail("jsonl asked the hub"))
    with pytest.raises(FileNotFoundError, match="data.source nope does not exist: jsonl reads a local file"):
        prepare(make_task("jsonl"), "nope", (10, 5, 5), seed=0)
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", "nope", "--sizes", "10,5,5",
                           "--out", tmp_path / "out")
    one_line_error(code, err, "--source nope does not exist", "no hub source")


def test_a_folders_own_test_file_is_its_test_split_and_splits_of_one_file_are_drawn_apart(tmp_path, capsys):
    """A jsonl folder's test.jsonl was never read: test was drawn from validation.jsonl. Without a test file, test and
    validation are disjoint draws from the validation file (one pool, not two copies of it)."""
    (tmp_path / "all").mkdir()
    for split in ("train", "validation", "test"):
        _write_jsonl(tmp_path / "all" / f"{split}.jsonl",
                     [{"id": f"{split[:2]}{i}", "question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(6)])
    splits, manifest = prepare(make_task("jsonl"), str(tmp_path / "all"), (4, 3, 5), seed=0)
    assert {example.id[:2] for example in splits.test} == {"te"} and len(splits.test) == 5
    assert {example.id[:2] for example in splits.validation} == {"va"} and manifest["splits"]["test"]["source"] == "test"
    (tmp_path / "all" / "test.jsonl").unlink()
    splits, manifest = prepare(make_task("jsonl"), str(tmp_path / "all"), (4, 3, 3), seed=0)
    assert {example.id[:2] for example in splits.test} == {"va"}
    assert not {example.id for example in splits.test} & {example.id for example in splits.validation}
    with pytest.raises(ValueError, match="only 3 eligible rows remain"):  # 3 + 4 > the file's 6 rows
        prepare(make_task("jsonl"), str(tmp_path / "all"), (4, 3, 4), seed=0)
    with pytest.raises(SystemExit):
        run_cli(capsys, "data", "prepare", "--help")
    assert "test: test or validation or dev" in capsys.readouterr().out


def test_the_command_to_prepare_a_folder_again_keeps_the_hub_config_and_the_bad_row_rule_it_was_made_with():
    """The "prepare it again" advice left out --hub-config (a hub dataset's other configuration) and --on-bad-row
    fail: run as given, it rebuilt other data, or let bad rows through."""
    from nemo_jq.data.prepare import prepare_again

    made = {"dataset": "hotpotqa", "source": "hotpot_qa", "sizes": {"train": 10, "validation": 5, "test": 5}, "seed": 0,
            "on_bad_row": "fail", "sources": {"train": {"hub": "hotpot_qa", "config": "fullwiki", "split": "train"}}}
    assert prepare_again(Path("/data/p"), made) == (
        "prepare the data again (nemo-jq data prepare --dataset hotpotqa --source hotpot_qa --hub-config fullwiki "
        "--on-bad-row fail --sizes 10,5,5 --seed 0 --out /data/p --overwrite)")
    local = {**made, "source": "/data/hotpot.json", "on_bad_row": "skip", "sources": {"all": {"file": "/data/hotpot.json"}}}
    assert "--hub-config" not in prepare_again(Path("/data/p"), local) and "--on-bad-row" not in prepare_again(
        Path("/data/p"), local)
