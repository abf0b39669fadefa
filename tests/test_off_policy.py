"""Off-policy GARL, PAFT and RLOO on the enumerable latent model, with rationales drawn from a behaviour policy
π ≠ p_θ (docs/off_policy.md): every expectation is exact (every pool of M samples from π, weighted by its
probability), and compared with the derivation's closed forms."""

import numpy as np
import pytest
import torch

from latent_pools import Pools
from nemo_jq.objectives import garl, grpo, paft, rb_rloo, rloo
from nemo_jq.objectives.importance import Correction, k3_kl
from nemo_jq.theory import default_model

MODEL = default_model()
#: The behaviour policy: softmax(θ + δ), a sampler with other numerics or an older policy.
BEHAVIOR = (lambda logits: np.exp(logits) / np.exp(logits).sum())(MODEL.prior_logits + np.array([-0.5, 0.7, 0.2]))
RHO = MODEL.prior / BEHAVIOR
PLAIN = Correction("plain")


def expectation(estimator, m: int, behavior=BEHAVIOR, **kwargs) -> np.ndarray:
    return Pools.enumerate(MODEL, m, behavior).expectation(estimator, **kwargs)


def off_policy_leading_bias(q: float, m: int) -> np.ndarray:
    """Thm 4.1's leading term with (w, g) -> (v, h) = (ρw, ρg) under π (docs/off_policy.md, §2.4)."""
    p, g = MODEL.success_probability, MODEL.per_latent_g()
    v, h = RHO * MODEL.weights, RHO[:, None] * g
    var_v = float(BEHAVIOR @ v**2) - p**2
    cov_hv = (BEHAVIOR * v) @ h - (BEHAVIOR @ h) * p
    return q / (m * p ** (q + 1.0)) * (0.5 * (q + 1.0) * MODEL.grad_loss(1.0) * var_v - cov_hv)


@pytest.mark.parametrize("estimator", [garl, rb_rloo, paft])
def test_at_q0_the_corrected_estimators_are_exactly_unbiased_for_every_m(estimator):
    """The ρ on the leave-one-out baseline makes the score term's control variate mean zero under π; PAFT's
    resampling ∝ ρw has off-policy GARL's mean (its resampling averaged out by repetition: exact in expectation)."""
    kwargs = {"q": 0.0} if estimator is not rb_rloo else {}
    for m in (2, 3, 8):
        if estimator is paft:
            pools = Pools.enumerate(MODEL, m, BEHAVIOR)
            torch.manual_seed(0)
            grads = pools.gradients(paft, repeat=300, q=0.0, correction=PLAIN).reshape(len(pools.probs), 300, -1)
            np.testing.assert_allclose(pools.probs @ grads.mean(1), MODEL.grad_loss(0.0), atol=6e-3)
        else:
            np.testing.assert_allclose(expectation(estimator, m, correction=PLAIN, **kwargs), MODEL.grad_loss(0.0), atol=1e-12)
    uncorrected = Pools.enumerate(MODEL, 3, BEHAVIOR)  # the same pools, treated as on-policy: biased
    uncorrected.behavior = None
    assert np.linalg.norm(uncorrected.expectation(garl, q=0.0) - MODEL.grad_loss(0.0)) > 0.05


@pytest.mark.parametrize("q", [0.5, 1.0])
def test_above_q0_the_bias_falls_like_one_over_m_as_derived(q):
    errors = {m: np.linalg.norm(expectation(garl, m, q=q, normalize=False, correction=PLAIN) - MODEL.grad_loss(q))
              for m in (2, 4, 8, 16, 32)}
    assert all(a > b for a, b in zip(errors.values(), list(errors.values())[1:]))
    assert 0.5 < (32 * errors[32]) / (8 * errors[8]) < 1.5  # M x bias levels off
    bias = expectation(garl, 48, q=0.75, normalize=False, correction=PLAIN) - MODEL.grad_loss(0.75)
    leading = off_policy_leading_bias(0.75, 48)
    assert np.linalg.norm(bias - leading) < 0.05 * np.linalg.norm(leading) and np.dot(bias, leading) > 0


@pytest.mark.parametrize("q", [0.0, 0.5, 1.0])
def test_with_the_behaviour_equal_to_the_policy_every_estimator_is_the_on_policy_one(q):
    torch.manual_seed(0)
    rlp, alp = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6) * 3 - 4
    rewards = torch.bernoulli(torch.full((4, 6), 0.4))
    for correction in (PLAIN, Correction("truncate", cap=1.5), Correction("mask", low=0.5, high=2.0)):
        for call in (lambda **k: garl(rlp, alp, q, **k), lambda **k: paft(rlp, alp, q, generator=torch.Generator().manual_seed(3), **k),
                     lambda **k: rloo(rlp, rewards, **k)):
            on, off = call(), call(behavior_logprob=rlp.detach(), correction=correction)
            grad_on = torch.autograd.grad(on.loss, rlp)[0]
            grad_off = torch.autograd.grad(off.loss, rlp)[0]
            assert on.loss.item() == off.loss.item() and torch.equal(grad_on, grad_off)


@pytest.mark.parametrize("cap", [1.5, 1.2])
def test_truncations_bias_at_q0_is_the_derived_formula(cap):
    """ρ̃ = min(ρ, C) in v, in P̂ and on the baseline: bias E_π[(ρ − ρ̃)((w − P̃) s + w a)], whatever M."""
    rho_t = np.minimum(RHO, cap)
    w, s, a = MODEL.weights, MODEL.rationale_score(), MODEL.answer_score()
    p_tilde = float(BEHAVIOR @ (rho_t * w))
    formula = (BEHAVIOR * (RHO - rho_t)) @ ((w - p_tilde)[:, None] * s + w[:, None] * a)
    for m in (2, 5):
        bias = expectation(garl, m, q=0.0, correction=Correction("truncate", cap=cap)) - MODEL.grad_loss(0.0)
        np.testing.assert_allclose(bias, formula, atol=1e-12)


def test_masking_normalised_by_m_is_unbiased_for_the_kept_sets_gradient():
    """ρ̃ = ρ on A = {a <= ρ <= b}, 0 elsewhere, the mean still over M: E = −∇P_A + P_A ∇p_θ(A) at q=0."""
    keep = (RHO >= 0.6) & (RHO <= 1.3)
    p, w = MODEL.prior, MODEL.weights
    s, a = MODEL.rationale_score(), MODEL.answer_score()
    grad_p_a = (keep * p * w) @ (s + a)
    target = -grad_p_a + float((keep * p) @ w) * ((keep * p) @ s)
    for m in (2, 4):
        np.testing.assert_allclose(expectation(garl, m, q=0.0, correction=Correction("mask", low=0.6, high=1.3)), target,
                                   atol=1e-12)


@pytest.mark.parametrize("q", [0.0, 0.5, 1.0])
def test_an_all_masked_group_gives_no_gradient(q):
    rlp, alp = torch.zeros(2, 4, requires_grad=True), torch.full((2, 4), -1.0, requires_grad=True)
    far = torch.full((2, 4), -5.0)  # ρ = e^5, outside [0.5, 2] everywhere
    for out in (garl(rlp, alp, q, behavior_logprob=far, correction=Correction("mask")),
                paft(rlp, alp, q, behavior_logprob=far, correction=Correction("mask"), generator=torch.Generator())):
        grads = torch.autograd.grad(out.loss, (rlp, alp))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        assert out.metrics["is_masked_fraction"] == 1.0


def test_rloos_sequence_ratio_makes_it_unbiased_for_the_expected_reward():
    """RLOO over sampled completions z ~ π with reward r(z): with ρ on the whole advantage, E[ĝ] = −∇E_p[r]."""
    rewards = MODEL.weights  # a reward per latent, as a sampled answer's
    for m in (2, 4):
        pools = Pools.enumerate(MODEL, m, BEHAVIOR)
        rlp = torch.tensor(np.log(MODEL.prior)[pools.latents], dtype=torch.float64, requires_grad=True)
        out = rloo(rlp, torch.tensor(rewards[pools.latents]), behavior_logprob=torch.tensor(np.log(BEHAVIOR)[pools.latents]),
                   correction=PLAIN)
        out.per_example.sum().backward()
        grads = np.einsum("cm,cmp->cp", rlp.grad.numpy(), MODEL.rationale_score()[pools.latents])
        np.testing.assert_allclose(pools.probs @ grads, -(MODEL.prior * rewards) @ MODEL.rationale_score(), atol=1e-12)


def test_the_per_token_k3_estimates_kl_from_the_behaviour_to_the_policy():
    """Two-token sequences, every one enumerated: E_π[Σ_t k3_t] with r = p/π is KL(π ‖ p) exactly."""
    generator = torch.Generator().manual_seed(0)
    p1, pi1 = torch.softmax(torch.randn(3, generator=generator), 0), torch.softmax(torch.randn(3, generator=generator), 0)
    p2, pi2 = torch.softmax(torch.randn(3, 3, generator=generator), 1), torch.softmax(torch.randn(3, 3, generator=generator), 1)
    kl, expected_k3 = 0.0, 0.0
    for i in range(3):
        for j in range(3):
            weight = float(pi1[i] * pi2[i, j])
            policy = torch.log(torch.stack([p1[i], p2[i, j]]))[None]
            behavior = torch.log(torch.stack([pi1[i], pi2[i, j]]))[None]
            expected_k3 += weight * 2 * float(k3_kl(policy, behavior, torch.ones(1, 2, dtype=torch.bool)))  # sum = 2 x mean
            kl += weight * float(behavior.sum() - policy.sum())
    assert expected_k3 == pytest.approx(kl, rel=1e-5)


def test_every_estimator_refuses_behaviour_log_probs_of_another_shape_or_missing_where_they_count():
    """One check, in :meth:`Correction.ratios`, for all of them: a shape mismatch, or NaN/+inf on a sampled token
    (the engine reported none); NaN outside the sampled tokens (GRPO's mask) is fine."""
    rationale, answer, rewards = torch.zeros(2, 3), torch.full((2, 3), -1.0), torch.tensor([[1.0, 0, 0], [0, 1, 0]])
    for bad in (torch.zeros(2, 2), torch.tensor([[0.0, float("nan"), 0], [0, 0, 0]]),
                torch.tensor([[0.0, float("inf"), 0], [0, 0, 0]])):
        for call in (lambda b: garl(rationale, answer, 0.5, behavior_logprob=b), lambda b: rb_rloo(rationale, answer, behavior_logprob=b),
                     lambda b: paft(rationale, answer, 0.5, behavior_logprob=b), lambda b: rloo(rationale, rewards, behavior_logprob=b)):
            with pytest.raises(ValueError, match="shape mismatch|NaN or \\+inf where it counts"):
                call(bad)
    logprob, mask = torch.full((2, 3, 4), -1.0), torch.ones(2, 3, 4)
    mask[..., -1] = 0
    behavior = torch.full((2, 3, 4), -1.0)
    behavior[..., -1] = float("nan")  # not sampled: no log-prob, and none needed
    assert grpo(logprob, rewards, mask, behavior_logprob=behavior).metrics["is_ratio_mean"] == pytest.approx(1.0)
    behavior[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or \\+inf where it counts"):
        grpo(logprob, rewards, mask, behavior_logprob=behavior)
