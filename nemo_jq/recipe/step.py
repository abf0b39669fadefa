"""One optimizer step's outcome, typed where the loop acts on it.

The q schedule and the collapse guard read the step's log P̂, the mismatch watch its log-prob gap and KL: fields here,
not string keys of the logged record. (The divergence checks run inside the step, before the weights take its loss and
gradient.) ``record`` is the line ``metrics.jsonl`` logs for the step (every metric of the estimator and of the step,
in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepResult:
    step: int
    #: The estimator's log P̂ (None for estimators without it: GRPO, RLOO, SFT).
    log_p_hat: float | None
    #: Between the engine's and the policy's log-probs of the sampled tokens (0 when the engine reports none).
    max_logprob_gap: float
    kl_k3: float
    record: dict[str, Any]

    @classmethod
    def from_record(cls, step: int, record: dict[str, Any]) -> StepResult:
        return cls(step, record.get("log_p_hat"), record.get("max_logprob_gap", 0.0), record.get("kl_k3", 0.0), record)
