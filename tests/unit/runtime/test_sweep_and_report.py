"""A sweep's grid, its folder and its runs' states; the report's table, interval and collapse flag on run folders
written by hand (what a finished run leaves: config.yaml, results.json, metrics.jsonl). The sweep run, stopped and
resumed, and the report of real runs: tests/e2e/test_sweep.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from doc_pages import ROOT

from helpers import one_line_error, run_cli
from nemo_jq.config import ConfigError, load_config, save_config
from nemo_jq.runtime import report
from nemo_jq.runtime.checkpoint import STATE
from nemo_jq.runtime.sweep import FINISHED, NEW, STOPPED, Sweep, split_words


def test_a_grid_is_configs_times_swept_values_times_seeds_each_run_named_by_what_it_sweeps(tmp_path):
    sweep = Sweep.from_grid(tmp_path / "s", [], ["train.max_steps=4", "objective.name=garl,grpo", "objective.q=0,1"],
                            [0, 1])
    assert [run.name for run in sweep.runs][:3] == ["name=garl_q=0_seed=0", "name=garl_q=0_seed=1",
                                                   "name=garl_q=1_seed=0"]
    assert len(sweep.runs) == 8 and sweep.runs[0].config is None
    assert sweep.runs[1].overrides == ("train.max_steps=4", "objective.name=garl", "objective.q=0", "train.seed=1")
    assert sweep.runs[1].train_words(tmp_path / "s") == ["train", "--requeue", "train.max_steps=4", "objective.name=garl",
                                                         "objective.q=0", "train.seed=1",
                                                         f"train.run_dir={tmp_path / 's' / 'name=garl_q=0_seed=1'}"]
    twins = Sweep.from_grid(tmp_path / "t", [], ["rollout.temperature=1,0.5", "eval.temperature=0.6"], None)
    assert [run.name for run in twins.runs] == ["temperature=1", "temperature=0.5"]  # one swept key: its last part
    twins = Sweep.from_grid(tmp_path / "t", [], ["rollout.temperature=1,0.5", "eval.temperature=0,0.6"], None)
    assert twins.runs[1].name == "rollout.temperature=1_eval.temperature=0.6"  # was temperature=1_temperature=0.6
    configs = Sweep.from_grid(tmp_path / "c", ["configs/a.yaml", "configs/b.yaml"], [], None)
    assert [(run.name, run.config, run.overrides) for run in configs.runs] == [("a", "configs/a.yaml", ()),
                                                                               ("b", "configs/b.yaml", ())]


def test_a_sweep_record_cut_short_by_a_full_disk_leaves_the_last_one_and_names_the_file(tmp_path, monkeypatch):
    """sweep.json was written in place: a full disk part-way left a cut record, which every later --resume and report
    refused (and the error, "[Errno 28] No space left on device", named no file)."""
    import errno

    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.q=0,1"], None)
    sweep.write()
    before = (tmp_path / "s" / "sweep.json").read_text()

    def full_disk(path, text, *args, **kwargs):
        with open(path, "w") as f:
            f.write(text[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    sweep.here["parallel"] = 3
    with pytest.raises(OSError, match="No space left on device") as raised:
        sweep.save()
    monkeypatch.undo()
    assert raised.value.filename == str(tmp_path / "s" / "sweep.json")
    assert (tmp_path / "s" / "sweep.json").read_text() == before and Sweep.load(tmp_path / "s").runs == sweep.runs


def test_a_finished_run_whose_checkpoints_were_deleted_is_still_finished(tmp_path):
    """Checkpoints are deleted to free the disk once runs finish (8B ones are ~100 GB each): the report left such a run
    out as unfinished, and `sweep --resume` moved it aside and trained it again from the start."""
    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.q=0,1", "train.max_steps=1"], None)
    sweep.write()
    for run in sweep.runs:
        finished_run(tmp_path / "s" / run.name, q=float(run.name.split("=")[1]))
        results = json.loads((tmp_path / "s" / run.name / "results.json").read_text())
        (tmp_path / "s" / run.name / "results.json").write_text(json.dumps({**results, "step": 1}))  # as runs write it
    assert [sweep.status(run) for run in sweep.runs] == [FINISHED, FINISHED]
    assert [row["n"] for row in report.report([tmp_path / "s"])["rows"]] == [1, 1]


def test_a_run_trained_over_replicas_is_finished_at_the_steps_its_trainer_counts_over_them(tmp_path, capsys):
    """An epoch's short last batch with fewer prompts than the replicas is skipped (PromptStream): the trainer counted
    192 steps for the 8B paper config at DP >= 2 where the sweep (and plan) counted 194, so a sweep never took such
    a run for finished: each --resume launched it again (a job that loads the model to say it has finished)."""
    from nemo_jq.runtime.sweep import steps_of

    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.q=0,1", "data.train_size=9", "train.batch_size=4",
                                                 "train.epochs=2"], None)
    sweep.write()
    assert [steps_of(load_config(None, list(sweep.runs[0].overrides)), replicas) for replicas in (1, 2, 4)] == [6, 4, 4]
    for run, replicas in zip(sweep.runs, (2, None)):  # the second saved before checkpoints named their replicas
        folder = finished_run(tmp_path / "s" / run.name, q=float(run.name.split("=")[1]), overrides=run.overrides)
        (folder / "results.json").write_text(json.dumps({**json.loads((folder / "results.json").read_text()), "step": 4}))
        (folder / "checkpoints" / "step_00000004").mkdir(parents=True)
        (folder / "checkpoints" / "step_00000004" / STATE).write_text(json.dumps(
            {"step": 4, "best_step": None, "best_metric": None, **({"replicas": replicas} if replicas else {})}))
        (folder / "checkpoints" / "latest").write_text("step_00000004")
    assert [sweep.status(run) for run in sweep.runs] == [FINISHED, STOPPED]  # one replica: 2 epochs of 3 batches
    with pytest.raises(ConfigError, match="is at step 4, beyond the 2 steps train.epochs=1 gives it"):  # 2 replicas
        sweep.go_on_with(["train.epochs=1"])


def test_a_sweeps_runs_read_the_copy_of_its_config_files_taken_at_its_start(tmp_path, monkeypatch):
    """A sweep's runs read its --config files as they were when it started (DIR/configs/): the runs read the files
    themselves, so an edit made while the sweep ran (a researcher tuning the next sweep) trained the runs not started
    yet with other settings than the rest, took finished runs for unfinished, and read from another folder (report),
    a relative path named no file and every run with results was finished whatever its config said."""
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    monkeypatch.chdir(project)
    for name in ("a", "b"):
        (project / "configs" / f"{name}.yaml").write_text(f"# {name}\ntrain:\n  max_steps: 4\n")
    sweep = Sweep.from_grid(Path("s"), ["configs/a.yaml", "configs/b.yaml"], ["objective.q=0,1"], None)
    sweep.write()
    assert (project / "s" / "configs" / "a.yaml").read_text() == "# a\ntrain:\n  max_steps: 4\n"
    loaded = Sweep.load(project / "s")
    assert [(run.name, run.config, run.config_copy) for run in loaded.runs][::2] == [
        ("a_q=0", "configs/a.yaml", "configs/a.yaml"), ("b_q=0", "configs/b.yaml", "configs/b.yaml")]
    assert loaded.runs[0].train_words(project / "s")[2:4] == ["--config", str(project / "s" / "configs" / "a.yaml")]
    run_dir = project / "s" / loaded.runs[0].name
    finished_run(run_dir, q=0.0)
    (run_dir / "results.json").write_text(json.dumps({**json.loads((run_dir / "results.json").read_text()), "step": 4}))
    (run_dir / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000004" / STATE).write_text(json.dumps({"step": 4, "best_step": None,
                                                                               "best_metric": None}))
    (run_dir / "checkpoints" / "latest").write_text("step_00000004")
    (project / "configs" / "a.yaml").write_text("train:\n  max_steps: 8\n  epochs: 9\n")  # edited for the next sweep
    assert loaded.status(loaded.runs[0]) == FINISHED
    assert [(config.train.max_steps, config.train.epochs) for config in loaded.check()][0] == (4, 8)
    monkeypatch.chdir(tmp_path)  # report, from another folder: the same verdict
    assert Sweep.load(project / "s").status(loaded.runs[0]) == FINISHED
    (project / "s" / "configs" / "a.yaml").write_text("train:\n  max_steps: 8\n")  # the sweep's own copy is what counts
    assert Sweep.load(project / "s").status(loaded.runs[0]) == STOPPED
    with pytest.raises(ValueError, match="run logs would be named as the sweep's own folder logs/: rename its config"):
        Sweep.from_grid(tmp_path / "t", ["x/logs.yaml", "x/other.yaml"], [], None)


def test_the_words_of_a_sweep_are_checked_in_one_line():
    assert split_words(["a.b=1", "c.d=x,y", "e.f=[1,2]"]) == (["a.b=1", "e.f=[1,2]"], {"c.d": ["x", "y"]})
    for words, fragment in ((["q"], "section.key=value"), (["a.b=1", "a.b=2"], "a.b is given twice"),
                            (["a.b=1,"], "an empty value")):
        with pytest.raises(ValueError, match=fragment):
            split_words(words)


def test_a_sweep_folder_records_its_grid_refuses_a_second_sweep_and_knows_each_runs_state(tmp_path, capsys):
    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.name=garl,grpo", "train.max_steps=4"], None)
    sweep.write()
    loaded = Sweep.load(tmp_path / "s")
    assert loaded.runs == sweep.runs and loaded.grid["axes"] == {"objective.name": ["garl", "grpo"]}
    code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", "objective.name=garl,grpo")
    one_line_error(code, err, "already holds a sweep", f"nemo-jq sweep --resume {tmp_path / 's'}", "--overwrite")
    garl, grpo = sweep.runs
    assert sweep.status(garl) == NEW
    (tmp_path / "s" / garl.name / "results.json").parent.mkdir(parents=True)
    (tmp_path / "s" / garl.name / "results.json").write_text("{}")
    (tmp_path / "s" / grpo.name / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "s" / grpo.name / "checkpoints" / "step_00000004" / STATE).write_text(
        json.dumps({"step": 4, "best_step": None, "best_metric": None}))
    (tmp_path / "s" / grpo.name / "checkpoints" / "latest").write_text("step_00000004")
    assert (sweep.status(garl), sweep.status(grpo)) == (FINISHED, STOPPED)
    # results of an earlier step (a run stopped in its end's evaluation after a resume): its resume evaluates again
    (tmp_path / "s" / grpo.name / "results.json").write_text(json.dumps({"step": 3}))
    assert sweep.status(grpo) == STOPPED
    (tmp_path / "s" / grpo.name / "results.json").write_text(json.dumps({"step": 4}))
    assert sweep.status(grpo) == FINISHED
    (tmp_path / "s" / grpo.name / "results.json").write_text('{"step": 4')  # cut short: its resume evaluates again
    assert sweep.status(grpo) == STOPPED
    (tmp_path / "s" / grpo.name / "results.json").write_text(json.dumps({"objective": "grpo", "test": {"p@1": 0.0},
                                                                          "step": 4}))
    save_config(load_config(None, list(grpo.overrides)), tmp_path / "s" / grpo.name / "config.yaml")
    assert report.read_run(tmp_path / "s" / grpo.name) is not None
    code, _, err = run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--seeds", "1")
    one_line_error(code, err, "--resume continues a sweep as its sweep.json records it: drop --out, --config, --seeds")
    sweep.go_on_with(["train.epochs=1"])  # the epochs' end is past step 4, and train.max_steps=4 still ends it there
    assert "gives 2 finished run(s) no more steps" in capsys.readouterr().err and sweep.status(sweep.runs[1]) == FINISHED
    sweep.go_on_with(["train.max_steps=6"])  # given more steps, a finished run trains on
    assert Sweep.load(tmp_path / "s").runs[1].overrides == ("objective.name=grpo", "train.epochs=1", "train.max_steps=6")
    assert sweep.status(grpo) == FINISHED and sweep.status(sweep.runs[1]) == STOPPED
    assert report.read_run(tmp_path / "s" / grpo.name) is None  # the report: unfinished, as the sweep decides
    axis = Sweep.from_grid(tmp_path / "axis", [], ["eval.every=2,4"], None)
    axis.write()
    record = (tmp_path / "axis" / "sweep.json").read_text()
    with pytest.raises(ConfigError, match="the sweep's runs differ in eval.every"):  # both would train at 8, named 2 and 4
        axis.go_on_with(["eval.every=8"])
    assert (tmp_path / "axis" / "sweep.json").read_text() == record
    code, _, err = run_cli(capsys, "sweep", "--resume", tmp_path / "nothing")
    one_line_error(code, err, "holds no sweep")


def test_a_resumed_sweep_runs_as_many_at_once_with_as_many_threads_as_it_was_started_with(tmp_path, capsys,
                                                                                          monkeypatch):
    from nemo_jq.runtime import sweep as sweeps

    asked = []
    monkeypatch.setattr(sweeps, "run_here", lambda sweep, **how: asked.append(how))
    monkeypatch.setattr("nemo_jq.cli.report.print_report", lambda *_, **__: 0)
    assert run_cli(capsys, "sweep", "--out", tmp_path / "s", "--parallel", "2", "--threads", "3", "objective.q=0,1")[0] == 0
    assert run_cli(capsys, "sweep", "--resume", tmp_path / "s")[0] == 0
    assert run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--parallel", "1")[0] == 0  # said again: as said
    assert asked == [{"parallel": 2, "threads": 3}] * 2 + [{"parallel": 1, "threads": 3}]
    assert run_cli(capsys, "sweep", "--out", tmp_path / "t", "objective.q=0,1")[0] == 0
    # threads: the free cores, when it runs; started_in: where its runs' relative paths are read
    assert Sweep.load(tmp_path / "t").here == {"parallel": None, "threads": None, "started_in": str(Path.cwd())}


def test_a_resumed_sweep_is_submitted_with_the_sbatch_options_and_cap_it_was_submitted_with(tmp_path, capsys, monkeypatch):
    """`sweep --resume DIR --slurm` forgot --parallel (no %N cap: every task at once) and --sbatch (one GPU a task, the
    partition's default time limit) of the first submission."""
    submitted = []

    def submit_sweep(sweep, options, parallel):  # a stand-in for sbatch's: it saves sweep.json, as the real one does
        submitted.append((options, parallel))
        sweep.save()

    monkeypatch.setattr("nemo_jq.cluster.launch.submit_sweep", submit_sweep)
    first = ["--sbatch=--time=08:00:00", "--sbatch=--gpus-per-node=8", "--parallel", "2"]
    assert run_cli(capsys, "sweep", "--out", tmp_path / "s", "--slurm", *first, "objective.q=0,1")[0] == 0
    assert run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--slurm")[0] == 0
    assert run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--slurm", "--parallel", "1")[0] == 0  # said again
    assert submitted == [(["--time=08:00:00", "--gpus-per-node=8"], 2)] * 2 + [(["--time=08:00:00", "--gpus-per-node=8"], 1)]
    assert run_cli(capsys, "sweep", "--out", tmp_path / "local", "objective.q=0,1", "--slurm")[0] == 0
    assert submitted[-1] == ([], None)  # no cap where none was asked for


def test_a_bad_key_or_value_in_a_sweep_is_refused_naming_the_run_before_its_folder_is_written(tmp_path, capsys):
    for words, fragments in ((["objective.qq=0,1"], ["run qq=0", "objective.qq", "did you mean 'objective.q'"]),
                             (["objective.q=", "train.seed=1,2"], ["run seed=1", "'objective.q=' gives objective.q no value"]),
                             (["objective.q=0,x"], ["run q=x", "objective.q must be float; got 'x'"])):
        code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", *words)
        line = one_line_error(code, err, *fragments)
        assert line.count("nemo-jq") == 1 and not (tmp_path / "s").exists(), line


def test_a_sweep_whose_data_its_runs_would_refuse_is_refused_naming_the_run_before_its_folder_is_written(tmp_path,
                                                                                                           capsys):
    """The runs' splits are built first where the files are here (the synthetic task, a local source): a split larger
    than the data failed inside every run before, the sweep saying only "run 1/2 FAILED"."""
    source = tmp_path / "mine.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                              for i in range(12)))
    local = ["data.name=jsonl", f"data.source={source}", "data.validation_size=2", "data.test_size=2"]
    for words, fragments in ((["objective.q=0,1", "data.train_size=1200"], ["run q=0", "1392 distinct examples",
                                                                             "only 1000 exist"]),
                             ([*local, "data.train_size=4,20"], ["run train_size=20", str(source)])):
        code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", *words)
        line = one_line_error(code, err, *fragments)
        assert not (tmp_path / "s").exists(), line
    assert Sweep.from_grid(tmp_path / "s", [], [*local, "data.train_size=4,8"], None).write() is None


def test_inline_q_schedules_are_swept_whole(tmp_path):
    """docs/sweeps.md's two inline schedules: the commas inside braces are the schedule's own."""
    one = "{name: linear, num_steps: 200, q_start: 1, q_end: 0}"
    two = "{name: linear, num_steps: 200, q_start: 1, q_end: 0.5}"
    assert f'"objective.q_schedule={one},{two}"' in " ".join((ROOT / "docs" / "sweeps.md").read_text().split())
    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.name=garl", f"objective.q_schedule={one},{two}"], None)
    assert [run.name for run in sweep.runs] == ["q_schedule=name-linear-num_steps-200-q_start-1-q_end-0",
                                                "q_schedule=name-linear-num_steps-200-q_start-1-q_end-0.5"]
    assert [load_config(None, list(run.overrides)).objective.q_schedule["q_end"] for run in sweep.runs] == [0, 0.5]
    assert split_words([f"objective.q_schedule={one}", "data.system_prompt='a, b','c'", "data.template=don't,do"]) == (
        [f"objective.q_schedule={one}"], {"data.system_prompt": ["'a, b'", "'c'"], "data.template": ["don't", "do"]})


def test_swept_paths_name_runs_by_their_last_parts_and_values_that_would_share_a_folder_are_refused(tmp_path, capsys):
    import sys

    from nemo_jq.runtime.sweep import run_here

    models = Sweep.from_grid(tmp_path / "m", [], ["model.path=Qwen/Qwen3-0.6B,Qwen/Qwen3-1.7B", "train.max_steps=1"], None)
    assert [run.name for run in models.runs] == ["path=Qwen3-0.6B", "path=Qwen3-1.7B"]
    assert models.runs[0].overrides == ("train.max_steps=1", "model.path=Qwen/Qwen3-0.6B")
    models.write()  # each run's log is made (a stand-in for `nemo-jq train` that exits at once)
    run_here(models, threads=1, say=lambda _: None, python=(sys.executable, "-c", "pass"))
    assert sorted(path.name for path in (tmp_path / "m" / "logs").iterdir()) == ["path=Qwen3-0.6B.log", "path=Qwen3-1.7B.log"]
    local = Sweep.from_grid(tmp_path / "l", ["a/x.yaml", "b/x.yaml"], ["model.path=/data/a/model,/data/b/model/",
                                                                     "data.name=my set:1,two"], None)
    assert local.runs[0].name == "a-x_path=a-model_name=my-set-1"
    code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", "data.name=a b,a:b")
    one_line_error(code, err, "data.name=a b and data.name=a:b would name one run folder (name=a-b)", "--out")
    code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", f"objective.q=0.{'1' * 260},0.2")
    one_line_error(code, err, "would have a name of 264 bytes, longer than a file name may be (251)")
    assert not (tmp_path / "s").exists()


def test_a_value_given_twice_is_refused_naming_it_before_anything_is_written(tmp_path, capsys):
    for words, fragment in ((["--seeds", "0,0"], "--seeds: 0 is given twice, which would train one run twice: drop one"),
                            (["objective.q=0,0"], "objective.q: 0 is given twice"),
                            (["objective.q=0.5,.5"], "objective.q: 0.5 and .5 are the same"),
                            (["optim.lr=1e-3,0.001"], "optim.lr: 1e-3 and 0.001 are the same"),  # as the config reads them
                            (["--config", "configs/a.yaml", "./configs/a.yaml"],
                             "--config: configs/a.yaml and ./configs/a.yaml are the same")):
        code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", *words)
        one_line_error(code, err, fragment)
        assert not (tmp_path / "s").exists()


def test_sweep_out_refuses_a_run_folder_as_train_does(tmp_path, capsys, monkeypatch):
    from nemo_jq.runtime import sweep as sweeps

    monkeypatch.setattr(sweeps, "run_here", lambda *_, **__: None)
    monkeypatch.setattr("nemo_jq.cli.report.print_report", lambda *_, **__: 0)
    run = finished_run(tmp_path / "run")
    code, _, err = run_cli(capsys, "sweep", "--out", run, "objective.q=0,1")
    one_line_error(code, err, f"{run} already holds a run (config.yaml, results.json, metrics.jsonl)", "--overwrite")
    assert not (run / "sweep.json").exists()
    assert run_cli(capsys, "sweep", "--out", run, "--overwrite", "objective.q=0,1")[0] == 0
    (aside,) = tmp_path.glob("run.old-*")
    assert (aside / "results.json").exists() and (run / "sweep.json").exists()


def test_a_sweep_record_edited_or_cut_short_is_refused_in_one_line_by_resume_task_and_report(tmp_path, capsys,
                                                                                              monkeypatch):
    from nemo_jq.runtime import sweep as sweeps

    monkeypatch.setattr(sweeps, "run_here", lambda *_, **__: None)  # a record that loads would run: it must not load
    Sweep.from_grid(tmp_path / "s", [], ["objective.q=0,1"], None).write()
    record = json.loads((tmp_path / "s" / "sweep.json").read_text())
    broken = {'{"grid": {': "not JSON: Expecting property name", "": "it is empty", "[]": "it holds [], not an object",
              '{"grid": {}}': "no list of runs", '{"runs": {"a": 1}}': "no list of runs",
              json.dumps({**record, "runs": [{"name": "../x", "config": None, "overrides": []}]}): "run 0 is not",
              json.dumps({**record, "runs": record["runs"] * 2}): "two runs share a name"}
    for text, wrong in broken.items():
        (tmp_path / "s" / "sweep.json").write_text(text)
        for words in (["sweep", "--resume"], ["sweep", "--index", "0", "--task"], ["report"]):
            code, _, err = run_cli(capsys, *words, tmp_path / "s")
            one_line_error(code, err, f"{tmp_path / 's' / 'sweep.json'} is not a sweep record ({wrong}",
                           "): restore it or start a new sweep with --out")
    for here, wrong in (({"parallel": "two"}, "here.parallel is 'two'"), ({"parallel": -1}, "here.parallel is -1"),
                        ({"parallel": 1, "threads": 0}, "here.threads is 0")):
        (tmp_path / "s" / "sweep.json").write_text(json.dumps({**record, "here": here}))
        code, _, err = run_cli(capsys, "sweep", "--resume", tmp_path / "s")
        one_line_error(code, err, f"({wrong}, not a whole number >= 1)")


def test_a_sweep_task_names_a_slurm_array_task_id_that_is_no_run_of_it(tmp_path, capsys, monkeypatch):
    Sweep.from_grid(tmp_path / "s", [], ["objective.q=0,1"], None).write()
    for task, fragment in (("abc", "SLURM_ARRAY_TASK_ID is 'abc', not a run's place in the sweep"),
                           ("7", f"SLURM_ARRAY_TASK_ID=7: {tmp_path / 's'} holds runs 0 to 1")):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
        code, _, err = run_cli(capsys, "sweep", "--task", tmp_path / "s")
        one_line_error(code, err, fragment)


def test_a_run_that_fails_stops_the_sweep_in_one_line_naming_its_log(tmp_path):
    import sys

    from nemo_jq.runtime.sweep import RunFailed, run_here

    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.name=garl,grpo"], None)
    sweep.write()
    lines = []
    with pytest.raises(RunFailed) as failed:  # a stand-in for `nemo-jq train` that exits 3 (the sweep's logic is real)
        run_here(sweep, threads=1, say=lines.append, python=(sys.executable, "-c", "import sys; sys.exit(3)"))
    message = str(failed.value)
    assert message.startswith("run name=garl failed (exit 3)"), message
    assert "nemo-jq" not in message.split("`")[0] and f"nemo-jq sweep --resume {tmp_path / 's'}" in message
    assert any("FAILED (exit 3)" in line for line in lines)
    assert "grpo" not in message  # no further run started after the failure
    # a start that failed before its first checkpoint goes last on --resume: its own value may fail every time
    from nemo_jq.runtime.runs import failed_start

    failed_run = tmp_path / "s" / "name=garl"
    failed_run.mkdir(exist_ok=True)
    save_config(load_config(None, ["objective.name=garl"]), failed_run / "config.yaml")
    assert failed_start(failed_run)
    with pytest.raises(RunFailed) as failed:
        run_here(sweep, threads=1, say=lines.append, python=(sys.executable, "-c", "import sys; sys.exit(3)"))
    assert str(failed.value).startswith("run name=grpo failed (exit 3)") and "the runs that have not failed first" in \
        str(failed.value)


def test_a_run_that_failed_after_its_first_checkpoint_goes_last_on_resume(tmp_path):
    """Only a run that failed before its first checkpoint went last: one failing at a later step (a schedule, a
    divergence) was continued first by every --resume, failed again, and the runs after it never started."""
    import sys

    from nemo_jq.runtime.sweep import RunFailed, run_here

    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.name=garl,grpo"], None)
    sweep.write()
    checkpoint = tmp_path / "s" / "name=garl" / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE).write_text(json.dumps({"step": 4, "best_step": None, "best_metric": None}))
    (checkpoint.parent / "latest").write_text(checkpoint.name)
    fails, ends = (sys.executable, "-c", "import sys; sys.exit(3)"), (sys.executable, "-c", "pass")
    with pytest.raises(RunFailed, match="^run name=garl failed"):
        run_here(sweep, threads=1, say=lambda _: None, python=fails)
    assert Sweep.load(tmp_path / "s").here["failed"] == ["name=garl"]
    with pytest.raises(RunFailed, match="^run name=grpo failed"):
        run_here(Sweep.load(tmp_path / "s"), threads=1, say=lambda _: None, python=fails)
    run_here(Sweep.load(tmp_path / "s"), threads=1, say=lambda _: None, python=ends)  # both went on: neither is listed
    assert Sweep.load(tmp_path / "s").here["failed"] == []


@pytest.mark.slow  # 7 s: two runs' progress
def test_the_first_progress_line_comes_once_each_running_runs_step_rate_is_measured(tmp_path):
    import sys

    from nemo_jq.runtime.monitor import duration
    from nemo_jq.runtime.sweep import run_here, steps_words

    assert (duration(40), duration(600), duration(4 * 3600)) == ("40 s", "10 min", "4.0 h")
    assert (steps_words({"a": 96, "b": 96}), steps_words({"a": 96, "b": 768}), steps_words({"a": None})) == (
        "; 96 steps each", "; 96 to 768 steps a run", "")
    # a stand-in for `nemo-jq train` that logs a step every 0.3 s (the sweep's reading of them is the real one)
    script = ("import json, sys, time, pathlib\n"
              "run = pathlib.Path(sys.argv[-1].split('=', 1)[1]); run.mkdir(parents=True, exist_ok=True)\n"
              "for step in range(1, 25):\n"
              "    with open(run / 'metrics.jsonl', 'a') as f: f.write(json.dumps({'kind': 'train', 'step': step}) + '\\n')\n"
              "    time.sleep(0.3)\n"
              "(run / 'results.json').write_text('{}')\n")
    sweep = Sweep.from_grid(tmp_path / "s", [], ["train.max_steps=24"], None)
    sweep.write()
    lines = []
    run_here(sweep, threads=1, say=lines.append, report_every=600, python=(sys.executable, "-c", script))
    assert "1 to start; 24 steps each)" in lines[0]
    progress = [index for index, line in enumerate(lines) if line.startswith("sweep: run step ")]
    assert progress and progress[0] < next(i for i, line in enumerate(lines) if "finished in" in line), lines
    assert "/24 (" in lines[progress[0]] and " s left)" in lines[progress[0]], lines
    # resumed: its log holds 12 steps of an earlier life when it starts, and it takes 1.5 s to start up; the rate is
    # its own steps' (~3.3/s), not the earlier life's last step to its first new one across the start-up (0.7/s)
    resumed = Sweep.from_grid(tmp_path / "r", [], ["train.max_steps=24"], None)
    resumed.write()
    (tmp_path / "r" / resumed.runs[0].name).mkdir()
    (tmp_path / "r" / resumed.runs[0].name / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": step}) + "\n" for step in range(1, 13)))
    lines = []
    run_here(resumed, threads=1, say=lines.append, report_every=600,
             python=(sys.executable, "-c", "import time; time.sleep(1.5)\n" + script.replace("range(1, 25)", "range(13, 25)")))
    rate = float(next(line for line in lines if line.startswith("sweep: run step ")).split(" (")[1].split(" steps/s")[0])
    assert 2.0 < rate < 4.5, lines


def test_one_q_schedule_spelt_two_ways_is_one_row(tmp_path, capsys):
    """``q_start: 1`` and ``q_start: 1.0`` are one schedule (a sweep refuses them as one run twice): two rows, each
    n=1, where the seeds were of one setting."""
    runs = tmp_path / "runs"
    for seed, start in ((0, "1"), (1, "1.0")):
        schedule = f"{{name: linear, num_steps: 6, q_start: {start}, q_end: 0}}"
        run = finished_run(runs / f"seed{seed}", seed=seed, overrides=[f"objective.q_schedule={schedule}"],
                           test={"p@1": 10.0 * (seed + 1)})
        results = json.loads((run / "results.json").read_text())
        results["q_schedule"] = {"name": "linear", "num_steps": 6, "q_start": float(start), "q_end": 0}
        (run / "results.json").write_text(json.dumps(results))
    code, out, _ = run_cli(capsys, "report", runs)
    assert code == 0 and "| GARL q linear(num_steps=6, q_start=1, q_end=0) | 2 | 15.0 ± " in out, out


def finished_run(folder, *, name="garl", q=0.5, seed=0, dataset="synthetic", test=None, validation=(10.0, 20.0),
                 overrides=()):
    """A run folder as a finished run leaves it, written by hand."""
    folder.mkdir(parents=True)
    save_config(load_config(None, [f"objective.name={name}", f"objective.q={q}", f"train.seed={seed}",
                                   f"data.name={dataset}", *overrides]), folder / "config.yaml")
    results = {"objective": name, "q": q if name != "grpo" else None, "best_step": 2, "best_validation": max(validation),
               "test": test or {"p@1": 1.0, "p@16": 2.0, "m@16": 3.0}}
    (folder / "results.json").write_text(json.dumps(results))
    records = [{"kind": "train", "step": 1, "log_p_hat": -20.0, "p_hat": 0.0, "q": q},
               *({"kind": "validation", "step": 2 * (i + 1), "m@16": value} for i, value in enumerate(validation))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def test_the_table_is_the_mean_and_a_t_interval_over_seeds_flags_a_peak_before_collapse_and_leaves_out_unfinished(
        tmp_path, capsys):
    for seed, p1 in enumerate([10.0, 20.0, 30.0]):
        finished_run(tmp_path / "runs" / f"garl_{seed}", seed=seed, test={"p@1": p1, "p@16": 50.0, "m@16": 5.0},
                     validation=(10.0, 0.0) if seed == 2 else (10.0, 20.0))
    finished_run(tmp_path / "runs" / "grpo_0", name="grpo", test={"p@1": 1.0, "p@16": 4.0, "m@16": 0.5})
    (tmp_path / "runs" / "unfinished").mkdir()
    save_config(load_config(None, []), tmp_path / "runs" / "unfinished" / "config.yaml")
    result = report.report([tmp_path / "runs"], figures=tmp_path / "figures")
    garl, grpo = result["rows"]
    # by hand: mean 20, sample sd 10, t(0.975, 2) = 4.302653, half-width 4.302653 * 10 / sqrt(3) = 24.84
    assert (garl["method"], garl["n"], garl["seeds"], garl["p@1"], garl["p@1 ±"]) == ("GARL q=0.5", 3, [0, 1, 2], 20.0, 24.84)
    assert garl["p@16 ±"] == 0.0 and garl["collapsed_after_peak"] == 1
    assert (grpo["method"], grpo["n"], grpo["p@1"], grpo["p@1 ±"], grpo["collapsed_after_peak"]) == ("GRPO", 1, 1.0, None, 0)
    assert result["unfinished"] == [str(tmp_path / "runs" / "unfinished")]
    text = report.markdown(result["rows"])
    assert "| GARL q=0.5 † (1/3) | 3 | 20.0 ± 24.8 | 50.0 ± 0.0 | 5.0 ± 0.0 |" in text and "| GRPO | 1 | 1.0 | 4.0 | 0.5 |" in text
    assert "† peak before collapse" in text
    assert report.csv_text(result["rows"]).splitlines()[1].startswith("synthetic,cold,GARL q=0.5,3,0 1 2,1,0,20.0,24.84")
    (figure,) = result["figures"]
    assert figure.endswith("curves_synthetic.png") and (tmp_path / "figures" / "curves_synthetic.png").stat().st_size > 10_000
    code, out, _ = run_cli(capsys, "report", tmp_path / "runs", "--json", tmp_path / "t.json")
    assert code == 0 and "not finished (left out)" in out and json.loads((tmp_path / "t.json").read_text())["rows"][0]["n"] == 3
    code, _, err = run_cli(capsys, "report", tmp_path / "runs" / "unfinished")
    one_line_error(code, err, "has finished")


def test_report_finds_the_runs_anywhere_below_a_folder_as_an_experiment_leaves_them(tmp_path):
    finished_run(tmp_path / "exp" / "q=0.5" / "seed0", test={"p@1": 1.0, "p@16": 2.0, "m@16": 3.0})
    finished_run(tmp_path / "exp" / "q=0.5" / "seed1", seed=1, test={"p@1": 3.0, "p@16": 4.0, "m@16": 5.0})
    finished_run(tmp_path / "exp" / "q=1" / "seed0", q=1.0)
    (tmp_path / "exp" / "q=1" / "seed0" / "checkpoints" / "step_1").mkdir(parents=True)  # inside a run: not searched
    # what --overwrite moved aside is not a seed more (unless given itself)
    finished_run(tmp_path / "exp" / "q=0.5" / "seed0.old-20261129-101500", test={"p@1": 9.0, "p@16": 9.0, "m@16": 9.0})
    finished_run(tmp_path / "exp.old-20261129-101500-2" / "q=0.5" / "seed0")
    assert report.run_dirs([tmp_path / "exp" / "q=0.5" / "seed0.old-20261129-101500"]) == [
        tmp_path / "exp" / "q=0.5" / "seed0.old-20261129-101500"]
    assert report.run_dirs([tmp_path]) == [tmp_path / "exp" / "q=0.5" / "seed0", tmp_path / "exp" / "q=0.5" / "seed1",
                                           tmp_path / "exp" / "q=1" / "seed0"]
    assert report.run_dirs([tmp_path / "exp"]) == [tmp_path / "exp" / "q=0.5" / "seed0",
                                                   tmp_path / "exp" / "q=0.5" / "seed1", tmp_path / "exp" / "q=1" / "seed0"]
    rows = report.report([tmp_path / "exp"])["rows"]
    assert [(row["method"], row["n"], row["p@1"]) for row in rows] == [("GARL q=0.5", 2, 2.0), ("GARL q=1", 1, 1.0)]


def test_a_run_that_ends_at_its_best_or_never_scores_is_not_flagged(tmp_path):
    rising = report.read_run(finished_run(tmp_path / "a", validation=(0.0, 5.0, 5.0)))
    zero = report.read_run(finished_run(tmp_path / "b", validation=(0.0, 0.0)))
    fallen = report.read_run(finished_run(tmp_path / "c", validation=(0.0, 5.0, 0.0)))
    assert (rising.collapsed_after_peak, zero.collapsed_after_peak, fallen.collapsed_after_peak) == (False, False, True)
    assert report.seed_stats([2.0, None]) == {"mean": 2.0, "sd": None, "n": 1, "ci95": None}
    assert report.seed_stats([None]) == {"mean": None, "sd": None, "n": 0, "ci95": None}
    two = report.seed_stats([1.0, 3.0])  # sd sqrt(2), t(0.975, 1) = 12.7062: half-width 12.7062 * sqrt(2) / sqrt(2)
    assert (two["mean"], two["n"]) == (2.0, 2) and math.isclose(two["sd"], math.sqrt(2))
    assert math.isclose(two["ci95"], 12.706204736 * math.sqrt(2) / math.sqrt(2))


def test_a_full_disk_in_a_resumes_cut_or_a_figure_leaves_the_runs_history_and_no_partial_file(tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl and samples.jsonl to its step, and a run or the demo writes its figure: a full
    disk (or a kill) part-way left the history cut short, or a figure half-written, where the earlier files stand."""
    import errno

    import matplotlib.figure

    from nemo_jq.runtime import outputs
    from nemo_jq.runtime.monitor import RunLogger, plot_runs, read_metrics

    run = finished_run(tmp_path / "run")
    (run / "samples.jsonl").write_text(json.dumps({"step": 2, "question": "1+1"}) + "\n")
    before = {name: (run / name).read_text() for name in ("metrics.jsonl", "samples.jsonl")}

    def full_disk(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs, "fsync", full_disk)
    with pytest.raises(OSError):
        RunLogger(run, tensorboard=False, resume_step=1)
    assert {name: (run / name).read_text() for name in before} == before
    monkeypatch.undo()

    def half_written(self, path, **_):
        Path(path).write_bytes(b"\x89PNG")
        full_disk()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_written)
    with pytest.raises(OSError):
        plot_runs({"run": read_metrics(run)}, tmp_path / "figure.png")
    assert not list(tmp_path.glob("figure.png*"))


def test_a_metrics_line_cut_short_at_the_end_is_left_out_as_a_resumed_run_drops_it_and_a_bad_line_elsewhere_is_named(
        tmp_path, capsys):
    from nemo_jq.runtime.monitor import RunLogger, read_metrics

    run = finished_run(tmp_path / "run")
    whole = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(whole + '{"kind": "train", "st')  # a run killed mid-write, or being written
    assert read_metrics(run) == [json.loads(line) for line in whole.splitlines()]
    assert run_cli(capsys, "report", run)[0] == 0
    (run / "samples.jsonl").write_text(json.dumps({"step": 2, "question": "Infinity"}) + '\n{"step": 3, "quest')
    RunLogger(run, tensorboard=False, resume_step=4).close("finished")  # `train --resume` from step 4 rewrites both without it
    assert (run / "metrics.jsonl").read_text() == whole
    assert (run / "samples.jsonl").read_text() == json.dumps({"step": 2, "question": "Infinity"}) + "\n"
    lines = whole.splitlines(keepends=True)
    for bad, wrong in (('{"kind": "train", "st\n', "not JSON: Unterminated string starting at, column 19"),
                       ('{"step": 1}\n', "no 'kind'"), ("[1]\n", "not a JSON object"),
                       # what the report reads, edited: a traceback in its statistics or its figures
                       ('{"kind": "validation", "step": 2, "m@16": "x"}\n', "m@16 is 'x', not a number"),
                       ('{"kind": "train", "step": 1, "log_p_hat": "x"}\n', "log_p_hat is 'x', not a number"),
                       ('{"kind": "train", "step": "a"}\n', "its step is 'a'")):
        (run / "metrics.jsonl").write_text("".join([lines[0], bad, *lines[1:]]))
        code, _, err = run_cli(capsys, "report", run)
        one_line_error(code, err, f"{run / 'metrics.jsonl'} line 2 is not a record the run logged ({wrong}): repair "
                                  "that line or delete it")


def test_a_results_file_cut_short_or_edited_is_named_in_one_line_and_a_score_no_seed_has_is_a_dash(tmp_path, capsys):
    run = finished_run(tmp_path / "run")
    for text, wrong in (('{"objective": "garl", "te', "not JSON: Unterminated string"), ("", "it is empty"),
                        ('{"test": {}}', "no objective"), ('{"objective": "garl", "test": [1, 2]}', "no test scores"),
                        ('{"objective": "garl", "q": "x", "test": {}}', "q is 'x', not a number"),
                        ('{"objective": "garl", "test": {"p@1": [1]}}', "test p@1 is [1], not a number"),
                        # a traceback from the report's statistics; a table of no scores; a row of its own, unnamed
                        ('{"objective": "garl", "test": {"p@1": NaN, "p@4": 1.0, "m@4": 1.0}}', "test p@1 is nan, not"),
                        ('{"objective": "garl", "test": {"p@1": "Infinity", "p@4": 1, "m@4": 1}}', "test p@1 is inf"),
                        ('{"objective": "garl", "test": {}}', "no test scores"),
                        ('{"objective": "garl", "test": {"p@1": 1.0, "m@16": 1.0}}', "test m@16 without p@16"),
                        ('{"objective": "garl", "test": {"p@16": 1.0, "m@16": 1.0}}', "no test p@1")):
        (run / "results.json").write_text(text)
        code, _, err = run_cli(capsys, "report", run)
        one_line_error(code, err, f"{run / 'results.json'} is not a finished run's results ({wrong}",
                       f"restore it, or move it aside and `nemo-jq train --resume {run}` writes it again")
    (run / "results.json").write_text(json.dumps({"objective": "garl", "q": 0.5, "test": {"p@1": None, "p@16": None,
                                                                                          "m@16": 3.0}}))
    code, out, _ = run_cli(capsys, "report", run)
    assert code == 0 and "| GARL q=0.5 | 1 | — | — | 3.0 |" in out, out


def test_a_score_some_seeds_lack_says_how_many_seeds_its_mean_is_over(tmp_path, capsys):
    """Three seeds, one without p@16 (null): the row's n stays 3, the p@16 cell and the JSON say its mean is over 2."""
    for seed, pk in enumerate([10.0, 30.0, None]):
        finished_run(tmp_path / "runs" / f"garl_{seed}", seed=seed, test={"p@1": 1.0, "p@16": pk, "m@16": 3.0})
    code, out, _ = run_cli(capsys, "report", tmp_path / "runs", "--json", tmp_path / "t.json")
    row = json.loads((tmp_path / "t.json").read_text())["rows"][0]
    assert code == 0 and "| GARL q=0.5 | 3 | 1.0 ± 0.0 | 20.0 ± 127.1 (2 of 3) | 3.0 ± 0.0 |" in out, out
    assert row["n"] == 3 and row["p@16"] == 20.0 and row["p@16 n"] == 2 and "p@1 n" not in row and "m@16 n" not in row


def test_runs_evaluated_at_another_k_are_rows_and_tables_of_their_own(tmp_path, capsys):
    finished_run(tmp_path / "runs" / "k16", test={"p@1": 1.0, "p@16": 2.0, "m@16": 3.0})
    finished_run(tmp_path / "runs" / "k4", seed=1, test={"p@1": 4.0, "p@4": 5.0, "m@4": 6.0})
    finished_run(tmp_path / "runs" / "grpo_k4", name="grpo", test={"p@1": 7.0, "p@4": 8.0, "m@4": 9.0})
    code, out, _ = run_cli(capsys, "report", tmp_path / "runs", "--csv", tmp_path / "t.csv")
    assert code == 0, out
    assert "| method | n | p@1 | p@16 | m@16 |\n| --- | --- | --- | --- | --- |\n| GARL q=0.5 | 1 | 1.0 | 2.0 | 3.0 |" in out
    assert "| method | n | p@1 | p@4 | m@4 |\n| --- | --- | --- | --- | --- |\n| GRPO | 1 | 7.0 | 8.0 | 9.0 |\n| GARL q=0.5 " in out
    assert (tmp_path / "t.csv").read_text().splitlines()[2:] == ["synthetic,cold,GARL q=0.5,1,0,0,0,1.0,,,,,,2.0,,3.0,",
                                                                 "synthetic,cold,GARL q=0.5,1,1,0,0,4.0,,5.0,,6.0,,,,,"]


def test_the_reports_heading_says_which_checkpoint_its_runs_tested():
    """Every run's validation stayed at 0, so each tested its latest checkpoint: the heading said best-validation."""
    rows = [{"dataset": "synthetic", "format": "cold", "method": "GARL", "n": 2, "seeds": [0, 1], "collapsed_after_peak": 0,
             "tested_latest": latest, "p@1": 1.0, "p@1 ±": None} for latest in (2, 1)]
    assert "(test, latest checkpoint: no validation rose above 0;" in report.markdown(rows[:1])
    assert "(test, best-validation checkpoint, or the latest where no validation rose above 0;" in report.markdown(rows)
    assert "(test, best-validation checkpoint;" in report.markdown([{**rows[0], "tested_latest": 0}])


def test_a_run_given_twice_is_read_once_and_two_runs_of_one_seed_are_said(tmp_path, capsys):
    finished_run(tmp_path / "runs" / "a")
    rows = report.report([tmp_path / "runs", tmp_path / "runs" / "a", tmp_path / "runs" / ".." / "runs" / "a"])["rows"]
    assert [(row["n"], row["seeds"]) for row in rows] == [(1, [0])]
    finished_run(tmp_path / "runs" / "b")
    rows = report.report([tmp_path / "runs"])["rows"]
    assert [(row["n"], row["seeds"]) for row in rows] == [(2, [0, 0])]
    assert capsys.readouterr().err == (f"nemo-jq: warning: {tmp_path / 'runs' / 'a'}, {tmp_path / 'runs' / 'b'} (GARL "
                                       "q=0.5, synthetic) share train.seed=0: each is counted as a seed of its own\n")


def test_report_writes_its_tables_over_nothing_but_its_own_earlier_tables_and_checks_where_before_it_reads(tmp_path,
                                                                                                        capsys):
    run = finished_run(tmp_path / "run")
    config = (run / "config.yaml").read_text()
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    (tmp_path / "folder").mkdir()
    for words, fragments in (
            (["--csv", run / "config.yaml"], ["config.yaml is a run's or a sweep's own file", "table.csv"]),
            (["--json", tmp_path / "results.json"], ["results.json is a run's or a sweep's own file"]),
            (["--json", tmp_path / "notes.json"], ["exists and is not an earlier table nemo-jq report wrote",
                                                   "left as it is"]),
            (["--csv", tmp_path / "folder"], [f"--csv: {tmp_path / 'folder'} is a folder: give the path of a file in it"]),
            (["--csv", tmp_path / "no" / "t.csv"], [f"the folder {tmp_path / 'no'} does not exist", "mkdir -p"]),
            (["--csv", tmp_path / "t", "--json", tmp_path / "t"], ["--csv and --json both name"]),
            (["--figures", run / "config.yaml"], ["is a file: give a folder"])):
        code, out, err = run_cli(capsys, "report", run, *words)
        one_line_error(code, err, *fragments)
        assert out == "", out  # refused before the table is made
    assert (run / "config.yaml").read_text() == config and (tmp_path / "notes.json").read_text() == '{"mine": 1}'
    (tmp_path / "empty.csv").touch()
    for _ in range(2):  # an empty file, then the table it was given, is written over
        assert run_cli(capsys, "report", run, "--csv", tmp_path / "empty.csv", "--json", tmp_path / "t.json")[0] == 0
    assert json.loads((tmp_path / "t.json").read_text())["rows"][0]["n"] == 1


def checkpoint_at(run, step):
    """A checkpoint of ``run`` at ``step``, ``latest`` naming it, as training leaves one (its state only)."""
    folder = run / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / STATE).write_text(json.dumps({"step": step, "best_step": None, "best_metric": None}))
    (run / "checkpoints" / "latest").write_text(folder.name)


def test_a_run_resumed_after_its_results_is_unfinished_in_the_report_as_in_its_sweep(tmp_path, capsys):
    """`train --resume RUN train.epochs=200` stopped at step 76: its results.json is step 6's, no longer its end's."""
    done, resumed = finished_run(tmp_path / "runs" / "done"), finished_run(tmp_path / "runs" / "resumed", seed=1)
    for run in (done, resumed):
        (run / "results.json").write_text(json.dumps({**json.loads((run / "results.json").read_text()), "step": 6}))
    checkpoint_at(done, 6)
    checkpoint_at(resumed, 76)
    result = report.report([tmp_path / "runs"])
    assert result["unfinished"] == [str(resumed)] and result["runs"] == [str(done)]
    assert [(row["n"], row["seeds"]) for row in result["rows"]] == [(1, [0])]
    code, _, err = run_cli(capsys, "report", resumed)
    one_line_error(code, err, "none of the 1 runs", "has finished")


def test_runs_that_differ_in_more_than_their_seeds_are_rows_of_their_own_labelled_by_what_tells_them_apart(tmp_path,
                                                                                                        capsys):
    runs = tmp_path / "runs"
    unseen = ["tracking.mlflow=true", "train.save_every=10", "eval.samples_shown=2", "train.micro_batch_rows=2"]
    for seed in (0, 1):  # an experiment's seeds: the data split's too; keys that change nothing a run computes
        finished_run(runs / f"lr=0.001_seed={seed}", seed=seed, overrides=["optim.lr=1e-3", f"data.seed={seed}",
                                                                            *(unseen if seed else [])],
                     test={"p@1": 10.0 + seed})
    finished_run(runs / "lr=0.05_seed=0", overrides=["optim.lr=5e-2"], test={"p@1": 30.0})
    finished_run(runs / "lr=0.05_epochs=2", overrides=["optim.lr=5e-2", "train.epochs=2"], test={"p@1": 40.0})
    for seed, q in ((0, 0.5), (1, 1.0)):  # a key GRPO does not read tells nothing apart: one row, its seeds
        finished_run(runs / f"grpo_q={q}", name="grpo", q=q, seed=seed, test={"p@1": 50.0})
    code, out, _ = run_cli(capsys, "report", runs, "--csv", tmp_path / "t.csv", "--json", tmp_path / "t.json")
    assert code == 0, out
    labels = ["GRPO", "GARL q=0.5 optim.lr=0.001 train.epochs=8", "GARL q=0.5 optim.lr=0.05 train.epochs=2",
              "GARL q=0.5 optim.lr=0.05 train.epochs=8"]  # in the order the runs come (folder names)
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [(row["method"], row["n"], row["p@1"]) for row in rows] == list(zip(labels, [2, 2, 1, 1],
                                                                               [50.0, 10.5, 40.0, 30.0]))
    assert "| GARL q=0.5 optim.lr=0.001 train.epochs=8 | 2 | 10.5 ± 6.3 |" in out and "| GRPO | 2 | 50.0 ± 0.0 |" in out
    assert [line.split(",")[2] for line in (tmp_path / "t.csv").read_text().splitlines()[1:]] == labels


def test_a_figure_draws_a_line_per_table_row_labelled_by_what_tells_it_apart(tmp_path):
    """Cold and warm starts, and runs evaluated at another k, are rows of their own: their curves too (they were one
    line, averaged together); the format and k join a label only where the dataset's rows differ in them."""
    runs = tmp_path / "runs"
    for seed in (0, 1):
        finished_run(runs / f"cold_{seed}", seed=seed)
    finished_run(runs / "warm", overrides=["data.format=warm"])
    finished_run(runs / "k4", test={"p@1": 1.0, "p@4": 2.0, "m@4": 3.0})
    result = report.report([runs], figures=tmp_path / "figures")
    lines = report.curve_lines(report.told_apart([report.read_run(run) for run in sorted(runs.iterdir())]))
    assert {label: len(members) for label, members in lines.items()} == {
        "GARL q=0.5 cold k=16": 2, "GARL q=0.5 cold k=4": 1, "GARL q=0.5 warm k=16": 1}
    assert len(result["rows"]) == 3 and (tmp_path / "figures" / "curves_synthetic.png").stat().st_size > 10_000
    same = report.curve_lines(report.told_apart([report.read_run(runs / f"cold_{seed}") for seed in (0, 1)]))
    assert list(same) == ["GARL q=0.5"]


def test_a_sweep_refuses_the_keys_it_sets_itself_and_options_that_would_do_nothing(tmp_path, capsys):
    for words, fragments in (
            (["train.seed=5", "--seeds", "0,1"], ["train.seed: --seeds sets train.seed for each run"]),
            (["train.seed=5,6", "--seeds", "0,1"], ["train.seed: --seeds sets train.seed for each run"]),
            ([f"train.run_dir={tmp_path / 'x'}"], ["train.run_dir: the sweep sets train.run_dir for each of its runs"]),
            (["train.run_dir=foo,bar", "objective.q=0,1"], ["train.run_dir: the sweep sets train.run_dir"]),
            (["objective.q=0,1", "--sbatch=--time=1:00:00"], ["--sbatch=--time=1:00:00 is an option of --slurm's",
                                                              "add --slurm"]),
            (["objective.q=0,1", "--index", "0"], ["--index 0 picks the run of --task SWEEP_DIR", "drop --index"]),
            (["objective.q=0,1", "--slurm", "--threads", "2"], ["--threads shares this machine's cores", "drop --threads"])):
        code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", *words)
        one_line_error(code, err, *fragments)
        assert not (tmp_path / "s").exists() and not (tmp_path / "x").exists()
    Sweep.from_grid(tmp_path / "s", [], ["objective.q=0,1"], None).write()
    code, _, err = run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--index", "0")
    one_line_error(code, err, "--index 0 picks the run of --task SWEEP_DIR")
    code, _, err = run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--sbatch=--partition=gpu")
    one_line_error(code, err, "add --slurm, or drop --sbatch")


def test_a_sweep_slurm_refuses_leaves_no_folder_and_parallel_caps_the_array(tmp_path, capsys, monkeypatch):
    """A stand-in ``sbatch`` (the real one runs in tests/distributed/test_slurm_launch.py): a refused array left
    DIR/sweep.json, so the same command, fixed, was refused as "already holds a sweep"; without sbatch the line blamed
    a path; ``--parallel`` with ``--slurm`` did nothing (now the array's ``%N``)."""
    import os
    import stat

    tools = tmp_path / "bin"
    tools.mkdir()
    sbatch = tools / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", "objective.q=0,1", "--slurm", "--sbatch=--partition=gpu")
    one_line_error(code, err, "sbatch refused the sweep's array (sbatch: error: invalid partition specified: gpu)")
    assert not (tmp_path / "s").exists()
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho 41\n")
    assert run_cli(capsys, "sweep", "--out", tmp_path / "s", "objective.q=0,1", "--slurm", "--parallel", "1")[0] == 0
    assert "--array=0,1%1 " in (tmp_path / "args").read_text() and (tmp_path / "s" / "sweep.json").exists()
    # while that array is queued (a stand-in squeue shows it) no second one, no run here, no --overwrite: a second
    # array ran the same runs beside the first; one left behind --overwrite ran the new sweep's
    squeue = tools / "squeue"
    squeue.write_text("#!/bin/sh\necho 41\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    for words in (["--resume", tmp_path / "s", "--slurm"], ["--resume", tmp_path / "s"],
                  ["--out", tmp_path / "s", "--overwrite", "objective.q=0,2", "--slurm"]):
        code, _, err = run_cli(capsys, "sweep", *words)
        one_line_error(code, err, f"{tmp_path / 's'}'s job array 41 is still queued or running (squeue -j 41): wait for "
                                  "it to end, or `scancel 41` first")
    squeue.write_text("#!/bin/sh\n")  # it has ended
    # from another folder: each task works from the one the sweep was started in, and finds it there by its
    # relative path (a host's absolute path is none in the task's container, whose working folder is that one's mount)
    started = Path.cwd()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--slurm")[0] == 0
    words = (tmp_path / "args").read_text().split()
    task = (tmp_path / "s").relative_to(started) if (tmp_path / "s").is_relative_to(started) else tmp_path / "s"
    assert f"--chdir={started}" in words and words[-3:] == ["sweep", "--task", str(task)], words
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    code, _, err = run_cli(capsys, "sweep", "--resume", tmp_path / "s", "--slurm")
    one_line_error(code, err, "sbatch, which is not on this machine's PATH: run it on the cluster's login node")
    assert (tmp_path / "s" / "sweep.json").exists()  # a resumed sweep's record stays
    # --overwrite moved the sweep aside before its new array was refused, and left it there, the folder empty
    record = (tmp_path / "s" / "sweep.json").read_text()
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n")
    code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", "--overwrite", "objective.q=0,0.5", "--slurm")
    one_line_error(code, err, "sbatch refused the sweep's array")
    assert (tmp_path / "s" / "sweep.json").read_text() == record and not list(tmp_path.glob("s.old-*"))


def test_sweep_out_and_report_figures_write_over_no_file_of_a_users(tmp_path, capsys):
    users = tmp_path / "uf"
    users.mkdir()
    (users / "curves_synthetic.png").write_text("notes")
    code, _, err = run_cli(capsys, "sweep", "--out", users, "objective.name=grpo")
    one_line_error(code, err, f"{users} is not empty (curves_synthetic.png) and holds no sweep", "a new or empty folder")
    code, _, err = run_cli(capsys, "sweep", "--out", users, "--overwrite", "objective.name=grpo")
    one_line_error(code, err, "is not empty")
    assert [path.name for path in users.iterdir()] == ["curves_synthetic.png"]
    run = finished_run(tmp_path / "run")
    code, out, err = run_cli(capsys, "report", run, "--figures", users)
    one_line_error(code, err, f"{users / 'curves_synthetic.png'} exists and is not a figure nemo-jq report wrote")
    assert out == "" and (users / "curves_synthetic.png").read_text() == "notes"
    for _ in range(2):  # a new folder, then the figure report wrote there, is written over
        assert run_cli(capsys, "report", run, "--figures", tmp_path / "figures")[0] == 0
    assert (tmp_path / "figures" / "curves_synthetic.png").stat().st_size > 10_000
    # a sweep's own folder holds the sweep's files alone: its figure of an earlier version (no mark) is the sweep's
    swept = tmp_path / "sweep"
    swept.mkdir()
    (swept / "sweep.json").write_text("{}")
    (swept / "curves_synthetic.png").write_text("written before figures carried the mark")
    assert report.report([run], figures=swept)["figures"] == [str(swept / "curves_synthetic.png")]
    assert (swept / "curves_synthetic.png").stat().st_size > 10_000


def test_report_searches_a_folder_reached_again_through_a_link_once(tmp_path, monkeypatch):
    """A folder holding a link to itself: searched once (it was searched through the link until the path was too
    long, and with two such links, without end)."""
    from pathlib import Path

    folder = tmp_path / "L"
    finished_run(folder / "run")
    (folder / "a").symlink_to(".")
    listed = []
    iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda path: listed.append(path) or iterdir(path))
    assert report.run_dirs([folder]) == [folder / "run"] and listed == [folder]
    (folder / "b").symlink_to(".")
    assert report.run_dirs([folder, folder / "a" / "run"]) == [folder / "run"]


def test_a_run_config_that_is_no_runs_is_named_in_one_line(tmp_path, capsys):
    run = finished_run(tmp_path / "run")
    (run / "config.yaml").write_text("a: 1\n")
    code, _, err = run_cli(capsys, "report", run)
    one_line_error(code, err, f"{run / 'config.yaml'} is not the run's saved config (unknown config key 'a'")


def test_a_sweep_inside_a_runs_folder_is_refused_before_it_writes_anything(tmp_path):
    """Its sweep.json and logs/ were written into the run's folder, then each run failed ("train.run_dir=... is inside
    the run") and the sweep's advice, `--resume`, could never go on."""
    finished_run(tmp_path / "run")
    sweep = Sweep.from_grid(tmp_path / "run" / "sw", [], ["objective.q=0.5,1"], None)
    with pytest.raises(ConfigError, match=f"run q=0.5 of the sweep: train.run_dir={tmp_path / 'run' / 'sw' / 'q=0.5'} is "
                                          f"inside the run {tmp_path / 'run'}"):
        sweep.write()
    assert not (tmp_path / "run" / "sw").exists()
