"""A latent-rationale model small enough to enumerate, for exact checks of Section 4.

K latent rationales z with prior p(z|x) = softmax(theta)_z and answer likelihood
w_z = p(y*|x, z) = sigmoid(phi_z). Parameters are the 2K-vector (theta, phi). Because the
GARL/PAFT estimates are symmetric in the M samples, their exact expectation over
M i.i.d. draws is a sum over the count vectors n (n_1 + ... + n_K = M) weighted by the
multinomial probability, which is cheap for small K even at M = 64.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.special import gammaln


@dataclass(frozen=True)
class LatentModel:
    prior_logits: np.ndarray  # theta, [K]
    answer_logits: np.ndarray  # phi, [K]

    @property
    def num_latents(self) -> int:
        return len(self.prior_logits)

    @property
    def prior(self) -> np.ndarray:
        e = np.exp(self.prior_logits - self.prior_logits.max())
        return e / e.sum()

    @property
    def weights(self) -> np.ndarray:
        """w_z = p(y*|x, z), [K]."""
        return 1.0 / (1.0 + np.exp(-self.answer_logits))

    @property
    def success_probability(self) -> float:
        """P = Σ_z p(z|x) w_z."""
        return float(self.prior @ self.weights)

    def rationale_score(self) -> np.ndarray:
        """∇ log p(z|x) for each z, [K, 2K]."""
        k = self.num_latents
        return np.concatenate([np.eye(k) - self.prior[None, :], np.zeros((k, k))], axis=1)

    def answer_score(self) -> np.ndarray:
        """∇ log p(y*|x, z) for each z, [K, 2K]."""
        k = self.num_latents
        return np.concatenate([np.zeros((k, k)), np.diag(1.0 - self.weights)], axis=1)

    def per_latent_g(self) -> np.ndarray:
        """g_z = -w_z ∇ log p(z, y*|x) (Eq. def-gm), [K, 2K]."""
        return -self.weights[:, None] * (self.rationale_score() + self.answer_score())

    def grad_loss(self, q: float) -> np.ndarray:
        """Exact ∇ l_q = -P^{-q} ∇P, [2K]."""
        grad_p = -(self.prior @ self.per_latent_g())
        return -self.success_probability**-q * grad_p

    def leading_bias(self, q: float, num_samples: int) -> np.ndarray:
        """Thm 4.1's leading term q/(M P^{q+1}) [ (q+1)/2 ∇l_1 Var(w) - Cov(g, w) ], [2K]."""
        p, w, pi, g = self.success_probability, self.weights, self.prior, self.per_latent_g()
        var_w = float(pi @ w**2) - p**2
        mean_g = pi @ g
        cov_gw = (pi * w) @ g - mean_g * p
        bracket = 0.5 * (q + 1.0) * self.grad_loss(1.0) * var_w - cov_gw
        return q / (num_samples * p ** (q + 1.0)) * bracket


def sample_count_vectors(num_latents: int, num_samples: int) -> np.ndarray:
    """Every count vector n with Σ n = M over K latents, [C, K] (stars and bars)."""
    rows = []
    for bars in itertools.combinations(range(num_samples + num_latents - 1), num_latents - 1):
        edges = (-1, *bars, num_samples + num_latents - 1)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(num_latents)])
    return np.array(rows, dtype=np.int64)


def count_vector_probabilities(counts: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Multinomial probability of each count vector under i.i.d. draws from ``prior``, [C]."""
    m = counts.sum(1)
    log_p = gammaln(m + 1) - gammaln(counts + 1).sum(1) + (counts * np.log(prior)[None, :]).sum(1)
    return np.exp(log_p)


def pools_from_counts(counts: np.ndarray) -> np.ndarray:
    """One ordered pool of latent indices per count vector, [C, M]."""
    return np.stack([np.repeat(np.arange(counts.shape[1]), row) for row in counts])


def plug_in_expectation(model: LatentModel, q: float, num_samples: int) -> np.ndarray:
    """Exact E[ḡ_M / w̄_M^q] over M i.i.d. rationales (Eq. mc-estimator), [2K]."""
    counts = sample_count_vectors(model.num_latents, num_samples)
    probs = count_vector_probabilities(counts, model.prior)
    mean_g = counts @ model.per_latent_g() / num_samples
    mean_w = counts @ model.weights / num_samples
    return probs @ (mean_g / mean_w[:, None] ** q)


def measured_bias(model: LatentModel, q: float, num_samples: int) -> np.ndarray:
    """Exact finite-M bias E[estimate] - ∇l_q of the plug-in estimator, [2K]."""
    return plug_in_expectation(model, q, num_samples) - model.grad_loss(q)


def default_model() -> LatentModel:
    """Three rationales, one good and likely, one good and rare, one bad: P ≈ 0.421."""
    return LatentModel(prior_logits=np.array([0.3, -0.8, 0.5]), answer_logits=np.array([0.9, 1.5, -2.5]))


def bias_table(model: LatentModel, q: float, sample_sizes: list[int]) -> list[dict[str, float]]:
    """Measured bias vs Thm 4.1's leading term for each M."""
    rows = []
    for m in sample_sizes:
        measured, leading = measured_bias(model, q, m), model.leading_bias(q, m)
        rows.append(
            {
                "M": m,
                "measured_bias_norm": float(np.linalg.norm(measured)),
                "leading_term_norm": float(np.linalg.norm(leading)),
                "relative_gap": float(np.linalg.norm(measured - leading) / max(np.linalg.norm(leading), math.ulp(1.0))),
            }
        )
    return rows
