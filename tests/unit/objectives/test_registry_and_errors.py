"""Registry lookups, declared needs, and the error messages users see."""

import math

import pytest
import torch

from nemo_jq.objectives import (
    EstimatorInputs,
    Need,
    garl,
    get_objective,
    grpo,
    list_objectives,
    paft,
    rb_rloo,
    register_objective,
    rloo,
    sft,
)


def test_registry_lists_every_estimator_with_its_needs():
    assert list_objectives() == ["garl", "garl_length_normalized", "garl_resampled_pathwise", "garl_score_only", "grpo",
                                 "maxrl", "paft", "rb_rloo", "rloo", "rlpr", "sft"]
    assert get_objective("garl").needs == {Need.REFERENCE_ANSWER_LOGPROB}
    assert get_objective("paft").needs == {Need.REFERENCE_ANSWER_LOGPROB}
    assert get_objective("rb_rloo").needs == {Need.REFERENCE_ANSWER_LOGPROB}
    assert get_objective("grpo").needs == {Need.SAMPLED_ANSWER_REWARD}
    assert get_objective("rloo").needs == {Need.SAMPLED_ANSWER_REWARD}
    assert get_objective("sft").needs == {Need.GIVEN_TARGET}
    assert [n for n in list_objectives() if get_objective(n).uses_q] == [
        "garl", "garl_length_normalized", "garl_resampled_pathwise", "garl_score_only", "paft"]
    assert get_objective("garl").min_samples == 2 and get_objective("paft").min_samples == 1


def test_rb_rloo_is_garl_at_q0():
    rlp = torch.randn(2, 5, requires_grad=True)
    alp = torch.randn(2, 5) - 3
    rb_rloo(rlp, alp).loss.backward()
    grad_rb = rlp.grad.clone()
    rlp.grad = None
    garl(rlp, alp, 0.0).loss.backward()
    torch.testing.assert_close(grad_rb, rlp.grad)


def test_each_registered_estimator_reads_its_inputs_like_the_pure_function():
    """The registry's adapters hand each pure function the spans and normalisers it documents."""
    torch.manual_seed(0)
    b, m, t = 2, 3, 5
    token_logprob = -torch.rand(b * m, t)
    rationale = torch.zeros(b * m, t, dtype=torch.bool)
    rationale[:, :2] = True
    answer = torch.zeros(b * m, t, dtype=torch.bool)
    answer[:, 2:4] = True
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    inputs = EstimatorInputs(token_logprob, rationale, answer, m, q=0.5, rewards=rewards, tokens_per_example=7.0,
                             batch_rewards=rewards, generator=torch.Generator().manual_seed(1))
    r_lp, a_lp = (token_logprob * rationale).sum(-1).view(b, m), (token_logprob * answer).sum(-1).view(b, m)
    expected = {
        "garl": garl(r_lp, a_lp, 0.5),
        "rb_rloo": rb_rloo(r_lp, a_lp),
        "paft": paft(r_lp, a_lp, 0.5, generator=torch.Generator().manual_seed(1)),
        "grpo": grpo(token_logprob.view(b, m, t), rewards, (rationale | answer).view(b, m, t), tokens_per_example=7.0),
        "rloo": rloo(((rationale | answer) * token_logprob).sum(-1).view(b, m), rewards),
        "sft": sft(token_logprob, rationale | answer),
    }
    for name, out in expected.items():
        got = get_objective(name)(inputs)
        assert got.loss.item() == out.loss.item() and got.metrics == out.metrics, name


def test_unknown_objective_suggests_the_closest_name():
    with pytest.raises(KeyError, match="did you mean 'paft'"):
        get_objective("pafft")


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_objective("garl", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=False)(lambda: None)


def test_a_definition_run_again_replaces_its_first_as_a_notebooks_cell_does():
    """A notebook's cell run again registers the same function anew (same module, same name): the second replaces
    the first; another function under that name is still refused."""
    from nemo_jq.objectives import registry

    cell = ("from nemo_jq.objectives import Need, register_objective\n"
            "@register_objective('mine_in_a_notebook', needs={{Need.GIVEN_TARGET}}, uses_q=False)\n"
            "def mine(inputs, options):\n    return {version}\n")
    try:
        for version in (1, 2):
            exec(cell.format(version=version), {"__name__": "__main__"})  # noqa: S102 - a notebook's cell, run twice
            assert get_objective("mine_in_a_notebook")(None) == version
        with pytest.raises(ValueError, match="'mine_in_a_notebook' is already registered"):
            register_objective("mine_in_a_notebook", needs={Need.GIVEN_TARGET}, uses_q=False)(lambda inputs, options: 3)
    finally:
        registry._REGISTRY.pop("mine_in_a_notebook", None)


@pytest.mark.parametrize("settings, message", [
    (dict(needs=set()), "needs must be one of Need.REFERENCE_ANSWER_LOGPROB"),
    (dict(needs={"sampled_answer_reward"}), "needs must be one of"),  # a string: the trainer fell back to teacher-forcing
    (dict(needs={Need.REFERENCE_ANSWER_LOGPROB, Need.SAMPLED_ANSWER_REWARD}), "needs must be one of"),
    (dict(needs={Need.SAMPLED_ANSWER_REWARD}, min_samples=0), "min_samples must be a whole number >= 1; got 0")])
def test_a_registration_the_trainer_cannot_serve_is_refused_where_it_is_made(settings, message):
    with pytest.raises(TypeError, match=message):
        register_objective("mine_unserved", uses_q=False, **settings)(lambda inputs, options: None)
    with pytest.raises(TypeError, match="letters, digits and _"):
        register_objective("has space", needs={Need.GIVEN_TARGET}, uses_q=False)(lambda inputs, options: None)


@pytest.mark.parametrize("bad_q", [-0.1, 1.5, math.nan])
@pytest.mark.parametrize("estimator", [garl, paft])
def test_q_outside_unit_interval_is_a_clear_error(estimator, bad_q):
    with pytest.raises(ValueError, match=r"q must lie in \[0, 1\].*q=" + ("nan" if bad_q != bad_q else str(bad_q))):
        estimator(torch.zeros(2, 3), torch.zeros(2, 3), bad_q)


def test_rloo_baseline_needs_two_samples():
    with pytest.raises(ValueError, match="M=2.*got M=1"):
        garl(torch.zeros(3, 1), torch.zeros(3, 1), 0.5)
    garl(torch.zeros(3, 1), torch.zeros(3, 1), 0.5, baseline="none")  # the plug-in works with M=1
    with pytest.raises(ValueError, match="M=1"):
        rb_rloo(torch.zeros(3, 1), torch.zeros(3, 1))


def test_mismatched_shapes_name_both_tensors():
    with pytest.raises(ValueError, match=r"rationale_logprob\[2, 3\].*answer_logprob\[2, 4\]"):
        garl(torch.zeros(2, 3), torch.zeros(2, 4), 0.5)
    with pytest.raises(ValueError, match=r"\[B, M\].*\[6\]"):
        paft(torch.zeros(6), torch.zeros(6), 0.5)


def test_nan_inputs_and_bad_options_are_rejected():
    with pytest.raises(ValueError, match="answer_logprob contains NaN"):
        garl(torch.zeros(2, 3), torch.full((2, 3), math.nan), 0.5)
    with pytest.raises(ValueError, match="baseline"):
        garl(torch.zeros(2, 3), torch.zeros(2, 3), 0.5, baseline="mean")
    with pytest.raises(ValueError, match="num_resamples"):
        paft(torch.zeros(2, 3), torch.zeros(2, 3), 0.5, num_resamples=0)


def test_paft_resampling_is_reproducible_with_a_generator():
    rlp, alp = torch.randn(4, 8), torch.randn(4, 8)
    a = paft(rlp, alp, 0.5, generator=torch.Generator().manual_seed(3)).metrics
    b = paft(rlp, alp, 0.5, generator=torch.Generator().manual_seed(3)).metrics
    assert a == b
    assert 1.0 <= a["ess"] <= 8.0


def test_every_registry_is_one_class_with_one_message_for_an_unknown_name():
    """Estimators, backends, rollout engines and datasets: one Registry, so a misspelt name reads alike everywhere."""
    from nemo_jq.backends import BACKENDS
    from nemo_jq.data.qa import DATASETS
    from nemo_jq.objectives import registry as objectives
    from nemo_jq.registry import Registry
    from nemo_jq.rollouts import SAMPLERS
    from nemo_jq.typed import ConfigError

    for registry, close in ((objectives._REGISTRY, "garl"), (BACKENDS, "megatron"), (SAMPLERS, "native"),
                            (DATASETS, "finqa")):
        assert isinstance(registry, Registry)
        with pytest.raises(ConfigError) as caught:
            registry.lookup(close + "x", "some.key")
        assert str(caught.value) == (f"some.key: unknown {registry.what} '{close}x' (did you mean '{close}'?); "
                                     f"known: {', '.join(sorted(registry))}")


def test_an_option_without_a_default_is_named_when_it_is_not_given():
    """A plugin's options dataclass with a required field: its run failed at load with a TypeError traceback."""
    import dataclasses

    from nemo_jq.typed import ConfigError

    @dataclasses.dataclass
    class Needs:
        alpha: float

    register_objective("needs_alpha", needs={Need.GIVEN_TARGET}, uses_q=False, options=Needs)(lambda inputs, options: None)
    spec = get_objective("needs_alpha")
    with pytest.raises(ConfigError, match=r"objective.options.alpha is required \(it has no default\): set "
                                          r"objective.options.alpha=\.\.\."):
        spec.parse_options({})
    assert spec.parse_options({"alpha": 2}).alpha == 2.0


@pytest.mark.parametrize("options", [{}, {"baseline": "none"}, {"normalize": False}])
def test_the_largest_amplified_advantage_is_of_the_coefficients_applied(options):
    """It was the pool's rloo coefficient over M^q whatever the baseline and normalisation: 0.32 for all three."""
    torch.manual_seed(0)
    rationale, answer, q = torch.randn(3, 4), torch.log(torch.rand(3, 4)), 0.5
    w = answer.exp()
    loo = ((w.sum(-1, keepdim=True) - w) / 3) ** (1 - q) if options.get("baseline", "rloo") == "rloo" else 0.0
    coefficient = (w / w.mean(-1, keepdim=True) ** q - loo) / (4 ** q if options.get("normalize", True) else 1.0)
    got = garl(rationale, answer, q, **options).metrics["max_amplified_advantage"]
    assert got == pytest.approx(coefficient.abs().max().item(), rel=1e-5)
