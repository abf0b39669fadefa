"""Sampling is quiet on every supported transformers: transformers 5.24 renamed the forward's ``past_key_values`` to
``cache`` and warns (a FutureWarning) at every call given the old name, i.e. at every decode step; the samplers pass
the name the model's forward takes (README.md, "Install": the unconstrained install resolves the newest transformers,
CI pins .ci/constraints.txt's)."""

import inspect
import warnings

import pytest
import torch
from transformers import Qwen3ForCausalLM

from helpers import rollout_engine, tiny_setup
from nemo_jq.rollouts.hf import cache_keyword


def _rollouts(model, chat, sampler):
    """Samples and log-probs of two prompts (four samples each, thinking and answers) under a fixed seed."""
    engine = rollout_engine(model, chat, budget=8, sampler=sampler)
    prompts = [[chat.pad_id + 1] * 3, [chat.pad_id + 2] * 5]
    groups = engine.generate(prompts, 4, sample_answers=True, generator=torch.Generator().manual_seed(5))
    return [(r.rationale_ids, r.answer_ids, r.rationale_logprobs) for g in groups for r in g]


@pytest.mark.parametrize("sampler", ["native", "hf"])
def test_sampling_on_the_installed_transformers_raises_no_warning(sampler):
    _, _, chat, model = tiny_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every warning, FutureWarning and DeprecationWarning included, fails the test
        _rollouts(model, chat, sampler)


class RenamedCacheQwen3(Qwen3ForCausalLM):
    """A stand-in for transformers 5.24's Qwen3 where an older transformers is installed (as CI's pin is): its forward
    takes the cache as ``cache`` and warns, as 5.24's does, when given ``past_key_values``."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0,
                **kwargs):
        if "past_key_values" in kwargs:
            warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0 for "
                          "`Qwen3ForCausalLM.forward`. Use `cache` instead.", FutureWarning, stacklevel=2)
            cache = kwargs.pop("past_key_values")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=cache, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)


@pytest.mark.skipif("cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters,
                    reason="the installed transformers takes `cache` itself: the test above runs on the real one")
@pytest.mark.parametrize("sampler", ["native", "hf"])
def test_a_forward_that_takes_cache_gets_it_by_that_name_and_samples_the_same(sampler):
    _, _, chat, model = tiny_setup()
    expected = _rollouts(model, chat, sampler)
    model.__class__ = RenamedCacheQwen3
    assert cache_keyword(RenamedCacheQwen3) == "cache" and cache_keyword(Qwen3ForCausalLM) == "past_key_values"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _rollouts(model, chat, sampler) == expected  # the same samples and log-probs, bit for bit
