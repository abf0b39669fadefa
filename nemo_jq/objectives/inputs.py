"""What a trainer hands every registered estimator: one micro-batch's log-probs, spans and normalisers.

Built once per micro-batch (NeMo-RL's loss functions get their data and ``global_valid_toks`` the same
way): the policy's per-token log-probs with the masks of the spans they belong to, the rewards where
answers were sampled, and the *global* normalisers (over the whole optimizer batch, every data-parallel
replica included) that make micro-batched gradients sum to the full batch's. Each estimator reads the
fields it needs and nothing is passed by parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_jq.objectives.importance import Correction, SampledTokens


@dataclass(frozen=True)
class EstimatorInputs:
    """B prompts x M samples of one micro-batch, rows prompt-major (row ``b * M + m``).

    Token tensors are ``[B*M, T]`` over target positions: position t scores token t + 1 of the spliced
    sequence ``[prompt, z, </think>, answer]``.
    """

    #: ``[B*M, T]`` the policy's log-prob of each target token (differentiable; 0 off the targets).
    token_logprob: torch.Tensor
    #: ``[B*M, T]`` bool: the rationale span's targets (z, and ``</think>`` when it was sampled).
    rationale_mask: torch.Tensor
    #: ``[B*M, T]`` bool: the answer span's targets (the teacher-forced y*, or a sampled answer).
    answer_mask: torch.Tensor
    #: M, rows per prompt (1 for given targets).
    num_samples: int
    #: The commitment this step (None for estimators without one).
    q: float | None = None
    #: ``[B, M]`` reward of each sampled answer (estimators that need :attr:`Need.SAMPLED_ANSWER_REWARD`).
    rewards: torch.Tensor | None = None
    #: Global normaliser: target tokens per prompt, averaged over the whole optimizer batch.
    tokens_per_example: float | None = None
    #: Global: ``[B_total, M]`` every reward of the optimizer batch (for batch-level reward scaling).
    batch_rewards: torch.Tensor | None = None
    #: The estimator's own random stream (PAFT's resampling), seeded and checkpointed by the trainer.
    generator: torch.Generator | None = None
    #: ``[B*M, T]`` the rollout engine's log-probs of the sampled target tokens (NaN elsewhere), when the samples
    #: came from another policy than ``token_logprob``'s and are to be corrected for it; None: on-policy.
    behavior_token_logprob: torch.Tensor | None = None
    #: What the estimators do to the importance ratio (``objective.importance``); used with the above.
    correction: Correction | None = None

    @property
    def num_prompts(self) -> int:
        return self.token_logprob.shape[0] // self.num_samples

    @property
    def target_mask(self) -> torch.Tensor:
        return self.rationale_mask | self.answer_mask

    def span_logprob(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B, M]`` sums of the token log-probs over ``mask``'s span."""
        return (self.token_logprob * mask).sum(-1).view(self.num_prompts, -1)

    @property
    def rationale_logprob(self) -> torch.Tensor:
        """``[B, M]`` ``log p(z_m | x)``."""
        return self.span_logprob(self.rationale_mask)

    @property
    def answer_logprob(self) -> torch.Tensor:
        """``[B, M]`` ``log p(y | x, z_m)``: the teacher-forced y* (GARL, PAFT) or the sampled answer."""
        return self.span_logprob(self.answer_mask)

    @property
    def sequence_logprob(self) -> torch.Tensor:
        """``[B, M]`` ``log p(z_m, y | x)`` of the whole completion."""
        return self.span_logprob(self.target_mask)

    def per_sample(self, tokens: torch.Tensor) -> torch.Tensor:
        """A ``[B*M, T]`` token tensor as ``[B, M, T]``."""
        return tokens.view(self.num_prompts, -1, tokens.shape[-1])

    def off_policy(self, span: torch.Tensor) -> dict:
        """An estimator's off-policy arguments over ``span`` (the tokens that were sampled: the rationale for GARL
        and PAFT, the whole completion for RLOO), or none when on-policy: the engine's log-probs summed over it, or
        per token (:class:`SampledTokens`) for the corrections that work from the tokens' ratios."""
        if self.behavior_token_logprob is None:
            return {}
        behavior = self._behavior_over(span)
        if self.correction is not None and self.correction.per_token:
            tokens = SampledTokens(self.per_sample(self.token_logprob), behavior, self.per_sample(span))
            return {"behavior_logprob": tokens, "correction": self.correction}
        return {"behavior_logprob": behavior.sum(-1), "correction": self.correction}

    def off_policy_tokens(self) -> dict:
        """GRPO's token-level off-policy arguments (``[B, M, T]``), or none when on-policy."""
        if self.behavior_token_logprob is None:
            return {}
        return {"behavior_logprob": self._behavior_over(self.target_mask), "correction": self.correction}

    def _behavior_over(self, span: torch.Tensor) -> torch.Tensor:
        """``[B, M, T]`` the engine's token log-probs over ``span``, 0 elsewhere."""
        return self.per_sample(torch.where(span, self.behavior_token_logprob.to(self.token_logprob.device), 0.0))
