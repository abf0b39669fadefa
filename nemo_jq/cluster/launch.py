"""``nemo-jq launch``: run a nemo-jq command through NeMo-Run on SLURM, Docker or this machine.

A small YAML launch config picks the executor and its resources; the command is the same words
one would give ``nemo-jq`` (``train --config ... key=value ...``). On SLURM ``srun`` starts one process
per GPU itself (no torchrun: torchrun 2.13 dies on the ``--signal=USR1`` SLURM sends before the time
limit, and its workers never see it), each joining from SLURM's step variables with the first node as
the rendezvous; ``train`` runs with ``--requeue``, so the signal writes a checkpoint and requeues the
job, which resumes: ``train --requeue`` exits with 75 after the time-limit signal's checkpoint, and the
batch script requeues the job from the host (a pyxis container has no ``scontrol``; docs/cluster.md). Docker and local runs
start under ``torchrun``. NeMo-Run keeps its files under ``job_dir/experiments/nemo-jq/<id>/`` and submits the
script it wrote there. ``--dryrun`` prints the sbatch script NeMo-Run would submit (rendered by NeMo-Run's own
``SlurmBatchRequest``) without touching SLURM or writing a file. Needs the ``launch`` extra
(``nemo-run==0.11.1`` with ``leptonai<0.47``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_jq.runtime.preemption import REQUEUE_EXIT_CODE

EXECUTORS = ("slurm", "docker", "local")
#: SLURM's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (sbatch rejects ``4h``).
SLURM_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)")
#: ``--mem``: a size with an optional K/M/G/T unit; 0: all of each node's memory.
SLURM_MEM = re.compile(r"\d+[KMGT]?")
#: The experiment title NeMo-Run files the job under (``job_dir/experiments/nemo-jq/nemo-jq_<id>``).
TITLE = "nemo-jq"
#: The batch script's last word after ``train --requeue`` exits with :data:`~nemo_jq.runtime.preemption.REQUEUE_EXIT_CODE`:
#: requeue the job, from the host (docs/cluster.md). A trap on the script's exit, as NeMo-Run's template has no lines
#: after srun, and ends with ``exit $exitcode``.
REQUEUE_ON_EXIT = (f"trap 'status=$?; if [ \"$status\" = {REQUEUE_EXIT_CODE} ]; then echo \"nemo-jq: requeueing job "
                   "$SLURM_JOB_ID; it resumes from the checkpoint just written\"; scontrol requeue \"$SLURM_JOB_ID\" || "
                   "echo \"nemo-jq: job $SLURM_JOB_ID was not requeued (requeued or cancelled from outside?)\"; exit 0; "
                   "fi' EXIT")


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
    #: The network interface the ranks talk over (multi-NIC nodes, containers): GLOO_SOCKET_IFNAME and
    #: NCCL_SOCKET_IFNAME, unless ``env`` sets them (``nemo-jq doctor`` says whether it resolves on a node).
    network_interface: str | None = None
    #: Where NeMo-Run keeps its job files and logs (on SLURM: a shared filesystem).
    job_dir: str = "nemo_run_jobs"
    signal: str = "USR1@300"
    #: The rendezvous port on the first node (SLURM).
    master_port: int = 29500
    #: SLURM: whole nodes (``--exclusive``), each node's memory (``--mem``; "0": all of it), CPUs per task (GPU).
    exclusive: bool = True
    mem: str = "0"
    cpus_per_task: int | None = None


def load_launch_config(path: Path) -> LaunchConfig:
    """Read a launch YAML; unknown keys and impossible values raise ``ValueError`` naming them."""
    from nemo_jq.strict_yaml import read_yaml_file

    values = read_yaml_file(Path(path)) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a launch config is a mapping of keys to values")
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        close = [match for key in unknown for match in difflib.get_close_matches(key, known, n=1)]
        raise ValueError(f"{path}: unknown launch key(s) {', '.join(unknown)}"
                         + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                         + f"; known: {', '.join(sorted(known))}")
    config = LaunchConfig(**values)
    if config.executor not in EXECUTORS:
        raise ValueError(f"{path}: executor={config.executor!r}; choose one of {', '.join(EXECUTORS)}")
    if config.executor == "slurm" and not config.account:
        raise ValueError(f"{path}: executor=slurm needs account (the SLURM account to charge)")
    if config.executor != "local" and not config.container_image:
        raise ValueError(f"{path}: executor={config.executor} needs container_image: REGISTRY#IMAGE:TAG for pyxis "
                         "(nvcr.io#nvidia/pytorch:25.04-py3), or a squashfs path every node sees (/shared/nemo-jq.sqsh)")
    for key in ("nodes", "gpus_per_node", *(("cpus_per_task",) if config.cpus_per_task is not None else ())):
        value = getattr(config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{path}: {key}={value!r} must be a whole number >= 1")
    if not isinstance(config.time, str) or not SLURM_TIME.fullmatch(config.time):
        raise ValueError(f"{path}: time={config.time!r} is not a SLURM time limit: write it quoted as \"HH:MM:SS\", "
                         "\"D-HH:MM:SS\" or minutes (\"240\"); an unquoted 2:00:00 is YAML's number 7200")
    if not isinstance(config.mem, str) or not SLURM_MEM.fullmatch(config.mem):
        raise ValueError(f"{path}: mem={config.mem!r} is not a SLURM memory size: \"0\" (all of the node's), \"512G\", ...")
    interface = config.network_interface
    if interface is not None and (not isinstance(interface, str) or not re.fullmatch(r"[=^]?[\w.:-]+(,[\w.:-]+)*", interface)):
        raise ValueError(f"{path}: network_interface={interface!r} is not an interface name: write it as the node calls it "
                         "(ib0, eth0; a comma-separated list, as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME take it), or "
                         "leave it out")
    if not isinstance(config.exclusive, bool):
        raise ValueError(f"{path}: exclusive={config.exclusive!r} must be true or false")
    return config


def build_executor(config: LaunchConfig) -> Any:
    import nemo_run as run

    interface = config.network_interface
    sockets = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if interface else {}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", **sockets, **config.env}
    if config.executor == "slurm":  # srun starts a process per GPU; nemo_jq.runtime.distributed joins from SLURM's variables
        return run.SlurmExecutor(
            account=config.account, partition=config.partition, nodes=config.nodes, ntasks_per_node=config.gpus_per_node,
            gpus_per_node=config.gpus_per_node, launcher=None, time=config.time, container_image=config.container_image,
            container_mounts=list(config.container_mounts), env_vars={"MASTER_PORT": str(config.master_port), **env},
            setup_lines="\n".join(['export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                                    REQUEUE_ON_EXIT]),
            signal=config.signal, exclusive=config.exclusive or None, mem=config.mem, cpus_per_task=config.cpus_per_task,
            job_name_prefix=f"{TITLE}-",  # the job is nemo-jq-<command> (NeMo-Run's own: <account>-<account>.<name>)
            # where NeMo-Run writes the script (the experiment's folder under job_dir) is where it submits it from
            tunnel=run.LocalTunnel(job_dir=str(Path(config.job_dir).resolve() / "experiments")), packager=run.Packager())
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


def sbatch_script(config: LaunchConfig, command: list[str]) -> str:
    """The sbatch script NeMo-Run would submit, rendered as its SLURM scheduler's dry run does, with the paths a
    submission would have (``job_dir/experiments/nemo-jq/nemo-jq_dryrun/<command>``); nothing is written there."""
    from nemo_run.core.execution.slurm import SlurmBatchRequest
    from nemo_run.run.torchx_backend.packaging import package

    name = command[0]
    experiment_id = f"{TITLE}_dryrun"
    real = str(Path(config.job_dir).resolve())
    with tempfile.TemporaryDirectory() as scratch:
        executor = build_executor(dataclasses.replace(config, job_dir=scratch))
        experiment_dir = str(Path(scratch) / "experiments" / TITLE / experiment_id)
        executor.assign(experiment_id, experiment_dir, name, name)
        role = package(name, task(command, config.executor), executor=executor).roles[0]
        macros = executor.macro_values()
        if macros:
            role = macros.apply(role)
        request = SlurmBatchRequest(launch_cmd=["sbatch", "--requeue", "--parsable"], jobs=[role.name],
                                    command_groups=[[" ".join([role.entrypoint, *role.args])]], executor=executor,
                                    max_retries=role.max_retries, extra_env=role.env, launcher=executor.get_launcher())
        return request.materialize().replace(scratch, real)


def separate_rollout_ranks(config: Path | None, overrides: list[str]) -> int:
    """``rollout.ranks`` when the run's config, loaded as ``train`` loads it, sets ``rollout.placement=separate``; 0
    otherwise (every rank trains and samples). A config this host cannot read (a launch may name a path inside the
    container) leaves the defaults and the overrides of the two keys."""
    from nemo_jq.config import load_config

    if config is None or not Path(config).is_file():
        config, overrides = None, [o for o in overrides if o.partition("=")[0] in ("rollout.placement", "rollout.ranks")]
    rollout = load_config(config, overrides).rollout
    return rollout.own_ranks


def train_config(command: list[str]) -> Any | None:
    """The config a launched ``train`` command trains, checked here before anything is written or queued: its file
    and overrides as ``train`` loads them where the file is readable here; where it is not (a path inside the
    container, or ``--resume``'s run), the overrides alone against the schema (keys with a did-you-mean, types,
    ranges), said in a line, and the defaults under the overrides of the rollout split's keys. None for another
    command."""
    import argparse

    from nemo_jq.config import check_overrides, load_config

    if command[:1] != ["train"]:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", type=Path)
    parser.add_argument("--resume", type=Path)
    known, rest = parser.parse_known_args(command[1:])
    overrides = [word for word in rest if "=" in word and not word.startswith("-")]
    if known.config is not None and known.config.is_file():
        return load_config(known.config, overrides)
    check_overrides(overrides)
    unread = known.config or known.resume
    if unread is not None:
        print(f"nemo-jq launch: {unread} is not readable here: the overrides were checked against the schema, the "
              "whole config is checked when the job starts", file=sys.stderr)
    return load_config(None, [o for o in overrides if o.partition("=")[0] in ("rollout.placement", "rollout.ranks")])


def roles(config: LaunchConfig, command: list[str]) -> str | None:
    """Which of the job's ranks train and which sample (``rollout.placement=separate``: the last ``rollout.ranks``;
    srun numbers the tasks node by node, so they are the allocation's last GPUs), as a comment line; None when every
    rank trains. A split that leaves no training rank is an error before anything is queued."""
    trained = train_config(command)
    rollout = trained.rollout.own_ranks if trained is not None else 0
    if not rollout:
        return None
    from nemo_jq.runtime.distributed import role_of

    world, per_node = config.nodes * config.gpus_per_node, config.gpus_per_node
    if rollout >= world:
        raise ValueError(f"rollout.ranks={rollout} leaves no training rank among the job's {world} GPUs (nodes="
                         f"{config.nodes} x gpus_per_node={per_node}): more nodes, or fewer rollout.ranks")
    spans = {}
    for rank in range(world):
        spans.setdefault(role_of(rank, world, rollout)[0], []).append(rank)

    def where(ranks: list[int]) -> str:
        first, last = ranks[0] // per_node, ranks[-1] // per_node
        return f"ranks {ranks[0]}-{ranks[-1]} " + (f"(node {first})" if first == last else f"(nodes {first}-{last})")

    return (f"# nemo-jq roles (rollout.placement=separate, rollout.ranks={rollout}): {where(spans['training'])} train, "
            f"{where(spans['rollout'])} sample; nodes counted from 0 in the allocation's order")


def launch(config: LaunchConfig, command: list[str], *, dryrun: bool) -> str | None:
    """Submit ``command`` (or, with ``dryrun`` on SLURM, return the script instead, with the roles of a split world
    as a comment after its first line); a submission returns a line naming the job and where NeMo-Run keeps its
    files (and the roles)."""
    import nemo_run as run

    split = roles(config, command)
    if dryrun and config.executor == "slurm":
        first, rest = sbatch_script(config, command).split("\n", 1)
        return "\n".join([first, split, rest]) if split else "\n".join([first, rest])
    executor = build_executor(config)
    if dryrun:
        run.run(task(command, config.executor), executor=executor, name=TITLE, dryrun=True)
        return None
    with run.Experiment(title=TITLE, executor=executor, base_dir=str(Path(config.job_dir).resolve()), log_level="WARN") as exp:
        exp.add(task(command, config.executor), name=command[0])
        exp.run(detach=True)
        submitted = exp.jobs[0]
    files, split = submitted.executor.job_dir, f"\n{split.removeprefix('# ')}" if split else ""
    if config.executor == "slurm":
        return f"nemo-jq launch: submitted SLURM job {submitted.handle.rsplit('/', 1)[-1]}; its files: {files}{split}"
    return f"nemo-jq launch: started {submitted.handle}; its files: {files}{split}"


#: The batch script each task of a sweep's job array runs (``nemo-jq sweep --task DIR``), in a checkout of this project.
SWEEP_LAUNCHER = Path(__file__).resolve().parents[2] / "launchers" / "slurm.sbatch"


def submit_sweep(sweep: Any, options: list[str], launcher: Path = SWEEP_LAUNCHER) -> str:
    """Submit ``sweep``'s unfinished runs as one SLURM job array (task K: run K of its ``sweep.json``), each task
    ``nemo-jq sweep --task DIR`` through ``launcher`` (its run, requeued after the time-limit signal), one GPU a task
    unless ``options`` (sbatch's) say otherwise, its output ``DIR/logs/task-K.out``; says so and returns the job id."""
    import subprocess

    from nemo_jq.runtime.sweep import FINISHED, LOGS_DIR

    unfinished = [index for index, run in enumerate(sweep.runs) if sweep.status(run) != FINISHED]
    if not unfinished:
        print(f"nemo-jq sweep: every run of {sweep.directory} has finished; nothing to submit")
        return ""
    if not launcher.exists():
        raise FileNotFoundError(f"{launcher} is missing: --slurm submits this project's launchers/slurm.sbatch, from a "
                                "checkout (pip install -e .)")
    directory = sweep.directory.absolute()
    (directory / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    gpus = [] if any(option.startswith(("--gpus", "--gres", "-G")) for option in options) else ["--gpus-per-node=1"]
    command = ["sbatch", "--parsable", f"--array={','.join(map(str, unfinished))}", "--job-name=nemo-jq-sweep",
               f"--output={directory / LOGS_DIR}/task-%a.out", *gpus, *options, str(launcher), "sweep", "--task",
               str(directory)]
    submitted = subprocess.run(command, capture_output=True, text=True)
    if submitted.returncode != 0:
        raise ValueError(f"sbatch refused the sweep's array ({' '.join(submitted.stderr.split())}): {' '.join(command)}")
    job = submitted.stdout.strip().split(";")[0]
    print(f"nemo-jq sweep: submitted job array {job}: {len(unfinished)} of {len(sweep.runs)} runs of {directory} "
          f"(tasks {','.join(map(str, unfinished))}: their place in sweep.json), output in "
          f"{directory / LOGS_DIR}/task-K.out; `nemo-jq report {directory}` once they have finished")
    return job
