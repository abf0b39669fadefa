"""A sweep's grid, its folder and its runs' states; the report's table, interval and collapse flag on run folders
written by hand (what a finished run leaves: config.yaml, results.json, metrics.jsonl). The sweep run, stopped and
resumed, and the report of real runs: tests/e2e/test_sweep.py."""

from __future__ import annotations

import json
import math

import pytest

from helpers import one_line_error, run_cli
from nemo_jq.config import load_config, save_config
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
    configs = Sweep.from_grid(tmp_path / "c", ["configs/a.yaml", "configs/b.yaml"], [], None)
    assert [(run.name, run.config, run.overrides) for run in configs.runs] == [("a", "configs/a.yaml", ()),
                                                                               ("b", "configs/b.yaml", ())]


def test_the_words_of_a_sweep_are_checked_in_one_line():
    assert split_words(["a.b=1", "c.d=x,y", "e.f=[1,2]"]) == (["a.b=1", "e.f=[1,2]"], {"c.d": ["x", "y"]})
    for words, fragment in ((["q"], "section.key=value"), (["a.b=1", "a.b=2"], "a.b is given twice"),
                            (["a.b=1,"], "an empty value")):
        with pytest.raises(ValueError, match=fragment):
            split_words(words)


def test_a_sweep_folder_records_its_grid_refuses_a_second_sweep_and_knows_each_runs_state(tmp_path, capsys):
    sweep = Sweep.from_grid(tmp_path / "s", [], ["objective.name=garl,grpo"], None)
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
    (tmp_path / "s" / grpo.name / "checkpoints" / "step_00000004" / STATE).write_text("{}")
    (tmp_path / "s" / grpo.name / "checkpoints" / "latest").write_text("step_00000004")
    assert (sweep.status(garl), sweep.status(grpo)) == (FINISHED, STOPPED)
    code, _, err = run_cli(capsys, "sweep", "--resume", tmp_path / "s", "objective.q=1")
    one_line_error(code, err, "--resume continues a sweep as its sweep.json records it")
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
    assert Sweep.load(tmp_path / "t").here == {"parallel": 1, "threads": None}  # threads: the free cores, when it runs


def test_a_bad_key_or_value_in_a_sweep_is_refused_naming_the_run_before_its_folder_is_written(tmp_path, capsys):
    for words, fragments in ((["objective.qq=0,1"], ["run qq=0", "objective.qq", "did you mean 'objective.q'"]),
                             (["objective.q=", "train.seed=1,2"], ["run seed=1", "objective.q must be float"]),
                             (["objective.q=0,x"], ["run q=x", "objective.q must be float; got 'x'"])):
        code, _, err = run_cli(capsys, "sweep", "--out", tmp_path / "s", *words)
        line = one_line_error(code, err, *fragments)
        assert line.count("nemo-jq") == 1 and not (tmp_path / "s").exists(), line


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


def test_the_first_progress_line_comes_once_each_running_runs_step_rate_is_measured(tmp_path):
    import sys

    from nemo_jq.runtime.sweep import duration, run_here, steps_words

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


def finished_run(folder, *, name="garl", q=0.5, seed=0, dataset="synthetic", test=None, validation=(10.0, 20.0)):
    """A run folder as a finished run leaves it, written by hand."""
    folder.mkdir(parents=True)
    save_config(load_config(None, [f"objective.name={name}", f"objective.q={q}", f"train.seed={seed}",
                                   f"data.name={dataset}"]), folder / "config.yaml")
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
    assert report.csv_text(result["rows"]).splitlines()[1].startswith("synthetic,cold,GARL q=0.5,3,0 1 2,1,20.0,24.84")
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
    assert report.run_dirs([tmp_path / "exp"]) == [tmp_path / "exp" / "q=0.5" / "seed0",
                                                   tmp_path / "exp" / "q=0.5" / "seed1", tmp_path / "exp" / "q=1" / "seed0"]
    rows = report.report([tmp_path / "exp"])["rows"]
    assert [(row["method"], row["n"], row["p@1"]) for row in rows] == [("GARL q=0.5", 2, 2.0), ("GARL q=1", 1, 1.0)]


def test_a_run_that_ends_at_its_best_or_never_scores_is_not_flagged(tmp_path):
    rising = report.read_run(finished_run(tmp_path / "a", validation=(0.0, 5.0, 5.0)))
    zero = report.read_run(finished_run(tmp_path / "b", validation=(0.0, 0.0)))
    fallen = report.read_run(finished_run(tmp_path / "c", validation=(0.0, 5.0, 0.0)))
    assert (rising.collapsed_after_peak, zero.collapsed_after_peak, fallen.collapsed_after_peak) == (False, False, True)
    assert report.seed_stats([2.0, None]) == {"mean": 2.0, "sd": 0.0, "n": 1, "ci95": None}
    assert report.seed_stats([None]) == {"mean": None, "sd": None, "n": 0, "ci95": None}
    two = report.seed_stats([1.0, 3.0])  # sd sqrt(2), t(0.975, 1) = 12.7062: half-width 12.7062 * sqrt(2) / sqrt(2)
    assert (two["mean"], two["n"]) == (2.0, 2) and math.isclose(two["sd"], math.sqrt(2))
    assert math.isclose(two["ci95"], 12.706204736 * math.sqrt(2) / math.sqrt(2))
