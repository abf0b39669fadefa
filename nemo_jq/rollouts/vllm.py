"""A vLLM sampler (optional ``vllm`` extra), colocated with training on the same GPUs.

Only :meth:`VLLMSampler.sample`'s ``llm.generate`` call and the weight hand-off in
:meth:`VLLMSampler.load_weights` touch vLLM; the request building and output conversion around them
are plain functions tested on CPU. None of this has run against a real vLLM yet (it installs on
neither our CPU machines nor the GPU machines lent to us): README.md, "Rollout engines".
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from nemo_jq.rollouts.sampling import Sample, SamplingSettings, check_request, seed_from


def sampling_params_kwargs(settings: SamplingSettings, *, num_samples: int, stop_ids: Sequence[int], max_new_tokens: int,
                           seed: int) -> dict[str, Any]:
    """``vllm.SamplingParams`` arguments for one request; truncation only when the settings ask for it,
    so vLLM's own defaults (no top-k, no top-p) hold otherwise. ``logprobs=0``: the sampled token's own
    log-prob, which vLLM reports before temperature or truncation (``logprobs_mode="raw_logprobs"``)."""
    kwargs = {"n": num_samples, "stop_token_ids": list(stop_ids), "max_tokens": max_new_tokens, "seed": seed,
              "temperature": settings.temperature, "logprobs": 0, "skip_special_tokens": False}
    if settings.top_k > 0:
        kwargs["top_k"] = settings.top_k
    if settings.top_p < 1.0:
        kwargs["top_p"] = settings.top_p
    return kwargs


def sample_from_completion(completion: Any) -> Sample:
    """A vLLM ``CompletionOutput`` as a :class:`Sample`: the stop id kept at the end (vLLM keeps stop
    token ids in ``token_ids``; added back if a version drops it) and the sampled tokens' log-probs."""
    token_ids = list(completion.token_ids)
    stopped = completion.finish_reason == "stop"
    if stopped and isinstance(completion.stop_reason, int) and token_ids[-1:] != [completion.stop_reason]:
        token_ids.append(completion.stop_reason)
    logprobs = None
    if completion.logprobs is not None and len(completion.logprobs) == len(token_ids):
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, token_ids)]
    return Sample(token_ids, stopped, logprobs)


def llm_kwargs(model_dir: str, *, tensor_parallel: int, gpu_memory_utilization: float, max_model_len: int | None,
               seed: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments. Tensor parallel uses vLLM's external launcher: every torchrun process builds
    its own ``LLM`` and vLLM joins ``tensor_parallel`` consecutive ranks into one engine (its workers are
    those processes, not new ones), so each of them must call ``generate`` with the same requests."""
    kwargs = {"model": model_dir, "enable_sleep_mode": True, "gpu_memory_utilization": gpu_memory_utilization,
              "max_model_len": max_model_len, "seed": seed, "dtype": "bfloat16", "logprobs_mode": "raw_logprobs",
              "tensor_parallel_size": tensor_parallel}
    if tensor_parallel > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


class VLLMSampler:
    """``vllm.LLM`` inside this training process, on this rank's GPU, asleep while the policy trains:
    ``load_weights`` wakes its weights and loads the policy's (full tensors; vLLM shards and casts them
    itself), ``sample`` wakes the KV cache, generates, and puts both back to sleep. With
    ``tensor_parallel`` > 1 the engine spans that many consecutive ranks (:func:`llm_kwargs`), which
    refit and sample in step (``RefittedRolloutEngine`` sees to it)."""

    def __init__(self, model_dir: str, *, settings: SamplingSettings, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel: int = 1):
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its model is reachable
        from vllm import LLM

        self.settings, self.tensor_parallel = settings, tensor_parallel
        self.llm = LLM(**llm_kwargs(model_dir, tensor_parallel=tensor_parallel, gpu_memory_utilization=gpu_memory_utilization,
                                    max_model_len=max_model_len, seed=seed))
        self._awake = {"weights", "kv_cache"}
        self._sleep()

    def _wake(self, *tags: str) -> None:
        missing = [tag for tag in tags if tag not in self._awake]
        if missing:
            self.llm.wake_up(tags=missing)
            self._awake.update(missing)

    def _sleep(self) -> None:
        self.llm.sleep(level=1)  # weights to host memory, KV cache freed: the GPU is the trainer's again
        self._awake.clear()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._wake("weights")
        self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(tensors)

    def sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
               generator: torch.Generator, greedy: bool = False) -> list[list[Sample]]:
        from vllm import SamplingParams

        check_request(prompts, num_samples, max_new_tokens)
        settings = SamplingSettings(temperature=0.0) if greedy else self.settings
        params = [SamplingParams(**sampling_params_kwargs(settings, num_samples=num_samples, stop_ids=stop_ids,
                                                          max_new_tokens=max_new_tokens, seed=seed_from(generator)))
                  for _ in prompts]
        self._wake("weights", "kv_cache")
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        finally:
            self._sleep()
        return [[sample_from_completion(c) for c in output.outputs] for output in outputs]
