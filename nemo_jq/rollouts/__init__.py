"""Rollouts: thinking budgets once (:mod:`.budget`) over a sampling primitive each engine implements.

``rollout.engine`` picks the sampler from :data:`SAMPLERS`: ``native`` (default; shared prefill,
preallocated cache, compaction), ``hf`` (the plain decode loop), ``vllm`` (optional extra, GPU).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nemo_jq.rollouts.budget import BudgetedRollouts
from nemo_jq.rollouts.hf import HFSampler, NativeSampler
from nemo_jq.rollouts.sampling import Sample, Sampler, SamplingSettings

#: ``builder(model, config, pad_id, device) -> Sampler``; ``model`` is the HF model the run starts from.
SamplerBuilder = Callable[[Any, Any, int, torch.device], Sampler]


def _settings(config: Any) -> SamplingSettings:
    rollout = config.rollout
    return SamplingSettings(rollout.temperature, rollout.top_k, rollout.top_p)


def _in_this_process(sampler_class: type) -> SamplerBuilder:
    def build(model, config, pad_id, device):
        return sampler_class(model, pad_id=pad_id, device=device, precision=config.model.precision, settings=_settings(config))

    return build


def _vllm(model, config, pad_id, device):
    from nemo_jq.rollouts.vllm import VLLMSampler

    return VLLMSampler(config.model.path, settings=_settings(config), seed=config.train.seed,
                       tensor_parallel=config.rollout.tensor_parallel)


SAMPLERS: dict[str, SamplerBuilder] = {"native": _in_this_process(NativeSampler), "hf": _in_this_process(HFSampler),
                                       "vllm": _vllm}
#: Samplers that decode the HF model they are given in place (the rest hold their own copy and need refits).
IN_PLACE = ("native", "hf")


def build_rollouts(model: Any, config: Any, chat: Any, device: torch.device) -> BudgetedRollouts:
    """The run's rollout engine: its sampler under the thinking and answer budgets."""
    rollout = config.rollout
    sampler = SAMPLERS[rollout.engine](model, config, chat.pad_id, device)
    return BudgetedRollouts(sampler, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                            max_thinking_tokens=rollout.max_thinking_tokens, max_answer_tokens=rollout.max_answer_tokens)


__all__ = ["BudgetedRollouts", "IN_PLACE", "SAMPLERS", "Sample", "Sampler", "SamplingSettings", "build_rollouts"]
