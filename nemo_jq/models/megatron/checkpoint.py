"""Megatron distributed checkpoints of a ``GPTModel`` shard and its AdamW state, loadable at any TP size.

Every rank writes its own shard with ``megatron.core.dist_checkpointing``; the checkpoint stores
each tensor in its global (unsharded) layout, so a run saved at one tensor-parallel size resumes
at another: each rank reads just the slices its new shard needs, and no rank ever holds the whole
model. AdamW's moments are sharded exactly like their parameters (megatron-core's
``optim_state_to_sharding_state``), and its step count, shared by all parameters, is stored once.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException

from nemo_jq.models.megatron import transformer_engine_usable
from nemo_jq.models.megatron.provider import Qwen3Architecture, read_qwen3_config
from nemo_jq.models.megatron.zero import DenseAndExpertAdamW, DistributedAdamW
from nemo_jq.runtime.checkpoint import damaged
from nemo_jq.typed import first_few

transformer_engine_usable()  # before importing megatron.core
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory  # noqa: E402
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)

#: The distributed checkpoint's folder inside a nemo_jq checkpoint directory.
SHARDED_DIR = "megatron"
_MODEL, _OPTIMIZER, _ARCH, _STEP = "model", "optimizer", "hf_config", "common_step"
_HAS_OPTIMIZER = "has_optimizer_state"
#: The request's entry for a distributed optimizer's reads (a name no saved entry has).
_ZERO_SHARD = "zero_shard"


def has_sharded_checkpoint(directory: Path) -> bool:
    return (Path(directory) / SHARDED_DIR / "metadata.json").exists()


def save_sharded(directory: Path, model: Any, optimizer: torch.optim.Optimizer, arch: Qwen3Architecture) -> None:
    """Write ``directory/megatron`` (a collective: every rank of the world calls it)."""
    target = Path(directory) / SHARDED_DIR
    target.mkdir(parents=True, exist_ok=True)
    model_state = model.sharded_state_dict()
    state = {_MODEL: model_state, _ARCH: arch.hf_config, _HAS_OPTIMIZER: bool(optimizer.state)}
    if optimizer.state:
        state[_OPTIMIZER] = _sharded_optimizer_state(model_state, optimizer)
    _start_writer_helpers()
    dist_checkpointing.save(state, str(target))


#: The signals that stop a run with a checkpoint and reach every process of a job step, or of a torchrun worker's
#: process group (SLURM's time limit, ``scancel``, torchrun's own SIGTERM, a closed terminal): megatron-core's writer
#: helpers never act on them (Ctrl-C's SIGINT its manager ignores itself).
STOP_SIGNALS = {signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP}


def _start_writer_helpers() -> None:
    """Start megatron-core's long-lived checkpoint-writer helpers (a multiprocessing manager for the write results,
    and multiprocessing's resource tracker) with :data:`STOP_SIGNALS` blocked, so that they never act on them: a
    helper killed by the signal that asks for the stop's checkpoint breaks that save (rank 0's BrokenPipeError while
    the others wait at a barrier, until the hard kill: under torchrun a SIGTERM left ``.tmp-step_...`` and no
    checkpoint). They end as the process does (multiprocessing shuts its manager down at exit), or by SIGKILL with
    the job. A stop signal to this process meanwhile stays pending, and is handled once unblocked."""
    from multiprocessing import resource_tracker

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", True) is not None:  # started already (or another megatron-core)
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()  # first: starting it unblocks SIGINT and SIGTERM here (CPython's own)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        filesystem_async._get_write_results_queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def load_sharded(directory: Path, model: Any, optimizer: torch.optim.Optimizer | DistributedAdamW | DenseAndExpertAdamW | None,
                 arch: Qwen3Architecture) -> None:
    """Fill this rank's shard of ``model`` (and ``optimizer``'s state) from ``directory/megatron``.

    A :class:`DistributedAdamW` reads only its data-parallel shard of the AdamW state (``_zero_shard_reads``),
    never the whole replicated state the checkpoint stores.

    Raises ``ValueError`` when the checkpoint belongs to another architecture or lacks a weight
    (naming the key), and ``FileNotFoundError`` when optimizer state is asked for but was not saved.
    """
    source = Path(directory) / SHARDED_DIR
    common = _common_state(source, arch)
    if optimizer is not None and not common[_HAS_OPTIMIZER]:
        raise FileNotFoundError(f"checkpoint {directory} holds no optimizer state (saved before the first step)")
    model_state = model.sharded_state_dict()
    with reading(source):
        saved = set(dist_checkpointing.load_tensors_metadata(str(source)))
    missing = sorted({value.key for value in nested_values(model_state) if isinstance(value, (ShardedTensor, ShardedTensorFactory))}
                     - saved)
    if missing:
        raise ValueError(f"checkpoint {source} lacks {len(missing)} weight(s) this model needs: "
                         f"{first_few(missing, repr)}")
    request = {_MODEL: model_state}
    with_master = any(key.startswith(f"{_OPTIMIZER}.state.master.") for key in saved)
    # a distributed optimizer's parts (a Qwen3-MoE's: the dense weights' and the experts'), each reading its shard
    zero = list(optimizer.parts) if isinstance(optimizer, DenseAndExpertAdamW) else (
        [optimizer] if isinstance(optimizer, DistributedAdamW) else [])
    targets = [part.state_to_load(with_master) for part in zero]
    partial_rows = []
    if zero:
        request[_ZERO_SHARD] = []
        for part, wanted in zip(zero, targets):
            reads, rows = _zero_shard_reads(model_state, part, wanted)
            request[_ZERO_SHARD] += reads
            partial_rows += rows
    elif optimizer is not None:
        _initialise_adam_state(optimizer, with_master=with_master)
        request[_OPTIMIZER] = _sharded_optimizer_state(model_state, optimizer)
    with reading(source):
        loaded = dist_checkpointing.load(request, str(source))
    model.load_state_dict(loaded[_MODEL], strict=True)
    for rows, target, at, (start, end) in partial_rows:
        target[at:at + end - start].copy_(rows.reshape(-1)[start:end])
    for part, wanted in zip(zero, targets):
        part.load_shard(wanted, loaded[_OPTIMIZER]["state"][_STEP])
    if optimizer is not None and not zero:
        _load_optimizer_state(optimizer, loaded[_OPTIMIZER])


def _zero_shard_reads(model_state: dict[str, Any], optimizer: DistributedAdamW, targets: dict[str, torch.Tensor]
                      ) -> tuple[list[ShardedTensor], list[tuple[torch.Tensor, torch.Tensor, int, tuple[int, int]]]]:
    """The reads that fill ``targets`` (this rank's shard of each state vector: ``exp_avg``, ``...``) from the
    checkpoint's per-parameter state, which is stored like the parameters, and nothing else.

    Each parameter's elements in the shard (``optimizer.pieces``) are whole rows of its local tensor (or of a
    part of it that megatron-core stores apart, as the gate and up halves of SwiGLU's ``linear_fc1``), between at
    most two partial rows. Whole rows are read straight into a view of the target; a partial row is read into a
    row of its own, returned as ``(row, target, position in the target, (start, end) in the row)`` to copy in
    after the load. Each read is an irregular chunk of the stored tensor (``axis_fragmentations=None``), which
    megatron-core's ``torch_dist`` format reads as a plain DCP chunk whatever the saved layout.
    """
    entries = get_param_id_to_sharded_param_map(model_state, optimizer.params)
    reads, partial_rows = [], []
    for index, first, last, at, _ in optimizer.pieces:
        parts = _stored_parts(entries[index])
        if sum(part.data.numel() for part, _ in parts) != optimizer.params[index].numel():
            raise ValueError(f"{entries[index].key} is stored in parts that do not cover the parameter")
        for part, offset in parts:
            width = math.prod(part.local_shape[1:])
            start, end = max(first, offset) - offset, min(last, offset + part.data.numel()) - offset
            whole_start, whole_end = -(-start // width) * width, end // width * width
            spans = [(start, min(end, whole_start)), (whole_start, whole_end), (max(whole_start, whole_end), end)]
            for span_start, span_end in spans:
                if span_start >= span_end:
                    continue
                row, row_end = span_start // width, -(-span_end // width)
                into = at + offset + span_start - first
                for key, target in targets.items():
                    shape = (1,) * part.prepend_axis_num + (row_end - row, *part.local_shape[1:])
                    whole_rows = span_start % width == 0 and span_end % width == 0
                    data = target[into:into + span_end - span_start].view(shape) if whole_rows else (
                        torch.empty(shape, dtype=target.dtype, device=target.device))
                    if not whole_rows:
                        partial_rows.append((data, target, into, (span_start - row * width, span_end - row * width)))
                    reads.append(_rows_of(part, row, f"{_OPTIMIZER}.state.{key}.", data))
    return reads, partial_rows


def _stored_parts(entry: ShardedTensor | ShardedTensorFactory) -> list[tuple[ShardedTensor, int]]:
    """The ShardedTensors a parameter is stored as (a factory's, built on a meta tensor), each with its first
    element's position in the parameter's flattened local tensor."""
    if isinstance(entry, ShardedTensorFactory):
        parts = list(nested_values(replace(entry, data=torch.empty_like(entry.data, device="meta")).build()))
    else:
        parts = [replace(entry, data=torch.empty(entry.local_shape, dtype=entry.dtype, device="meta"))]
    for part in parts:
        if not part.data.is_contiguous():
            raise ValueError(f"{part.key} is stored in non-contiguous parts; the distributed optimizer cannot read them")
    return [(part, part.data.storage_offset()) for part in parts]


def _rows_of(part: ShardedTensor, row: int, prefix: str, data: torch.Tensor) -> ShardedTensor:
    """A read of rows ``row : row + len`` of ``part`` (its first local axis) into ``data`` under the key
    ``prefix + part.key``; the prepended axes (a layer's index) are written out, as the read is irregular."""
    axis = part.prepend_axis_num
    offset = (*part.global_offset[:axis], part.global_offset[axis] + row, *part.global_offset[axis + 1:])
    return ShardedTensor(key=prefix + part.key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                         global_shape=part.global_shape, global_offset=offset, axis_fragmentations=None,
                         replica_id=part.replica_id, allow_shape_mismatch=part.allow_shape_mismatch)


@contextlib.contextmanager
def reading(source: Path) -> Iterator[None]:
    """megatron-core reading the distributed checkpoint ``source``: a file of it cut short or corrupt (a copy, a full
    disk elsewhere) is :func:`~nemo_jq.runtime.checkpoint.damaged`, one line naming the folder, what broke and the
    run's other steps, where megatron-core and torch's distributed checkpoint raised their own tracebacks."""
    try:
        yield
    except (CheckpointException, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        if isinstance(err, CheckpointException):  # each failing rank's own exception, gathered: the first says it
            err = next(iter(err.failures.values()))[0]
        words = str(err).strip().splitlines()
        raise damaged(source, f"truncated or corrupt: {type(err).__name__}"
                      + (f": {words[0][:160]}" if words else "")) from None


def _common_state(source: Path, arch: Qwen3Architecture) -> dict[str, Any]:
    """The checkpoint's non-tensor state, once its architecture is checked against ``arch``."""
    if not (source / "metadata.json").exists():
        raise FileNotFoundError(f"checkpoint {source.parent} is missing {SHARDED_DIR}/ (a Megatron distributed checkpoint)")
    with reading(source):
        common = dist_checkpointing.load_common_state_dict(str(source))
    saved = read_qwen3_config(common[_ARCH])
    differing = [name for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "tie_word_embeddings")
                 if getattr(saved, name) != getattr(arch, name)]
    if differing:
        raise ValueError(f"checkpoint {source} was saved from another model: "
                         + ", ".join(f"{name} {getattr(saved, name)} there, {getattr(arch, name)} here" for name in differing))
    return common


def _sharded_optimizer_state(model_state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each moment a ShardedTensor placed like its parameter."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own: copy before changing
    steps = {float(entry["step"]) for entry in state["state"].values() if "step" in entry}
    state["state"] = {index: {key: value for key, value in entry.items() if key != "step"}
                      for index, entry in state["state"].items()}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's parameters are at different steps {sorted(steps)}; they must share one")
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_state, params))
    state["state"][_STEP] = torch.tensor(steps.pop() if steps else 0.0)
    return state


def _initialise_adam_state(optimizer: torch.optim.Optimizer, *, with_master: bool) -> None:
    """fp32 zero moments (and master weights, where the checkpoint has them: a bf16-weights run's) for parameters
    that have none yet, as ``torch.optim.AdamW`` would make on its first step, so that the state to load into has
    every tensor's shape."""
    keys = ("exp_avg", "exp_avg_sq", *(("master",) if with_master else ()))
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param] = {"step": torch.tensor(0.0),
                                          **{key: torch.zeros_like(param, dtype=torch.float32) for key in keys}}


def _load_optimizer_state(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Load the moments and the shared step; hyperparameters stay this optimizer's own (the trainer sets the lr).
    Assigned as loaded, in fp32 (``Optimizer.load_state_dict`` would cast them to a bf16 parameter's dtype)."""
    step = loaded["state"].pop(_STEP)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, entry in loaded["state"].items():
        optimizer.state[params[index]] = {**entry, "step": step.clone()}
