"""SFT: teacher-forced negative log-likelihood of given rationale + answer tokens (baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.checks import check_token_tensors
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.registry import register_objective
from nemo_jq.precision import upcast
from nemo_jq.typed import option

REDUCTIONS = ("sequence", "token")


def sft(token_logprob: torch.Tensor, mask: torch.Tensor, *, reduction: str = "sequence") -> ObjectiveOutput:
    """SFT loss for N target sequences of up to T tokens.

    Args:
        token_logprob: ``[N, T]`` log-prob of each target token under teacher forcing (differentiable).
        mask: ``[N, T]`` 1 on target tokens (rationale and answer), 0 on prompt and padding.
        reduction: ``"sequence"``: per-example loss is the sequence NLL ``-log p(z, y | x)`` (the
            q=1 pole's unit); ``"token"``: that NLL divided by the number of target tokens.
    """
    check_token_tensors(mask, token_logprob=token_logprob)
    if token_logprob.dim() != 2:
        raise ValueError(f"token_logprob must be [N, T]; got shape {list(token_logprob.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got reduction={reduction!r}")
    mask = upcast(mask)
    token_nll = -upcast(token_logprob) * mask
    per_example = token_nll.sum(-1)
    if reduction == "token":
        per_example = per_example / mask.sum(-1).clamp(min=1.0)
    metrics = {"nll_per_token": (token_nll.sum() / mask.sum().clamp(min=1.0)).item(), "target_tokens": int(mask.sum())}
    return ObjectiveOutput(loss=per_example.mean(), per_example=per_example, metrics=metrics)


@dataclass(frozen=True)
class SftOptions:
    reduction: str = option("sequence", "sequence: the NLL of each target; token: divided by its token count",
                            choices=REDUCTIONS)


@register_objective("sft", needs={Need.GIVEN_TARGET}, uses_q=False, min_samples=1, options=SftOptions)
def sft_estimator(inputs: EstimatorInputs, options: SftOptions) -> ObjectiveOutput:
    return sft(inputs.token_logprob, inputs.target_mask, reduction=options.reduction)
