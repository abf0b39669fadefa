"""Training memory that does not grow with M: row chunks (``train.micro_batch_rows``) give the whole-group gradient
for every estimator and correction; activation checkpointing (``model.activation_checkpointing``) the same gradient."""

import copy
import math

import pytest
import torch

from helpers import TINY_RUN, learn_on, tiny_setup
from nemo_jq.config import load_config
from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.objectives import Need, get_objective, list_objectives
from nemo_jq.objectives.importance import Correction
from nemo_jq.recipe.experience import experience_from
from nemo_jq.recipe.trainer import Trainer

SAMPLES = 4
#: Chunks of one row, of three (across prompt groups and micro-batches) and of one group.
CHUNKS = (1, 3, SAMPLES)


def learned(trainer, experience, rows):
    """The accumulated gradient and the merged metrics of one batch, in chunks of ``rows`` rows (None: whole groups),
    the estimator's random stream as it was before."""
    state = trainer.random.estimator.get_state()
    trainer.config.train.micro_batch_rows = rows
    metrics = learn_on(trainer, experience, 0.5 if trainer.objective.estimator.uses_q else None, experience.num_prompts)
    trainer.random.estimator.set_state(state)
    grads = [p.grad.clone() for p in trainer.policy.model.parameters()]
    trainer.policy.optimizer.zero_grad(set_to_none=True)
    return grads, metrics


CORRECTIONS = {"on_policy": None, "truncate": Correction("truncate", cap=1.5), "mask": Correction("mask", low=0.7, high=1.4),
               "token_truncate": Correction("token_truncate", cap=1.1), "geometric": Correction("geometric", cap=1.02)}


@pytest.mark.parametrize(("name", "correction"), [
    pytest.param(name, correction, id=f"{name}-{label}") for name in list_objectives() for label, correction in
    CORRECTIONS.items() if correction is None or get_objective(name).corrects_off_policy])  # the trainer refuses the rest
def test_row_chunks_give_the_whole_group_gradient(tmp_path, name, correction):
    estimator = get_objective(name)
    trainer = Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'run'}", f"objective.name={name}",
                                         f"rollout.num_samples={SAMPLES}", "rollout.max_thinking_tokens=6"]))
    parts = trainer.components
    examples = parts.splits.train[:4]
    if Need.GIVEN_TARGET in estimator.needs:
        from nemo_jq.recipe.experience import make_experience

        experience = make_experience(parts, examples, estimator, torch.Generator().manual_seed(0))
    else:
        rollouts = parts.engine.generate(parts.prompt_ids(examples), SAMPLES, generator=torch.Generator().manual_seed(0),
                                         sample_answers=Need.SAMPLED_ANSWER_REWARD in estimator.needs)
        experience = experience_from(parts, examples, estimator, rollouts, 0, 1.0)
    if estimator.needs & {Need.SAMPLED_ANSWER_REWARD}:  # rewards that differ within every group
        experience.rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0],
                                           [0.0, 0.0, 1.0, 1.0]])
    if correction is not None:  # an engine that is off by up to e^±0.3 per sampled token
        engine = experience.batch.engine_logprobs
        noise = torch.empty_like(engine).uniform_(-0.3, 0.3, generator=torch.Generator().manual_seed(1))
        experience.batch.engine_logprobs = engine + noise
        parts.correction = correction
    whole, whole_metrics = learned(trainer, experience, None)
    scale = max(float(g.abs().max()) for g in whole)
    assert scale > 0
    for rows in CHUNKS:
        grads, metrics = learned(trainer, experience, rows)
        for full, chunked in zip(whole, grads):
            torch.testing.assert_close(chunked, full, atol=1e-5 * scale, rtol=1e-4)
        for (prompts, full), (chunk_prompts, values) in zip(whole_metrics, metrics):
            assert prompts == chunk_prompts and set(values) == set(full)
            for key, value in full.items():
                assert math.isclose(values[key], value, rel_tol=1e-5, abs_tol=1e-6), (rows, key)


def test_row_chunks_hold_rows_of_like_length_and_so_pad_least():
    """``chunks_by_length``: every row once, chunks of the size asked (the last the rest), longest first; the tokens a
    pass runs (each chunk's rows at its longest) never more than the rows' own order gives, and far fewer where rows
    that stop early sit beside rows that run to the budget (as one prompt's rollouts do once a model learns to stop)."""
    from nemo_jq.recipe.learn import chunks_by_length

    def padded(chunks, lengths):
        return sum(len(chunk) * int(lengths[chunk].max()) for chunk in chunks)

    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        rows, size = int(torch.randint(1, 70, (1,), generator=generator)), int(torch.randint(1, 9, (1,), generator=generator))
        lengths = torch.randint(1, 4096, (rows,), generator=generator)
        chunks = chunks_by_length(lengths, size)
        assert sorted(torch.cat(chunks).tolist()) == list(range(rows))
        assert [len(chunk) for chunk in chunks[:-1]] == [size] * (len(chunks) - 1) and 0 < len(chunks[-1]) <= size
        assert lengths[chunks[0]].max() == lengths.max()
        in_order = list(torch.arange(rows).split(size))
        assert padded(chunks, lengths) <= padded(in_order, lengths)
    # 4 prompts x 32 rollouts, 8 rows a chunk (the paper configs): in each prompt's rows every other one stopped early
    lengths = torch.tensor([4096 if row % 2 else 512 for row in range(128)])
    chunks = chunks_by_length(lengths, 8)
    assert padded(chunks, lengths) == 64 * 4096 + 64 * 512 < 0.57 * padded(list(torch.arange(128).split(8)), lengths)


def test_activation_checkpointing_keeps_less_and_gives_the_same_gradient():
    """The hf backend's ``model.activation_checkpointing``: what autograd saves in the forward shrinks (each decoder
    layer keeps its input only), the gradient does not change."""
    from nemo_jq.models.hf import HFPolicy

    _, tokenizer, _, model = tiny_setup()
    rows = torch.randint(3, len(tokenizer), (4, 24), generator=torch.Generator().manual_seed(0))
    batch = TokenBatch(rows, torch.ones_like(rows), torch.ones(4, 23, dtype=torch.bool), torch.zeros(4, 23, dtype=torch.bool))

    def step(checkpointing):
        policy = HFPolicy(copy.deepcopy(model), device=torch.device("cpu"), activation_checkpointing=checkpointing)
        saved = []

        def pack(tensor):
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            policy.forward_backward([batch], lambda logprobs, index: (-logprobs.sum(), {}))
        return sum(saved), [p.grad for p in policy.model.parameters()]

    kept, grads = step(False)
    kept_checkpointed, grads_checkpointed = step(True)
    assert kept_checkpointed < kept / 2
    for plain, checkpointed in zip(grads, grads_checkpointed):
        torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=1e-5)


def megatron_steps(run_dir: str, overrides: list[str]) -> tuple[list[dict], list[int]]:
    """Three steps of the tiny run on the megatron backend (one rank of :func:`megatron_cpu.run_in_processes`), and
    each pass of the pipeline schedule it ran: its micro-batches' lengths, and the lengths the stages computed them at."""
    from nemo_jq.models.megatron import policy
    from nemo_jq.runtime.monitor import read_metrics

    schedules, run_pipeline, right_padded = [], policy.MegatronPolicy._run_pipeline, policy._right_padded

    def counted(self, micro_batches, *args, **kwargs):
        schedules.append(([micro.input_ids.shape[1] for micro in micro_batches], []))
        return run_pipeline(self, micro_batches, *args, **kwargs)

    def padded(micro, rows, length):
        schedules[-1][1].append(length)
        return right_padded(micro, rows, length)

    policy.MegatronPolicy._run_pipeline, policy._right_padded = counted, padded
    Trainer(load_config(None, [*TINY_RUN, "train.max_steps=3", "eval.every=1000", f"train.run_dir={run_dir}",
                               "objective.name=garl", "model.backend=megatron", *overrides])).fit()
    return [{key: r[key] for key in ("loss", "grad_norm", "rollout_tokens")} for r in read_metrics(run_dir)
            if r["kind"] == "train"], schedules


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.megatron
def test_row_chunks_train_alike_on_two_megatron_pipeline_stages(tmp_path):
    """The two passes on the megatron backend: the no-grad scoring pass's log-probs reach both stages (PP=2, where
    only the last computes them), and three GARL steps in chunks of 3 rows equal the stored whole-group steps of the
    same run on the hf backend (tests/fixtures/three_step_metrics.json). Each pass goes through the stages in one
    run of the schedule over all its chunks (a chunk at a time would leave a stage idle while the other works), each
    chunk at its own length (padded to the longest, a short chunk cost the longest one's compute on every stage)."""
    pytest.importorskip("megatron.core")
    import json
    from pathlib import Path

    from megatron_cpu import run_in_processes

    stored = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "three_step_metrics.json").read_text())["garl"]
    ranks = run_in_processes(megatron_steps, 2, str(tmp_path / "run"), ["megatron.pipeline_parallel=2", "train.micro_batch_rows=3"])
    (metrics, schedules), (other_metrics, other_schedules) = ranks
    assert metrics == other_metrics and schedules == other_schedules
    chunks = -(-16 // 3)  # the tiny run's 4 prompts x M=4 rows a step, in chunks of 3
    assert [len(lengths) for lengths, _ in schedules] == [chunks, chunks] * 3, schedules  # per step: scoring, gradient
    computed = [length for _, lengths in schedules for length in lengths]
    assert all(lengths == computed_at for lengths, computed_at in schedules) and len(set(computed)) > 1, schedules
    assert [r["rollout_tokens"] for r in metrics] == [r["rollout_tokens"] for r in stored]
    for ours, theirs in zip(metrics, stored, strict=True):
        for key in ("loss", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), (key, ours, theirs)
