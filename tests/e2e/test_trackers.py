"""W&B and MLflow trackers: the config, every record, the guard's events and the plot; a missing package in one line."""

import json
from pathlib import Path

import pytest

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.runtime.monitor import read_metrics

QUICK = [*TINY_RUN, "train.max_steps=2", "eval.every=1000"]


@pytest.mark.slow
def test_trackers_get_the_config_every_record_the_guards_events_and_the_plot(tmp_path, capsys, monkeypatch):
    """W&B offline and MLflow's file store, no network; a resumed run continues both tracker runs."""
    import wandb
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "tracked"
    args = [*TINY_RUN, "train.max_steps=4", "eval.every=2", "guard.enabled=true", "guard.logp_drop=0.01", "guard.window=1",
            "tracking.wandb=true", "tracking.wandb_mode=offline", "tracking.mlflow=true", f"train.run_dir={run_dir}"]

    def train(*command):
        """The tracker ids after ``nemo-jq train COMMAND``, which dropped no tracker on the way."""
        code, _, err = run_cli(capsys, "train", *command)
        assert code == 0 and "failed on" not in err, err
        wandb.teardown()  # as the command's exit does: it waits for W&B's service to write out what it was sent
        return json.loads((run_dir / "tracking.json").read_text())

    ids = train(*args, "train.max_steps=3")
    assert train("--resume", run_dir, "train.max_steps=4") == ids  # the same tracker runs, continued

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())  # (the file store, allowed by the tracker)
    run = client.get_run(ids["mlflow"])
    assert run.data.params["objective.name"] == "garl" and run.data.params["tracking.mlflow"] == "True"
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")] == [1, 2, 3, 4]
    assert client.get_metric_history(ids["mlflow"], "test/m_at_4")
    guards = [r for r in read_metrics(run_dir) if r["kind"] == "guard"]
    assert guards and run.data.tags[f"guard/reason.step_{guards[0]['step']}"] == guards[0]["reason"]
    assert "training.png" in [a.path for a in client.list_artifacts(ids["mlflow"])]

    sessions = sorted((run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}"))  # one per process (docs/training.md)
    assert len(sessions) == 2
    for session in sessions:  # W&B's records (protobuf, read by its Go core only) hold the names as they are
        records = (session / f"run-{ids['wandb']}.wandb").read_bytes()
        assert not [name for name in (b"train/loss", b"test/m@4", b"objective.name", b"plots/training") if name not in records]
        assert list((session / "files" / "media" / "images" / "plots").glob("training_*.png"))
    assert b"guard/reason" in (sessions[0] / f"run-{ids['wandb']}.wandb").read_bytes()


def test_tracking_without_its_package_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.wandb=true", f"train.run_dir={tmp_path / 'r'}")
    one_line_error(code, err, "tracking.wandb=true needs the wandb package: pip install wandb")
    assert not (tmp_path / "r").exists()


def test_a_tracker_that_cannot_start_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    """An MLflow URI no server answers at (its client retried for minutes) and W&B online with no login: one line each,
    before any step, with the fix, and no run directory left (it held the run's config, splits and tokenizer, which
    the next start moved aside as a failed start's)."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.mlflow=true", f"tracking.mlflow_tracking_uri=http://127.0.0.1:{port}",
                           f"train.run_dir={tmp_path / 'mlflow'}")
    one_line_error(code, err, f"tracking.mlflow_tracking_uri=http://127.0.0.1:{port}: no MLflow server answers there",
                   "correct the URI")
    assert not (tmp_path / "mlflow").exists()
    # beside W&B (offline: it would start), MLflow is checked first: no W&B run is left behind, here or online
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.mlflow=true", f"tracking.mlflow_tracking_uri=http://127.0.0.1:{port}",
                           "tracking.wandb=true", "tracking.wandb_mode=offline", f"train.run_dir={tmp_path / 'both'}")
    one_line_error(code, err, "no MLflow server answers there")
    assert not (tmp_path / "both").exists()
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))  # no login this test could find
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.wandb=true", f"train.run_dir={tmp_path / 'wandb'}")
    one_line_error(code, err, "tracking.wandb=true (wandb_mode=online) could not start W&B", "tracking.wandb_mode=offline")
    assert not (tmp_path / "wandb").exists()
    # logged in, no server answering (a stand-in for wandb.init: a real one waits about 100 s for its server): its
    # attempt's logs were left in the run's folder, where the next start trained beside them, and it said "log in"
    import wandb

    def unanswered(**kwargs):
        (Path(kwargs["dir"]) / "wandb" / "debug").mkdir(parents=True)
        raise wandb.errors.CommError("Failed to get resume status: context deadline exceeded")

    monkeypatch.setattr(wandb, "init", unanswered)
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.wandb=true", f"train.run_dir={tmp_path / 'unanswered'}")
    one_line_error(code, err, "could not start W&B (CommError: Failed to get resume status", "no W&B server answered (check "
                   "WANDB_BASE_URL and the network)")
    assert not (tmp_path / "unanswered").exists()


def test_a_start_that_fails_after_its_trackers_started_ends_their_runs(tmp_path, capsys, monkeypatch):
    """The trackers start before the run writes its files (so one that cannot start leaves nothing): a failure in
    that write (here a full disk) ends their runs, which would otherwise stay RUNNING in MLflow."""
    import errno

    from mlflow.tracking import MlflowClient

    import nemo_jq.recipe.trainer

    def full_disk(run_dir, *_):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "config.yaml"))

    monkeypatch.setattr(nemo_jq.recipe.trainer, "write_run_files", full_disk)
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.mlflow=true", f"train.run_dir={run_dir}")
    one_line_error(code, err, f"no space left on device: {run_dir / 'config.yaml'}")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"


def wandb_exit_code(run_dir: Path) -> str:
    """The exit code W&B's offline run in ``run_dir`` was finished with, as its own log records it."""
    return (run_dir / "wandb" / "latest-run" / "logs" / "debug.log").read_text().split("got exitcode: ")[1].split()[0]


@pytest.mark.slow
def test_a_tracker_run_ends_as_the_run_did_and_unset_names_come_from_the_trackers_variables(tmp_path, capsys, monkeypatch):
    """A run that diverges is FAILED in MLflow and failed in W&B (exit code 1), one stopped by a signal KILLED
    (resumable; W&B: preempting, exit code 0), one that finishes FINISHED: every tracker run said FINISHED before. The
    project, the experiment and W&B's mode left unset are $WANDB_PROJECT, $MLFLOW_EXPERIMENT_NAME and $WANDB_MODE
    (the config's "nemo_jq" and "online" overrode them). Samples reach MLflow as a table without pandas, which
    mlflow-skinny does not bring (its log_table needs it: MLflow was dropped at the first validation)."""
    import os
    import signal
    import sys

    import wandb
    from mlflow.tracking import MlflowClient

    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.monitor import SAMPLE_COLUMNS

    for name, value in (("WANDB_SILENT", "true"), ("WANDB_MODE", "offline"), ("WANDB_PROJECT", "their_project"),
                        ("MLFLOW_EXPERIMENT_NAME", "their_experiment"), ("MLFLOW_ALLOW_FILE_STORE", "true")):
        monkeypatch.setenv(name, value)
    class NoPandas:  # pandas not installed: importing it fails (None in sys.modules is no stand-in: W&B looks there)
        def find_spec(self, name, *_):
            if name.split(".")[0] == "pandas":
                raise ModuleNotFoundError(f"No module named {name!r}")

    for name in [name for name in sys.modules if name.split(".")[0] == "pandas"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoPandas(), *sys.meta_path])
    monkeypatch.setattr(wandb.util, "pd_available", False)  # as W&B found it on its import, which came before
    trackers = [*TINY_RUN, "eval.every=2", "tracking.mlflow=true", "tracking.wandb=true"]

    def train(run_dir, *words):
        code, _, err = run_cli(capsys, "train", *trackers, *words, f"train.run_dir={run_dir}")
        wandb.teardown()
        ids = json.loads((run_dir / "tracking.json").read_text())
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
        return code, err, client, ids, client.get_run(ids["mlflow"])

    code, err, _, _, run = train(tmp_path / "diverged", "train.max_steps=4", "optim.lr=1e30")
    assert code == 2 and "diverged" in err and "failed on" not in err and run.info.status == "FAILED", err
    assert wandb_exit_code(tmp_path / "diverged") == "1"

    train_step = Trainer.train_step

    def stopped_at_step_3(self, batch):
        if self.state.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's time-limit signal
        return train_step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", stopped_at_step_3)
    code, err, _, _, run = train(tmp_path / "stopped", "train.max_steps=6")
    assert code == 0 and "failed on" not in err and run.info.status == "KILLED", err
    assert wandb_exit_code(tmp_path / "stopped") == "0"
    monkeypatch.setattr(Trainer, "train_step", train_step)

    code, err, client, ids, run = train(tmp_path / "finished", "train.max_steps=2")
    assert code == 0 and "failed on" not in err and run.info.status == "FINISHED", err
    assert wandb_exit_code(tmp_path / "finished") == "0"
    assert client.get_experiment(run.info.experiment_id).name == "their_experiment"
    assert b"their_project" in next((tmp_path / "finished" / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    table = json.loads(Path(client.download_artifacts(ids["mlflow"], "samples/step_00000002.json", str(tmp_path))).read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS) and table["data"] and all(row[0] == 2 for row in table["data"])


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_dropped_and_a_resume_finds_its_store_or_says_why_not(tmp_path, capsys, monkeypatch):
    """MLflow's file store named by MLFLOW_TRACKING_URI at the start: a resume without it continues the run in that
    store (tracking.json records it). A failure during a run (here a store that stops taking metrics at step 4: a
    stand-in for a server gone away) drops the tracker with a line and the run finishes; the tracking keys change
    on --resume; a run the store does not hold is one line naming tracking.json."""
    from mlflow.tracking import MlflowClient

    from nemo_jq.runtime import tracking

    store, run_dir = (tmp_path / "store").as_uri(), tmp_path / "run"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert run_cli(capsys, "train", *QUICK, "tracking.mlflow=true", f"train.run_dir={run_dir}")[0] == 0
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    real_log = tracking.MlflowTracker.log

    def failing_from_step_4(self, record):
        if record["step"] >= 4:
            raise OSError(28, "No space left on device")
        real_log(self, record)

    monkeypatch.setattr(tracking.MlflowTracker, "log", failing_from_step_4)
    code, out, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=5")
    assert code == 0, err
    assert err.count("nemo-jq: MLflow failed on step 4's train record (OSError: [Errno 28] No space left on device): the "
                     "run goes on without it") == 1, err
    ids = json.loads((run_dir / "tracking.json").read_text())
    assert ids["mlflow_tracking_uri"] == store
    client = MlflowClient(tracking_uri=store)
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    monkeypatch.undo()
    assert run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=6", "tracking.mlflow=false")[0] == 0
    (run_dir / "tracking.json").write_text(json.dumps({**ids, "mlflow": "0" * 32}))
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.epochs=2", "train.max_steps=7", "tracking.mlflow=true")
    one_line_error(code, err, f"{run_dir / 'tracking.json'}: MLflow run {'0' * 32} is not in the store at {store}",
                   "delete its \"mlflow\" entry")
    (run_dir / "tracking.json").write_text('{"mlflow": ')
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.epochs=2", "train.max_steps=7", "tracking.mlflow=true")
    one_line_error(code, err, f"{run_dir / 'tracking.json'} is not the run's tracker ids", "delete it")


@pytest.mark.slow
def test_a_sweeps_runs_share_one_mlflow_store_and_are_grouped_by_the_sweep(tmp_path, capsys, monkeypatch):
    """Two runs started at once: one file store in the sweep's folder (each made sure of the experiment; the second
    finds the first's), each MLflow run tagged with the sweep, each W&B run in the sweep's group."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's client, as the tracker allows it
    sweep = tmp_path / "q_sweep"
    code, out, err = run_cli(capsys, "sweep", "--out", sweep, "--parallel", "2", "objective.q=0.5,1", *TINY_RUN,
                             "train.max_steps=2", "tracking.mlflow=true", "tracking.wandb=true", "tracking.wandb_mode=offline")
    assert code == 0, out + err
    runs = [json.loads((sweep / name / "tracking.json").read_text()) for name in ("q=0.5", "q=1")]
    assert {ids["mlflow_tracking_uri"] for ids in runs} == {(sweep / "mlruns").as_uri()}
    assert not any((sweep / name / "mlruns").exists() for name in ("q=0.5", "q=1"))
    client = MlflowClient(tracking_uri=(sweep / "mlruns").as_uri())
    for name, ids in zip(("q=0.5", "q=1"), runs):
        run = client.get_run(ids["mlflow"])
        assert run.info.run_name == name and run.data.tags["sweep"] == "q_sweep"
        assert [m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")] == [1, 2]
        session = next((sweep / name / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
        assert b"q_sweep" in (session / f"run-{ids['wandb']}.wandb").read_bytes()  # the group, in W&B's run record


def test_an_experiments_runs_share_its_mlflow_store_named_by_method_and_seed(tmp_path, capsys, monkeypatch):
    """An experiment's runs (``OUT/METHOD/seedS``, experiment.json in OUT) were each a store of their own and each
    named ``seed0``: one store in OUT, each run named ``METHOD/seedS`` and tagged with the experiment. A run in a
    folder that merely sits under an experiment's is no sweep's: only the sweep's own runs are grouped as one."""
    from mlflow.tracking import MlflowClient

    from nemo_jq.runtime.tracking import Group, group_of

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    experiment = tmp_path / "noisy"
    experiment.mkdir()
    (experiment / "experiment.json").write_text("{}")
    run_dir = experiment / "grpo" / "seed0"
    assert run_cli(capsys, "train", *QUICK, "tracking.mlflow=true", f"train.run_dir={run_dir}")[0] == 0
    client = MlflowClient(tracking_uri=(experiment / "mlruns").as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "grpo/seed0" and run.data.tags["experiment"] == "noisy"
    assert not (run_dir / "mlruns").exists()
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text("{}")
    assert group_of(tmp_path / "sweep" / "q=1") == Group("sweep", tmp_path / "sweep", "q=1")
    assert group_of(tmp_path / "sweep" / "q=1" / "inner") is None and group_of(tmp_path / "alone") is None
    # warm-start's and escape-rates' runs, a folder deeper (they were each a store of their own, named seed0)
    assert group_of(experiment / "sum" / "GRPO" / "seed0") == Group("experiment", experiment, "sum/GRPO/seed0")
    assert group_of(experiment / "adamw" / "GARL" / "w3_seed1").run_name == "adamw/GARL/w3_seed1"
