"""`nemo-jq launch`: NeMo-Run executors from a launch YAML; the dry run's sbatch text; bad launch configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("nemo_run")

from nemo_jq.cli import main  # noqa: E402
from nemo_jq.cluster import launch  # noqa: E402
from nemo_jq.runtime.preemption import REQUEUE_EXIT_CODE  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]

LAUNCH_YAML = """\
account: acct
partition: batch
nodes: 2
gpus_per_node: 8
time: "02:00:00"
cpus_per_task: 16
container_image: nvcr.io#acme/nemo-jq:latest
container_mounts: [/lustre/me:/lustre/me]
env: {NCCL_IB_HCA: mlx5}
job_dir: JOB_DIR
"""


def write_launch(tmp_path, text: str = LAUNCH_YAML):
    path = tmp_path / "launch.yaml"
    # the test's own folder is mounted too: the configs written there are read in the job's container
    path.write_text(text.replace("JOB_DIR", str(tmp_path / "jobs")).replace(
        "container_mounts: [/lustre/me:/lustre/me]", f"container_mounts: [/lustre/me:/lustre/me, {tmp_path}:{tmp_path}]"))
    return path


def test_dryrun_prints_the_sbatch_script_nemo_run_would_submit(tmp_path, capsys):
    """One task per GPU started by srun (no torchrun: it dies on SLURM's SIGUSR1 and its workers never see it), the
    rendezvous on the first node, and train --requeue so that the signal checkpoints and requeues."""
    command = ["train", "--config", "/lustre/me/c.yaml", "model.backend=megatron", "megatron.tensor_parallel=8"]
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", *command]) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=02:00:00", "#SBATCH --signal=USR1@300",
                 "#SBATCH --open-mode=append", "export NCCL_IB_HCA=mlx5", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 "export MASTER_PORT=29500", 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'):
        assert line in script.splitlines(), line
    srun = next(line for line in script.splitlines() if line.startswith("srun --output"))
    assert "--container-image nvcr.io#acme/nemo-jq:latest" in srun and "--container-mounts /lustre/me:/lustre/me," in srun
    for line in ("#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --cpus-per-task=16"):
        assert line in script.splitlines(), line
    assert "#SBATCH --job-name=nemo-jq-train" in script.splitlines()
    job_files = f"{tmp_path / 'jobs'}/experiments/nemo-jq/nemo-jq_dryrun/train"  # where NeMo-Run would write them
    assert "torchrun" not in script and f"{job_files}:/nemo_run" in srun  # an absolute mount
    assert srun.endswith("-m nemo_jq.cli train --requeue " + " ".join(command[1:]))
    # exit 75 (a checkpoint after SIGUSR1) is requeued by the batch script, on the host: a trap on its exit, set
    # before srun, sees the status NeMo-Run's template exits with after it
    lines = script.splitlines()
    trap = lines.index(launch.REQUEUE_ON_EXIT)
    assert trap < lines.index(srun) and "exit $exitcode" in [line.strip() for line in lines[lines.index(srun):]]
    assert f'[ "$status" = {REQUEUE_EXIT_CODE} ]' in lines[trap] and 'scontrol requeue "$SLURM_JOB_ID"' in lines[trap]
    assert "scontrol" not in srun
    assert not (tmp_path / "jobs").exists()  # a dry run writes nothing


def test_docker_and_local_executors_run_under_torchrun(tmp_path):
    import nemo_run as run

    docker = launch.build_executor(launch.LaunchConfig(executor="docker", gpus_per_node=4, container_mounts=["/d:/d"],
                                                       container_image="nemo-jq:latest"))
    assert isinstance(docker, run.DockerExecutor) and docker.num_gpus == 4 and docker.volumes == ["/d:/d"]
    local = launch.build_executor(launch.LaunchConfig(executor="local", gpus_per_node=2))
    assert isinstance(local, run.LocalExecutor) and local.ntasks_per_node == 2
    assert all(executor.get_launcher().__class__.__name__ == "Torchrun" for executor in (docker, local))


@pytest.mark.parametrize("text, message", [
    ("acount: acct\n", "unknown launch key(s) acount (did you mean 'account'?); known: account,"),
    ("executor: k8s\n", "executor must be one of slurm, docker, local; got 'k8s'"),
    ("executor: slurm\n", "executor=slurm needs account"),
    ("account: a\n", "executor=slurm needs container_image: REGISTRY#IMAGE:TAG for pyxis"),
    ("account: a\ncontainer_image: x.sqsh\nnodes: 0\n", "nodes must be >= 1; got 0"),
    ("account: a\ncontainer_image: x.sqsh\ngpus_per_node: true\n", "gpus_per_node must be int; got True"),
    ("account: a\ncontainer_image: x.sqsh\nnodes: '2'\n", "nodes must be int; got '2'"),
    ("account: a\ncontainer_image: x.sqsh\ntime: 4h\n", "time='4h' is not a SLURM time limit"),
    ("account: a\ncontainer_image: x.sqsh\ntime: 2:00:00\n",  # YAML 1.1's base 60: it was the time limit 7200
     '2:00:00 reads as 7200 in YAML (an octal or base-60 number): write 7200 for that number, or quote it as text: "2:00:00"'),
    ("account: a\ncontainer_image: x.sqsh\nmem: 80 GB\n", "mem='80 GB' is not a SLURM memory size"),
    ("account: a\ncontainer_image: x.sqsh\ncpus_per_task: 0\n", "cpus_per_task must be >= 1; got 0"),
    ("account: a\ncontainer_image: x.sqsh\nnetwork_interface: 5\n", "network_interface=5 is not an interface name"),
    ("account: a\ncontainer_image: x.sqsh\nnetwork_interface: ''\n", "network_interface='' is not an interface name"),
    ("account: a\ncontainer_image: x.sqsh\nnetwork_interface: ib0 eth0\n", "network_interface='ib0 eth0' is not an"),
    ("account: a\ncontainer_image: x.sqsh\naccount: b\n", ":3: key 'account' is given twice (first on line 1)"),
    # every key against its type, and what goes into the batch script in the form SLURM and the shell take it
    ("account: a\ncontainer_image: 5\n", "container_image must be str; got 5"),
    ("account: a\ncontainer_image: x.sqsh\ncontainer_mounts: /l/me:/l/me\n",
     "container_mounts must be list; got '/l/me:/l/me'; write a YAML list of host:container pairs"),
    # each entry: srun took a relative host side, and a bad one was blamed on the first path under none of them
    *((f"account: a\ncontainer_image: x.sqsh\ncontainer_mounts: ['{mount}']\n", f"container_mounts entry '{mount}' is "
       "not /host/path[:/container/path[:options]] (absolute paths, no commas)")
      for mount in ("rel/dir:/l/me", "/l/me:relative", "nocolon", "/l/me:/l/me:rw:extra", "/a:/a,/b:/b")),
    ("account: a\ncontainer_image: x.sqsh\nenv: [NCCL_IB_HCA=mlx5]\n",
     "env must be dict; got ['NCCL_IB_HCA=mlx5']; write a mapping of names to quoted values, e.g. env: {NCCL_IB_HCA: mlx5"),
    ("account: a\ncontainer_image: x.sqsh\nenv: {OMP_NUM_THREADS: 4}\n",
     "env OMP_NUM_THREADS=4 must be a string: quote it (OMP_NUM_THREADS: '4')"),
    ("account: a\ncontainer_image: x.sqsh\nenv: {NCCL_DEBUG: null}\n", "env NCCL_DEBUG has no value: give it one"),
    ("account: a\ncontainer_image: x.sqsh\nenv: {BAD NAME: x}\n", "env name 'BAD NAME' is not a shell variable name"),
    ("account: a\ncontainer_image: x.sqsh\nenv: {'A;rm -rf ~': x}\n", "env name 'A;rm -rf ~' is not a shell variable"),
    ("account: a\ncontainer_image: x.sqsh\nenv: {http_proxy: x}\n", "env name 'http_proxy' has lower-case letters, and "
     "NeMo-Run's SLURM script exports it as HTTP_PROXY: give it in upper case"),
    ("account: a\ncontainer_image: x.sqsh\nsignal: bogus\n", "signal='bogus' is not a signal as sbatch --signal takes it"),
    # a signal the run does not requeue on, or one only the batch shell hears: the job would end without its requeue
    ("account: a\ncontainer_image: x.sqsh\nsignal: TERM@300\n", "signal='TERM@300': SIGTERM checkpoints and ends the "
     "run without a requeue (only SIGUSR1 requeues it): write USR1@SECONDS"),
    ("account: a\ncontainer_image: x.sqsh\nsignal: KILL@300\n", "KILL is not a signal the trainer checkpoints on"),
    ("account: a\ncontainer_image: x.sqsh\nsignal: 'B:USR1@300'\n", "signal='B:USR1@300': B: sends it to the batch "
     "shell alone, which does not pass it to the run's processes"),
    # a limit the signal's lead eats: the signal before the first step, and a requeue after requeue (5 in 2.5 min)
    ("account: a\ncontainer_image: x.sqsh\ntime: '00:04:00'\n", "time='00:04:00' is no longer than the time-limit "
     "signal's lead (signal='USR1@300': 300 s before the limit): it would arrive before the run's first step"),
    ("account: a\ncontainer_image: x.sqsh\ntime: '1'\nsignal: USR1\n", "(signal='USR1': 60 s before the limit)"),
    ("account: a\ncontainer_image: x.sqsh\nmaster_port: hello\n", "master_port must be int; got 'hello'"),
    ("account: a\ncontainer_image: x.sqsh\nmaster_port: 70000\n", "master_port must be >= 1 and <= 65535; got 70000"),
    ("account: a\ncontainer_image: x.sqsh\npartition: [a, b]\n", "partition=['a', 'b'] is not a SLURM partition: one name, or"),
    ("account: a\ncontainer_image: x.sqsh\nexclusive: maybe\n", "exclusive must be bool; got 'maybe'"),
    # NeMo-Run's local and docker executors start every process on this machine: a second node would never run
    ("executor: local\nnodes: 2\n", "nodes=2 but executor=local starts every process on this machine: set nodes: 1"),
    ("executor: docker\ncontainer_image: x\nnodes: 2\n", "nodes=2 but executor=docker starts every process on this"),
])
def test_bad_launch_configs_are_one_line_errors(tmp_path, capsys, text, message):
    assert main(["launch", str(write_launch(tmp_path, text)), "--dryrun", "train"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"nemo-jq launch: error: {tmp_path / 'launch.yaml'}")  # the file is named


def test_the_signal_sbatch_takes_and_env_values_are_written_as_given(tmp_path, capsys):
    """``--signal`` in SLURM's forms, and each env value double-quoted in the batch script NeMo-Run writes unquoted,
    so that a space or ``;`` stays in the value (it runs nothing) and the job's variables still expand."""
    for signal in ("USR1@120", "R:USR1@120", "SIGUSR1", "10@60"):
        text = LAUNCH_YAML.replace("env: {NCCL_IB_HCA: mlx5}",
                                   f"env: {{NCCL_IB_HCA: mlx5, X: 'a b; touch {tmp_path}/ran', HF_HOME: '/scratch/$USER/hf'}}")
        assert main(["launch", str(write_launch(tmp_path, text + f"signal: '{signal}'\n")), "--dryrun", "train",
                     "--demo-dir", "/lustre/me/demo"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert f"#SBATCH --signal={signal}" in lines and "export NCCL_IB_HCA=mlx5" in lines
        assert f'export X="a b; touch {tmp_path}/ran"' in lines and 'export HF_HOME="/scratch/$USER/hf"' in lines


def test_a_launch_without_a_command_is_refused(tmp_path, capsys):
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun"]) == 2
    assert "needs the command to run" in capsys.readouterr().err


def test_a_misspelt_command_is_refused_and_a_dry_run_writes_nothing(tmp_path, capsys):
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", "trian", "--config", "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert "'trian' is not a nemo-jq command (did you mean 'train'?)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "jobs").exists()


def test_the_single_node_launcher_asks_for_no_gpus_and_no_docker_hub_image():
    """launchers/slurm.sbatch runs any command: the GPUs are asked for on the sbatch line of a command that needs them,
    and its default image is a squashfs file (a bare nemo-jq:latest means Docker Hub to pyxis)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "launchers" / "slurm.sbatch").read_text()
    assert "--gpus-per-node" not in "".join(line for line in text.splitlines() if line.startswith("#SBATCH"))
    assert "nemo-jq:latest}" not in text and 'IMAGE="${NEMO_JQ_IMAGE:-$PWD/nemo-jq.sqsh}"' in text


def documented_requeue() -> tuple[list[str], str]:
    """docs/cluster.md's batch script of one's own: its #SBATCH lines, and its block from the status test on."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "docs" / "cluster.md").read_text(), re.S).group(1)
    sbatch = [line for line in block.splitlines() if line.startswith("#SBATCH")]
    return sbatch, block[block.index('if [ "$status"'):]


@pytest.mark.parametrize("launcher", sorted((ROOT / "launchers").glob("*.sbatch")), ids=lambda path: path.name)
def test_every_sbatch_launcher_requeues_on_the_requeue_exit_code_from_the_host(launcher):
    """After srun returns, on the host (a pyxis image has no scontrol): exit REQUEUE_EXIT_CODE -> scontrol requeue,
    docs/cluster.md's block word for word, in a requeueable job. The two-node launcher runs it on the real SLURM
    (tests/distributed/test_slurm_launch.py); the others hold the same lines."""
    text = launcher.read_text()
    sbatch, block = documented_requeue()
    assert f'if [ "$status" = {REQUEUE_EXIT_CODE} ]; then' in block
    assert all(line in text.splitlines() for line in sbatch), sbatch
    assert text.endswith(block)
    steps = text[text.index("\nstatus=0\n"):text.index(block)]
    assert steps.count("srun ") == 1 and steps.rstrip().endswith("|| status=$?") and "scontrol" not in steps


def test_a_split_world_says_which_gpus_train_and_which_sample_and_refuses_a_split_without_trainers(tmp_path, capsys):
    """``rollout.placement=separate`` (from the config, if this host can read it, or the overrides): the script names
    the roles by the same rule the run splits its world by (``role_of``); the last node's GPUs sample here."""
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  backend: megatron\nrollout:\n  placement: separate\n  ranks: 4\n"
                      "train:\n  run_dir: /lustre/me/runs/c\n  batch_size: 48\n")
    for command, roles in ((["train", "--config", config], "rollout.ranks=4): ranks 0-11 (nodes 0-1) train, ranks 12-15 (node 1) sample"),
                           (["train", "--config", "/lustre/me/not_here.yaml", "rollout.placement=separate", "rollout.ranks=8"],
                            "rollout.ranks=8): ranks 0-7 (node 0) train, ranks 8-15 (node 1) sample")):
        assert main(["launch", str(write_launch(tmp_path)), "--dryrun", *map(str, command)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "#!/bin/bash" and lines[1].startswith("# nemo-jq roles") and roles in lines[1], lines[1]
        assert sum(line.startswith("#SBATCH") for line in lines) > 5  # sbatch still reads its options after a comment
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", "train", "--config", str(config),
                 "rollout.placement=colocated"]) == 0
    assert "nemo-jq roles" not in capsys.readouterr().out
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", "train", "rollout.placement=separate",
                 "rollout.ranks=16", "train.run_dir=/lustre/me/runs/x"]) == 2
    assert "rollout.ranks=16 leaves no training rank among the job's 16 GPUs" in capsys.readouterr().err


def test_a_launched_training_command_is_checked_before_anything_is_written_or_queued(tmp_path, capsys):
    """A misspelt or out-of-range override, or a config file readable here that train would refuse, is one line
    before a script is written; a config only the job can read has its overrides checked, and says so."""
    launch_yaml = str(write_launch(tmp_path))
    for words, message in ((["megatron.tensor_paralel=8"], "unknown config key 'megatron.tensor_paralel'; did you mean "
                            "'megatron.tensor_parallel'?"),
                           (["megatron.tensor_parallel=0"], "megatron.tensor_parallel must be >= 1; got 0")):
        assert main(["launch", launch_yaml, "--dryrun", "train", "--config", "/lustre/me/c.yaml", *words]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    here = tmp_path / "c.yaml"
    here.write_text("model:\n  backend: megatron\n  activation_checkpointing: true\n")
    assert main(["launch", launch_yaml, "--dryrun", "train", "--config", str(here)]) == 2
    err = capsys.readouterr().err
    assert "model.activation_checkpointing is the hf backend's" in err and len(err.strip().splitlines()) == 1
    assert main(["launch", launch_yaml, "--dryrun", "train", "--config", "/lustre/me/c.yaml",
                 "megatron.tensor_parallel=8"]) == 0
    out, err = capsys.readouterr()
    assert "srun" in out and "/lustre/me/c.yaml is not readable here: the overrides were checked" in err
    assert not (tmp_path / "jobs").exists()


def test_a_launched_config_is_checked_against_the_jobs_gpus_as_its_ranks_check_it(tmp_path, capsys):
    """A config readable here over the job's 16 processes: each of these queued, then failed on every rank at its
    start (a TP that divides no head count, a PP that divides no layer count, a batch over 6 replicas, hf in 16
    processes)."""
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  path: Qwen/Qwen3-8B\n  backend: megatron\ntrain:\n  run_dir: /lustre/me/runs/c\n"
                      "  batch_size: 64\nmegatron:\n  tensor_parallel: 2\n")
    three_nodes = LAUNCH_YAML.replace("nodes: 2", "nodes: 3")
    for launch_yaml, words, message in [
            (LAUNCH_YAML, ["megatron.tensor_parallel=3"], "megatron.tensor_parallel=3 does not divide num_attention_heads"),
            (LAUNCH_YAML, ["megatron.pipeline_parallel=5"], "megatron.pipeline_parallel=5 does not divide "
                                                            "num_hidden_layers=36"),
            (LAUNCH_YAML, ["megatron.pipeline_parallel=3"], "pipeline_parallel=3 x context_parallel=1 does not divide the "
                                                            "16 processes: use a multiple of 6 (nodes=2 x gpus_per_node=8"),
            (three_nodes, [], "train.batch_size=64 does not split over the 12 data-parallel replicas of 24 training "
                              "processes (nodes=3 x gpus_per_node=8 in the launch YAML)"),
            (LAUNCH_YAML, ["model.backend=hf", "megatron.tensor_parallel=1"],
             "model.backend=hf trains in one process, but the job starts 16")]:
        assert main(["launch", str(write_launch(tmp_path, launch_yaml)), "--dryrun", "train", "--config", str(config),
                     *words]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", "train", "--config", str(config)]) == 0
    assert not (tmp_path / "jobs").exists()


def test_the_network_interface_reaches_gloo_and_nccl_in_the_launch_and_the_batch_script(tmp_path, capsys):
    """Issue 43's N4: ``network_interface`` in the launch YAML, NEMO_JQ_IFNAME for the batch script, set both sockets'
    interface (a cluster's own variables win in the batch script)."""
    import subprocess

    assert main(["launch", str(write_launch(tmp_path, LAUNCH_YAML + "network_interface: ib0\n")), "--dryrun", "train",
                 "--demo-dir", "/lustre/me/demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "export GLOO_SOCKET_IFNAME=ib0" in lines and "export NCCL_SOCKET_IFNAME=ib0" in lines
    script = (ROOT / "launchers" / "slurm_multinode.sbatch").read_text()
    block = script[script.index('if [ -n "${NEMO_JQ_IFNAME:-}" ]'):script.index("fi\n", script.index("NEMO_JQ_IFNAME:-}"))] + "fi"
    shown = subprocess.run(["bash", "-c", block + '\necho "$GLOO_SOCKET_IFNAME $NCCL_SOCKET_IFNAME"'], text=True,
                           capture_output=True, env={"PATH": "/usr/bin:/bin", "NEMO_JQ_IFNAME": "ib0",
                                                     "NCCL_SOCKET_IFNAME": "=eth1"}).stdout.strip()
    assert shown == "ib0 =eth1"


def refused_at_once(argv: list[str], capsys) -> str:
    """The one line (exit 2) ``nemo-jq`` ends with, by the launched command's own parser (which exits) or as an error."""
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("words, message", [
    (["train", "--bogus-flag"], "nemo-jq train: error: unrecognized arguments: --bogus-flag (see nemo-jq train --help)"),
    (["generate"], "nemo-jq generate: error: the following arguments are required: checkpoint, question"),
    (["train", "--config"], "nemo-jq train: error: argument --config: expected one argument"),
    (["train", "--dryrun", "train.max_steps=2"], "--dryrun after the command goes to train, which takes no --dryrun: put "
     "it before the command (nemo-jq launch LAUNCH --dryrun train ...)"),
    (["launch", "LAUNCH", "train"], "launch cannot wrap launch: give one launch config, then the command it runs"),
])
def test_the_launched_words_are_read_by_the_commands_own_parser_before_anything_is_queued(tmp_path, capsys, monkeypatch,
                                                                                        words, message):
    """A bad word of the launched command is its own parser's one line; a --dryrun among them (where the command
    takes none) is refused rather than submitting; and launch does not wrap itself."""
    monkeypatch.setenv("PATH", f"{fake_sbatch(tmp_path)}:{__import__('os').environ['PATH']}")
    launch_yaml = str(write_launch(tmp_path))
    err = refused_at_once(["launch", launch_yaml, *[launch_yaml if word == "LAUNCH" else word for word in words]], capsys)
    assert message.replace("LAUNCH", launch_yaml) in err
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "submitted").exists()


@pytest.mark.parametrize("words, given", [
    (["train", "--config", "c.yaml"], "--config c.yaml"),
    (["train", "--config", "/lustre/me/c.yaml", "train.run_dir=runs/x"], "train.run_dir=runs/x"),
    (["train", "--config", "/lustre/me/c.yaml", "data.prepared_dir=prepared/finqa"], "data.prepared_dir=prepared/finqa"),
    (["train", "--config", "/lustre/me/c.yaml", "model.path=qwen3_local"], "model.path=qwen3_local"),
    (["train", "--config", "/lustre/me/c.yaml", "data.name=jsonl", "data.source=data/qa.jsonl"], "data.source=data/qa.jsonl"),
    (["train", "--config", "READABLE"], "train.run_dir=runs/here"),
    (["train", "train.max_steps=2"], "train.run_dir=runs/train"),  # no config: the default run directory
    (["train"], "--demo-dir runs/cold_start"),  # the demo, in its default folder
    (["eval", "runs/x"], "checkpoint runs/x"),
    # a subcommand's own path options, and an output file of a type of its own, went unchecked
    (["data", "prepare", "--dataset", "jsonl", "--source", "/lustre/me/x.jsonl", "--out", "rel/out", "--sizes", "1,1,1"],
     "--out rel/out"),
    (["data", "prepare", "--dataset", "jsonl", "--source", "rel/x.jsonl", "--out", "/lustre/me/out", "--sizes", "1,1,1"],
     "--source rel/x.jsonl"),
    (["dryrun", "--config", "/lustre/me/c.yaml", "--json", "rel.json"], "--json rel.json"),
    (["experiment", "escape-rates", "--quick"], "--out runs/escape_rates"),  # its default, which it filled in later
])
def test_a_relative_path_is_refused_where_the_job_runs_in_nemo_runs_code_folder(tmp_path, capsys, words, given):
    """Under SLURM (and Docker) the job starts in /nemo_run/code: a relative path the command is given, or its
    config's run_dir, prepared_dir, a local model.path or a data.source file, names nothing there; a hub name (of a
    model, of a dataset) is no path."""
    readable = tmp_path / "c.yaml"
    readable.write_text("train:\n  run_dir: runs/here\n")
    words = [str(readable) if word == "READABLE" else word for word in words]
    err = refused_at_once(["launch", str(write_launch(tmp_path)), "--dryrun", *words], capsys)
    assert f"error: {given} is a relative path, but under executor=slurm the job runs in NeMo-Run's code folder " \
           "(/nemo_run/code)" in err and "give an absolute path under one of container_mounts" in err
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", "train", "--config", "/lustre/me/c.yaml",
                 "model.path=Qwen/Qwen3-0.6B", "train.run_dir=/lustre/me/runs/x", "data.name=hotpotqa",
                 "data.source=hotpot_qa"]) == 0
    local = write_launch(tmp_path, "executor: local\ngpus_per_node: 1\n")  # the job runs here: a relative path is fine
    assert launch.check_job_paths(launch.load_launch_config(local), {"--config": Path("c.yaml")}) is None


def fake_sbatch(tmp_path: Path) -> Path:
    """A folder holding an ``sbatch`` that refuses every job as a host without a SLURM configuration does (and marks
    that it ran)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    (folder / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/submitted\necho 'sbatch: error: fetch_config: DNS SRV "
                                   "lookup failed' >&2\necho 'sbatch: fatal: Could not establish a configuration source' >&2\n"
                                   "exit 1\n")
    (folder / "sbatch").chmod(0o755)
    return folder


@pytest.mark.slow
def test_sbatchs_refusal_is_one_line_and_leaves_no_experiment_folder(tmp_path):
    """The last line sbatch said, exit 2, and the experiment folder NeMo-Run made for the job removed, with the
    folders above it this launch made (one there before is kept)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": f"{fake_sbatch(tmp_path)}:{os.environ['PATH']}", "NEMORUN_HOME": str(tmp_path / "home")}
    for kept in (None, tmp_path / "jobs" / "experiments" / "nemo-jq" / "earlier"):
        if kept is not None:
            kept.mkdir(parents=True)
        result = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "launch", str(write_launch(tmp_path)), "train",
                                 "train.max_steps=2", "train.run_dir=/lustre/me/runs/x", "model.backend=megatron",
                                 "train.batch_size=16"], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 2 and not result.stdout, result.stdout + result.stderr
        assert result.stderr.splitlines()[-1] == (
            "nemo-jq launch: error: sbatch refused the job (sbatch: fatal: Could not establish a configuration source); "
            "nothing was queued or kept: fix what it says in the launch YAML, or launch from a host that submits to this "
            "SLURM") and "Traceback" not in result.stderr and "Error running job" not in result.stderr, result.stderr
        assert "DeprecationWarning" not in result.stderr, result.stderr  # NeMo-Run's imports' noise is not the user's
        assert (tmp_path / "submitted").exists()
        if kept is None:
            assert not (tmp_path / "jobs").exists()
        else:
            assert sorted((tmp_path / "jobs").rglob("*")) == [kept.parents[1], kept.parent, kept]


def test_a_docker_daemon_that_does_not_answer_is_one_line_and_leaves_no_experiment_folder(tmp_path, capsys, monkeypatch):
    """Docker's client found no daemon (here a socket that is not there): NeMo-Run's 140-line traceback, exit 1 and an
    experiment folder left behind were what a user saw."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    monkeypatch.setattr("nemo_run.config._NEMORUN_HOME", str(tmp_path / "nemo_run_home"))
    text = f"executor: docker\ngpus_per_node: 1\ncontainer_image: x\njob_dir: {tmp_path}/jobs\n"
    err = refused_at_once(["launch", str(write_launch(tmp_path, text)), "train", f"train.run_dir={tmp_path}/run"], capsys)
    assert "nemo-jq launch: error: Docker could not start the job (" in err and "start Docker's daemon" in err, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["launch.yaml"]


def test_a_local_dry_run_writes_nothing(tmp_path, capsys, monkeypatch):
    """NeMo-Run's own dry run files an experiment under NEMORUN_HOME (~/.nemo_run): this one's is a scratch folder."""
    monkeypatch.setattr("nemo_run.config._NEMORUN_HOME", str(tmp_path / "nemo_run_home"))
    monkeypatch.chdir(tmp_path)
    for text in ("executor: local\ngpus_per_node: 1\n", "executor: docker\ngpus_per_node: 1\ncontainer_image: x\n"):
        assert main(["launch", str(write_launch(tmp_path, text)), "--dryrun", "train", "train.max_steps=2",
                     f"train.run_dir={tmp_path}/runs/x"]) == 0
        capsys.readouterr()
        assert sorted(path.name for path in tmp_path.iterdir()) == ["launch.yaml"]


def test_a_command_that_runs_in_one_process_is_refused_a_job_of_several(tmp_path, capsys):
    """The job starts a process a GPU and each ran the command whole: two copies of a sweep (one refused as the
    other's folder, the job FAILED). eval, generate and export run over a Megatron checkpoint's layout; a job of one
    GPU runs any command."""
    code = main(["launch", str(write_launch(tmp_path)), "--dryrun", "sweep", "--out", "/lustre/me/s", "objective.q=0,1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("nemo-jq sweep runs in one process, but the job starts 16 (nodes=2 x gpus_per_node=8 in the launch YAML), "
            "each running it whole: give it nodes: 1 and gpus_per_node: 1; or submit the sweep's runs as a job array, "
            "one GPU each (nemo-jq sweep --slurm)") in err
    assert main(["launch", str(write_launch(tmp_path)), "--dryrun", "report", "/lustre/me/s"]) == 2
    one = LAUNCH_YAML.replace("nodes: 2", "nodes: 1").replace("gpus_per_node: 8", "gpus_per_node: 1")
    assert main(["launch", str(write_launch(tmp_path, one)), "--dryrun", "report", "/lustre/me/s"]) == 0
    capsys.readouterr()


def test_a_train_job_into_a_run_folder_it_cannot_use_is_refused_before_it_queues(tmp_path, capsys):
    """The job's run folder, where this machine sees it (a mount's host side), is checked as the job's own start
    would: one holding another run (other settings), or under a read-only mount, failed the job after its wait in the
    queue (exit 2). A folder of this run is resumed by the job: accepted."""
    from nemo_jq.config import load_config, save_config

    one = LAUNCH_YAML.replace("nodes: 2", "nodes: 1").replace("gpus_per_node: 8", "gpus_per_node: 1")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config(None, [f"train.run_dir={run_dir}", "optim.lr=0.01"]), run_dir / "config.yaml")
    launch = write_launch(tmp_path, one)
    code = main(["launch", str(launch), "--dryrun", "train", f"train.run_dir={run_dir}", "optim.lr=0.02"])
    err = capsys.readouterr().err
    assert code == 2 and f"{run_dir} holds another run (its config.yaml differs in optim.lr" in err, err
    assert main(["launch", str(launch), "--dryrun", "train", f"train.run_dir={run_dir}", "optim.lr=0.01"]) == 0
    capsys.readouterr()
    read_only = write_launch(tmp_path, one.replace("container_mounts: [/lustre/me:/lustre/me]",
                                                   f"container_mounts: [{tmp_path}:/data:ro]"))
    code = main(["launch", str(read_only), "--dryrun", "train", "train.run_dir=/data/run"])
    err = capsys.readouterr().err
    assert code == 2 and "train.run_dir=/data/run is under a read-only mount (ro in container_mounts)" in err, err
