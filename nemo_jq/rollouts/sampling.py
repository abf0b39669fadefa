"""The sampling primitive every rollout engine implements, and the token sampler the native ones share.

A :class:`Sampler` continues token-id prompts: ``num_samples`` continuations each, ending on a
stop id (kept) or after ``max_new_tokens``. Nothing about thinking budgets lives here; the
budget core (:mod:`nemo_jq.rollouts.budget`) drives a sampler in two phases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

import torch


@dataclass
class Sample:
    """One continuation: its token ids (ending in the stop id when ``stopped``) and, where the engine
    has them, each token's log-prob under the distribution it was sampled from (after temperature, top-k
    and top-p: the behaviour policy; the model's own at the paper's settings)."""

    token_ids: list[int]
    stopped: bool
    logprobs: list[float] | None = None
    #: Where the engine records them (a Qwen3-MoE under routing replay, :mod:`nemo_jq.models.routes`): the experts
    #: each position of prompt + ``token_ids`` was routed to, ``[positions, layers, k]`` uint8.
    routes: torch.Tensor | None = None


class Sampler(Protocol):
    #: How many ranks sample together, each calling ``sample`` with the same arguments and getting the same
    #: result (a tensor-parallel engine); 1 for an engine that samples in one process.
    tensor_parallel: int

    def sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
               generator: torch.Generator, greedy: bool = False) -> list[list[Sample]]:
        """``[B][num_samples]`` continuations; the same ``generator`` state gives the same samples
        (``greedy``: argmax decoding instead of the engine's sampling settings). A sampler that records routes (its
        ``record_routes`` true) also takes ``routes=False``: this call's samples carry none."""
        ...

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights under HF names, one tensor at a time (after an optimizer step)."""
        ...


@dataclass(frozen=True)
class SamplingSettings:
    """The rollouts' distribution: temperature 1 and no truncation is the paper's setting."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def truncate(self, logits: torch.Tensor) -> torch.Tensor:
        """Tempered logits with everything outside top-k / top-p set to -inf (``logits`` itself when neither is set
        and the temperature is 1: a division by 1 is a pass over [rows, V] that changes nothing)."""
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # keep the smallest prefix with mass >= top_p (as HF, vLLM)
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits

    def next_tokens(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row by inverting the CDF at ``uniforms`` (one draw per row, where
        ``torch.multinomial`` would need its own stream per row); return the tokens and their log-probs under
        the distribution they were drawn from (tempered and truncated: the behaviour policy an importance
        correction divides by; the plain model's at temperature 1 without truncation, and when greedy).

        ``logits``: [n, V] any dtype; ``uniforms``: [n] in [0, 1). Returns ``[n]`` long, ``[n]`` fp32.
        """
        logits = logits.float()
        if self.temperature == 0:
            tokens = logits.argmax(-1)
            picked = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
            return tokens, picked - torch.logsumexp(logits, -1)
        logits, uniforms = self.truncate(logits), uniforms.to(logits.device)
        rows = logits.shape[0] if logits.device.type != "cpu" else max(1, HOST_CHUNK_ELEMENTS // logits.shape[1])
        drawn = [_inverse_cdf(logits[start:start + rows], uniforms[start:start + rows])
                 for start in range(0, logits.shape[0], rows)]
        return torch.cat([tokens for tokens, _ in drawn]), torch.cat([logprobs for _, logprobs in drawn])


#: Rows x vocabulary entries sampled at once on the host: each temporary (4 MiB) stays under glibc's mmap threshold,
#: so its pages are reused, where a [128, 151936] one (78 MiB) is mapped and faulted in afresh at every decode step
#: (4x slower; bench/rollouts.py's sampling step). A GPU samples every row at once.
HOST_CHUNK_ELEMENTS = 1 << 20


def _inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' tokens at ``uniforms`` of their CDF and the tokens' log-probs, from one exponentiation of the
    logits: the unnormalised CDF's last entry is the softmax's denominator, so neither a softmax nor a second
    log-sum-exp pass over the vocabulary is needed."""
    top = logits.amax(-1, keepdim=True)
    cdf = (logits - top).exp_().cumsum_(-1)
    total = cdf[:, -1]
    tokens = torch.searchsorted(cdf, (uniforms * total).unsqueeze(1), right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
    picked = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, picked - top.squeeze(1) - total.log()


def seed_from(generator: torch.Generator) -> int:
    """A 31-bit seed drawn from ``generator`` (for engines that take integer seeds, like vLLM)."""
    return int(torch.randint(2**31 - 1, (1,), generator=generator, device=generator.device))


def check_request(prompts: Sequence[list[int]], num_samples: int, max_new_tokens: int) -> None:
    if num_samples < 1 or max_new_tokens < 1 or any(len(p) == 0 for p in prompts):
        raise ValueError(f"a sampling request needs num_samples >= 1, max_new_tokens >= 1 and non-empty prompts; "
                         f"got num_samples={num_samples}, max_new_tokens={max_new_tokens}")


def as_groups(flat: list[Any], num_samples: int) -> list[list[Any]]:
    """Prompt-major rows (``b * M + m``) as ``[B][M]``."""
    return [flat[start:start + num_samples] for start in range(0, len(flat), num_samples)]
