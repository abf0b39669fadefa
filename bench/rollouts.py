"""Rollout throughput: the native sampler against today's plain decode loop and ``model.generate``.

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
stopping at ``</think>``). Tokens/s counts generated tokens only (a finished row's padding is not a
token). Ratios: median of per-round ratios with a bootstrap 95% interval. Target: native / hf >= 1.5
at M=32. Also the sampling step alone on [rows, 151936] logits: inverse CDF against ``torch.multinomial``.

Usage: python bench/rollouts.py [--quick]
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

from step_overhead import paired_ratio  # noqa: E402

from nemo_jq.chat import ChatFormat, build_tokenizer  # noqa: E402
from nemo_jq.data import SyntheticArithmetic  # noqa: E402
from nemo_jq.models.hf import tiny_qwen3  # noqa: E402
from nemo_jq.rollouts.hf import HFSampler, NativeSampler, left_pad  # noqa: E402
from nemo_jq.rollouts.sampling import SamplingSettings  # noqa: E402

ENGINES = ("native", "hf", "generate")


def build_model(vocab: int, hidden: int, layers: int):
    return tiny_qwen3(vocab, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                      intermediate_size=3 * hidden, max_position_embeddings=2048, seed=0).eval()


def tilt_stop_row(model, prompts, stop_id: int, pad_id: int, budget: int) -> float:
    """Point ``stop_id``'s output row along the mean hidden state, scaled (by bisection) so that the
    mean rationale is about half the budget; return the mean fraction reached."""
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=torch.tensor([prompts[0]])).last_hidden_state.mean((0, 1))
        direction, row = hidden / hidden.norm(), model.get_output_embeddings().weight[stop_id]
        sampler = NativeSampler(model, pad_id=pad_id, device=torch.device("cpu"))
        low, high, fraction = 0.0, 64.0, 1.0
        for _ in range(10):
            scale = (low + high) / 2
            row.copy_(scale * direction)
            samples = sampler.sample(prompts[:2], 8, stop_ids=[stop_id], max_new_tokens=budget,
                                     generator=torch.Generator().manual_seed(0))
            fraction = statistics.mean(len(s.token_ids) for g in samples for s in g) / budget
            if abs(fraction - 0.5) < 0.08:
                break
            low, high = (scale, high) if fraction > 0.5 else (low, scale)
    return fraction


def run_engine(name: str, model, prompts, samples: int, budget: int, stop_id: int, pad_id: int, seed: int):
    """``(generated tokens, seconds)`` for one rollout batch."""
    started = time.perf_counter()
    if name == "generate":
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


def measure(args, label: str, vocab: int | None, hidden: int) -> dict:
    task = SyntheticArithmetic(num_operands=3)
    tokenizer = build_tokenizer(task.corpus([]))
    chat = ChatFormat(tokenizer)
    prompts = [chat.prompt_ids(task.messages(e, "cold")) for e in task.splits(args.prompts, 0, 0, seed=0).train]
    model = build_model(vocab or len(tokenizer), hidden, args.layers)
    reached = tilt_stop_row(model, prompts, chat.think_end_id, chat.pad_id, args.budget)
    cases = {}
    for samples in args.samples:
        tokens = {name: [] for name in ENGINES}
        seconds = {name: [] for name in ENGINES}
        for round_index in range(args.warmup + args.repeats):
            order = ENGINES[round_index % 3:] + ENGINES[:round_index % 3]
            for name in order:
                count, took = run_engine(name, model, prompts, samples, args.budget, chat.think_end_id, chat.pad_id,
                                         seed=round_index)
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
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollouts.json")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.samples, args.budget, args.repeats, args.warmup = 2, [4], 12, 2, 0
    torch.set_num_threads(args.threads)

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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'model':<12} {'M':>3} {'native tok/s':>13} {'hf tok/s':>9} {'generate tok/s':>15} "
          f"{'native/hf [95% CI]':>24} {'native/generate':>16} {'mean len':>9}")
    for m in models:
        for case, r in m["cases"].items():
            ratio = r["native_over_hf"]
            print(f"{m['model']:<12} {case[2:]:>3} {r['tokens_per_s']['native']:>13.0f} {r['tokens_per_s']['hf']:>9.0f} "
                  f"{r['tokens_per_s']['generate']:>15.0f} "
                  f"{ratio['median']:>8.2f} [{ratio['ci95_low']:.2f}, {ratio['ci95_high']:.2f}]     "
                  f"{r['native_over_generate']['median']:>16.2f} {r['mean_rationale_tokens']['native']:>9.1f}")
    print(f"sampling step on [{args.prompts * top}, 151936]: inverse CDF {sampling['inverse_cdf_s'] * 1e3:.1f} ms, "
          f"multinomial {sampling['multinomial_s'] * 1e3:.1f} ms")
    print(f"targets met: {result['targets_met']}\nwrote {args.out}")


if __name__ == "__main__":
    main()
