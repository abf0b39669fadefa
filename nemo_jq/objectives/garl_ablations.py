"""Two GARL ablations that test the paper's candidate (1) for GARL's warm-start collapse, "pathwise-term corruption"
(issue 33): GARL raises log p(y*|x,z) on every sampled z, PAFT only on rationales resampled in proportion to w.

Both keep Algorithm 1's score term, ``-(1/M^q)(1/M) Σ_m c_m ∇log p(z_m|x)`` with
``c_m = w_m/w̄^q - (w̄_¬m)^{1-q}``, and change only its pathwise term ``-(1/M^q)(1/M) Σ_m (w_m/w̄^q) ∇log p(y*|x,z_m)``:

- :func:`garl_score_only` drops it, which biases the gradient (docs/estimators.md, "GARL without its pathwise term");
- :func:`garl_resampled_pathwise` replaces it by PAFT's, applied to K rationales resampled ∝ w, whose mean given the
  pool is GARL's: the expected gradient is GARL's, only its spread and which rationales move in one step change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.garl import GarlOptions, garl
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.paft import paft
from nemo_jq.objectives.registry import register_objective
from nemo_jq.typed import option


def garl_score_only(rationale_logprob: torch.Tensor, answer_logprob: torch.Tensor, q: float, *, baseline: str = "rloo",
                    normalize: bool = True) -> ObjectiveOutput:
    """GARL (Alg. 1) without its pathwise term: ``-(1/M^q)(1/M) Σ_m c_m ∇log p(z_m|x)`` only.

    Biased at every q, also at q=0 where GARL is not: its expectation is GARL's plus
    ``(1/M^q) E[(1/M) Σ_m (w_m/w̄^q) ∇log p(y*|x,z_m)]``, the dropped term, which tends to
    ``P^{-q} E_{z~p(z|x)}[∇ p(y*|x,z)]`` as M grows (times ``1/M^q`` when ``normalize``). The likelihood of y* after a
    rationale is then learnt only through the rationale distribution: nothing raises ``p(y*|x,z)`` for a fixed z.
    Shapes and ``baseline``/``normalize`` as :func:`~nemo_jq.objectives.garl`; the value is the same plug-in l_q.
    """
    return garl(rationale_logprob, answer_logprob.detach(), q, baseline=baseline, normalize=normalize)


def garl_resampled_pathwise(rationale_logprob: torch.Tensor, answer_logprob: torch.Tensor, q: float, *,
                            baseline: str = "rloo", normalize: bool = True, num_resamples: int | None = None,
                            generator: torch.Generator | None = None) -> ObjectiveOutput:
    """GARL's score term with PAFT's pathwise term (Alg. 2's choice inside Alg. 1).

    Per-example gradient: ``-(1/M^q)(1/M) Σ_m c_m ∇log p(z_m|x) - (w̄^{1-q}/(M^q K)) Σ_k ∇log p(y*|x,z_{r_k})``
    with ``r_1..r_K`` drawn ∝ w_m (K = ``num_resamples``, default M; ``generator`` draws them). Given the pool,
    ``E[count_m] = K w_m / (M w̄)``, so the resampled term's mean is GARL's pathwise term exactly: the expectation is
    GARL's (unbiased at q=0, GARL's O(q/(M P^q)) bias otherwise) and no term is added or dropped. What changes is
    the variance (higher) and that, in one step, only resampled rationales, mostly those with large w, get their
    ``log p(y*|x,z)`` raised. Shapes as :func:`~nemo_jq.objectives.garl`; the value is the same plug-in l_q.
    """
    score = garl_score_only(rationale_logprob, answer_logprob, q, baseline=baseline, normalize=normalize)
    pathwise = paft(rationale_logprob.detach(), answer_logprob, q, num_resamples=num_resamples, normalize=normalize,
                    generator=generator).per_example
    per_example = score.per_example + (pathwise - pathwise.detach())
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=score.metrics)


@dataclass(frozen=True)
class ResampledPathwiseOptions(GarlOptions):
    num_resamples: int | None = option(None, "K, rationales resampled ∝ w for the pathwise term (null = M)", ge=1)


@register_objective("garl_score_only", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=True, min_samples=2,
                    options=GarlOptions)
def garl_score_only_estimator(inputs: EstimatorInputs, options: GarlOptions) -> ObjectiveOutput:
    return garl_score_only(inputs.rationale_logprob, inputs.answer_logprob, inputs.q, baseline=options.baseline,
                           normalize=options.normalize)


@register_objective("garl_resampled_pathwise", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=True, min_samples=2,
                    options=ResampledPathwiseOptions)
def garl_resampled_pathwise_estimator(inputs: EstimatorInputs, options: ResampledPathwiseOptions) -> ObjectiveOutput:
    return garl_resampled_pathwise(inputs.rationale_logprob, inputs.answer_logprob, inputs.q,
                                   baseline=options.baseline, normalize=options.normalize,
                                   num_resamples=options.num_resamples, generator=inputs.generator)
