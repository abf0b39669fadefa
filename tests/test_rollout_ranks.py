"""Rollouts on ranks of their own (``rollout.placement=separate``, nemo_jq/rollouts/ranks.py): the world split by
torchrun's variables into training and rollout ranks over gloo, against the same run colocated."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")  # megatron_cpu starts the ranks (and lets the megatron backend run on CPU)

from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.config import ConfigError, load_config  # noqa: E402

pytestmark = pytest.mark.distributed

#: What must be equal between the placements (no timings).
KEYS = ("loss", "grad_norm", "rollout_tokens", "train_reward", "log_p_hat", "kl_k3", "logprob_gap")


def train_run(run_dir: Path, overrides: list[str], steps: int) -> dict:
    """``steps`` steps of the tiny recipe from torchrun's variables; on the writer, the train records (the metrics
    compared and the sync's) and the test scores; elsewhere, what ``fit`` returned and what the rank holds."""
    from helpers import TINY_RUN
    from nemo_jq import distributed
    from nemo_jq.monitor import read_metrics
    from nemo_jq.trainer import Trainer

    trainer = Trainer(load_config(None, [*TINY_RUN, f"train.max_steps={steps}", f"train.run_dir={run_dir}", "eval.every=1000",
                                         *overrides]))
    result = trainer.fit()
    roles = distributed.roles()
    held = {"policy": getattr(trainer, "policy", None) is not None, "engine": type(getattr(
        getattr(trainer, "components", None), "engine", None)).__name__, "world": distributed.world_size()}
    if not distributed.is_writer():
        return {"result": result, "samples": roles is not None and roles.samples, **held}
    records = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    return {"train": records, "test": [r for r in read_metrics(run_dir) if r["kind"] == "test"], **held}


def same_training(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) and all(r.get(k) is not None for r in ours for k in ("loss", "grad_norm", "kl_k3"))
    for mine, other in zip(ours, theirs, strict=True):
        assert {k: mine.get(k) for k in KEYS} == {k: other.get(k) for k in KEYS}


def test_one_trainer_and_one_rollout_rank_train_as_one_colocated_process(tmp_path):
    """hf backend, native engine: the rollout rank samples what the trainer would have, from the synced weights."""
    both = ["objective.importance=truncate"]  # the separate engine has weights of its own: corrected either way
    (colocated,) = run_in_processes(train_run, 1, tmp_path / "colocated", both, 2, process_group=False)
    trainer, server = run_in_processes(train_run, 2, tmp_path / "separate", [*both, "rollout.placement=separate"], 2,
                                       process_group=False)
    same_training(trainer["train"], colocated["train"])
    assert trainer["test"][0]["p@1"] == colocated["test"][0]["p@1"]
    assert (trainer["engine"], trainer["world"]) == ("RemoteRollouts", 1)  # the trainer's own world; no sampler here
    assert server == {"result": {"served": 4, "synced": 3}, "samples": True, "policy": False, "engine": "NoneType",
                      "world": 1}
    first, second = trainer["train"]
    assert first["sync_bytes"] == second["sync_bytes"] > 0 and first["sync_seconds"] > 0


def test_two_data_parallel_trainers_and_one_rollout_rank_train_as_colocated(tmp_path):
    """megatron backend at DP=2, native engine: the one rollout rank serves both replicas, each with its own
    generator's state; the metrics equal the colocated DP=2 run's."""
    megatron = ["model.backend=megatron", "objective.name=garl"]
    colocated = run_in_processes(train_run, 2, tmp_path / "colocated", megatron, 2, process_group=False)[0]
    separate = run_in_processes(train_run, 3, tmp_path / "separate", [*megatron, "rollout.placement=separate"], 2,
                                process_group=False)
    same_training(separate[0]["train"], colocated["train"])
    assert separate[0]["test"][0]["p@1"] == colocated["test"][0]["p@1"]
    assert [rank.get("samples", False) for rank in separate] == [False, False, True]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=vllm"], "rollout.placement=separate samples with rollout.engine=native or hf for now"),
    (["rollout.async_steps=1"], "rollout.placement=separate samples on-policy for now"),
    (["rollout.ranks=0"], "rollout.ranks must be >= 1"),
])
def test_placements_the_split_cannot_serve_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.placement=separate", *overrides])


def test_a_split_that_leaves_no_trainer_is_named(tmp_path):
    with pytest.raises(Exception, match="rollout.ranks=1 leaves no training process among the 1"):
        run_in_processes(train_run, 1, tmp_path / "run", ["rollout.placement=separate"], 1, process_group=False)
