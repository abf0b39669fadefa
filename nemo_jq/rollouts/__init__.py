"""Rollouts: thinking budgets once (:mod:`.budget`) over a sampling primitive each engine implements.

``rollout.engine`` picks the sampler from :data:`SAMPLERS`: ``native`` (default; shared prefill,
preallocated cache, compaction), ``hf`` (the plain decode loop), ``vllm`` (optional extra, GPU).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nemo_jq.registry import Registry
from nemo_jq.rollouts.budget import BudgetedRollouts
from nemo_jq.rollouts.hf import HFSampler, NativeSampler
from nemo_jq.rollouts.sampling import Sample, Sampler, SamplingSettings

#: ``builder(model, config, pad_id, device) -> Sampler``; ``model`` is the HF model the run starts from.
SamplerBuilder = Callable[[Any, Any, int, torch.device], Sampler]


#: The registered samplers (``rollout.engine``), and those that decode the HF model they are given in place
#: (the rest hold their own copy, which the backend refits after each step).
SAMPLERS = Registry("rollout engine")
IN_PLACE: set[str] = set()


def register_sampler(name: str, *, in_place: bool = False) -> Callable[[SamplerBuilder], SamplerBuilder]:
    """Decorator adding a sampler builder under ``name`` (docs/extending.md)."""
    if in_place:
        IN_PLACE.add(name)
    return SAMPLERS.register(name)


def _settings(config: Any) -> SamplingSettings:
    rollout = config.rollout
    return SamplingSettings(rollout.temperature, rollout.top_k, rollout.top_p)


def _in_this_process(sampler_class: type) -> SamplerBuilder:
    def build(model, config, pad_id, device):
        return sampler_class(model, pad_id=pad_id, device=device, precision=config.model.precision, settings=_settings(config))

    return build


register_sampler("native", in_place=True)(_in_this_process(NativeSampler))
register_sampler("hf", in_place=True)(_in_this_process(HFSampler))


@register_sampler("vllm")
def _vllm(model, config, pad_id, device):
    from nemo_jq.rollouts.vllm import VLLMSampler

    return VLLMSampler(config.model.path, settings=_settings(config), seed=config.train.seed,
                       tensor_parallel=config.rollout.tensor_parallel)


def build_rollouts(model: Any, config: Any, chat: Any, device: torch.device) -> BudgetedRollouts:
    """The run's rollout engine: its sampler under the thinking and answer budgets."""
    rollout = config.rollout
    sampler = SAMPLERS[rollout.engine](model, config, chat.pad_id, device)
    return BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                            max_thinking_tokens=rollout.max_thinking_tokens, max_answer_tokens=rollout.max_answer_tokens)


__all__ = ["BudgetedRollouts", "IN_PLACE", "SAMPLERS", "Sample", "Sampler", "SamplingSettings", "build_rollouts",
           "register_sampler"]
