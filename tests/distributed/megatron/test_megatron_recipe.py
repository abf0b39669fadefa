"""The recipe on the Megatron backend against the HF backend, on CPU in gloo processes: the same steps at every
layout (the ``hf_training`` fixture runs the HF steps once for this module), resumed at another layout, data-parallel
replicas, and bf16 weights."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import (  # noqa: E402
    assert_same_training,
    max_diff,
    train_steps,
)


@pytest.fixture(scope="module")
def hf_training(tmp_path_factory):
    """``hf_training(objective)``: three steps of the recipe on the hf backend, run once per objective for this
    module (every layout below compares against them)."""
    runs: dict[str, list[dict[str, float]]] = {}

    def metrics(objective: str) -> list[dict[str, float]]:
        if objective not in runs:
            runs[objective] = train_steps(tmp_path_factory.mktemp("hf"), [f"objective.name={objective}"])
        return runs[objective]

    return metrics


@pytest.mark.parametrize("world_size, layout", [(1, []), (2, ["megatron.tensor_parallel=2"]), (2, ["megatron.pipeline_parallel=2"]),
                                                (2, ["megatron.context_parallel=2"])],
                         ids=["one-process", "tp2", "pp2", "cp2"])
@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_trains_alike_on_either_backend(world_size, layout, hf_training, tmp_path):
    """The trainer never branches on the backend: three GARL steps match the HF backend's, in one process and
    at TP=2 (where the replica's first rank samples the rollouts from its refitted HF copy and shares them)."""
    hf = hf_training("garl")
    ranks = run_in_processes(train_steps, world_size, tmp_path / "megatron", ["objective.name=garl", "model.backend=megatron", *layout])
    assert all(metrics == ranks[0] for metrics in ranks)  # every rank reads the one metrics.jsonl rank 0 wrote
    assert_same_training(ranks[0], hf)


@pytest.mark.parametrize("layout", [["megatron.distributed_optimizer=true"],
                                    ["megatron.distributed_optimizer=true", "megatron.context_parallel=2"],
                                    ["megatron.pipeline_parallel=2"]],
                         ids=["dp2-distributed-optimizer", "cp2-distributed-optimizer", "pp2-adamw"])
@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_process_recipe_equals_one_process_and_resumes_in_one(layout, hf_training, tmp_path):
    """SFT trains on given targets, so no sampling differs: at DP=2 each replica takes half of each batch,
    losses are divided by the global prompt count, and two steps equal the HF backend's two steps, with the
    distributed optimizer stepping half of AdamW's state on each replica (plain AdamW at DP=2 is checked by
    the parity test and the DP=2 GARL test below); at CP=2 the two ranks are one replica that splits each
    sequence, and the optimizer's state is split over them; at PP=2 each holds one layer. The checkpoint then
    resumes in one process (``--resume`` changing the layout) for a third step that equals the HF run's third."""
    hf = hf_training("sft")
    megatron = ["objective.name=sft", "model.backend=megatron", *layout]
    ranks = run_in_processes(train_steps, 2, tmp_path / "dp2", megatron, 2)
    assert ranks[0] == ranks[1] and len(ranks[0]) == 2  # logged once, by rank 0
    assert_same_training(ranks[0], hf[:2])
    checkpoint = tmp_path / "dp2" / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "megatron", "rng-rank1.pt", "rng.pt", "state.json"]
    one_process = ["megatron.context_parallel=1", "megatron.pipeline_parallel=1"]
    (resumed,) = run_in_processes(train_steps, 1, tmp_path / "dp2", one_process, 3, True)
    assert_same_training(resumed, hf)


def garl_at_two_replicas(run_dir) -> dict[str, Any]:
    """One GARL step at DP=2: what each replica trained on, and its weights before and after."""
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    trainer = Trainer(load_config(None, [*TINY_RUN, "train.max_steps=1", "eval.every=1000", "objective.name=garl",
                                         "model.backend=megatron", f"train.run_dir={run_dir}"]))
    examples, before = trainer.prompts.upcoming(trainer.state), trainer.policy.hf_state_dict()
    trainer.fit()
    return {"ids": [e.id for e in trainer.data_parallel.shard(examples)], "before": before,
            "after": trainer.policy.hf_state_dict()}


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_replicas_split_each_batch_and_stay_identical(tmp_path):
    from nemo_jq.runtime.runs import last_checkpoint_state

    first, second = run_in_processes(garl_at_two_replicas, 2, tmp_path / "run")
    assert len(first["ids"]) == len(second["ids"]) == 2 and not set(first["ids"]) & set(second["ids"])
    assert max_diff(first["after"], first["before"]) > 1e-4
    assert max_diff(first["after"], second["after"]) == 0.0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "checkpoints", "config.yaml", "metrics.jsonl", "results.json", "samples.jsonl", "splits.json", "tokenizer",
        "training.png"]
    assert last_checkpoint_state(tmp_path / "run")["replicas"] == 2  # what a sweep counts the run's steps over


@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_trains_with_bf16_weights_close_to_fp32(tmp_path):
    """The recipe with megatron.bf16_weights=true (one process): the steps' losses and gradient norms within bf16's
    precision of the HF backend's fp32 steps; the refit carries the bf16 weights into the fp32 rollout copy."""
    hf = train_steps(tmp_path / "hf", ["objective.name=sft"], 2)
    (bf16,) = run_in_processes(train_steps, 1, tmp_path / "bf16", ["objective.name=sft", "model.backend=megatron",
                                                                   "megatron.distributed_optimizer=true", "megatron.bf16_weights=true"], 2)
    for mine, other in zip(bf16, hf, strict=True):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(other[key], rel=0.03), (key, mine, other)
            assert mine[key] != other[key]  # bf16 did run
