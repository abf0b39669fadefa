"""Runs that never lose a user's work, never silently do the wrong thing, and fail with one actionable line."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.cli import main
from nemo_jq.config import ConfigError, load_config
from nemo_jq.data.prepare import load_prepared, make_task, prepare, write_prepared
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.checkpoint import latest_checkpoint, load_checkpoint
from nemo_jq.runtime.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QUICK = [*TINY_RUN, "train.max_steps=2", "eval.every=1000"]


# ----------------------------------------------------------------------------- data loss
def test_a_run_directory_that_holds_a_run_is_refused_and_kept(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    code, _, err = run_cli(capsys, "train", *QUICK, "objective.name=paft", f"train.run_dir={run_dir}")
    one_line_error(code, err, str(run_dir), "--resume", "train.run_dir", "--overwrite")
    assert {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # --overwrite moves the earlier run aside, whole, before the new one starts.
    assert run_cli(capsys, "train", *QUICK, "objective.name=paft", f"train.run_dir={run_dir}", "--overwrite")[0] == 0
    (aside,) = tmp_path.glob("run.old-*")
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
    assert load_config(run_dir / "config.yaml").objective.name == "paft"


def test_an_earlier_demo_is_refused_or_moved_aside(tmp_path, capsys):
    from nemo_jq.recipe.demo import run_demo

    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "summary.json").write_text("{}")
    code, _, err = run_cli(capsys, "train", "--demo-dir", demo)
    one_line_error(code, err, str(demo), "--demo-dir", "--overwrite")
    assert (demo / "summary.json").read_text() == "{}"
    with pytest.raises(FileExistsError):
        run_demo(demo)


def test_resume_rebuilds_tensorboard_without_the_steps_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [*TINY_RUN, "train.tensorboard=true", "train.save_every=2", f"train.run_dir={tmp_path / 'run'}"]
    trainer = Trainer(load_config(None, overrides))
    trainer.fit(max_steps=3)
    # Killed after logging step 3 but before its checkpoint: latest still names step 2.
    root = trainer.run_dir / "checkpoints"
    (root / "latest").write_text("step_00000002")
    resumed = Trainer.resume(trainer.run_dir)
    resumed.fit(max_steps=5)
    events = EventAccumulator(str(trainer.run_dir / "tensorboard"))
    events.Reload()
    steps = [event.step for event in events.Scalars("train/loss")]
    assert steps == [1, 2, 3, 4, 5]
    assert steps == [r["step"] for r in read_metrics(trainer.run_dir) if r["kind"] == "train"]


# ----------------------------------------------------------------------------- silently doing the wrong thing
def _prepared(tmp_path, name="hotpotqa", folder="hotpotqa_hf", sizes=(3, 2, 2), **prompt):
    task = make_task(name, **prompt)
    splits, manifest = prepare(task, str(FIXTURES / folder), sizes, seed=0)
    out = tmp_path / f"prepared-{name}"
    write_prepared(splits, manifest, out)
    return out


def test_a_prepared_folder_sets_the_dataset_and_a_conflicting_name_is_an_error(tmp_path):
    prepared = _prepared(tmp_path)
    config = load_config(None, [f"data.prepared_dir={prepared}"])
    assert config.data.name == "hotpotqa"
    with pytest.raises(ConfigError, match="data.name='musique' but data.prepared_dir=.*was prepared with 'hotpotqa'"):
        load_config(None, [f"data.prepared_dir={prepared}", "data.name=musique"])
    assert load_config(None, []).data.name == "synthetic"


def test_custom_prompts_travel_with_the_prepared_folder(tmp_path):
    rows = [{"id": f"c{i}", "question": f"What is {i}+{i}?", "answer": str(2 * i), "context": f"n={i}"} for i in range(8)]
    source = tmp_path / "mine.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task("jsonl", template="{context} | {question}", system="Digits only.")
    splits, manifest = prepare(task, str(source), (4, 2, 2), seed=0)
    write_prepared(splits, manifest, tmp_path / "mine")
    assert (manifest["template"], manifest["system"]) == ("{context} | {question}", "Digits only.")
    trainer = Trainer(load_config(None, [*QUICK, f"data.prepared_dir={tmp_path / 'mine'}", "data.format=warm",
                                         "train.batch_size=2", f"train.run_dir={tmp_path / 'run'}"]))
    example = trainer.components.splits.train[0]
    assert trainer.components.task.messages(example, "warm") == [
        {"role": "system", "content": "Digits only."},
        {"role": "user", "content": f"{example.context} | {example.question}"},
    ]
    with pytest.raises(ConfigError, match="data.template="):
        load_config(None, [f"data.prepared_dir={tmp_path / 'mine'}", 'data.template="Q: {question}"'])


def test_resume_applies_safe_overrides_and_refuses_the_rest(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "optim.lr=1e-2")
    line = one_line_error(code, err, "a resumed run keeps what it trains; optim.lr=1e-2 cannot change", "train.epochs",
                          "eval.every")
    assert "m@k" not in line  # said only of the key it is about
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "eval.num_samples=8")
    one_line_error(code, err, "and the k of the validation m@k that picks its best checkpoint")
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "--config", ROOT / "configs/examples" / "synthetic_cold_paft_q0.75.yaml")
    one_line_error(code, err, "--resume", "--config")
    # a layout key may change (megatron checkpoints reshard), but only on the backend that has layouts
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "megatron.tensor_parallel=2")
    one_line_error(code, err, "megatron.tensor_parallel", "model.backend=megatron")
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "model.tensor_parallel=2")  # the key before 0.2
    assert code == 2 and "megatron.tensor_parallel needs model.backend=megatron" in err and "Traceback" not in err
    assert run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3", "eval.every=3")[0] == 0
    saved = load_config(run_dir / "config.yaml")
    assert saved.train.max_steps == 3 and saved.eval.every == 3
    records = read_metrics(run_dir)
    assert {"kind": "resume", "step": 2, "overrides": ["train.max_steps=3", "eval.every=3"]} in records
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    # how fast and in how much memory it runs: what an out-of-memory error says to lower, or a compile that failed
    speed = ["rollout.kv_cache_tokens=64", "rollout.cuda_graphs=false", "rollout.compile=false", "model.compile=false",
             "model.logprob_chunk_size=64"]
    assert run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=4", *speed)[0] == 0
    saved = load_config(run_dir / "config.yaml")
    assert (saved.rollout.kv_cache_tokens, saved.rollout.cuda_graphs, saved.model.logprob_chunk_size) == (64, False, 64)
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.save_every=0", "train.save_every must be >= 1; got 0"),
        ("train.max_steps=-3", "train.max_steps must be >= 1; got -3"),
        ("train.max_steps=0", "train.max_steps must be >= 1; got 0"),
        ("optim.lr=-1", "optim.lr must be >= 0.0; got -1.0"),
        ("data.validation_size=0", "data.validation_size must be >= 1; got 0"),
        ("data.test_size=-2", "data.test_size must be >= 1; got -2"),
        ("rollout.top_p=0", "rollout.top_p must be > 0.0 and <= 1.0; got 0.0"),
        ("rollout.temperature=-0.5", "rollout.temperature must be >= 0.0"),
        ("eval.every=0", "eval.every must be >= 1"),
        ("optim.betas=[0.9, 1.5]", "optim.betas must be two numbers in [0, 1)"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1"),
    ],
)
def test_numbers_out_of_range_are_refused_at_load_time(override, message, capsys):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])
    one_line_error(*run_cli(capsys, "train", override)[::2], message)


@pytest.mark.parametrize("sizes", ["40,-5,10", "40,0,10", "1,2", "a,b,c", "1.5,2,2"])
def test_data_prepare_refuses_bad_sizes(tmp_path, capsys, sizes):
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "hotpotqa", "--source", FIXTURES / "hotpotqa_hf",
                           "--sizes", sizes, "--out", tmp_path / "out")
    one_line_error(code, err, "--sizes", sizes)
    assert not (tmp_path / "out").exists()


def test_an_empty_prepared_split_is_an_error(tmp_path):
    prepared = _prepared(tmp_path)
    (prepared / "test.jsonl").write_text("")
    with pytest.raises(ValueError, match="test.jsonl is empty"):
        load_prepared(prepared)


def test_unreadable_lines_are_bad_rows_counted_from_one(tmp_path, capsys):
    good = (FIXTURES / "hotpotqa_hf" / "train.jsonl").read_bytes().splitlines()
    source = tmp_path / "train.jsonl"
    source.write_bytes(b"\n".join([good[0], b'{"id": "broken", "question": ', good[1], b"\xff\xfe not utf-8", good[2]]) + b"\n")
    (tmp_path / "validation.jsonl").write_bytes((FIXTURES / "hotpotqa_hf" / "validation.jsonl").read_bytes())
    _, manifest = prepare(make_task("hotpotqa"), str(tmp_path), (3, 1, 1), seed=0)
    bad = manifest["sources"]["train"]["bad"]
    assert [(b["row"], b["reason"].split(" (")[0]) for b in bad] == [(2, "not valid JSON"), (4, "not UTF-8 text")]
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "hotpotqa", "--source", tmp_path, "--sizes", "3,1,1",
                           "--on-bad-row", "fail", "--out", tmp_path / "out")
    one_line_error(code, err, f"{source}: row 2", "not valid JSON", "--on-bad-row skip")


def test_a_json_file_with_bad_bytes_or_syntax_names_file_and_line(tmp_path, capsys):
    broken = tmp_path / "train.json"
    broken.write_bytes(b'[\n{"id": 1},\n{"id": "\xe9t\xe9"}\n]')
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "finqa", "--source", broken, "--sizes", "1,1,1",
                           "--out", tmp_path / "out")
    one_line_error(code, err, f"{broken}:3", "not UTF-8", "save the file as UTF-8")
    broken.write_text('[\n{"id": 1},\n{"id": 2,}\n]')
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "finqa", "--source", broken, "--sizes", "1,1,1",
                           "--out", tmp_path / "out")
    one_line_error(code, err, f"{broken}:3:", "not valid JSON")


# ----------------------------------------------------------------------------- errors a person can act on
def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("train:\n  epochs: 3\n  batch_size: [1, 2\n")
    code, _, err = run_cli(capsys, "train", "--config", config)
    one_line_error(code, err, f"{config}:4:1", "invalid YAML")
    with pytest.raises(ConfigError):
        main(["--debug", "train", "--config", str(config)])  # --debug shows the traceback instead


def test_the_debug_environment_variable_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_JQ_DEBUG", "1")
    with pytest.raises(ConfigError, match="train.save_every"):
        main(["train", "train.save_every=0"])


def test_a_full_disk_is_one_line_and_the_last_good_checkpoint_stays(tmp_path, capsys, monkeypatch):
    from nemo_jq.models.hf import HFPolicy

    original, calls = HFPolicy.save, []

    def fill_up(self, path):
        calls.append(path)
        if len(calls) > 1:
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos: file write failed")
        original(self, path)

    monkeypatch.setattr(HFPolicy, "save", fill_up)
    monkeypatch.setattr("nemo_jq.runtime.checkpoint.shutil.disk_usage", lambda _path: SimpleNamespace(total=1 << 30, used=1 << 30, free=0))
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "train.max_steps=4", "train.save_every=2", "eval.every=1000",
                           f"train.run_dir={run_dir}")
    one_line_error(code, err, "no space left on device", str(run_dir / "checkpoints" / "step_00000004"), "--resume")
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest.name == "step_00000002" and not list((run_dir / "checkpoints").glob(".tmp-*"))
    monkeypatch.undo()
    state, _ = load_checkpoint(latest, Trainer.resume(run_dir).policy)
    assert state["step"] == 2


def test_a_read_only_run_directory_is_one_line(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "locked"
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self == run_dir:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    code, _, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")
    one_line_error(code, err, "read-only file system", str(run_dir), "writable")


def test_the_hub_without_a_network_says_to_pass_local_files(monkeypatch, tmp_path, capsys):
    import datasets

    def offline(*_args, **_kwargs):
        raise ConnectionError("Couldn't reach 'hotpotqa/hotpot_qa' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "hotpotqa", "--sizes", "1,1,1", "--out", tmp_path / "o")
    one_line_error(code, err, "hotpotqa/hotpot_qa", "ConnectionError", "--source")


def test_eval_and_export_name_the_step_they_use_and_take_another_on_request(tmp_path, capsys, monkeypatch):
    """At a cold start every validation is 0: no checkpoint is the best, so the test split, eval and export take the
    latest (the earliest of the zeros is the least trained) and say so; --step N (or latest) takes another. Each eval
    writes a report; none is overwritten."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, "train.max_steps=3", "eval.every=1", "train.save_every=1",
                   "train.keep_checkpoints=10", f"train.run_dir={run_dir}")[0] == 0
    assert [r["m@4"] for r in read_metrics(run_dir) if r["kind"] == "validation"] == [0.0, 0.0, 0.0]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["best_step"] is None and results["tested"] == "the latest (step 3): no validation m@4 rose above 0"
    code, out, _ = run_cli(capsys, "export", run_dir, "--out", tmp_path / "best")
    assert code == 0 and f"exported step 3 of {run_dir} (the latest (no validation m@4 rose above 0))" in out, out
    source = json.loads((tmp_path / "best" / "nemo_jq_export.json").read_text())["source"]
    assert (source["step"], source["checkpoint"]) == (3, str(run_dir / "checkpoints" / "step_00000003"))
    code, out, _ = run_cli(capsys, "export", run_dir, "--out", tmp_path / "first", "--step", "1")
    assert code == 0 and "exported step 1" in out and "(step 1, as asked)" in out
    code, out, _ = run_cli(capsys, "export", run_dir, "--out", tmp_path / "first", "--step", "2")  # said, not silent
    assert code == 0 and "exported step 2" in out and "replacing its export of step 1" in out, out
    # another run's export may be a run's model.path: it is not replaced (it was, silently)
    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns(".nemo_jq.lock"))
    code, _, err = run_cli(capsys, "export", other, "--out", tmp_path / "first")
    one_line_error(code, err, f"--out {tmp_path / 'first'} holds the export of another run ({run_dir}, step 2)")
    assert json.loads((tmp_path / "first" / "nemo_jq_export.json").read_text())["source"]["step"] == 2
    # another run started in the run's folder (--overwrite) is another run; the run moved elsewhere is the same
    assert run_cli(capsys, "train", *QUICK, "train.max_steps=1", f"train.run_dir={other}", "--overwrite",
                   "rollout.temperature=0.7", "rollout.top_p=0.95")[0] == 0
    assert run_cli(capsys, "export", other, "--out", tmp_path / "other_export")[0] == 0
    for export, sampled in (("best", (1.0, 0, 1.0)), ("other_export", (0.7, 0, 0.95))):  # as each run's rollouts
        generation = json.loads((tmp_path / export / "generation_config.json").read_text())
        assert (generation["do_sample"], generation["temperature"], generation.get("top_k", 0),
                generation.get("top_p", 1.0)) == (True, *sampled), export
    assert run_cli(capsys, "train", *QUICK, "train.max_steps=2", f"train.run_dir={other}", "--overwrite")[0] == 0
    code, _, err = run_cli(capsys, "export", other, "--out", tmp_path / "other_export")
    one_line_error(code, err, f"--out {tmp_path / 'other_export'} holds the export of another run ({other}, step 1)")
    moved = tmp_path / "moved"
    sorted(tmp_path.glob("other.old-*"))[-1].rename(moved)  # the second: the run that exported it
    code, out, _ = run_cli(capsys, "export", moved, "--out", tmp_path / "other_export")
    assert code == 0 and "replacing its export of step 1" in out, out
    # the same validations at 0.5 (written as a run that scored them would): the best is the earliest of the tie
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"m@4": 0.0', '"m@4": 0.5'))
    state_file = run_dir / "checkpoints" / "step_00000003" / "state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "best_metric": 0.5, "best_step": 1}))
    code, out, _ = run_cli(capsys, "export", run_dir, "--out", tmp_path / "tied")
    assert code == 0 and "exported step 1" in out and "(the best validation m@4 (0.5), tied with steps 2, 3" in out, out
    for _ in range(2):
        code, out, err = run_cli(capsys, "eval", run_dir, "--split", "validation", "--step", "2")
        assert code == 0 and json.loads(out)["step"] == 2 and "evaluated step 2" in err
    assert sorted(p.name for p in (run_dir / "evals").iterdir()) == ["validation-step_00000002-2.json",
                                                                    "validation-step_00000002.json"]
    code, _, err = run_cli(capsys, "eval", run_dir, "--step", "7")
    one_line_error(code, err, "--step 7", "checkpoints at steps 1, 2, 3")
    monkeypatch.chdir(tmp_path)  # a relative run directory: the report carries it absolute
    code, out, _ = run_cli(capsys, "eval", "run", "--split", "validation", "--step", "3")
    assert code == 0 and json.loads(out)["run_dir"] == str(run_dir) and json.loads(out)["checkpoint"].startswith("/")


def test_export_onto_an_existing_file_is_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    code, _, err = run_cli(capsys, "export", run_dir, "--out", target)
    one_line_error(code, err, str(target), "choose another --out")
    assert target.read_text() == "mine"
    out = tmp_path / "exported"
    assert run_cli(capsys, "export", run_dir, "--out", out)[0] == 0
    # a full disk: safetensors' own error, which hid the disk's (a traceback), said as the disk's, the export kept
    def full_disk(self, out_dir, tokenizer):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("nemo_jq.models.hf.HFPolicy.export", full_disk)
        code, _, err = run_cli(capsys, "export", run_dir, "--out", out)
    one_line_error(code, err, f"no space left on device: {out}; free some space or choose another --out")
    assert (out / "model.safetensors").exists() and "--resume" not in err
    (out / "nemo_jq_export.json").write_text("{bad")  # an edit, a copy cut short: which files are the export's?
    code, _, err = run_cli(capsys, "export", run_dir, "--out", out)
    one_line_error(code, err, f"{out / 'nemo_jq_export.json'} is not an export's record (not JSON", "choose another --out")
    assert (out / "model.safetensors").exists()
    # a record naming a file elsewhere: the next export deleted it (a copied or hand-made record)
    (out / "nemo_jq_export.json").write_text(json.dumps({"files": ["model.safetensors", "../notes.txt"]}))
    code, _, err = run_cli(capsys, "export", run_dir, "--out", out)
    one_line_error(code, err, f"{out / 'nemo_jq_export.json'} is not an export's record (no list of its files' names",
                   "choose another --out")
    assert target.read_text() == "mine"


def test_eval_generate_and_export_take_only_overrides_of_how_they_sample_and_where_they_run(tmp_path, capsys):
    """A key of what the run trained used to load into a model of another shape (a 60-line traceback) or be ignored."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    code, _, err = run_cli(capsys, "eval", run_dir, "model.tiny.hidden_size=64")
    one_line_error(code, err, "model.tiny.hidden_size=64 cannot change with eval", "eval.num_samples", "train.device")
    code, _, err = run_cli(capsys, "eval", run_dir, "train.max_steps=5")
    one_line_error(code, err, "train.max_steps=5 cannot change with eval")
    code, _, err = run_cli(capsys, "generate", run_dir, "3+4+5", "eval.num_samples=2")
    one_line_error(code, err, "eval.num_samples=2 cannot change with generate", "rollout.max_thinking_tokens")
    code, _, err = run_cli(capsys, "export", run_dir, "--out", tmp_path / "hf", "rollout.temperature=0.5")
    one_line_error(code, err, "rollout.temperature=0.5 cannot change with export", "train.device")
    assert not (tmp_path / "hf").exists()
    code, out, _ = run_cli(capsys, "eval", run_dir, "--split", "validation", "eval.num_samples=2", "train.device=cpu")
    assert code == 0 and "m@2" in json.loads(out)
    assert run_cli(capsys, "export", run_dir, "--out", tmp_path / "hf", "train.device=cpu")[0] == 0


def test_generate_refuses_a_question_or_answer_no_sample_could_be_scored_against(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    for question in ("", "  "):
        code, _, err = run_cli(capsys, "generate", run_dir, question)
        one_line_error(code, err, "the question is empty")
    # the question left out: the first override was taken for it and sampled, at the run's own temperature
    code, _, err = run_cli(capsys, "generate", run_dir, "rollout.temperature=0.5", "rollout.max_thinking_tokens=4")
    one_line_error(code, err, "the question is missing (rollout.temperature=0.5 is an override)",
                   f'nemo-jq generate {run_dir} "3+4+5" rollout.temperature=0.5 rollout.max_thinking_tokens=4')
    code, _, err = run_cli(capsys, "generate", run_dir, "3+4+5", "--answer", " ")
    one_line_error(code, err, "empty '--answer'", "leave --answer out")
    code, _, err = run_cli(capsys, "generate", run_dir, "3+4+5", "--answer", "?!")
    one_line_error(code, err, "'?!' is empty once normalised", "leave --answer out")
    code, out, _ = run_cli(capsys, "generate", run_dir, "3+4+5", "--answer", " 12 ", "--json")
    assert code == 0 and json.loads(out)["reference"] == "12"
    code, _, err = run_cli(capsys, "generate", run_dir, "3+4+5", "--context", "a passage")  # the synthetic task's
    one_line_error(code, err, "data.name=synthetic) puts no passage in its prompts", "drop --context")
    code, _, err = run_cli(capsys, "generate", run_dir, "1+" * 400 + "1")  # it sampled past the context, unsaid
    one_line_error(code, err, "the question: its prompt is", "beyond the model's context of 512 tokens "
                   "(model.tiny.max_position_embeddings): shorten the question (or --context), or lower "
                   "rollout.max_thinking_tokens")


def test_a_finished_run_whose_checkpoints_were_deleted_is_no_failed_start(tmp_path, capsys):
    """It was called "a start that failed before the first" by --resume, and a new run in its folder moved it aside
    without --overwrite."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    shutil.rmtree(run_dir / "checkpoints")
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")
    one_line_error(code, err, f"{run_dir} finished (its results.json) and its checkpoints are gone: nothing is left to "
                   "resume from")
    code, _, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")
    one_line_error(code, err, f"{run_dir} already holds a run", "pass --overwrite to move the old run aside first")
    assert [path.name for path in tmp_path.iterdir()] == ["run"] and (run_dir / "results.json").exists()


def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_steps_left(tmp_path, capsys):
    """A checkpoint file cut short (a copy, a full disk elsewhere) or edited: its file and the other steps, which still
    load."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")[0] == 0
    step_2 = run_dir / "checkpoints" / "step_00000002"
    intact = (step_2 / "model.safetensors").read_bytes()
    (step_2 / "model.safetensors").write_bytes(intact[:100])
    for command in (["eval", run_dir, "--step", "2"], ["generate", run_dir, "3+4+5"]):
        code, _, err = run_cli(capsys, *command)
        one_line_error(code, err, f"{step_2 / 'model.safetensors'} is damaged (truncated or corrupt",
                       "(step 1): `nemo-jq eval` and `export` take one")
    (step_2 / "model.safetensors").write_bytes(intact)
    # rng.pt: inference reads none of it (it unpickled whoever's run it was, and refused intact weights without it); a
    # resume does, cut anywhere (cut mid-way torch says "[Errno 22] Invalid argument", and so did the error)
    intact = (step_2 / "rng.pt").read_bytes()
    for cut in (100, len(intact) // 2):
        (step_2 / "rng.pt").write_bytes(intact[:cut])
        code, out, _ = run_cli(capsys, "generate", run_dir, "3+4+5", "--json")
        assert code == 0 and json.loads(out)["step"] == 2
        code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")
        one_line_error(code, err, f"{step_2 / 'rng.pt'} is damaged (truncated or corrupt", "step_00000001")
    (step_2 / "rng.pt").write_bytes(intact)
    state = (step_2 / "state.json").read_text()
    for text, what in [("[]", "a JSON list"), ("{bad", "not JSON"), ("{}", "step missing"),
                       ('{"step": true, "best_step": null, "best_metric": null}', "step missing or not a number")]:
        (step_2 / "state.json").write_text(text)
        code, _, err = run_cli(capsys, "eval", run_dir)
        one_line_error(code, err, f"{step_2 / 'state.json'} is damaged ({what}", "(step 1): `nemo-jq eval` and `export` take one")
    code, out, _ = run_cli(capsys, "eval", run_dir, "--split", "validation", "--step", "1")
    assert code == 0 and json.loads(out)["step"] == 1
    (step_2 / "state.json").write_text(state)
    shutil.rmtree(run_dir / "evals")
    mkdir = Path.mkdir  # a run on a read-only mount (another user's): root cannot be refused a write, mkdir's error stands in

    def read_only(path, *args, **kwargs):
        if path.parent == run_dir:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return mkdir(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "mkdir", read_only)
        code, out, err = run_cli(capsys, "eval", run_dir, "--split", "validation", "--step", "1")
    assert code == 0 and json.loads(out)["step"] == 1 and not (run_dir / "evals").exists()
    assert f"warning: {run_dir} cannot be written (read-only file system): the evaluation is printed, not kept in its evals/" in err
    assert "wrote" not in err
    (run_dir / "evals").mkdir()  # evaluated before, then mounted read-only: an error after the printed evaluation
    write_text = Path.write_text

    def read_only_file(path, *args, **kwargs):
        if path.parent == run_dir / "evals":
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return write_text(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "write_text", read_only_file)
        code, out, err = run_cli(capsys, "eval", run_dir, "--split", "validation", "--step", "1")
    assert code == 0 and json.loads(out)["step"] == 1 and not list((run_dir / "evals").iterdir())
    assert f"warning: {run_dir} cannot be written (read-only file system): the evaluation is printed" in err
    for edit, said in ((lambda saved: {**saved, "foo": 1}, "TypeError"),  # tracebacks; no epoch resumed from epoch 0
                       (lambda saved: {key: value for key, value in saved.items() if key != "epoch"}, "KeyError: 'no epoch'"),
                       (lambda saved: {key: value for key, value in saved.items() if key != "schedule"}, "KeyError")):
        (step_2 / "state.json").write_text(json.dumps(edit(json.loads(state))))
        code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")
        one_line_error(code, err, f"{step_2 / 'state.json'} is damaged (its state.json or rng.pt does not restore the "
                       f"loop: {said}", "step_00000001")
    (step_2 / "state.json").write_text(state)
    (step_2 / "optimizer.pt").write_bytes((step_2 / "optimizer.pt").read_bytes()[:100])  # read by a resume only
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")
    one_line_error(code, err, f"{step_2 / 'optimizer.pt'} is damaged (truncated or corrupt",
                   f"write its folder's name (step_00000001) into {run_dir / 'checkpoints' / 'latest'}")
    (run_dir / "checkpoints" / "latest").write_text("step_00000001")
    assert run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")[0] == 0


def test_eval_says_what_is_missing_where_no_run_holds_a_checkpoint(tmp_path, capsys):
    """A path that is not there, or neither a run nor a checkpoint, a checkpoint copied out of its run, a run with no
    checkpoint yet, a run whose own files are damaged (its config, its splits' record: a garbled one turned the
    data-changed check off, its tokenizer: a raw JSON error or a traceback), a run without the tokenizer its
    checkpoints' token ids are of (one trained anew would stand in silently)."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    code, _, err = run_cli(capsys, "eval", tmp_path / "nowhere")
    one_line_error(code, err, f"{tmp_path / 'nowhere'} does not exist")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a.txt").write_text("hi\n")
    for path, what in (("empty", "is neither a checkpoint (no state.json) nor a run directory"), ("a.txt", "is a file")):
        code, _, err = run_cli(capsys, "eval", tmp_path / path)
        one_line_error(code, err, f"{tmp_path / path} {what}", "give the run's directory (its train.run_dir) or a checkpoint")
    damaged = tmp_path / "damaged"
    for name, text, said in (
            ("config.yaml", "", "config.yaml sets nothing"),
            ("splits.json", "garbage", "splits.json is not the splits' digests the run wrote at its start (not JSON"),
            ("splits.json", "[1]", "splits.json is not the splits' digests the run wrote at its start (it holds a JSON list"),
            ("splits.json", '{"train": 5}', "splits.json is not the splits' digests the run wrote at its start (its train is 5, "
                                           "not a digest)"),
            ("tokenizer/tokenizer.json", "garbage", "tokenizer does not load (JSONDecodeError"),
            ("tokenizer/tokenizer.json", "{}", "tokenizer does not load (KeyError: 'added_tokens')")):
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(run_dir, damaged)
        (damaged / name).write_text(text)
        generate = [] if name == "splits.json" else [["generate", damaged, "What is 2 + 3?"]]  # it reads no split
        for command in (["eval", damaged], *generate):
            code, _, err = run_cli(capsys, *command)
            one_line_error(code, err, f"{damaged / name.split('/')[0]}", said, "restore it" if "tokenizer" not in name
                           else "restore the folder from a copy of the run")
    shutil.rmtree(damaged)
    shutil.copytree(run_dir, damaged)
    code, _, err = run_cli(capsys, "eval", damaged, "--split", "validation")
    assert code == 0 and "(the latest (no validation m@4 rose above 0))" in err, err
    (damaged / "metrics.jsonl").unlink()  # which told whether it had validations
    code, _, err = run_cli(capsys, "eval", damaged, "--split", "validation")
    assert code == 0 and "(the latest (no metrics.jsonl says how its validations went))" in err, err
    copied = tmp_path / "copies" / "step_00000002"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", copied)
    for command in (["eval", copied], ["export", copied, "--out", tmp_path / "hf"]):
        code, _, err = run_cli(capsys, *command)
        one_line_error(code, err, f"{copied} is not inside a run directory (RUN/checkpoints/step_N", "give the run directory")
    unsaved = tmp_path / "unsaved"
    unsaved.mkdir()
    shutil.copy(run_dir / "config.yaml", unsaved)
    code, _, err = run_cli(capsys, "eval", unsaved)
    one_line_error(code, err, f"run {unsaved} has no checkpoint yet", f"train.run_dir={unsaved}")
    shutil.rmtree(run_dir / "tokenizer")
    code, _, err = run_cli(capsys, "eval", run_dir)
    one_line_error(code, err, f"tokenizer folder {run_dir / 'tokenizer'} is missing", "restore it")


def test_train_help_lists_every_config_key_with_its_default():
    result = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "train", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    for line in ("train.save_every = 25", "optim.lr = 0.005", "rollout.top_p = 1.0", "data.format = cold",
                 "model.tiny.hidden_size = 128", "eval.num_samples = 16"):
        assert line in result.stdout, line
    assert "one of cold, warm" in result.stdout and "--resume" in result.stdout and "--overwrite" in result.stdout


def test_data_prepare_never_writes_over_prepared_data(tmp_path, capsys):
    args = ["data", "prepare", "--dataset", "hotpotqa", "--source", FIXTURES / "hotpotqa_hf", "--sizes", "3,1,1",
            "--out", tmp_path / "out"]
    assert run_cli(capsys, *args)[0] == 0
    before = (tmp_path / "out" / "manifest.json").read_text()
    code, _, err = run_cli(capsys, *args[:-4], "--sizes", "2,1,1", "--seed", "3", "--out", tmp_path / "out")
    one_line_error(code, err, str(tmp_path / "out"), "--overwrite")
    assert (tmp_path / "out" / "manifest.json").read_text() == before
    assert run_cli(capsys, *args[:-4], "--sizes", "2,1,1", "--out", tmp_path / "out", "--overwrite")[0] == 0
    (aside,) = tmp_path.glob("out.old-*")
    assert (aside / "manifest.json").read_text() == before
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["sizes"]["train"] == 2
    mine = tmp_path / "mine"  # a folder of the user's own: the data would land among (and --overwrite move) its files
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, *args[:-1], mine)
    one_line_error(code, err, f"{mine} is not empty (notes.txt) and holds no prepared data", "give a new or empty folder")
    assert sorted(path.name for path in mine.iterdir()) == ["notes.txt"]


def test_a_stop_part_way_through_an_export_or_a_data_prepare_leaves_its_folder_as_it_was(tmp_path, capsys, monkeypatch):
    """A Ctrl-C mid-write deleted the earlier export (its files went first) or left a train.jsonl without a manifest,
    which blocked the same command next time. The stop is raised where a file is written (a real signal's moment
    cannot be chosen in a test): what the folder held is kept, nothing half-written is left beside it, and the same
    command then runs."""
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    assert run_cli(capsys, "train", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")[0] == 0
    assert run_cli(capsys, "export", run_dir, "--out", out, "--step", "1")[0] == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    write_text = Path.write_text

    def stopped_at(name):
        def write(path, *args, **kwargs):
            if path.name == name:
                raise KeyboardInterrupt
            return write_text(path, *args, **kwargs)
        return write

    monkeypatch.setattr(Path, "write_text", stopped_at("README.md"))  # the model card: the weights are written
    code, _, err = run_cli(capsys, "export", run_dir, "--out", out, "--step", "2")
    assert code == 130, err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exported", "run"]  # no .exported.partial
    monkeypatch.setattr(Path, "write_text", write_text)
    code, out_text, _ = run_cli(capsys, "export", run_dir, "--out", out, "--step", "2")
    assert code == 0 and "replacing its export of step 1" in out_text
    prepared = tmp_path / "prepared"
    args = ["data", "prepare", "--dataset", "hotpotqa", "--source", FIXTURES / "hotpotqa_hf", "--sizes", "3,1,1",
            "--out", prepared]
    monkeypatch.setattr(Path, "write_text", stopped_at("validation.jsonl"))
    assert run_cli(capsys, *args)[0] == 130
    assert not prepared.exists() and not (tmp_path / ".prepared.partial").exists()
    monkeypatch.setattr(Path, "write_text", write_text)
    assert run_cli(capsys, *args)[0] == 0 and (prepared / "manifest.json").exists()


def test_an_export_into_a_mount_point_stages_inside_it_and_a_stop_as_it_moves_in_waits_for_the_move(
        tmp_path, capsys, monkeypatch):
    """--out a mount point (a bind-mounted scratch; here its device number stands in, and a rename into it from
    beside fails as the kernel's does): the export stages inside it (the rename failed, after the earlier export's
    files were deleted, leaving a full copy beside). A Ctrl-C while the files are moved in (a real signal) takes effect
    once all are in (it left the earlier export deleted and the new one half there)."""
    import signal

    run_dir, out = tmp_path / "run", tmp_path / "mounted"
    assert run_cli(capsys, "train", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")[0] == 0
    assert run_cli(capsys, "export", run_dir, "--out", out, "--step", "1")[0] == 0
    stat, replace, moves = Path.stat, os.replace, []

    def mounted(path, *args, **kwargs):
        found = stat(path, *args, **kwargs)
        return os.stat_result((found[:2] + (found.st_dev + 1,) + found[3:])) if Path(path) == out else found

    def rename(source, target):
        if out in Path(target).parents and out not in Path(source).parents:  # into the mount point from outside it
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(source))
        moves.append(Path(target).name)
        if len(moves) == 2:
            signal.raise_signal(signal.SIGINT)
        return replace(source, target)

    monkeypatch.setattr(Path, "stat", mounted)
    monkeypatch.setattr(os, "replace", rename)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's Ctrl-C (xdist's workers ignore it)
    try:
        code, _, err = run_cli(capsys, "export", run_dir, "--out", out, "--step", "2")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130, err
    assert len(moves) > 2 and moves[-1] == "nemo_jq_export.json"  # every file moved in, the marker last
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mounted", "run"]
    assert ".partial" not in {path.name for path in out.iterdir()}
    assert json.loads((out / "nemo_jq_export.json").read_text())["source"]["step"] == 2


def test_an_out_folder_of_ones_own_in_a_folder_one_cannot_write_is_written_from_inside_it(tmp_path, capsys, monkeypatch):
    """A shared project folder the user cannot write, holding their own --out: the export stages in --out itself
    (the root user of this test cannot be refused a folder: os.access stands in for the permission), and a killed
    export's leftover there is neither a foreign file nor kept."""
    import os

    run_dir, project = tmp_path / "run", tmp_path / "project"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    (project / "mine" / ".partial").mkdir(parents=True)
    (project / "mine" / ".partial" / "model.safetensors").write_bytes(b"cut short")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != project and access(path, mode, **kw))
    assert run_cli(capsys, "export", run_dir, "--out", project / "mine")[0] == 0
    assert sorted(path.name for path in project.iterdir()) == ["mine"]  # nothing written beside it
    assert ".partial" not in {path.name for path in (project / "mine").iterdir()}
    assert (project / "mine" / "config.json").exists()


def test_prompt_options_typed_in_a_shell_keep_their_new_lines(tmp_path, capsys):
    source = tmp_path / "mine.jsonl"
    source.write_text("".join(json.dumps({"question": f"q{i}?", "answer": str(i), "context": "c"}) + "\n" for i in range(4)))
    assert run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", source, "--sizes", "2,1,1",
                   "--template", r"{context}\n\nQ: {question}", "--system", r"Digits.\tOnly.", "--out", tmp_path / "p")[0] == 0
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert (manifest["template"], manifest["system"]) == ("{context}\n\nQ: {question}", "Digits.\tOnly.")


def test_the_readme_shows_the_demo_table_ci_checks():
    from nemo_jq.recipe.demo import DEMO_RUNS, markdown_table

    readme = (ROOT / "README.md").read_text()
    header = markdown_table({}).splitlines()[0]
    assert header in readme
    table = readme[readme.index(header):].split("\n\n")[0].splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == [label for label, _, _ in DEMO_RUNS]



def test_the_demo_over_an_experiments_results_and_a_demos_resume_with_words_say_what_works(tmp_path, capsys):
    """``--demo-dir`` over an experiment's folder (its summary.json) offered `train --resume`, which fails there ("not a
    run directory"); `train --resume DEMO --quick` is refused, and its key=value words may change only how long the
    runs train, how they are evaluated and saved (tests/e2e/test_sweep.py trains on with them)."""
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    (experiment / "summary.json").write_text("{}")
    code, _, err = run_cli(capsys, "train", "--demo-dir", experiment, "--quick")
    line = one_line_error(code, err, f"{experiment} already holds an earlier demo's or an experiment's results "
                          "(summary.json): pass --demo-dir DIR for a new one, or --overwrite")
    assert "--resume" not in line and sorted(path.name for path in experiment.iterdir()) == ["summary.json"]
    from nemo_jq.recipe.demo import demo_sweep

    demo = tmp_path / "demo"
    demo_sweep(demo).write()
    record = (demo / "sweep.json").read_text()
    code, _, err = run_cli(capsys, "train", "--resume", demo, "--quick")
    assert one_line_error(code, err, f"--resume {demo} continues the demo as it started: drop --quick").endswith("--quick")
    code, _, err = run_cli(capsys, "train", "--resume", demo, "--demo-dir", tmp_path / "elsewhere")
    one_line_error(code, err, "continues the demo as it started: drop --demo-dir")
    for words in (["--requeue"], ["--demo-dir", tmp_path / "other", "--requeue"]):  # it ran the whole demo, silently
        code, _, err = run_cli(capsys, "train", *words)
        one_line_error(code, err, "the demo (no --config) continues with `nemo-jq train --resume DEMO_DIR`; drop --requeue")
    assert not (tmp_path / "other").exists()
    code, _, err = run_cli(capsys, "train", "--resume", demo, "objective.q=1")
    one_line_error(code, err, "objective.q=1 cannot change with --resume", "train.epochs, train.max_steps")
    assert (demo / "sweep.json").read_text() == record


def test_the_demos_table_shows_the_scores_its_runs_have_at_any_eval_num_samples():
    """`nemo-jq train --demo-dir D eval.num_samples=4` finished its five runs, then stopped at the table: "error: p@16"."""
    from nemo_jq.recipe.demo import format_table

    results = {"GRPO": {"test": {"p@1": 25.0, "p@4": 50.0, "m@4": 12.5}, "initial_log_p_hat": -3.0, "best_step": 8},
               "GARL q=1": {"test": {"p@1": 75.0, "p@4": 100.0, "m@4": 62.5}, "initial_log_p_hat": None, "best_step": 4}}
    lines = format_table(results, 4).splitlines()
    assert "test split, best validation m@4 checkpoint;" in lines[0] and lines[1].split()[1:4] == ["p@1", "p@4", "m@4"]
    assert lines[2].split()[1:] == ["25.0", "50.0", "12.5", "-3.00"] and lines[3].split()[2:] == ["75.0", "100.0", "62.5", "n/a"]
    # the header says what was tested: a run none of whose validations rose above 0 tests its latest checkpoint
    results["GRPO"]["best_step"] = None
    assert "best validation m@4 checkpoint, or the latest where none rose above 0;" in format_table(results, 4)
    results["GARL q=1"]["best_step"] = None
    assert "test split, latest checkpoint: no validation m@4 rose above 0;" in format_table(results, 4)

def test_a_run_that_fails_to_start_leaves_nothing_that_blocks_the_next(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *QUICK, "model.path=./no/such/model", f"train.run_dir={run_dir}")
    assert code == 2 and "no/such/model" in err
    assert not any((run_dir / name).exists() for name in ("config.yaml", "tokenizer", "checkpoints", "metrics.jsonl"))
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    assert (run_dir / "tokenizer").is_dir()


def test_a_cuda_device_without_cuda_is_one_line_and_creates_nothing(tmp_path, capsys):
    """A job submitted to a node without GPUs (or a CPU-only torch) used to end in a 41-line traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli(capsys, "train", *QUICK, "train.device=cuda", f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, "train.device=cuda but", "train.device=cpu")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- a run's folder and its checkpoints
def test_a_step_resumed_past_a_damaged_checkpoint_is_written_afresh_and_the_old_one_kept(tmp_path):
    """Resumed from step 2 (as the damaged step 4's line advises), the run reached step 4 again and found step_4 there:
    it kept the damaged folder, pointed latest at it and lost the weights it had just trained."""
    trainer = Trainer(load_config(None, [*QUICK, "train.max_steps=4", f"train.run_dir={tmp_path / 'run'}"]))
    trainer.fit()
    root = trainer.run_dir / "checkpoints"
    damaged = root / "step_00000004" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    (root / "latest").write_text("step_00000002")
    resumed = Trainer.resume(trainer.run_dir)
    resumed.fit()
    (aside,) = root.glob("step_00000004.old-*")
    assert (aside / "model.safetensors").stat().st_size == 1000  # moved aside, not deleted
    assert latest_checkpoint(root) == root / "step_00000004"
    assert load_checkpoint(root / "step_00000004", resumed.policy)[0]["step"] == 4
    resumed.save()  # a step saved twice by one run is written once
    assert len(list(root.glob("step_00000004*"))) == 2


def test_a_folder_of_ones_own_files_is_refused_not_moved_aside_as_a_failed_start(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("train:\n  max_steps: 2\n")
    (folder / "notes.txt").write_text("notes")
    code, _, err = run_cli(capsys, "train", "--config", folder / "config.yaml", *QUICK, f"train.run_dir={folder}")
    one_line_error(code, err, f"{folder} holds no run's checkpoint", "notes.txt", "config.yaml, not a run's saved config",
                   f"train.run_dir={folder / 'run'}", "--overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "notes.txt"]
    # a failed start's folder with notes added: its advice was a folder inside that start's, which is refused
    failed = tmp_path / "failed"
    code, _, _ = run_cli(capsys, "train", *QUICK, f"train.run_dir={failed}", "optim.lr=1e30", "optim.grad_clip=0")
    assert code == 2 and not (failed / "checkpoints" / "latest").exists()
    (failed / "notes.txt").write_text("notes")
    code, _, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={failed}")
    one_line_error(code, err, f"{failed} holds no run's checkpoint", "notes.txt", f"train.run_dir={tmp_path / 'failed-2'}")
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={tmp_path / 'failed-2'}")[0] == 0


def test_a_run_directory_inside_or_holding_a_run_or_the_prepared_data_is_refused_before_anything_is_written(tmp_path, capsys):
    from nemo_jq.config import save_config
    from nemo_jq.runtime.outputs import hold_run_dir

    saved = tmp_path / "saved"  # a run as its start leaves it: its whole config
    saved.mkdir()
    save_config(load_config(None, []), saved / "config.yaml")
    checkpointed = tmp_path / "checkpointed"
    (checkpointed / "checkpoints").mkdir(parents=True)
    (checkpointed / "checkpoints" / "latest").write_text("step_00000002")
    held = tmp_path / "held"  # a run loading its model: nothing in its folder but the lock it holds (until train ends)
    hold_run_dir(held)
    for outer, why in ((held, "held by pid"), (saved, "its config.yaml"), (checkpointed, "its checkpoints/latest")):
        code, _, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={outer / 'tensorboard' / 'x'}")
        one_line_error(code, err, f"is inside the run {outer} ({why}", f"(e.g. {tmp_path / 'x'})")
        assert not (outer / "tensorboard").exists()
    code, _, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={tmp_path}")
    one_line_error(code, err, f"train.run_dir={tmp_path} holds the run", "choose a train.run_dir that holds no run")
    prepared = _prepared(tmp_path / "data")
    before = {p.name: p.read_bytes() for p in prepared.iterdir()}
    for run_dir, where in ((prepared, "is"), (prepared / "run", "is inside"), (prepared.parent, "holds")):
        code, _, err = run_cli(capsys, "train", *QUICK, f"data.prepared_dir={prepared}", f"train.run_dir={run_dir}",
                               "--overwrite")
        one_line_error(code, err, f"train.run_dir={run_dir} {where} data.prepared_dir={prepared}", "outside")
    assert {p.name: p.read_bytes() for p in prepared.iterdir()} == before
    assert sorted(p.name for p in prepared.parent.iterdir()) == [prepared.name]
    # a local source likewise: --overwrite moved the user's folder, their data file in it, aside
    source = tmp_path / "mine" / "mine.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(12)))
    for run_dir, where in ((source.parent, "holds"), (source, "is")):
        code, _, err = run_cli(capsys, "train", *QUICK, "data.name=jsonl", f"data.source={source}", "data.train_size=4",
                               "data.validation_size=2", "data.test_size=2", f"train.run_dir={run_dir}", "--overwrite")
        one_line_error(code, err, f"train.run_dir={run_dir} {where} data.source={source}", "outside")
    assert sorted(p.name for p in source.parent.iterdir()) == ["mine.jsonl"]


def test_a_full_disk_as_a_run_directory_is_held_names_the_file(tmp_path, monkeypatch):
    """``[Errno 28] No space left on device`` with no path: os.write of the holder's record names no file."""
    from nemo_jq.runtime import outputs

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "write", full)
    with pytest.raises(OSError) as raised:
        outputs.hold_run_dir(tmp_path / "run")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "run" / outputs.LOCK_FILE)


def test_a_lost_or_dangling_latest_names_the_complete_checkpoints_and_never_moves_the_run(tmp_path, capsys, monkeypatch):
    """latest deleted: the run looked like a failed start, and the next start moved it aside; latest naming a deleted
    step: a line with no fix."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")[0] == 0
    root = run_dir / "checkpoints"
    (root / "latest").unlink()
    fix = (f"(steps 1, 2): `nemo-jq eval` and `export` take one with --step N; to resume from one (train --resume has no "
           f"--step), write its folder's name (step_00000002) into {root / 'latest'}")
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")
    one_line_error(code, err, f"{root / 'latest'} is missing, beside complete checkpoints", fix)
    code, _, err = run_cli(capsys, "train", "--requeue", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")
    one_line_error(code, err, f"{root / 'latest'} is missing", fix)
    code, _, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")
    one_line_error(code, err, f"{run_dir} already holds a run", "--resume")
    assert not list(tmp_path.glob("run.old-*"))
    code, out, _ = run_cli(capsys, "eval", run_dir, "--split", "validation", "--step", "1")  # as the line advises
    assert code == 0 and json.loads(out)["step"] == 1
    shutil.rmtree(root / "step_00000002")
    (root / "latest").write_text("step_00000002")
    code, _, err = run_cli(capsys, "eval", run_dir)
    one_line_error(code, err, f"names {root / 'step_00000002'}, which is not a complete checkpoint",
                   "(step 1): `nemo-jq eval` and `export` take one", f"write its folder's name (step_00000001) into {root / 'latest'}")
    (root / "latest").write_text("")  # it named the checkpoints' folder
    code, _, err = run_cli(capsys, "eval", run_dir)
    one_line_error(code, err, f"{root / 'latest'} is empty: ", "(step 1)")
    # --overwrite of the folder the command runs in, spelled ".": one line, and the run stays where it is
    monkeypatch.chdir(run_dir)
    code, _, err = run_cli(capsys, "train", *QUICK, "train.run_dir=.", "--overwrite")
    one_line_error(code, err, f"{run_dir} holds the folder this command runs in", f"cd {tmp_path}")
    assert (run_dir / "results.json").exists() and not list(tmp_path.glob("run.old-*"))


def test_the_quick_demo_has_a_folder_of_its_own(monkeypatch, capsys):
    """`train --quick` then `train` found the quick demo in runs/cold_start and advised continuing it, which reprinted
    the one-epoch table."""
    from nemo_jq.recipe import demo

    folders = []
    monkeypatch.setattr(demo, "run_demo", lambda out_dir, overrides=(), overwrite=False: folders.append(out_dir))
    assert run_cli(capsys, "train", "--quick")[0] == 0 and run_cli(capsys, "train")[0] == 0
    assert folders == [Path("runs/cold_start_quick"), Path("runs/cold_start")]


def test_a_home_folder_is_read_as_a_shell_reads_it_and_a_folder_that_is_no_run_is_placed(tmp_path, capsys, monkeypatch):
    """`train.run_dir=~/x` (quoted, or in a YAML file) trained into a folder named `~`; `--resume` of a missing folder,
    of a run's checkpoints or of a folder of runs said only "not a run directory"; `report` of a missing folder, "holds
    no run"."""
    from nemo_jq.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_config(None, ["train.run_dir=~/runs/x"]).train.run_dir == str(tmp_path / "home" / "runs" / "x")
    run = tmp_path / "sweep" / "run"
    assert run_cli(capsys, "train", *TINY_RUN, "train.max_steps=1", f"train.run_dir={run}")[0] == 0
    for folder, said in [(tmp_path / "missing", "the folder does not exist; give the run's folder"),
                         (run / "checkpoints", f"it is inside the run {run}: give that"),
                         (tmp_path / "sweep", f"it holds runs ({run}): give one of them")]:
        code, _, err = run_cli(capsys, "train", "--resume", folder)
        one_line_error(code, err, f"{folder} is not a run directory: no config.yaml", said)
    one_line_error(*run_cli(capsys, "report", tmp_path / "missing")[::2], "missing does not exist: give run folders")
    for command in (["eval", tmp_path / "sweep"], ["export", run / "config.yaml", "--out", tmp_path / "x"]):
        code, _, err = run_cli(capsys, *command)  # as --resume places them
        one_line_error(code, err, f"it holds runs ({run}): give one of them" if command[0] == "eval" else
                       f"config.yaml is a file; it is inside the run {run}: give that")
    monkeypatch.chdir(tmp_path)  # `--out=~/x`, one word: a shell leaves its ~ as it is
    assert run_cli(capsys, "export", run, "--out=~/exported")[0] == 0
    assert (tmp_path / "home" / "exported" / "model.safetensors").exists() and not (tmp_path / "~").exists()


def test_a_config_yaml_edited_since_its_checkpoints_or_a_lost_best_checkpoint_is_refused_before_anything_runs(tmp_path, capsys):
    """A checkpoint records the config it was trained with: an edited config.yaml resumed another q without a word,
    and evaluated another model's shape into a traceback. A best checkpoint deleted by hand (its end tests it) let a
    resume train every step before failing, and again on every resume."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")[0] == 0
    config = run_dir / "config.yaml"
    saved = config.read_text()
    config.write_text(saved.replace("  q: 0.75\n", "  q: 0.1\n"))
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")
    one_line_error(code, err, f"{config} says objective.q=0.1, but its checkpoint step_00000002 was trained with "
                              "objective.q=0.75: a run's config.yaml holds what it trained with; put it back")
    config.write_text(saved.replace("hidden_size: 32", "hidden_size: 64"))
    code, _, err = run_cli(capsys, "eval", run_dir)
    one_line_error(code, err, "says model.tiny.hidden_size=64, but its checkpoint step_00000002 was trained with "
                              "model.tiny.hidden_size=32")
    # a checkpoint of an earlier version, which recorded no key added since (a KeyError traceback for every old run)
    state = run_dir / "checkpoints" / "step_00000002" / "state.json"
    recorded = json.loads(state.read_text())
    config.write_text(saved)
    state.write_text(json.dumps({**recorded, "config": {**recorded["config"], "train": {
        key: value for key, value in recorded["config"]["train"].items() if key != "seed"}}}))
    code, out, _ = run_cli(capsys, "eval", run_dir, "--split", "validation")
    assert code == 0 and json.loads(out)["step"] == 2
    state.write_text(json.dumps(recorded))
    config.write_text(saved.replace("max_steps: 2", "max_steps: 3"))  # a key a resume may change, changed by hand
    code, out, _ = run_cli(capsys, "eval", run_dir, "--split", "validation", "rollout.temperature=0.5")
    assert code == 0 and json.loads(out)["step"] == 2
    sampled = json.loads(out)["sampled_with"]  # how it sampled: two reports of a checkpoint told apart
    assert (sampled["rollout.temperature"], sampled["eval.num_samples"], sampled["rollout.max_thinking_tokens"]) == (0.5, 4, 3)
    config.write_text(saved)
    latest = run_dir / "checkpoints" / "step_00000002" / "state.json"
    latest.write_text(json.dumps({**json.loads(latest.read_text()), "best_metric": 0.5, "best_step": 1}))
    weights = run_dir / "checkpoints" / "step_00000001" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short: found only when the end loaded it, the steps trained
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=4")
    one_line_error(code, err, f"the run's best checkpoint, step 1 (validation 0.5, which the run's end tests), is damaged "
                   f"({weights}: truncated or corrupt: Error while deserializing header: invalid header length)")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000001", "step_00000002"]
    shutil.rmtree(run_dir / "checkpoints" / "step_00000001")
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=4")
    one_line_error(code, err, "the run's best checkpoint, step 1 (validation 0.5, which the run's end tests), is gone",
                   f"`nemo-jq eval {run_dir} --step N`) (its checkpoints: steps 2)")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000002"]  # nothing trained
    code, _, err = run_cli(capsys, "eval", run_dir)
    one_line_error(code, err, "best checkpoint, step 1 (validation m@4 0.5), is gone", "give --step latest or --step N")
    code, out, _ = run_cli(capsys, "eval", run_dir, "--split", "validation", "--step", "latest")
    assert code == 0 and json.loads(out)["step"] == 2
    shutil.rmtree(run_dir / "evals")
    (run_dir / "evals").write_text("mine")  # said before the evaluation, not after it
    code, _, err = run_cli(capsys, "eval", run_dir, "--step", "latest")
    one_line_error(code, err, f"{run_dir / 'evals'} is a file: `nemo-jq eval` writes its reports into that folder")
    (run_dir / "checkpoints" / "step_00000002" / "model.safetensors").unlink()
    code, _, err = run_cli(capsys, "eval", run_dir, "--step", "2")
    one_line_error(code, err, f"checkpoint {run_dir / 'checkpoints' / 'step_00000002'} is missing model.safetensors: the run "
                              "holds no other")


def test_memory_that_runs_out_is_one_line_naming_the_settings_that_shrink_a_step(tmp_path, capsys):
    """The host's memory really running out (an address-space limit of 6 GB on the process; eval.num_samples of a
    billion asks 24 GB at once) was a traceback; a GPU's ``torch.OutOfMemoryError`` takes the same line."""
    import resource

    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (6 * 10**9, 6 * 10**9))  # noqa: E731 - a preexec hook
    done = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "eval", str(run_dir), "eval.num_samples=1000000000"],
                          capture_output=True, text=True, timeout=300, preexec_fn=limit, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    one_line_error(done.returncode, done.stderr, "nemo-jq eval: error: out of memory (", "can't allocate memory",
                   "lower what a step holds at once (rollout.kv_cache_tokens, train.micro_batch_rows, eval.batch_size, "
                   "eval.num_samples or rollout.num_samples); `nemo-jq dryrun --config C.yaml` finds a run's peak")
    import torch

    from nemo_jq.cli import user_error_message

    assert user_error_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")) \
        .startswith("out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.): lower what a step holds")
    # a path the command cannot write: its own option names the fix (report's said "choose another train.run_dir")
    denied = PermissionError(errno.EACCES, "Permission denied", "/sys/t.json")
    for command, fix in (("report", "another --csv, --json or --figures path"), ("train", "another train.run_dir"),
                         ("export", "another --out")):
        assert user_error_message(denied, command) == f"permission denied: /sys/t.json; make it writable or choose {fix}" \
            + " (or --demo-dir)" * (command == "train")


def test_sigterm_or_sighup_ends_a_command_in_one_line_and_a_ctrl_c_while_it_starts_leaves_no_traceback(tmp_path, capsys,
                                                                                                     monkeypatch):
    """SIGTERM and SIGHUP ended eval, generate, export and data prepare without a word (their default action); Ctrl-C
    while the command was still importing its parts printed a traceback. The signals here are real, sent by the
    process to itself where the command evaluates (a moment a test cannot choose from outside)."""
    import signal

    from nemo_jq.recipe import evaluation

    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: the command takes the signals
    ignored = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal's shell starts it (under nohup: ignored)
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP):  # raise_signal: delivered, and its handler run, before it returns
            monkeypatch.setattr(evaluation.Evaluator, "evaluate", lambda self, *a, **k: signal.raise_signal(signum))
            code, out, err = run_cli(capsys, "eval", run_dir)
            assert code == 128 + signum and out == "", (signum, code, out)
            assert err.strip().splitlines()[-1] == f"nemo-jq eval: stopped by {signal.Signals(signum).name}", err
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives as long as the command
    import nemo_jq.cli.plan

    monkeypatch.setattr(nemo_jq.cli.plan, "add_parser", lambda commands: (_ for _ in ()).throw(KeyboardInterrupt))
    code, _, err = run_cli(capsys, "plan", "--model", "8b")
    assert code == 130 and err == "nemo-jq: interrupted\n"


@pytest.mark.slow
def test_an_eval_of_a_run_moved_aside_meanwhile_files_no_report_into_the_run_there_now(tmp_path, capsys, monkeypatch):
    """An eval holds no lock on its run (it may read a run training now): `train --overwrite` moved the run aside while
    it was evaluated, and the report was filed into the new run's evals/, naming a checkpoint it does not have."""
    from nemo_jq.recipe.evaluation import Evaluator

    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    evaluate = Evaluator.evaluate

    def moved_meanwhile(self, split):
        scores = evaluate(self, split)
        run_dir.rename(tmp_path / "run.old")  # --overwrite, and a new run's start there
        (run_dir / "evals").mkdir(parents=True)
        return scores

    monkeypatch.setattr(Evaluator, "evaluate", moved_meanwhile)
    code, out, err = run_cli(capsys, "eval", run_dir, "--split", "validation")
    assert code == 0 and json.loads(out)["step"] == 2
    assert f"{run_dir} was moved while it was evaluated" in err and "printed, not kept" in err, err
    assert not list((run_dir / "evals").iterdir()) and not list((tmp_path / "run.old" / "evals").iterdir())


def test_eval_and_export_of_a_run_training_now_pick_again_the_checkpoint_it_deleted_before_they_read_it(
        tmp_path, capsys, monkeypatch):
    """A run keeps only its last train.keep_checkpoints: eval, generate and export of a run still training read a
    checkpoint it had just deleted, and said it was gone and to write another step into the live run's ``latest``.
    ``latest`` and ``best`` are picked again; a step asked for says what happened. The run saving its next step and
    deleting this one is made where the checkpoint is read (its moment cannot be chosen in a test), and the run is held
    as a training holds it."""
    from nemo_jq.runtime.outputs import hold_run_dir, release_run_dir

    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")[0] == 0
    root, load = run_dir / "checkpoints", load_checkpoint

    def moved_on(checkpoint):
        """``checkpoint``, which the run deleted once it saved the next step (made ``latest``)."""
        step = json.loads((checkpoint / "state.json").read_text())["step"] if checkpoint.exists() else None
        if step is not None:  # the run saves step + 1 and deletes this one, as its read begins
            following = root / f"step_{step + 1:08d}"
            shutil.copytree(checkpoint, following)
            state = json.loads((following / "state.json").read_text())
            (following / "state.json").write_text(json.dumps({**state, "step": step + 1}))
            (root / "latest").write_text(following.name)
            shutil.rmtree(checkpoint)
        return checkpoint

    def saved_next_and_deleted(checkpoint, *args, **kwargs):
        return load(moved_on(checkpoint), *args, **kwargs)

    hold_run_dir(run_dir)
    try:
        with monkeypatch.context() as patch:
            calls = iter([True, False])  # the first read finds its checkpoint deleted, the one picked again does not
            patch.setattr("nemo_jq.recipe.components.load_checkpoint",
                          lambda checkpoint, *a, **k: (saved_next_and_deleted if next(calls) else load)(checkpoint, *a, **k))
            code, out, err = run_cli(capsys, "eval", run_dir, "--step", "latest", "--split", "validation")
            assert code == 0 and json.loads(out)["step"] == 3, err
            patch.setattr("nemo_jq.recipe.components.load_checkpoint", saved_next_and_deleted)
            code, _, err = run_cli(capsys, "export", run_dir, "--step", "3", "--out", tmp_path / "exported")
        one_line_error(code, err, f"checkpoint {root / 'step_00000003'} was deleted before it could be read by the run "
                                  f"training in {run_dir}", "ask for --step latest or best")
        assert "write its folder's name" not in err and not (tmp_path / "exported").exists()
        # the run moves on between ``latest`` naming a checkpoint and its state being read: picked again too
        from nemo_jq.runtime import runs

        read_state = runs.read_state
        with monkeypatch.context() as patch:
            calls = iter([True])
            patch.setattr(runs, "read_state", lambda checkpoint: read_state(
                moved_on(checkpoint) if next(calls, False) else checkpoint))
            code, out, err = run_cli(capsys, "eval", run_dir, "--step", "latest", "--split", "validation")
        assert code == 0 and json.loads(out)["step"] == 5, err
    finally:
        release_run_dir(run_dir)


@pytest.mark.slow
def test_export_checks_its_out_folder_before_loading_and_keeps_a_users_folder_private(tmp_path, capsys, monkeypatch):
    """An --out it cannot write (below a file, a link to nowhere) was told after minutes of loading the model, and a
    link to nowhere left the whole export beside it; a folder of the user's made private (0o700) was opened to all."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing")
    with monkeypatch.context() as patch:
        patch.setattr("nemo_jq.cli.export.load", lambda args: pytest.fail("loaded before --out was checked"))
        code, _, err = run_cli(capsys, "export", run_dir, "--out", tmp_path / "notes.txt" / "x")
        assert code == 2 and str(tmp_path / "notes.txt") in err
        code, _, err = run_cli(capsys, "export", run_dir, "--out", tmp_path / "nowhere")
        one_line_error(code, err, f"export target {tmp_path / 'nowhere'} is a link to {tmp_path / 'missing'}, which does "
                                  "not exist")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "nowhere", "run"]
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert run_cli(capsys, "export", run_dir, "--out", private)[0] == 0
    assert (private / "model.safetensors").exists() and private.stat().st_mode & 0o777 == 0o700
