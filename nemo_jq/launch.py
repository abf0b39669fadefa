"""``nemo-jq launch``: run a nemo-jq command through NeMo-Run on SLURM, Docker or this machine.

A small YAML launch config picks the executor and its resources; the command is the same words
one would give ``nemo-jq`` (``train --config ... key=value ...``). On SLURM ``srun`` starts one process
per GPU itself (no torchrun: torchrun 2.13 dies on the ``--signal=USR1`` SLURM sends before the time
limit, and its workers never see it), each joining from SLURM's step variables with the first node as
the rendezvous; ``train`` runs with ``--requeue``, so the signal writes a checkpoint and requeues the
job, which resumes. Docker and local runs start under ``torchrun``. ``--dryrun`` prints the sbatch
script NeMo-Run would submit (rendered by NeMo-Run's own ``SlurmBatchRequest``) without touching
SLURM. Needs the ``launch`` extra (``nemo-run==0.11.1`` with ``leptonai<0.47``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXECUTORS = ("slurm", "docker", "local")


@dataclass
class LaunchConfig:
    executor: str = "slurm"
    account: str | None = None
    partition: str | None = None
    nodes: int = 1
    gpus_per_node: int = 8
    time: str = "04:00:00"
    #: What pyxis/enroot (SLURM) or Docker runs: ``REGISTRY#IMAGE:TAG`` (``nvcr.io#nvidia/pytorch:25.04-py3``) or a
    #: squashfs path on a filesystem every node sees (``enroot import -o /shared/nemo-jq.sqsh dockerd://nemo-jq``).
    container_image: str | None = None
    #: host:container pairs; the config and run directory must be reachable through them (absolute paths).
    container_mounts: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: Where NeMo-Run keeps its job files and logs (on SLURM: a shared filesystem).
    job_dir: str = "nemo_run_jobs"
    signal: str = "USR1@300"
    #: The rendezvous port on the first node (SLURM).
    master_port: int = 29500


def load_launch_config(path: Path) -> LaunchConfig:
    """Read a launch YAML; unknown keys and impossible values raise ``ValueError`` naming them."""
    import yaml

    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a launch config is a mapping of keys to values")
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{path}: unknown launch key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    config = LaunchConfig(**values)
    if config.executor not in EXECUTORS:
        raise ValueError(f"{path}: executor={config.executor!r}; choose one of {', '.join(EXECUTORS)}")
    if config.executor == "slurm" and not config.account:
        raise ValueError(f"{path}: executor=slurm needs account (the SLURM account to charge)")
    if config.executor != "local" and not config.container_image:
        raise ValueError(f"{path}: executor={config.executor} needs container_image: REGISTRY#IMAGE:TAG for pyxis "
                         "(nvcr.io#nvidia/pytorch:25.04-py3), or a squashfs path every node sees (/shared/nemo-jq.sqsh)")
    for key in ("nodes", "gpus_per_node"):
        value = getattr(config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{path}: {key}={value!r} must be a whole number >= 1")
    return config


def build_executor(config: LaunchConfig) -> Any:
    import nemo_run as run

    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", **config.env}
    if config.executor == "slurm":  # srun starts a process per GPU; nemo_jq.distributed joins from SLURM's variables
        return run.SlurmExecutor(
            account=config.account, partition=config.partition, nodes=config.nodes, ntasks_per_node=config.gpus_per_node,
            gpus_per_node=config.gpus_per_node, launcher=None, time=config.time, container_image=config.container_image,
            container_mounts=list(config.container_mounts), env_vars={"MASTER_PORT": str(config.master_port), **env},
            setup_lines='export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            signal=config.signal, tunnel=run.LocalTunnel(job_dir=str(Path(config.job_dir).resolve())),
            packager=run.Packager())
    if config.executor == "docker":
        return run.DockerExecutor(container_image=config.container_image, num_gpus=config.gpus_per_node,
                                  ntasks_per_node=config.gpus_per_node, launcher="torchrun",
                                  volumes=list(config.container_mounts), env_vars=env, job_dir=config.job_dir,
                                  packager=run.Packager())
    return run.LocalExecutor(ntasks_per_node=config.gpus_per_node, launcher="torchrun", env_vars=env)


def task(command: list[str], executor: str) -> Any:
    """``python -m nemo_jq.cli COMMAND`` on every GPU; on SLURM a ``train`` runs with ``--requeue`` (the requeued
    job runs the same command, which resumes)."""
    import nemo_run as run

    command = list(command)
    if executor == "slurm" and command[:1] == ["train"] and "--requeue" not in command:
        command.insert(1, "--requeue")
    return run.Script(path="nemo_jq.cli", entrypoint="python", m=True, args=command)


def sbatch_script(config: LaunchConfig, command: list[str], name: str = "nemo-jq") -> str:
    """The sbatch script NeMo-Run would submit, rendered as its SLURM scheduler's dry run does."""
    from nemo_run.core.execution.slurm import SlurmBatchRequest
    from nemo_run.run.torchx_backend.packaging import package

    executor = build_executor(config)
    executor.assign("dryrun", str(Path(config.job_dir).resolve() / "dryrun"), name, name)
    role = package(name, task(command, config.executor), executor=executor).roles[0]
    macros = executor.macro_values()
    if macros:
        role = macros.apply(role)
    request = SlurmBatchRequest(launch_cmd=["sbatch", "--requeue", "--parsable"], jobs=[role.name],
                                command_groups=[[" ".join([role.entrypoint, *role.args])]], executor=executor,
                                max_retries=role.max_retries, extra_env=role.env, launcher=executor.get_launcher())
    return request.materialize()


def launch(config: LaunchConfig, command: list[str], *, dryrun: bool) -> str | None:
    """Submit ``command`` (or, with ``dryrun`` on SLURM, return the script instead)."""
    import nemo_run as run

    if dryrun and config.executor == "slurm":
        return sbatch_script(config, command)
    run.run(task(command, config.executor), executor=build_executor(config), name="nemo-jq", dryrun=dryrun, detach=True)
    return None
