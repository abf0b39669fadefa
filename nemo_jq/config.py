"""Typed run configuration: dataclasses loaded from YAML, with ``key=value`` overrides.

Every key is checked: an unknown key is an error that names it and suggests the closest
valid key, and values are checked against the field's type. The defaults are the embedded
CPU demo (a tiny Qwen3 on the synthetic task).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    pass


@dataclass
class TinyModelConfig:
    """Shape of the randomly initialised Qwen3 used when ``model.path`` is null."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 192
    max_position_embeddings: int = 512
    tokenizer_vocab_size: int = 320


@dataclass
class ModelConfig:
    #: Local HF folder (or hub name, where a network is available); null = tiny Qwen3 from scratch.
    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    #: auto = bf16 autocast on GPU, fp32 on CPU.
    precision: str = "auto"
    logprob_chunk_size: int = 256


@dataclass
class DataConfig:
    #: synthetic (the embedded task), finqa, hotpotqa, musique, or jsonl (your own data).
    name: str = "synthetic"
    #: cold: linearised x*, no task description or formatting hint; warm: instructions.
    format: str = "cold"
    train_size: int = 768
    validation_size: int = 32
    test_size: int = 128
    seed: int = 0
    #: synthetic only: operands per expression.
    num_operands: int = 3
    #: A local file, a folder of split files (train/dev/validation/test .json/.jsonl/.parquet) or a
    #: hub name; null = the paper's hub name (hotpotqa, musique). Ignored when prepared_dir is set.
    source: str | None = None
    hub_config: str | None = None
    #: A folder written by `nemo-jq data prepare`.
    prepared_dir: str | None = None
    #: Malformed rows: skip (counted in the manifest) or fail on the first.
    on_bad_row: str = "skip"
    #: jsonl only: user-turn template over {question} and {context}, and the warm system message.
    template: str | None = None
    system_prompt: str | None = None


@dataclass
class RolloutConfig:
    #: M, rollouts per prompt.
    num_samples: int = 8
    max_thinking_tokens: int = 6
    max_answer_tokens: int = 4
    temperature: float = 1.0
    #: 0 and 1.0 switch top-k and top-p off (the paper's setting).
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class ObjectiveConfig:
    #: An estimator from the registry: garl, paft, rb_rloo, grpo, rloo, sft.
    name: str = "garl"
    q: float = 0.75
    #: A q schedule mapping (nemo_jq.objectives.schedules); when set it replaces q.
    q_schedule: dict[str, Any] | None = None
    #: Keyword options of the estimator, e.g. {baseline: none} for garl, {num_resamples: 4} for paft.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class EvalConfig:
    every: int = 25
    num_samples: int = 16
    #: Prompts per generation call.
    batch_size: int = 32


@dataclass
class TrainConfig:
    epochs: int = 4
    #: Prompts per optimizer step.
    batch_size: int = 16
    #: Prompts per forward/backward; whole groups of M rollouts stay together.
    micro_batch_size: int = 16
    #: Stop after this many steps (null: run all epochs).
    max_steps: int | None = None
    seed: int = 0
    device: str = "auto"
    save_every: int = 25
    keep_checkpoints: int = 2
    run_dir: str = "runs/train"
    tensorboard: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "Config":
        """Cross-field checks that need the registry (done before any model is built)."""
        from nemo_jq.objectives import get_objective
        from nemo_jq.objectives.checks import check_q
        from nemo_jq.objectives.schedules import build_schedule

        try:
            spec = get_objective(self.objective.name)
        except KeyError as err:
            raise ConfigError(f"objective.name: {err.args[0]}") from None
        if spec.uses_q:
            try:
                check_q(self.objective.q)
                if self.objective.q_schedule is not None:
                    build_schedule(self.objective.q_schedule)
            except ValueError as err:
                raise ConfigError(f"objective.q / objective.q_schedule: {err}") from None
        accepted = set(inspect.signature(spec.fn).parameters)
        for key in self.objective.options:
            if key not in accepted or key in ("q", "generator"):
                raise ConfigError(f"objective.options.{key} is not an option of {spec.name!r}")
        if self.rollout.num_samples < spec.min_samples:
            raise ConfigError(
                f"rollout.num_samples={self.rollout.num_samples} but {spec.name!r} needs at least {spec.min_samples}"
            )
        from nemo_jq.data.prepare import BAD_ROW_POLICIES
        from nemo_jq.data.qa import DATASETS
        from nemo_jq.models.hf import PRECISIONS

        if self.data.name != "synthetic" and self.data.name not in DATASETS:
            raise ConfigError(f"data.name must be 'synthetic' or one of {sorted(DATASETS)}; got {self.data.name!r}")
        if self.data.on_bad_row not in BAD_ROW_POLICIES:
            raise ConfigError(f"data.on_bad_row must be one of {BAD_ROW_POLICIES}; got {self.data.on_bad_row!r}")

        if self.model.precision not in PRECISIONS:
            raise ConfigError(f"model.precision must be one of {PRECISIONS}; got {self.model.precision!r}")
        if self.data.format not in ("cold", "warm"):
            raise ConfigError(f"data.format must be 'cold' or 'warm'; got {self.data.format!r}")
        for key in ("batch_size", "micro_batch_size", "epochs"):
            if getattr(self.train, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1; got {getattr(self.train, key)}")
        return self


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides (values parsed as YAML)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set_path(raw, key.split("."), yaml.safe_load(value))
    return _build(Config, raw, prefix="").validate()


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))


def _set_path(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {key} is not a section")
        tree = node
    tree[keys[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping; got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {sorted(fields)}"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _check_type(value, hint, f"{prefix}{name}")
    return cls(**values)


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], key)
    expected = origin or hint
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if expected is Any or (isinstance(value, expected) and not (expected is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"{key} must be {getattr(expected, '__name__', expected)}; got {value!r}")
