"""What a run's checkpoint remembers of the loop: where it is (and the prompt stream it is in), how the guard changed
its course (and the objective it trains with now), its random streams."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from nemo_jq.data import Example
from nemo_jq.models.common import new_generator
from nemo_jq.objectives import ObjectiveSpec, QSchedule, build_schedule, get_objective
from nemo_jq.registry import blamed_on_plugin
from nemo_jq.runtime.distributed import DataParallel
from nemo_jq.runtime.runs import best_step_of


@dataclass
class Course:
    """How the collapse guard has changed the run so far (kept over resumes)."""

    objective: str
    q_scale: float = 1.0
    lr_scale: float = 1.0
    guard_triggers: int = 0

    def change(self, guard: Any) -> None:
        """The guard's ``action`` (config.guard): switch the estimator, or lower q or the learning rate by its factor."""
        self.guard_triggers += 1
        if guard.action == "switch_estimator":
            self.objective = guard.estimator
        elif guard.action == "lower_q":
            self.q_scale *= guard.factor
        else:
            self.lr_scale *= guard.factor

    def trains(self, config: Any) -> str:
        """The estimator a run of ``config`` trains on this course: its ``objective.name``, or the guard's once the
        guard switched to it (a checkpoint whose course names another was not trained by this config)."""
        switched = self.guard_triggers and config.guard.action == "switch_estimator"
        return config.guard.estimator if switched else config.objective.name

    def apply(self, objective: ObjectiveInUse, policy: Any, config: Any) -> None:
        """Make the run follow this course (the estimator, q's scale, the learning rate's), also after a resume."""
        objective.follow(self, config.objective.q)
        policy.set_learning_rate(config.optim.lr * self.lr_scale)


@dataclass
class ObjectiveInUse:
    """The estimator the run trains with now, its options and its q schedule: what the guard's course changes
    (``switch_estimator`` swaps the estimator; ``lower_q`` scales q)."""

    estimator: ObjectiveSpec
    options: Any
    #: None for estimators without a q.
    schedule: QSchedule | None

    def q(self, step: int, course: Course) -> float | None:
        """The step's q: the schedule's, scaled by the course's ``q_scale``; None for estimators without one."""
        if self.schedule is None:
            return None
        with blamed_on_plugin(self.schedule, f"objective.q_schedule {type(self.schedule).__name__}"):
            q = self.schedule(step)
        if not isinstance(q, (int, float)) or isinstance(q, bool) or not 0.0 <= q <= 1.0:  # a registered one's, too
            raise ValueError(f"objective.q_schedule {type(self.schedule).__name__} gave q={q!r} at step {step}: a q "
                             "schedule gives a number in [0, 1]")
        return q * course.q_scale

    def follow(self, course: Course, q: Any) -> None:
        """Switch to the course's estimator, if it is another (with its own options; a q schedule built from the
        config's ``objective.q`` if the run had none)."""
        if course.objective != self.estimator.name:
            self.estimator = get_objective(course.objective)
            self.options = self.estimator.options()  # the earlier estimator's options need not be this one's
            if self.schedule is None and self.estimator.uses_q:
                self.schedule = build_schedule(q)


@dataclass
class TrainState:
    """Where the run is: what a checkpoint's ``state.json`` holds beside the schedule's and the guard's state."""

    course: Course
    step: int = 0
    epoch: int = 0
    #: The next prompt's index in this epoch's permutation of the training split.
    position: int = 0
    best_metric: float | None = None
    best_step: int | None = None

    @classmethod
    def from_json(cls, saved: dict[str, Any], course: Course) -> TrainState:
        """A saved state (``course``: the run's own, if the checkpoint predates the guard)."""
        saved = dict(saved)
        missing = [key for key in ("step", "epoch", "position") if key not in saved]
        if missing:  # an edited state resumed from epoch 0 or the epoch's first prompt without a word
            raise KeyError(f"no {', '.join(missing)}")
        saved["course"] = Course(**saved["course"]) if "course" in saved else course
        return cls(**saved)


class PromptStream:
    """The training prompts, a batch at a time: each epoch a permutation fixed by the seed and the epoch, so that a
    run resumed at a :class:`TrainState`'s epoch and position takes the batches an uninterrupted one would. An epoch's
    short last batch is cut to a multiple of the ``replicas`` (data-parallel), each of which takes an equal share: a
    replica with fewer prompts would make fewer forward passes than the others, and the collectives of every pass
    (expert parallelism's, a lockstep engine's) would wait for it forever; one with none left is skipped."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, replicas: int = 1):
        self.examples, self.batch_size, self.seed, self.replicas = examples, batch_size, seed, replicas

    def next(self, state: TrainState) -> list[Example]:
        """The next batch of ``state``'s epoch (the next epoch's first, at its end); ``state`` moves past it."""
        batch, state.epoch, state.position = self._batch_at(state.epoch, state.position)
        return batch

    def upcoming(self, state: TrainState) -> list[Example]:
        """The batch :meth:`next` will give (one step off, its rollouts are requested a step early)."""
        return self._batch_at(state.epoch, state.position)[0]

    def _batch_at(self, epoch: int, position: int) -> tuple[list[Example], int, int]:
        if position >= len(self.examples):
            epoch, position = epoch + 1, 0
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        taken = order[position : position + self.batch_size]
        taken = taken[: len(taken) - len(taken) % self.replicas]
        if not len(taken):
            return self._batch_at(epoch + 1, 0)
        return [self.examples[i] for i in taken], epoch, position + self.batch_size


class RandomStreams:
    """The run's randomness: Python's, numpy's and torch's global state, and the two streams the loop draws
    from, each replica its own: the rollouts' samples and the estimator's (PAFT's resampling)."""

    def __init__(self, seed: int, data_parallel: DataParallel, device: torch.device):
        self.seed, self.data_parallel = seed, data_parallel
        self.rollout = new_generator(device).manual_seed(data_parallel.replica_seed(seed))
        self.estimator = new_generator(device).manual_seed(data_parallel.replica_seed(seed + 1))

    def state_dict(self) -> dict[str, Any]:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "rollout": self.rollout.get_state(), "estimator": self.estimator.get_state(),
                "replica": self.data_parallel.rank}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Restore ``state`` (saved at ``step``); a replica the run did not have then starts streams of its own."""
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state.get("replica", 0) == self.data_parallel.rank:
            self.rollout.set_state(state["rollout"])
            self.estimator.set_state(state["estimator"])
        else:  # saved with fewer replicas: fixed by the seed and the step
            seed = self.seed + 7919 * step
            self.rollout.manual_seed(self.data_parallel.replica_seed(seed))
            self.estimator.manual_seed(self.data_parallel.replica_seed(seed + 1))


def loop_checkpoint(state: TrainState, objective: ObjectiveInUse, guard: Any, random: RandomStreams,
                     ahead: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a checkpoint saves of the loop beside the policy: ``state.json`` (where the run is, its course, the q
    schedule's and the guard's state) and the random streams (with the rollouts sampled ahead, one step off)."""
    schedule = objective.schedule
    saved = {**asdict(state), "schedule": schedule.state_dict() if schedule is not None else None,
             "guard": guard.state_dict() if guard is not None else None}
    return saved, {**random.state_dict(), **({"ahead": ahead.state_dict()} if ahead is not None else {})}


def restore_loop(saved: dict[str, Any], rng: dict[str, Any], course: Course, objective: ObjectiveInUse,
                          guard: Any, random: RandomStreams, ahead: Any) -> TrainState:
    """Restore what :func:`loop_checkpoint` saved into the loop's parts; the run's :class:`TrainState`."""
    saved = dict(saved)
    schedule_state, guard_state = saved.pop("schedule"), saved.pop("guard", None)
    saved.pop("config", None)  # what the run trained with: runs.check_trained_with reads it
    saved.pop("replicas", None)  # what its steps were counted over: a sweep's status reads it
    saved.pop("run_id", None)  # the trainer's
    state = TrainState.from_json(saved, course)
    if best_step_of(saved) is None:  # saved before the rule: a best validation of 0 is no best
        state.best_step = state.best_metric = None
    if objective.schedule is not None and schedule_state is not None:
        objective.schedule.load_state_dict(schedule_state)
    if guard is not None and guard_state is not None:
        guard.load_state_dict(guard_state)
    random.load_state_dict(rng, state.step)
    if ahead is not None:
        ahead.load_state_dict(rng.get("ahead", {}))
    return state

