"""Making the training experience, in one place: rollouts, rewards and the token batch of one step.

What the estimator declares it needs decides what is made: given targets (SFT) are spliced from the
examples; otherwise M rationales per prompt are sampled under the thinking budget, and then either the
reference answer y* is spliced after each (GARL, PAFT: teacher-forced, no answer sampled) or an answer
is sampled and scored by the task's reward (GRPO, RLOO). Rows are prompt-major (row ``b * M + m``).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from nemo_jq.data import Example
from nemo_jq.data.base import reward_of
from nemo_jq.models.common import new_generator
from nemo_jq.models.interfaces import Rollout, TokenBatch
from nemo_jq.objectives import Need, ObjectiveSpec
from nemo_jq.objectives.importance import Correction, k3_kl
from nemo_jq.recipe.sequences import given_target_batch, reference_answer_batch, sampled_answer_batch
from nemo_jq.rollouts.process import SamplingProcess, publish_refit, second_process_refused, share_weights
from nemo_jq.rollouts.refit import RefittedRolloutEngine
from nemo_jq.rollouts.sampling import seed_from

if TYPE_CHECKING:
    from nemo_jq.recipe.components import Components
    from nemo_jq.recipe.step import StepResult


@dataclass
class MicroBatch:
    """Whole prompt groups of an :class:`Experience`: one forward/backward."""

    batch: TokenBatch
    rewards: torch.Tensor | None
    num_prompts: int


@dataclass
class Experience:
    """This replica's share of one optimizer batch, ready for the loss."""

    batch: TokenBatch
    #: Rows per prompt: M rollouts, or 1 given target.
    group: int
    #: ``[B, M]`` rewards of the sampled answers (None when none were sampled).
    rewards: torch.Tensor | None
    #: Tokens the rollouts sampled, and the seconds that took (prompt formatting and splicing included).
    rollout_tokens: int
    rollout_seconds: float

    @property
    def num_prompts(self) -> int:
        return self.batch.num_rows // self.group

    def micro_batches(self, prompts_per_micro_batch: int) -> list[MicroBatch]:
        """Consecutive runs of whole prompt groups, each trimmed to its longest sequence."""
        bounds = [(s, min(s + prompts_per_micro_batch, self.num_prompts))
                  for s in range(0, self.num_prompts, prompts_per_micro_batch)]
        return [MicroBatch(self.batch.rows(s * self.group, e * self.group),
                           self.rewards[s:e] if self.rewards is not None else None, e - s) for s, e in bounds]


def make_experience(components: Components, examples: list[Example], estimator: ObjectiveSpec,
                    generator: torch.Generator) -> Experience:
    """The experience ``estimator`` needs for ``examples`` (this replica's prompts), sampled with ``generator``."""
    started = time.perf_counter()
    chat, engine = components.chat, components.engine
    prompts = components.prompt_ids(examples)
    if Need.GIVEN_TARGET in estimator.needs:
        batch = given_target_batch(prompts, [chat.rationale_ids(e.rationale or "") for e in examples],
                                   [chat.answer_ids(e.answer) for e in examples], chat.think_end_id, chat.pad_id)
        return Experience(batch, 1, None, 0, time.perf_counter() - started)
    tokens_before = engine.tokens_generated
    rollouts = engine.generate(prompts, components.config.rollout.num_samples,
                               sample_answers=Need.SAMPLED_ANSWER_REWARD in estimator.needs, generator=generator)
    return experience_from(components, examples, estimator, rollouts, engine.tokens_generated - tokens_before,
                           time.perf_counter() - started)


def experience_from(components: Components, examples: list[Example], estimator: ObjectiveSpec,
                    rollouts: list[list[Rollout]], tokens: int, seconds: float) -> Experience:
    """Training rows from ``examples``' rollouts: y* spliced after each rationale (GARL, PAFT: teacher-forced), or
    the sampled answers with the task's rewards (GRPO, RLOO)."""
    chat = components.chat
    rewards = None
    if Need.SAMPLED_ANSWER_REWARD in estimator.needs:
        batch = sampled_answer_batch(rollouts, chat.think_end_id, chat.pad_id)
        rewards = torch.tensor([[reward_of(components.task, chat.decode_answer(r.answer_ids), e) for r in group_rollouts]
                                for group_rollouts, e in zip(rollouts, examples)], device=components.device)
    else:
        batch = reference_answer_batch(rollouts, [chat.answer_ids(e.answer) for e in examples], chat.think_end_id,
                                       chat.pad_id)
    return Experience(batch, components.config.rollout.num_samples, rewards, tokens, seconds)


class RolloutsAhead:
    """One-step-off experience (``rollout.async_steps=1``): while step t trains on rollouts sampled from θ_{t-1},
    the rollouts of step t+1 are sampled from θ_t, and the estimators correct for the lag (objective.importance).

    The engine holds its own copy of the weights (:class:`~nemo_jq.rollouts.refit.RefittedRolloutEngine`; the hf
    backend builds one for async runs), refitted in this process when a request is made, so no request sees a
    half-updated policy. In one process with an engine over an HF model (native, hf) the copy samples in a child
    process (:class:`~nemo_jq.rollouts.process.SamplingProcess`) while this one trains; otherwise (vLLM, or under
    torchrun) the next step's rollouts are sampled before the step trains: one step off, without the overlap,
    which needs inference on other devices. Evaluation and checkpoints wait for the request in flight
    (:meth:`settle`); a checkpoint carries its experience, so a resumed run continues exactly.
    """

    def __init__(self, components: Components):
        from nemo_jq.rollouts import samples_in_a_child
        from nemo_jq.runtime import distributed

        engine = components.engine
        if not isinstance(engine, RefittedRolloutEngine):
            raise ValueError("rollout.async_steps=1 needs a rollout engine with its own copy of the weights; "
                             f"model.backend={components.config.model.backend} gave {type(engine).__name__}")
        self.components, self.engine = components, engine
        self.overlaps = samples_in_a_child(components.config, distributed.world_size())
        refused = second_process_refused(components.device) if self.overlaps else None
        if refused is not None:
            self.overlaps = False
            print(f"rollout.async_steps=1: {refused}, so no sampling process can share it: the next step's rollouts "
                  "are sampled in this process before each step (one step off, without the overlap)", file=sys.stderr)
        self.worker: SamplingProcess | None = None
        #: The request in flight (its examples and estimator), or its experience once settled.
        self.pending: tuple[list[Example], ObjectiveSpec] | Experience | None = None

    def submit(self, examples: list[Example], estimator: ObjectiveSpec, seed: int) -> None:
        """Sample ``examples``' experience from the weights as they are now (seeded by ``seed``)."""
        if not self.overlaps:  # its sampling refits the engine in the one wake it samples in (a vLLM engine woke twice)
            self.pending = make_experience(self.components, examples, estimator,
                                           new_generator(self.components.device).manual_seed(seed))
            return
        self.engine.refit()
        if self.worker is None:
            share_weights(self.engine.engine)
            self.worker = SamplingProcess(self.engine.engine, threads=self._split_threads())
        publish_refit(self.components.device)
        self.worker.submit(self.components.prompt_ids(examples), self.components.config.rollout.num_samples,
                           sample_answers=Need.SAMPLED_ANSWER_REWARD in estimator.needs, seed=seed)
        self.pending = (examples, estimator)

    def step_experience(self, shard: list[Example], upcoming: list[Example] | None, estimator: ObjectiveSpec,
                        generator: torch.Generator) -> tuple[Experience, int]:
        """A step's experience and how many steps older than the weights its sampler's were: the one sampled ahead,
        or (the first step, and the first after the guard restored a checkpoint) ``shard``'s sampled now; then the
        next step's request (``upcoming``: None on the last step), sent before this step trains."""
        experience, lag = self.take(), 1
        if experience is None:
            experience, lag = make_experience(self.components, shard, estimator, generator), 0
        if upcoming is not None:
            self.submit(upcoming, estimator, seed_from(generator))
        return experience, lag

    def settle(self) -> Experience | None:
        """Wait for the request in flight; its experience (None if there is none)."""
        if isinstance(self.pending, tuple):
            (examples, estimator), self.pending = self.pending, None  # a child's error is raised once: close() after
            rollouts, tokens, seconds = self.worker.result()  # it waited for a second reply that never came (a hang)
            self.pending = experience_from(self.components, examples, estimator, rollouts, tokens, seconds)
        return self.pending

    def take(self) -> Experience | None:
        experience, self.pending = self.settle(), None
        return experience

    def close(self) -> None:
        """Stop the sampling process (a later request starts another) and give this process its threads back."""
        self.settle()
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            torch.set_num_threads(self.threads)

    def _split_threads(self) -> int:
        """On CPU the two processes share the run's threads (:func:`split_threads` of torch's count: OMP_NUM_THREADS,
        which a sweep sets to the run's share of the free cores); returns the sampling process's."""
        self.threads = torch.get_num_threads()
        if self.components.device.type != "cpu":
            return 1
        sampling, training = split_threads(self.threads)
        torch.set_num_threads(training)
        return sampling

    def state_dict(self) -> dict[str, Any]:
        return {"pending": self.settle(), "layout": self.layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The rollouts sampled ahead, where the run resumes at the layout it saved them at (each rank saved its
        replica's); at another (``megatron.*`` sizes may change on resume: a replica's share, a rank's replica, moved)
        the first step samples its own, from the resumed weights: lag 0. A checkpoint saved before layouts were
        recorded is taken as at this one."""
        same = state.get("layout", self.layout()) == self.layout()
        self.pending = state.get("pending") if same else None

    def layout(self) -> list[int]:
        """What decides which prompts a rank's replica trains on: the processes, replicas, and TP x PP x CP."""
        from nemo_jq.runtime import distributed

        megatron = self.components.config.megatron
        return [distributed.world_size(), self.components.data_parallel.size, megatron.tensor_parallel,
                megatron.pipeline_parallel, megatron.context_parallel]


def split_threads(threads: int) -> tuple[int, int]:
    """A run's ``threads`` shared between its sampling process and its training one, (sampling, training): half each,
    training the odd one, at least one each (OpenMP threads spin while they wait, so a process with all of them
    starves the other; at one thread, one each: neither spins)."""
    sampling = max(1, threads // 2)
    return sampling, max(1, threads - sampling)


def mismatch_metrics(policy_logprobs: torch.Tensor, batch: TokenBatch) -> dict[str, float]:
    """How far the policy that sampled the rollouts is from the one trained, over the sampled tokens the engine
    scored (``scored_tokens``): the mean and largest |engine − policy| log-prob, and ``kl_k3``, the k3 estimate of
    KL(engine ‖ policy) per token (unbiased under the engine's samples, each term >= 0)."""
    if batch.engine_logprobs is None:
        return {}
    engine = batch.engine_logprobs.to(policy_logprobs.device)
    scored = ~engine.isnan()
    if not bool(scored.any()):
        return {}
    gaps = (policy_logprobs - engine)[scored].abs()
    return {"logprob_gap": float(gaps.mean()), "max_logprob_gap": float(gaps.max()),
            "kl_k3": float(k3_kl(policy_logprobs, engine, scored)), "scored_tokens": int(scored.sum())}


class MismatchWatch:
    """Says so, on the writer, when the rollouts stray from the policy: a sampled token's log-prob more than
    ``rollout.max_logprob_gap`` apart, or the per-token KL above ``rollout.max_mismatch_kl``; again only when the
    KL has doubled since (every step's values are in metrics.jsonl).

    One step off under a correction, the lag itself puts every step past those thresholds, by design: there a step
    is judged against what the lag gives (the median KL of the lagged steps before it, once it has :data:`LAG_STEPS`
    of them), and only a KL :data:`LAG_JUMP` times that and past the threshold is said (a refit that failed, an
    engine in another precision); the first step, sampled from the current weights, is judged as any on-policy step."""

    #: Lagged steps seen before the lag's own level is known (none is said before).
    LAG_STEPS = 3
    #: How far past the lag's median KL a lagged step's KL must be to be said.
    LAG_JUMP = 4.0

    def __init__(self, rollout: Any, correction: Correction | None, uncorrected_by: str | None = None):
        """``correction``: the one the estimator applies; ``uncorrected_by``: an estimator that takes none."""
        self.max_gap, self.max_kl, self.correction = rollout.max_logprob_gap, rollout.max_mismatch_kl, correction
        self.rollout = rollout
        self.uncorrected_by = uncorrected_by
        self.warned_kl: float | None = None
        self.lagged_kls: list[float] = []

    def recall(self, results: Iterable[StepResult]) -> None:
        """Go over a resumed run's steps before its checkpoint, saying nothing: it then warns as the run would have
        without the stop (a lag's median from its steps before, no warning again below twice the KL said last)."""
        for result in results:
            self(result, say=False)

    def __call__(self, result: StepResult, *, say: bool = True) -> None:
        from nemo_jq.runtime import distributed

        step, gap, kl = result.step, result.max_logprob_gap, result.kl_k3
        exceeded = gap > self.max_gap or kl > self.max_kl
        explained = ""
        if result.record.get("rollout_lag") and self.correction is not None:
            seen, self.lagged_kls = self.lagged_kls, [*self.lagged_kls, kl]
            if len(seen) < self.LAG_STEPS:
                return
            lag_kl = statistics.median(seen)
            exceeded = kl > self.max_kl and kl > self.LAG_JUMP * lag_kl
            explained = f", {kl / lag_kl:.3g} times the {lag_kl:.3g} the one-step lag gave before"
        if not exceeded or (self.warned_kl is not None and kl <= 2 * self.warned_kl) or not distributed.is_writer():
            return
        self.warned_kl = max(kl, self.max_kl)
        if not say:
            return
        departs = sampling_departures(self.rollout)
        handled = (f"corrected by objective.importance={self.correction.mode}" if self.correction is not None else
                   f"uncorrected: objective.name={self.uncorrected_by} takes no correction" if self.uncorrected_by else
                   f"uncorrected: {departs} samples another distribution than the policy's; set objective.importance "
                   "to correct for it (docs/off_policy.md, §2.3)" if departs else
                   "uncorrected: set objective.importance (docs/off_policy.md), or check the engine's precision and refit")
        print(f"warning: step {step}: the rollouts are off-policy: KL(engine || policy) {kl:.3g} per token "
              f"(rollout.max_mismatch_kl={self.max_kl}{explained}), log-prob gaps up to {gap:.3g} "
              f"(rollout.max_logprob_gap={self.max_gap}); {handled}", flush=True)


def sampling_departures(rollout: Any) -> str:
    """The rollout settings that make the sampler's distribution another than the policy's, as ``key=value`` words
    ("" at temperature 1 without top-k or top-p): the rollouts' log-probs are the tempered, truncated distribution's,
    the policy trained is the model's own."""
    departs = [f"rollout.temperature={rollout.temperature:g}"] if rollout.temperature != 1.0 else []
    departs += [f"rollout.top_k={rollout.top_k}"] if rollout.top_k > 0 else []
    return ", ".join(departs + ([f"rollout.top_p={rollout.top_p:g}"] if rollout.top_p < 1.0 else []))


class RolloutsAheadOnRanks(RolloutsAhead):
    """One step off on the rollout ranks (``rollout.async_steps=1``): :meth:`submit` sends the weights θ_t (if they
    moved) and step t+1's request, and returns; the rollout ranks sample it while this rank trains step t, and
    :meth:`settle` takes the rollouts. Checkpoints carry the settled experience as :class:`RolloutsAhead`'s do."""

    def __init__(self, components: Any):
        self.components, self.engine, self.pending = components, components.engine, None
        self.worker = self.engine  # whose result() settles the request, as a sampling process's does

    def submit(self, examples: list[Example], estimator: ObjectiveSpec, seed: int) -> None:
        parts = self.components
        generator = new_generator(parts.device).manual_seed(seed)
        self.engine.request(parts.prompt_ids(examples), parts.config.rollout.num_samples,
                            sample_answers=Need.SAMPLED_ANSWER_REWARD in estimator.needs, generator=generator)
        self.pending = (examples, estimator)

    def close(self) -> None:
        self.settle()
