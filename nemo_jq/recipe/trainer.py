"""The J_Q training recipe, top to bottom: set up, train, save, finish.

Per step: take a batch of prompts; make the experience the estimator needs (``make_experience``: M
rationales per prompt under the thinking budget, and answers only for estimators that need a reward);
run one forward/backward per micro-batch of whole prompt groups, handing the estimator its
``EstimatorInputs`` with the global normalisers; step the optimizer. Every ``eval.every`` steps: p@1, p@k
and m@k on the validation split, keeping the best checkpoint by m@k (k = eval.num_samples, 16 by
default); at the end, that checkpoint on test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from nemo_jq.config import Config, ConfigError
from nemo_jq.data import Example
from nemo_jq.models.common import peak_memory_gib, reset_peak_memory
from nemo_jq.objectives.schedules import AdaptiveQ
from nemo_jq.recipe.components import Components, this_ranks_part
from nemo_jq.recipe.evaluation import EvaluationStopped, Evaluator
from nemo_jq.recipe.experience import Experience, MismatchWatch, RolloutsAhead, RolloutsAheadOnRanks, make_experience
from nemo_jq.recipe.learn import estimator_gradient
from nemo_jq.recipe.state import (
    Course,
    ObjectiveInUse,
    PromptStream,
    RandomStreams,
    TrainState,
    loop_checkpoint,
    restore_loop,
)
from nemo_jq.recipe.step import StepResult, rollout_record
from nemo_jq.registry import blamed_on_plugin
from nemo_jq.rollouts.ranks import RemoteRollouts, RolloutServer
from nemo_jq.runtime import distributed, runs
from nemo_jq.runtime.checkpoint import (
    STATE,
    damaged,
    load_checkpoint,
    prune_checkpoints,
    read_state,
    save_checkpoint,
    step_dir_name,
)
from nemo_jq.runtime.monitor import RunLogger, merge_metrics, progress, read_metrics
from nemo_jq.runtime.outputs import hold_run_dir
from nemo_jq.runtime.preemption import StopSignals, current_series
from nemo_jq.runtime.runs import CHECKPOINT_DIR, PLOT_FILE, open_for_resume, run_results, write_results, write_run_files
from nemo_jq.runtime.tracking import open_trackers


def _keys(words: list[str]) -> str:
    """The keys of ``key=value`` words, joined by "and"."""
    return " and ".join(word.partition("=")[0] for word in words)


class Trainer:
    """One run in one directory. A new run refuses a directory that already holds one (see
    :func:`~nemo_jq.runtime.runs.claim_run_dir`); :meth:`resume` reopens its own with ``existing=True``."""

    def __init__(self, config: Config, *, run_dir: Path | None = None, existing: bool = False, overwrite: bool = False,
                 components: Components | None = None, rows_for: Callable[[Components], int | None] | None = None):
        """``components``: built already (the dry run builds them on its stand-in GPU); else built here.
        ``rows_for``: what ``train.micro_batch_rows=auto`` resolves to once the components exist (``nemo-jq train``
        passes ``nemo_jq.cluster.plan``'s memory model, a layer above this one); the config then holds the number."""
        self.config = config.validate()
        if config.train.micro_batch_rows == "auto" and rows_for is None:  # before anything is built or claimed
            raise ConfigError("train.micro_batch_rows=auto is resolved by `nemo-jq train` (nemo-jq plan's memory "
                              "model) or a Trainer given rows_for=; set a number of rows here, or null")
        self.run_dir = Path(run_dir or config.train.run_dir)
        if not existing:
            runs.refuse_shared_run_dir(self.run_dir, config)
        #: On a rollout rank (``rollout.placement=separate``): what it serves instead of training.
        self.server: RolloutServer | None = None
        if components is None:
            components = this_ranks_part(config, self.run_dir, existing=existing, overwrite=overwrite)
            if isinstance(components, RolloutServer):
                self.server = components
                return
        self.components = parts = components
        if existing:  # a resume trains on, and tests, the splits it started with
            runs.check_splits(self.run_dir, parts.splits, config.data)
        if config.train.micro_batch_rows == "auto":
            config.train.micro_batch_rows = rows_for(parts)
        device = parts.device
        self.policy, self.data_parallel, self.evaluator = parts.policy, parts.data_parallel, Evaluator(parts)
        self.objective, self.guard = ObjectiveInUse(parts.estimator, parts.estimator_options, parts.schedule), parts.guard
        self.random = RandomStreams(config.train.seed, self.data_parallel, device)
        applied = parts.correction if parts.estimator.corrects_off_policy else None
        self.mismatch = MismatchWatch(config.rollout, applied, uncorrected_by=None if applied or parts.correction is None
                                      else config.objective.name)
        if config.rollout.async_steps and parts.correction is not None and applied is None:
            from nemo_jq.objectives import get_objective, list_objectives

            correcting = [name for name in list_objectives() if get_objective(name).corrects_off_policy]
            distributed.on_writer(lambda: print(
                f"nemo-jq: warning: objective.name={config.objective.name} takes no off-policy correction: its rollouts, "
                f"sampled one step ahead (rollout.async_steps={config.rollout.async_steps}), train uncorrected "
                f"(objective.importance corrects {', '.join(correcting)}): set rollout.async_steps=0 for on-policy "
                "rollouts", file=sys.stderr, flush=True))
        #: The next step's rollouts, sampled while this step trains (rollout.async_steps=1); None: on-policy.
        self.ahead = None
        if config.rollout.async_steps:  # on rollout ranks of their own, or beside this process's training
            self.ahead = RolloutsAheadOnRanks(parts) if isinstance(parts.engine, RemoteRollouts) else RolloutsAhead(parts)
        self.state = TrainState(Course(config.objective.name))
        self.prompts = PromptStream(parts.splits.train, config.train.batch_size, config.train.seed, self.data_parallel.size)
        if config.train.batch_size > len(parts.splits.train) and not existing:  # its config.yaml says another batch
            distributed.on_writer(lambda: print(
                f"nemo-jq: warning: train.batch_size={config.train.batch_size} is more than the "
                f"{len(parts.splits.train)} training prompts: each step takes all of them (an epoch a step); lower "
                "train.batch_size, or raise data.train_size", file=sys.stderr, flush=True))
        self.resumed_with: list[str] = []
        #: The q of the latest step trained in this process (None before the first).
        self.last_q: float | None = None
        #: Whether an adaptive q schedule was said to read a log P̂ the estimator does not report.
        self.said_unobserved = False
        #: The step whose checkpoint this run wrote last or resumed from: saved again, it is only pointed at.
        self.saved_step: int | None = None
        #: The run's own name for itself, drawn at its start and kept in its checkpoints: what its exports are known
        #: by, wherever its folder is (another run started in the same folder is another run).
        self.run_id = uuid.uuid4().hex

    @classmethod
    def resume(cls, run_dir: Path, overrides: list[str] | tuple[str, ...] = (),
               rows_for: Callable[[Components], int | None] | None = None) -> Trainer:
        """Rebuild a run from its saved config and continue from its latest checkpoint.

        ``overrides`` may change only :data:`~nemo_jq.runtime.runs.RESUMABLE_KEYS`; the run's ``config.yaml`` records them.
        """
        config, checkpoint = open_for_resume(Path(run_dir), overrides)
        trainer = cls(config, run_dir=run_dir, existing=True, rows_for=rows_for)
        step = read_state(checkpoint)["step"]  # checked before the weights and optimizer state load
        if trainer.server is None and step > trainer.total_steps:  # it would end where it is, past them
            limits, raised = trainer._limits(step)
            raise ConfigError(f"{trainer.run_dir}: the run is at step {step}, at or past {limits}: raise "
                              f"{_keys(raised)} to go past step {step} (e.g. --resume {trainer.run_dir} {' '.join(raised)})")
        trainer.restore(checkpoint)
        trainer.resumed_with = list(overrides)
        return trainer

    @property
    def total_steps(self) -> int:
        return min(self.epochs_steps, self.config.train.max_steps or math.inf)

    @property
    def epochs_steps(self) -> int:
        """The steps of ``train.epochs`` passes over the training split."""
        train = self.config.train
        batches = distributed.batches_per_epoch(len(self.components.splits.train), train.batch_size, self.data_parallel.size)
        return train.epochs * batches

    def finished(self) -> str | None:
        """For a resumed run: why it has no step left to train, in one line with the key to raise (None: it has steps
        left, or its end's evaluation is not written for this step, which resuming then does; a rollout rank holds no
        step: the training ranks say it)."""
        if self.server is not None:
            return None
        if self.state.step < self.total_steps or not runs.results_current(self.run_dir, self.state.step):
            return None
        limits, raised = self._limits(self.state.step)
        return (f"{self.run_dir}: the run finished {limits} and has nothing left to train; raise {_keys(raised)} (e.g. "
                f"--resume {self.run_dir} {' '.join(raised)})")

    def _limits(self, step: int) -> tuple[str, list[str]]:
        """The limits ``step`` has reached (``train.max_steps``, the epochs' steps, or both), in words; and the
        ``key=value`` words that raise them past it."""
        train, epochs_steps = self.config.train, self.epochs_steps
        limits, raised = [], []
        if train.max_steps is not None and train.max_steps <= step:
            limits.append(f"its train.max_steps={train.max_steps} steps")
            raised.append(f"train.max_steps={min(epochs_steps, 2 * step) if epochs_steps > step else 2 * step}")
        if epochs_steps <= step:
            limits.append(f"its {train.epochs} epoch{'s' * (train.epochs != 1)} ({epochs_steps} steps)")
            raised.append(f"train.epochs={2 * math.ceil(step / (epochs_steps // train.epochs))}")
        return " and ".join(limits), raised

    # ----------------------------------------------------------------- train
    def _label(self, series: Any) -> str:
        """How progress names the run: its folder, below an experiment's (``GRPO/seed0``: each method's runs are
        ``seed0``, ``seed1``, ... alike) where it is one of a series of runs in this process."""
        out_dir, run_dir = getattr(series, "out_dir", None), Path(self.run_dir).resolve()
        if out_dir is not None and Path(out_dir).resolve() in run_dir.parents:
            return run_dir.relative_to(Path(out_dir).resolve()).as_posix()
        return self.run_dir.name

    def fit(self, max_steps: int | None = None, stop: StopSignals | None = None,
            until: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """Train until the configured end (or ``max_steps``, or the first step whose record ``until`` accepts, or
        SIGTERM/SIGUSR1/SIGINT), then evaluate. On a signal the current step finishes, a checkpoint is written, and fit
        returns ``{"preempted": signum}`` (inside a :class:`~nemo_jq.runtime.preemption.Series` it raises ``Stopped``: no further
        run of the command starts). ``stop``: signals already being caught (the CLI catches them from its start; a
        series' own), else caught while this runs."""
        series = current_series() if stop is None else None
        stop = series.stop if series is not None else stop
        if self.server is not None:  # a rollout rank samples until the training ranks are done
            served = self.server.serve()  # a stop signal this rank caught ends it as it ends them (a requeue's exit)
            stopped = series is None and stop is not None and stop.requested()
            return {**served, "preempted": stop.received, "step": None} if stopped else served
        end = min(self.total_steps, max_steps or self.total_steps)
        trackers: list[Any] = []

        def start() -> None:  # the trackers first: one that does not start (a wrong URI, no login) leaves no run behind
            hold_run_dir(self.run_dir)
            trackers.extend(open_trackers(self.run_dir, self.config))
            try:
                write_run_files(self.run_dir, self.config, self.components.tokenizer, self.components.splits)
            except BaseException:  # a full disk, a signal: the trackers' runs end, not left running
                for tracker in trackers:
                    tracker.close("failed")
                raise

        distributed.on_writer(start)  # if it fails, every rank raises
        writes = distributed.is_writer()
        logger = RunLogger(self.run_dir, tensorboard=self.config.train.tensorboard, resume_step=self.state.step,
                           writes=writes, trackers=trackers)
        if self.resumed_with:
            logger.log({"kind": "resume", "step": self.state.step, "overrides": self.resumed_with})
        bar = progress(self.total_steps, f"train {self._label(series)}", unit="step", initial=self.state.step,
                       shows=distributed.is_writer())
        outcome = "failed"  # the trackers' runs end as the run does: an error unless it finishes or a signal stops it
        with contextlib.nullcontext(stop) if stop is not None else StopSignals() as stop:
            try:
                while self.state.step < end and not stop.requested():
                    result = self.train_step(self.prompts.next(self.state))
                    record = result.record
                    self.state.step += 1
                    logger.log({"kind": "train", "step": self.state.step, **record})
                    bar.update(1)
                    bar.set_postfix({k: f"{record[k]:.4g}" for k in ("loss", "train_reward", "q") if record.get(k) is not None})
                    self._after_step(result, logger, end)
                    if until is not None and until(record):
                        break
                if stop.requested():
                    self.save()
                    outcome = "stopped"
                    if series is not None:
                        raise series.stopped(self.run_dir, self.state.step)
                    return {"preempted": stop.received, "step": self.state.step}
                results = self._finish(logger, stop) if self.state.step >= self.total_steps else {"step": self.state.step}
                if results is None:  # stopped in the end's evaluation: its last checkpoint stands, a resume evaluates
                    outcome = "stopped"
                    if series is not None:
                        raise series.stopped(self.run_dir, self.state.step)
                    return {"preempted": stop.received, "step": self.state.step}
                outcome = "finished"
                return results
            finally:
                bar.close()
                logger.close(outcome)
                if self.ahead is not None:
                    self.ahead.close()
                if isinstance(self.components.engine, RemoteRollouts):
                    self.components.engine.close()

    def train_step(self, batch_examples: list[Example]) -> StepResult:
        """One optimizer step on a global batch; this replica samples and trains on its share of the prompts."""
        started, step = time.perf_counter(), self.state.step + 1
        reset_peak_memory(self.components.device)
        q = self.last_q = self.objective.q(self.state.step, self.state.course)
        experience, lag = self._experience(batch_examples)
        micro_metrics = estimator_gradient(self.components, self.objective.estimator, self.objective.options, experience,
                                           q=q, batch_prompts=len(batch_examples), generator=self.random.estimator)
        merged = merge_metrics(self.data_parallel.gather(micro_metrics))
        self._stop_if_diverged(step, "the loss", merged.get("loss"),  # before the weights take it
                               self.objective.estimator.name if self.state.step == 0 else None)
        record = {"epoch": self.state.epoch, "q": q, **merged, **self.policy.optimizer_step()}
        self._stop_if_diverged(step, "the gradient norm", record.get("grad_norm"))
        distributed.everywhere(lambda: self._stop_if_diverged(step, *runs.nonfinite_weights(self.policy)))
        record["train_reward"] = record.get("reward", record.get("p_hat"))
        record.update(rollout_record(self.components, experience, lag if self.ahead is not None else None))
        record["step_time"] = time.perf_counter() - started
        peak = peak_memory_gib(self.components.device)
        if peak is not None:  # the fullest rank's, over the step's rollouts and training
            record["gpu_peak_gib"] = distributed.largest(peak)
        result = StepResult.from_record(step, record)
        schedule = self.objective.schedule
        if schedule is not None and result.log_p_hat is not None:
            with blamed_on_plugin(schedule, f"objective.q_schedule {type(schedule).__name__}'s observe"):
                schedule.observe(result.log_p_hat)
        elif isinstance(schedule, AdaptiveQ) and not self.said_unobserved:  # once: q would stay at q_max unsaid
            self.said_unobserved = True
            distributed.on_writer(lambda: print(
                f"nemo-jq: warning: objective.q_schedule adaptive reads log P̂, which objective.name="
                f"{self.config.objective.name} does not report (no log_p_hat metric): q stays at its q_max",
                file=sys.stderr, flush=True))
        self.mismatch(result)
        return result

    def _stop_if_diverged(self, step: int, what: str, value: Any, first_loss_of: str | None = None) -> None:
        """A NaN or inf ``value`` (the loss, the gradient norm, a weight) stops the run before anything saves it
        (``first_loss_of``: the estimator whose loss it is, before any update)."""
        if value is not None and not math.isfinite(value):
            raise runs.diverged(self.run_dir, step, what, value, self.config.optim.lr, first_loss_of)

    def _experience(self, batch_examples: list[Example]) -> tuple[Experience, int]:
        """This replica's experience for the step, and how many steps older than the weights its sampler's were (one
        step off: :meth:`~nemo_jq.recipe.experience.RolloutsAhead.step_experience`)."""
        shard, estimator = self.data_parallel.shard(batch_examples), self.objective.estimator
        if self.ahead is None:
            return make_experience(self.components, shard, estimator, self.random.rollout), 0
        upcoming = self.data_parallel.shard(self.prompts.upcoming(self.state)) if self.state.step + 1 < self.total_steps else None
        return self.ahead.step_experience(shard, upcoming, estimator, self.random.rollout)

    def _after_step(self, result: StepResult, logger: RunLogger, end: int) -> None:
        step = self.state.step
        if self.guard is not None:
            self._watch(self.guard.train(result.log_p_hat), logger)
        if step % self.config.eval.every == 0 or step == self.total_steps:
            self._validate(logger)
        if step % self.config.train.save_every == 0 or step == end:
            self.save()

    # ----------------------------------------------------------------- evaluate, and the collapse guard
    def _validate(self, logger: RunLogger) -> None:
        self._settle_rollouts()
        scores = self.evaluator.evaluate("validation", seed_offset=self.state.step, shown=self.config.eval.samples_shown)
        logger.log({"kind": "validation", "step": self.state.step, **scores})
        logger.log_samples(self.state.step, self.evaluator.shown)
        value = scores[f"m@{self.config.eval.num_samples}"]  # the paper selects by m@16
        if runs.beats_best(value, self.state.best_metric):
            self.state.best_metric, self.state.best_step = value, self.state.step
            self.save()
        if self.guard is not None:
            self._watch(self.guard.validation(value, len(self.components.splits.validation)), logger)

    def _watch(self, reason: str | None, logger: RunLogger) -> None:
        """On the guard's signal: restore the best checkpoint (weights and optimizer), change course by
        ``guard.action``, and log a ``guard`` record; at most ``guard.max_triggers`` times."""
        course, guard = self.state.course, self.config.guard
        if reason is None or course.guard_triggers >= guard.max_triggers:
            return
        best = self.state.best_step
        if self.ahead is not None:  # sampled from the weights being abandoned (and for the estimator, maybe)
            self.ahead.take()
        if best is not None:
            self.policy.load(self.run_dir / CHECKPOINT_DIR / step_dir_name(best), with_optimizer=True)
        course.change(guard)
        course.apply(self.objective, self.policy, self.config)
        self.guard.restart()
        logger.log({"kind": "guard", "step": self.state.step, "reason": reason, "action": guard.action,
                    "restored_step": best, **dataclasses.asdict(course)})

    def _finish(self, logger: RunLogger, stop: StopSignals) -> dict[str, Any] | None:
        """Evaluate the best validation checkpoint on the test split and write results.json; None, writing nothing,
        after a stop signal (checked between its evaluations on every rank; in one process, before each call)."""
        best = self.state.best_step
        self._settle_rollouts()
        alone = (lambda: stop.received is not None) if distributed.world_size() == 1 else None
        try:
            final_memorisation = self.evaluator.memorisation(alone)
            if stop.requested():
                return None
            if best is not None and best != self.state.step:
                self.policy.load(self.run_dir / CHECKPOINT_DIR / step_dir_name(best), with_optimizer=False)
            scores = self.evaluator.evaluate("test", stopped=alone)
            tested = self.evaluator.memorisation(alone) if final_memorisation is not None else None
        except EvaluationStopped:
            return None
        if stop.requested():
            return None
        memorisation = ({"final": final_memorisation["memorised"], "tested": tested["memorised"],
                         "chance": {"final": final_memorisation["chance"], "tested": tested["chance"]}}
                        if final_memorisation is not None else None)
        logger.log({"kind": "test", "step": self.state.step, "best_step": best, **scores,
                    **({"memorisation": memorisation["tested"]} if memorisation else {})})
        if self.last_q is None:  # resumed only to evaluate the end again: the q its last step trained with, as logged
            self.last_q = next((r.get("q") for r in reversed(read_metrics(self.run_dir)) if r["kind"] == "train"), None)
        results = run_results(self.config.objective, self.objective.estimator.uses_q, self.last_q, best, self.state.best_metric,
                              scores, memorisation, step=self.state.step, key=f"m@{self.config.eval.num_samples}")
        distributed.on_writer(lambda: write_results(self.run_dir, results))
        logger.attach(self.run_dir / PLOT_FILE)
        return results

    # ----------------------------------------------------------------- checkpoints
    def _settle_rollouts(self) -> None:
        """Wait for the rollouts sampled ahead, before anything else uses the engine they are sampled with."""
        if self.ahead is not None:
            self.ahead.settle()

    def save(self) -> Path:
        """A checkpoint of the run; one step off, it carries the next step's experience (waited for)."""
        state, rng = loop_checkpoint(self.state, self.objective, self.guard, self.random, self.ahead)
        state["config"] = runs.config_record(self.config)  # what a resume or an evaluation holds config.yaml to
        state["replicas"] = self.data_parallel.size  # what its epochs' steps are counted over (a sweep's status)
        state["run_id"] = self.run_id
        root = self.run_dir / CHECKPOINT_DIR
        distributed.everywhere(lambda: self._stop_if_diverged(self.state.step, *runs.nonfinite_weights(self.policy)))
        path = save_checkpoint(root, self.state.step, self.policy, state, rng, written=self.saved_step == self.state.step)
        self.saved_step = self.state.step
        protect = {path.name} | ({step_dir_name(self.state.best_step)} if self.state.best_step is not None else set())
        distributed.on_writer(lambda: prune_checkpoints(root, self.config.train.keep_checkpoints, protect))
        return path

    def restore(self, checkpoint: Path) -> None:
        if self.server is not None:  # a rollout rank's weights arrive with the first sync
            return
        state, rng = load_checkpoint(checkpoint, self.policy)
        self.run_id = state.get("run_id") or self.run_id  # one saved before runs had ids: its next checkpoint has one
        try:
            self.state = restore_loop(state, rng, self.state.course, self.objective, self.guard, self.random, self.ahead)
        except (KeyError, TypeError, AttributeError, ValueError) as err:  # edited, or another version's: a traceback
            raise damaged(checkpoint / STATE, f"its state.json or rng.pt does not restore the loop: {type(err).__name__}: "
                                              f"{err}") from None
        trains = self.state.course.trains(self.config)
        if self.state.course.objective != trains:  # config.yaml edited: results.json would name what it did not train
            raise ConfigError(f"{self.run_dir / runs.CONFIG_FILE} says objective.name={self.config.objective.name}, but "
                              f"its checkpoint {checkpoint} trains {self.state.course.objective}; a run's objective is "
                              f"fixed: put objective.name={self.state.course.objective} back, or start a new run "
                              "(another train.run_dir)")
        self.state.course.apply(self.objective, self.policy, self.config)
        self.saved_step = self.state.step
        self.mismatch.recall(StepResult.from_record(record["step"], record) for record in read_metrics(self.run_dir)
                             if record["kind"] == "train" and record["step"] <= self.state.step)
