"""How a rollout engine gets its weights, decided in one place for every backend.

On a training rank of a split world (``rollout.placement=separate``) the engine asks the rollout ranks, which hold
the weights they are sent (:class:`~nemo_jq.rollouts.ranks.RemoteRollouts`): no engine or HF copy is built there.
Otherwise three ways, by the engine and the run: an engine that loads a folder (``rollout.engine`` not in-place:
vLLM) starts from the starting weights' HF folder and is refitted after every step; an in-place sampler (native, hf)
decodes its own HF copy, refitted likewise, where the backend gives one (rollouts sampled one step ahead, which sample
while the policy trains; a Megatron policy, whose weights are not an HF model); else it decodes the policy's HF model
itself.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_jq.models.interfaces import Policy, RolloutEngine
from nemo_jq.rollouts import IN_PLACE, SamplerRequest, build_rollouts
from nemo_jq.rollouts.ranks import RemoteRollouts
from nemo_jq.rollouts.refit import RefittedRolloutEngine
from nemo_jq.runtime import distributed


def compose_engine(policy: Policy, *, config: Any, chat: Any, device: torch.device, model_dir: Path | None,
                   in_place_model: Any = None, own_copy: Callable[[], Any] | None = None) -> RolloutEngine:
    """``config.rollout.engine`` over ``policy``'s weights. ``model_dir``: the local HF folder the run starts from
    (None: a model built in this process); ``in_place_model``: the policy's own HF model, which an in-place sampler
    may decode; ``own_copy()``: the HF copy an in-place sampler decodes instead (it is refitted from the policy)."""
    def request(model: Any, folder: Path | None = None) -> SamplerRequest:
        return SamplerRequest(model, folder, config, chat.pad_id, device)

    roles = distributed.roles()
    if roles is not None:  # a training rank of a split world: no engine or copy here, the rollout ranks sample
        return RemoteRollouts(policy, roles, config.rollout.bucket_bytes())

    if config.rollout.engine not in IN_PLACE:  # an engine with its own weights: no HF copy anywhere
        folder = starting_weights_dir(policy, chat, model_dir)
        return RefittedRolloutEngine(build_rollouts(request(None, folder), chat), policy)
    if own_copy is not None:
        return RefittedRolloutEngine(build_rollouts(request(own_copy()), chat), policy)
    if in_place_model is None:
        raise ValueError(f"rollout.engine={config.rollout.engine} decodes an HF model in place, and this backend's "
                         "policy gives neither its own nor a copy")
    return build_rollouts(request(in_place_model), chat)


def starting_weights_dir(policy: Policy, chat: Any, model_dir: Path | None) -> Path:
    """A local HF folder of the weights the run starts from, for an engine that loads a folder: ``model_dir``, or the
    policy's export into a temporary folder (a model built from scratch; one node: the writer's disk)."""
    if model_dir is not None:
        return model_dir
    folder = Path(distributed.on_writer(scratch_model_dir))
    policy.export(folder, chat.tokenizer)
    return folder


def scratch_model_dir() -> str:
    """A temporary folder for starting weights, removed when this process exits."""
    folder = tempfile.mkdtemp(prefix="nemo_jq_starting_weights_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
