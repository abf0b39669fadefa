"""Issue 29, L1: a replica's ranks that do not sample wait for its rollouts one sampler chunk at a time.

Under torchrun one rank of a model replica samples (the native and hf samplers hold the replica's one HF copy) while
the others wait for its rollouts. At 8B one evaluation call (``eval.batch_size`` = 64 prompts x 16 samples x 4k
thinking tokens) takes about 57 minutes against the 60-minute collective timeout (``train.collective_timeout_minutes``),
so a waiting rank that sat in one broadcast for the whole call failed the job on any slower day. Here two gloo ranks
share a group whose timeout is 2 s, and the sampler is made slow per row it decodes (as long rationales make an 8B
model), so that the call takes more than twice the timeout while each of its chunks (one prompt's M rows for the
thinking, a few rows for the answers, as ``rollout.kv_cache_tokens`` cuts them) takes a fifth of it. The slowness is
the only thing that stands in: the sampler, the thinking budgets, the refit and the collectives are the real ones.
"""

from __future__ import annotations

import copy
import time
from datetime import timedelta

import pytest
import torch

pytest.importorskip("megatron.core")  # tests/megatron_cpu.py, which starts the ranks, patches it in each

import torch.distributed as dist  # noqa: E402

from helpers import tiny_setup  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.models.hf import HFPolicy  # noqa: E402
from nemo_jq.rollouts import BudgetedRollouts  # noqa: E402
from nemo_jq.rollouts.hf import NativeSampler  # noqa: E402
from nemo_jq.rollouts.refit import ChunkReporting, RefittedRolloutEngine  # noqa: E402

pytestmark = pytest.mark.megatron

CPU = torch.device("cpu")
TIMEOUT_SECONDS = 2.0
#: The slowness: each row a chunk decodes costs this long, so a chunk of at most SAMPLES rows takes 0.4 s and the
#: whole call (PROMPTS x SAMPLES rows, thinking then answers) about 5 s.
SECONDS_PER_ROW = 0.1
PROMPTS, SAMPLES, THINKING, ANSWERS, SEED = 6, 4, 6, 3, 11


class SlowNativeSampler(NativeSampler):
    """The native sampler, made slow per row it decodes; its samples are the native sampler's own."""

    def _sample(self, prompts, num_samples, **kwargs):
        time.sleep(SECONDS_PER_ROW * len(prompts) * num_samples)
        return super()._sample(prompts, num_samples, **kwargs)


def evaluation_request(sampler_class: type, groups_per_chunk: int | None = 1) -> tuple[BudgetedRollouts, list[list[int]]]:
    """A budgeted engine over the tiny model whose KV cache holds ``groups_per_chunk`` prompts' M rows at a time (one,
    as the 8B configs' ``rollout.kv_cache_tokens`` does; None: no bound), and the prompts of one evaluation call."""
    task, _, chat, model = tiny_setup()
    prompts = [chat.prompt_ids(task.messages(example, "cold")) for example in task.splits(0, PROMPTS, 0, 0).validation]
    group_tokens = (max(map(len, prompts)) + THINKING) * SAMPLES
    sampler = sampler_class(model, pad_id=chat.pad_id, device=CPU,
                            kv_cache_tokens=groups_per_chunk and group_tokens * groups_per_chunk)
    assert sampler.prompts_per_chunk(prompts, SAMPLES, THINKING) == (groups_per_chunk or PROMPTS)
    engine = BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                              max_thinking_tokens=THINKING, max_answer_tokens=ANSWERS)
    return engine, prompts


def replica_rank(timeout_seconds: float) -> tuple[list, float]:
    """One rank of a two-rank replica whose group times out after ``timeout_seconds``: rank 0 samples and rank 1
    waits for its rollouts, as the megatron backend's ranks do. Returns the rollouts and how long the call took."""
    engine, prompts = evaluation_request(SlowNativeSampler)
    policy = HFPolicy(copy.deepcopy(engine.sampler.model), device=CPU)  # the weights the engine is refitted with
    policy.model_parallel_group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_seconds))
    refitted = RefittedRolloutEngine(engine, policy)
    dist.barrier()
    start = time.monotonic()
    rollouts = refitted.generate(prompts, SAMPLES, sample_answers=True, generator=torch.Generator().manual_seed(SEED))
    return rollouts, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_waiting_for_an_evaluation_call_longer_than_the_collective_timeout_does_not_time_out():
    """The call takes more than twice the group's timeout; the waiting rank gets the rollouts all the same (today's
    single broadcast fails it with gloo's "Timed out waiting 2000ms"), and both ranks' rollouts are exactly those of
    the same engine sampling the same prompts in one process, in one piece."""
    (sampled, seconds), (received, _) = run_in_processes(replica_rank, 2, TIMEOUT_SECONDS)
    assert seconds > 2 * TIMEOUT_SECONDS  # the test shows what it claims: one call outlasts the timeout
    engine, prompts = evaluation_request(NativeSampler)
    whole = engine.generate(prompts, SAMPLES, sample_answers=True, generator=torch.Generator().manual_seed(SEED))
    assert len(whole) == PROMPTS and sampled == received == whole


@pytest.mark.parametrize("groups_per_chunk, least_reports", [(None, 2), (1, PROMPTS + 1), (4, 3)])
def test_sampling_chunk_by_chunk_gives_the_samplers_own_samples(groups_per_chunk, least_reports):
    """The sampling rank hands its sampler one of its own chunks at a time and reports after each: the rollouts are
    those of the whole request, whatever ``rollout.kv_cache_tokens`` makes the chunks (the whole request per phase
    without a bound: one report a phase, as before)."""
    engine, prompts = evaluation_request(NativeSampler, groups_per_chunk)
    whole = engine.generate(prompts, SAMPLES, sample_answers=True, generator=torch.Generator().manual_seed(SEED))
    reports = []
    engine.sampler = ChunkReporting(engine.sampler, lambda: reports.append(len(reports)))
    chunked = engine.generate(prompts, SAMPLES, sample_answers=True, generator=torch.Generator().manual_seed(SEED))
    assert chunked == whole and len(reports) >= least_reports
    if groups_per_chunk is None:
        assert len(reports) == 2  # one chunk a phase
