"""What a GPU machine's torch differs in from this one's (2.13): the lent H100 had torch 2.11, where the dry run's
import of ``FakeTensorDeviceMismatchError`` (new in 2.13) failed, and with it every ``nemo-jq`` command, since every
command's parser carries the dry run's help. Older torch is simulated here by removing that name."""

from __future__ import annotations

import subprocess
import sys

SIMULATE_OLDER_TORCH = "import torch._subclasses.fake_tensor as f; del f.FakeTensorDeviceMismatchError; "


def test_every_command_parses_without_the_dry_runs_torch_internals():
    """``nemo-jq train --help`` (the parser every command builds) with torch 2.11's fake-tensor module."""
    code = SIMULATE_OLDER_TORCH + "from nemo_jq.cli import main; main(['train', '--help'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "usage: nemo-jq train" in done.stdout, done.stderr[-2000:]
    assert "ImportError" not in done.stderr


def test_a_device_mismatch_is_recognised_as_torch_2_11_raises_it(monkeypatch):
    from torch._subclasses import fake_tensor

    from nemo_jq.dryrun.world import is_device_mismatch

    older = RuntimeError("Unhandled FakeTensor Device Propagation for aten.add.Tensor, found two different devices meta, cpu")
    assert is_device_mismatch(fake_tensor.FakeTensorDeviceMismatchError(None, "meta", "cpu"))
    assert not is_device_mismatch(older)  # 2.13 raises its own class for this, never the message
    monkeypatch.delattr(fake_tensor, "FakeTensorDeviceMismatchError")
    assert is_device_mismatch(older)
    assert not is_device_mismatch(RuntimeError("shape mismatch"))
