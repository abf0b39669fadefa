"""Samplers over an HF causal LM in this process: today's plain decode loop, and a faster native one.

Both draw one uniform per row and step from the caller's generator, for every row of the request
whether or not it is still decoding, so the random stream does not depend on how the batch is laid
out: the native sampler's compaction and shared prefill leave the samples unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterable, Sequence

import torch

from nemo_jq.models.common import autocast_context, check_precision, in_memory_target
from nemo_jq.models.routes import RouteRecorder
from nemo_jq.precision import autocast_dtype_now
from nemo_jq.rollouts.sampling import Sample, SamplingSettings, as_groups, check_request


def left_pad(prompts: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask, so every row's next token is at the end."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The keyword the model's forward takes its KV cache by, read from its signature once per class: ``cache`` from
    transformers 5.24 on (which warns at every call given the old name), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def decode_attention():
    """Scaled dot-product attention without cuDNN's kernel: it builds an execution plan for every new shape, and a
    decode's shape changes at every step (one more key) and compaction (fewer rows). On an H100 (torch 2.11) it was
    the attention torch chose, and its plans took 57% of the native sampler's time, 1.8 ms of CPU a call
    (bench/results/real_gpu.json); FlashAttention or memory-efficient attention take any shape without one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class HFSampler:
    """The plain decode loop: every prompt copied M times, prefilled, and decoded to the longest row
    over HF's growing cache (what the trainer used before the native sampler; the benchmark's baseline).
    ``record_routes``: a Qwen3-MoE's samples carry the experts each position was routed to (routing replay)."""

    tensor_parallel = 1

    def __init__(self, model: Any, *, pad_id: int, device: torch.device, precision: str = "auto",
                 settings: SamplingSettings = SamplingSettings(), kv_cache_tokens: int | None = None,
                 record_routes: bool = False):
        self.model, self.pad_id, self.device, self.record_routes = model, pad_id, device, record_routes
        self.precision, self.settings = check_precision(precision), settings
        #: The most tokens of keys and values held at once (rows x (prompt + new tokens)); None: no bound.
        self.kv_cache_tokens = kv_cache_tokens
        self.cache_keyword = cache_keyword(type(model))

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (a tied head arrives as, or with, the embedding)."""
        target = self.model.state_dict()  # views of the parameters
        received, unexpected = set(), set()
        for name, tensor in tensors:
            placed = in_memory_target(name, target)  # a Qwen3-MoE's expert: its slice of the fused experts
            if placed is None:
                unexpected.add(name)
                continue
            received.add(placed[0])
            placed[1].copy_(tensor)
        missing = set(target) - received - {"lm_head.weight"}
        if unexpected or missing:
            raise RuntimeError(f"weights for the sampler: missing {sorted(missing)}, unexpected {sorted(unexpected)}")

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        with autocast_context(self.device, self.precision), decode_attention():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **{self.cache_keyword: cache},
                             use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _prefill(self, prompts: Sequence[list[int]], num_samples: int, max_new_tokens: int):
        """``(logits [n, V], cache, mask, positions)`` for the ``n = B * M`` rows, prompt-major."""
        from transformers import DynamicCache

        ids, mask = left_pad([p for p in prompts for _ in range(num_samples)], self.pad_id, self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        return self._forward(ids, mask, positions, cache), cache, mask, positions[:, -1:]

    def _compact(self, cache: Any, keep: torch.Tensor, batch_rows: int) -> bool:
        """Whether to drop the finished rows from the batch now (``keep``: the rows to keep); never here."""
        return False

    def sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
               generator: torch.Generator, greedy: bool = False, routes: bool = True) -> list[list[Sample]]:
        """As the protocol says; prompts are sampled in chunks of whole groups whose keys and values fit
        ``kv_cache_tokens`` (at least one prompt's M rows at a time), so memory is bounded whatever B x M."""
        check_request(prompts, num_samples, max_new_tokens)
        per_chunk = self.prompts_per_chunk(prompts, num_samples, max_new_tokens)
        return [group for start in range(0, len(prompts), per_chunk)
                for group in self._sample(prompts[start:start + per_chunk], num_samples, stop_ids=stop_ids,
                                          max_new_tokens=max_new_tokens, generator=generator, greedy=greedy,
                                          routes=routes and self.record_routes)]

    def prompts_per_chunk(self, prompts: Sequence[list[int]], num_samples: int, max_new_tokens: int) -> int:
        """How many of ``prompts`` one chunk samples at once: as many whole groups as ``kv_cache_tokens`` holds."""
        if self.kv_cache_tokens is None:
            return len(prompts)
        return max(1, self.kv_cache_tokens // ((max(map(len, prompts)) + max_new_tokens) * num_samples))

    @torch.inference_mode()
    def _sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
                generator: torch.Generator, greedy: bool, routes: bool) -> list[list[Sample]]:
        settings = SamplingSettings(temperature=0.0) if greedy else self.settings
        n = len(prompts) * num_samples
        self.model.eval()
        tokens = torch.full((n, max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=self.device)
        stopped = torch.zeros(n, dtype=torch.bool, device=self.device)
        stops = torch.tensor(list(stop_ids), dtype=torch.long, device=self.device)

        with RouteRecorder(self.model) if routes else contextlib.nullcontext() as recorder:
            logits, cache, mask, positions = self._prefill(prompts, num_samples, max_new_tokens)
            width = mask.shape[1]
            routes = None if recorder is None else recorder.prefilled(width, n, max_new_tokens)
            rows = torch.arange(n, device=self.device)  # the request's row of each batch row
            live = torch.ones(n, dtype=torch.bool, device=self.device)  # per batch row: still decoding
            for step in range(max_new_tokens):
                uniforms = torch.rand(n, generator=generator, device=generator.device).to(self.device)[rows]
                token, logprob = settings.next_tokens(logits, uniforms)
                tokens[rows[live], step], logprobs[rows[live], step] = token[live], logprob[live]
                ends = live & torch.isin(token, stops)
                stopped[rows[ends]] = True
                lengths[rows[ends]] = step + 1
                live &= ~ends
                if step + 1 == max_new_tokens or not bool(live.any()):
                    break
                if self._compact(cache, live, len(rows)):
                    cache.batch_select_indices(live.nonzero().squeeze(1))
                    token, mask, positions, rows = token[live], mask[live], positions[live], rows[live]
                    live = live[live]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions + 1
                logits = self._forward(token.unsqueeze(1), mask, positions, cache)
                if routes is not None:  # the token sampled at this step, fed back at position width + step
                    routes[rows, width + step] = recorder.take(1)[:, 0]

        samples = samples_from(tokens.cpu(), logprobs.cpu(), lengths.cpu(), stopped.cpu(), num_samples)
        if routes is not None:
            routes = routes.cpu()
            for i, sample in enumerate(sample for group in samples for sample in group):
                start = width - len(prompts[i // num_samples])  # after the row's left padding
                sample.routes = routes[i, start:width + len(sample.token_ids)].clone()  # not a view of all rows'
        return samples


def samples_from(tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor,
                 num_samples: int) -> list[list[Sample]]:
    """``[B][num_samples]`` samples from a decode's host outputs: each row's first ``lengths[i]`` tokens and log-probs."""
    lengths, stopped = lengths.tolist(), stopped.tolist()
    samples = [Sample(tokens[i, :lengths[i]].tolist(), stopped[i], logprobs[i, :lengths[i]].tolist())
               for i in range(len(lengths))]
    return as_groups(samples, num_samples)


def preallocated_cache(num_layers: int, capacity: int,
                       buffers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """An HF cache whose layers hold their keys and values in buffers sized once for prompt plus
    budget: a decode step writes one position instead of copying the whole cache (as HF's growing
    cache does by concatenation). ``buffers``: each layer's (keys, values) to write into, [rows, heads,
    ``capacity``, dim] (else allocated at the first write)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class PreallocatedLayer(PreallocatedCacheLayer, DynamicLayer):
        pass

    return Cache(layers=[PreallocatedLayer(capacity, buffers[i] if buffers else None) for i in range(num_layers)])


class PreallocatedCacheLayer:
    """The buffers and their bookkeeping; mixed into HF's ``DynamicLayer`` for the rest of its interface."""

    def __init__(self, capacity: int, buffers: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.capacity, self.length = capacity, 0
        if buffers is not None:
            self._keys, self._values = buffers
            self.dtype, self.device, self.is_initialized = self._keys.dtype, self._keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # in the compute dtype: under bf16 autocast Qwen3's fp32 norm weights make fp32 keys
            rows, heads, _, _ = key_states.shape
            dtype = autocast_dtype_now(key_states.device.type) or key_states.dtype
            self._keys = key_states.new_empty((rows, heads, self.capacity, key_states.shape[-1]), dtype=dtype)
            self._values = value_states.new_empty((rows, heads, self.capacity, value_states.shape[-1]), dtype=dtype)
            self.is_initialized = True
        end = self.length + key_states.shape[-2]
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity

    def _rebuild(self, rows) -> None:
        """New buffers holding ``rows`` (an index or a repeat) of the filled part only."""
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            filled = rows(old[:, :, :self.length])
            new = old.new_empty((filled.shape[0], *old.shape[1:]))
            new[:, :, :self.length] = filled
            setattr(self, name, new)
        self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebuild(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebuild(lambda t: t[indices])


class NativeSampler(HFSampler):
    """The decode loop made cheaper for M samples per prompt: one prefill per prompt, its cache
    repeated for the M continuations; a preallocated cache; and finished rows leave the batch
    (once an eighth of it has finished, so the copy is paid rarely) instead of decoding padding."""

    def _prefill(self, prompts: Sequence[list[int]], num_samples: int, max_new_tokens: int):
        ids, mask = left_pad(prompts, self.pad_id, self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
        cache = preallocated_cache(layers, ids.shape[1] + max_new_tokens)
        logits = self._forward(ids, mask, positions, cache)
        cache.batch_repeat_interleave(num_samples)
        return (logits.repeat_interleave(num_samples, dim=0), cache, mask.repeat_interleave(num_samples, dim=0),
                positions[:, -1:].repeat_interleave(num_samples, dim=0))

    def _compact(self, cache: Any, keep: torch.Tensor, batch_rows: int) -> bool:
        return int(keep.sum()) <= batch_rows * 7 // 8
