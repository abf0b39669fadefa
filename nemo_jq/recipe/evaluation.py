"""Evaluation as in the paper: p@1, unbiased p@k, m@k (majority vote), substring correctness."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from nemo_jq.data.base import Example, Task, correct_of
from nemo_jq.models.common import new_generator
from nemo_jq.models.interfaces import Rollout

if TYPE_CHECKING:
    from nemo_jq.recipe.components import Components


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased p@k = 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), as a stable product."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must lie in [1, n={num_samples}]; got k={k}")
    if num_samples - num_correct < k:
        return 1.0
    miss = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_answer(answers: Sequence[str]) -> str:
    """The most frequent answer; ties go to the one seen first."""
    counts = Counter(answers)
    return max(answers, key=lambda a: (counts[a], -answers.index(a))) if answers else ""


def score_outputs(task: Task, examples: Sequence[Example], outputs: Sequence[Sequence[str]], k: int) -> dict[str, float]:
    """``outputs[i]`` holds the n sampled answers for ``examples[i]``; returns p@1, p@k, m@k (percent)."""
    p1, pk, mk = [], [], []
    for example, samples in zip(examples, outputs):
        correct = [correct_of(task, o, example) for o in samples]
        p1.append(pass_at_k(len(samples), sum(correct), 1))
        pk.append(pass_at_k(len(samples), sum(correct), k))
        extracted = [task.extract_answer(o) for o in samples[:k]]
        normalized = [task.normalize(a) for a in extracted]
        winner = majority_answer(normalized)
        mk.append(float(bool(winner) and correct_of(task, extracted[normalized.index(winner)], example)))
    count = max(len(p1), 1)
    return {"p@1": 100 * sum(p1) / count, f"p@{k}": 100 * sum(pk) / count, f"m@{k}": 100 * sum(mk) / count}


def sample_outputs(
    components: Components,
    examples: Sequence[Example],
    num_samples: int,
    batch_size: int,
    generator: torch.Generator,
    progress=None,
    greedy: bool = False,
    on_group: Callable[[int, list[Rollout]], None] | None = None,
    stopped: Callable[[], bool] | None = None,
) -> list[list[str]]:
    """Decoded answers, ``num_samples`` per example, generated ``batch_size`` prompts at a time from the prompts
    training samples from (:meth:`Components.prompt_ids`); ``on_group(index, rollouts)`` sees each example's rollouts
    as they come (the evaluation keeps a few to show, :func:`shown_samples`). A Qwen3-MoE's routes are not recorded:
    nothing trains on these rollouts. ``stopped``: asked before each call; true, :class:`EvaluationStopped`."""
    outputs: list[list[str]] = []
    for start in range(0, len(examples), batch_size):
        if stopped is not None and stopped():
            raise EvaluationStopped
        chunk = list(examples[start : start + batch_size])
        for group in components.engine.generate(components.prompt_ids(chunk), num_samples, sample_answers=True,
                                                generator=generator, greedy=greedy, routes=False):
            if on_group is not None:
                on_group(len(outputs), group)
            outputs.append([components.chat.decode_answer(r.answer_ids or []) for r in group])
        if progress is not None:
            progress.update(len(chunk))
    return outputs


class EvaluationStopped(Exception):
    """A stop signal came while a run's end was evaluated: nothing is written, and a resume evaluates again."""


def memorised(task: Task, noisy: Sequence[Example], outputs: Sequence[Sequence[str]]) -> list[bool]:
    """Whether each noisy example's (first) output reproduces its corrupted label: correct by the task's rule
    against the corrupted label and not against the clean example (``noise.clean_of``: its answer, aliases and
    meta), so an output naming both does not count."""
    from nemo_jq.data.noise import clean_of

    return [correct_of(task, samples[0], example) and not correct_of(task, samples[0], clean_of(example))
            for example, samples in zip(noisy, outputs)]


#: Of each noisy example's pool of training answers, how many :func:`chance_memorised` draws at most.
CHANCE_DRAWS = 2000


def chance_memorised(task: Task, train: Sequence[Example], noisy: Sequence[Example], outputs: Sequence[Sequence[str]],
                     draws: int = CHANCE_DRAWS) -> list[float]:
    """For each noisy example, the share of the wrong labels its corruption could have drawn (a training answer the
    task does not count correct for it, as :func:`~nemo_jq.data.noise.corrupt_labels` draws them) that its (first)
    output would count as memorised: what :func:`memorised` gives an output that ignores the label it trained on. An
    output naming many answers matches many labels by chance. The pool is ``train``'s answers, clean; past ``draws``
    of them, a seeded draw of that many."""
    import dataclasses
    import random

    from nemo_jq.data.noise import CLEAN_ANSWER, clean_of

    pool = sorted({example.meta.get(CLEAN_ANSWER, example.answer) for example in train})
    shares = []
    for example, samples in zip(noisy, outputs):
        clean = clean_of(example)
        if correct_of(task, samples[0], clean):  # memorised never counts an output naming the clean answer
            shares.append(0.0)
            continue
        drawn = pool if len(pool) <= draws else random.Random(f"chance-{example.id}").sample(pool, draws)
        wrong = [answer for answer in drawn if not correct_of(task, answer, clean)]
        shares.append(sum(correct_of(task, samples[0], dataclasses.replace(example, answer=answer)) for answer in wrong)
                      / max(1, len(wrong)))
    return shares


class Evaluator:
    """A run's evaluation: scores on a split, and memorisation of noisy labels, from its rollout engine.

    Sampling draws from its own generator, seeded from the run's seed (and, per call, ``seed_offset``):
    evaluating never moves the training streams. Each data-parallel replica samples its share.
    """

    def __init__(self, components: Components):
        self.components = components
        #: The first prompts of the last call's ``shown`` (:func:`shown_samples`): what the model wrote for them.
        self.shown: list[dict[str, Any]] = []

    def evaluate(self, split: str, seed_offset: int = 0, shown: int = 0,
                 stopped: Callable[[], bool] | None = None) -> dict[str, float]:
        """p@1, p@k and m@k (k = eval.num_samples) on ``split``; the first ``shown`` prompts' samples are kept in
        :attr:`shown`. ``stopped``: as :func:`sample_outputs` takes it."""
        from nemo_jq.runtime import distributed
        from nemo_jq.runtime.monitor import progress

        parts, settings = self.components, self.components.config.eval
        examples = parts.splits.get(split)
        mine, count = self._share(examples)
        seed = parts.data_parallel.replica_seed(parts.config.train.seed + 10_000 + seed_offset)
        generator = new_generator(parts.device).manual_seed(seed)
        kept: dict[int, list[Rollout]] = {}
        keep = (lambda index, group: kept.setdefault(index, group) if index < shown else None) if shown else None
        with progress(len(mine), f"eval {split}", unit="prompt", shows=distributed.is_writer(), transient=True) as bar:
            outputs = sample_outputs(parts, mine, settings.num_samples, settings.batch_size, generator, bar,
                                     on_group=keep, stopped=stopped)
        self.shown = shown_samples(parts, mine[:min(shown, count)], [kept[i] for i in range(min(shown, count))])
        return score_outputs(parts.task, examples, parts.data_parallel.gather(outputs[:count]), settings.num_samples)

    def _share(self, examples: list[Example]) -> tuple[list[Example], int]:
        """This replica's share of ``examples`` to sample, and how many of them are its own. An engine in lockstep
        (vLLM's data-parallel ranks step together), or a policy whose refit gathers over the replicas (a Qwen3-MoE's
        experts, over the expert-parallel ranks), needs every replica to make the same calls: a shorter share is
        padded with copies of its last example (or the first one), whose outputs are dropped (a replica with none
        joined no refit: the others waited for it until the collective timeout)."""
        parts = self.components
        mine = parts.data_parallel.shard(examples)
        if not (parts.engine.lockstep or parts.policy.gathers_over_replicas) or not examples:
            return mine, len(mine)
        most = -(-len(examples) // parts.data_parallel.size)
        return mine + [(mine or examples)[-1]] * (most - len(mine)), len(mine)

    def memorisation(self, stopped: Callable[[], bool] | None = None) -> dict[str, float] | None:
        """Percent of the noisy training prompts (``data.label_noise``) whose corrupted label the model's greedy
        answer reproduces (``memorised``), and what those answers would score against labels drawn afresh
        (``chance``: :func:`chance_memorised`); None without label noise. ``stopped``: as :func:`sample_outputs`
        takes it."""
        from nemo_jq.data.noise import noisy_examples

        parts = self.components
        noisy = noisy_examples(parts.splits.train)
        if not noisy:
            return None
        unused = new_generator(parts.device)  # greedy decoding draws nothing
        mine, count = self._share(noisy)
        outputs = sample_outputs(parts, mine, 1, parts.config.eval.batch_size, unused, greedy=True, stopped=stopped)
        gathered = parts.data_parallel.gather(outputs[:count])
        flags = memorised(parts.task, noisy, gathered)
        chance = chance_memorised(parts.task, parts.splits.train, noisy, gathered)
        return {"memorised": 100 * sum(flags) / len(flags), "chance": 100 * sum(chance) / len(chance)}


#: Of each shown prompt's samples, how many :func:`shown_samples` keeps.
SAMPLES_SHOWN_PER_PROMPT = 4


def shown_samples(components: Components, examples: Sequence[Example], groups: Sequence[Sequence[Rollout]], *,
                  limit: int = SAMPLES_SHOWN_PER_PROMPT) -> list[dict[str, Any]]:
    """What the model wrote for ``examples``: each prompt's question, reference answer and first ``limit`` samples (the
    rationale, whether ``</think>`` was forced, the answer, and whether the task's rule counts it correct: the
    reward)."""
    chat, task = components.chat, components.task
    shown = []
    for example, group in zip(examples, groups):
        samples = []
        for rollout in group[:limit]:
            answer = chat.decode_answer(rollout.answer_ids or [])
            samples.append({"rationale": chat.tokenizer.decode(rollout.rationale_ids, skip_special_tokens=False),
                            "think_end_forced": rollout.think_end_forced, "answer": answer,
                            "correct": correct_of(task, answer, example)})
        shown.append({"id": example.id, "question": example.question, "reference": example.answer, "samples": samples})
    return shown
