"""``runtime/distributed.py``'s start of a world: which device each process takes."""

from __future__ import annotations

import os

import pytest
import torch

from nemo_jq.runtime import distributed


def test_an_explicit_gpu_other_than_the_local_ranks_is_refused_not_replaced(monkeypatch):
    """Under torchrun each process takes its LOCAL_RANK's GPU: ``train.device=cuda:1`` was replaced by it without a
    word (and config.yaml kept saying cuda:1). Only the device is read here: no GPU, no process group is needed."""
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"train.device=cuda:1 in a world of 2 processes: each takes its LOCAL_RANK's "
                                         r"GPU \(this one cuda:0\): set train.device=cuda \(or auto\)"):
        distributed.init_from_env(torch.device("cuda", 1))
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: the device as given
    assert distributed.init_from_env(torch.device("cuda", 1)) == torch.device("cuda", 1)
