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

Why one file (near 600 lines): every check here reads the one launch config against the one run config before
anything is queued; the executors differ in a few lines each.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import re
import shutil
import sys
import tempfile
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jq.runtime.preemption import REQUEUE_EXIT_CODE
from nemo_jq.typed import ConfigError, check_range, check_type, option

EXECUTORS = ("slurm", "docker", "local")
#: Where NeMo-Run starts the job's command under SLURM and Docker: a relative path is read there, not where it was typed.
JOB_WORKDIR = "/nemo_run/code"
#: The launch keys SLURM reads in a form of its own (each into the batch script): the form, and how to write it.
SLURM_FORMS = {
    #: SLURM's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (sbatch rejects ``4h``).
    "time": (re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)"),
             'is not a SLURM time limit: write it quoted as "HH:MM:SS", "D-HH:MM:SS" or minutes ("240")'),
    #: ``--mem``: a size with an optional K/M/G/T unit; 0: all of each node's memory.
    "mem": (re.compile(r"\d+[KMGT]?"), 'is not a SLURM memory size: "0" (all of the node\'s), "512G", ...'),
    #: ``--signal``: ``[{R|B}:]SIGNAL[@SECONDS]``, the signal by name or number (:func:`check_signal` then asks for
    #: the one the trainer requeues on).
    "signal": (re.compile(r"([RB]{1,2}:)?(SIG)?([A-Z][A-Z0-9]*|\d+)(@\d+)?"),
               "is not a signal as sbatch --signal takes it: USR1@300 (SIGUSR1 300 s before the time limit, the one the "
               "trainer checkpoints and requeues on)"),
    "account": (re.compile(r"[\w.-]+"), "is not a SLURM account name: one name, as sacctmgr lists it"),
    "partition": (re.compile(r"[\w.-]+(,[\w.-]+)*"), "is not a SLURM partition: one name, or several comma-separated "
                  "(batch,debug)"),
    "network_interface": (re.compile(r"[=^]?[\w.:-]+(,[\w.:-]+)*"),
                          "is not an interface name: write it as the node calls it (ib0, eth0; a comma-separated list, "
                          "as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME take it), or leave it out"),
}
#: A name the batch script can ``export`` (NeMo-Run writes ``export NAME=value``).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
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
    executor: str = option("slurm", choices=EXECUTORS)
    account: str | None = None
    partition: str | None = None
    nodes: int = option(1, ge=1)
    gpus_per_node: int = option(8, ge=1)
    time: str = "04:00:00"
    #: What pyxis/enroot (SLURM) or Docker runs: ``REGISTRY#IMAGE:TAG`` (``nvcr.io#nvidia/pytorch:25.04-py3``) or a
    #: squashfs path on a filesystem every node sees (``enroot import -o /shared/nemo-jq.sqsh dockerd://nemo-jq``).
    container_image: str | None = None
    #: host:container pairs; the config and run directory must be reachable through them (absolute paths).
    container_mounts: list[str] = option(factory=list, help="a YAML list of host:container pairs, e.g. "
                                         "container_mounts: [/lustre/me:/lustre/me]")
    env: dict[str, str] = option(factory=dict, help="a mapping of names to quoted values, e.g. env: {NCCL_IB_HCA: mlx5, "
                                 "OMP_NUM_THREADS: '4'}")
    #: The network interface the ranks talk over (multi-NIC nodes, containers): GLOO_SOCKET_IFNAME and
    #: NCCL_SOCKET_IFNAME, unless ``env`` sets them (``nemo-jq doctor`` says whether it resolves on a node).
    network_interface: str | None = None
    #: Where NeMo-Run keeps its job files and logs (on SLURM: a shared filesystem).
    job_dir: str = "nemo_run_jobs"
    signal: str = "USR1@300"
    #: The rendezvous port on the first node (SLURM).
    master_port: int = option(29500, help="a free TCP port number, e.g. master_port: 29500", ge=1, le=65535)
    #: SLURM: whole nodes (``--exclusive``), each node's memory (``--mem``; "0": all of it), CPUs per task (GPU).
    exclusive: bool = True
    mem: str = "0"
    cpus_per_task: int | None = option(None, ge=1)


def load_launch_config(path: Path) -> LaunchConfig:
    """Read a launch YAML; an unknown key, a value of the wrong type or form (its values go into a batch script), or an
    impossible combination raises ``ConfigError`` naming the file and the key."""
    from nemo_jq.strict_yaml import read_yaml_file

    values = read_yaml_file(Path(path)) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a launch config is a mapping of keys to values")
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(map(str, set(values) - known))
    if unknown:
        close = [match for key in unknown for match in difflib.get_close_matches(key, known, n=1)]
        raise ConfigError(f"{path}: unknown launch key(s) {', '.join(unknown)}"
                          + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                          + f"; known: {', '.join(sorted(known))}")
    for key, (form, fix) in SLURM_FORMS.items():
        value = values.get(key)
        if value is not None and not (isinstance(value, str) and form.fullmatch(value)):
            raise ConfigError(f"{path}: {key}={value!r} {fix}")
    if values.get("signal") is not None:
        check_signal(path, values["signal"])
    hints = typing.get_type_hints(LaunchConfig)
    for spec in dataclasses.fields(LaunchConfig):
        if spec.name in values:
            try:
                check_range(check_type(values[spec.name], hints[spec.name], spec.name), spec.metadata, spec.name)
            except ConfigError as err:
                how = spec.metadata.get("help")
                raise ConfigError(f"{path}: {err}" + (f"; write {how}" if how else "")) from None
    config = LaunchConfig(**values)
    check_env(path, config.env, config.executor)
    for mount in config.container_mounts:  # into srun's --container-mounts (a comma list) and docker's volumes as given
        host, target, _ = mount_sides(mount)
        if "," in mount or not host.is_absolute() or not target.is_absolute() or mount.count(":") > 2:
            raise ConfigError(f"{path}: container_mounts entry {mount!r} is not /host/path[:/container/path[:options]] "
                              "(absolute paths, no commas): write e.g. /lustre/me:/lustre/me")
    if config.executor == "slurm" and not config.account:
        raise ConfigError(f"{path}: executor=slurm needs account (the SLURM account to charge)")
    if config.executor != "local" and not config.container_image:
        raise ConfigError(f"{path}: executor={config.executor} needs container_image: REGISTRY#IMAGE:TAG for pyxis "
                          "(nvcr.io#nvidia/pytorch:25.04-py3), or a squashfs path every node sees (/shared/nemo-jq.sqsh)")
    # sbatch --signal without @SECONDS sends it 60 s before the limit
    limit, lead = slurm_seconds(config.time), int(config.signal.partition("@")[2] or 60) if config.signal else None
    if config.executor == "slurm" and limit is not None and lead is not None and limit <= lead:
        raise ConfigError(f"{path}: time={config.time!r} is no longer than the time-limit signal's lead "
                          f"(signal={config.signal!r}: {lead} s before the limit): it would arrive before the run's first "
                          "step, and each requeue would start it again: give a longer time, or a shorter lead")
    if config.executor != "slurm" and config.nodes > 1:  # NeMo-Run's local and docker executors use this host alone
        raise ConfigError(f"{path}: nodes={config.nodes} but executor={config.executor} starts every process on this "
                          "machine: set nodes: 1 (gpus_per_node processes), or use executor: slurm for several nodes")
    return config


def slurm_seconds(limit: str) -> int | None:
    """A SLURM time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds; None where it has none."""
    if limit.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, _, clock = limit.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    if days:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = [*parts, 0, 0][:3]
    elif len(parts) == 3:  # HH:MM:SS
        hours, minutes, seconds = parts
    else:  # MM[:SS]
        hours, minutes, seconds = 0, parts[0], parts[1] if len(parts) == 2 else 0
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_signal(path: Path, value: str) -> None:
    """The time-limit signal must reach the run's processes and be the one ``train --requeue`` requeues on (SIGUSR1):
    sbatch's ``B:`` sends it to the batch shell alone (the run never hears it and dies at the limit without a
    checkpoint), and another signal stops the run unrequeued (TERM, INT, HUP: a checkpoint, then the job ends) or
    kills it. Refused in one line saying which."""
    import signal

    flags, _, rest = value.rpartition(":")
    name = rest.split("@", 1)[0].removeprefix("SIG")
    usr1 = name == "USR1" or name == str(int(signal.SIGUSR1))
    why = ("B: sends it to the batch shell alone, which does not pass it to the run's processes (they never checkpoint)"
           if "B" in flags else None if usr1 else
           f"SIG{name} checkpoints and ends the run without a requeue (only SIGUSR1 requeues it)"
           if name in ("TERM", "INT", "HUP", *(str(int(getattr(signal, f"SIG{n}"))) for n in ("TERM", "INT", "HUP")))
           else f"{name} is not a signal the trainer checkpoints on (it requeues on SIGUSR1)")
    if why:
        raise ConfigError(f"{path}: signal={value!r}: {why}: write {'R:' * ('R' in flags)}USR1@SECONDS (USR1@300: 300 s "
                          "before the time limit)")


def check_env(path: Path, env: dict[Any, Any], executor: str) -> None:
    """Each ``env`` name one the batch script can export as it is written (NeMo-Run's SLURM script exports each name
    upper-cased: ``http_proxy`` would arrive as ``HTTP_PROXY``), each value a string (YAML reads 4 or true as others)."""
    import json

    for name, value in env.items():
        if not (isinstance(name, str) and ENV_NAME.fullmatch(name)):
            raise ConfigError(f"{path}: env name {name!r} is not a shell variable name (letters, digits and _, not "
                              "starting with a digit): rename it")
        if executor == "slurm" and name != name.upper():
            raise ConfigError(f"{path}: env name {name!r} has lower-case letters, and NeMo-Run's SLURM script exports "
                              f"it as {name.upper()}: give it in upper case, or set {name} in the job's own environment")
        if isinstance(value, (bool, int, float)):
            raise ConfigError(f"{path}: env {name}={value!r} must be a string: quote it ({name}: '{json.dumps(value)}')")
        if value is None:
            raise ConfigError(f"{path}: env {name} has no value: give it one, quoted ({name}: '...'), or leave {name} out")
        if not isinstance(value, str):
            raise ConfigError(f"{path}: env {name}={value!r} must be a string: write one, quoted ({name}: '...')")


def job_shell_value(value: str) -> str:
    """``value`` as the batch script's ``export NAME=value`` line takes it (NeMo-Run writes it unquoted): in double
    quotes, so that spaces and ``;`` stay in the value, while the job's own variables still expand (``$USER``,
    ``$SLURM_JOB_ID``: a per-user scratch path is the usual reason to set one); a plain word as it is."""
    if re.fullmatch(r"[\w@%+=:,./-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'


def build_executor(config: LaunchConfig) -> Any:
    import nemo_run as run

    interface = config.network_interface
    sockets = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if interface else {}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", **sockets, **config.env}
    if config.executor == "slurm":  # srun starts a process per GPU; nemo_jq.runtime.distributed joins from SLURM's variables
        return run.SlurmExecutor(
            account=config.account, partition=config.partition, nodes=config.nodes, ntasks_per_node=config.gpus_per_node,
            gpus_per_node=config.gpus_per_node, launcher=None, time=config.time, container_image=config.container_image,
            container_mounts=list(config.container_mounts),
            env_vars={name: job_shell_value(value) for name, value in {"MASTER_PORT": str(config.master_port), **env}.items()},
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


#: The run's keys that name a file or folder the job reads or writes, made absolute where the job runs elsewhere.
RUN_PATH_KEYS = ("train.run_dir", "data.prepared_dir", "model.path", "data.source")


def train_config(command: list[str], arguments: Any, launch_config: LaunchConfig) -> Any | None:
    """The config a launched ``train`` command (``arguments``: its words as ``train`` parses them) trains, checked here
    before anything is written or queued, its :data:`RUN_PATH_KEYS` too (:func:`check_job_paths`): its file and
    overrides as ``train`` loads them where the file is readable here or there is none (the defaults, under which
    ``train.run_dir`` is relative); where it is not (a path inside the container, or ``--resume``'s run), the overrides
    alone against the schema (keys with a did-you-mean, types, ranges), said in a line, and the defaults under the
    overrides of the rollout split's keys. The demo (``train`` with no config and no overrides): its folder. None for
    the demo and for another command."""
    from nemo_jq.config import check_overrides, load_config
    from nemo_jq.recipe.demo import DEMO_DIR, QUICK_DIR, asks_for_demo

    if command[0] != "train":
        return None
    overrides = arguments.overrides
    if asks_for_demo(arguments):
        check_job_paths(launch_config, {"--demo-dir": arguments.demo_dir or (QUICK_DIR if arguments.quick else DEMO_DIR)})
        return None
    if (arguments.config is None and arguments.resume is None) or (arguments.config is not None
                                                                   and arguments.config.is_file()):
        config = load_config(arguments.config, overrides)
        check_job_paths(launch_config, {key: operator.attrgetter(key)(config) for key in RUN_PATH_KEYS})
        check_world(config, launch_config)
        check_run_dir(config, launch_config)
        return config
    check_overrides(overrides)
    given = dict(override.split("=", 1) for override in overrides)
    check_job_paths(launch_config, {key: given[key] for key in RUN_PATH_KEYS if key in given})
    unread = arguments.config or arguments.resume
    if unread is not None:
        print(f"nemo-jq launch: {unread} is not readable here: the overrides were checked against the schema, the "
              "whole config is checked when the job starts", file=sys.stderr)
    return load_config(None, [f"{key}={given[key]}" for key in ("rollout.placement", "rollout.ranks") if key in given])


#: The commands that run over a job's processes (a process a GPU); every other runs in one.
OVER_PROCESSES = ("train", "eval", "generate", "export", "doctor")


def check_processes(config: LaunchConfig, command: str) -> None:
    """A command that runs in one process gets a job of one: the job starts one a GPU, and each ran the whole command
    (two copies of a sweep, one refused as the other's folder, and the job FAILED)."""
    processes = config.nodes * config.gpus_per_node
    if command not in OVER_PROCESSES and processes > 1:
        raise ConfigError(f"nemo-jq {command} runs in one process, but the job starts {processes} (nodes={config.nodes} "
                          f"x gpus_per_node={config.gpus_per_node} in the launch YAML), each running it whole: give it "
                          "nodes: 1 and gpus_per_node: 1" + ("; or submit the sweep's runs as a job array, one GPU each "
                                                              "(nemo-jq sweep --slurm)" if command == "sweep" else ""))


def check_world(config: Any, launch_config: LaunchConfig) -> None:
    """The config trains over the job's processes (a process a GPU: ``nodes`` x ``gpus_per_node``, its rollout ranks
    aside), as each rank checks at its start: refused here, before the job waits in the queue to fail. The hf backend
    trains in one process; a Megatron layout divides the processes (and, where this machine knows the model's shape,
    the model: plan's rule), and its data-parallel replicas split the batch."""
    from nemo_jq.cluster.plan import architecture

    job = f"nodes={launch_config.nodes} x gpus_per_node={launch_config.gpus_per_node} in the launch YAML"
    world = launch_config.nodes * launch_config.gpus_per_node - config.rollout.own_ranks
    if world < 1:
        return  # roles() says what is wrong with that split
    if config.model.backend == "hf":
        if world > 1:
            raise ConfigError(f"model.backend=hf trains in one process, but the job starts {world} training processes "
                              f"({job}): give the job one GPU, or train with model.backend=megatron (`nemo-jq plan "
                              "--config ...` gives its layout)")
        return
    try:
        arch = architecture(str(config.model.path)) if config.model.path else None
    except ValueError:  # a path inside the container: the ranks check the model's shape
        arch = None
    layout = config.megatron
    layout.validate(arch, world, processes_from=job)
    if arch is not None:
        layout.check_trainable(arch)
    replicas = layout.data_parallel(world)
    if config.train.batch_size % replicas:
        raise ConfigError(f"train.batch_size={config.train.batch_size} does not split over the {replicas} data-parallel "
                          f"replicas of {world} training processes ({job}): make it a multiple of {replicas}, or change "
                          "the job's GPUs")


def host_side(config: LaunchConfig, path: str) -> tuple[Path, str] | None:
    """Where the job's ``path`` is on this machine, and its mount's options (``ro``...): the path itself under the
    local executor, else through the ``container_mounts`` (``host:container[:options]``) it is under; None where it
    is under none, or relative (the job's code folder)."""
    if config.executor == "local":
        return Path(path).expanduser(), ""
    for host, target, options in map(mount_sides, config.container_mounts):
        if path.startswith("/") and Path(path).is_relative_to(target):
            return host / Path(path).relative_to(target), options
    return None


def mount_sides(mount: str) -> tuple[Path, Path, str]:
    """A ``container_mounts`` entry's host side, container side and options (``host:container[:options]``, or one path
    mounted at itself)."""
    host, _, rest = mount.partition(":")
    target, _, options = (rest or host).partition(":")
    return Path(host), Path(target), options


def check_run_dir(config: Any, launch_config: LaunchConfig) -> None:
    """``train.run_dir`` as the job will find it, where this machine sees it, checked as the job's ``train --requeue``
    would at its start, before the job waits in the queue to fail: a read-only mount, or a folder holding another run
    (other settings), is refused; one a run holds now is said (the job fails at its start if it still holds it then)."""
    from nemo_jq.runtime.outputs import holder_of
    from nemo_jq.runtime.runs import holds_this_run

    found = host_side(launch_config, str(config.train.run_dir))
    if found is None:
        return
    here, options = found
    if "ro" in options.split(","):
        raise ConfigError(f"train.run_dir={config.train.run_dir} is under a read-only mount ({options} in "
                          "container_mounts): the run could not write there; mount its folder read-write")
    if not here.is_dir():
        return
    holds_this_run(dataclasses.replace(config, train=dataclasses.replace(config.train, run_dir=str(here))))
    if (holder := holder_of(here)) is not None:
        print(f"nemo-jq launch: warning: {here} is in use by another run now ({holder}): the job fails at its start "
              "if that run still holds it then", file=sys.stderr)


def check_job_paths(config: LaunchConfig, paths: dict[str, Any]) -> None:
    """Under SLURM and Docker the job runs in NeMo-Run's code folder (:data:`JOB_WORKDIR`), where a relative path
    names nothing of the user's: each of ``paths`` (the command's path arguments and :data:`RUN_PATH_KEYS`; a
    ``model.path`` only where it is not a hub name, by the rule the model's loader reads it by; a ``data.source`` only
    where it names a file, by its suffix or one here, not a hub dataset) must be absolute."""
    from nemo_jq.data.sources import SUFFIXES
    from nemo_jq.models.common import is_hub_name

    if config.executor == "local":
        return
    for name, value in paths.items():
        for path in value if isinstance(value, list) else [value]:
            text = str(path or "")
            no_path = ((name == "model.path" and is_hub_name(text))
                       or (name in ("data.source", "--source") and not text.endswith(SUFFIXES)
                           and not Path(text).exists()))
            shown = f"{name}={text}" if name in RUN_PATH_KEYS else f"{name} {text}"
            if text and not no_path and not text.startswith(("/", "~")):
                raise ConfigError(f"{shown} is a relative path, but under executor={config.executor} the job runs "
                                  f"in NeMo-Run's code folder ({JOB_WORKDIR}), where it names nothing of yours: give an "
                                  "absolute path under one of container_mounts (docs/cluster.md)")
            targets = [target for _, target, _ in map(mount_sides, config.container_mounts)]
            if text.startswith("/") and not no_path and targets and not any(Path(text).is_relative_to(target)
                                                                           for target in targets):
                raise ConfigError(f"{shown} is not under any of container_mounts ({', '.join(map(str, targets))} in "
                                  "the container): the job would not find it, and what it writes there would go with "
                                  "the container; give a path under a mount, or mount its folder")


def roles(config: LaunchConfig, trained: Any | None) -> str | None:
    """Which of the job's ranks train and which sample (``rollout.placement=separate`` in the ``trained`` config: the
    last ``rollout.ranks``; srun numbers the tasks node by node, so they are the allocation's last GPUs), as a comment
    line; None when every rank trains. A split that leaves no training rank is an error before anything is queued."""
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


def launch(config: LaunchConfig, command: list[str], arguments: Any, paths: dict[str, Any], *, dryrun: bool) -> str | None:
    """Submit ``command`` (``arguments``: its words as its own parser read them; ``paths``: its path arguments by
    name), or with ``dryrun`` show what would be submitted (on SLURM: return the script, with the roles of a split
    world as a comment after its first line) and write nothing; a submission returns a line naming the job and where
    NeMo-Run keeps its files (and the roles). sbatch's refusal is one line, and leaves no experiment folder."""
    with warnings.catch_warnings():  # NeMo-Run imports fastapi, which imports a module starlette says is deprecated
        warnings.filterwarnings("ignore", message="starlette.middleware.wsgi is deprecated")
        import nemo_run as run
    from docker.errors import DockerException
    from invoke.exceptions import UnexpectedExit

    check_job_paths(config, paths)
    check_processes(config, command[0])
    split = roles(config, train_config(command, arguments, config))
    if dryrun and config.executor == "slurm":
        first, rest = sbatch_script(config, command).split("\n", 1)
        return "\n".join([first, split, rest]) if split else "\n".join([first, rest])
    executor = build_executor(config)
    if dryrun:  # NeMo-Run's dry run writes its experiment's folder (under ~/.nemo_run by default): a scratch one here
        with tempfile.TemporaryDirectory() as scratch, run.Experiment(title=TITLE, executor=executor, base_dir=scratch,
                                                                     log_level="WARN") as exp:
            exp.add(task(command, config.executor), name=command[0])
            exp.dryrun()
        return None
    job_dir = Path(config.job_dir).resolve()
    made = [folder for folder in (job_dir, job_dir / "experiments", job_dir / "experiments" / TITLE) if not folder.exists()]
    try:  # clean_mode: NeMo-Run's console would print a page for a refusal this turns into one line
        with run.Experiment(title=TITLE, executor=executor, base_dir=str(job_dir), log_level="WARN", clean_mode=True) as exp:
            exp.add(task(command, config.executor), name=command[0])
            exp.run(detach=True)
            submitted = exp.jobs[0]
    except (UnexpectedExit, DockerException) as refused:  # sbatch's (the one command NeMo-Run's local tunnel runs), Docker's
        shutil.rmtree(Path(exp.jobs[0].executor.job_dir).parent, ignore_errors=True)  # the experiment's own folder
        for folder in reversed(made):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if isinstance(refused, DockerException):
            said = (str(refused).strip().splitlines() or ["it said nothing"])[0][:200]
            raise ValueError(f"Docker could not start the job ({said}); nothing was started or kept: start Docker's "
                             "daemon (`docker info` says whether one answers), or launch with executor: local") from None
        raise ValueError(f"sbatch refused the job ({sbatch_refusal(refused.result.stderr or refused.result.stdout)}); "
                         "nothing was queued or kept: fix what it says in the launch YAML, or launch from a host that "
                         "submits to this SLURM") from None
    files, split = submitted.executor.job_dir, f"\n{split.removeprefix('# ')}" if split else ""
    if config.executor == "slurm":
        return f"nemo-jq launch: submitted SLURM job {submitted.handle.rsplit('/', 1)[-1]}; its files: {files}{split}"
    return f"nemo-jq launch: started {submitted.handle}; its files: {files}{split}"


def sbatch_refusal(output: str) -> str:
    """What sbatch said when it refused a job: its last line with words on it (the fatal one, after the lines that led
    to it)."""
    said = [line.strip() for line in output.splitlines() if line.strip()]
    return said[-1] if said else "it said nothing"


#: The batch script each task of a sweep's job array runs (``nemo-jq sweep --task DIR``), in a checkout of this project.
SWEEP_LAUNCHER = Path(__file__).resolve().parents[2] / "launchers" / "slurm.sbatch"


def refuse_queued_array(sweep: Any) -> None:
    """Refuse to run, resubmit or move aside ``sweep`` while the job array ``--slurm`` last submitted for it is still
    queued or running (``squeue``; where this machine has none, nothing is checked): a second array ran the same runs
    beside the first, and one left queued behind ``--overwrite`` ran the new sweep's runs."""
    import shutil
    import subprocess

    job = sweep.here.get("slurm_array")
    if not job or shutil.which("squeue") is None:
        return
    shown = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%i"], capture_output=True, text=True)
    if shown.returncode == 0 and shown.stdout.strip():
        raise ValueError(f"{sweep.directory}'s job array {job} is still queued or running (squeue -j {job}): wait for "
                         f"it to end, or `scancel {job}` first")


def submit_sweep(sweep: Any, options: list[str], launcher: Path = SWEEP_LAUNCHER, parallel: int | None = None) -> str:
    """Submit ``sweep``'s unfinished runs as one SLURM job array (task K: run K of its ``sweep.json``), each task
    ``nemo-jq sweep --task DIR`` through ``launcher`` (its run, requeued after the time-limit signal), one GPU a task
    unless ``options`` (sbatch's) say otherwise, at most ``parallel`` running at once (sbatch's ``--array=...%N``), its
    output ``DIR/logs/task-K.out``; says so and returns the job id."""
    import shutil
    import subprocess

    from nemo_jq.runtime.sweep import FINISHED, LOGS_DIR

    unfinished = [index for index, run in enumerate(sweep.runs) if sweep.status(run) != FINISHED]
    if not unfinished:
        print(f"nemo-jq sweep: every run of {sweep.directory} has finished; nothing to submit")
        return ""
    if not launcher.exists():
        raise FileNotFoundError(f"{launcher} is missing: --slurm submits this project's launchers/slurm.sbatch, from a "
                                "checkout (pip install -e .)")
    if shutil.which("sbatch") is None:
        raise ValueError("--slurm submits a job array with sbatch, which is not on this machine's PATH: run it on the "
                         "cluster's login node, or drop --slurm to run the sweep here")
    directory = sweep.directory.absolute()
    (directory / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    # each task works from the folder the sweep was started in (a container's mount of it, launchers/slurm.sbatch's
    # default), and finds the sweep inside it by a relative path: a host's absolute path is no path in the container
    started = Path(sweep.here.get("started_in") or Path.cwd())
    task_dir = directory.relative_to(started) if directory.is_relative_to(started) else directory
    chdir = [] if any(option.startswith(("--chdir", "-D")) for option in options) else [f"--chdir={started}"]
    gpus = [] if any(option.startswith(("--gpus", "--gres", "-G")) for option in options) else ["--gpus-per-node=1"]
    throttle = f"%{parallel}" if parallel else ""
    command = ["sbatch", "--parsable", f"--array={','.join(map(str, unfinished))}{throttle}", "--job-name=nemo-jq-sweep",
               f"--output={directory / LOGS_DIR}/task-%a.out", *chdir, *gpus, *options, str(launcher.absolute()), "sweep",
               "--task", str(task_dir)]
    submitted = subprocess.run(command, capture_output=True, text=True)
    if submitted.returncode != 0:
        raise ValueError(f"sbatch refused the sweep's array ({sbatch_refusal(submitted.stderr)}): {' '.join(command)}")
    job = submitted.stdout.strip().split(";")[0]
    sweep.here["slurm_array"] = job  # refuse_queued_array: no second array while this one is queued
    sweep.save()
    print(f"nemo-jq sweep: submitted job array {job}: {len(unfinished)} of {len(sweep.runs)} runs of {directory} "
          f"(tasks {','.join(map(str, unfinished))}: their place in sweep.json), output in "
          f"{directory / LOGS_DIR}/task-K.out; `nemo-jq report {directory}` once they have finished")
    return job
