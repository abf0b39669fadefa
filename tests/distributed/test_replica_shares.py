"""Issue 43's N5: the vLLM engines of one model replica each decode a distinct share of its prompts.

Under torchrun with ``rollout.tensor_parallel`` below the replica's ranks (the 8B configs: TP=2 PP=2, one vLLM engine
per rank), every rank holds an engine, and all of them step in lockstep. Before, each decoded every prompt of the
replica and one rank's rollouts were kept: 4x the decode work at TP=2 PP=2. Here two gloo ranks form one replica; the
sampler stands in for vLLM (which these forked workers cannot build: the real engine's split runs in
tests/unit/rollouts/test_vllm.py's torchrun test) with what the split relies on: each prompt's samples come from its
own seed, drawn from the call's generator (vLLM's ``SamplingParams(seed=...)``). The refit, the thinking budgets,
the split and the collective are the real ones; the native sampler decodes each prompt.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core")  # tests/megatron_cpu.py, which starts the ranks, patches it in each

import torch.distributed as dist  # noqa: E402

from helpers import tiny_setup  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.models.hf import HFPolicy  # noqa: E402
from nemo_jq.rollouts import BudgetedRollouts  # noqa: E402
from nemo_jq.rollouts.hf import NativeSampler  # noqa: E402
from nemo_jq.rollouts.refit import RefittedRolloutEngine, share_sizes  # noqa: E402
from nemo_jq.rollouts.sampling import seed_from  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

CPU = torch.device("cpu")
PROMPTS, SAMPLES, THINKING, ANSWERS, SEED = 5, 3, 5, 2, 7


class SeededPerPrompt(NativeSampler):
    """A lockstep sampler whose prompts are each sampled from their own seed, as vLLM's are; it counts the prompts it
    decodes, call by call."""

    lockstep = True

    def __init__(self, *args, tensor_parallel: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.tensor_parallel, self.decoded = tensor_parallel, []

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
        return self.sample_seeded(prompts, [seed_from(generator) for _ in prompts], num_samples, stop_ids=stop_ids,
                                  max_new_tokens=max_new_tokens, greedy=greedy)

    def sample_seeded(self, prompts, seeds, num_samples, *, stop_ids, max_new_tokens, greedy=False):
        self.decoded.append(len(prompts))
        return [NativeSampler.sample(self, [prompt], num_samples, stop_ids=stop_ids, max_new_tokens=max_new_tokens,
                                     generator=torch.Generator().manual_seed(seed), greedy=greedy)[0]
                for prompt, seed in zip(prompts, seeds)]


def replica_rank(tensor_parallel: int) -> dict:
    """One rank of a two-rank replica whose engines span ``tensor_parallel`` ranks each: its rollouts, the prompts its
    engine decoded per call, the generator's state after the call, and (rank 0) one engine's rollouts of the whole
    call, sampled alone."""
    task, _, chat, model = tiny_setup()
    prompts = [chat.prompt_ids(task.messages(example, "cold")) for example in task.splits(0, PROMPTS, 0, 0).validation]

    def engine(sampler_tp: int) -> BudgetedRollouts:
        sampler = SeededPerPrompt(copy.deepcopy(model), pad_id=chat.pad_id, device=CPU, tensor_parallel=sampler_tp)
        return BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                                max_thinking_tokens=THINKING, max_answer_tokens=ANSWERS)

    split = engine(tensor_parallel)
    policy = HFPolicy(copy.deepcopy(model), device=CPU)  # the weights the engine is refitted with
    policy.model_parallel_group = dist.new_group([0, 1])
    generator = torch.Generator().manual_seed(SEED)
    rollouts = RefittedRolloutEngine(split, policy).generate(prompts, SAMPLES, sample_answers=True, generator=generator)
    result = {"rollouts": rollouts, "decoded": split.sampler.decoded, "state": generator.get_state()}
    if dist.get_rank() == 0:
        alone, generator = engine(1), torch.Generator().manual_seed(SEED)
        result["alone"] = alone.generate(prompts, SAMPLES, sample_answers=True, generator=generator)
        result["alone_state"] = generator.get_state()
    return result


@pytest.mark.slow
def test_each_engine_of_a_replica_decodes_its_share_and_every_rank_gets_one_engines_rollouts():
    """Two engines of one replica (rollout.tensor_parallel=1 on two ranks): 5 prompts split 3 and 2 in the thinking
    phase, 15 answer rows 8 and 7; each prompt decoded once; both ranks hold the same rollouts, those one engine gives
    the whole call alone, and their generators stand where that engine's does."""
    first, second = run_in_processes(replica_rank, 2, 1)
    assert first["decoded"] == [3, 8] and second["decoded"] == [2, 7]
    assert first["rollouts"] == second["rollouts"] == first["alone"]
    assert torch.equal(first["state"], first["alone_state"]) and torch.equal(second["state"], first["alone_state"])


@pytest.mark.slow
def test_one_engine_over_the_replicas_ranks_decodes_every_prompt_on_each_of_its_ranks():
    """rollout.tensor_parallel=2 on a replica of two ranks: one engine, whose two tensor-parallel ranks each take the
    whole call together (as vLLM's do), so nothing is split."""
    first, second = run_in_processes(replica_rank, 2, 2)
    assert first["decoded"] == second["decoded"] == [PROMPTS, PROMPTS * SAMPLES]
    assert first["rollouts"] == second["rollouts"] == first["alone"]


def test_shares_are_as_even_as_they_go_the_first_ones_longer():
    assert share_sizes(5, 2) == [3, 2] and share_sizes(2, 4) == [1, 1, 0, 0] and share_sizes(8, 4) == [2] * 4
    assert all(sum(share_sizes(prompts, engines)) == prompts for prompts in range(12) for engines in range(1, 6))


def test_a_lockstep_sampler_that_cannot_split_a_call_is_refused_in_one_line():
    """A plugin's lockstep sampler without sample_seeded would have every engine of a replica decode all its prompts."""
    from nemo_jq.rollouts.refit import ReplicaShares
    from nemo_jq.typed import ConfigError

    class EveryRankSamplesAll:
        lockstep, tensor_parallel = True, 1

    with pytest.raises(ConfigError, match="EveryRankSamplesAll samples in lockstep on every rank but has no sample_seeded"):
        ReplicaShares(EveryRankSamplesAll(), group=None)
