"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow, both optional.

Each receives what a run logs: its config once, every record of metrics.jsonl (``kind/key`` at the
record's step: train, validation, test and the collapse guard's events), and the Figure-3 plot when
the run finishes. A resumed run continues the same tracker run (the ids, and the MLflow store the run is in, are
kept in ``RUN_DIR/tracking.json``). A tracker that fails during a run is dropped with a line on stderr: the run
trains on (``metrics.jsonl`` holds every record), :class:`~nemo_jq.runtime.monitor.RunLogger` sees to it. A tracker
run ends as the run did (:data:`OUTCOMES`): finished, failed (an error, a divergence), or stopped by a signal (to be
resumed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from nemo_jq.runtime.outputs import write_atomic

TRACKING_FILE = "tracking.json"
#: How a run ended, as its tracker runs are closed: "finished" (its steps done, or the steps asked for), "failed" (an
#: error: a divergence, a bad batch, a full disk), "stopped" (a signal: a checkpoint was written, a resume continues).
OUTCOMES = ("finished", "failed", "stopped")


class Tracker(Protocol):
    #: How a line on stderr names it (``W&B``, ``MLflow``).
    name: str

    def log(self, record: dict[str, Any]) -> None: ...

    def attach(self, path: Path) -> None: ...

    def table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...

    def close(self, outcome: str) -> None: ...


#: The W&B project and the MLflow experiment when neither the config nor the tracker's own variable names one.
DEFAULT_NAME = "nemo_jq"


def is_number(value: Any) -> bool:
    """A JSON number as a run writes one (JSON's true and false are none)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """A record's finite numbers as ``kind/key`` (the step itself excluded)."""
    return {f"{record['kind']}/{key}": float(value) for key, value in record.items()
            if is_number(value) and key != "step" and math.isfinite(value)}


def texts(record: dict[str, Any]) -> dict[str, str]:
    """A record's words (a guard's reason and action) as ``kind/key``."""
    return {f"{record['kind']}/{key}": value for key, value in record.items() if isinstance(value, str) and key != "kind"}


def flat_config(config: Any) -> dict[str, Any]:
    """``section.key -> value`` for every leaf of the run's config."""
    flat: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict) and not prefix.endswith(("options.", "q_schedule.")):
            for key, inner in value.items():
                walk(inner, f"{prefix}{key}.")
        else:
            flat[prefix.rstrip(".")] = value

    walk(dataclasses.asdict(config), "")
    return flat


@dataclasses.dataclass(frozen=True)
class Group:
    """The sweep or experiment a run is one of: its kind (``sweep``, ``experiment``), its folder, and the run's name
    there (``q=0.5``; an experiment's ``grpo/seed0``, where the folder's last part alone was ``seed0`` for all)."""

    kind: str
    folder: Path
    run_name: str


def group_of(run_dir: Path) -> Group | None:
    """The sweep (``sweep.json`` in the run's folder's parent) or experiment (``experiment.json`` up to three folders
    up: its runs are ``METHOD/seedS``, warm-start's ``DEPENDENCE/METHOD/seedS``, escape-rates' ``OPTIMIZER/METHOD/
    wW_seedS``) ``run_dir`` is a run of, else None."""
    from nemo_jq.runtime.sweep import EXPERIMENT_FILE, SWEEP_FILE

    run_dir = Path(run_dir).resolve()
    for folder in run_dir.parents[:3]:
        for kind, record in (("sweep", SWEEP_FILE), ("experiment", EXPERIMENT_FILE)):
            if (folder / record).exists() and (kind == "experiment" or folder == run_dir.parent):
                return Group(kind, folder, run_dir.relative_to(folder).as_posix())
    return None


class TrackerDidNotStart(ValueError):
    """A tracker the config turns on could not start (its service, its login): one line, the run not begun."""


class WandbTracker:
    """A Weights & Biases run named after the run directory, a sweep's or an experiment's runs grouped under its
    folder's name (:func:`group_of`; offline mode writes under ``RUN_DIR/wandb``)."""

    name = "W&B"

    def __init__(self, run_dir: Path, config: Any, ids: dict[str, str]):
        import wandb

        tracking = config.tracking
        mode = tracking.wandb_mode or os.environ.get("WANDB_MODE") or "online"
        self.wandb = wandb
        made = not (Path(run_dir) / "wandb").exists()
        try:
            group = group_of(run_dir)
            self.run = wandb.init(project=tracking.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_NAME,
                                  entity=tracking.wandb_entity, name=group.run_name if group else run_dir.name,
                                  group=group.folder.name if group else None,
                                  dir=str(run_dir), mode=mode, config=flat_config(config),
                                  id=ids.get("wandb"), resume="allow", settings=wandb.Settings(silent=True, console="off"))
        except (wandb.Error, OSError) as err:  # no login, no network: the tracker's, said before any step
            if made:  # its logs of the attempt: the run's folder is left as the start found it
                shutil.rmtree(Path(run_dir) / "wandb", ignore_errors=True)
            fix = ("no W&B server answered (check WANDB_BASE_URL and the network)"
                   if isinstance(err, wandb.errors.CommError) else "log in (wandb login, or WANDB_API_KEY)")
            raise TrackerDidNotStart(f"tracking.wandb=true (wandb_mode={mode}) could not start W&B "
                                     f"({first_line(err)}): {fix}, or set tracking.wandb_mode=offline (sync later with "
                                     "wandb sync)") from None
        ids["wandb"] = self.run.id

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({**numbers(record), **texts(record)}, step=record["step"])

    def attach(self, path: Path) -> None:
        self.run.log({f"plots/{path.stem}": self.wandb.Image(str(path))})

    def table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, outcome: str) -> None:
        """W&B's states: finished (exit code 0), failed (any other); a stopped run is marked preempting first."""
        if outcome == "stopped":
            self.run.mark_preempting()
        self.run.finish(exit_code=1 if outcome == "failed" else 0)


def first_line(error: BaseException) -> str:
    """An error's first line, with its kind."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def reachable(uri: str) -> None:
    """An MLflow server answers at ``uri`` (its ``/health``), within seconds: its client retries a refused connection
    for minutes before it fails (MLFLOW_HTTP_REQUEST_MAX_RETRIES), a run started against a wrong URI waited as long."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10).close()
    except (urllib.error.URLError, OSError) as err:
        if isinstance(err, urllib.error.HTTPError):  # it answered: a server is there (a proxy's page, a login)
            return
        raise TrackerDidNotStart(f"tracking.mlflow_tracking_uri={uri}: no MLflow server answers there "
                                 f"({first_line(err)}): "
                                 "start it (mlflow server), correct the URI, or leave it unset for a file store in "
                                 "the run directory") from None


def mlflow_name(key: str) -> str:
    """MLflow's names take no ``@``: ``test/m@16`` is logged as ``test/m_at_16``."""
    return key.replace("@", "_at_")


class MlflowTracker:
    """An MLflow run named after the run directory, in ``tracking.mlflow_experiment`` (metric names as
    :func:`mlflow_name` says); words go in as tags ``kind/key.step_N``. Its store: ``tracking.mlflow_tracking_uri``,
    else the one a resumed run was started in (recorded in ``tracking.json``), else ``$MLFLOW_TRACKING_URI``, else a
    file store in the run's folder, or in its sweep's or experiment's (one store for all its runs, each tagged
    ``sweep`` or ``experiment`` with the folder's name)."""

    name = "MLflow"

    def __init__(self, run_dir: Path, config: Any, ids: dict[str, str]):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        tracking = config.tracking
        group = group_of(run_dir)
        uri = (tracking.mlflow_tracking_uri or ids.get("mlflow_tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
               or ((group.folder if group else run_dir) / "mlruns").resolve().as_uri())
        if uri.startswith("file:"):  # MLflow 3 wants a database; a file store needs no server and no SQLAlchemy
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if uri.startswith(("http://", "https://")):
            reachable(uri)
        self.client = MlflowClient(tracking_uri=uri)
        ids["mlflow_tracking_uri"] = uri
        if "mlflow" in ids:
            self.run_id = ids["mlflow"]
            try:
                self.client.update_run(self.run_id, status="RUNNING")
            except MlflowException as err:
                raise TrackerDidNotStart(
                    f"{run_dir / TRACKING_FILE}: MLflow run {self.run_id} is not in the store at {uri} "
                    f"({first_line(err)}): set tracking.mlflow_tracking_uri to the store that holds it, or delete its "
                    "\"mlflow\" entry there to log to a new MLflow run from here on") from None
            return
        experiment_id = self._experiment_id(tracking.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
                                            or DEFAULT_NAME)
        tags = {group.kind: group.folder.name} if group else {}
        self.run_id = ids["mlflow"] = self.client.create_run(experiment_id, run_name=group.run_name if group else run_dir.name,
                                                             tags=tags).info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flat_config(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def _experiment_id(self, name: str) -> str:
        """The experiment called ``name``, made if the store has none (a sweep's runs starting at once may both make
        it: the second finds the first's)."""
        from mlflow.exceptions import MlflowException

        for _ in range(2):
            experiment = self.client.get_experiment_by_name(name)
            if experiment is not None:
                return experiment.experiment_id
            try:
                return self.client.create_experiment(name)
            except MlflowException:  # made by another run meanwhile
                continue
        raise TrackerDidNotStart(f"tracking.mlflow_experiment={name}: MLflow could neither find nor make it")

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(key), value, now, record["step"]) for key, value in numbers(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        for key, value in texts(record).items():
            self.client.set_tag(self.run_id, f"{key}.step_{record['step']}", value)

    def attach(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        """The rows as an artifact ``NAME/step_00000064.json`` in MLflow's table layout (``columns`` and ``data``, as
        its ``log_table`` writes), written without pandas, which ``log_table`` needs and mlflow-skinny does not bring."""
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{name}/step_{step:08d}.json")

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status={"finished": "FINISHED", "failed": "FAILED",
                                                        "stopped": "KILLED"}[outcome])


def open_trackers(run_dir: Path, config: Any) -> list[Tracker]:
    """The trackers ``config.tracking`` turns on, continuing this run's earlier tracker runs if it has any."""
    from nemo_jq.runtime.monitor import read_json_file

    tracking = config.tracking
    # MLflow first: its server is checked at once, and one that does not answer then leaves no W&B run behind
    wanted = [cls for on, cls in ((tracking.mlflow, MlflowTracker), (tracking.wandb, WandbTracker)) if on]
    if not wanted:
        return []
    path = run_dir / TRACKING_FILE
    ids = read_json_file(path, "the run's tracker ids", _ids_problem, "restore it, or delete it to log to new tracker "
                         "runs from here on") if path.exists() else {}
    trackers: list[Tracker] = []
    try:
        for cls in wanted:
            trackers.append(cls(run_dir, config, ids))
    except BaseException:  # the ones started end as failed, not left running
        for tracker in trackers:
            tracker.close("failed")
        raise
    write_atomic(path, json.dumps(ids, indent=2) + "\n")
    return trackers


def _ids_problem(ids: dict[str, Any]) -> str | None:
    wrong = [key for key, value in ids.items() if not isinstance(value, str)]
    return f"its {wrong[0]} is not a string" if wrong else None
