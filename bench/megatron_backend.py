"""The Megatron backend: log-prob head memory per rank under TP, and step time against the HF backend.

All in one run:

1. peak memory per rank of the J_Q loss head (LM head matmul to vocab-parallel logits, then
   ``vocab_parallel_token_logprobs`` forward and backward) at TP=2 relative to TP=1, at
   V=151936, T=4096, H=1024; each layout in fresh gloo processes, the largest rank reported.
   Target: <= 0.55 (each rank holds ``[T, V/TP]`` logits and their gradient, so ~0.5);
2. the trainer's full GARL step (rollout, forward/backward, AdamW; lr=0 keeps the rollouts
   identical) with ``model.backend=megatron`` at TP=1 relative to ``model.backend=hf`` on the same
   tiny model, interleaved A B B A ..., median of per-round ratios with a bootstrap 95% interval.

On CPU, megatron-core needs the test-only CUDA patches (``tests/megatron_cpu.py``); this script
applies them only when no GPU is present. Usage: python bench/megatron_backend.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from step_overhead import SETUP_KEYS, add_common_arguments, paired_ratio, tiny_overrides  # noqa: E402


def head_peak_bytes(tokens: int, vocab: int, hidden: int, chunk: int) -> int:
    """Run in a gloo process: this rank's peak extra memory over one head forward+backward."""
    import torch.distributed as dist

    from nemo_jq.models.megatron.logprobs import vocab_parallel_token_logprobs
    from nemo_jq.models.megatron.provider import padded_vocab_size

    rank, size = dist.get_rank(), dist.get_world_size()
    local_vocab = padded_vocab_size(vocab, size) // size
    torch.manual_seed(rank)
    hidden_states = (torch.randn(tokens, hidden) * 0.02).requires_grad_()
    head_shard = (torch.randn(local_vocab, hidden) * 0.02).requires_grad_()
    targets = torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    cuda = torch.cuda.is_available()
    if cuda:
        hidden_states, head_shard, targets = (t.detach().cuda().requires_grad_(t.requires_grad) for t in
                                              (hidden_states, head_shard, targets))
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:  # the current resident set; an earlier high-water mark above it can only overstate the peak
        baseline = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    logits = hidden_states @ head_shard.T  # [T, V/TP]: what Megatron's vocab-parallel output layer returns
    logprobs = vocab_parallel_token_logprobs(logits, targets, vocab_start=rank * local_vocab, vocab_size=vocab,
                                             group=dist.group.WORLD, chunk_size=chunk)
    logprobs.sum().backward()
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak - baseline


def head_memory(args) -> dict[str, float]:
    from megatron_cpu import run_in_processes

    peaks = {tp: max(run_in_processes(head_peak_bytes, tp, args.mem_tokens, args.mem_vocab, args.mem_hidden, args.chunk))
             for tp in (1, 2)}
    return {"tp1_peak_gb": peaks[1] / 2**30, "tp2_peak_gb_per_rank": peaks[2] / 2**30, "tp2_over_tp1": peaks[2] / peaks[1]}


def step_times(args, work: Path) -> tuple[list[float], list[float]]:
    """Per-round GARL step seconds of the megatron (TP=1) and hf backends, interleaved."""
    from nemo_jq.config import load_config
    from nemo_jq.trainer import Trainer

    overrides = ["objective.name=garl", f"objective.q={args.q}"]
    trainers = {backend: Trainer(load_config(None, [*tiny_overrides(args, work / backend), *overrides,
                                                    f"model.backend={backend}"]))
                for backend in ("megatron", "hf")}
    examples = trainers["hf"].splits.train[: args.prompts]
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for repeat in range(args.warmup + args.repeats):
        order = ["megatron", "hf"] if repeat % 2 == 0 else ["hf", "megatron"]
        for name in order:
            trainer = trainers[name]
            trainer.rollout_generator.manual_seed(0)
            trainer.estimator_generator.manual_seed(1)
            started = time.perf_counter()
            trainer.train_step(examples)
            times[name].append(time.perf_counter() - started)
    return times["megatron"][args.warmup :], times["hf"][args.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "megatron_backend.json")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup = 3, 1
        args.mem_tokens, args.mem_vocab, args.mem_hidden = 1024, 32768, 256
    torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        from megatron_cpu import patch_megatron_for_cpu

        from nemo_jq.models.backends import MEGATRON_ON_CPU

        patch_megatron_for_cpu()
        os.environ[MEGATRON_ON_CPU] = "1"

    memory = head_memory(args)
    with tempfile.TemporaryDirectory() as tmp:
        megatron, hf = step_times(args, Path(tmp))
    ratio = paired_ratio(megatron, hf)
    result = {
        "setup": {k: getattr(args, k) for k in SETUP_KEYS},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "head_memory": memory,
        "step_seconds": {"megatron_tp1": statistics.median(megatron), "hf": statistics.median(hf)},
        "megatron_tp1_over_hf_step": ratio,
        "targets_met": {"tp2_head_memory_at_most_0.55_of_tp1": memory["tp2_over_tp1"] <= 0.55},
    }
    print(f"{'quantity':<40}{'value':>12}")
    for key, value in {**memory, **{f"step s {k}": v for k, v in result["step_seconds"].items()}}.items():
        print(f"{key:<40}{value:>12.4f}")
    print(f"{'megatron TP=1 step / hf step':<40}{ratio['median']:>12.4f}  95% CI [{ratio['ci95_low']:.4f}, "
          f"{ratio['ci95_high']:.4f}]")
    for key, value in result["targets_met"].items():
        print(f"{'target ' + key:<40}{'met' if value else 'MISSED':>12}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
