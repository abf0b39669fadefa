"""Off-policy training: importance correction in the trainer, mismatch metrics, one-step-off rollouts."""

import dataclasses

import pytest
import torch

from helpers import TINY_RUN, learn_on, tiny_setup
from nemo_jq.config import load_config
from nemo_jq.objectives.importance import Correction
from nemo_jq.recipe.components import importance_correction
from nemo_jq.recipe.experience import MismatchWatch, experience_from
from nemo_jq.recipe.step import StepResult
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.rollouts import BudgetedRollouts
from nemo_jq.rollouts.hf import NativeSampler
from nemo_jq.rollouts.process import SamplingProcess, share_weights
from nemo_jq.runtime.monitor import merge_metrics, read_metrics

TIMING = {"step_time", "rollout_tokens_per_s"}


def make_trainer(tmp_path, *overrides, name="run"):
    return Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / name}", *overrides]))


def train_records(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_auto_corrects_only_rollouts_that_another_policy_sampled():
    config = load_config(None, [])
    assert importance_correction(config, on_policy=True) is None  # the in-place samplers: every ratio is 1
    # an engine whose numerics differ: each token's ratio (bench/results/importance_modes.md: over long rationales
    # the sequence ratio's truncation is biased by 0.3-0.7 of the gradient where the per-token one is not)
    assert importance_correction(config, on_policy=False) == Correction("token_truncate", cap=2.0, low=0.5, high=2.0)
    lagged = load_config(None, ["rollout.async_steps=1", "objective.importance_cap=3"])
    assert importance_correction(lagged, on_policy=True) == Correction("truncate", cap=3.0)
    assert importance_correction(lagged, on_policy=False) == Correction("truncate", cap=3.0)  # the lag: systematic
    masked = load_config(None, ["objective.importance=mask", "objective.importance_bounds=[0.25, 4]"])
    assert importance_correction(masked, on_policy=True) == Correction("mask", cap=2.0, low=0.25, high=4.0)
    assert importance_correction(load_config(None, ["objective.importance=none", "rollout.async_steps=1"]),
                                 on_policy=False) is None


def test_micro_batch_metrics_merge_by_kind():
    merged = merge_metrics([(1, {"loss": 1.0, "max_is_ratio": 2.0, "min_is_ratio": 0.5}),
                            (3, {"loss": 3.0, "max_is_ratio": 1.5, "min_is_ratio": 0.8, "kl_k3": 0.25})])
    assert merged == {"loss": 2.5, "max_is_ratio": 2.0, "min_is_ratio": 0.5, "kl_k3": 0.25}  # kl: the one reporting it
    # per-token means by their tokens: one prompt's 100 scored tokens beside another's 300 (by prompts: 0.25)
    merged = merge_metrics([(1, {"kl_k3": 0.1, "logprob_gap": 0.2, "scored_tokens": 100, "loss": 1.0}),
                            (1, {"kl_k3": 0.4, "logprob_gap": 0.6, "scored_tokens": 300, "loss": 3.0})])
    assert merged == pytest.approx({"kl_k3": 0.325, "logprob_gap": 0.5, "scored_tokens": 400, "loss": 2.0}, rel=1e-12)


def test_the_mismatch_warning_says_what_and_repeats_only_when_the_kl_doubles(capsys):
    config = load_config(None, ["rollout.max_mismatch_kl=0.1"])
    watch = MismatchWatch(config.rollout, None)
    for step, kl in enumerate([0.05, 0.2, 0.3, 0.39, 0.5, 0.9], start=1):
        watch(StepResult.from_record(step, {"kl_k3": kl, "max_logprob_gap": 0.5, "logprob_gap": 0.1}))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["warning", "warning"] and "step 2:" in lines[0] and "step 5:" in lines[1]
    assert "KL(engine || policy) 0.2 per token (rollout.max_mismatch_kl=0.1)" in lines[0]
    assert "uncorrected: set objective.importance" in lines[0]
    MismatchWatch(config.rollout, Correction())(StepResult.from_record(1, {"kl_k3": 0.2, "max_logprob_gap": 0.1}))
    assert "corrected by objective.importance=truncate" in capsys.readouterr().out
    # an in-place sampler at another temperature: every ratio is not 1, and the warning says why
    tempered = load_config(None, ["rollout.max_mismatch_kl=0.1", "rollout.temperature=0.7", "rollout.top_p=0.9"])
    MismatchWatch(tempered.rollout, None)(StepResult.from_record(1, {"kl_k3": 0.2, "max_logprob_gap": 0.1}))
    assert ("uncorrected: rollout.temperature=0.7, rollout.top_p=0.9 samples another distribution than the policy's; "
            "set objective.importance to correct for it (docs/off_policy.md, §2.3)") in capsys.readouterr().out


def test_one_step_off_the_watch_says_only_what_the_lag_does_not_explain(capsys):
    """A corrected one-step-off run's lag puts every step past max_mismatch_kl by design: nothing is said for it; a
    KL four times the lag's own (a refit that failed) is. The first step, at lag 0, is judged as on-policy."""
    config = load_config(None, ["rollout.max_mismatch_kl=0.1"])
    watch = MismatchWatch(config.rollout, Correction())
    watch(StepResult.from_record(1, {"kl_k3": 0.05, "max_logprob_gap": 0.5, "rollout_lag": 0}))
    for step, kl in enumerate([0.2, 0.3, 0.25, 0.22, 0.4, 0.3], start=2):
        watch(StepResult.from_record(step, {"kl_k3": kl, "max_logprob_gap": 1.5, "rollout_lag": 1}))
    assert capsys.readouterr().out == ""
    watch(StepResult.from_record(8, {"kl_k3": 1.5, "max_logprob_gap": 4.0, "rollout_lag": 1}))
    line = capsys.readouterr().out
    assert line.startswith("warning: step 8:") and "KL(engine || policy) 1.5 per token (rollout.max_mismatch_kl=0.1, " \
        "5.45 times the 0.275 the one-step lag gave before)" in line and "corrected by" in line, line
    # a resumed run's watch recalls the steps before its checkpoint (metrics.jsonl), saying nothing, and then says what
    # the uninterrupted one does: it started afresh, and said every lagged step past the threshold again
    resumed = MismatchWatch(config.rollout, Correction())
    records = [{"kl_k3": 0.05, "max_logprob_gap": 0.5, "rollout_lag": 0},
               *({"kl_k3": kl, "max_logprob_gap": 1.5, "rollout_lag": 1} for kl in [0.2, 0.3, 0.25, 0.22, 0.4])]
    resumed.recall(StepResult.from_record(step, record) for step, record in enumerate(records, start=1))
    resumed(StepResult.from_record(7, {"kl_k3": 0.3, "max_logprob_gap": 1.5, "rollout_lag": 1}))
    assert capsys.readouterr().out == ""
    resumed(StepResult.from_record(8, {"kl_k3": 1.5, "max_logprob_gap": 4.0, "rollout_lag": 1}))
    assert "5.45 times the 0.275 the one-step lag gave before" in capsys.readouterr().out
    uncorrected = MismatchWatch(config.rollout, None)  # without a correction the lag is not by design: said at once
    uncorrected(StepResult.from_record(2, {"kl_k3": 0.2, "max_logprob_gap": 1.5, "rollout_lag": 1}))
    assert "uncorrected" in capsys.readouterr().out


@pytest.mark.slow
def test_an_estimator_that_takes_no_correction_is_said_to_train_one_step_off_uncorrected(tmp_path, capsys):
    """objective.importance=auto truncates one step off, but rlpr (and the other verifier-free estimators, the GARL
    ablations) take no correction: the run said nothing, and its watch called the lag corrected by truncate."""
    trainer = make_trainer(tmp_path, "objective.name=rlpr", "rollout.async_steps=1", "rollout.max_mismatch_kl=0.1")
    assert "objective.name=rlpr takes no off-policy correction" in capsys.readouterr().err
    assert trainer.components.correction is not None and trainer.mismatch.correction is None
    trainer.mismatch(StepResult.from_record(2, {"kl_k3": 0.2, "max_logprob_gap": 1.5, "rollout_lag": 1}))
    assert "uncorrected: objective.name=rlpr takes no correction" in capsys.readouterr().out
    make_trainer(tmp_path, "rollout.async_steps=1", name="garl")
    assert "takes no off-policy correction" not in capsys.readouterr().err


def _gradient(trainer, engine, num_samples, seed):
    """The gradient of the trainer's loss on its first training prompt, from ``num_samples`` rollouts of ``engine``."""
    trainer.policy.model.zero_grad(set_to_none=True)
    examples = trainer.components.splits.train[:1]
    rollouts = engine.generate(trainer.components.prompt_ids(examples), num_samples, sample_answers=False,
                               generator=torch.Generator().manual_seed(seed))
    experience = dataclasses.replace(experience_from(trainer.components, examples, trainer.objective.estimator, rollouts, 0, 0.0),
                                     group=num_samples)
    [(_, metrics)] = learn_on(trainer, experience, 0.0, 1)
    return torch.cat([p.grad.flatten() for p in trainer.policy.model.parameters() if p.grad is not None]), metrics


@pytest.mark.slow
def test_a_corrected_gradient_from_a_perturbed_sampler_is_closer_to_the_on_policy_one(tmp_path):
    """GARL at q=0 from rollouts at temperature 0.7 (a sampler that is not the policy), on a fixed prompt: the
    corrected gradient is nearer the on-policy one (4096 rollouts of the policy itself) than the uncorrected one,
    and the metrics report the mismatch. The model's head is sharpened so the temperature moves its samples."""
    trainer = make_trainer(tmp_path, "objective.name=garl", "objective.q=0", "train.micro_batch_size=1")
    with torch.no_grad():
        trainer.policy.model.lm_head.weight.mul_(6.0)
    chat = trainer.components.chat

    def engine(temperature):
        sampler = NativeSampler(trainer.policy.model, pad_id=chat.pad_id, device=trainer.components.device,
                                settings=dataclasses.replace(trainer.components.engine.sampler.settings, temperature=temperature))
        return BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                                max_thinking_tokens=3, max_answer_tokens=3)

    on_policy, _ = _gradient(trainer, engine(1.0), 4096, seed=99)
    errors = {}
    for correction in (None, Correction("plain")):
        trainer.components.correction = correction
        gradient, metrics = _gradient(trainer, engine(0.7), 1024, seed=1)
        errors[correction] = float((gradient - on_policy).norm() / on_policy.norm())
        assert metrics["kl_k3"] > 0.1 and metrics["max_logprob_gap"] > 1.0  # the mismatch is reported either way
    assert errors[Correction("plain")] < 0.5 * errors[None]
    assert {"is_ratio_mean", "min_is_ratio", "max_is_ratio", "is_truncated_fraction",
            "is_truncated_mass"} <= metrics.keys()


@pytest.mark.slow
@pytest.mark.distributed
def test_one_step_off_in_a_sampling_process_equals_the_same_run_sampled_in_sequence(tmp_path):
    """The child process samples step t+1's rollouts from θ_t while step t trains: exactly what sampling them on
    this thread before the step trains gives, so the copy never sees a half-updated policy."""
    overrides = ("rollout.async_steps=1", "train.max_steps=4", "eval.every=100", "train.save_every=100")
    overlapped = make_trainer(tmp_path, *overrides, name="overlapped")
    overlapped.fit()
    in_sequence = make_trainer(tmp_path, *overrides, name="in_sequence")
    in_sequence.ahead.overlaps = False
    in_sequence.fit()
    records = train_records(tmp_path / "overlapped")
    assert records == train_records(tmp_path / "in_sequence")
    assert [r["rollout_lag"] for r in records] == [0, 1, 1, 1]
    assert records[0]["kl_k3"] < 1e-9 < 1e-4 < min(r["kl_k3"] for r in records[1:])  # the policy has moved on
    assert all(r["is_ratio_mean"] > 0 for r in records)  # auto: truncated
    assert overlapped.ahead.worker is None  # closed when fit returned


def test_one_step_off_in_sequence_wakes_the_engine_once_a_sampling_call(tmp_path, monkeypatch):
    """Sampled before the step trains (vLLM's, or under torchrun), the request refitted the engine in a wake of its own
    and sampled in another: a vLLM engine moved its weights and rebuilt its cache twice a step."""
    import contextlib

    trainer = make_trainer(tmp_path, "rollout.async_steps=1", "train.max_steps=3", "eval.every=100",
                           "train.save_every=100")
    trainer.ahead.overlaps = False
    engine, counts = trainer.ahead.engine.engine, {"awake": 0, "generate": 0, "depth": 0}
    awake, generate = engine.awake, engine.generate

    @contextlib.contextmanager
    def counted_awake():  # the outermost: a wake within a wake moves nothing
        counts["awake"] += counts["depth"] == 0
        counts["depth"] += 1
        try:
            with awake():
                yield
        finally:
            counts["depth"] -= 1

    def counted_generate(*args, **kwargs):
        counts["generate"] += 1
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "awake", counted_awake)
    monkeypatch.setattr(engine, "generate", counted_generate)
    trainer.fit()
    assert counts["generate"] >= 3 and counts["awake"] == counts["generate"] and counts["depth"] == 0, counts


def test_rollouts_sampled_ahead_are_resumed_only_at_the_layout_they_were_saved_at(tmp_path):
    """megatron.* sizes may change on resume, and each rank saved its replica's rollouts: at DP 1 -> 2 both replicas
    trained on the whole batch, at DP 2 -> 1 on half, divided by the whole; at TP 2 -> 4 one replica's ranks held two
    replicas' batches. At another layout the first step samples its own (lag 0)."""
    ahead = make_trainer(tmp_path, "rollout.async_steps=1").ahead
    saved = {"pending": "step 3's rollouts", "layout": ahead.layout()}
    assert saved["layout"] == [1, 1, 1, 1, 1]
    for layout, kept in ((saved["layout"], True), ([2, 2, 1, 1, 1], False), ([4, 1, 4, 1, 1], False), (None, True)):
        ahead.load_state_dict({**saved, "layout": layout} if layout else {"pending": saved["pending"]})  # None: older
        assert (ahead.pending == saved["pending"]) is kept and (ahead.pending is None) is not kept


@pytest.mark.slow
def test_an_interrupted_one_step_off_run_resumes_exactly(tmp_path):
    """(Sampled in sequence, which the test above shows is the same, to spare three process starts.)"""
    overrides = ("rollout.async_steps=1", "train.max_steps=5", "eval.every=100")

    def in_sequence(trainer):
        trainer.ahead.overlaps = False
        return trainer

    in_sequence(make_trainer(tmp_path, *overrides, name="a")).fit()
    assert in_sequence(make_trainer(tmp_path, *overrides, name="b")).fit(max_steps=3) == {"step": 3}
    resumed = in_sequence(Trainer.resume(tmp_path / "b"))
    assert resumed.ahead.pending is not None  # the checkpoint carried the rollouts sampled ahead
    lagged = [record["kl_k3"] for record in train_records(tmp_path / "b") if record.get("rollout_lag")]
    assert len(lagged) == 2 and resumed.mismatch.lagged_kls == lagged  # its watch recalled the steps before
    resumed.fit()
    assert train_records(tmp_path / "a") == train_records(tmp_path / "b")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sampling_process_raises_its_errors_here_and_samples_what_this_process_would():
    _, _, chat, model = tiny_setup()
    engine = BudgetedRollouts(NativeSampler(model, pad_id=chat.pad_id, device=torch.device("cpu")),
                              think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id, max_thinking_tokens=5,
                              max_answer_tokens=2)
    share_weights(engine)
    worker = SamplingProcess(engine, threads=1)
    try:
        with torch.no_grad():  # a refit here, between requests, is what the child samples from next
            model.lm_head.weight.mul_(3.0)
        worker.submit([[1, 2, 3], [4, 5]], 2, sample_answers=True, seed=7)
        rollouts, tokens, _ = worker.result()
        assert rollouts == engine.generate([[1, 2, 3], [4, 5]], 2, sample_answers=True,
                                           generator=torch.Generator().manual_seed(7))
        assert tokens == sum(len(r.rationale_ids) + 1 + len(r.answer_ids) for group in rollouts for r in group)
        worker.submit([[]], 2, sample_answers=False, seed=7)
        with pytest.raises(ValueError, match="non-empty prompts"):
            worker.result()
    finally:
        worker.close()


@pytest.mark.slow
@pytest.mark.distributed
def test_an_error_in_the_sampling_process_ends_the_run_with_that_error(tmp_path, monkeypatch):
    """The child's error was raised once and the request kept as in flight, so that fit's close() waited for a second
    reply the child never sends: the run hung (its allocation burnt) and never showed the error."""
    import threading

    submit = SamplingProcess.submit
    monkeypatch.setattr(SamplingProcess, "submit", lambda self, prompts, n, **kw: submit(self, [[]], n, **kw))
    trainer = make_trainer(tmp_path, "rollout.async_steps=1", "train.max_steps=3", "eval.every=100",
                           "train.save_every=100")
    raised = []

    def fit():
        try:
            trainer.fit()
        except ValueError as err:
            raised.append(err)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    thread.join(timeout=240)
    assert not thread.is_alive(), "the run hung after its sampling process failed"
    assert len(raised) == 1 and "non-empty prompts" in str(raised[0]) and trainer.ahead.worker is None


@pytest.mark.parametrize("share, sampler, trainer", [(1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 2, 2)])
def test_one_step_off_splits_the_runs_own_thread_share_between_the_trainer_and_the_sampling_process(share, sampler,
                                                                                                  trainer):
    """A sweep (and the demo) gives each run its share of the free cores as OMP_NUM_THREADS, torch's thread count,
    which the one-step-off run splits: the sampling process takes half of it and training the rest, so the run holds
    its share (at a share of one, one thread each: neither has OpenMP threads spinning while the other works)."""
    from nemo_jq.recipe.experience import split_threads

    assert split_threads(share) == (sampler, trainer)
