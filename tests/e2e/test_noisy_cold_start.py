"""`nemo-jq experiment noisy-cold-start`: its bookkeeping, and a smoke run at the quick size (not a result)."""

import json
import math
import subprocess
import sys

import pytest

from helpers import one_line_error, run_cli
from nemo_jq.config import load_config
from nemo_jq.experiments.noisy_cold_start import aggregate, methods, steps_to_escape


def test_steps_to_escape_is_the_first_step_above_log_one_over_m():
    records = [{"kind": "train", "step": 1, "log_p_hat": -20.0}, {"kind": "validation", "step": 1},
               {"kind": "train", "step": 2, "log_p_hat": -math.log(4)}, {"kind": "train", "step": 3, "log_p_hat": -1.0},
               {"kind": "train", "step": 4, "log_p_hat": -0.5}]
    assert steps_to_escape(records, -math.log(4)) == 3  # strictly above log(1/M)
    assert steps_to_escape(records, -5.0) == 2
    assert steps_to_escape(records[:3], -math.log(4)) is None and steps_to_escape([{"kind": "train", "step": 1}], -5.0) is None


def test_aggregate_is_mean_and_sd_over_seeds_and_counts_the_seeds_that_escaped():
    runs = [{"test": {"p@1": p, "p@4": p, "m@4": p}, "steps_to_escape": s, "steps_to_leave_cold": c, "memorisation": m}
            for p, s, c, m in [(10.0, 5, 2, 20.0), (20.0, None, 3, 40.0), (30.0, 7, 4, 60.0)]]
    stats = aggregate(runs, 4)
    t2, t1 = 4.302652729749464, 12.706204736174698  # Student t(0.975) at 2 and 1 degrees of freedom
    assert stats["p@1"] == pytest.approx({"mean": 20.0, "sd": 10.0, "n": 3, "ci95": t2 * 10.0 / math.sqrt(3)})
    assert stats["steps_to_escape"] == pytest.approx({"mean": 6.0, "sd": math.sqrt(2.0), "n": 2, "ci95": t1})
    assert stats["steps_to_leave_cold"] == pytest.approx({"mean": 3.0, "sd": 1.0, "n": 3, "ci95": t2 / math.sqrt(3)})
    assert stats["memorisation"]["mean"] == 40.0


def test_every_method_shares_the_settings_and_schedules_span_the_run():
    plan = methods(steps=384)
    assert list(plan) == ["GRPO", "q=0.25", "q=0.5", "q=0.75", "q=1", "SFT-then-RLVR", "linear 1->0", "cosine 1->0", "adaptive"]
    assert "num_steps: 384" in plan["linear 1->0"][-1] and "cold_p: 0.015625" in plan["adaptive"][-1]
    assert "cold_p: 0.25, ema_decay: 0.5" in methods(steps=384, adaptive={"cold_p": 0.25, "ema_decay": 0.5})["adaptive"][-1]
    tiny = methods(steps=384, adaptive={"cold_p": 1e-5})["adaptive"][-1]  # written so that YAML reads a number back
    assert load_config(None, [tiny]).objective.q_schedule["cold_p"] == 1e-5


def test_a_knob_given_twice_to_adaptive_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # argparse's own error
        run_cli(capsys, "experiment", "noisy-cold-start", "--out", tmp_path / "x", "--quick", "--seeds", "0", "--methods",
                "adaptive", "--adaptive", "cold_p=0.1,cold_p=0.2")
    one_line_error(refused.value.code, capsys.readouterr().err, "--adaptive: cold_p is given twice: drop one")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_quick_run_writes_table_summary_and_figures_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "experiment"
    command = [sys.executable, "-m", "nemo_jq.cli", "experiment", "noisy-cold-start", "--quick", "--seeds", "0",
               "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 9 and all(len(per_seed) == 1 for per_seed in summary["runs"].values())
    for per_seed in summary["runs"].values():
        assert 0 <= per_seed[0]["memorisation"] <= 100 and set(per_seed[0]["test"]) == {"p@1", "p@4", "m@4"}
    assert summary["theory"]["q=1"]["noise_equilibrium"] > summary["theory"]["q=0.25"]["noise_equilibrium"]
    assert (out / "table.md").read_text().startswith("| method |")
    assert "±" not in (out / "table.md").read_text()  # one seed shows no spread: its mean alone, not "± 0.0"
    assert (out / "tradeoff.png").exists() and (out / "figure3_seed0.png").exists()
    # `nemo-jq report` reads the experiment's run folders: each method's row is the experiment's own aggregate
    from nemo_jq.experiments.noisy_cold_start import slug
    from nemo_jq.runtime import report

    rows = {row["method"]: row for row in report.report([out])["rows"]}
    assert len(rows) == 9
    for method, stats in summary["aggregate"].items():
        row = rows[report.read_run(out / slug(method) / "seed0").method]
        assert row["n"] == 1 and row["m@4"] == round(stats["m@4"]["mean"], 2) and row["p@1"] == round(stats["p@1"]["mean"], 2)
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "an earlier experiment" in again.stderr


@pytest.mark.slow
def test_unknown_methods_and_malformed_knobs_are_one_line_errors(tmp_path):
    base = [sys.executable, "-m", "nemo_jq.cli", "experiment", "noisy-cold-start", "--quick", "--out", str(tmp_path / "x")]
    unknown = subprocess.run([*base, "--methods", "q=1,adaptiv"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "unknown method(s) 'adaptiv'; choose from" in unknown.stderr
    malformed = subprocess.run([*base, "--adaptive", "cold_p=x"], capture_output=True, text=True, timeout=120)
    assert malformed.returncode == 2 and "must be KNOB=NUMBER" in malformed.stderr
    for knobs, message in [("=3", "must be KNOB=NUMBER"), ("cold_p=nan", "cold_p must be a finite number; got nan")]:
        hostile = subprocess.run([*base, "--adaptive", knobs], capture_output=True, text=True, timeout=120)
        assert hostile.returncode == 2 and message in hostile.stderr and "Traceback" not in hostile.stderr
    misspelt = subprocess.run([*base, "--adaptive", "cold=0.1"], capture_output=True, text=True, timeout=120)
    assert misspelt.returncode == 2 and "unknown key(s) ['cold'] for q schedule 'adaptive'" in misspelt.stderr
    # with the adaptive method left out, its knobs are checked all the same (they were recorded and trained past)
    unchosen = subprocess.run([*base, "--methods", "q=1", "--adaptive", "cold=0.1"], capture_output=True, text=True,
                              timeout=120)
    assert unchosen.returncode == 2 and "unknown key(s) ['cold'] for q schedule 'adaptive'" in unchosen.stderr
    assert not (tmp_path / "x").exists()  # nothing was started


@pytest.mark.slow
def test_ctrl_c_stops_the_whole_experiment_not_one_run(tmp_path):
    """A multi-run command (issue 34, item 2): SIGINT during its first training checkpoints that run, starts no
    further run, says what finished and how to go on, and exits 130 (each run used to catch the signal for itself,
    and the next run started)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "exp"
    command = [sys.executable, "-m", "nemo_jq.cli", "experiment", "noisy-cold-start", "--quick", "--seeds", "0",
               "--out", str(out), "train.epochs=400"]  # a first run long enough to be interrupted
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("**/metrics.jsonl")) or not any(p.stat().st_size for p in out.glob("**/metrics.jsonl")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "stopped by SIGINT" in err and "no further run started" in err and "--resume" in err, err
    started = {path.parent for path in out.glob("**/metrics.jsonl")}
    assert len(started) == 1, started  # no second run began
    assert list(next(iter(started)).glob("checkpoints/step_*")), "the interrupted run wrote its checkpoint"


@pytest.mark.slow
def test_an_experiment_stopped_mid_run_resumes_to_the_summary_an_unstopped_one_writes(tmp_path, capsys, monkeypatch):
    """`experiment NAME --resume OUT`: the run a stop left continues from its checkpoint, a finished run is read back
    from the record, not trained again, and the summary equals the one an experiment never stopped writes."""
    import os
    import signal

    from nemo_jq.experiments.noisy_cold_start import run_experiment
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.preemption import Stopped

    options = dict(seeds=[0], label_noise=0.2, quick=True, only=["q=1", "GRPO"])
    unstopped = run_experiment(tmp_path / "unstopped", **options)
    step = Trainer.train_step
    calls = []

    def stopped_at_the_second_runs_fourth_step(self, batch):
        calls.append(self.run_dir.parent.name)
        if calls.count("q=1") == 4:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the step ends, a checkpoint is written
        return step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", stopped_at_the_second_runs_fourth_step)
    with pytest.raises(Stopped) as stop:
        run_experiment(tmp_path / "out", **options)
    assert f"--resume {tmp_path / 'out'}` goes on" in str(stop.value) and "q=1/seed0 stopped at step 4" in str(stop.value)
    calls.clear()
    code, out, err = run_cli(capsys, "experiment", "noisy-cold-start", "--resume", tmp_path / "out")
    assert code == 0, err
    assert calls.count("GRPO") == 0 and calls.count("q=1") == 2  # GRPO read back; q=1 from its step-4 checkpoint on
    resumed = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert resumed["runs"] == json.loads(json.dumps(unstopped["runs"])) and resumed["aggregate"] == unstopped["aggregate"]
    for words, message in [(["--seeds", "1"], "drop --seeds"), (["--quick", "train.epochs=2"], "drop --quick, key=value"),
                           (["--label-noise", "0.1"], "drop --label-noise")]:
        code, _, err = run_cli(capsys, "experiment", "noisy-cold-start", "--resume", tmp_path / "out", *words)
        one_line_error(code, err, message)
    code, _, err = run_cli(capsys, "experiment", "escape-rates", "--resume", tmp_path / "out")
    one_line_error(code, err, "holds experiment noisy-cold-start, not escape-rates: `nemo-jq experiment noisy-cold-start "
                              f"--resume {tmp_path / 'out'}` continues it")
    code, _, err = run_cli(capsys, "experiment", "noisy-cold-start", "--resume", tmp_path / "unstopped" / "GRPO")
    one_line_error(code, err, "holds no experiment to resume (experiment.json)")
    code, _, err = run_cli(capsys, "experiment", "escape-rates", "--quick", "--out", tmp_path / "out")
    one_line_error(code, err, f"continue it with `nemo-jq experiment noisy-cold-start --resume {tmp_path / 'out'}`")
    record = json.loads((tmp_path / "out" / "experiment.json").read_text())
    (tmp_path / "out" / "experiment.json").write_text(json.dumps({**record, "options": {**record["options"], "foo": 1}}))
    code, _, err = run_cli(capsys, "experiment", "noisy-cold-start", "--resume", tmp_path / "out")
    one_line_error(code, err, "experiment.json is not an experiment's record", "'foo'", "restore it")
    # options edited in the record are said as the record's (they read as if given on the command line, unnamed)
    for edit, said in [({"label_noise": 5}, "data.label_noise must be >= 0.0 and < 1.0; got 5"),
                       ({"overrides": ["foo.bar=1"]}, "unknown config key 'foo'"),
                       ({"seeds": ["x"]}, "options.seeds is ['x'], not a list of whole numbers")]:
        (tmp_path / "out" / "experiment.json").write_text(json.dumps({**record, "options": {**record["options"], **edit}}))
        code, _, err = run_cli(capsys, "experiment", "noisy-cold-start", "--resume", tmp_path / "out")
        one_line_error(code, err, f"{tmp_path / 'out' / 'experiment.json'} ", said, "start the experiment again with "
                       "--out NEW_DIR")
    # --out inside a run is refused before anything is written into that run
    inside = tmp_path / "unstopped" / "GRPO" / "seed0" / "more"
    code, _, err = run_cli(capsys, "experiment", "noisy-cold-start", "--quick", "--out", inside)
    one_line_error(code, err, f"--out {inside} is inside the run {tmp_path / 'unstopped' / 'GRPO' / 'seed0'}",
                   "choose an --out outside it")
    assert not inside.exists()
    # a folder holding a sweep, a run or anything else is not an experiment's: refused before anything is written
    (tmp_path / "notes" / "GRPO").mkdir(parents=True)  # a folder of one's own named as a method's runs are
    (tmp_path / "notes" / "GRPO" / "notes.txt").write_text("mine")
    for folder, message in [(tmp_path / "notes", "is not empty (GRPO) and holds no experiment"),
                            (tmp_path / "unstopped" / "GRPO" / "seed0", "already holds a sweep or a run")]:
        code, _, err = run_cli(capsys, "experiment", "noisy-cold-start", "--quick", "--out", folder)
        one_line_error(code, err, message)
        assert not (folder / "experiment.json").exists()


@pytest.mark.slow
def test_a_stop_as_a_run_ends_starts_no_further_run(tmp_path, monkeypatch, capsys):
    """A signal during a run's last evaluation: the run ends and is recorded, and the next is not started (it was:
    it built its model and wrote an untrained step-0 checkpoint, inside the signal's grace period). Its progress
    names it below the experiment's folder (every method's runs are seed0, seed1, ...)."""
    import os
    import signal

    from nemo_jq.experiments.noisy_cold_start import run_experiment
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.preemption import Stopped

    fit = Trainer.fit

    def signalled_as_it_ends(self, *args, **kwargs):
        result = fit(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C in its last moments: the run has finished
        return result

    monkeypatch.setattr(Trainer, "fit", signalled_as_it_ends)
    with pytest.raises(Stopped) as stop:
        run_experiment(tmp_path / "out", seeds=[0], label_noise=0.2, quick=True, only=["GRPO", "q=1"])
    assert f"finished runs: {tmp_path / 'out' / 'GRPO' / 'seed0'}; {tmp_path / 'out' / 'q=1' / 'seed0'} not started" \
        in str(stop.value), str(stop.value)
    assert not (tmp_path / "out" / "q=1").exists()
    assert list(json.loads((tmp_path / "out" / "experiment.json").read_text())["runs"]) == ["GRPO/seed0"]
    shown = capsys.readouterr()
    assert "train GRPO/seed0" in shown.out + shown.err
