"""Everything a run is made of, built once from its config: what train, eval and export share.

``build_components`` seeds the run, then builds the task and its splits, the tokenizer and chat format,
the policy and rollout engine (from the registered backend), the estimator with its checked options, the
q schedule and the collapse guard, in that order, so that a run's random draws never depend on who
asked for the components.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from nemo_jq.backends import BackendRequest, build_backend
from nemo_jq.config import Config, load_config
from nemo_jq.data import Example, Splits, Task
from nemo_jq.data.chat import ChatFormat, build_tokenizer
from nemo_jq.data.prepare import build_task, task_of
from nemo_jq.models.common import SafetensorsFolder, autocast_dtype, resolve_device, resolve_pretrained
from nemo_jq.models.export import export_hf_model
from nemo_jq.models.hf import load_causal_lm, tiny_qwen3
from nemo_jq.models.interfaces import Policy, RolloutEngine
from nemo_jq.objectives import ObjectiveSpec, QSchedule, build_schedule, get_objective
from nemo_jq.objectives.importance import Correction
from nemo_jq.recipe.guard import CollapseGuard
from nemo_jq.rollouts import IN_PLACE, BudgetedRollouts, SamplerRequest, build_rollouts, check_sampler
from nemo_jq.rollouts.ranks import RemoteRollouts, RolloutServer
from nemo_jq.rollouts.wiring import scratch_model_dir
from nemo_jq.runtime import distributed
from nemo_jq.runtime.checkpoint import load_checkpoint
from nemo_jq.runtime.distributed import DataParallel
from nemo_jq.runtime.outputs import holder_of
from nemo_jq.runtime.runs import (
    CONFIG_FILE,
    INFERENCE_KEYS,
    TOKENIZER_DIR,
    Selected,
    at_home,
    check_splits,
    check_trained_with,
    claim_run_dir,
    refuse_overrides,
    select_checkpoint,
)
from nemo_jq.runtime.tracking import first_line
from nemo_jq.typed import ConfigError


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
        """The token ids of each example's prompt: the one formula training, one-step-off requests, evaluation and
        the experiments sample from (the task's messages in ``data.format``, in the chat template)."""
        return [self.chat.prompt_ids(self.task.messages(e, self.config.data.format)) for e in examples]


def this_ranks_part(config: Config, run_dir: Path, *, existing: bool, overwrite: bool = False) -> Components | RolloutServer:
    """What this process does in a run: it joins torchrun's world (split into roles under ``rollout.placement=separate``);
    a rollout rank gets the server it runs, a training rank the run directory (claimed, for a new run) and the
    components. ``existing``: reopening ``run_dir`` (with its saved tokenizer)."""
    separate = config.rollout.own_ranks
    device = distributed.init_from_env(resolve_device(config.train.device),
                                        timedelta(minutes=config.train.collective_timeout_minutes), rollout_ranks=separate,
                                        engine_ranks=config.rollout.tensor_parallel)
    tokenizer_dir = run_dir / TOKENIZER_DIR if existing else None
    roles = distributed.roles()
    if roles is not None and roles.samples:
        return build_rollout_server(config, device, tokenizer_dir=tokenizer_dir)
    if not existing:
        distributed.on_writer(lambda: claim_run_dir(run_dir, overwrite=overwrite))
    return build_components(config, device, tokenizer_dir=tokenizer_dir)


def build_components(config: Config, device: torch.device, *, tokenizer_dir: Path | None = None,
                     reads_splits: bool = True) -> Components:
    """The run's components on ``device``; ``tokenizer_dir``: a run's saved tokenizer, when reopening it;
    ``reads_splits=False``: empty splits, the data not read (generating from a run, exporting it). On a training
    rank of a split world (``rollout.placement=separate``) the engine asks the rollout ranks (:class:`RemoteRollouts`)."""
    task, splits, model_dir, chat = _prepare(config, tokenizer_dir, reads_splits)
    components = assemble_components(config, device, task, splits, chat, BackendRequest(
        load_model=lambda: load_model(config, model_dir, len(chat.tokenizer)), model_dir=model_dir, config=config,
        chat=chat, device=device))
    if distributed.roles() is not None and not isinstance(components.engine, RemoteRollouts):
        raise ValueError(f"model.backend={config.model.backend} built a rollout engine of its own on a training rank of a "
                         "split world (rollout.placement=separate): compose it with nemo_jq.rollouts.wiring.compose_engine "
                         "(nemo_jq.backends.engine_for), which asks the rollout ranks, or set rollout.placement=colocated")
    return components


def build_rollout_server(config: Config, device: torch.device, *, tokenizer_dir: Path | None = None) -> RolloutServer:
    """A rollout rank's part (``rollout.placement=separate``): its engine (:func:`rollout_rank_engine`), serving the
    training ranks; no policy, no optimizer."""
    task, splits, model_dir, chat = _prepare(config, tokenizer_dir)
    engine = rollout_rank_engine(config, device, chat, model_dir, lambda: load_model(config, model_dir, len(chat.tokenizer)))
    return RolloutServer(engine, distributed.roles(), config.rollout.bucket_bytes())


def rollout_rank_engine(config: Config, device: torch.device, chat: ChatFormat, model_dir: Path | None,
                        load_model: Callable[[], Any]) -> BudgetedRollouts:
    """A rollout rank's engine, over weights of its own that arrive with the first sync (the dry run builds it too).
    An in-place sampler (native, hf) decodes ``load_model()`` in the compute dtype (as the megatron backend's sampler);
    an engine that loads a folder (vLLM) starts from ``model_dir``, or from the export of the model built from scratch
    that its first rank writes (an engine over several rollout ranks: ``rollout.tensor_parallel``; one node's disk)."""
    if config.rollout.engine in IN_PLACE:
        dtype = autocast_dtype(device, config.model.precision) or torch.float32
        return build_rollouts(SamplerRequest(load_model().to(device, dtype=dtype), model_dir, config, chat.pad_id, device),
                              chat)
    if model_dir is None:  # a model built from scratch: the engine's ranks load its first rank's export of it
        import torch.distributed as dist

        folder = [None]
        if distributed.world_size() == 1 or dist.get_rank() == 0:
            folder = [scratch_model_dir()]
            export_hf_model(load_model(), Path(folder[0]), chat.tokenizer)
        if distributed.world_size() > 1:
            dist.broadcast_object_list(folder, src=0)
        model_dir = Path(folder[0])
    return build_rollouts(SamplerRequest(None, model_dir, config, chat.pad_id, device), chat)


def _prepare(config: Config, tokenizer_dir: Path | None, reads_splits: bool = True) -> tuple[Task, Splits, Path | None, ChatFormat]:
    """Seed the run, then the task and its splits (empty unless ``reads_splits``), the model folder and the chat format
    (prompt lengths checked)."""
    check_sampler(config)  # a rollout engine that cannot be had is said before any model is built
    seed = config.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    task, splits = build_task(config.data) if reads_splits else (task_of(config.data), Splits([], [], []))
    model_dir = resolve_model_dir(config.model.path)
    tokenizer = load_tokenizer(config, model_dir, task, splits, tokenizer_dir)
    chat = ChatFormat(tokenizer)
    check_prompt_lengths(config, model_dir, task, chat, [(f"{name} example {e.id!r}", e) for name in ("train", "validation", "test")
                                                      for e in splits.get(name)],
                         "shorten or drop that row (`nemo-jq data prepare` drops rows over its character cap), lower "
                         "rollout.max_thinking_tokens" + (", or raise model.tiny.max_position_embeddings" if model_dir is None else ""))
    return task, splits, model_dir, chat


def assemble_components(config: Config, device: torch.device, task: Task, splits: Splits, chat: ChatFormat,
                        request: BackendRequest) -> Components:
    """The components from a task, its chat format and what the backend builds from (the dry run passes its own)."""
    policy, engine = build_backend(config.model.backend, request)
    if config.train.batch_size % policy.data_parallel.size:
        raise ValueError(f"train.batch_size={config.train.batch_size} does not split over {policy.data_parallel.size} "
                         "data-parallel replicas: make it a multiple of world size / (tensor_parallel x pipeline_parallel x "
                         "context_parallel)")
    estimator = get_objective(config.objective.name)
    objective = config.objective
    schedule = build_schedule(objective.q_schedule or objective.q) if estimator.uses_q else None
    return Components(config, device, task, splits, chat.tokenizer, chat, policy, engine, estimator,
                      estimator.parse_options(objective.options), schedule, build_guard(config),
                      importance_correction(config, on_policy=engine.on_policy))


def importance_correction(config: Config, *, on_policy: bool) -> Correction | None:
    """``objective.importance`` as a :class:`Correction` (None: none). ``auto``: for rollouts one step off (a
    systematic shift: the policy has moved), the sequence ratio truncated; for an engine that is not ``on_policy``
    (vLLM's kernels, megatron's HF sampler: per-token numerical noise), each token's ratio truncated, which over 1k-4k
    -token rationales keeps the gradient's error at the on-policy estimator's where sequence truncation's bias grows to
    0.3-0.7 of it (bench/results/importance_modes.md); none for the in-place samplers, where every ratio is 1 at the
    paper's sampling (temperature 1, no top-k or top-p; at another, the rollouts are the tempered or truncated
    distribution's and go uncorrected unless asked: the mismatch warning says so)."""
    objective = config.objective
    mode = objective.importance
    if mode == "auto":
        mode = "truncate" if config.rollout.async_steps else "none" if on_policy else "token_truncate"
    if mode == "none":
        return None
    low, high = objective.importance_bounds
    return Correction(mode, cap=objective.importance_cap, low=low, high=high)


def resolve_model_dir(path: str | None) -> Path | None:
    """``model.path`` as a local folder on every rank (None: a model from scratch). A hub name is looked up, and
    downloaded if it must be, once, by torchrun's rank 0 while every rank waits (a split world's rollout ranks too);
    then every rank finds the same snapshot in its cache, which must be one every node reads (``HF_HOME``)."""
    if not path:
        return None
    distributed.first_on_global_rank_0(lambda: resolve_pretrained(path))
    try:
        return resolve_pretrained(path, local_files_only=True)
    except FileNotFoundError:
        if distributed.rank() == 0:
            raise
        import socket

        raise FileNotFoundError(
            f"model.path={path}: rank 0 has it in its Hugging Face cache, which this rank (rank {distributed.rank()} on "
            f"{socket.gethostname()}) does not see at HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}: "
            "point HF_HOME at a folder every node reads (a shared file system), or download the model on every node "
            "first (`hf download NAME`), or set model.path to a shared local folder") from None


def load_tokenizer(config: Config, model_dir: Path | None, task: Task, splits: Splits, saved: Path | None) -> Any:
    """A run's own saved tokenizer when reopening it (one gone is an error: its checkpoints' token ids are that
    tokenizer's, and a rebuilt one would differ once the data or the tokenizers library did); else the model folder's;
    else one trained on the task's texts."""
    if saved is not None:
        if not saved.exists():
            from_model = f" (or copy the tokenizer files of model.path, {model_dir}, into it)" if model_dir else ""
            raise FileNotFoundError(f"the run's tokenizer folder {saved} is missing: its checkpoints' token ids are that "
                                    f"tokenizer's, and no other may stand in; restore it from a copy of the run{from_model}")
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(saved)
        except (OSError, ImportError):  # unreadable (its own hint), or a library missing: not the folder's fault
            raise
        except Exception as err:  # noqa: BLE001 - a damaged file fails in the tokenizers library, any kind of error
            raise ValueError(f"the run's tokenizer folder {saved} does not load ({first_line(err)}): a file in it is "
                             "damaged (restore the folder from a copy of the run), or a newer tokenizers library "
                             "wrote it (upgrade tokenizers)") from None
    if model_dir is not None:
        from transformers import AutoTokenizer

        if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
            raise FileNotFoundError(f"model folder {model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy "
                                    "the model's own beside its config.json (e.g. `hf download NAME --include 'tokenizer*' "
                                    f"'*.jinja' --local-dir {model_dir}`)")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if not tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {model_dir} has no chat template (no chat_template in "
                             "tokenizer_config.json, no chat_template.jinja): prompts are rendered with it; copy the "
                             "chat_template.jinja of the model's chat release (e.g. Qwen/Qwen3-0.6B) into that folder")
        return tokenizer
    return build_tokenizer(task.corpus(splits.train), config.model.tiny.tokenizer_vocab_size)


#: Files one of which an HF folder's tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_prompt_lengths(config: Config, model_dir: Path | None, task: Task, chat: ChatFormat,
                         examples: list[tuple[str, Example]], fix: str) -> None:
    """Every prompt of ``examples`` (each with its label: "train example 'x'"), with the thinking budget and its
    answer, fits the model's context (``max_position_embeddings``): one that does not is a ``ValueError`` naming it
    and ``fix``, before any model is built (or samples). A prompt short enough in UTF-8 bytes
    (a token is at least one) is passed without tokenizing it."""
    if model_dir is None:
        context, where = config.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    else:
        context = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
        where = f"max_position_embeddings in {model_dir / 'config.json'}"
    if not context or not examples:
        return
    rollout, form = config.rollout, config.data.format
    room = context - rollout.max_thinking_tokens - 1  # the rationale and </think>
    if room - rollout.max_answer_tokens < 1:  # no prompt fits: the budgets are the fault, not an example
        raise ValueError(f"rollout.max_thinking_tokens={rollout.max_thinking_tokens}, </think> and "
                         f"rollout.max_answer_tokens={rollout.max_answer_tokens} leave no room for a prompt in the "
                         f"model's context of {context} tokens ({where}): lower rollout.max_thinking_tokens")
    blank = [{**m, "content": ""} if m["role"] == "user" else m for m in task.messages(examples[0][1], form)]
    overhead = len(chat.prompt_ids(blank)) + 8  # the template's tokens, and a few where the text meets them
    for label, example in examples:
        messages = task.messages(example, form)
        user = sum(len(m["content"].encode()) for m in messages if m["role"] == "user")
        if overhead + user + max(rollout.max_answer_tokens, len(example.answer.encode()) + 4) <= room:
            continue
        prompt = len(chat.prompt_ids(messages))
        answer = max(rollout.max_answer_tokens, len(chat.answer_ids(example.answer)))
        if prompt + answer > room:
            raise ValueError(f"{label}: its prompt is {prompt} tokens, which with its answer "
                             f"({answer}) and rollout.max_thinking_tokens={rollout.max_thinking_tokens} is beyond the "
                             f"model's context of {context} tokens ({where}): {fix}")


def load_model(config: Config, model_dir: Path | None, vocab_size: int) -> Any:
    """The HF causal LM the run starts from: the model folder's, or a tiny Qwen3 from scratch."""
    if model_dir is not None:
        check_config_matches_weights(model_dir)
        return load_causal_lm(model_dir)
    tiny = config.model.tiny
    return tiny_qwen3(vocab_size, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                      num_kv_heads=tiny.num_kv_heads, intermediate_size=tiny.intermediate_size,
                      max_position_embeddings=tiny.max_position_embeddings, seed=config.train.seed)


def check_config_matches_weights(model_dir: Path) -> None:
    """A ``ValueError`` naming the first weight whose shape in the folder's safetensors differs from the one its
    ``config.json`` builds (checked on the meta device, before anything is loaded), or a Qwen3-MoE routing to more
    experts than it has."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    experts, chosen = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    if experts and chosen and chosen > experts:  # transformers fails at the first forward, deep in the router
        raise ValueError(f"model folder {model_dir}: its config.json routes each token to num_experts_per_tok={chosen} "
                         f"of num_experts={experts} experts: use the config.json that came with these weights")
    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    weights = SafetensorsFolder(model_dir)
    for file in dict.fromkeys(weights.files.values()):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                shape = tuple(tensors.get_slice(name).get_shape())
                if name in expected and shape != expected[name]:
                    raise ValueError(f"model folder {model_dir}: its config.json does not match its weights ({name} is "
                                     f"{list(shape)} in {file.name}, {list(expected[name])} by config.json): use the "
                                     "config.json that came with these weights")


def build_guard(config: Config) -> CollapseGuard | None:
    guard = config.guard
    if not guard.enabled:
        return None
    return CollapseGuard(min_fraction_of_best=guard.min_fraction_of_best, patience=guard.patience,
                         logp_drop=guard.logp_drop, window=guard.window, min_drop_se=guard.min_drop_se)


@dataclass
class LoadedRun:
    """A run's components holding one checkpoint's weights (its optimizer state not loaded)."""

    selected: Selected
    components: Components


def _layout_runs_here(config: Config, command: str) -> None:
    """A Megatron checkpoint's layout over this command's processes, or one line naming the keys that place it here:
    a checkpoint loads at any layout (eval, generate and export take them), which a run at TP, PP or EP > 1 on a
    GPU node, evaluated in one process, needs."""
    try:
        config.megatron.validate(world_size=distributed.world_size())
    except ValueError as err:
        layout = " ".join(f"megatron.{key}=1" for key in ("tensor_parallel", "pipeline_parallel", "context_parallel",
                                                           "expert_parallel", "expert_tensor_parallel")
                          if getattr(config.megatron, key) > 1)
        layout += " megatron.sequence_parallel=false" if config.megatron.sequence_parallel else ""
        raise ConfigError(f"{err}; or place the checkpoint here: {command} loads it at any layout ({layout} for one "
                          "process)") from None


def load_for_inference(path: Path, overrides: list[str] | tuple[str, ...] = (), which: str = "best", *,
                       command: str) -> LoadedRun:
    """The components of the run at ``path`` (a run directory: its ``which`` checkpoint, see
    :func:`select_checkpoint`; or a checkpoint directory), with that checkpoint's weights; ``overrides`` of the run's
    config only of the keys ``command`` may change (:data:`INFERENCE_KEYS`, e.g. ``eval.num_samples=4``)."""
    refuse_overrides(overrides, INFERENCE_KEYS[command], command,
                     f"{command} uses a checkpoint as its run trained it (its model, data and prompt format) and trains nothing")
    selected = picked(path, which)
    run_dir = selected.run_dir
    config = at_home(load_config(run_dir / CONFIG_FILE, list(overrides), saved=True), run_dir)
    selected = read_while_training(lambda checkpoint: check_trained_with(config, checkpoint, INFERENCE_KEYS[command]),
                                   selected, path, which)
    device = distributed.init_from_env(resolve_device(config.train.device),
                                      timedelta(minutes=config.train.collective_timeout_minutes))
    if config.model.backend == "megatron":  # the layout it trained at may not fit the processes it runs in here
        _layout_runs_here(config, command)
    scores = command == "eval"  # the run's own splits (generate and export read none: the data may be gone)
    components = build_components(config, device, tokenizer_dir=run_dir / TOKENIZER_DIR, reads_splits=scores)
    if scores:
        check_splits(run_dir, components.splits, config.data)

    def read(checkpoint: Path) -> None:
        if checkpoint != selected.checkpoint:  # picked again: checked as the first pick was above
            check_trained_with(config, checkpoint, INFERENCE_KEYS[command])
        load_checkpoint(checkpoint, components.policy, with_optimizer=False)

    return LoadedRun(read_while_training(read, selected, path, which), components)


#: How often eval, generate and export pick a run's ``best`` or ``latest`` checkpoint again where the run, training
#: now, deleted the one they picked before they read it (``train.keep_checkpoints``).
PICKS = 3


def read_while_training(read: Callable[[Path], None], selected: Selected, path: Path, which: str) -> Selected:
    """``read(selected.checkpoint)``, and the checkpoint read. A run training now deletes its older checkpoints as it
    saves new ones: one deleted before it was read is picked again where ``which`` is ``best`` or ``latest`` (it was
    said to be gone, with advice to write another into the live run's ``latest``), else one line says what happened."""
    picks = 1
    while True:
        try:
            read(selected.checkpoint)
            return selected
        except FileNotFoundError:
            holder = holder_of(selected.run_dir)
            if selected.checkpoint.exists() or holder is None:
                raise
            if which not in ("best", "latest") or Path(path).resolve() == selected.checkpoint or picks == PICKS:
                raise FileNotFoundError(
                    f"checkpoint {selected.checkpoint} was deleted before it could be read by the run training in "
                    f"{selected.run_dir} ({holder}), which keeps only its last train.keep_checkpoints: ask for --step "
                    "latest or best (picked again if deleted), or wait for the run to end") from None
            selected, picks = picked(path, which), picks + 1


def picked(path: Path, which: str) -> Selected:
    """:func:`select_checkpoint`, picked again where a run training now deleted the checkpoint it named in the instant
    between naming and reading it (its ``latest`` moved on to the next one saved): that was one line of error."""
    picks = 1
    while True:
        try:
            return select_checkpoint(path, which)
        except FileNotFoundError:
            if picks == PICKS or which not in ("best", "latest") or holder_of(Path(path).resolve()) is None:
                raise
            picks += 1
