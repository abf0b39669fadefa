"""Section 2 results: gradient geometry, escort minimiser, properness, dispersion penalty."""

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from nemo_jq.objectives import jq_loss, log_q
from nemo_jq.theory import categorical_jq, dispersion_gap, escort_minimizer, neg_log_q


def test_log_q_is_continuous_at_one_and_matches_closed_form():
    u = torch.tensor([1e-6, 0.03, 0.5, 1.0], dtype=torch.float64)
    assert torch.allclose(log_q(u, 1.0 - 1e-9), torch.log(u), rtol=1e-7, atol=1e-12)
    for q in (0.0, 0.3, 0.75):
        assert torch.allclose(log_q(u, q), (u ** (1 - q) - 1) / (1 - q), rtol=1e-12)


def test_jq_loss_is_finite_and_exact_far_below_float_range():
    log_p = torch.tensor([-1e4, -50.0, -0.1], dtype=torch.float64)
    for q in (0.0, 0.5, 0.9):
        assert torch.allclose(jq_loss(log_p, q), (1 - torch.exp((1 - q) * log_p)) / (1 - q))
        assert jq_loss(log_p, q)[0].item() == pytest.approx(1 / (1 - q))
    assert torch.equal(jq_loss(log_p, 1.0), -log_p)


@pytest.mark.parametrize("q", [0.0, 0.3, 0.75, 1.0])
def test_gradient_geometry_matches_both_factorisations(q):
    """Prop. 2.2: ∇l_q = P^{-q} ∇l_0 = P^{1-q} ∇l_1, by autograd on a latent model."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    phi = (torch.randn(5, generator=gen, dtype=torch.float64) - 3).requires_grad_()

    def success_log_prob():
        return torch.logsumexp(torch.log_softmax(theta, 0) + torch.nn.functional.logsigmoid(phi), 0)

    def grad_of(q_value):
        value = jq_loss(success_log_prob(), q_value)
        return torch.cat(torch.autograd.grad(value, (theta, phi)))

    p = success_log_prob().exp().detach()
    assert torch.allclose(grad_of(q), p**-q * grad_of(0.0), rtol=1e-10)
    assert torch.allclose(grad_of(q), p ** (1 - q) * grad_of(1.0), rtol=1e-10)


def _simplex_minimiser(alpha, q):
    k = len(alpha)
    result = minimize(
        lambda t: categorical_jq(np.clip(t, 1e-12, 1), alpha, q),
        np.full(k, 1.0 / k),
        method="SLSQP",
        bounds=[(1e-9, 1.0)] * k,
        constraints=[{"type": "eq", "fun": lambda t: t.sum() - 1.0}],
        options={"ftol": 1e-14, "maxiter": 500},
    )
    assert result.success, result.message
    return result.x


@pytest.mark.parametrize("q", [0.3, 0.6, 1.0])
def test_escort_minimiser_matches_constrained_numerical_minimiser(q):
    alpha = np.random.default_rng(1).dirichlet(np.ones(4))
    np.testing.assert_allclose(escort_minimizer(alpha, q), _simplex_minimiser(alpha, q), atol=2e-5)


def test_escort_at_q0_is_the_mode_vertex():
    alpha = np.array([0.2, 0.5, 0.3])
    vertex = np.eye(3)[1]
    rng = np.random.default_rng(2)
    for theta in rng.dirichlet(np.ones(3), size=200):
        assert categorical_jq(vertex, alpha, 0.0) <= categorical_jq(theta, alpha, 0.0) + 1e-12
    assert escort_minimizer(alpha, 0.02)[1] > 0.999


def test_strictly_proper_only_at_q1():
    alpha = np.array([0.5, 0.3, 0.2])
    rng = np.random.default_rng(3)
    # q = 1: the data distribution is the unique minimiser.
    for theta in rng.dirichlet(np.ones(3), size=200):
        assert categorical_jq(alpha, alpha, 1.0) < categorical_jq(theta, alpha, 1.0)
    # q < 1: reporting alpha honestly is beaten by the (sharper) escort.
    for q in (0.25, 0.5, 0.9):
        escort = escort_minimizer(alpha, q)
        assert categorical_jq(escort, alpha, q) < categorical_jq(alpha, alpha, q) - 1e-6
        assert escort[0] > alpha[0]


def test_dispersion_penalty():
    rng = np.random.default_rng(4)
    p = rng.uniform(0.01, 0.99, size=50)
    for q in (0.25, 0.5, 1.0):
        assert dispersion_gap(p, q) > 0
        assert dispersion_gap(np.full(50, p.mean()), q) == pytest.approx(0.0, abs=1e-12)
    assert dispersion_gap(p, 0.0) == pytest.approx(0.0, abs=1e-12)  # l_0 is linear: no penalty
    assert neg_log_q(1.0, 0.5) == 0.0
