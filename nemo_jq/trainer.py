"""The J_Q training recipe: rollouts, one estimator from the registry, evaluation, checkpoints.

Per step: take a batch of prompts; sample M rationales each under the thinking budget (and
answers, only for estimators that need a reward); splice token-level sequences; run one
forward/backward per micro-batch of whole prompt groups, feeding the estimator exactly the
log-prob sums it asks for; step AdamW. Every ``eval.every`` steps: p@1/p@k/m@k on the
validation split, keeping the best checkpoint by m@k (k = eval.num_samples, 16 by default);
at the end, that checkpoint on test.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_jq import distributed
from nemo_jq.chat import ChatFormat, build_tokenizer
from nemo_jq.checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint, step_dir_name
from nemo_jq.config import Config, load_config, save_config
from nemo_jq.data import Example, Splits, SyntheticArithmetic, Task
from nemo_jq.data.noise import corrupt_labels, noisy_examples
from nemo_jq.data.prepare import load_prepared, make_task, prepare
from nemo_jq.evaluation import memorised, sample_outputs, score_outputs
from nemo_jq.guard import CollapseGuard
from nemo_jq.models.backends import BackendRequest, build_backend
from nemo_jq.models.hf import load_causal_lm, resolve_device, resolve_pretrained, tiny_qwen3
from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.monitor import METRICS_FILE, RunLogger, plot_runs, read_metrics
from nemo_jq.outputs import claim_dir
from nemo_jq.objectives import Need, ObjectiveSpec, build_schedule, get_objective
from nemo_jq.sequences import given_target_batch, reference_answer_batch, sampled_answer_batch

CONFIG_FILE, TOKENIZER_DIR, CHECKPOINT_DIR, RESULTS_FILE = "config.yaml", "tokenizer", "checkpoints", "results.json"
#: What a run writes into its directory; any of them there means the directory holds a run.
RUN_FILES = (CONFIG_FILE, TOKENIZER_DIR, CHECKPOINT_DIR, RESULTS_FILE, METRICS_FILE, "tensorboard", "training.png")
#: Keys a resumed run may change: how long it goes on, how it is evaluated and saved, and how the megatron backend
#: lays the model out over the processes (its checkpoints load at any TP, PP, CP and DP size), never what it trains.
RESUMABLE_KEYS = ("train.epochs", "train.max_steps", "train.save_every", "train.keep_checkpoints", "train.tensorboard",
                  "eval.every", "eval.num_samples", "eval.batch_size", "model.tensor_parallel", "model.pipeline_parallel",
                  "model.context_parallel", "model.sequence_parallel", "model.recompute_activations",
                  "model.distributed_optimizer")


def claim_run_dir(run_dir: Path, *, overwrite: bool = False) -> Path | None:
    """Make sure a new run never writes over an earlier one (:func:`claim_dir` with the run's files)."""
    return claim_dir(run_dir, RUN_FILES, overwrite=overwrite, what="a run",
                     advice=f"continue it with `nemo-jq train --resume {run_dir}`, write the new run elsewhere "
                            "(train.run_dir=...), or pass --overwrite to move the old run aside first")


def local_model_dir(path: str | None) -> Path | None:
    """``model.path`` as a local HF folder, or None (no path, or a hub name)."""
    if not path:
        return None
    resolved = Path(resolve_pretrained(path))
    return resolved if resolved.is_dir() else None


def build_task(config: Config) -> tuple[Task, Splits]:
    """The task and its splits (the synthetic sums, a prepared folder, or a dataset prepared in memory), with
    ``data.label_noise`` of the training labels corrupted."""
    task, splits = _clean_task(config)
    if config.data.label_noise:
        splits = dataclasses.replace(splits, train=corrupt_labels(splits.train, config.data.label_noise, config.data.seed, task))
    return task, splits


def _clean_task(config: Config) -> tuple[Task, Splits]:
    data = config.data
    sizes = (data.train_size, data.validation_size, data.test_size)
    if data.name == "synthetic":
        task = SyntheticArithmetic(num_operands=data.num_operands)
        return task, task.splits(*sizes, data.seed)
    task = make_task(data.name, template=data.template, system=data.system_prompt)
    if data.prepared_dir:
        return task, load_prepared(Path(data.prepared_dir))
    splits, _ = prepare(task, data.source, sizes, data.seed, hub_config=data.hub_config, on_bad_row=data.on_bad_row)
    return task, splits


def estimator_inputs(
    spec: ObjectiveSpec, logprobs: torch.Tensor, batch: TokenBatch, num_prompts: int, rewards: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The estimator's tensor arguments, by parameter name, from one micro-batch's token log-probs.

    Rows are prompt-major (``b * M + m``), so ``view(num_prompts, M)`` recovers the groups.
    """
    params = inspect.signature(spec.fn).parameters
    per_token = "logprob" in params  # GRPO's token-level [B, M, T] form
    candidates = {
        "rationale_logprob": lambda: (logprobs * batch.rationale_mask).sum(-1).view(num_prompts, -1),
        "answer_logprob": lambda: (logprobs * batch.answer_mask).sum(-1).view(num_prompts, -1),
        "sequence_logprob": lambda: (logprobs * batch.target_mask).sum(-1).view(num_prompts, -1),
        "logprob": lambda: logprobs.view(num_prompts, -1, logprobs.shape[-1]),
        "token_logprob": lambda: logprobs,
        "mask": lambda: batch.target_mask.view(num_prompts, -1, logprobs.shape[-1]) if per_token else batch.target_mask,
        "rewards": lambda: rewards,
    }
    return {name: make() for name, make in candidates.items() if name in params}


class Trainer:
    """One run in one directory. A new run refuses a directory that already holds one (see
    :func:`claim_run_dir`); :meth:`resume` and inference reopen their own with ``existing=True``."""

    def __init__(self, config: Config, *, run_dir: Path | None = None, existing: bool = False, overwrite: bool = False):
        self.config = config.validate()
        self.run_dir = Path(run_dir or config.train.run_dir)
        self.device = distributed.init_from_env(resolve_device(config.train.device))
        distributed.on_writer(lambda: self._claim_run_dir(existing, overwrite))
        seed = config.train.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

        self.task, self.splits = build_task(config)
        self.tokenizer = self._tokenizer(existing)
        self.chat = ChatFormat(self.tokenizer)
        self.policy, self.engine = build_backend(config.model.backend, BackendRequest(
            load_model=self._model, model_dir=local_model_dir(config.model.path), config=config, chat=self.chat,
            device=self.device))
        self.data_parallel = self.policy.data_parallel
        if config.train.batch_size % self.data_parallel.size:
            raise ValueError(f"train.batch_size={config.train.batch_size} does not split over {self.data_parallel.size} "
                             "data-parallel replicas: make it a multiple of world size / (tensor_parallel x pipeline_parallel x "
                             "context_parallel)")
        self.spec = get_objective(config.objective.name)
        self.objective_options = dict(config.objective.options)
        objective = config.objective
        self.schedule = build_schedule(objective.q_schedule or objective.q) if self.spec.uses_q else None
        guard = config.guard
        self.guard = CollapseGuard(min_fraction_of_best=guard.min_fraction_of_best, patience=guard.patience,
                                   logp_drop=guard.logp_drop, window=guard.window,
                                   min_drop_se=guard.min_drop_se) if guard.enabled else None
        self.rollout_generator = torch.Generator(device=self.device).manual_seed(self._replica_seed(seed))
        self.estimator_generator = torch.Generator(device=self.device).manual_seed(self._replica_seed(seed + 1))
        self.state: dict[str, Any] = {"step": 0, "epoch": 0, "position": 0, "best_metric": None, "best_step": None,
                                      "course": {"objective": config.objective.name, "q_scale": 1.0, "lr_scale": 1.0,
                                                 "guard_triggers": 0}}
        self._stop_signal: int | None = None
        self.resumed_with: list[str] = []

    # ----------------------------------------------------------------- construction
    def _claim_run_dir(self, existing: bool, overwrite: bool) -> None:
        if not existing:
            claim_run_dir(self.run_dir, overwrite=overwrite)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _replica_seed(self, seed: int) -> int:
        """Data-parallel replicas sample their own prompts with their own streams; replica 0 keeps ``seed``."""
        return seed + 1_000_003 * self.data_parallel.rank

    def _tokenizer(self, existing: bool):
        """The run's own saved tokenizer when reopening it; else a new one (saved when training starts)."""
        saved = self.run_dir / TOKENIZER_DIR
        if existing and saved.exists():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(saved)
        if self.config.model.path:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(resolve_pretrained(self.config.model.path))
        return build_tokenizer(self.task.corpus(self.splits.train), self.config.model.tiny.tokenizer_vocab_size)

    def _model(self):
        if self.config.model.path:
            return load_causal_lm(self.config.model.path)
        tiny = self.config.model.tiny
        return tiny_qwen3(
            len(self.tokenizer), hidden_size=tiny.hidden_size, num_layers=tiny.num_layers, num_heads=tiny.num_heads,
            num_kv_heads=tiny.num_kv_heads, intermediate_size=tiny.intermediate_size,
            max_position_embeddings=tiny.max_position_embeddings, seed=self.config.train.seed,
        )

    @classmethod
    def resume(cls, run_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> "Trainer":
        """Rebuild a run from its saved config and continue from its latest checkpoint.

        ``overrides`` may change only :data:`RESUMABLE_KEYS`; the run's ``config.yaml`` records them.
        """
        run_dir = Path(run_dir)
        if not (run_dir / CONFIG_FILE).exists():
            raise FileNotFoundError(f"{run_dir} is not a run directory: no {CONFIG_FILE}")
        refused = [item for item in overrides if item.partition("=")[0] not in RESUMABLE_KEYS]
        if refused:
            raise ValueError(
                f"a resumed run keeps what it trains; {', '.join(refused)} cannot change mid-run. "
                f"Overrides allowed with --resume: {', '.join(RESUMABLE_KEYS)}"
            )
        checkpoint = latest_checkpoint(run_dir / CHECKPOINT_DIR)
        if checkpoint is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from: start it again with --overwrite")
        trainer = cls(load_config(run_dir / CONFIG_FILE, list(overrides)), run_dir=run_dir, existing=True)
        trainer.restore(checkpoint)
        trainer.resumed_with = list(overrides)
        return trainer

    # ----------------------------------------------------------------- the loop
    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.splits.train) / self.config.train.batch_size)

    @property
    def total_steps(self) -> int:
        total = self.config.train.epochs * self.steps_per_epoch
        return min(total, self.config.train.max_steps) if self.config.train.max_steps else total

    def fit(self, max_steps: int | None = None) -> dict[str, Any]:
        """Train until the configured end (or ``max_steps``, or SIGTERM/SIGUSR1/SIGINT), then evaluate.

        On a signal the current step finishes, a checkpoint is written, and fit returns with
        ``{"preempted": signum}``; ``nemo-jq train`` then exits 0 for the scheduler to requeue.
        A second Ctrl-C stops at once (the last checkpoint stays loadable).
        """
        from tqdm import tqdm

        end = min(self.total_steps, max_steps or self.total_steps)
        distributed.on_writer(self._write_run_files)
        logger = RunLogger(self.run_dir, tensorboard=self.config.train.tensorboard, resume_step=self.state["step"],
                           writes=distributed.is_writer())
        if self.resumed_with:
            logger.log({"kind": "resume", "step": self.state["step"], "overrides": self.resumed_with})
        bar = tqdm(total=self.total_steps, initial=self.state["step"], desc=f"train {self.run_dir.name}",
                   dynamic_ncols=True, disable=not distributed.is_writer())
        previous = self._install_signal_handlers()
        try:
            while self.state["step"] < end and not self._stopping():
                record = self.train_step(self._next_batch())
                self.state["step"] += 1
                logger.log({"kind": "train", "step": self.state["step"], **record})
                bar.update(1)
                shown = {k: record.get(k) for k in ("loss", "train_reward", "q")}
                bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items() if v is not None})
                step = self.state["step"]
                if self.guard is not None:
                    self._watch(self.guard.train(record.get("log_p_hat")), logger)
                if step % self.config.eval.every == 0 or step == self.total_steps:
                    self._validate(logger)
                if step % self.config.train.save_every == 0 or step == end:
                    self.save()
            if self._stopping():
                self.save()
                return {"preempted": self._stop_signal, "step": self.state["step"]}
            if self.state["step"] >= self.total_steps:
                return self._finish(logger)
            return {"step": self.state["step"]}
        finally:
            bar.close()
            logger.close()
            self._restore_signal_handlers(previous)

    def _write_run_files(self) -> None:
        save_config(self.config, self.run_dir / CONFIG_FILE)
        if not (self.run_dir / TOKENIZER_DIR).exists():
            self.tokenizer.save_pretrained(self.run_dir / TOKENIZER_DIR)

    def _stopping(self) -> bool:
        """Whether a stop signal reached any rank; all ranks then agree on the largest signal number."""
        self._stop_signal = distributed.largest(self._stop_signal or 0) or None
        return self._stop_signal is not None

    def _next_batch(self) -> list[Example]:
        """The next prompts of the current epoch's permutation (deterministic in seed and epoch)."""
        train = self.splits.train
        size = self.config.train.batch_size
        if self.state["position"] >= len(train):
            self.state["epoch"] += 1
            self.state["position"] = 0
        order = np.random.default_rng([self.config.train.seed, self.state["epoch"]]).permutation(len(train))
        start = self.state["position"]
        self.state["position"] = start + size
        return [train[i] for i in order[start : start + size]]

    def prompt_ids(self, examples: list[Example]) -> list[list[int]]:
        return [self.chat.prompt_ids(self.task.messages(e, self.config.data.format)) for e in examples]

    def train_step(self, batch_examples: list[Example]) -> dict[str, Any]:
        """One optimizer step on a global batch; this replica samples and trains on its share of the prompts."""
        started = time.perf_counter()
        q = self.schedule(self.state["step"]) * self.state["course"]["q_scale"] if self.schedule is not None else None
        examples = self.data_parallel.shard(batch_examples)
        prompts = self.prompt_ids(examples)
        group, rewards = 1, None
        rollout_tokens_before = self.engine.tokens_generated

        if Need.GIVEN_TARGET in self.spec.needs:
            batch = given_target_batch(
                prompts,
                [self.chat.rationale_ids(e.rationale or "") for e in examples],
                [self.chat.answer_ids(e.answer) for e in examples],
                self.chat.think_end_id,
                self.chat.pad_id,
            )
        else:
            group = self.config.rollout.num_samples
            sample_answers = Need.SAMPLED_ANSWER_REWARD in self.spec.needs
            rollouts = self.engine.generate(prompts, group, sample_answers=sample_answers, generator=self.rollout_generator)
            if sample_answers:
                batch = sampled_answer_batch(rollouts, self.chat.think_end_id, self.chat.pad_id)
                rewards = torch.tensor(
                    [[self.task.reward(self.chat.decode_answer(r.answer_ids), e) for r in rs] for rs, e in zip(rollouts, examples)],
                    device=self.device,
                )
            else:
                batch = reference_answer_batch(
                    rollouts, [self.chat.answer_ids(e.answer) for e in examples], self.chat.think_end_id, self.chat.pad_id
                )
        rollout_seconds = time.perf_counter() - started
        rollout_tokens = self.engine.tokens_generated - rollout_tokens_before

        micro_metrics = self._forward_backward(batch, group, len(batch_examples), rewards, q)
        record = {"epoch": self.state["epoch"], "q": q, **_merge_metrics(self.data_parallel.gather(micro_metrics)),
                  **self.policy.optimizer_step()}
        if self.schedule is not None and "log_p_hat" in record:
            self.schedule.observe(record["log_p_hat"])
        record["train_reward"] = record.get("reward", record.get("p_hat"))
        if record.get("max_logprob_gap", 0.0) > self.config.rollout.max_logprob_gap and distributed.is_writer():
            print(f"warning: step {self.state['step'] + 1}: the rollout engine's log-probs differ from the policy's by up to "
                  f"{record['max_logprob_gap']:.3g} (mean {record['logprob_gap']:.3g}; rollout.max_logprob_gap="
                  f"{self.config.rollout.max_logprob_gap}): the samples are off-policy; check the engine's precision "
                  "and its refit", flush=True)
        rollout_tokens = int(self.data_parallel.sum(rollout_tokens))
        record["rollout_tokens"] = rollout_tokens
        record["rollout_tokens_per_s"] = rollout_tokens / rollout_seconds if rollout_tokens else None
        record["step_time"] = time.perf_counter() - started
        return record

    def _forward_backward(self, batch: TokenBatch, group: int, batch_prompts: int, rewards, q) -> list[tuple[int, dict]]:
        """One forward/backward per micro-batch of whole groups of this replica's share.

        Each prompt's loss is divided by the global batch's prompt count, so the replicas'
        gradients sum to the full batch's mean; batch-level statistics (GRPO's token count and
        reward scale) are taken over the global batch too.
        """
        num_prompts = batch.num_rows // group
        per_micro = self.config.train.micro_batch_size
        bounds = [(s, min(s + per_micro, num_prompts)) for s in range(0, num_prompts, per_micro)]
        micro_batches = [batch.rows(s * group, e * group) for s, e in bounds]
        options = dict(self.objective_options)
        params = inspect.signature(self.spec.fn).parameters
        if "tokens_per_example" in params:
            options.setdefault("tokens_per_example", self.data_parallel.sum(float(batch.target_mask.sum())) / batch_prompts)
        if "batch_rewards" in params and rewards is not None:  # GRPO's scale_rewards="batch" sees all of them
            options["batch_rewards"] = torch.tensor(self.data_parallel.gather(rewards.tolist()), device=self.device)
        if "generator" in params:
            options["generator"] = self.estimator_generator
        if q is not None:
            options["q"] = q
        collected: list[tuple[int, dict]] = []

        def loss_fn(logprobs: torch.Tensor, index: int) -> torch.Tensor:
            start, end = bounds[index]
            micro = micro_batches[index].to(self.device)
            micro_rewards = rewards[start:end] if rewards is not None else None
            out = self.spec.fn(**estimator_inputs(self.spec, logprobs, micro, end - start, micro_rewards), **options)
            collected.append((end - start, {"loss": float(out.per_example.detach().mean()), **out.metrics,
                                            **logprob_gap(logprobs.detach(), micro)}))
            return out.per_example.sum() / batch_prompts

        self.policy.forward_backward(micro_batches, loss_fn)
        return self.policy.from_loss_stage(collected)

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, split: str, seed_offset: int = 0) -> dict[str, float]:
        """p@1, p@k and m@k (k = eval.num_samples) on ``split``; sampling has its own seeded RNG."""
        from tqdm import tqdm

        examples = self.splits.get(split)
        mine = self.data_parallel.shard(examples)
        generator = torch.Generator(device=self.device).manual_seed(self._replica_seed(self.config.train.seed + 10_000 + seed_offset))
        with tqdm(total=len(mine), desc=f"eval {split}", leave=False, dynamic_ncols=True,
                  disable=not distributed.is_writer()) as bar:
            outputs = sample_outputs(
                self.engine, self.chat, self.task, mine, self.config.data.format,
                self.config.eval.num_samples, self.config.eval.batch_size, generator, bar,
            )
        return score_outputs(self.task, examples, self.data_parallel.gather(outputs), self.config.eval.num_samples)

    def memorisation(self) -> float | None:
        """Percent of the noisy training prompts (``data.label_noise``) whose corrupted label the model's greedy
        answer reproduces; None without label noise."""
        noisy = noisy_examples(self.splits.train)
        if not noisy:
            return None
        unused = torch.Generator(device=self.device)  # greedy decoding draws nothing
        outputs = sample_outputs(self.engine, self.chat, self.task, self.data_parallel.shard(noisy), self.config.data.format,
                                 1, self.config.eval.batch_size, unused, greedy=True)
        flags = memorised(self.task, noisy, self.data_parallel.gather(outputs))
        return 100 * sum(flags) / len(flags)

    def _validate(self, logger: RunLogger) -> None:
        scores = self.evaluate("validation", seed_offset=self.state["step"])
        logger.log({"kind": "validation", "step": self.state["step"], **scores})
        value = scores[f"m@{self.config.eval.num_samples}"]  # the paper selects by m@16
        if self.state["best_metric"] is None or value > self.state["best_metric"]:
            self.state["best_metric"], self.state["best_step"] = value, self.state["step"]
            self.save()
        if self.guard is not None:
            self._watch(self.guard.validation(value, len(self.splits.get("validation"))), logger)

    # ----------------------------------------------------------------- the collapse guard
    def _watch(self, reason: str | None, logger: RunLogger) -> None:
        """On the guard's signal: restore the best checkpoint (weights and optimizer), change course by
        ``guard.action``, and log a ``guard`` record; at most ``guard.max_triggers`` times."""
        course, guard = self.state["course"], self.config.guard
        if reason is None or course["guard_triggers"] >= guard.max_triggers:
            return
        best = self.state["best_step"]
        if best is not None:
            self.policy.load(self.run_dir / CHECKPOINT_DIR / step_dir_name(best), with_optimizer=True)
        course["guard_triggers"] += 1
        if guard.action == "paft":
            course["objective"] = "paft"
        elif guard.action == "lower_q":
            course["q_scale"] *= guard.factor
        else:
            course["lr_scale"] *= guard.factor
        self._follow_course()
        self.guard.restart()
        logger.log({"kind": "guard", "step": self.state["step"], "reason": reason, "action": guard.action,
                    "restored_step": best, **course})

    def _follow_course(self) -> None:
        """Apply the guard's changes so far (the estimator, q's scale, the learning rate's), also after a resume."""
        course = self.state["course"]
        if course["objective"] != self.spec.name:
            self.spec = get_objective(course["objective"])
            self.objective_options = {}  # the earlier estimator's options need not be this one's
            if self.schedule is None and self.spec.uses_q:
                self.schedule = build_schedule(self.config.objective.q)
        self.policy.set_learning_rate(self.config.optim.lr * course["lr_scale"])

    def _finish(self, logger: RunLogger) -> dict[str, Any]:
        """Evaluate the best validation checkpoint on the test split and write results.json."""
        best = self.state["best_step"]
        final_memorisation = self.memorisation()
        if best is not None and best != self.state["step"]:
            self.policy.load(self.run_dir / CHECKPOINT_DIR / step_dir_name(best), with_optimizer=False)
        scores = self.evaluate("test")
        memorisation = {"final": final_memorisation, "tested": self.memorisation()} if final_memorisation is not None else None
        logger.log({"kind": "test", "step": self.state["step"], "best_step": best, **scores,
                    **({"memorisation": memorisation["tested"]} if memorisation else {})})
        results = {"objective": self.config.objective.name, "q": self.config.objective.q if self.spec.uses_q else None,
                   "best_step": best, "best_validation": self.state["best_metric"], "test": scores,
                   **({"memorisation": memorisation} if memorisation else {})}
        distributed.on_writer(lambda: self._write_results(results))
        return results

    def _write_results(self, results: dict[str, Any]) -> None:
        (self.run_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        plot_runs({self.run_dir.name: read_metrics(self.run_dir)}, self.run_dir / "training.png")

    # ----------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        state = {**self.state, "schedule": self.schedule.state_dict() if self.schedule is not None else None,
                 "guard": self.guard.state_dict() if self.guard is not None else None}
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "rollout": self.rollout_generator.get_state(),
            "estimator": self.estimator_generator.get_state(),
            "replica": self.data_parallel.rank,
        }
        root = self.run_dir / CHECKPOINT_DIR
        path = save_checkpoint(root, self.state["step"], self.policy, state, rng)
        best = self.state["best_step"]
        protect = {path.name} | ({step_dir_name(best)} if best is not None else set())
        distributed.on_writer(lambda: prune_checkpoints(root, self.config.train.keep_checkpoints, protect))
        return path

    def restore(self, checkpoint: Path) -> None:
        state, rng = load_checkpoint(checkpoint, self.policy)
        schedule_state, guard_state = state.pop("schedule"), state.pop("guard", None)
        self.state = {"course": self.state["course"], **state}
        self._follow_course()
        if self.schedule is not None and schedule_state is not None:
            self.schedule.load_state_dict(schedule_state)
        if self.guard is not None and guard_state is not None:
            self.guard.load_state_dict(guard_state)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("replica", 0) == self.data_parallel.rank:
            self.rollout_generator.set_state(rng["rollout"])
            self.estimator_generator.set_state(rng["estimator"])
        else:  # saved with fewer replicas: this one starts its own streams, fixed by the seed and the step
            seed = self.config.train.seed + 7919 * state["step"]
            self.rollout_generator.manual_seed(self._replica_seed(seed))
            self.estimator_generator.manual_seed(self._replica_seed(seed + 1))

    # ----------------------------------------------------------------- preemption
    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT and self._stop_signal is not None:
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            print("\nCtrl-C: finishing this step and writing a checkpoint (press again to stop at once)", flush=True)
        self._stop_signal = signum

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def logprob_gap(policy_logprobs: torch.Tensor, batch: TokenBatch) -> dict[str, float]:
    """Mean and largest |engine − policy| log-prob over the sampled tokens the engine scored
    (how off-policy the rollouts are; the loss always uses the policy's own log-probs)."""
    if batch.engine_logprobs is None:
        return {}
    engine = batch.engine_logprobs.to(policy_logprobs.device)
    gaps = (policy_logprobs - engine)[~engine.isnan()].abs()
    return {"logprob_gap": float(gaps.mean()), "max_logprob_gap": float(gaps.max())} if gaps.numel() else {}


def _merge_metrics(micro_metrics: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Prompt-weighted means across micro-batches; ``max_*`` metrics take the maximum."""
    total = sum(n for n, _ in micro_metrics)
    merged: dict[str, float] = {}
    for key in micro_metrics[0][1]:
        values = [(n, m[key]) for n, m in micro_metrics if key in m]
        if key.startswith("max_"):
            merged[key] = max(v for _, v in values)
        else:
            merged[key] = sum(n * v for n, v in values) / total
    return merged
