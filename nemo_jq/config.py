"""Typed run configuration: dataclasses loaded from YAML, with ``key=value`` overrides.

Every key is checked: an unknown key is an error that names it and suggests the closest
valid key, and values are checked against the field's type. The defaults are the embedded
CPU demo (a tiny Qwen3 on the synthetic task).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import operator
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nemo_jq.data.base import FORMATS
from nemo_jq.data.prepare import BAD_ROW_POLICIES
from nemo_jq.guard import GUARD_ACTIONS

#: Compute precisions of the policy and rollouts.
PRECISIONS = ("auto", "fp32", "bf16")
#: The registered backends (nemo_jq.models.backends); named here so loading a config imports no torch.
BACKEND_NAMES = ("hf", "megatron")
#: The registered rollout samplers (nemo_jq.rollouts), likewise.
ROLLOUT_ENGINE_NAMES = ("native", "hf", "vllm")

class ConfigError(ValueError):
    pass


def option(default: Any = None, help: str = "", *, factory: Any = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None,
           choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its help text and the range or choices every value is checked against at load time."""
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


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
    backend: str = option("hf", "hf (transformers, one process) or megatron (megatron-core GPTModel; any number "
                          "of processes under torchrun)", choices=BACKEND_NAMES)
    tensor_parallel: int = option(1, "megatron: ranks that split each layer (must divide the attention heads, "
                                  "KV heads and MLP width)", ge=1)
    pipeline_parallel: int = option(1, "megatron: pipeline stages, each an equal run of layers (must divide the "
                                    "layer count), scheduled 1F1B", ge=1)
    sequence_parallel: bool = option(False, "megatron: split the norms' and dropouts' activations over the "
                                     "tensor-parallel ranks too (needs tensor_parallel > 1)")
    context_parallel: int = option(1, "megatron: ranks that split every sequence (load-balanced, 2 chunks each) for "
                                   "long contexts; needs Transformer Engine's attention, so GPU only", ge=1)
    recompute_activations: bool = option(False, "megatron: keep only each layer's input and recompute the layer in "
                                         "backward (less activation memory, about a third more compute)")
    distributed_optimizer: bool = option(False, "megatron: split AdamW's fp32 master weights and moments over the "
                                         "data-parallel ranks (ZeRO-1: 12/DP bytes of optimizer state per parameter)")
    bf16_weights: bool = option(False, "megatron: bf16 parameters and activations, with fp32 gradient accumulation "
                                "and the fp32 master weights in the distributed optimizer (needs "
                                "distributed_optimizer=true)")
    precision: str = option("auto", "auto = bf16 autocast on GPU, fp32 on CPU", choices=PRECISIONS)
    logprob_chunk_size: int = option(256, "positions per chunk of the log-prob kernel", ge=1)


@dataclass
class DataConfig:
    name: str | None = option(
        None, "synthetic, finqa, hotpotqa, musique or jsonl; null = synthetic, or the dataset a prepared_dir holds"
    )
    format: str = option("cold", "cold: linearised x*, no task description or format hint; warm: instructions",
                         choices=FORMATS)
    train_size: int = option(768, "ignored with prepared_dir", ge=1)
    validation_size: int = option(64, "ignored with prepared_dir", ge=1)
    test_size: int = option(128, "ignored with prepared_dir", ge=1)
    seed: int = option(0, "subset draw (and the synthetic expressions)", ge=0)
    num_operands: int = option(3, "synthetic only: operands per expression", ge=2)
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
    engine: str = option("native", "native (shared prefill, compaction; this process), hf (the plain decode loop), "
                         "or vllm (optional extra, GPU; needs model.path)", choices=ROLLOUT_ENGINE_NAMES)
    tensor_parallel: int = option(1, "vllm only: ranks that hold one vLLM engine, tensor-parallel (torchrun's own "
                                  "processes, vLLM's external launcher; must divide model.tensor_parallel)", ge=1)
    max_logprob_gap: float = option(
        1.0, "warn when an engine's log-prob of a sampled token differs from the policy's by more than this", gt=0.0)


@dataclass
class ObjectiveConfig:
    name: str = option("garl", "an estimator from the registry: garl, paft, rb_rloo, grpo, rloo, sft")
    q: float = option(0.75, "the commitment, in [0, 1]", ge=0.0, le=1.0)
    q_schedule: dict[str, Any] | None = option(None, "a q schedule mapping (nemo_jq.objectives.schedules); replaces q")
    options: dict[str, Any] = option(
        help="the estimator's keyword options, e.g. {baseline: none} (garl), {num_resamples: 4} (paft)", factory=dict)


@dataclass
class OptimConfig:
    lr: float = option(5e-3, "AdamW learning rate (constant; 0 freezes the weights, as the benchmarks do)", ge=0.0)
    weight_decay: float = option(0.0, ge=0.0)
    betas: list[float] = option(help="AdamW betas, each in [0, 1)", factory=lambda: [0.9, 0.999])
    eps: float = option(1e-8, gt=0.0)
    grad_clip: float = option(1.0, "max global gradient norm", gt=0.0)


@dataclass
class EvalConfig:
    every: int = option(64, "validate every this many steps", ge=1)
    num_samples: int = option(16, "k of p@k and m@k; the best checkpoint is chosen by validation m@k", ge=1)
    batch_size: int = option(32, "prompts per generation call", ge=1)


@dataclass
class GuardConfig:
    """The collapse guard (nemo_jq/guard.py): off unless enabled."""

    enabled: bool = option(False, "watch for a collapse; on one, restore the best checkpoint and apply guard.action")
    min_fraction_of_best: float = option(0.5, "trigger when validation m@k falls below this fraction of its best ...",
                                         gt=0.0, le=1.0)
    patience: int = option(2, "... for this many evaluations in a row", ge=1)
    min_drop_se: float = option(2.0, "... and by more than this many binomial standard errors of a difference over the "
                                "validation prompts (so sampling noise alone does not trigger it; 0 = off)", ge=0.0)
    logp_drop: float = option(5.0, "or when the train log P̂ (mean of guard.window steps) falls this many nats below its "
                              "best such mean; 0 = off", ge=0.0)
    window: int = option(16, "steps in the log P̂ mean", ge=1)
    action: str = option("paft", "paft (switch the estimator to PAFT at the same q), lower_q, or lower_lr",
                         choices=GUARD_ACTIONS)
    factor: float = option(0.5, "lower_q / lower_lr: multiply q / the learning rate by this", gt=0.0, lt=1.0)
    max_triggers: int = option(3, "act at most this many times in a run", ge=1)


@dataclass
class TrainConfig:
    epochs: int = option(8, ge=1)
    batch_size: int = option(8, "prompts per optimizer step", ge=1)
    micro_batch_size: int = option(8, "prompts per forward/backward; whole groups of M rollouts stay together", ge=1)
    max_steps: int | None = option(None, "stop after this many steps; null = all epochs", ge=1)
    seed: int = option(0, ge=0)
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    save_every: int = option(25, "checkpoint every this many steps", ge=1)
    keep_checkpoints: int = option(2, "newest checkpoints kept (the best one is always kept)", ge=1)
    run_dir: str = option("runs/train", "where the run is written; one run per directory")
    tensorboard: bool = option(True, "write TensorBoard events under RUN_DIR/tensorboard")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "Config":
        """Cross-field checks that need the registry or the prepared data (done before any model is built).

        Resolves ``data.name``, ``data.template`` and ``data.system_prompt`` from a prepared
        folder's manifest, so the saved config says what the run trained on.
        """
        from nemo_jq.objectives import get_objective
        from nemo_jq.objectives.schedules import build_schedule

        try:
            spec = get_objective(self.objective.name)
        except KeyError as err:
            raise ConfigError(f"objective.name: {err.args[0]}") from None
        if spec.uses_q and self.objective.q_schedule is not None:
            try:
                build_schedule(self.objective.q_schedule)
            except ValueError as err:
                raise ConfigError(f"objective.q_schedule: {err}") from None
        accepted = set(inspect.signature(spec.fn).parameters)
        for key in self.objective.options:
            if key not in accepted or key in ("q", "generator"):
                raise ConfigError(f"objective.options.{key} is not an option of {spec.name!r}")
        if self.rollout.num_samples < spec.min_samples:
            raise ConfigError(
                f"rollout.num_samples={self.rollout.num_samples} but {spec.name!r} needs at least {spec.min_samples}"
            )
        if self.model.backend != "megatron" and (self.model.tensor_parallel > 1 or self.model.pipeline_parallel > 1
                                                 or self.model.context_parallel > 1
                                                 or self.model.sequence_parallel or self.model.recompute_activations
                                                 or self.model.distributed_optimizer or self.model.bf16_weights):
            raise ConfigError(f"model.tensor_parallel/pipeline_parallel/context_parallel/sequence_parallel/"
                              f"recompute_activations/distributed_optimizer/bf16_weights need "
                              f"model.backend=megatron "
                              f"(model.backend={self.model.backend} trains in one process)")
        if self.model.bf16_weights and not self.model.distributed_optimizer:
            raise ConfigError("model.bf16_weights=true keeps the fp32 master weights in the distributed optimizer: "
                              "set model.distributed_optimizer=true too (it is plain AdamW on fp32 masters at DP=1)")
        if self.rollout.tensor_parallel > 1 and (self.rollout.engine != "vllm" or self.model.backend != "megatron"
                                                 or self.model.tensor_parallel % self.rollout.tensor_parallel):
            raise ConfigError(f"rollout.tensor_parallel={self.rollout.tensor_parallel} splits a vLLM engine over the ranks of "
                              "one model replica: it needs rollout.engine=vllm, model.backend=megatron and a "
                              f"model.tensor_parallel it divides (got {self.rollout.engine}, {self.model.backend}, "
                              f"{self.model.tensor_parallel})")
        if self.rollout.engine == "vllm" and not self.model.path:
            raise ConfigError("rollout.engine=vllm needs model.path (an HF folder vLLM can load; the policy's weights "
                              "replace its own after each step): set model.path, or use rollout.engine=native")
        if self.guard.enabled and self.guard.action == "lower_q" and not spec.uses_q:
            raise ConfigError(f"guard.action=lower_q needs an estimator with a q; {spec.name!r} has none: "
                              "use guard.action=lower_lr")
        if not all(0.0 <= beta < 1.0 for beta in self.optim.betas) or len(self.optim.betas) != 2:
            raise ConfigError(f"optim.betas must be two numbers in [0, 1); got {self.optim.betas}")
        self._resolve_data()
        return self

    def _resolve_data(self) -> None:
        from nemo_jq.data.prepare import read_manifest
        from nemo_jq.data.qa import DATASETS

        data = self.data
        if data.prepared_dir:
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
        elif data.name is None:
            data.name = "synthetic"
        if data.name != "synthetic" and data.name not in DATASETS:
            raise ConfigError(f"data.name must be 'synthetic' or one of {sorted(DATASETS)}; got {data.name!r}")


def describe_keys() -> str:
    """Every config key with its type, default, allowed range and help: the ``nemo-jq train --help`` listing."""
    lines = []

    def walk(cls: type, instance: Any, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                walk(type(value), value, f"{prefix}{f.name}.")
                continue
            bounds = _bounds_text(f.metadata)
            hint = f.metadata.get("help", "")
            text = f"  {prefix}{f.name} = {yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            extras = "; ".join(part for part in (bounds, hint) if part)
            lines.append(f"{text:<44} {extras}" if extras else text)

    defaults = Config()
    for section in dataclasses.fields(Config):
        lines.append(f"{section.name}:")
        value = getattr(defaults, section.name)
        walk(type(value), value, f"{section.name}.")
    return "\n".join(lines)


#: The bounds an ``option`` may declare: how each reads and how each is checked.
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


def _bounds_text(metadata: Any) -> str:
    if metadata.get("choices"):
        return "one of " + ", ".join(metadata["choices"])
    return " and ".join(f"{symbol} {metadata[key]}" for key, (symbol, _) in _BOUNDS.items() if metadata.get(key) is not None)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides (values parsed as YAML)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        raw = _parse_yaml(path.read_text(), str(path)) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set_path(raw, key.split("."), _parse_yaml(value, f"override {item!r}"))
    return _build(Config, raw, prefix="").validate()


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        place = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{place}: invalid YAML ({problem}); fix the syntax there") from None


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
            values[name] = _check_range(_check_type(value, hint, f"{prefix}{name}"), fields[name].metadata, f"{prefix}{name}")
    return cls(**values)


def _check_range(value: Any, metadata: Any, key: str) -> Any:
    """The value, if it lies in the field's range or choices; else an error naming the key and what is allowed."""
    if value is None or isinstance(value, bool):
        return value
    choices = metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
    if isinstance(value, (int, float)) and not all(
        check(value, metadata[key]) for key, (_, check) in _BOUNDS.items() if metadata.get(key) is not None
    ):
        raise ConfigError(f"{key} must be {_bounds_text(metadata)}; got {value!r}")
    return value


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
