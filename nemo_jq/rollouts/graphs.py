"""The native sampler's decode under CUDA graphs: a static KV cache, one graph per row bucket and length bucket.

Why: HF's eager decode step launches ~1,450 kernels (Qwen3-0.6B), so on an H100 the native sampler decoded at 4.7%
of the memory-bandwidth bound, the host launching while the GPU waited (bench/results/real_gpu.json). Here a decode
step is the model family's own step (:data:`DECODE_STEPS`, e.g. :mod:`.qwen3_decode`) over buffers allocated once per
sampling call, followed by the sampling and the bookkeeping, all on the device and with static shapes, so that it can
be captured once and replayed: one launch a step.

* **Row buckets**: the live rows sit at the front of the buffers; a step runs the first ``b`` of them, ``b`` a
  power of two (or the call's row count). When the live rows fit the next smaller bucket they are moved there
  (compaction, on the host's side, a few times a call).
* **Length buckets**: attention reads the first ``length`` columns of the cache, ``length`` the decode position
  rounded up by at most an eighth (:func:`length_bucket`), under a mask of each row's real columns (its left padding
  excluded), so a step reads about each row's real length, not the whole static cache.
* **One graph per (rows, length)** bucket, captured the first time it is needed (that step runs eagerly on the
  capture stream, then is recorded), replayed after, for every chunk of the call; dropped with the call (the
  cache's memory is the rollouts', not training's). A graph reads the sampler's weights where the model holds them
  in the compute dtype (a refit in place is seen by the next replay), else a copy cast once per call.
* **Sampling stays the budget core's**: every row of the request draws one uniform a step from the caller's
  generator (drawn outside the graph, as the eager loop draws it), the tokens are the same inverse-CDF draws, and a
  finished row writes nothing more. On the CPU (and the dry run's stand-in GPU) the same steps run eagerly, which is
  how the suite checks the graph path against :class:`~nemo_jq.rollouts.hf.NativeSampler` token for token.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from nemo_jq.models.common import autocast_dtype
from nemo_jq.registry import Registry
from nemo_jq.rollouts.hf import NativeSampler, decode_attention, left_pad, preallocated_cache, samples_from
from nemo_jq.rollouts.sampling import Sample, SamplingSettings, check_request

#: Decode steps by HF ``model_type``: a class built from ``(model, compute dtype)`` with a ``supports(model)`` check.
DECODE_STEPS = Registry("decode step")


def register_decode_step(model_type: str, *, supports: Callable[[Any], bool]):
    """Decorator: ``model_type``'s decode step, used where ``supports(model)``."""

    def decorate(cls):
        cls.supports = staticmethod(supports)
        return DECODE_STEPS.register(model_type)(cls)

    return decorate


def decode_step_for(model: Any) -> type | None:
    """The registered decode step for ``model`` (None: its family has none, or its shape is not the one it computes)."""
    step = DECODE_STEPS.get(getattr(model.config, "model_type", None))
    return step if step is not None and step.supports(model) else None


def row_bucket(count: int, rows: int) -> int:
    """The fewest rows of a bucket that holds ``count`` live rows: a power of two, or ``rows`` (the call's)."""
    return min(rows, 1 << max(0, count - 1).bit_length())


def length_bucket(need: int, capacity: int) -> int:
    """Columns a step reads when ``need`` hold keys: rounded up to a multiple of an eighth of ``need``'s power of two
    (at least 64), so that at most an eighth more is read and a 4k-token decode passes through ~20 buckets."""
    grain = max(64, 1 << max(0, need.bit_length() - 4))
    return min(capacity, -(-need // grain) * grain)


def attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row and head against ``keys``/``values`` [b, kv_heads, length, d] under ``mask`` [b, length]:
    the query heads sharing a key head are that head's queries (no repeated keys); ``[b, kv_heads, group, d]``."""
    rows, heads, _, dim = q.shape
    grouped = q.reshape(rows, keys.shape[1], heads // keys.shape[1], dim)
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask[:, None, None], scale=scale)


def attend_matmul(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attend_sdpa` as two batched matrix products and a softmax in fp32."""
    rows, heads, _, dim = q.shape
    grouped = q.reshape(rows, keys.shape[1], heads // keys.shape[1], dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(scale)
    scores.masked_fill_(~mask[:, None, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(values.dtype), values)


#: The decode attention kernels, by name (``GraphSampler(attention=...)``). ``matmul`` is the default: at the paper
#: config's chunk (32 rows, contexts 1k-5k) on an H200 its decode reached 0.42 of the bandwidth bound compiled, 0.30
#: not, where SDPA's memory-efficient kernel reached 0.33 and 0.25 (bench/results/real_gpu.json).
ATTENTION = {"sdpa": attend_sdpa, "matmul": attend_matmul}


class Fused:
    """``plain`` under ``torch.compile`` (shapes dynamic); if compiling fails, ``plain`` itself from then on, said once
    (the compiler's failure is not the run's: the same step, unfused). Compiling happens at the first call, which is
    an eager step, never inside a graph's capture."""

    def __init__(self, plain: Callable):
        self.plain, self.compiled = plain, torch.compile(plain, dynamic=True)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as error:  # noqa: BLE001 - any compiler failure: the plain function computes the same
                warnings.warn(f"torch.compile of the decode step's {self.plain.__name__} failed ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); the decode runs unfused (set "
                              "rollout.compile=false to skip trying)", stacklevel=2)
                self.compiled = None
        return self.plain(*args)


_FUSED: dict[Callable, Fused] = {}


def fused(plain: Callable) -> Fused:
    """``plain`` compiled, once a process (every call's steps share it)."""
    if plain not in _FUSED:
        _FUSED[plain] = Fused(plain)
    return _FUSED[plain]


class GraphSampler(NativeSampler):
    """:class:`NativeSampler` whose decode steps run from a static cache, under CUDA graphs on a GPU (eagerly
    elsewhere); its prefill and chunking are the native sampler's. ``graphs``: None = on CUDA devices; ``compiled``:
    each layer's elementwise work fused by ``torch.compile`` (compiled once a process, at the first call)."""

    def __init__(self, model: Any, *, pad_id: int, device: torch.device, precision: str = "auto",
                 settings: SamplingSettings = SamplingSettings(), kv_cache_tokens: int | None = None,
                 graphs: bool | None = None, attention: str = "matmul", compiled: bool = False,
                 record_routes: bool = False):
        super().__init__(model, pad_id=pad_id, device=device, precision=precision, settings=settings,
                         kv_cache_tokens=kv_cache_tokens, record_routes=record_routes)  # a dense Qwen3's: none
        self.step_class = decode_step_for(model)
        if self.step_class is None:
            raise ValueError(f"no decode step is registered for model_type {model.config.model_type!r} with this "
                             f"shape (known: {', '.join(DECODE_STEPS)}): use the native sampler's eager loop")
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self.attention = fused(ATTENTION[attention]) if compiled else ATTENTION[attention]
        self.compiled = compiled

    def _compact(self, cache: Any, keep: torch.Tensor, batch_rows: int) -> bool:
        """Whether the live rows fit the next smaller row bucket."""
        return batch_rows > 1 and int(keep.sum()) <= 1 << (batch_rows - 1).bit_length() - 1

    def weight_bytes(self) -> int:
        """The bytes of weights a decode step reads: the parameters in the compute dtype (the dry run's time bound)."""
        dtype = autocast_dtype(self.device, self.precision)
        size = torch.finfo(dtype).bits // 8 if dtype is not None else None
        return sum(p.numel() * (size if size and p.is_floating_point() else p.element_size()) for p in self.model.parameters())

    def decode_step(self) -> Any:
        """The model family's step over the model's weights (cast to the compute dtype where they are in another)."""
        return self.step_class(self.model, autocast_dtype(self.device, self.precision), compiled=self.compiled)

    def sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
               generator: torch.Generator, greedy: bool = False) -> list[list[Sample]]:
        check_request(prompts, num_samples, max_new_tokens)
        per_chunk = self.prompts_per_chunk(prompts, num_samples, max_new_tokens)
        settings = SamplingSettings(temperature=0.0) if greedy else self.settings
        with torch.inference_mode(), decode_attention():
            self.model.eval()
            state = StaticDecode(self, self.decode_step(), rows=min(per_chunk, len(prompts)) * num_samples,
                                 capacity=max(map(len, prompts)) + max_new_tokens, max_new_tokens=max_new_tokens,
                                 stop_ids=stop_ids, settings=settings)
            return [group for start in range(0, len(prompts), per_chunk)
                    for group in state.sample(prompts[start:start + per_chunk], num_samples, generator)]


class StaticDecode:
    """One sampling call's buffers, graphs and loop. Slot ``i`` of the buffers decodes request row ``slot_rows[i]``;
    slots without a live row write to the spare output row ``trash``."""

    def __init__(self, sampler: GraphSampler, step: Any, *, rows: int, capacity: int, max_new_tokens: int,
                 stop_ids: Sequence[int], settings: SamplingSettings):
        device = sampler.device
        self.sampler, self.step_fn, self.settings = sampler, step, settings
        self.rows, self.capacity, self.max_new_tokens, self.trash = rows, capacity, max_new_tokens, rows
        whole = {"dtype": torch.long, "device": device}
        self.tokens = torch.zeros(rows, **whole)
        self.positions = torch.zeros(rows, **whole)
        self.slot_rows = torch.full((rows,), rows, **whole)
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, **whole)  # the cache column the next step writes
        self.step = torch.zeros(1, **whole)  # the output column the next sampled token goes to
        self.columns = torch.arange(capacity, device=device)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.uniforms = torch.zeros(rows + 1, device=device)
        self.stops = torch.tensor(list(stop_ids), **whole)
        self.out_tokens = torch.full((rows + 1, max_new_tokens), sampler.pad_id, **whole)
        self.out_logprobs = torch.zeros((rows + 1, max_new_tokens), device=device)
        self.out_lengths = torch.full((rows + 1,), max_new_tokens, **whole)
        self.out_stopped = torch.zeros(rows + 1, dtype=torch.bool, device=device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.allocate_cache(autocast_dtype(device, sampler.precision) or next(sampler.model.parameters()).dtype)
        self.graphs: dict[tuple[int, int], Any] | None = {} if sampler.graphs else None
        if sampler.graphs:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)

    def allocate_cache(self, dtype: torch.dtype) -> None:
        """Keys and values for every row and column, per layer, in ``dtype`` (the one the prefill computes them in)."""
        config = self.sampler.model.config.get_text_config(decoder=True)
        shape = (self.rows, config.num_key_value_heads, self.capacity, self.step_fn.head_dim)
        for buffers in (self.keys, self.values):
            buffers.extend(torch.zeros(shape, dtype=dtype, device=self.sampler.device) for _ in range(self.layers))

    @property
    def layers(self) -> int:
        return self.sampler.model.config.get_text_config(decoder=True).num_hidden_layers

    def sample(self, prompts: Sequence[list[int]], num_samples: int, generator: torch.Generator) -> list[list[Sample]]:
        """One chunk: its prefill, then its decode steps until no row is live or the budget is spent."""
        rows = len(prompts) * num_samples
        logits, column = self._prefill(prompts, num_samples)
        self.out_tokens.fill_(self.sampler.pad_id)
        self.out_logprobs.zero_()
        self.out_lengths.fill_(self.max_new_tokens)
        self.out_stopped.zero_()
        batch = row_bucket(rows, self.rows)
        self.slot_rows.fill_(self.trash)
        self.slot_rows[:rows] = torch.arange(rows, device=self.slot_rows.device)
        self.live.zero_()
        self.live[:rows] = True
        self.step.zero_()
        self._draw(rows, generator)
        self._take(*self.settings.next_tokens(logits, self.uniforms[self.slot_rows[:rows]]), rows)
        for _ in range(1, self.max_new_tokens):
            if not bool(self.live[:batch].any()):
                break
            if self.sampler._compact(None, self.live[:batch], batch):
                batch = self._compact(batch, column)
            self._draw(rows, generator)
            self._run(batch, length_bucket(column + 1, self.capacity))
            column += 1
        tokens, logprobs = self.out_tokens[:rows].cpu(), self.out_logprobs[:rows].cpu()
        return samples_from(tokens, logprobs, self.out_lengths[:rows].cpu(), self.out_stopped[:rows].cpu(), num_samples)

    def _prefill(self, prompts: Sequence[list[int]], num_samples: int) -> tuple[torch.Tensor, int]:
        """The prompts' keys and values, computed into the buffers' first rows and copied from there to each prompt's
        ``num_samples`` rows (in place: no second cache); the rows' first logits and the first free column."""
        sampler = self.sampler
        ids, mask = left_pad(prompts, sampler.pad_id, sampler.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        width, count = ids.shape[1], len(prompts)
        cache = preallocated_cache(self.layers, self.capacity,
                                   [(keys[:count], values[:count]) for keys, values in zip(self.keys, self.values)])
        logits = sampler._forward(ids, mask, positions, cache)
        if num_samples > 1:
            for buffer in (*self.keys, *self.values):
                for prompt in reversed(range(count)):  # each prompt's row is read before a later group covers it
                    group = buffer[prompt * num_samples + (prompt == 0):(prompt + 1) * num_samples, :, :width]
                    group.copy_(buffer[prompt:prompt + 1, :, :width].expand_as(group))
        rows = count * num_samples
        self.valid[:rows, :width] = mask.repeat_interleave(num_samples, dim=0).bool()
        self.valid[:rows, width:] = True
        self.positions[:rows] = positions[:, -1].repeat_interleave(num_samples) + 1
        self.column.fill_(width)
        return logits.repeat_interleave(num_samples, dim=0), width

    def _draw(self, rows: int, generator: torch.Generator) -> None:
        """This step's uniform for every row of the request, as the eager loop draws them."""
        self.uniforms[:rows].copy_(torch.rand(rows, generator=generator, device=generator.device))

    def _run(self, batch: int, length: int) -> None:
        if self.graphs is None:
            return self._step(batch, length)
        graph = self.graphs.get((batch, length))
        if graph is not None:
            return graph.replay()
        self.capture(batch, length)

    def capture(self, batch: int, length: int) -> None:
        """This step run on the capture stream (the warm-up the capture needs, and a real step), then recorded. If the
        recording fails, the step has run all the same: the sampler goes on eagerly, and says so once."""
        current = torch.cuda.current_stream(self.sampler.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self._step(batch, length)
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self._step(batch, length)
        except RuntimeError as error:  # a capture torch refused: the steps run as they are, unrecorded
            warnings.warn(f"a decode step could not be captured as a CUDA graph ({str(error).splitlines()[0]}); this "
                          "sampler decodes eagerly from now on (rollout.cuda_graphs=false skips trying)", stacklevel=2)
            self.graphs, self.sampler.graphs = None, False
            return
        self.graphs[(batch, length)] = graph

    def _step(self, batch: int, length: int) -> None:
        """One decode step of the first ``batch`` slots, reading ``length`` columns: forward, sample, take."""
        mask = self.valid[:batch, :length] & (self.columns[:length] <= self.column)
        logits = self.step_fn(self.tokens[:batch], self.positions[:batch], self.column, mask,
                              [keys[:batch] for keys in self.keys], [values[:batch] for values in self.values],
                              self.sampler.attention)
        self.positions[:batch] += 1
        self.column += 1
        self._take(*self.settings.next_tokens(logits, self.uniforms[self.slot_rows[:batch]]), batch)

    def _take(self, token: torch.Tensor, logprob: torch.Tensor, batch: int) -> None:
        """The sampled tokens into the live rows' outputs; rows that sampled a stop id end there."""
        live, rows = self.live[:batch], self.slot_rows[:batch]
        at = self.step.expand(batch)
        written = torch.where(live, rows, self.trash)
        self.out_tokens.index_put_((written, at), token)
        self.out_logprobs.index_put_((written, at), logprob)
        ends = live & (token[:, None] == self.stops).any(-1)
        ended = torch.where(ends, rows, self.trash)
        self.out_stopped.index_put_((ended,), ends)
        self.out_lengths.index_put_((ended,), at + 1)
        live.logical_and_(~ends)
        self.tokens[:batch] = token
        self.step += 1

    def _compact(self, batch: int, column: int) -> int:
        """The live slots moved to the front (their filled columns only); returns the new row bucket."""
        keep = self.live[:batch].nonzero().squeeze(1)
        kept = keep.numel()
        for buffer in (*self.keys, *self.values):
            buffer[:kept, :, :column] = buffer[:batch, :, :column].index_select(0, keep)
        for state in (self.valid, self.tokens, self.positions, self.slot_rows):
            state[:kept] = state[:batch].index_select(0, keep)
        smaller = row_bucket(kept, self.rows)
        self.slot_rows[kept:smaller] = self.trash
        self.live[:kept] = True
        self.live[kept:smaller] = False
        return smaller
