"""The multi-node sbatch script, end to end on a fake SLURM (tests/fake_slurm on PATH): two "nodes"
of one gloo rank each train a tiny model with the Megatron backend; a SIGUSR1 mid-run checkpoints,
requeues and resumes, and the metrics equal an uninterrupted run's. The launchers and the
Dockerfile pass their linters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY_RUN
from megatron_cpu import free_port
from nemo_jq.monitor import read_metrics

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
FAKE_SLURM = ROOT / "tests" / "fake_slurm"


def sbatch(tmp_path: Path, run_dir: Path, steps: int, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  backend: megatron\n")
    state = tmp_path / f"slurm-{run_dir.name}"
    state.mkdir()
    environment = {
        **os.environ, "PATH": os.pathsep.join([str(FAKE_SLURM), os.environ["PATH"]]), "FAKE_SLURM_STATE": str(state),
        "NEMO_JQ_RUN_DIR": str(run_dir), "NEMO_JQ_COMMAND": f"{sys.executable} tests/megatron_cpu.py",
        "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *sys.path]), **env,
    }
    return subprocess.run(["sbatch", "--nodes=2", "--ntasks-per-node=1", "launchers/slurm_multinode.sbatch", str(config),
                           *TINY_RUN, f"train.max_steps={steps}", "eval.every=1000", *overrides],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)


def train_records(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in read_metrics(run_dir) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """Five steps through the sbatch script with no signal: what every interrupted run must end up with."""
    tmp_path = tmp_path_factory.mktemp("whole")
    whole = sbatch(tmp_path, tmp_path / "whole", 5)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert [r["step"] for r in train_records(tmp_path / "whole")] == [1, 2, 3, 4, 5]
    return train_records(tmp_path / "whole")


def test_two_nodes_train_and_a_signal_requeues_and_resumes_to_the_same_metrics(tmp_path, uninterrupted):

    interrupted = sbatch(tmp_path, tmp_path / "interrupted", 5, FAKE_SLURM_SIGNAL_FILE=str(tmp_path / "interrupted" / "metrics.jsonl"),
                         FAKE_SLURM_SIGNAL_LINES="2")
    assert interrupted.returncode == 0, interrupted.stderr[-3000:]
    assert (tmp_path / "slurm-interrupted" / "requeued.log").read_text() == "4242\n"  # requeued once, then finished
    assert (tmp_path / "interrupted" / "results.json").exists()
    resumed = train_records(tmp_path / "interrupted")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for got, expected in zip(resumed, uninterrupted, strict=True):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_the_nemo_run_job_checkpoints_at_the_signal_requeues_and_resumes_to_the_same_metrics(tmp_path, uninterrupted):
    """NeMo-Run's rendered script (nemo-jq launch --dryrun) on the fake SLURM: srun starts the two ranks itself, the
    time-limit signal reaches them, and train --requeue checkpoints, requeues and resumes."""
    pytest.importorskip("nemo_run")
    from nemo_jq import launch

    def submit(name: str, **env: str) -> subprocess.CompletedProcess:
        config = launch.LaunchConfig(account="acct", nodes=2, gpus_per_node=1, container_image="unused#image:tag",
                                     job_dir=str(tmp_path / "jobs" / name), master_port=free_port())
        tiny = tmp_path / "tiny.yaml"
        tiny.write_text("model:\n  backend: megatron\n")
        script = launch.sbatch_script(config, ["train", "--config", str(tiny), *TINY_RUN, "train.max_steps=5",
                                               "eval.every=1000", f"train.run_dir={tmp_path / name}"])
        path = tmp_path / f"{name}.sbatch"  # the CPU patches' entry point in place of `python -m nemo_jq.cli`
        path.write_text(script.replace("python -m nemo_jq.cli", f"{sys.executable} tests/megatron_cpu.py"))
        state = tmp_path / f"slurm-{name}"
        state.mkdir()
        environment = {**os.environ, "PATH": os.pathsep.join([str(FAKE_SLURM), os.environ["PATH"]]),
                       "FAKE_SLURM_STATE": str(state), "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *sys.path]), **env}
        return subprocess.run(["sbatch", "--nodes=2", "--ntasks-per-node=1", str(path)], cwd=ROOT, env=environment,
                              capture_output=True, text=True, timeout=600)

    interrupted = submit("interrupted", FAKE_SLURM_SIGNAL_FILE=str(tmp_path / "interrupted" / "metrics.jsonl"),
                         FAKE_SLURM_SIGNAL_LINES="2")
    assert interrupted.returncode == 0, interrupted.stderr[-3000:]
    assert (tmp_path / "slurm-interrupted" / "requeued.log").read_text() == "4242\n"  # by rank 0, once
    assert (tmp_path / "interrupted" / "results.json").exists()
    resumed = train_records(tmp_path / "interrupted")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for got, expected in zip(resumed, uninterrupted, strict=True):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_a_failing_rank_ends_the_job_with_its_error_and_no_requeue(tmp_path):
    failed = sbatch(tmp_path, tmp_path / "bad", 2, "train.batch_size=3")
    assert failed.returncode != 0
    assert "nemo-jq train: error: train.batch_size=3 does not split over 2 data-parallel replicas" in failed.stderr
    assert not (tmp_path / "slurm-bad" / "requeued.log").exists()


@pytest.mark.parametrize("linter, files", [("shellcheck", sorted(str(p) for p in (ROOT / "launchers").glob("*.sbatch"))),
                                            ("hadolint", [str(ROOT / "docker" / "Dockerfile")])])
def test_launchers_and_dockerfile_pass_their_linters(linter, files):
    result = subprocess.run([linter, *files], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
