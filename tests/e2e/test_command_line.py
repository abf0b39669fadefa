"""The command line in daily use: q schedules as overrides, plain progress lines in a batch log, data preparation
that says why rows are bad, and small mistakes (a misspelt key, a closed pipe, a file as run directory) in one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.cli import main
from nemo_jq.config import load_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QUICK = [*TINY_RUN, "train.max_steps=2", "eval.every=1000"]


def test_q_schedules_from_the_command_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", *QUICK, "objective.q_schedule={name: step}", f"train.run_dir={tmp_path / 'a'}")
    one_line_error(code, err, "objective.q_schedule: q schedule 'step' needs switch_step",
                   "its keys: switch_step, q_before=1.0, q_after=0.0")
    schedule = ROOT / "configs" / "schedules" / "linear_1_to_0.yaml"
    code, _, err = run_cli(capsys, "train", *QUICK, f"objective.q_schedule={schedule}", f"train.run_dir={tmp_path / 'b'}")
    assert code == 0, err
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["q"] is None and results["q_schedule"] == {"name": "linear", "num_steps": 200, "q_start": 1.0, "q_end": 0.0}
    assert results["final_q"] == pytest.approx(1.0 - 1 / 199)  # the q of step 2 (index 1) of 0..199
    assert load_config(tmp_path / "b" / "config.yaml").objective.q_schedule == results["q_schedule"]  # inlined
    code, _, err = run_cli(capsys, "train", "--config", ROOT / "configs" / "schedules" / "adaptive.yaml")
    one_line_error(code, err, "holds a q schedule, not a run's config: pass it as objective.q_schedule=")


@pytest.mark.slow
def test_a_batch_log_gets_plain_progress_lines_and_no_warnings(tmp_path):
    """Without a terminal: no bar redrawn with carriage returns, a line per tenth of the run; no FutureWarning from
    transformers on the train and eval paths (made errors here), no Apex/TE import chatter from megatron-core."""
    run_dir = tmp_path / "run"
    train = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-m", "nemo_jq.cli", "train", *TINY_RUN,
                            "train.epochs=2", "train.max_steps=10", "eval.every=1000", f"train.run_dir={run_dir}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    assert "\r" not in train.stderr and "it/s" not in train.stderr
    lines = [line for line in train.stderr.splitlines() if line.startswith("train run:")]
    assert [line.split()[2] for line in lines] == [f"{n}/10" for n in range(1, 11)] and "loss=" in lines[-1]
    evaluate = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-m", "nemo_jq.cli", "eval", run_dir],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert evaluate.returncode == 0 and "\r" not in evaluate.stderr, evaluate.stderr[-2000:]
    megatron = subprocess.run([sys.executable, "-c", "import nemo_jq.models.megatron.policy"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert megatron.returncode == 0 and "Apex" not in megatron.stderr and "Warning" not in megatron.stderr


@pytest.mark.slow
def test_data_preparation_says_why_rows_are_bad_and_finds_official_file_names(tmp_path, capsys):
    rows = [{"id": f"q{i}", "question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(6)]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "hotpotqa", "--source", plain, "--sizes", "1,1,1",
                           "--out", tmp_path / "p")
    one_line_error(code, err, "of 6: 6 bad (6: missing field 'context'), 0 over the 4000-character cap)",
                   "every row is bad: is 'hotpotqa' the source's schema?")
    code, out, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", plain, "--sizes", "2,1,1",
                             "--out", tmp_path / "mine")
    assert code == 0 and "all: 6 rows, 0 bad, 0 over the 32000-character cap, selected" in out and "None" not in out, out
    # a prepared folder given as a raw source (docs/datasets.md's FinQA folder once was both): the fix, not the schema
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "finqa", "--source", tmp_path / "mine", "--sizes",
                           "1,1,1", "--out", tmp_path / "again")
    one_line_error(code, err, f"{tmp_path / 'mine'} is a prepared folder (nemo-jq data prepare wrote its manifest.json), "
                   f"not finqa's own files: give it as data.prepared_dir={tmp_path / 'mine'}")

    official = tmp_path / "musique_release"
    official.mkdir()
    for ours, theirs in (("train", "musique_ans_v1.0_train"), ("validation", "musique_ans_v1.0_dev")):
        shutil.copy(FIXTURES / "musique" / f"{ours}.jsonl", official / f"{theirs}.jsonl")
    code, out, err = run_cli(capsys, "data", "prepare", "--dataset", "musique", "--source", official, "--sizes", "2,1,1",
                             "--out", tmp_path / "musique")
    assert code == 0, err
    assert json.loads((tmp_path / "musique" / "manifest.json").read_text())["sources"]["train"]["file"].endswith(
        "musique_ans_v1.0_train.jsonl")

    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "hotpot", "--out", tmp_path / "x")
    one_line_error(code, err, "unknown dataset 'hotpot' (did you mean 'hotpotqa'?)")
    help_text = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "data", "prepare", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60).stdout
    assert "jsonl: Your own JSONL with question and answer (optional context, id)" in help_text
    assert "musique_ans_v1.0_dev" in help_text and "validation: dev or validation" in help_text


@pytest.mark.slow
def test_a_misspelt_key_a_closed_pipe_a_file_as_run_directory_and_a_failed_start_are_one_line_each(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_step=70")
    one_line_error(code, err, "unknown config key 'train.max_step'; did you mean 'train.max_steps'?")
    results = (run_dir / "results.json").read_text()
    code, _, err = run_cli(capsys, "train", "--resume", run_dir)  # a finished run: nothing to train, said, nothing lost
    one_line_error(code, err, "the run finished its train.max_steps=2 steps and has nothing left to train; raise "
                   f"train.max_steps (e.g. --resume {run_dir} train.max_steps=4)")
    assert (run_dir / "results.json").read_text() == results
    assert run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=42")[0] == 0  # on to the epoch's end, 6 steps
    results = (run_dir / "results.json").read_text()
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=42")
    one_line_error(code, err, "the run finished its 1 epoch (6 steps) and has nothing left to train; raise train.epochs")
    assert (run_dir / "results.json").read_text() == results
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")  # both limits: both named
    one_line_error(code, err, "the run is at step 6, at or past its train.max_steps=3 steps and its 1 epoch (6 steps): "
                   f"raise train.max_steps and train.epochs to go past step 6 (e.g. --resume {run_dir} "
                   "train.max_steps=12 train.epochs=2)")

    plan = subprocess.Popen(f"{sys.executable} -m nemo_jq.cli plan --model 8b --gpus-per-node 8 --nodes 2 | head -1",
                            shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = plan.communicate(timeout=120)
    assert len(out.splitlines()) == 1 and "Broken pipe" not in err and "Error" not in err, err

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    code, _, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={a_file}")
    one_line_error(code, err, f"{a_file} is a file, not a folder")
    assert a_file.read_text() == "mine"

    code, _, err = run_cli(capsys, "train", *QUICK, f"model.path={tmp_path / 'no_model'}", f"train.run_dir={tmp_path / 'new'}")
    assert code == 2 and not (tmp_path / "new").exists()  # a failed start leaves no run directory behind


@pytest.mark.parametrize("args, said", [
    (["sweep", "--out", "x", "objective.q=0,1", "--seeds", "0,,1"], "nemo-jq sweep: error: argument --seeds: "),
    (["plan", "--gpus-per-node", "0"], "nemo-jq plan: error: argument --gpus-per-node: must be a whole number >= 1"),
    (["train", "--nope"], "nemo-jq train: error: unrecognized arguments: --nope (see nemo-jq train --help)"),
    (["bogus"], "nemo-jq: error: argument command: invalid choice: 'bogus'"),
    # the overrides, optional, were named as required beside what is
    (["experiment"], "nemo-jq experiment: error: the following arguments are required: name (see"),
    (["eval"], "nemo-jq eval: error: the following arguments are required: checkpoint (see"),
    # Path("") is the current folder: --source "$DATA" with DATA unset read it
    (["data", "prepare", "--dataset", "jsonl", "--source", "", "--sizes", "5,2,2", "--out", "x"],
     "nemo-jq data prepare: error: argument --source: is empty (an unset shell variable?)"),
    (["export", "run", "--out", " "], "nemo-jq export: error: argument --out: is empty (an unset shell variable?)"),
    # an option of one value given twice: argparse kept the last, and the first config's keys went unread, unsaid
    (["train", "--config", "a.yaml", "--config", "b.yaml"],
     "nemo-jq train: error: --config given twice (a.yaml, then b.yaml): give it once (see nemo-jq train --help)"),
    (["sweep", "--out", "x", "--config", "a.yaml", "--config", "b.yaml", "objective.q=0,1"],
     "nemo-jq sweep: error: --config given twice (a.yaml, then b.yaml): give its values after one (--config a.yaml b.yaml)")])
def test_a_bad_argument_is_one_line_without_the_usage_block(capsys, args, said):
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith(said), err


def test_overrides_after_an_option_of_several_values_are_overrides(monkeypatch):
    """The experiments' READMEs give ``--seeds 1 2 3 guard.enabled=true``: argparse took the override as a fourth seed
    (and ``sweep --config A.yaml objective.q=0,1`` as a second config). Each value list stops at an override word."""
    import nemo_jq.experiments.escape_rates as escape_rates
    import nemo_jq.experiments.noisy_cold_start as noisy_cold_start
    import nemo_jq.runtime.sweep as sweep

    seen = []
    for module in (noisy_cold_start, escape_rates):
        monkeypatch.setattr(module, "run_experiment", lambda out, seeds, *rest, **options: seen.append((seeds, options)))
    for page, start in (("noisy_cold_start", "nemo-jq experiment noisy-cold-start --seeds 1 2 3 guard"),
                        ("escape_rates", "nemo-jq experiment escape-rates --methods")):
        line = next(line for line in (ROOT / "docs" / "results" / page / "README.md").read_text().splitlines()
                    if line.startswith(start))
        assert main(line.split("#")[0].split()[1:]) == 0
    assert seen[0][0] == [1, 2, 3] and seen[0][1]["overrides"] == ["guard.enabled=true"]
    assert seen[1][0] == [0] and seen[1][1]["widths"] == [3, 4] and seen[1][1]["overrides"] == ["optim.eps=1e-16"]
    main(["experiment", "escape-rates", "a.b=1", "--widths", "2", "c.d=2", "--quick", "e.f=3"])
    assert seen[2][1]["widths"] == [2] and seen[2][1]["overrides"] == ["a.b=1", "c.d=2", "e.f=3"]  # as given

    def grid(directory, configs, words, seeds):
        seen.append((configs, words))
        raise ValueError("stop here")

    monkeypatch.setattr(sweep.Sweep, "from_grid", grid)
    assert main(["sweep", "--out", "x", "--config", "a.yaml", "b.yaml", "objective.q=0,1"]) == 2
    assert seen[-1] == (["a.yaml", "b.yaml"], ["objective.q=0,1"])
    assert main(["sweep", "--out", "x", "--config", "a.yaml", "plugins=[p.py]", "objective.q=0,1"]) == 2
    assert seen[-1] == (["a.yaml"], ["plugins=[p.py]", "objective.q=0,1"])  # plugins= was swept as a second config


def test_a_path_that_is_not_what_a_command_wants_is_named_with_the_fix(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "figures.txt"
    a_file.write_text("mine")
    code, _, err = run_cli(capsys, "theory", "--out", a_file)
    one_line_error(code, err, f"--out {a_file} is a file: give a folder")
    assert a_file.read_text() == "mine"
    notes = tmp_path / "notes"  # a folder of the person's own, holding a theory.json theory did not write
    notes.mkdir()
    (notes / "theory.json").write_text('{"mine": 1}')
    code, _, err = run_cli(capsys, "theory", "--out", notes)
    one_line_error(code, err, f"--out {notes} holds theory.json, which is no earlier report of nemo-jq theory")
    assert (notes / "theory.json").read_text() == '{"mine": 1}' and not (notes / "escape_time.png").exists()
    for _ in range(2):  # its own earlier report is written over
        assert run_cli(capsys, "theory", "--out", tmp_path / "theory")[0] == 0
    # a stop while it writes (here Ctrl-C in the plot) leaves --out as it was: it held theory.json without the plot
    import nemo_jq.theory.report

    monkeypatch.setattr(nemo_jq.theory.report, "plot_escape_times", lambda path: (_ for _ in ()).throw(KeyboardInterrupt))
    assert run_cli(capsys, "theory", "--out", tmp_path / "stopped")[0] == 130
    assert not (tmp_path / "stopped").exists() and not (tmp_path / ".stopped.partial").exists()
    # dryrun --json never replaces a user's file (here the config itself), nor waits for the dry run to find a
    # missing folder (tests/unit/dryrun/test_dryrun.py writes over its own earlier report)
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  max_steps: 1\n")
    for target, reason in [(config, "exists and is not an earlier dry run's JSON report"),
                           (tmp_path / "missing" / "dry.json", "does not exist: create it")]:
        with pytest.raises(SystemExit) as refused:
            main(["dryrun", "--config", str(config), "--json", str(target)])
        assert refused.value.code == 2 and reason in capsys.readouterr().err
    assert config.read_text() == "train:\n  max_steps: 1\n"
    with pytest.raises(SystemExit) as refused:
        main(["generate", str(tmp_path), "3 + 4", "--seed", str(2**64)])
    assert refused.value.code == 2 and "argument --seed: must be a whole number from 0 to 4294967295" in capsys.readouterr().err


def test_a_batch_larger_than_the_training_split_is_said(tmp_path, capsys):
    """train.batch_size=100 over 24 prompts trained 24 a step without a word, its config.yaml saying 100."""
    code, _, err = run_cli(capsys, "train", *QUICK, "train.batch_size=100", "train.max_steps=1",
                           f"train.run_dir={tmp_path / 'run'}")
    assert code == 0 and "warning: train.batch_size=100 is more than the 24 training prompts: each step takes all of " \
        "them (an epoch a step)" in err, err
    code, _, err = run_cli(capsys, "train", *QUICK, "train.max_steps=1", f"train.run_dir={tmp_path / 'fits'}")
    assert code == 0 and "train.batch_size" not in err, err


def test_auto_row_chunks_are_resolved_said_and_saved(tmp_path, capsys):
    """``train.micro_batch_rows=auto``: `nemo-jq train` resolves it once the run is built (on the CPU, or for a model
    built from scratch, whole groups: the memory model sizes a Qwen3 on a GPU), says so, and saves the number it
    trained with; a Trainer not told how to resolve it refuses in one line."""
    from nemo_jq.config import ConfigError
    from nemo_jq.recipe.trainer import Trainer

    run_dir = tmp_path / "auto"
    code, out, err = run_cli(capsys, "train", *QUICK, "train.micro_batch_rows=auto", f"train.run_dir={run_dir}")
    assert code == 0, err
    assert "nemo-jq train: train.micro_batch_rows=auto: whole groups (the CPU: the memory model sizes a Qwen3 on a GPU)" in out
    assert load_config(run_dir / "config.yaml", saved=True).train.micro_batch_rows is None
    with pytest.raises(ConfigError, match="train.micro_batch_rows=auto is resolved by `nemo-jq train`"):
        Trainer(load_config(None, [*QUICK, "train.micro_batch_rows=auto", f"train.run_dir={tmp_path / 'api'}"]))
    assert not (tmp_path / "api").exists()  # refused before anything was claimed
