"""Everything a run is made of, built once from its config: what train, eval and export share.

``build_components`` seeds the run, then builds the task and its splits, the tokenizer and chat format,
the policy and rollout engine (from the registered backend), the estimator with its checked options, the
q schedule and the collapse guard, in that order, so that a run's random draws never depend on who
asked for the components.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_jq import distributed
from nemo_jq.chat import ChatFormat, build_tokenizer
from nemo_jq.config import Config
from nemo_jq.data import Example, Splits, SyntheticArithmetic, Task
from nemo_jq.data.noise import corrupt_labels
from nemo_jq.data.prepare import load_prepared, make_task, prepare
from nemo_jq.distributed import DataParallel
from nemo_jq.guard import CollapseGuard
from nemo_jq.models.backends import BackendRequest, build_backend
from nemo_jq.models.common import resolve_pretrained
from nemo_jq.models.hf import load_causal_lm, tiny_qwen3
from nemo_jq.models.interfaces import Policy, RolloutEngine
from nemo_jq.objectives import ObjectiveSpec, QSchedule, build_schedule, get_objective
from nemo_jq.objectives.importance import Correction
from nemo_jq.rollouts.refit import RefittedRolloutEngine


@dataclass
class Components:
    config: Config
    device: torch.device
    task: Task
    splits: Splits
    tokenizer: Any
    chat: ChatFormat
    policy: Policy
    engine: RolloutEngine
    estimator: ObjectiveSpec
    #: ``estimator.options`` as ``objective.options`` sets them.
    estimator_options: Any
    #: None for estimators without a q.
    schedule: QSchedule | None
    #: None unless ``guard.enabled``.
    guard: CollapseGuard | None
    #: The importance correction ``objective.importance`` asks for (``auto`` resolved); None: on-policy.
    correction: Correction | None = None

    @property
    def data_parallel(self) -> DataParallel:
        return self.policy.data_parallel

    def prompt_ids(self, examples: list[Example]) -> list[list[int]]:
        return [self.chat.prompt_ids(self.task.messages(e, self.config.data.format)) for e in examples]


def build_components(config: Config, device: torch.device, *, tokenizer_dir: Path | None = None) -> Components:
    """The run's components on ``device``; ``tokenizer_dir``: a run's saved tokenizer, when reopening it."""
    seed = config.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    task, splits = build_task(config)
    model_dir = resolve_model_dir(config.model.path)
    tokenizer = load_tokenizer(config, model_dir, task, splits, tokenizer_dir)
    chat = ChatFormat(tokenizer)
    policy, engine = build_backend(config.model.backend, BackendRequest(
        load_model=lambda: load_model(config, model_dir, len(tokenizer)), model_dir=model_dir, config=config, chat=chat,
        device=device))
    if config.train.batch_size % policy.data_parallel.size:
        raise ValueError(f"train.batch_size={config.train.batch_size} does not split over {policy.data_parallel.size} "
                         "data-parallel replicas: make it a multiple of world size / (tensor_parallel x pipeline_parallel x "
                         "context_parallel)")
    estimator = get_objective(config.objective.name)
    objective = config.objective
    schedule = build_schedule(objective.q_schedule or objective.q) if estimator.uses_q else None
    return Components(config, device, task, splits, tokenizer, chat, policy, engine, estimator,
                      estimator.parse_options(objective.options), schedule, build_guard(config),
                      importance_correction(config, own_weights=isinstance(engine, RefittedRolloutEngine)))


def importance_correction(config: Config, *, own_weights: bool) -> Correction | None:
    """``objective.importance`` as a :class:`Correction` (None: none). ``auto`` truncates when the rollouts come from
    another policy than the one trained: an engine with its own copy of the weights (``own_weights``: vLLM's
    kernels, or megatron's HF sampler) or one-step-off rollouts; it is none for on-policy rollouts (the in-place
    samplers), where every ratio is 1."""
    objective = config.objective
    mode = objective.importance
    if mode == "auto":
        mode = "truncate" if own_weights or config.rollout.async_steps else "none"
    if mode == "none":
        return None
    low, high = objective.importance_bounds
    return Correction(mode, cap=objective.importance_cap, low=low, high=high)


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
        task = SyntheticArithmetic(num_operands=data.num_operands, answer_width=data.answer_width)
        return task, task.splits(*sizes, data.seed)
    task = make_task(data.name, template=data.template, system=data.system_prompt)
    if data.prepared_dir:
        return task, load_prepared(Path(data.prepared_dir))
    splits, _ = prepare(task, data.source, sizes, data.seed, hub_config=data.hub_config, on_bad_row=data.on_bad_row)
    return task, splits


def resolve_model_dir(path: str | None) -> Path | None:
    """``model.path`` as a local folder on every rank (None: a model from scratch). A hub name is looked up, and
    downloaded if it must be, once, by the writer; then every rank finds the same snapshot in its cache."""
    if not path:
        return None
    distributed.on_writer(lambda: resolve_pretrained(path))
    return resolve_pretrained(path, local_files_only=True)


def load_tokenizer(config: Config, model_dir: Path | None, task: Task, splits: Splits, saved: Path | None) -> Any:
    """A run's own saved tokenizer when reopening it; else the model folder's; else one trained on the task's texts."""
    if saved is not None and saved.exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)
    if model_dir is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    return build_tokenizer(task.corpus(splits.train), config.model.tiny.tokenizer_vocab_size)


def load_model(config: Config, model_dir: Path | None, vocab_size: int) -> Any:
    """The HF causal LM the run starts from: the model folder's, or a tiny Qwen3 from scratch."""
    if model_dir is not None:
        return load_causal_lm(model_dir)
    tiny = config.model.tiny
    return tiny_qwen3(vocab_size, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                      num_kv_heads=tiny.num_kv_heads, intermediate_size=tiny.intermediate_size,
                      max_position_embeddings=tiny.max_position_embeddings, seed=config.train.seed)


def build_guard(config: Config) -> CollapseGuard | None:
    guard = config.guard
    if not guard.enabled:
        return None
    return CollapseGuard(min_fraction_of_best=guard.min_fraction_of_best, patience=guard.patience,
                         logp_drop=guard.logp_drop, window=guard.window, min_drop_se=guard.min_drop_se)
