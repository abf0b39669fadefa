"""The Megatron backend's rollout side, on CPU in gloo processes: a tensor-parallel rollout engine's refit and
sampling on each of its ranks, and where the sampler's model is placed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import torch.distributed as dist  # noqa: E402

from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.rollouts import Sample  # noqa: E402


class ScriptedSampler:
    """Stands for one rank of a tensor-parallel engine (vLLM's external launcher): samples drawn from the
    generator and shifted by the weights it was refitted with, so both the draws and the refit show."""

    def __init__(self, tensor_parallel: int):
        self.tensor_parallel, self.weights, self.calls = tensor_parallel, None, 0

    def load_weights(self, tensors):
        self.weights = {name: tensor.clone() for name, tensor in tensors}

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
        self.calls += 1
        shift = int(self.weights["w"].sum())
        return [[Sample([int(torch.randint(5, (1,), generator=generator)) + shift + len(prompt), stop_ids[0]], True)
                 for _ in range(num_samples)] for prompt in prompts]


class ScriptedPolicy:
    """The refit's view of a policy: one replica over the whole world, its weights streamed under HF names."""

    weights_version = 1
    model_parallel_group = None
    gathers_over_replicas = False

    def iter_hf(self):
        for name, value in (("w", 20.0), ("v", 1.0)):
            yield name, torch.full((2,), value)


def tensor_parallel_refit_worker(tensor_parallel: int) -> dict[str, Any]:
    from nemo_jq.rollouts import BudgetedRollouts
    from nemo_jq.rollouts.refit import RefittedRolloutEngine

    policy = ScriptedPolicy()
    policy.model_parallel_group = dist.group.WORLD
    sampler = ScriptedSampler(tensor_parallel)
    engine = RefittedRolloutEngine(BudgetedRollouts(sampler, think_end_id=1, end_of_turn_id=2, max_thinking_tokens=4,
                                                    max_answer_tokens=3), policy)
    rollouts = engine.generate([[5, 6], [7]], 3, sample_answers=True, generator=torch.Generator().manual_seed(0))
    return {"calls": sampler.calls, "refitted": sampler.weights is not None, "rollouts": rollouts}


@pytest.mark.distributed
def test_a_tensor_parallel_rollout_engine_refits_and_samples_on_each_of_its_ranks():
    """rollout.tensor_parallel=2: both ranks of the replica take the refit and sample in step (as vLLM's external
    launcher needs), and the replica trains on the first one's rollouts; with one sampling rank only rank 0 does."""
    spread = run_in_processes(tensor_parallel_refit_worker, 2, 2)
    single = run_in_processes(tensor_parallel_refit_worker, 2, 1)
    assert [(r["calls"], r["refitted"]) for r in spread] == [(2, True), (2, True)]  # thinking, then answers
    assert [(r["calls"], r["refitted"]) for r in single] == [(2, True), (0, False)]
    rollouts = [r["rollouts"] for r in spread + single]
    assert all(r == rollouts[0] for r in rollouts)
    assert all(20 * 2 + 2 <= rollout.rationale_ids[0] < 20 * 2 + 2 + 5 for rollout in rollouts[0][0])  # refitted weights


def sampler_placement(precision: str) -> tuple[str, str]:
    """Where the megatron backend puts its sampler's HF model (a tiny model built in memory: no model.path)."""
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.components import build_components

    config = load_config(None, [*TINY_RUN, "model.backend=megatron", "megatron.tensor_parallel=2",
                                f"model.precision={precision}"])
    parts = build_components(config, torch.device("cpu"))
    weight = next(parts.engine.engine.sampler.model.parameters())
    return weight.device.type, str(weight.dtype)


@pytest.mark.distributed
def test_the_sampler_built_in_memory_is_on_its_rank_in_the_compute_dtype():
    """Without model.path the megatron backend's sampler decoded the model it built in memory, left on the host in
    fp32 on every rank (issue 29, D3): it is moved to the sampling rank's device in the compute dtype (bf16 here),
    and the other rank holds none."""
    assert run_in_processes(sampler_placement, 2, "bf16") == [("cpu", "torch.bfloat16"), ("meta", "torch.bfloat16")]
