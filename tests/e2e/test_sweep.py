"""``nemo-jq sweep`` and the demo as a sweep, run as a user runs them (subprocesses, real signals): a sweep stopped by
Ctrl-C continues with ``--resume`` to the metrics of one never stopped, and the report reproduces each run's
results.json; the demo, stopped, continues with ``nemo-jq train --resume`` to the table of one never stopped, and its
overrides reach every run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import from_a_terminal, process_stat
from nemo_jq.runtime.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
#: Tiny runs: a few seconds of training each, a checkpoint every 4 steps.
SMALL = ["train.max_steps=12", "train.save_every=4", "eval.every=6", "data.validation_size=16", "data.test_size=16"]
#: What differs between two runs of the same seed: timings, and the float noise between the sampler's and the
#: trainer's log-probs (it depends on the threads; the samples and the weights do not).
NOISE = ("step_time", "rollout_tokens_per_s", "logprob_gap", "max_logprob_gap", "kl_k3")

pytestmark = pytest.mark.slow


def nemo_jq(*words: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(["tests", *sys.path])}
    return subprocess.Popen([sys.executable, "-m", "nemo_jq.cli", *map(str, words)], cwd=ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=from_a_terminal)


def finish(process: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    out, _ = process.communicate(timeout=timeout)
    return process.returncode, out


def interrupt_when_training(process: subprocess.Popen, run_dir: Path) -> tuple[int, str]:
    """Ctrl-C (SIGINT to the command) once ``run_dir`` has logged 5 steps; the command's exit code and output."""
    deadline = time.monotonic() + 300
    while not [r for r in read_metrics(run_dir) if r["kind"] == "train" and r["step"] >= 5]:
        assert process.poll() is None and time.monotonic() < deadline, "the sweep ended before its first run trained"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    return finish(process)


def comparable(run_dir: Path) -> list[dict]:
    return [{key: value for key, value in record.items() if key not in NOISE} for record in read_metrics(run_dir)]


def documented(where: Path) -> list[list[str]]:
    """docs/sweeps.md's sweep, resume and report commands (their words after ``nemo-jq``), on ``where`` instead of
    runs/q_sweep, each run cut to :data:`SMALL`."""
    page = (ROOT / "docs" / "sweeps.md").read_text()
    block = page.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.replace("runs/q_sweep", str(where)).split()[1:] for line in block.splitlines()]
    return [commands[0] + SMALL, *commands[1:]]


def test_the_documented_sweep_stopped_resumes_to_an_unstopped_ones_metrics_and_its_report_reads_each_runs_results(
        tmp_path):
    """docs/sweeps.md's commands: 2 estimators x 2 seeds, 2 runs at a time; stopped by Ctrl-C during its first run,
    continued with --resume, the same metrics, samples and results as the same sweep never stopped."""
    sweep, resume, report = documented(tmp_path / "stopped")
    code, out = finish(nemo_jq(*[word.replace(str(tmp_path / "stopped"), str(tmp_path / "whole")) for word in sweep]))
    assert code == 0, out
    assert out.splitlines()[0].startswith(f"nemo-jq sweep: 4 runs in {tmp_path / 'whole'} (0 finished, 0 to continue, "
                                          "4 to start; ") and "steps each), 2 at a time" in out.splitlines()[0]
    code, out = interrupt_when_training(nemo_jq(*sweep), tmp_path / "stopped" / "name=garl_seed=0")
    assert code == 130, out
    assert f"`nemo-jq sweep --resume {tmp_path / 'stopped'}` continues them" in out.splitlines()[-1]
    code, out = finish(nemo_jq(*resume))
    assert code == 0, out
    assert "to continue" in out.splitlines()[0] and "(0 finished" in out.splitlines()[0]
    names = [run["name"] for run in json.loads((tmp_path / "whole" / "sweep.json").read_text())["runs"]]
    for name in names:
        assert comparable(tmp_path / "stopped" / name) == comparable(tmp_path / "whole" / name), name
        for kept in ("results.json", "samples.jsonl"):  # what each validation's first prompts were answered with too
            assert (tmp_path / "stopped" / name / kept).read_text() == (tmp_path / "whole" / name / kept).read_text()
    # the report: each group's mean over its two seeds is the mean of what the runs recorded
    code, out = finish(nemo_jq(*report))
    assert code == 0, out
    results = {name: json.loads((tmp_path / "whole" / name / "results.json").read_text()) for name in names}
    table = json.loads((tmp_path / "stopped" / "table.json").read_text())["rows"]
    garl = next(row for row in table if row["method"] == "GARL q=0.75")
    mean = sum(results[f"name=garl_seed={seed}"]["test"]["p@16"] for seed in (0, 1)) / 2
    assert garl["n"] == 2 and garl["seeds"] == [0, 1] and garl["p@16"] == round(mean, 2)
    assert (tmp_path / "stopped" / "table.csv").read_text().startswith("dataset,format,method,n,seeds")
    assert (tmp_path / "stopped" / "curves_synthetic.png").stat().st_size > 10_000
    code, out = finish(nemo_jq("generate", tmp_path / "whole" / "name=garl_seed=0", *documented_generate()))
    assert code == 0 and out.count("--- sample") == 4 and out.count("answer: ") == 4, out
    # --resume with words of how long the runs train: every run, finished ones too, trains on; sweep.json keeps them
    for words, message in [(["objective.q=1"], "objective.q=1 cannot change with --resume"),
                           (["train.max_steps=10"], "is at step 12, beyond the 10 steps train.max_steps=10 gives it")]:
        code, out = finish(nemo_jq(*resume, *words))
        assert code == 2 and message in out and "Traceback" not in out, out
    code, out = finish(nemo_jq(*resume, "train.max_steps=20"))
    assert code == 0 and "(0 finished, 4 to continue" in out.splitlines()[0], out
    for name in names:
        assert json.loads((tmp_path / "stopped" / name / "results.json").read_text())["step"] == 20, name
    code, out = finish(nemo_jq(*resume))
    assert code == 0 and "(4 finished, 0 to continue, 0 to start)" in out.splitlines()[0], out


def test_a_sweep_whose_terminal_closed_or_that_was_killed_stops_its_runs_with_checkpoints(tmp_path):
    """SIGHUP (a closed terminal) stops a sweep as Ctrl-C does (exit 129, the resume line); a SIGKILL of the sweep,
    which can pass nothing on, reaches its runs as SIGTERM (each a session of its own, no terminal's signal reaches
    it): they stop with their checkpoints instead of going on unseen; ``--resume`` then finishes them all."""
    out_dir = tmp_path / "sweep"
    words = ["sweep", "--out", out_dir, "--parallel", "2", "objective.q=0.5,1", "train.max_steps=60", "train.save_every=4",
             "eval.every=1000", "data.validation_size=8", "data.test_size=8"]
    runs = [out_dir / "q=0.5", out_dir / "q=1"]
    logs = [out_dir / "logs" / f"{run.name}.log" for run in runs]
    for signum in (signal.SIGHUP, signal.SIGKILL):
        before = [log.stat().st_size if log.exists() else 0 for log in logs]  # a run's log goes on across a resume
        trained = [max([r["step"] for r in read_metrics(run) if r["kind"] == "train"], default=0) for run in runs]
        process = nemo_jq(*(words if signum == signal.SIGHUP else ["sweep", "--resume", out_dir]))  # 2 at once again
        deadline = time.monotonic() + 300
        while not all([r for r in read_metrics(run) if r["kind"] == "train" and r["step"] >= step + 4]
                      for run, step in zip(runs, trained)):
            assert process.poll() is None and time.monotonic() < deadline, "the sweep ended before its runs trained"
            time.sleep(0.2)
        process.send_signal(signum)
        code, out = finish(process)
        if signum == signal.SIGHUP:
            assert code == 129 and "stopped by SIGHUP" in out and f"nemo-jq sweep --resume {out_dir}" in out, out
        said = "SIGHUP" if signum == signal.SIGHUP else "SIGTERM"
        deadline = time.monotonic() + 120
        while not all(f"stopped by {said} at step" in log.read_text()[start:] for log, start in zip(logs, before)):
            assert time.monotonic() < deadline, [log.read_text()[start:][-500:] for log, start in zip(logs, before)]
            time.sleep(0.2)
        # a run of a local sweep says how it continues, not what a SLURM job would do (it takes --requeue too)
        assert all(f"`nemo-jq train --resume {run}` continues" in log.read_text()[start:]
                   and "requeue" not in log.read_text()[start:] for run, log, start in zip(runs, logs, before))
    code, out = finish(nemo_jq("sweep", "--resume", out_dir))
    assert code == 0 and "(0 finished, 2 to continue, 0 to start" in out.splitlines()[0], out
    assert all((run / "results.json").exists() for run in runs)


def _children(pid: int) -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()
            and process_stat(int(entry.name))[1:2] == [str(pid)]]


def _steps(run: Path) -> int:
    return max([r["step"] for r in read_metrics(run) if r["kind"] == "train"], default=0)


def test_ctrl_z_stops_a_sweeps_runs_with_it_and_fg_lets_them_go_on(tmp_path):
    """SIGTSTP (Ctrl-Z) to the sweep stops its runs too (sessions of their own, which the terminal's signal does not
    reach: they trained on, holding the cores); SIGCONT (fg, bg) lets them go on."""
    out_dir = tmp_path / "sweep"
    process = nemo_jq("sweep", "--out", out_dir, "--parallel", "2", "objective.q=0.5,1", "train.max_steps=400",
                      "eval.every=1000", "data.validation_size=8", "data.test_size=8")
    runs = [out_dir / "q=0.5", out_dir / "q=1"]
    deadline = time.monotonic() + 300
    while not all(_steps(run) >= 4 for run in runs):
        assert process.poll() is None and time.monotonic() < deadline, "the sweep ended before its runs trained"
        time.sleep(0.2)
    children = _children(process.pid)
    assert len(children) == 2
    process.send_signal(signal.SIGTSTP)
    deadline = time.monotonic() + 30
    while not all(process_stat(pid)[:1] == ["T"] for pid in [process.pid, *children]):
        assert time.monotonic() < deadline, [process_stat(pid)[:1] for pid in [process.pid, *children]]
        time.sleep(0.1)
    held = [_steps(run) for run in runs]
    time.sleep(2)
    assert [_steps(run) for run in runs] == held  # nothing trains while stopped
    process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while not all(_steps(run) > step for run, step in zip(runs, held)):
        assert time.monotonic() < deadline, "the runs did not go on"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    code, out = finish(process)
    assert code == 130 and f"nemo-jq sweep --resume {out_dir}" in out, out


def documented_generate() -> list[str]:
    """docs/sweeps.md's generate command's words after the run folder."""
    page = (ROOT / "docs" / "sweeps.md").read_text()
    line = next(line for line in page.splitlines() if line.startswith("nemo-jq generate runs/"))
    return shlex.split(line)[3:]


def test_the_demo_stopped_continues_to_the_table_of_one_never_stopped_and_takes_overrides_to_every_run(tmp_path):
    small = ["--quick", "train.max_steps=12", "data.test_size=16"]
    code, whole = finish(nemo_jq("train", "--demo-dir", tmp_path / "whole", *small))
    assert code == 0, whole
    assert whole.splitlines()[0].startswith("nemo-jq train: the cold-start comparison, GRPO, GARL q=0 (RB-RLOO), GARL "
                                            "q=0.5, GARL q=0.75, GARL q=1")
    code, out = interrupt_when_training(nemo_jq("train", "--demo-dir", tmp_path / "stopped", *small),
                                        tmp_path / "stopped" / "grpo")
    assert code == 130 and f"`nemo-jq train --resume {tmp_path / 'stopped'}` continues them" in out, out
    code, out = finish(nemo_jq("train", "--resume", tmp_path / "stopped"))
    assert code == 0, out
    table = [line for line in whole.splitlines() if line.startswith(("GRPO", "GARL"))]
    assert len(table) == 5 and table == [line for line in out.splitlines() if line.startswith(("GRPO", "GARL"))]
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary == json.loads((tmp_path / "stopped" / "summary.json").read_text())
    # `nemo-jq report` on the demo's folder gives its table: each method once (one seed), its test scores as recorded
    code, out = finish(nemo_jq("report", tmp_path / "whole", "--json", tmp_path / "report.json"))
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert code == 0 and [row["method"] for row in rows] == ["GRPO", "GARL q=0", "GARL q=0.5", "GARL q=0.75", "GARL q=1"]
    for row, (label, result) in zip(rows, summary.items()):
        assert row["n"] == 1 and all(row[key] == round(value, 2) for key, value in result["test"].items()), label
    for slug in ("grpo", "garl_q0", "garl_q0.5", "garl_q0.75", "garl_q1"):  # --quick and the overrides reached each
        config = (tmp_path / "whole" / slug / "config.yaml").read_text()
        assert "max_steps: 12" in config and "test_size: 16" in config and "validation_size: 32" in config, slug


def test_a_sweep_resumed_from_another_folder_reads_its_runs_paths_from_where_it_was_started(tmp_path, monkeypatch):
    """A sweep records the folder it was started in: its runs' relative paths (``--config syn.yaml``) are read from
    there. ``--resume`` from another folder failed every run ("config file syn.yaml does not exist")."""
    from nemo_jq.runtime.sweep import Sweep

    project = tmp_path / "project"
    project.mkdir()
    (project / "syn.yaml").write_text("train:\n  max_steps: 2\n  save_every: 2\neval:\n  every: 1000\n"
                                      "data:\n  validation_size: 4\n  test_size: 4\n")
    monkeypatch.chdir(project)
    sweep = Sweep.from_grid(Path("s"), ["syn.yaml"], [], None)
    sweep.here = {"parallel": 1, "threads": 1, "started_in": str(project)}
    sweep.write()
    code, out = finish(nemo_jq("sweep", "--resume", project / "s"))  # from the repository's folder
    assert code == 0 and f"working from {project}, where the sweep was started" in out, out
    assert [r["step"] for r in read_metrics(project / "s" / "run") if r["kind"] == "train"] == [1, 2]
