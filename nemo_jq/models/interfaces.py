"""The seams a backend implements: a Policy that trains, a RolloutEngine that samples.

Both speak token ids and padded tensors only, so a Megatron policy or a vLLM engine can replace the
HF ones without the recipe changing. Training and refit are separate protocols (as NeMo-RL separates
``PolicyInterface`` from ``ColocatablePolicyInterface``): :class:`Policy` is what the recipe trains,
:class:`RefittablePolicy` what an engine holding its own copy of the weights reads to refit it.
The engine returns each rollout's spans (prompt, sampled rationale, whether ``</think>`` was forced,
sampled answer); the recipe splices training sequences from those ids. :func:`require` checks an object
against a protocol when a backend is built, so a missing member is named then, not at the first refit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from nemo_jq.registry import NotImplementing
from nemo_jq.runtime.distributed import DataParallel


@dataclass
class Rollout:
    prompt_ids: list[int]
    #: Sampled thinking tokens, without ``</think>``.
    rationale_ids: list[int]
    #: True when the thinking budget ran out and ``</think>`` was inserted rather than sampled.
    think_end_forced: bool
    #: Sampled answer tokens after ``</think>`` (ending in end-of-turn unless the answer budget ran
    #: out), or None when the estimator needs no sampled answer.
    answer_ids: list[int] | None = None
    #: The sampling engine's own log-probs of the rationale span's targets (each rationale token, then a
    #: sampled ``</think>``), and of the answer's; None where the engine has none. Training recomputes
    #: them with the policy and only logs the gap (an off-policy check).
    rationale_logprobs: list[float] | None = None
    answer_logprobs: list[float] | None = None
    #: A Qwen3-MoE under routing replay: the experts the engine routed each position of prompt + rationale (+
    #: ``</think>`` + answer, where sampled) to, ``[positions, layers, k]`` uint8, ``ROUTE_YOURSELF`` where it ran
    #: none (:mod:`nemo_jq.models.routes`); None where the engine recorded none.
    routes: torch.Tensor | None = None


@dataclass
class TokenBatch:
    """Right-padded sequences with their target spans.

    ``rationale_mask[i, t]`` / ``answer_mask[i, t]`` mark the tokens ``input_ids[i, t + 1]`` that
    belong to the rationale / answer span: position t predicts token t + 1.
    """

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    rationale_mask: torch.Tensor  # [N, L-1] bool
    answer_mask: torch.Tensor  # [N, L-1] bool
    #: The rollout engine's own log-probs of the target tokens where it reported them, NaN elsewhere
    #: ([N, L-1] fp32), for the off-policy gap; None when it reported none.
    engine_logprobs: torch.Tensor | None = None
    #: The engine's routes of each input position ([N, L, layers, k] uint8, ``ROUTE_YOURSELF`` where it ran none: the
    #: trainer replays them, :mod:`nemo_jq.models.routes`); None when it recorded none.
    routes: torch.Tensor | None = None

    @property
    def target_mask(self) -> torch.Tensor:
        return self.rationale_mask | self.answer_mask

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, end: int | None = None) -> "TokenBatch":
        """Rows ``start:end`` (or the rows a tensor ``start`` of indices names, in its order), trimmed to their
        longest sequence."""
        picked = start if end is None else slice(start, end)
        length = int(self.attention_mask[picked].sum(1).max())
        ids, targets = (picked, slice(0, length)), (picked, slice(0, length - 1))
        return TokenBatch(self.input_ids[ids], self.attention_mask[ids], self.rationale_mask[targets],
                          self.answer_mask[targets], None if self.engine_logprobs is None else self.engine_logprobs[targets],
                          None if self.routes is None else self.routes[ids])

    def to(self, device: torch.device | str) -> "TokenBatch":
        return TokenBatch(*(None if t is None else t.to(device) for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.input_ids, self.attention_mask, self.rationale_mask, self.answer_mask, self.engine_logprobs, self.routes


#: ``loss_fn(token_logprobs [n, L-1], micro_batch_index) -> (scalar to backpropagate, its metrics)``.
LossFn = Callable[[torch.Tensor, int], "tuple[torch.Tensor, dict[str, Any]]"]


def backward_each(policy: "Policy", micro_batches: Sequence[TokenBatch], loss_fn: LossFn, *,
                  before_each: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """``forward_backward`` of a policy that runs every ``loss_fn`` call itself (no pipeline): one backward per
    micro-batch, their metrics in order; ``before_each(index)`` before each micro-batch's forward."""
    metrics = []
    for index, micro in enumerate(micro_batches):
        if before_each is not None:
            before_each(index)
        loss, micro_metrics = loss_fn(policy.token_logprobs(micro), index)
        loss.backward()
        metrics.append(micro_metrics)
    return metrics


def token_logprobs_each(policy: "Policy", batches: Sequence[TokenBatch]) -> list[torch.Tensor]:
    """No-grad ``token_logprobs`` of each batch, in order. A policy whose stages would idle while one batch at a time
    passes through them (pipeline parallelism) scores them together with a ``token_logprobs_each`` method of its own;
    any other, one batch at a time."""
    together = getattr(policy, "token_logprobs_each", None)
    with torch.no_grad():
        return together(batches) if together is not None else [policy.token_logprobs(batch) for batch in batches]


class Policy(Protocol):
    #: This rank's share of the data (``DataParallel()``: all of it, in one process).
    data_parallel: DataParallel

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """``[N, L-1]`` fp32 log-probs of the target tokens (0 elsewhere); differentiable under grad."""
        ...

    def forward_backward(self, micro_batches: Sequence[TokenBatch], loss_fn: LossFn) -> list[dict[str, Any]]:
        """Accumulate gradients of ``loss_fn`` over the micro-batches (no optimizer step); return the metrics
        ``loss_fn`` gave for each, in order, on every rank (under pipeline parallelism only the last stage calls
        it, and the policy shares them: NeMo-RL's ``policy.train(...) -> metrics``)."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients; return e.g. the pre-clip gradient norm."""
        ...

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the following steps."""
        ...

    def save(self, directory: Path) -> None:
        """Write the weights and optimizer state into ``directory`` (a collective: every rank calls it)."""
        ...

    def load(self, directory: Path, *, with_optimizer: bool = True) -> None:
        """Read what ``save`` wrote (a collective); ``FileNotFoundError`` names what is missing."""
        ...

    def export(self, out_dir: Path, tokenizer: Any) -> None:
        """Write an HF folder that ``AutoModelForCausalLM.from_pretrained`` loads unchanged."""
        ...


class RefittablePolicy(Protocol):
    """What a rollout engine holding its own copy of a policy's weights reads to reload them after they change
    (a backend's policy implements it beside :class:`Policy`; a scripted weight source may implement it alone)."""

    #: Moves whenever the weights change (an optimizer step, a load), so the engine knows to refit.
    weights_version: int
    #: The ranks holding one replica, which train on the same rollouts (None in one process).
    model_parallel_group: Any
    #: Whether ``iter_hf`` is a collective over every replica, not only this one's ranks (a Qwen3-MoE's experts come
    #: from the expert-parallel ranks, carved from the replicas): rollout ranks of their own then have every replica
    #: take part in the gather their weights come from.
    gathers_over_replicas: bool

    def iter_hf(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights under their HF names, one tensor at a time (a collective over the replica's ranks,
        each of which consumes it to the end)."""
        ...


class RolloutEngine(Protocol):
    #: Tokens sampled so far beyond the prompts (a forced ``</think>`` included), for throughput logging.
    tokens_generated: int
    #: Whether its rollouts are drawn from the policy's own distribution (its weights, its kernels), so that
    #: ``objective.importance=auto`` corrects nothing; False for an engine with weights and kernels of its own
    #: (vLLM's, or an HF copy beside a Megatron policy). The recipe reads this, never the engine's type.
    on_policy: bool
    #: Whether every rank of the world calls ``generate`` alike, in step (vLLM's external launcher, rollout ranks):
    #: evaluation then gives every data-parallel replica a share of the same length.
    lockstep: bool

    def generate(
        self,
        prompts: Sequence[list[int]],
        num_samples: int,
        *,
        sample_answers: bool,
        generator: torch.Generator,
        greedy: bool = False,
        routes: bool = True,
    ) -> list[list[Rollout]]:
        """``num_samples`` rollouts per prompt (``[B][M]``) under the thinking and answer budgets
        (``greedy``: the most likely token at each step instead of the run's sampling; ``routes=False``: a
        Qwen3-MoE's rollouts carry no routes, and an engine that records them per call records none: evaluation's,
        which trains on nothing it samples)."""
        ...


def members(protocol: type) -> list[str]:
    """The attributes and methods a protocol declares, its bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls is object or cls.__name__ in ("Protocol", "Generic"):
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}
    return sorted(names)


def require(obj: Any, protocol: type, what: str) -> Any:
    """``obj``, if it has every member of ``protocol`` and its methods take every keyword the protocol's do; else a
    ``TypeError`` naming what it lacks (at the backend's build, not at the first call that passes the keyword)."""
    missing = [name for name in members(protocol) if not hasattr(obj, name)]
    missing += [f"{name}(..., {keyword}=...)" for name in members(protocol) if hasattr(obj, name)
                for keyword in _keywords_not_taken(getattr(protocol, name, None), getattr(obj, name))]
    if missing:
        module = type(obj).__module__
        source = None if module.split(".")[0] in sys.stdlib_module_names else getattr(sys.modules.get(module), "__file__", None)
        raise NotImplementing(f"{what} ({type(obj).__name__}{f', {source}' if source else ''}) does not implement "
                              f"{protocol.__name__}: it lacks {', '.join(missing)} (docs/extending.md)")
    return obj


def _keywords_not_taken(declared: Any, method: Any) -> list[str]:
    """The keyword-only parameters of the protocol's ``declared`` method that ``method`` takes neither by name nor by
    ``**kwargs`` (none where either is no function, or has no signature to read)."""
    import inspect

    if not (inspect.isfunction(declared) and callable(method)):
        return []
    try:
        taken = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return []
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in taken.values()):
        return []
    return [name for name, parameter in inspect.signature(declared).parameters.items()
            if parameter.kind is parameter.KEYWORD_ONLY and name not in taken]
