"""Splice training sequences from rollout token ids, with the rationale and answer spans marked.

GARL/PAFT:  [prompt, z_m, </think>, y* formatted, <|im_end|>]  -> log p(z_m|x), log p(y*|x, z_m)
GRPO/RLOO:  [prompt, z_m, </think>, sampled answer]          -> log p(z_m, ŷ_m | x)
SFT:        [prompt, gold z, </think>, y* formatted]        -> log p(z, y* | x)

A sampled ``</think>`` belongs to the rationale (the model chose to stop thinking); a forced
one belongs to no span, since the model did not choose it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from nemo_jq.models.interfaces import Rollout, TokenBatch
from nemo_jq.models.routes import empty_routes


def splice(prompt: list[int], rationale: list[int], think_end_id: int, think_end_forced: bool, answer: list[int]):
    """One sequence: ``(ids, rationale_targets, answer_targets)`` with the masks over ids[1:]."""
    ids = prompt + rationale + [think_end_id] + answer
    in_rationale = [False] * len(prompt) + [True] * len(rationale) + [not think_end_forced] + [False] * len(answer)
    in_answer = [False] * (len(prompt) + len(rationale) + 1) + [True] * len(answer)
    return ids, in_rationale[1:], in_answer[1:]


def engine_logprobs(rollout: Rollout, with_answer: bool) -> list[float] | None:
    """The engine's log-probs of the rollout's spliced targets (over ids[1:]), NaN where it has none
    (the prompt, a forced ``</think>``, a reference answer); None when it reported none at all."""
    if rollout.rationale_logprobs is None:
        return None
    answer = (rollout.answer_logprobs or [math.nan] * len(rollout.answer_ids)) if with_answer else []
    after_think = len(rollout.rationale_ids) + 1 - len(rollout.rationale_logprobs)  # the forced </think>, if any
    return [math.nan] * (len(rollout.prompt_ids) - 1) + rollout.rationale_logprobs + [math.nan] * after_think + answer


def engine_routes(rollout: Rollout, with_answer: bool) -> torch.Tensor | None:
    """The engine's routes of the rollout's spliced positions: the prompt's and rationale's, and with the sampled
    answer the ``</think>``'s and the answer's too; a teacher-forced answer the trainer routes itself."""
    if rollout.routes is None or with_answer:
        return rollout.routes
    return rollout.routes[: len(rollout.prompt_ids) + len(rollout.rationale_ids)]


def collate(rows: Sequence[tuple[list[int], list[bool], list[bool]]], pad_id: int,
            engine_rows: Sequence[list[float] | None] = (), route_rows: Sequence[torch.Tensor | None] = ()) -> TokenBatch:
    """Right-pad spliced rows into a :class:`TokenBatch` (with the engine's log-probs where every row has them, and
    its routes where any has them: the positions past a row's, and padding, to route themselves)."""
    length = max(len(ids) for ids, _, _ in rows)
    n = len(rows)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    rationale_mask = torch.zeros((n, length - 1), dtype=torch.bool)
    answer_mask = torch.zeros((n, length - 1), dtype=torch.bool)
    for i, (ids, in_rationale, in_answer) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        rationale_mask[i, : len(in_rationale)] = torch.tensor(in_rationale, dtype=torch.bool)
        answer_mask[i, : len(in_answer)] = torch.tensor(in_answer, dtype=torch.bool)
    engine = None
    if engine_rows and all(row is not None for row in engine_rows):
        engine = torch.full((n, length - 1), math.nan)
        for i, row in enumerate(engine_rows):
            engine[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    recorded = [routes for routes in route_rows if routes is not None]
    routes = None
    if recorded:
        routes = empty_routes(n, length, *recorded[0].shape[1:])
        for i, row in enumerate(route_rows):
            if row is not None:
                routes[i, : len(row)] = row
    return TokenBatch(input_ids, attention, rationale_mask, answer_mask, engine, routes)


def reference_answer_batch(
    rollouts: Sequence[Sequence[Rollout]], reference_answers: Sequence[list[int]], think_end_id: int, pad_id: int
) -> TokenBatch:
    """GARL/PAFT rows, prompt-major (row ``b * M + m``), each ending in its prompt's formatted y*."""
    rows = [
        splice(r.prompt_ids, r.rationale_ids, think_end_id, r.think_end_forced, answer)
        for group, answer in zip(rollouts, reference_answers)
        for r in group
    ]
    return collate(rows, pad_id, [engine_logprobs(r, with_answer=False) for group in rollouts for r in group],
                   [engine_routes(r, with_answer=False) for group in rollouts for r in group])


def sampled_answer_batch(rollouts: Sequence[Sequence[Rollout]], think_end_id: int, pad_id: int) -> TokenBatch:
    """GRPO/RLOO rows, prompt-major, each ending in its own sampled answer."""
    rows = []
    for group in rollouts:
        for r in group:
            if r.answer_ids is None:
                raise ValueError("rollout has no sampled answer; generate with sample_answers=True")
            rows.append(splice(r.prompt_ids, r.rationale_ids, think_end_id, r.think_end_forced, r.answer_ids))
    return collate(rows, pad_id, [engine_logprobs(r, with_answer=True) for group in rollouts for r in group],
                   [engine_routes(r, with_answer=True) for group in rollouts for r in group])


def given_target_batch(
    prompts: Sequence[list[int]],
    rationales: Sequence[list[int]],
    answers: Sequence[list[int]],
    think_end_id: int,
    pad_id: int,
) -> TokenBatch:
    """SFT rows: a given rationale (its ``</think>`` is a target too) and the formatted y*."""
    return collate([splice(p, z, think_end_id, False, y) for p, z, y in zip(prompts, rationales, answers)], pad_id)
