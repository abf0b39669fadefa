"""One-step-off sampling in a child process on a GPU (issue 29 L4), everything around CUDA checked on CPU: the refit
is published before a request is sent, and a GPU in EXCLUSIVE_PROCESS compute mode, where the child could not open a
second CUDA context, falls back to sampling in this process with one line saying so. No GPU here: ``nvidia-smi`` is a
script that answers as the real one does, and ``torch.cuda.synchronize`` a recorder."""

import os
import stat

import pytest
import torch

from helpers import TINY_RUN
from nemo_jq.config import load_config
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.rollouts.process import SamplingProcess, publish_refit, second_process_refused


def fake_nvidia_smi(folder, answer: str, exit_code: int = 0):
    """``nvidia-smi`` on PATH that records its arguments and prints ``answer`` as ``--query-gpu=compute_mode`` does."""
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$@" > "{folder}/args"\necho "{answer}"\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder / "args"


@pytest.mark.parametrize("answer, exit_code, refused", [("Exclusive_Process", 0, True), ("Default", 0, False),
                                                        ("Prohibited", 0, False), ("", 9, False)])
def test_exclusive_process_mode_is_read_from_nvidia_smi_by_the_visible_gpus_name(tmp_path, monkeypatch, answer,
                                                                                   exit_code, refused):
    args = fake_nvidia_smi(tmp_path, answer, exit_code)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")
    reason = second_process_refused(torch.device("cuda", 1))
    assert args.read_text().split() == ["--query-gpu=compute_mode", "--format=csv,noheader", "-i", "3"]
    assert (reason is not None) == refused and (not refused or "GPU 3 is in EXCLUSIVE_PROCESS" in reason)
    assert second_process_refused(torch.device("cpu")) is None


def test_no_nvidia_smi_says_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert second_process_refused(torch.device("cuda", 0)) is None


def test_the_refit_is_published_on_a_gpu_only(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    publish_refit(torch.device("cpu"))
    publish_refit(torch.device("cuda", 0))
    assert synchronized == [torch.device("cuda", 0)]


def make_trainer(tmp_path, name):
    return Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / name}", "rollout.async_steps=1",
                                      "train.max_steps=2", "eval.every=100", "train.save_every=100"]))


@pytest.mark.slow
def test_each_request_follows_its_refit_and_its_publication(tmp_path, monkeypatch):
    """The order a GPU needs: refit the child's copy, wait for those kernels, then send the request."""
    events = []
    monkeypatch.setattr("nemo_jq.recipe.experience.publish_refit", lambda device: events.append("publish"))
    submit = SamplingProcess.submit
    monkeypatch.setattr(SamplingProcess, "submit", lambda self, *a, **k: (events.append("submit"), submit(self, *a, **k)))
    trainer = make_trainer(tmp_path, "ordered")
    refit = trainer.ahead.engine.refit
    monkeypatch.setattr(trainer.ahead.engine, "refit", lambda: (events.append("refit"), refit()))
    trainer.fit()
    assert events == ["refit", "publish", "submit"]  # step 2's request (step 1 samples in this process)


def test_an_exclusive_gpu_samples_in_this_process_and_says_so_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("nemo_jq.recipe.experience.second_process_refused", lambda device: "GPU 0 is in EXCLUSIVE_PROCESS mode")
    started = []
    monkeypatch.setattr(SamplingProcess, "__init__", lambda self, *a, **k: started.append(1))
    trainer = make_trainer(tmp_path, "exclusive")
    trainer.fit()
    lines = [line for line in capsys.readouterr().err.splitlines() if "EXCLUSIVE_PROCESS" in line]
    assert len(lines) == 1 and "sampled in this process" in lines[0] and not started
