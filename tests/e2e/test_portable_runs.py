"""A run directory is portable: a run resumes and evaluates from another working directory and after a move."""

import json
import shutil
from pathlib import Path

import pytest

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.config import load_config
from nemo_jq.runtime.monitor import read_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QUICK = [*TINY_RUN, "train.max_steps=2", "eval.every=1000"]


@pytest.mark.slow
def test_a_run_resumes_and_evaluates_from_another_directory_and_after_a_move(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    monkeypatch.chdir(work)
    assert run_cli(capsys, "data", "prepare", "--dataset", "hotpotqa", "--source", FIXTURES / "hotpotqa_hf",
                   "--sizes", "3,2,2", "--out", "data/mine")[0] == 0
    assert run_cli(capsys, "train", *QUICK, "data.prepared_dir=data/mine", "train.epochs=2", "train.batch_size=1",
                   "train.micro_batch_size=1", "train.run_dir=runs/r")[0] == 0
    monkeypatch.chdir(tmp_path)  # elsewhere: the saved config names the data by its absolute path
    code, _, err = run_cli(capsys, "train", "--resume", "work/runs/r", "train.max_steps=3")
    assert code == 0, err
    moved = shutil.move(work / "runs" / "r", tmp_path / "moved")  # as clusters move scratch to project space
    code, out, err = run_cli(capsys, "eval", moved, "--split", "validation")
    assert code == 0 and json.loads(out)["run_dir"] == str(moved), err
    code, _, err = run_cli(capsys, "train", "--resume", moved, "train.max_steps=4")
    assert code == 0, err
    assert load_config(Path(moved) / "config.yaml").train.run_dir == str(moved)
    assert [r["step"] for r in read_metrics(moved) if r["kind"] == "train"] == [1, 2, 3, 4]

    shutil.move(work / "data", tmp_path / "archived")  # the data purged from scratch: only eval reads it
    code, _, err = run_cli(capsys, "eval", moved)
    one_line_error(code, err, f"{work / 'data' / 'mine'} does not exist")
    code, _, err = run_cli(capsys, "train", "--resume", moved, "train.max_steps=5")  # a fix that --resume can take
    one_line_error(code, err, f"data.prepared_dir={work / 'data' / 'mine'}, which is gone", "move the prepared folder "
                   f"back there, or set data.prepared_dir in {Path(moved) / 'config.yaml'} to where it is now")
    config = (Path(moved) / "config.yaml").read_text()
    (Path(moved) / "config.yaml").write_text(config.replace(str(work / "data" / "mine"), str(tmp_path / "archived" / "mine")))
    code, _, err = run_cli(capsys, "train", "--resume", moved, "train.max_steps=5")
    assert code == 0, err
    code, out, err = run_cli(capsys, "generate", moved, "Which city is the capital of France?")
    assert code == 0 and "Traceback" not in err, err
    (Path(moved) / "results.json").write_text('{"objective": "garl", "te')  # cut short: only its card's test line
    code, _, err = run_cli(capsys, "export", moved, "--out", tmp_path / "exported")
    assert code == 0 and err.count("\n") == 1 and f"warning: {moved}/results.json is not a finished run's results" in err, err
    assert (tmp_path / "exported" / "model.safetensors").exists()
