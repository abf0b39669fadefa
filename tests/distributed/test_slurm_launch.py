"""The launchers on a real SLURM: slurmctld and two slurmd (nodes n1, n2: one CPU and one /dev/null "GPU" each) on
this machine, brought up by tests/slurm/setup.sh (Debian's slurm-wlm and munge) and stopped by PID after these tests;
srun's --container-* flags are taken by the test stand-in for pyxis (tests/slurm/container_spank.c), which runs the
task on the host in the folder the mounts map the workdir to, with no SLURM client on its PATH (a pyxis image has
none): a requeue must come from the batch script, on the host (docs/cluster.md).

- the two-node sbatch job (Megatron backend, one gloo rank per node): `scancel --signal=USR1` (the time-limit signal,
  without waiting for a time limit) -> a checkpoint on both ranks -> exit 75 -> requeue by the batch script, on the
  host -> a resumed run whose metrics equal an uninterrupted run's;
- `scancel` (SIGTERM) ends a job for good, after its checkpoint; an external `scontrol requeue` is one line;
- `nemo-jq launch` with docs/cluster.md's settings (an absolute job_dir) submits through NeMo-Run; the time-limit signal
  -> exit 75 -> requeue by NeMo-Run's batch script, on the host -> the job resumes and completes;
- a failing rank ends the job with its error and no requeue; the no-container mode (NEMO_JQ_IMAGE=none).

Not shown here (no fake SLURM either): 8 GPUs per node; tests/unit/cluster/test_launch.py checks the 8-GPU script text.
Skipped only where SLURM is not installed and cannot be (not root, or no apt-get)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TINY_RUN
from megatron_cpu import free_port
from nemo_jq.runtime.monitor import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "tests" / "slurm" / "setup.sh"
SLURM_DIR = Path(os.environ.get("NEMO_JQ_SLURM_DIR", "/tmp/nemo-jq-slurm"))
TINY = [*TINY_RUN, "train.max_steps=5", "eval.every=1000"]
#: A run the time-limit signal always lands in: its steps take ~0.05-0.1 s here (checkpoints ~1 s), so five steps
#: could end before `scancel --signal=USR1` reached them (a requeue test once failed with Restarts 0), and on a
#: loaded 2-core host sixty did too (at 9 steps/s); the signal is sent at step 2 (or as the trainer starts) and
#: SIGNALLED_STEPS steps with no checkpoint of their own take ~10-20 s more.
SIGNALLED_STEPS = 200
SIGNALLED = [*TINY_RUN, f"train.max_steps={SIGNALLED_STEPS}", "train.epochs=40", "train.save_every=1000",
             "eval.every=1000"]
CPU_MEGATRON = f"{sys.executable} tests/megatron_cpu.py"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def slurm() -> dict[str, str]:
    """The environment of a SLURM client; the daemons this fixture started are stopped after the module."""
    started = subprocess.run([str(SETUP), "start"], capture_output=True, text=True, timeout=900)
    if started.returncode == 3:
        pytest.skip(started.stderr.strip())
    assert started.returncode == 0, started.stdout + started.stderr
    ours = "already up" not in started.stdout
    yield {**os.environ, "SLURM_CONF": str(SLURM_DIR / "slurm.conf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *sys.path])}
    if ours:
        subprocess.run([str(SETUP), "stop"], capture_output=True, timeout=120)


def sbatch(env: dict[str, str], tmp_path: Path, *args: str, **extra: str) -> str:
    result = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", *args], cwd=ROOT,
                            env={**env, **extra}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job(env: dict[str, str], job_id: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_until(check, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout} s: {what}")


def wait_for_end(env: dict[str, str], job_id: str, timeout: float = 240) -> dict[str, str]:
    try:
        return wait_until(lambda: (state := job(env, job_id)).get("JobState") in ENDED and state, timeout,
                          f"job {job_id} to end")
    except AssertionError:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
        raise


def train_steps(run_dir: Path) -> int:
    return sum(record["kind"] == "train" for record in read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0


def train_records(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in read_metrics(run_dir) if r["kind"] == "train"]


def log(tmp_path: Path, job_id: str) -> str:
    return (tmp_path / f"job-{job_id}.out").read_text()


def multinode(env: dict[str, str], tmp_path: Path, run_dir: Path, *overrides: str, image: str = "",
              run: list[str] = TINY) -> str:
    """The two-node sbatch job, its container flags mapped by the test pyxis: the repository at /workspace."""
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  backend: megatron\n")
    return sbatch(env, tmp_path, "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
                  "launchers/slurm_multinode.sbatch", str(config), *run, *overrides,
                  NEMO_JQ_IMAGE=image or str(tmp_path / "test.sqsh"), NEMO_JQ_MOUNTS=f"{ROOT}:/workspace,{tmp_path}:{tmp_path}",
                  NEMO_JQ_RUN_DIR=str(run_dir), NEMO_JQ_COMMAND=CPU_MEGATRON, MASTER_PORT=str(free_port()))


def test_the_test_container_has_no_slurm_client_on_its_path(slurm, tmp_path):
    """What the requeue tests below rest on: inside the test pyxis, as inside a pyxis image, no SLURM program is
    found (and bash and python are); outside a container the task has them."""
    shown = {}
    for where, container in (("container", [f"--container-image={tmp_path}/test.sqsh"]), ("host", [])):
        found = subprocess.run(["srun", "--nodes=1", *container, "bash", "-c", "command -v scontrol srun bash python"],
                               env=slurm, capture_output=True, text=True, timeout=60)
        shown[where] = [Path(line).name for line in found.stdout.split()]
    assert shown == {"container": ["bash", "python"], "host": ["scontrol", "srun", "bash", "python"]}


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> list[dict]:
    """The signalled run of the two-node job with no signal, with no container (NEMO_JQ_IMAGE=none)."""
    tmp_path = tmp_path_factory.mktemp("whole")
    job_id = multinode(slurm, tmp_path, tmp_path / "whole", image="none", run=SIGNALLED)
    state = wait_for_end(slurm, job_id)
    assert state["JobState"] == "COMPLETED", log(tmp_path, job_id)[-3000:]
    assert "NEMO_JQ_TEST_CONTAINER_IMAGE" not in log(tmp_path, job_id)
    assert [r["step"] for r in train_records(tmp_path / "whole")] == list(range(1, SIGNALLED_STEPS + 1))
    return train_records(tmp_path / "whole")


def test_the_time_limit_signal_checkpoints_both_nodes_requeues_from_the_host_and_resumes(slurm, tmp_path, uninterrupted):
    run_dir = tmp_path / "interrupted"
    job_id = multinode(slurm, tmp_path, run_dir, run=SIGNALLED)
    wait_until(lambda: train_steps(run_dir) >= 2, 180, "two steps")
    subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm, check=True, timeout=30)
    state = wait_for_end(slurm, job_id)
    text = log(tmp_path, job_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", text[-3000:]
    assert "checkpoint written; exit 75 asks the batch script to requeue" in text
    assert f"nemo-jq: requeueing job {job_id}" in text and "Traceback" not in text
    assert (run_dir / "results.json").exists()
    resumed = train_records(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, SIGNALLED_STEPS + 1))
    for got, expected in zip(resumed, uninterrupted, strict=True):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_the_time_limit_signal_requeues_a_run_whose_rollouts_are_on_a_rank_of_their_own(slurm, tmp_path):
    """One training rank and one rollout rank (``rollout.placement=separate``), one per node: the time-limit signal
    reaches both; the rollout rank ends with the trainers (it ended first, and rank 0's exit 75 then lost the
    world's last collective: a traceback, srun's 143, FAILED, no requeue). The job requeues and resumes to its end."""
    run_dir = tmp_path / "separate"
    job_id = multinode(slurm, tmp_path, run_dir, "rollout.placement=separate", "rollout.ranks=1", run=SIGNALLED)
    wait_until(lambda: train_steps(run_dir) >= 2, 180, "two steps")
    subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm, check=True, timeout=30)
    state = wait_for_end(slurm, job_id)
    text = log(tmp_path, job_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", text[-3000:]
    assert "checkpoint written; exit 75 asks the batch script to requeue" in text and "Traceback" not in text, text[-3000:]
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, SIGNALLED_STEPS + 1))
    assert (run_dir / "results.json").exists()


def single(env: dict[str, str], tmp_path: Path, run_dir: Path, *overrides: str) -> str:
    """launchers/slurm_train.sbatch, one node, the HF backend, a long run."""
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  backend: hf\n")
    return sbatch(env, tmp_path, "--gpus-per-node=1", "launchers/slurm_train.sbatch", str(config), *TINY_RUN,
                  "train.epochs=100", "train.save_every=1000", "eval.every=1000", *overrides,
                  NEMO_JQ_IMAGE=str(tmp_path / "test.sqsh"), NEMO_JQ_MOUNTS=f"{ROOT}:/workspace,{tmp_path}:{tmp_path}",
                  NEMO_JQ_RUN_DIR=str(run_dir), NEMO_JQ_COMMAND=f"{sys.executable} -m nemo_jq.cli")


def test_scancel_ends_a_job_for_good_and_an_external_requeue_is_one_line(slurm, tmp_path):
    """Both jobs at once, one per node. scancel: SIGTERM -> checkpoint, never a requeue. scontrol requeue from outside:
    the trainer checkpoints and says so in one line (no traceback, no second requeue); SLURM restarts it, and it
    resumes."""
    cancelled, requeued = tmp_path / "cancelled", tmp_path / "requeued"
    jobs = {"cancelled": single(slurm, tmp_path, cancelled), "requeued": single(slurm, tmp_path, requeued)}
    wait_until(lambda: train_steps(cancelled) >= 1 and train_steps(requeued) >= 1, 180, "a step of each job")
    subprocess.run(["scancel", jobs["cancelled"]], env=slurm, check=True, timeout=30)
    subprocess.run(["scontrol", "requeue", jobs["requeued"]], env=slurm, check=True, timeout=30)

    state = wait_for_end(slurm, jobs["cancelled"], 60)
    assert state["JobState"] == "CANCELLED" and state["Restarts"] == "0"
    assert (cancelled / "checkpoints").is_dir()

    stopped = wait_until(lambda: re.search(r"nemo-jq train: stopped by SIGTERM at step (\d+) with a checkpoint; not "
                                           r"requeued", log(tmp_path, jobs["requeued"])), 60, "the requeued job's line")
    wait_until(lambda: job(slurm, jobs["requeued"])["Restarts"] == "1" and train_steps(requeued) > int(stopped.group(1)),
               120, "the requeued job to restart and train on from its checkpoint")
    # a requeued job waits cred_expire (10 s here) before it starts again, counted from the requeue, made with the
    # scancel: the cancelled job, had it been requeued, would be back by now
    assert job(slurm, jobs["cancelled"])["JobState"] == "CANCELLED" and job(slurm, jobs["cancelled"])["Restarts"] == "0"
    subprocess.run(["scancel", jobs["requeued"]], env=slurm, check=True, timeout=30)
    wait_for_end(slurm, jobs["requeued"], 60)
    text = log(tmp_path, jobs["requeued"])
    assert "Traceback" not in text and "Job is pending execution" not in text, text[-3000:]
    assert "nemo-jq: requeueing" not in text


def test_a_failing_rank_ends_the_job_with_its_error_and_no_requeue(slurm, tmp_path):
    job_id = multinode(slurm, tmp_path, tmp_path / "bad", "train.batch_size=3", image="none")
    state = wait_for_end(slurm, job_id)
    assert state["JobState"] == "FAILED" and state["Restarts"] == "0"
    text = log(tmp_path, job_id)
    assert "nemo-jq train: error: train.batch_size=3 does not split over 2 data-parallel replicas" in text, text[-3000:]


def test_nemo_jq_launch_submits_with_the_readme_settings_and_its_script_requeues_from_the_host(slurm, tmp_path):
    """docs/cluster.md's launch YAML shape (an absolute job_dir, container image and mounts): NeMo-Run submits the sbatch
    script from where it wrote it, and srun starts the task in the (test) container. The time-limit signal, as soon as
    the trainer runs (it catches signals from its start; its steps take a fraction of a second here): a checkpoint,
    exit 75, and NeMo-Run's script requeues the job on the host (the container has no scontrol); the job resumes and
    completes. One node and the HF backend: NeMo-Run's script runs `python -m nemo_jq.cli`, without the CPU patches
    megatron-core needs here (the two-node Megatron job is the sbatch route's test above)."""
    pytest.importorskip("nemo_run")
    (tmp_path / "tiny.yaml").write_text("model:\n  backend: hf\n")
    (tmp_path / "launch.yaml").write_text(
        f"executor: slurm\naccount: acct\nnodes: 1\ngpus_per_node: 1\ntime: \"00:10:00\"\n"
        f"container_image: {tmp_path}/test.sqsh\ncontainer_mounts: [{tmp_path}:{tmp_path}]\n"
        f"env: {{OMP_NUM_THREADS: '1'}}\njob_dir: {tmp_path}/jobs\nmaster_port: {free_port()}\n")
    run_dir = tmp_path / "launched"
    submitted = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "launch", str(tmp_path / "launch.yaml"), "train",
                                "--config", str(tmp_path / "tiny.yaml"), *SIGNALLED, f"train.run_dir={run_dir}"],
                               cwd=tmp_path, env={**slurm, "NEMORUN_HOME": str(tmp_path / "nemo_run_home")},
                               capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = re.search(r"submitted SLURM job (\d+); its files: (\S+)", submitted.stdout)
    assert job_id, submitted.stdout + submitted.stderr[-3000:]
    assert Path(job_id.group(2)).is_relative_to(tmp_path / "jobs" / "experiments" / "nemo-jq")
    wait_until(run_dir.is_dir, 180, "the trainer to start")
    subprocess.run(["scancel", "--signal=USR1", job_id.group(1)], env=slurm, check=True, timeout=30)
    state = wait_for_end(slurm, job_id.group(1))
    logs = "".join(path.read_text() for path in sorted(Path(job_id.group(2)).glob("*.out")))
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", logs[-3000:]
    assert "checkpoint written; exit 75 asks the batch script to requeue" in logs
    assert f"nemo-jq: requeueing job {job_id.group(1)}" in logs and "Traceback" not in logs
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, SIGNALLED_STEPS + 1))
    assert not (tmp_path / "nemo_run_home" / "experiments").exists()  # all under job_dir


@pytest.mark.parametrize("linter, files", [("shellcheck", sorted(str(p) for p in (ROOT / "launchers").glob("*.sbatch"))
                                            + [str(SETUP)]), ("hadolint", [str(ROOT / "docker" / "Dockerfile")])])
def test_launchers_and_dockerfile_pass_their_linters(linter, files):
    result = subprocess.run([linter, *files], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


#: A sweep's tiny runs: six steps, a validation at 3 and 6, 8 test prompts.
SWEEP_RUN = ["train.max_steps=6", "eval.every=3", "data.validation_size=8", "data.test_size=8"]


def test_a_sweep_submitted_as_a_job_array_runs_every_run_and_reports_as_the_same_sweep_run_here(slurm, tmp_path):
    """`nemo-jq sweep --slurm`: 2 estimators x 2 seeds as one job array through launchers/slurm.sbatch (no container),
    each task `nemo-jq sweep --task DIR` (its run); once every task has completed, the report equals the report of
    the same sweep run here, and a second submission finds nothing to do."""
    grid = ["objective.name=garl,grpo", "--seeds", "0,1", *SWEEP_RUN]

    def nemo_jq(*words, **extra):
        return subprocess.run([sys.executable, "-m", "nemo_jq.cli", *map(str, words)], cwd=ROOT, env={**slurm, **extra},
                              capture_output=True, text=True, timeout=400)

    here = nemo_jq("sweep", "--out", tmp_path / "here", "--parallel", "2", *grid)
    assert here.returncode == 0, here.stdout + here.stderr
    submitted = nemo_jq("sweep", "--out", tmp_path / "array", *grid, "--slurm", NEMO_JQ_IMAGE="none")
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted job array (\d+): 4 of 4 runs", submitted.stdout).group(1)

    def tasks() -> list[dict[str, str]]:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=slurm, capture_output=True, text=True,
                               timeout=30)
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in shown.stdout.splitlines() if line.strip()]

    ended = wait_until(lambda: (found := tasks()) and all(task.get("JobState") in ENDED for task in found)
                       and len(found) == 4 and found, 400, f"the 4 tasks of job array {job_id} to end")
    logs = {path.name: path.read_text() for path in (tmp_path / "array" / "logs").glob("task-*.out")}
    assert [task["JobState"] for task in ended] == ["COMPLETED"] * 4, logs
    assert sorted(logs) == [f"task-{k}.out" for k in range(4)]
    reports = {}
    for where in ("here", "array"):
        shown = nemo_jq("report", tmp_path / where, "--json", tmp_path / f"{where}.json")
        assert shown.returncode == 0, shown.stderr
        reports[where] = json.loads((tmp_path / f"{where}.json").read_text())["rows"]
    assert reports["array"] == reports["here"] and [row["n"] for row in reports["here"]] == [2, 2]
    again = nemo_jq("sweep", "--resume", tmp_path / "array", "--slurm")
    assert again.returncode == 0 and "has finished; nothing to submit" in again.stdout, again.stdout + again.stderr
