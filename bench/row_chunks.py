"""Row chunks in the rows' own order (the old path) beside chunks of like length, in one run.

The two passes of ``train.micro_batch_rows``, chunked both ways (``learn.chunks_by_length`` the new), on rollouts
whose lengths differ as a trained model's do.

4 prompts x M=32 rows of a 64-token prompt each, 8 rows a chunk (the paper configs' chunk); in each prompt, a share
``--stopped`` of the rows (every other one at 0.5) stopped its rationale early (``--short`` tokens) and the others ran
to the budget (``--long``). Both orders run the same two passes of ``HFPolicy`` (a no-grad scoring pass over every
chunk, then ``forward_backward`` over them) on a small Qwen3 (hidden 128, 4 layers, V=2048) on one CPU thread,
interleaved, ``--rounds`` times;
reported: the tokens each pass runs (the chunks' rows at each chunk's longest), the seconds (median and the rounds'
range) and old/new. The gradients of the two orders are compared too (the same sum, in another order).

Usage: python bench/row_chunks.py [--rounds N] [--out bench/results/row_chunks.json]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stopped", type=float, default=0.5, help="share of each prompt's rows that stopped early")
    parser.add_argument("--short", type=int, default=64, help="rationale tokens of a row that stopped early")
    parser.add_argument("--long", type=int, default=512, help="rationale tokens of a row that ran to the budget")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "row_chunks.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.models.interfaces import TokenBatch
    from nemo_jq.recipe.learn import chunks_by_length

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    policy = HFPolicy(model, device=torch.device("cpu"))
    prompts, samples, prompt_tokens, rows_per_chunk = 4, 32, 64, 8
    every = max(1, round(1 / args.stopped)) if args.stopped else 0
    rationale = [args.short if every and m % every == 0 else args.long for _ in range(prompts) for m in range(samples)]
    width = prompt_tokens + max(rationale)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 2048, (len(rationale), width), generator=generator)
    lengths = torch.tensor([prompt_tokens + r for r in rationale])
    attention = (torch.arange(width) < lengths[:, None]).long()
    positions = torch.arange(width - 1)
    targets = (positions >= prompt_tokens - 1) & (positions < lengths[:, None] - 1)
    batch = TokenBatch(ids * attention, attention, targets, torch.zeros_like(targets))
    coefficients = torch.randn(targets.shape, generator=generator) * 1e-3
    orders = {"rows_own_order": list(torch.arange(len(rationale)).split(rows_per_chunk)),
              "by_length": chunks_by_length(lengths, rows_per_chunk)}

    def two_passes(chunks: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        batches = [batch.rows(chunk) for chunk in chunks]
        started = time.perf_counter()
        with torch.no_grad():
            for part in batches:
                policy.token_logprobs(part)
        policy.forward_backward(batches, lambda logprobs, index: (
            (logprobs * coefficients[chunks[index], :logprobs.shape[1]]).sum(), {}))
        seconds = time.perf_counter() - started
        grads = [p.grad.clone() for p in policy.model.parameters()]
        policy.optimizer.zero_grad(set_to_none=True)
        return seconds, grads

    two_passes(orders["by_length"])  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in orders}
    grads = {}
    for round_index in range(args.rounds):
        for name in (list(orders) if round_index % 2 == 0 else list(orders)[::-1]):
            took, grads[name] = two_passes(orders[name])
            seconds[name].append(took)
    scale = max(float(g.abs().max()) for g in grads["rows_own_order"])
    difference = max(float((a - b).abs().max()) for a, b in zip(grads["rows_own_order"], grads["by_length"]))
    tokens = {name: sum(len(chunk) * int(lengths[chunk].max()) for chunk in chunks) for name, chunks in orders.items()}
    ratios = [old / new for old, new in zip(seconds["rows_own_order"], seconds["by_length"])]
    result = {"what": __doc__.splitlines()[0], "rows": len(rationale), "rows_per_chunk": rows_per_chunk,
              "lengths": {"prompt": prompt_tokens, "short": args.short, "long": args.long, "stopped": args.stopped},
              "real_tokens": int(lengths.sum()), "tokens_a_pass": tokens,
              "seconds": {name: [round(s, 3) for s in values] for name, values in seconds.items()},
              "median_seconds": {name: statistics.median(values) for name, values in seconds.items()},
              "old_over_new": {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]},
              "gradient_difference_over_scale": difference / scale,
              "machine": f"{torch.get_num_threads()} thread, torch {torch.__version__}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"| chunks | tokens a pass | seconds (median of {args.rounds}) |\n| --- | ---: | ---: |")
    for name in orders:
        print(f"| {name} | {tokens[name]} | {result['median_seconds'][name]:.3f} |")
    print(f"old/new: {result['old_over_new']['median']:.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f}); real tokens "
          f"{result['real_tokens']}; gradients differ by {difference / scale:.1e} of their largest")


if __name__ == "__main__":
    main()
