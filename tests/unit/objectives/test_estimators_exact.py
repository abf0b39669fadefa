"""Section 4 and Appendix E on an enumerable latent model, through the torch estimators."""

import numpy as np
import pytest
import torch

from latent_pools import Pools
from nemo_jq.objectives import garl, paft, resample_indices, sft
from nemo_jq.theory import default_model, measured_bias
from nemo_jq.theory.latent import LatentModel

MODEL = default_model()


def test_garl_at_q0_is_unbiased_for_every_m():
    for m in (2, 3, 8):
        pools = Pools.enumerate(MODEL, m)
        np.testing.assert_allclose(pools.expectation(garl, q=0.0), MODEL.grad_loss(0.0), atol=1e-12)


@pytest.mark.parametrize("q", [0.5, 1.0])
def test_garl_is_consistent_as_m_grows(q):
    errors = [
        np.linalg.norm(Pools.enumerate(MODEL, m).expectation(garl, q=q, normalize=False) - MODEL.grad_loss(q))
        for m in (2, 4, 8, 16, 32)
    ]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 0.1 * errors[0]


@pytest.mark.parametrize("q", [0.25, 0.75, 1.0])
def test_rloo_keeps_the_mean_and_the_bias_matches_the_theory(q):
    """Prop. E.1: RLOO has the plug-in's expectation for every M; both equal the exact bias."""
    for m in (2, 5, 16):
        pools = Pools.enumerate(MODEL, m)
        with_rloo = pools.expectation(garl, q=q, normalize=False)
        plug_in = pools.expectation(garl, q=q, normalize=False, baseline="none")
        np.testing.assert_allclose(with_rloo, plug_in, atol=1e-12)
        np.testing.assert_allclose(plug_in - MODEL.grad_loss(q), measured_bias(MODEL, q, m), atol=1e-12)


def test_measured_bias_at_small_m_follows_theorem_4_1():
    q, m = 0.75, 48
    bias = Pools.enumerate(MODEL, m).expectation(garl, q=q, normalize=False) - MODEL.grad_loss(q)
    leading = MODEL.leading_bias(q, m)
    assert np.linalg.norm(bias - leading) < 0.05 * np.linalg.norm(leading)
    assert np.dot(bias, leading) > 0


def test_rloo_reduces_variance_here():
    pools = Pools.enumerate(MODEL, 8)
    assert pools.variance(garl, q=0.5, baseline="rloo") < pools.variance(garl, q=0.5, baseline="none")


@pytest.mark.parametrize("q", [0.0, 0.4, 1.0])
def test_normalize_divides_by_m_to_the_q(q):
    pools = Pools.enumerate(MODEL, 6)
    np.testing.assert_allclose(
        pools.gradients(garl, q=q), pools.gradients(garl, q=q, normalize=False) / 6**q, rtol=1e-12, atol=1e-15
    )


def test_garl_endpoints_per_pool():
    pools = Pools.enumerate(MODEL, 5)
    g, w = MODEL.per_latent_g()[pools.latents], MODEL.weights[pools.latents]  # [C, M, 2K], [C, M]
    # q = 0 plug-in: the sample mean of g_m (RB-REINFORCE).
    np.testing.assert_allclose(pools.gradients(garl, q=0.0, baseline="none"), g.mean(1), atol=1e-12)
    # q = 1 plug-in: IWAE, Σ w_m (-∇log p(z_m, y*)) / Σ w_m.
    iwae = (g.sum(1)) / w.sum(1, keepdims=True)
    np.testing.assert_allclose(pools.gradients(garl, q=1.0, baseline="none", normalize=False), iwae, atol=1e-12)
    # q = 0 with RLOO: VeriFree's -(w_m - w̄_¬m) ∇log p(z_m) - ∇w_m.
    loo = (w.sum(1, keepdims=True) - w) / 4
    rscore, ascore = MODEL.rationale_score()[pools.latents], MODEL.answer_score()[pools.latents]
    verifree = (-(w - loo)[..., None] * rscore - w[..., None] * ascore).mean(1)
    np.testing.assert_allclose(pools.gradients(garl, q=0.0), verifree, atol=1e-12)


@pytest.mark.parametrize("q", [0.0, 1.0])
def test_paft_endpoints_are_resampled_sft(q):
    gen = torch.Generator().manual_seed(5)
    rlp = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    alp = (torch.randn(3, 6, generator=gen, dtype=torch.float64) * 3 - 4).requires_grad_()
    paft(rlp, alp, q, normalize=False, generator=torch.Generator().manual_seed(11)).loss.backward()
    paft_grads = torch.cat([rlp.grad, alp.grad])

    rlp2, alp2 = rlp.detach().clone().requires_grad_(), alp.detach().clone().requires_grad_()
    picks = resample_indices(alp.detach(), 6, torch.Generator().manual_seed(11))
    tokens = torch.stack([rlp2.gather(1, picks), alp2.gather(1, picks)], -1)  # [B, K, 2]
    per_prompt_sft = sft(tokens.reshape(-1, 2), torch.ones(18, 2)).per_example.view(3, 6).mean(1)
    scale = 1.0 if q == 1.0 else torch.exp(torch.logsumexp(alp.detach(), 1) - np.log(6))  # w̄ at q = 0
    (scale * per_prompt_sft).mean().backward()
    torch.testing.assert_close(paft_grads, torch.cat([rlp2.grad, alp2.grad]))


def test_paft_matches_garl_in_mean_and_has_more_variance():
    """Props. E.3 and E.4 by Monte Carlo over resamples, against GARL's exact moments."""
    q, m, repeats = 0.5, 6, 400
    model = LatentModel(prior_logits=np.array([0.2, -0.4, 0.1]), answer_logits=np.array([0.5, 1.2, -1.5]))
    pools = Pools.enumerate(model, m)
    torch.manual_seed(0)
    grads = pools.gradients(paft, repeat=repeats, q=q, num_resamples=2).reshape(len(pools.probs), repeats, -1)
    per_pool_mean = grads.mean(1)
    plug_in = pools.gradients(garl, q=q, baseline="none")
    stderr = grads.std(1) / np.sqrt(repeats)
    assert np.all(np.abs(per_pool_mean - plug_in) <= 5 * stderr + 1e-9)  # E[PAFT | pool] = GARL plug-in
    paft_mean = pools.probs @ per_pool_mean
    np.testing.assert_allclose(paft_mean, pools.expectation(garl, q=q, baseline="none"), atol=3e-3)
    paft_var = float(pools.probs @ ((grads - paft_mean) ** 2).sum(2).mean(1))
    assert paft_var > 1.2 * pools.variance(garl, q=q, baseline="none")
