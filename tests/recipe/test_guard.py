"""The collapse guard: scripted metric streams that must and must not trigger it, and the trainer's response."""

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_RUN
from nemo_jq.config import ConfigError, load_config
from nemo_jq.objectives import get_objective
from nemo_jq.recipe.guard import CollapseGuard
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.monitor import read_metrics


def guard(**overrides):
    return CollapseGuard(**{"min_fraction_of_best": 0.5, "patience": 2, "logp_drop": 2.0, "window": 3, **overrides})


@pytest.mark.parametrize("stream, fires_at", [
    ([10, 20, 9, 8], 3),           # two evaluations in a row below half the best
    ([10, 20, 9, 15, 9, 12], None),  # a dip that recovers resets the streak
    ([0, 0, 0, 0], None),          # no best above zero: nothing to fall from
    ([10, 20, 10, 10, 10], None),  # exactly half the best is not below it
    ([30, 5, 5, 5], 2),
])
def test_validation_streams(stream, fires_at):
    watcher = guard()
    fired = [i for i, value in enumerate(stream) if watcher.validation(value)]
    assert (fired[0] if fired else None) == fires_at


@pytest.mark.parametrize("stream, fires_at", [
    ([17.2, 6.25, 7.81, 6.25], None),  # the clean demo's GARL q=0.5: 64 prompts' noise, not a collapse
    ([1.56, 0.0, 0.0, 0.0], None),     # GRPO's one lucky prompt
    ([17.2, 3.0, 3.0], 2),             # beyond 2 standard errors (13.3 points) twice
    ([40.0, 10.0, 30.0, 10.0, 10.0], 4),
])
def test_validation_streams_over_64_prompts_ignore_sampling_noise(stream, fires_at):
    watcher = guard(min_drop_se=2.0)
    fired = [i for i, value in enumerate(stream) if watcher.validation(value, 64)]
    assert (fired[0] if fired else None) == fires_at
    plain = guard(min_drop_se=0.0)  # without the test, the demo's noise fires
    assert any(plain.validation(value, 64) for value in [17.2, 6.25, 7.81]) and guard().validation(17.2, 64) is None


@pytest.mark.parametrize("stream, fires_at", [
    ([-5, -5, -5, -4, -4, -4, -7, -7, -7], 8),  # the 3-step mean falls from -4 to -7: 3 nats
    ([-5, -4, -6, -4, -5, -6, -4, -5], None),   # noise within the margin
    ([-3, -3, -3, None, -9, -9, -9], 5),          # steps without log P̂ are skipped: [-3, -9, -9] is 4 down
])
def test_train_logp_streams(stream, fires_at):
    watcher = guard()
    fired = [i for i, value in enumerate(stream) if watcher.train(value)]
    assert (fired[0] if fired else None) == fires_at
    assert not any(guard(logp_drop=0.0).train(value) for value in stream)  # 0 turns the signal off


def test_improving_streams_never_trigger_and_a_restored_guard_continues_alike():
    rng = random.Random(0)
    for _ in range(200):
        values = sorted(rng.uniform(0, 100) for _ in range(12))
        logps = sorted(rng.uniform(-30, 0) for _ in range(40))
        watcher = guard()
        assert not any(watcher.validation(v) for v in values) and not any(watcher.train(v) for v in logps)
    stream = [rng.uniform(-10, 0) for _ in range(30)]
    whole, first = guard(), guard()
    expected = [whole.train(v) for v in stream]
    head = [first.train(v) for v in stream[:13]]
    second = guard()
    second.load_state_dict(first.state_dict())
    assert head + [second.train(v) for v in stream[13:]] == expected


def scripted_trainer(tmp_path, validation, *overrides):
    """A tiny run whose validation m@4 follows ``validation`` (one value per step)."""
    trainer = Trainer(load_config(None, [*TINY_RUN, "guard.enabled=true", "guard.logp_drop=0", "guard.min_drop_se=0", "eval.every=1",
                                         f"train.max_steps={len(validation)}", f"train.run_dir={tmp_path / 'run'}",
                                         *overrides]))
    scores = iter(validation)
    evaluate = trainer.evaluator.evaluate
    trainer.evaluator.evaluate = lambda split, seed_offset=0, shown=0, stopped=None: (
        {"p@1": 0.0, "p@4": 0.0, "m@4": next(scores)} if split == "validation" else evaluate(split, seed_offset))
    loads = []
    load = trainer.policy.load

    def recording_load(directory, *, with_optimizer=True):
        load(directory, with_optimizer=with_optimizer)
        loads.append((Path(directory).name, {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}))

    trainer.policy.load = recording_load
    return trainer, loads


@pytest.mark.slow
def test_a_collapse_restores_the_best_checkpoint_switches_to_paft_and_is_logged(tmp_path):
    """The default action switches to guard.estimator (paft), named through the registry."""
    trainer, loads = scripted_trainer(tmp_path, [50, 60, 20, 10, 40])
    trainer.fit()
    [event] = [r for r in read_metrics(trainer.run_dir) if r["kind"] == "guard"]
    assert (event["step"], event["restored_step"], event["action"], event["objective"]) == (4, 2, "switch_estimator", "paft")
    name, weights = loads[0]
    assert name == "step_00000002"
    saved = load_file(str(trainer.run_dir / "checkpoints" / name / "model.safetensors"))
    assert all(torch.equal(weights[key], saved[key]) for key in saved)
    assert trainer.objective.estimator.name == "paft"
    assert [r["objective"] for r in read_metrics(trainer.run_dir) if r["kind"] == "guard"] == ["paft"]
    resumed = Trainer.resume(trainer.run_dir)
    assert resumed.objective.estimator.name == "paft" and resumed.state.course.guard_triggers == 1
    assert (trainer.run_dir / "training.png").exists()


@pytest.mark.parametrize("action", ["lower_lr", "lower_q"])
def test_lower_lr_and_lower_q_scale_by_the_factor_at_each_trigger(tmp_path, action):
    trainer, _ = scripted_trainer(tmp_path, [50, 10, 10, 60, 10, 10], f"guard.action={action}", "guard.factor=0.25")
    trainer.fit()
    records = read_metrics(trainer.run_dir)
    events = [r for r in records if r["kind"] == "guard"]
    assert [(e["step"], e["restored_step"]) for e in events] == [(3, 1), (6, 4)]
    q = {r["step"]: r["q"] for r in records if r["kind"] == "train"}
    if action == "lower_lr":
        assert trainer.policy.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * 0.25**2)
        assert q[3] == q[4] == 0.75
    else:
        assert (q[3], q[4], q[6]) == (0.75, pytest.approx(0.75 * 0.25), pytest.approx(0.75 * 0.25))


def test_the_trainer_weighs_a_drop_against_its_validation_prompts(tmp_path):
    """On TINY_RUN's 4 validation prompts, 50% -> 10% is within 2 standard errors (70 points): no trigger."""
    trainer, _ = scripted_trainer(tmp_path, [50, 10, 10, 10], "guard.min_drop_se=2")
    trainer.fit()
    assert not [r for r in read_metrics(trainer.run_dir) if r["kind"] == "guard"]


def test_a_run_that_does_not_collapse_is_left_alone_and_lower_q_needs_a_q(tmp_path):
    trainer, loads = scripted_trainer(tmp_path, [10, 20, 20, 30])
    trainer.fit()
    assert not [r for r in read_metrics(trainer.run_dir) if r["kind"] == "guard"] and loads == []
    with pytest.raises(ConfigError, match="guard.action=lower_q needs an estimator with a q"):
        load_config(None, ["guard.enabled=true", "guard.action=lower_q", "objective.name=grpo"])


@pytest.mark.slow
def test_the_guard_switches_to_any_registered_estimator_with_its_defaults(tmp_path):
    trainer, _ = scripted_trainer(tmp_path, [50, 60, 20, 10], "guard.estimator=rb_rloo", "objective.options={baseline: none}")
    trainer.fit()
    [event] = [r for r in read_metrics(trainer.run_dir) if r["kind"] == "guard"]
    assert event["objective"] == "rb_rloo" and trainer.objective.estimator.name == "rb_rloo"
    assert trainer.objective.options == get_objective("rb_rloo").options()  # garl's options do not carry over
