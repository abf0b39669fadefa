"""Decode and training speed against their bounds: the measurements of ``bench/real_gpu.py --parts speed``.

``decode``: the native sampler's decode steps, timed alone (prefill and graph capture excluded: each is timed apart,
synchronised, and taken off the call's time), eager (``NativeSampler``, the old path) and under CUDA graphs
(``GraphSampler``, each attention kernel), at the Qwen3-0.6B shape in bf16, against the bound of the bytes one decode
step must move: the weights once, each live row's keys and values at its real length, and the logits written once.
Shapes: the paper config's own chunk (one prompt's M=32 rows, the rows its KV budget allows, at contexts from 1k to
5k tokens: 48 steps at each of five contexts, integrated over 1,024..5,120), 512 rows x 64 tokens (none stops), and
512 rows with a 256-token budget whose rows stop as a trained model's do (the stop id's output row tilted). Host
launches per decode step from torch.profiler (calls of two lengths, their difference). ``floors``: the step's matrix
products alone and its sampling alone at 32 and 512 rows, against the same bound (:func:`decode_floors`: how much of
the bound any step built on those kernels could reach).

``train``: the training phase's forward and backward (``Policy.forward_backward``) on one micro-batch of the paper's
full row length, 8 rows x (1,024 prompt + 4,096 thinking + 128 answer) tokens, with the package found at ``--root``
(the old tree runs the same function), and its MFU: 6·N·D over the trained tokens (N without the embedding lookup),
6·V·H per scored position for the head, and causal attention's 2·s²·(heads·head_dim) per layer and row forward,
three times that with backward, over the time and 989 TFLOP/s (recomputation not counted). ``--floor``: the same
micro-batch's matrix products and attention alone (:func:`train_floor`: the most MFU any implementation on those
kernels can show).

Usage: python bench/gpu_speed.py {decode,train} --out FILE [--device cuda|cpu] [--root DIR] [--chunks N ...] [--floor]

Why one file (over 600 lines): a lent GPU's 15 minutes run one prepared script; decode and training share its
timers, shapes and bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: Qwen3-0.6B's shape, and a tiny one for --device cpu (a smoke run of this script).
SHAPES = {"qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                             max_position_embeddings=40960),
          "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=8192)}
#: Datasheet HBM bandwidth (TB/s) and dense bf16 rate (TFLOP/s) by device name.
DATASHEET = {"H100 80GB HBM3": (3.35, 989.0), "H100": (3.35, 989.0), "H200": (4.8, 989.0)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_of(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape])).to(dtype).eval()


def measured_bandwidth(device: torch.device) -> float | None:
    """A device-to-device copy of 2 GiB, bytes read plus written per second (the ceiling METHOD.md asks for)."""
    if device.type != "cuda":
        return None
    source = torch.randn(2**29, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    synchronize(device)
    return 10 * 2 * source.numel() * 4 / (time.perf_counter() - started)


# ----------------------------------------------------------------------------------------------------------- decode
class DecodeClock:
    """The decode steps' share of a sampling call: the call's time less its prefills and graph captures, each
    timed apart between synchronisations."""

    def __init__(self, device: torch.device):
        self.device, self.excluded = device, 0.0

    def wrap(self, owner, name: str):
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            synchronize(self.device)
            started = time.perf_counter()
            out = real(*args, **kwargs)
            synchronize(self.device)
            self.excluded += time.perf_counter() - started
            return out

        return _patched(owner, name, timed)

    @contextlib.contextmanager
    def call(self):
        from nemo_jq.rollouts import graphs, hf

        self.excluded = 0.0
        with self.wrap(hf.NativeSampler, "_prefill"), self.wrap(graphs.StaticDecode, "_prefill"), \
                self.wrap(graphs.StaticDecode, "capture"):
            synchronize(self.device)
            started = time.perf_counter()
            yield self
            synchronize(self.device)
        self.total = time.perf_counter() - started
        self.decode = self.total - self.excluded


@contextlib.contextmanager
def _patched(owner, name: str, value):
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def decode_bound_bytes(model, prompt_lengths: list[int], lengths: list[int]) -> float:
    """Bytes the decode steps of rows with these prompt and sampled lengths must move: every step the weights once,
    each live row's keys and values so far, its logits once (bf16); the first token comes from the prefill."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    logits_row = config.vocab_size * 2
    total = 0.0
    for step in range(1, max(lengths)):
        live = [prompt + step for prompt, length in zip(prompt_lengths, lengths) if length > step]
        if live:
            total += weights + kv_token * sum(live) + logits_row * len(live)
    return total


def decode_flops(model, prompt_lengths: list[int], lengths: list[int]) -> float:
    """The matrix FLOPs of the same decode steps: 2 per weight (the head's too) per live row, and attention's
    4·heads·head_dim per layer and key of each live row (the compute roof beside the bytes' one)."""
    config = model.config
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name) + \
        config.vocab_size * config.hidden_size
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    total = 0.0
    for step in range(1, max(lengths)):
        live = [prompt + step for prompt, length in zip(prompt_lengths, lengths) if length > step]
        total += 2 * weights * len(live) + attention * sum(live)
    return total


def engines(device: torch.device, chat_pad: int):
    from nemo_jq.rollouts.graphs import GraphSampler
    from nemo_jq.rollouts.hf import NativeSampler

    gpu = device.type == "cuda"
    return {"eager": lambda m: NativeSampler(m, pad_id=chat_pad, device=device, precision="bf16"),
            "static_eager": lambda m: GraphSampler(m, pad_id=chat_pad, device=device, precision="bf16", graphs=False),
            "graphs_sdpa": lambda m: GraphSampler(m, pad_id=chat_pad, device=device, precision="bf16", graphs=gpu),
            "graphs_matmul": lambda m: GraphSampler(m, pad_id=chat_pad, device=device, precision="bf16", graphs=gpu,
                                                    attention="matmul"),
            "graphs_sdpa_compiled": lambda m: GraphSampler(m, pad_id=chat_pad, device=device, precision="bf16",
                                                           graphs=gpu, compiled=True),
            "graphs_matmul_compiled": lambda m: GraphSampler(m, pad_id=chat_pad, device=device, precision="bf16",
                                                             graphs=gpu, attention="matmul", compiled=True)}


def time_decode(sampler, prompts, samples: int, steps: int, stop_ids, device, seed: int) -> dict:
    clock = DecodeClock(device)
    with clock.call():
        groups = sampler.sample(prompts, samples, stop_ids=stop_ids, max_new_tokens=steps,
                                generator=torch.Generator(device).manual_seed(seed))
    lengths = [len(s.token_ids) for g in groups for s in g]
    return {"decode_s": clock.decode, "excluded_s": clock.excluded, "lengths": lengths,
            "prompt_lengths": [len(p) for p in prompts for _ in range(samples)]}


def decode_case(model, names: list[str], prompts, samples: int, steps: int, stop_ids, device, bandwidth: float,
                rounds: int = 2, peak: float = 989e12) -> dict:
    """Each engine warmed once, then timed ``rounds`` times, in turn. An engine named ``NAME@fp32`` samples from an
    fp32 copy of the model under bf16 (as the paper config samples from its fp32 policy); the bounds are the bf16
    model's."""
    samplers = {name: sampler_for(name, model, device) for name in names}
    warm = {}
    for name, sampler in samplers.items():
        started = time.perf_counter()
        time_decode(sampler, prompts, samples, steps, stop_ids, device, seed=0)
        warm[name] = round(time.perf_counter() - started, 2)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in (names if round_index % 2 == 0 else names[::-1]):
            runs[name].append(time_decode(samplers[name], prompts, samples, steps, stop_ids, device, seed=1))
    out = {}
    for name, timed in runs.items():
        best = min(timed, key=lambda r: r["decode_s"])
        bound = decode_bound_bytes(model, best["prompt_lengths"], best["lengths"]) / bandwidth
        compute = decode_flops(model, best["prompt_lengths"], best["lengths"]) / peak
        tokens = sum(length - 1 for length in best["lengths"])  # the decode steps' tokens (the first is the prefill's)
        out[name] = {"decode_s": [round(r["decode_s"], 5) for r in timed], "excluded_s": [round(r["excluded_s"], 4) for r in timed],
                     "decode_tokens": tokens, "decode_tokens_per_s": tokens / best["decode_s"],
                     "bound_s": bound, "bound_over_measured": bound / best["decode_s"], "compute_bound_s": compute,
                     "roofline_over_measured": max(bound, compute) / best["decode_s"], "warm_call_s": warm[name]}
    return out


def sampler_for(name: str, model, device: torch.device):
    """Engine ``name`` over ``model``, or over its fp32 twin for ``NAME@fp32``."""
    return engines(device, 0)[name.split("@")[0]](fp32_twin(model) if name.endswith("@fp32") else model)


_TWINS: dict[int, object] = {}


def fp32_twin(model):
    """The fp32 model the bf16 one was cast from (same seed): what the paper config's sampler reads."""
    if id(model) not in _TWINS:
        shape = "qwen3-0.6b" if model.config.vocab_size == SHAPES["qwen3-0.6b"]["vocab_size"] else "tiny"
        _TWINS[id(model)] = model_of(shape, model.device, torch.float32)
    return _TWINS[id(model)]


def profiled_call(sampler, prompts, samples: int, steps: int, device, activities) -> tuple:
    """One warm-up call, then one call of ``steps`` decode steps under torch.profiler: (profiler, its decode seconds)."""
    from torch.profiler import profile

    time_decode(sampler, prompts, samples, steps, [-1], device, seed=0)
    with profile(activities=activities) as profiler:
        wall = time_decode(sampler, prompts, samples, steps, [-1], device, seed=0)["decode_s"]
    return profiler, wall


def launches_per_step(model, name: str, prompts, samples: int, device, short: int = 8, long: int = 24) -> float | None:
    """Host launches (kernels, graphs, copies, memsets) per decode step: two calls' counts, their difference."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity

    sampler = sampler_for(name, model, device)
    counts = []
    for steps in (short, long):
        profiler, _ = profiled_call(sampler, prompts, samples, steps, device, [ProfilerActivity.CPU, ProfilerActivity.CUDA])
        counts.append(sum(event.count for event in profiler.key_averages()
                          if event.key.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy",
                                                   "cudaMemset"))))
    return (counts[1] - counts[0]) / (long - short)


def kernels_per_step(model, name: str, prompts, samples: int, device, short: int = 16, long: int = 48) -> dict | None:
    """GPU kernels per decode step and their summed GPU time per step (two calls' difference, so a call's prefill and
    captures cancel), beside the step's wall time; the longer call's top kernels by GPU time."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity

    sampler = sampler_for(name, model, device)
    seen = []
    for steps in (short, long):
        profiler, wall = profiled_call(sampler, prompts, samples, steps, device, [ProfilerActivity.CUDA])
        kernels = [event for event in profiler.events() if event.device_type.name == "CUDA"
                   and not event.name.startswith(("Memcpy", "Memset"))]
        seen.append((len(kernels), sum(event.device_time for event in kernels) / 1e6, wall, profiler))
    steps = long - short
    return {"kernels_per_step": (seen[1][0] - seen[0][0]) / steps,
            "kernel_ms_per_step": 1e3 * (seen[1][1] - seen[0][1]) / steps,
            "wall_ms_per_step": 1e3 * (seen[1][2] - seen[0][2]) / steps,
            "top_kernels": seen[1][3].key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)}


def decode_floors(model, rows_list: list[int], device: torch.device, bandwidth: float, peak: float = 989e12,
                  steps: int = 16) -> dict:
    """What a decode step costs at least in the library's own kernels, per row count: its matrix products alone (each
    layer's q/k/v, o, gate/up and down as one product each at the model's widths, then the head; bf16, each layer
    fed by the one before), and the budget core's sampling over the vocabulary alone (the inverse CDF on [rows, V]
    logits), each over ``steps`` steps in one CUDA graph on a GPU (eagerly elsewhere); beside the step's byte bound
    at the shortest context (the weights and the logits, no keys) and its FLOP bound. ``bound_over_floor``: the most
    of the bound a step made of these kernels could reach if everything else it runs (norms, rotary, attention, the
    cache write) cost nothing: a target above it needs fused kernels, not fewer launches."""
    from nemo_jq.rollouts.sampling import SamplingSettings

    config = model.config
    hidden, inter, dim = config.hidden_size, config.intermediate_size, config.head_dim
    queries, keys = config.num_attention_heads * dim, config.num_key_value_heads * dim
    generator = torch.Generator(device).manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator) * 0.02

    layers = [(weight(queries + 2 * keys, hidden), weight(hidden, queries), weight(2 * inter, hidden), weight(hidden, inter))
              for _ in range(config.num_hidden_layers)]
    head = weight(config.vocab_size, hidden)
    weight_bytes = sum(p.numel() for p in model.parameters()) * 2
    step_flops = 2 * (sum(w.numel() for layer in layers for w in layer) + head.numel())
    settings = SamplingSettings()
    out = {}
    for rows in rows_list:
        x = weight(rows, hidden)
        logits = weight(rows, config.vocab_size)
        uniforms = torch.rand(rows, device=device, generator=generator)

        def products(x=x):
            h = x
            for qkv, o, gate_up, down in layers:
                h = torch.nn.functional.linear(torch.nn.functional.linear(h, qkv)[:, :queries], o)
                h = torch.nn.functional.linear(torch.nn.functional.linear(h, gate_up)[:, :inter], down)
            return torch.nn.functional.linear(h, head)

        def sampling(logits=logits, uniforms=uniforms):
            return settings.next_tokens(logits, uniforms)

        bound = (weight_bytes + rows * config.vocab_size * 2) / bandwidth
        timed = {name: _per_step_seconds(work, steps, device) for name, work in (("products", products), ("sampling", sampling))}
        floor = timed["products"] + timed["sampling"]
        out[f"rows_{rows}"] = {"products_ms": 1e3 * timed["products"], "sampling_ms": 1e3 * timed["sampling"],
                               "bound_ms": 1e3 * bound, "compute_bound_ms": 1e3 * step_flops * rows / peak,
                               "bound_over_floor": bound / floor}
    return out


def _per_step_seconds(work, steps: int, device: torch.device) -> float:
    """Seconds a call of ``work`` takes, over ``steps`` calls: on a GPU captured once as one graph and replayed
    (launches out of the way), elsewhere run in a loop."""
    for _ in range(2):
        work()
    synchronize(device)
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(steps):
            work()
        return (time.perf_counter() - started) / steps
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        work()
    torch.cuda.current_stream(device).wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(steps):
            work()
    graph.replay()
    synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / steps)
    return best


def tilt_stop_row(model, prompts, stop_id: int, budget: int, device) -> float:
    sys.path[:0] = [str(ROOT / "bench")]
    from rollouts import tilt_stop_row as tilt

    return tilt(model, prompts, stop_id, 0, budget, device)


def decode(args) -> dict:
    device = torch.device(args.device)
    tiny = device.type == "cpu"
    model = model_of("tiny" if tiny else "qwen3-0.6b", device, torch.bfloat16)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sheet = next((v for k, v in DATASHEET.items() if k in name), (None, None))
    copy = measured_bandwidth(device)
    bandwidth = sheet[0] * 1e12 if sheet[0] else (copy or 50e9)
    result = {"device": name, "datasheet_tbs": sheet[0], "copy_tbs": copy / 1e12 if copy else None,
              "bound_bandwidth_tbs": bandwidth / 1e12}
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def random_prompt(length: int) -> list[int]:
        return torch.randint(10, vocab, (length,), generator=generator).tolist()

    names = args.engines
    # the paper config's chunk: one prompt's 32 rows, 48 steps at each context
    contexts = [64, 128, 192] if tiny else args.contexts
    paper = {}
    for context in contexts if "paper" in args.shapes else []:
        started = time.perf_counter()
        try:
            paper[context] = decode_case(model, names, [random_prompt(context)], 32, 8 if tiny else 48, [-1], device,
                                         bandwidth)
        except Exception as error:  # noqa: BLE001 - a finding; the other shapes still run
            paper[context] = {"error": f"{type(error).__name__}: {error}"[-2000:]}
        print(f"[decode paper chunk {context}] {time.perf_counter() - started:.1f}s", flush=True)
    result["paper_chunk"] = {"rows": 32, "steps_per_context": 8 if tiny else 48, "by_context": paper,
                             "integrated": integrate(paper, contexts[0], contexts[-1] + 64 if tiny else 5120)}
    sys.path[:0] = [str(ROOT / "bench")]
    from rollouts import task_prompts

    chat, prompts = task_prompts(8 if tiny else 64)
    if "rows512" in args.shapes:
        started = time.perf_counter()
        result["rows512_tokens64"] = _guarded(lambda: decode_case(model, names, prompts, 8, 8 if tiny else 64, [-1],
                                                                  device, bandwidth))
        print(f"[decode 512x64] {time.perf_counter() - started:.1f}s", flush=True)
    if "launches" in args.shapes:
        result["launches_per_decode_step"] = {
            name: _guarded(lambda name=name: launches_per_step(model, name, prompts, 8, device)) for name in names}
    if "profile" in args.shapes:
        graph_engines = [name for name in names if name != "eager"]
        result["kernels_per_decode_step"] = {
            "paper_chunk_1024": {name: _guarded(lambda name=name: kernels_per_step(
                model, name, [random_prompt(32 if tiny else 1024)], 32, device)) for name in graph_engines},
            "rows512": {name: _guarded(lambda name=name: kernels_per_step(model, name, prompts, 8, device))
                        for name in graph_engines}}
        print("[decode profile] done", flush=True)
    if "floors" in args.shapes:
        result["floors"] = _guarded(lambda: decode_floors(model, [32, 512] if not tiny else [4, 16], device, bandwidth))
        print("[decode floors] done", flush=True)
    if "stopping" in args.shapes:
        started = time.perf_counter()
        budget = 16 if tiny else 256
        reached = tilt_stop_row(model, prompts, chat.think_end_id, budget, device)
        result["rows512_stopping"] = {"budget": budget, "mean_fraction_of_budget_at_calibration": reached, **_guarded(
            lambda: decode_case(model, names, prompts, 8, budget, [chat.think_end_id], device, bandwidth))}
        print(f"[decode stopping] {time.perf_counter() - started:.1f}s", flush=True)
    return result


def _guarded(measure):
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - a finding; the other shapes still run
        return {"error": f"{type(error).__name__}: {error}"[-2000:]}


def integrate(by_context: dict, first: int, last: int) -> dict:
    """Seconds of one chunk's whole decode (contexts ``first``..``last``, one step each), per engine: per-step time
    and per-step bound interpolated linearly between the measured contexts."""
    contexts = sorted(c for c in by_context if "error" not in by_context[c])
    if len(contexts) < 2:
        return {}
    engines_seen = [name for name in by_context[contexts[0]] if "error" not in by_context[contexts[0]][name]]
    out = {}
    for name in engines_seen:
        per_step = [min(by_context[c][name]["decode_s"]) / by_context[c][name]["decode_tokens"] * 32 for c in contexts]
        bound = [by_context[c][name]["bound_s"] / by_context[c][name]["decode_tokens"] * 32 for c in contexts]
        measured = sum(_interpolate(contexts, per_step, c) for c in range(first, last))
        least = sum(_interpolate(contexts, bound, c) for c in range(first, last))
        out[name] = {"chunk_decode_s": measured, "chunk_bound_s": least, "bound_over_measured": least / measured}
    return out


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0] + (ys[1] - ys[0]) * (x - xs[0]) / (xs[1] - xs[0])
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-2] + (ys[-1] - ys[-2]) * (x - xs[-2]) / (xs[-1] - xs[-2])


# ------------------------------------------------------------------------------------------------------------ train
def train(args) -> dict:
    """One micro-batch of the paper's row length through ``forward_backward``, per row count and log-prob chunk size."""
    sys.path.insert(0, str(Path(args.root).resolve()))
    device = torch.device(args.device)
    tiny = device.type == "cpu"
    shape = SHAPES["tiny" if tiny else "qwen3-0.6b"]
    prompt, thinking, answer = (32, 64, 8) if tiny else (1024, 4096, 128)
    length = prompt + thinking + 1 + answer - 1  # prompt, rationale, </think>, answer: targets are all but the prompt's
    import nemo_jq

    results = {"tokens_per_row": length, "package": str(Path(nemo_jq.__file__).parent),
               "compiled_layers": args.compiled, "activation_checkpointing": not args.no_checkpointing}
    for rows in args.rows:
        for chunk in args.chunks:
            key = f"chunk_{chunk}" if len(args.rows) == 1 else f"rows_{rows}_chunk_{chunk}"
            results[key] = train_case(args, shape, device, rows, length, prompt, thinking, chunk)
        if args.floor:
            key = "floor" if len(args.rows) == 1 else f"rows_{rows}_floor"
            results[key] = _guarded(lambda rows=rows: train_floor(shape, device, rows, length, length - prompt))
    return results


def train_floor(shape: dict, device: torch.device, rows: int, length: int, scored_per_row: int) -> dict:
    """What the micro-batch's training costs at least in the library's own kernels: its matrix products alone (every
    layer's seven projections forward, and backward to inputs and to weights; the head over the scored positions, the
    same three) and its causal attention (SDPA's kernel, forward and backward), bf16, nothing else (no norms, rotary,
    casts, optimizer, recomputation). ``mfu_floor``: the model FLOPs over that time and the peak: the most MFU any
    implementation on these kernels can show; with recomputation, one more forward of the layers."""
    import torch.nn.functional as F

    hidden, inter, heads, kv, dim = (shape[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim"))
    tokens, scored = rows * length, rows * scored_per_row
    generator = torch.Generator(device).manual_seed(0)

    def tensor(*size: int, grad: bool = False) -> torch.Tensor:
        return (torch.randn(*size, device=device, dtype=torch.bfloat16, generator=generator) * 0.02).requires_grad_(grad)

    projections = [(hidden, heads * dim), (hidden, kv * dim), (hidden, kv * dim), (heads * dim, hidden),
                   (hidden, inter), (hidden, inter), (inter, hidden)]
    weights = {size: tensor(size[1], size[0]) for size in set(projections)}
    inputs = {features: tensor(tokens, features) for features in {size[0] for size in projections}}
    outputs = {features: tensor(tokens, features) for features in {size[1] for size in projections}}
    chunk = min(scored, 2048)  # the head in chunks of positions, as the policy's log-prob kernel runs it
    head, scored_hidden, scored_grad = tensor(shape["vocab_size"], hidden), tensor(chunk, hidden), tensor(chunk, shape["vocab_size"])
    q, k, v = (tensor(rows, count, length, dim, grad=True) for count in (heads, kv, kv))
    attended_grad = tensor(rows, heads, length, dim)

    def products(forward: bool = True, backward: bool = True) -> None:
        for _ in range(shape["num_hidden_layers"]):
            for size in projections:
                if forward:
                    F.linear(inputs[size[0]], weights[size])
                if backward:
                    outputs[size[1]] @ weights[size]  # to the input
                    outputs[size[1]].t() @ inputs[size[0]]  # to the weight
        for _ in range(-(-scored // chunk)):
            if forward:
                F.linear(scored_hidden, head)
            if backward:
                scored_grad @ head
                scored_grad.t() @ scored_hidden

    def attention(backward: bool = True) -> None:
        for _ in range(shape["num_hidden_layers"]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)
            if backward:
                torch.autograd.grad(out, (q, k, v), attended_grad)

    def timed(work) -> float:
        work()
        synchronize(device)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            work()
            synchronize(device)
            best = min(best, time.perf_counter() - started)
        return best

    products_s, attention_s = timed(products), timed(attention)
    recompute_s = timed(lambda: (products(backward=False), attention(backward=False)))
    flops = model_flops(shape, rows, length, scored)
    floor = products_s + attention_s
    return {"products_s": products_s, "attention_s": attention_s, "floor_s": floor, "model_flops": flops,
            "mfu_floor": flops / floor / 989e12, "mfu_floor_with_recomputation": flops / (floor + recompute_s) / 989e12,
            "products_tflops": 2 * 3 * (tokens * sum(a * b for a, b in projections) * shape["num_hidden_layers"]
                                        + -(-scored // chunk) * chunk * hidden * shape["vocab_size"]) / products_s / 1e12}


def train_case(args, shape: dict, device: torch.device, rows: int, length: int, prompt: int, thinking: int,
               chunk: int) -> dict:
    """``rows`` rows of ``length`` tokens through ``forward_backward``, three times: seconds, MFU, peak memory."""
    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.models.interfaces import TokenBatch

    tiny = device.type == "cpu"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, shape["vocab_size"], (rows, length), generator=generator)
    positions = torch.arange(length - 1)
    rationale = (positions >= prompt - 1) & (positions < prompt + thinking)
    answers = positions >= prompt + thinking
    batch = TokenBatch(ids, torch.ones_like(ids), rationale.expand(rows, -1).clone(), answers.expand(rows, -1).clone())
    coefficient = torch.randn(rows, length - 1, generator=generator).to(device) * 1e-3
    flops = model_flops(shape, rows, length, int(batch.target_mask.sum()))
    result = {"rows": rows, "model_flops": flops}
    model = model_of("tiny" if tiny else "qwen3-0.6b", device, torch.float32)
    # the product's model.compile (each layer's attention, MLP and norms compiled; the old tree has no such key)
    options = {"compiled": True} if args.compiled else {}
    policy = HFPolicy(model, device=device, precision="auto", logprob_chunk_size=chunk,
                      activation_checkpointing=not args.no_checkpointing, **options)

    def step(policy=policy):
        policy.forward_backward([batch], lambda logprobs, index: ((logprobs * coefficient).sum(), {}))
        policy.optimizer.zero_grad(set_to_none=True)

    times = []
    try:
        for _ in range(3):
            synchronize(device)
            started = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - started)
        best = min(times[1:])
        result.update(seconds=[round(t, 4) for t in times], best_s=best, mfu=flops / best / 989e12,
                      peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
        if args.profile and device.type == "cuda":
            result["top_kernels"] = profile_top(step)
    except Exception as error:  # noqa: BLE001 - a finding (an out-of-memory one too)
        result["error"] = f"{type(error).__name__}: {error}"[-2000:]
    del policy, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def model_flops(shape: dict, rows: int, length: int, scored: int) -> float:
    """6·N·D (N: the decoder's parameters, no embedding) + 6·V·H per scored position + causal attention, fwd+bwd."""
    hidden, layers, heads, dim = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"], shape["head_dim"]
    kv, inter = shape["num_key_value_heads"], shape["intermediate_size"]
    per_layer = hidden * (heads * dim) * 2 + hidden * (kv * dim) * 2 + 3 * hidden * inter
    body = layers * per_layer
    attention = 3 * 2 * layers * heads * dim * length * length * rows
    return 6 * body * rows * length + 6 * shape["vocab_size"] * hidden * scored + attention


def profile_top(step, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    return profiler.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["decode", "train"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--root", default=str(ROOT), help="the tree whose nemo_jq is timed (an old one's too)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256], help="train: model.logprob_chunk_size values")
    parser.add_argument("--profile", action="store_true", help="train: the top kernels by GPU time")
    parser.add_argument("--compiled", action="store_true", help="train: model.compile (each layer's attention, MLP and "
                        "norms under torch.compile)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8], help="train: rows of the micro-batch")
    parser.add_argument("--no-checkpointing", action="store_true", help="train: without activation checkpointing")
    parser.add_argument("--floor", action="store_true", help="train: the micro-batch's matrix products and attention "
                        "alone, the MFU they allow (train_floor)")
    parser.add_argument("--engines", nargs="+", default=["eager", "graphs_sdpa", "graphs_matmul"], help="decode: samplers")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 3072, 4096, 5056],
                        help="decode: the paper chunk's contexts measured")
    parser.add_argument("--shapes", nargs="+", default=["paper", "rows512", "launches", "stopping"],
                        help="decode: which cases")
    args = parser.parse_args()
    if args.what == "decode":
        sys.path.insert(0, str(Path(args.root).resolve()))
    result = decode(args) if args.what == "decode" else train(args)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result)[:3000])


if __name__ == "__main__":
    main()
