"""One optimizer step's outcome, typed where the loop acts on it.

The q schedule and the collapse guard read the step's log P̂, the mismatch watch its log-prob gap and KL: fields here,
not string keys of the logged record. (The divergence checks run inside the step, before the weights take its loss and
gradient.) ``record`` is the line ``metrics.jsonl`` logs for the step (every metric of the estimator and of the step,
in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_jq.recipe.components import Components
    from nemo_jq.recipe.experience import Experience


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


def rollout_record(parts: Components, experience: Experience, lag: int | None) -> dict[str, Any]:
    """The step's rollout metrics: the lag of one-step-off experience (``lag``: None when on-policy, not logged), the
    rollout tokens of every replica and this replica's rate, and the weight syncs to rollout ranks of their own."""
    from nemo_jq.rollouts.ranks import RemoteRollouts

    tokens = int(parts.data_parallel.sum(experience.rollout_tokens))
    record = {} if lag is None else {"rollout_lag": lag}
    record.update(rollout_tokens=tokens, rollout_tokens_per_s=tokens / experience.rollout_seconds if tokens else None)
    if isinstance(parts.engine, RemoteRollouts):
        record.update(parts.engine.take_sync_record())
    return record
