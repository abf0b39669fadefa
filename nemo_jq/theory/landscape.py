"""Static results on categorical models: escort minimiser, properness, dispersion, noise fitting."""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq


def neg_log_q(p: np.ndarray | float, q: float) -> np.ndarray | float:
    """``-log_q p = (1 - p^{1-q}) / (1 - q)``, ``-log p`` at q=1."""
    p = np.asarray(p, dtype=float)
    return -np.log(p) if q == 1.0 else (1.0 - p ** (1.0 - q)) / (1.0 - q)


def categorical_jq(theta: np.ndarray, alpha: np.ndarray, q: float) -> float:
    """J_Q(theta, q) = Σ_j alpha_j (-log_q theta_j) for a K-category model with frequencies alpha."""
    return float(np.sum(alpha * neg_log_q(theta, q)))


def escort_minimizer(alpha: np.ndarray, q: float) -> np.ndarray:
    """Thm 2.1: the minimiser of J_Q over the simplex, theta_j ∝ alpha_j^{1/q} (q in (0, 1]).

    Computed in log space so that small q (a near one-hot escort) does not overflow.
    """
    if not 0.0 < q <= 1.0:
        raise ValueError(f"the escort minimiser is unique only for q in (0, 1]; got q={q}")
    logits = np.log(np.asarray(alpha, dtype=float)) / q
    logits -= logits.max()
    theta = np.exp(logits)
    return theta / theta.sum()


def dispersion_gap(p: np.ndarray, q: float) -> float:
    """Prop. C.1: J_Q - (-log_q(mean P)) over examples with success probabilities p (>= 0 for q > 0)."""
    p = np.asarray(p, dtype=float)
    return float(np.mean(neg_log_q(p, q)) - neg_log_q(p.mean(), q))


def noise_equilibrium(q: float, eps: float) -> float:
    """Stable contamination p̃*(q) of the noise-fitting dynamics (Eq. noise-fitting-dynamics).

    Solves ε p̃^{-q} = (1-ε)(1-p̃)^{-q} by root finding in log p̃ (so tiny equilibria at small q
    are resolved); for q = 0 there is none: p̃ decays to 0.
    """
    if not 0.0 < q <= 1.0:
        raise ValueError(f"an equilibrium exists only for q in (0, 1]; got q={q}")
    if not 0.0 < eps < 0.5:
        raise ValueError(f"label-noise rate eps must lie in (0, 1/2); got eps={eps}")

    def balance(s: float) -> float:
        return math.log(eps) - q * s - math.log(1.0 - eps) + q * math.log1p(-math.exp(s))

    lower = 2.0 * math.log(eps / (1.0 - eps)) / q - 1.0
    return math.exp(brentq(balance, lower, math.log(0.5), xtol=1e-14, rtol=1e-14))


def noise_equilibrium_asymptote(q: float, eps: float) -> float:
    """Eq. (noise-asymptote): p̃*(q) ~ (ε/(1-ε))^{1/q} as ε -> 0."""
    return (eps / (1.0 - eps)) ** (1.0 / q)


def noise_fitting_rate(p_tilde: float, q: float, eps: float) -> float:
    """dp̃/dt under gradient flow on the two-label sigmoid model with label-noise rate ε."""
    p = 1.0 - p_tilde
    return (eps * p_tilde**-q - (1.0 - eps) * p**-q) * p**2 * p_tilde**2
