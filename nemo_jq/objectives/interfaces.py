"""What every estimator returns and what each one needs from a trainer.

An estimator returns a differentiable scalar plus metrics (NeMo-RL's ``LossFunction`` does the same).
The trainer never special-cases an estimator; it reads the :class:`Need` set that the registry
declares for it, builds only those rollouts, and hands it :class:`~nemo_jq.objectives.inputs.EstimatorInputs`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Need(enum.Enum):
    """Inputs a trainer must produce before calling an estimator."""

    #: ``log p(z_m|x)`` and teacher-forced ``log p(y*|x,z_m)`` for M sampled rationales
    #: (GARL, PAFT, RB-RLOO). No answer is sampled.
    REFERENCE_ANSWER_LOGPROB = "reference_answer_logprob"
    #: Sampled answers scored by a reward function, with the token log-probs of the
    #: sampled completions (GRPO, RLOO).
    SAMPLED_ANSWER_REWARD = "sampled_answer_reward"
    #: Given target tokens (rationale + answer) to teacher-force (SFT).
    GIVEN_TARGET = "given_target"


@dataclass
class ObjectiveOutput:
    """Result of one estimator call.

    ``loss`` is the scalar to call ``backward()`` on: its gradient is the estimator's
    gradient estimate averaged over the batch. ``per_example`` holds one entry per
    example (``[B]``) with the same gradient semantics, so a caller may weight or
    sum examples itself. ``metrics`` are detached Python floats for logging.
    """

    loss: torch.Tensor
    per_example: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
