"""`nemo-jq launch`: NeMo-Run executors from a launch YAML; the dry run's sbatch text; bad launch configs."""

from __future__ import annotations

import pytest

pytest.importorskip("nemo_run")

from nemo_jq import launch  # noqa: E402
from nemo_jq.cli import main  # noqa: E402

LAUNCH_YAML = """\
account: acct
partition: batch
nodes: 2
gpus_per_node: 8
time: "02:00:00"
container_image: nvcr.io/acme/nemo-jq:latest
container_mounts: [/lustre/me:/lustre/me]
env: {NCCL_IB_HCA: mlx5}
job_dir: JOB_DIR
"""


def write_launch(tmp_path, text: str = LAUNCH_YAML):
    path = tmp_path / "launch.yaml"
    path.write_text(text.replace("JOB_DIR", str(tmp_path / "jobs")))
    return path


def test_dryrun_prints_the_sbatch_script_nemo_run_would_submit(tmp_path, capsys):
    command = ["train", "--config", "/lustre/me/c.yaml", "model.backend=megatron", "megatron.tensor_parallel=8"]
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", *command]) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=02:00:00", "#SBATCH --signal=USR1@300",
                 "export NCCL_IB_HCA=mlx5", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1"):
        assert line in script.splitlines(), line
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container-image nvcr.io/acme/nemo-jq:latest" in srun and "--container-mounts /lustre/me:/lustre/me," in srun
    assert "--kill-on-bad-exit=1 torchrun" in srun and "--nnodes 2 --nproc-per-node 8" in srun
    assert srun.endswith("-m nemo_jq.cli " + " ".join(command))
    assert not (tmp_path / "jobs" / "dryrun" / "nemo-jq" / "log").exists()  # nothing was submitted


def test_docker_and_local_executors_run_under_torchrun(tmp_path):
    import nemo_run as run

    docker = launch.build_executor(launch.LaunchConfig(executor="docker", gpus_per_node=4, container_mounts=["/d:/d"]))
    assert isinstance(docker, run.DockerExecutor) and docker.num_gpus == 4 and docker.volumes == ["/d:/d"]
    local = launch.build_executor(launch.LaunchConfig(executor="local", gpus_per_node=2))
    assert isinstance(local, run.LocalExecutor) and local.ntasks_per_node == 2
    assert all(executor.get_launcher().__class__.__name__ == "Torchrun" for executor in (docker, local))


@pytest.mark.parametrize("text, message", [
    ("acount: acct\n", "unknown launch key(s) acount; known: account,"),
    ("executor: k8s\n", "executor='k8s'; choose one of slurm, docker, local"),
    ("executor: slurm\n", "executor=slurm needs account"),
    ("account: a\nnodes: 0\n", "nodes=0 must be a whole number >= 1"),
    ("account: a\ngpus_per_node: true\n", "gpus_per_node=True must be a whole number >= 1"),
    ("account: a\nnodes: '2'\n", "nodes='2' must be a whole number >= 1"),
])
def test_bad_launch_configs_are_one_line_errors(tmp_path, capsys, text, message):
    assert main(["launch", str(write_launch(tmp_path, text)), "--dryrun", "train"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_launch_without_a_command_is_refused(tmp_path, capsys):
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun"]) == 2
    assert "needs the command to run" in capsys.readouterr().err
