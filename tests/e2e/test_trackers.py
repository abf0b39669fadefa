"""W&B and MLflow trackers: the config, every record, the guard's events and the plot; a missing package in one line."""

import json

import pytest

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.runtime.monitor import read_metrics

QUICK = [*TINY_RUN, "train.max_steps=2", "eval.every=1000"]


@pytest.mark.slow
def test_trackers_get_the_config_every_record_the_guards_events_and_the_plot(tmp_path, capsys, monkeypatch):
    """W&B offline and MLflow's file store, no network; a resumed run continues both tracker runs."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "tracked"
    args = [*TINY_RUN, "train.max_steps=4", "eval.every=2", "guard.enabled=true", "guard.logp_drop=0.01", "guard.window=1",
            "tracking.wandb=true", "tracking.wandb_mode=offline", "tracking.mlflow=true", f"train.run_dir={run_dir}"]
    assert run_cli(capsys, "train", *args, "train.max_steps=3")[0] == 0
    ids = json.loads((run_dir / "tracking.json").read_text())
    assert run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=4")[0] == 0
    assert json.loads((run_dir / "tracking.json").read_text()) == ids  # the same tracker runs, continued

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())  # (the file store, allowed by the tracker)
    run = client.get_run(ids["mlflow"])
    assert run.data.params["objective.name"] == "garl" and run.data.params["tracking.mlflow"] == "True"
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")] == [1, 2, 3, 4]
    assert client.get_metric_history(ids["mlflow"], "test/m_at_4")
    guards = [r for r in read_metrics(run_dir) if r["kind"] == "guard"]
    assert guards and run.data.tags[f"guard/reason.step_{guards[0]['step']}"] == guards[0]["reason"]
    assert "training.png" in [a.path for a in client.list_artifacts(ids["mlflow"])]

    sessions = sorted((run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}"))  # one per process: wandb sync joins them
    assert len(sessions) == 2
    for session in sessions:  # W&B's records (protobuf, read by its Go core only) hold the names as they are
        records = (session / f"run-{ids['wandb']}.wandb").read_bytes()
        assert all(name in records for name in (b"train/loss", b"test/m@4", b"objective.name", b"plots/training"))
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
    before any step, with the fix; a later start moves the run directory aside as a failed start's."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.mlflow=true", f"tracking.mlflow_tracking_uri=http://127.0.0.1:{port}",
                           f"train.run_dir={tmp_path / 'mlflow'}")
    one_line_error(code, err, f"tracking.mlflow_tracking_uri=http://127.0.0.1:{port}: no MLflow server answers there",
                   "correct the URI")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))  # no login this test could find
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    code, _, err = run_cli(capsys, "train", *QUICK, "tracking.wandb=true", f"train.run_dir={tmp_path / 'wandb'}")
    one_line_error(code, err, "tracking.wandb=true (wandb_mode=online) could not start W&B", "tracking.wandb_mode=offline")
    assert read_metrics(tmp_path / "wandb") == []
