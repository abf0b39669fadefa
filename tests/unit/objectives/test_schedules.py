"""q schedules: shapes over steps, the adaptive rule, resume state, and config loading."""

import math
import re
from pathlib import Path

import pytest
import yaml

from nemo_jq.objectives.schedules import AdaptiveQ, ConstantQ, CosineQ, LinearQ, StepQ, build_schedule

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "schedules"


def test_step_only_schedules():
    assert ConstantQ(0.75)(0) == ConstantQ(0.75)(10_000) == 0.75
    sft_then_rl = StepQ(switch_step=100)
    assert [sft_then_rl(s) for s in (0, 99, 100, 5000)] == [1.0, 1.0, 0.0, 0.0]
    lin = LinearQ(num_steps=11, q_start=1.0, q_end=0.2)
    assert [lin(s) for s in (0, 5, 10, 20)] == pytest.approx([1.0, 0.6, 0.2, 0.2])
    cos = CosineQ(num_steps=11, q_start=0.85, q_end=0.25)
    assert [cos(s) for s in (0, 5, 10, 11)] == pytest.approx([0.85, 0.55, 0.25, 0.25])
    assert cos(2) > LinearQ(num_steps=11, q_start=0.85, q_end=0.25)(2)  # cosine stays high longer


@pytest.mark.parametrize("schedule", [LinearQ, CosineQ])
def test_the_last_scheduled_step_has_q_end(schedule):
    """Steps count from 0, so ``num_steps`` steps end at ``num_steps - 1``: there q is ``q_end`` (one step: that one)."""
    twelve = schedule(num_steps=12, q_start=1.0, q_end=0.25)
    assert twelve(0) == 1.0 and twelve(11) == pytest.approx(0.25) and twelve(10) > 0.25
    assert schedule(num_steps=1, q_start=1.0, q_end=0.25)(0) == 0.25


def test_adaptive_keeps_q_high_in_cold_start_and_anneals_as_p_hat_grows():
    sched = AdaptiveQ(q_max=1.0, q_min=0.0, cold_p=1 / 32, ema_decay=0.0)
    assert sched(0) == 1.0
    sched.observe(math.log(1e-9))
    assert sched(1) == 1.0
    sched.observe(math.log(1 / 32))
    assert sched(2) == pytest.approx(1.0)
    sched.observe(math.log(1 / math.sqrt(32)))
    assert sched(3) == pytest.approx(0.5)
    sched.observe(0.0)
    assert sched(4) == pytest.approx(0.0)
    sched.observe(math.log(1e-9))  # monotone: a bad batch does not re-commit
    assert sched(5) == pytest.approx(0.0)


def test_adaptive_smooths_with_an_ema_and_can_rise_when_not_monotone():
    sched = AdaptiveQ(q_max=0.8, q_min=0.2, cold_p=0.01, ema_decay=0.5, monotone=False)
    sched.observe(math.log(0.01))
    sched.observe(0.0)  # EMA: log P̂ = 0.5 log 0.01
    assert sched(2) == pytest.approx(0.2 + 0.6 * 0.5)
    sched.observe(math.log(1e-6))
    assert sched(3) > 0.5


def test_adaptive_state_round_trips():
    a = AdaptiveQ(ema_decay=0.7)
    for lp in (-20.0, -3.0, -1.0):
        a.observe(lp)
    b = AdaptiveQ(ema_decay=0.7)
    b.load_state_dict(a.state_dict())
    a.observe(-0.5)
    b.observe(-0.5)
    assert a(4) == b(4)


def test_schedule_parameter_errors():
    with pytest.raises(ValueError, match=re.escape("q_before must lie in [0, 1] (0 = RLVR, 1 = log-marginal-likelihood); got "
                                                   "q_before=2.0")):  # the key, not "q"
        StepQ(switch_step=3, q_before=2.0)
    with pytest.raises(ValueError, match=re.escape("switch_step must be >= 0 (the first step is 0); got switch_step=-5")):
        StepQ(switch_step=-5)  # it trained at q_after from the first step
    with pytest.raises(ValueError, match="num_steps"):
        LinearQ(num_steps=0)
    with pytest.raises(ValueError, match="q_min=0.9 must not exceed q_max=0.5"):
        AdaptiveQ(q_max=0.5, q_min=0.9)
    with pytest.raises(ValueError, match="cold_p"):
        AdaptiveQ(cold_p=1.5)


def test_build_schedule_from_every_shipped_config():
    files = sorted(CONFIGS.glob("*.yaml"))
    names = set()
    for path in files:
        spec = yaml.safe_load(path.read_text())
        sched = build_schedule(spec)
        assert 0.0 <= sched(0) <= 1.0
        names.add(spec["name"])
    assert names == {"constant", "step", "linear", "cosine", "adaptive"}
    assert build_schedule(0.5)(7) == 0.5


def test_build_schedule_rejects_unknown_names_and_keys():
    with pytest.raises(ValueError, match="name must be one of"):
        build_schedule({"name": "exponential"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['steps'\]"):
        build_schedule({"name": "linear", "steps": 10})
    # a name or key YAML read as other than text: a TypeError's traceback
    with pytest.raises(ValueError, match=r"name must be one of .*; got name=\['step'\]"):
        build_schedule({"name": ["step"]})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['1', 'foo'\] for q schedule 'step'"):
        build_schedule({"name": "step", 1: 2, "foo": 3, "switch_step": 3})
    assert build_schedule({"name": "linear", "num_steps": 10, "q_start": "1e-1"})(0) == 0.1  # YAML 1.1's text for 0.1


@pytest.mark.parametrize("spec, message", [
    ({"name": "adaptive", "cold_p": "abc"}, "'adaptive': cold_p must be a finite number; got 'abc'"),
    ({"name": "adaptive", "q_max": float("nan")}, "'adaptive': q_max must be a finite number; got nan"),
    ({"name": "adaptive", "monotone": "yes"}, "'adaptive': monotone must be true or false; got 'yes'"),
    ({"name": "linear", "num_steps": 2.5}, "'linear': num_steps must be a whole number; got 2.5"),
    ({"name": "step", "switch_step": True}, "'step': switch_step must be a whole number; got True"),
    ({"name": "cosine", "num_steps": 10, "q_end": None}, "'cosine': q_end must be a finite number; got None"),
])
def test_build_schedule_names_a_value_of_the_wrong_kind(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_schedule(spec)


def test_a_schedule_registered_must_be_a_dataclass_with_a_schedules_methods():
    from dataclasses import dataclass

    from nemo_jq.objectives.schedules import StepOnlyQ, register_q_schedule

    with pytest.raises(TypeError, match="register a dataclass"):
        register_q_schedule("not_a_dataclass")(type("Plain", (StepOnlyQ,), {"__call__": lambda self, step: 0.5}))
    with pytest.raises(TypeError, match="lacks __call__ .subclass StepOnlyQ"):
        register_q_schedule("no_call")(dataclass(type("NoCall", (StepOnlyQ,), {})))
    with pytest.raises(TypeError, match="lacks observe, state_dict, load_state_dict"):
        register_q_schedule("no_state")(dataclass(type("NoState", (), {"__call__": lambda self, step: 0.5})))
    with pytest.raises(ValueError, match="q schedule 'linear' is already registered"):
        register_q_schedule("linear")(dataclass(type("Mine", (StepOnlyQ,), {"__call__": lambda self, step: 0.5})))
