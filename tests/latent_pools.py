"""Run the torch estimators on every pool of the enumerable latent model (nemo_jq.theory.latent).

The implementation is called on real [C, M] log-prob tensors, one row per count vector;
its per-row gradient with respect to those log-probs is mapped to the model's 2K
parameters with the exact score Jacobians, giving the estimate for every possible pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nemo_jq.theory.latent import (
    LatentModel,
    count_vector_probabilities,
    pools_from_counts,
    sample_count_vectors,
)


@dataclass
class Pools:
    model: LatentModel
    latents: np.ndarray  # [C, M] latent index of each sample
    probs: np.ndarray  # [C] probability of each pool
    #: The policy the samples were drawn from (None: the model's prior itself).
    behavior: np.ndarray | None = None

    @classmethod
    def enumerate(cls, model: LatentModel, num_samples: int, behavior: np.ndarray | None = None) -> "Pools":
        """Every pool of ``num_samples`` rationales drawn from ``behavior`` (default: the model's prior)."""
        counts = sample_count_vectors(model.num_latents, num_samples)
        sampler = model.prior if behavior is None else behavior
        return cls(model, pools_from_counts(counts), count_vector_probabilities(counts, sampler), behavior)

    def logprobs(self, repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``log p(z_m|x)`` and ``log p(y*|x,z_m)`` as float64 leaf tensors, [C*repeat, M]."""
        latents = np.repeat(self.latents, repeat, axis=0)
        rlp = torch.tensor(np.log(self.model.prior)[latents], dtype=torch.float64, requires_grad=True)
        alp = torch.tensor(np.log(self.model.weights)[latents], dtype=torch.float64, requires_grad=True)
        return rlp, alp

    def gradients(self, estimator, repeat: int = 1, **kwargs) -> np.ndarray:
        """Each row's parameter-space gradient estimate, [C*repeat, 2K] (given the behaviour's log-probs, if any)."""
        rlp, alp = self.logprobs(repeat)
        if self.behavior is not None:
            latents = np.repeat(self.latents, repeat, axis=0)
            kwargs["behavior_logprob"] = torch.tensor(np.log(self.behavior)[latents], dtype=torch.float64)
        out = estimator(rlp, alp, **kwargs)
        out.per_example.sum().backward()
        latents = np.repeat(self.latents, repeat, axis=0)
        rscore, ascore = self.model.rationale_score(), self.model.answer_score()
        return np.einsum("cm,cmp->cp", rlp.grad.numpy(), rscore[latents]) + np.einsum(
            "cm,cmp->cp", alp.grad.numpy(), ascore[latents]
        )

    def expectation(self, estimator, **kwargs) -> np.ndarray:
        return self.probs @ self.gradients(estimator, **kwargs)

    def variance(self, estimator, **kwargs) -> float:
        """Total variance E||ĝ - E ĝ||^2."""
        grads = self.gradients(estimator, **kwargs)
        mean = self.probs @ grads
        return float(self.probs @ ((grads - mean) ** 2).sum(1))
