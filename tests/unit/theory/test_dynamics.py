"""Section 3 and Appendix D: escape times and the noise-fitting equilibrium."""

import math

import numpy as np
import pytest
from scipy.integrate import solve_ivp

from nemo_jq.theory import (
    escape_time_asymptotic,
    escape_time_bounds,
    escape_time_ode,
    escape_time_quadrature,
    escort_minimizer,
    noise_equilibrium,
    noise_equilibrium_asymptote,
    noise_fitting_rate,
)

QS = [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("q", QS)
def test_quadrature_and_ode_agree_and_respect_the_bounds(q):
    for p0 in (1e-2, 1e-5, 1e-9):
        quad_t, ode_t = escape_time_quadrature(q, p0), escape_time_ode(q, p0)
        assert ode_t == pytest.approx(quad_t, rel=1e-7)
        low, high = escape_time_bounds(q, p0)
        assert low <= quad_t <= high


@pytest.mark.parametrize("q", QS)
def test_escape_time_approaches_the_asymptotics(q):
    gaps = [abs(escape_time_quadrature(q, p0) / escape_time_asymptotic(q, p0) - 1) for p0 in (1e-3, 1e-6, 1e-12)]
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] < 0.05


def test_escape_time_separates_the_poles():
    p0 = 1e-8
    times = [escape_time_quadrature(q, p0) for q in QS]
    assert all(a > b for a, b in zip(times, times[1:]))
    # Thm 3.2's speed-up ratio T_q / T_q' = Θ(p0^{-(q'-q)}): measured exponent close to q'-q.
    small, smaller = 1e-8, 1e-12
    slope = math.log(escape_time_quadrature(0.25, smaller) / escape_time_quadrature(0.75, smaller)) - math.log(
        escape_time_quadrature(0.25, small) / escape_time_quadrature(0.75, small)
    )
    assert slope / math.log(small / smaller) == pytest.approx(0.5, abs=0.01)


def test_bad_escape_interval_is_rejected():
    with pytest.raises(ValueError, match="p0"):
        escape_time_quadrature(0.5, 0.7)


@pytest.mark.parametrize("q", [0.25, 0.5, 0.75, 1.0])
def test_noise_equilibrium_is_the_escort_of_the_noisy_labels(q):
    for eps in (0.2, 0.05, 0.01):
        root = noise_equilibrium(q, eps)
        assert root == pytest.approx(escort_minimizer(np.array([1 - eps, eps]), q)[1], rel=1e-9)
        assert noise_fitting_rate(0.5 * root, q, eps) > 0 > noise_fitting_rate(min(2 * root, 0.9), q, eps)


@pytest.mark.parametrize("q", [0.25, 0.5, 0.75, 1.0])
def test_noise_equilibrium_approaches_its_asymptote(q):
    gaps = [abs(noise_equilibrium(q, eps) / noise_equilibrium_asymptote(q, eps) - 1) for eps in (0.1, 0.01, 0.001)]
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] < 0.01


def test_gradient_flow_converges_to_the_noise_equilibrium():
    q, eps = 0.5, 0.1
    target = noise_equilibrium(q, eps)
    sol = solve_ivp(lambda _t, y: [noise_fitting_rate(y[0], q, eps)], (0, 5e5), [target / 20], rtol=1e-10, atol=1e-14)
    assert sol.y[0, -1] == pytest.approx(target, rel=1e-4)


def test_q0_has_no_noise_equilibrium_and_contamination_decays():
    assert all(noise_fitting_rate(p, 0.0, 0.1) < 0 for p in (1e-4, 0.1, 0.4))
    with pytest.raises(ValueError, match="q"):
        noise_equilibrium(0.0, 0.1)
