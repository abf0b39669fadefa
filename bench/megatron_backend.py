"""The Megatron backend: log-prob head memory per rank under TP, and step time against the HF backend.

All in one run:

1. peak memory per rank of the J_Q loss head (LM head matmul to vocab-parallel logits, then
   ``vocab_parallel_token_logprobs`` forward and backward) at TP=2 relative to TP=1, at
   V=151936, T=4096, H=1024; each layout in fresh gloo processes, the largest rank reported.
   Target: <= 0.55 (each rank holds ``[T, V/TP]`` logits and their gradient, so ~0.5);
2. the trainer's full GARL step (rollout, forward/backward, AdamW; lr=0 keeps the rollouts
   identical) with ``model.backend=megatron`` at TP=1 relative to ``model.backend=hf`` on the same
   tiny model, interleaved A B B A ..., median of per-round ratios with a bootstrap 95% interval.

On a GPU (``--gpu``, results in ``megatron_backend_gpu.json``): training MFU of a Qwen3-0.6B-shaped
model at sequence length 4096 in bf16 (bf16 weights, fp32 masters in the distributed optimizer), the
model's FLOPs (``training_step_flops``) over the measured step time against the device's dense bf16
peak (goal >= 45%); and bf16 parity of that backend against the HF backend in fp32 on the same
weights and batch (log-probs, loss, gradients). The report names the layer spec it ran (Transformer
Engine's when TE imports, else megatron-core's local one, whose attention is not fused).

On CPU, megatron-core needs the test-only CUDA patches (``tests/megatron_cpu.py``); this script
applies them only when no GPU is present. Usage: python bench/megatron_backend.py [--quick | --gpu]
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

from nemo_jq.cluster.plan import architecture, layer_parameters  # noqa: E402
from nemo_jq.models.megatron.provider import read_qwen3_config  # noqa: E402  (imports no megatron)

#: Dense (no sparsity) bf16 tensor-core peaks by device name, TFLOP/s (the vendor's datasheets); others need --peak-tflops.
PEAK_BF16_TFLOPS = {"H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H200": 989.4}


def training_step_flops(arch, rows: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward and backward, 3x forward) over ``rows`` sequences of ``seq_len``:
    6 x N x tokens for the matmuls of the N parameters every token meets (each layer's and the LM head's; the
    embedding lookup is no matmul), plus causal attention's two matmuls (scores and values, over the half of the
    s x s square a token sees): 3 x 2 x 2 x s^2/2 x heads x head_dim per layer and sequence. Recomputation's
    extra forward is not counted: MFU counts the model's FLOPs, not the hardware's."""
    matmul_parameters = arch.num_layers * layer_parameters(arch) + arch.vocab_size * arch.hidden_size
    attention = 6 * seq_len**2 * arch.num_attention_heads * arch.head_dim * arch.num_layers
    return rows * (6 * matmul_parameters * seq_len + attention)


def random_sequences(vocab_size: int, rows: int, seq_len: int, device) -> list:
    """One micro-batch per row: random tokens, every position after the first a (rationale) target."""
    from nemo_jq.models.interfaces import TokenBatch

    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(rows):
        ids = torch.randint(vocab_size, (1, seq_len), generator=generator)
        targets = torch.ones(1, seq_len - 1, dtype=torch.bool)
        batches.append(TokenBatch(ids, torch.ones_like(ids), targets, torch.zeros_like(targets)).to(device))
    return batches


def mean_logprob_loss(tokens: int):
    return lambda logprobs, index: (-logprobs.sum() / tokens, {})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_mfu(hf_config: dict, device: str, seq_len: int, rows: int, steps: int, warmup: int, peak_tflops: float,
                recompute: bool) -> dict:
    """Median step time of ``MegatronPolicy`` (bf16 weights, distributed optimizer, this one rank) training on
    ``rows`` random sequences of ``seq_len`` tokens, one per micro-batch; its model TFLOP/s and MFU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nemo_jq.models.megatron.policy import MegatronPolicy

    device = torch.device(device)
    torch.manual_seed(0)
    policy = MegatronPolicy.from_hf_model(Qwen3ForCausalLM(Qwen3Config(**hf_config)), device=device, lr=1e-6,
                                          distributed_optimizer=True, bf16_weights=True, recompute_activations=recompute)
    batches = random_sequences(hf_config["vocab_size"], rows, seq_len, device)
    loss_fn = mean_logprob_loss(rows * (seq_len - 1))
    seconds = []
    for _ in range(warmup + steps):
        synchronize(device)
        started = time.perf_counter()
        policy.forward_backward(batches, loss_fn)
        policy.optimizer_step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    step = statistics.median(seconds[warmup:])
    flops = training_step_flops(read_qwen3_config(hf_config), rows, seq_len)
    return {"layer_spec": "transformer_engine" if policy.uses_transformer_engine else "local", "seq_len": seq_len,
            "rows": rows, "steps": steps, "recompute": recompute, "step_seconds": step, "step_seconds_all": seconds,
            "model_flops_per_step": flops, "model_tflops_per_s": flops / step / 1e12, "peak_tflops": peak_tflops,
            "mfu": flops / step / 1e12 / peak_tflops,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def bf16_parity(hf_config: dict, device: str, seq_len: int, rows: int) -> dict:
    """``MegatronPolicy`` in bf16 (weights and activations; fp32 gradient accumulation) against ``HFPolicy`` in fp32
    on the same weights and sequences: log-prob and loss differences, and the worst parameter's gradient error
    (relative norm)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.models.megatron.policy import MegatronPolicy

    device = torch.device(device)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**hf_config))
    policy = MegatronPolicy.from_hf_model(model, device=device, distributed_optimizer=True, bf16_weights=True)
    hf = HFPolicy(model, device=device, precision="fp32")
    batches = random_sequences(hf_config["vocab_size"], rows, seq_len, device)
    loss_fn = mean_logprob_loss(rows * (seq_len - 1))
    with torch.no_grad():
        logprob_error = max(float((policy.token_logprobs(b) - hf.token_logprobs(b)).abs().max()) for b in batches)
    losses: dict[str, list[float]] = {}
    for name, trained in (("megatron", policy), ("hf", hf)):
        metrics = trained.forward_backward(batches, lambda logprobs, index: _with_loss(*loss_fn(logprobs, index)))
        losses[name] = [micro["loss"] for micro in metrics]
    grads = policy.gather_hf({name: param.main_grad for name, param in policy.model.named_parameters()})
    grad_error = max(float((grads[name] - param.grad).norm() / param.grad.norm()) for name, param in hf.model.named_parameters())
    loss, hf_loss = sum(losses["megatron"]), sum(losses["hf"])
    return {"seq_len": seq_len, "rows": rows, "logprob_max_abs_diff": logprob_error, "loss": loss, "hf_loss": hf_loss,
            "loss_rel_diff": abs(loss - hf_loss) / abs(hf_loss), "grad_max_rel_norm_error": grad_error}


def _with_loss(loss: torch.Tensor, metrics: dict) -> tuple[torch.Tensor, dict]:
    return loss, {**metrics, "loss": float(loss.detach())}


def measure_gpu(args) -> dict:
    """The ``--gpu`` report: MFU at the Qwen3-0.6B shape, then bf16 parity (each in a one-rank NCCL group)."""
    import torch.distributed as dist

    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    if peak is None:
        raise SystemExit(f"error: no known bf16 peak for {name!r}: pass --peak-tflops (its dense bf16 TFLOP/s)")
    hf_config = architecture("0.6b").hf_config
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("nccl", init_method=f"file://{store.name}", rank=0, world_size=1)
        mfu = measure_mfu(hf_config, "cuda", args.seq_len, args.rows, args.steps, args.warmup, peak, args.recompute)
        parity = bf16_parity(hf_config, "cuda", args.parity_seq_len, 2)
    return {"device": name, "torch": torch.__version__, "mfu": mfu, "bf16_parity": parity,
            "targets_met": {"mfu_at_least_0.45": mfu["mfu"] >= 0.45}}


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
    from nemo_jq.recipe.trainer import Trainer

    overrides = ["objective.name=garl", f"objective.q={args.q}"]
    trainers = {backend: Trainer(load_config(None, [*tiny_overrides(args, work / backend), *overrides,
                                                    f"model.backend={backend}"]))
                for backend in ("megatron", "hf")}
    examples = trainers["hf"].components.splits.train[: args.prompts]
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for repeat in range(args.warmup + args.repeats):
        order = ["megatron", "hf"] if repeat % 2 == 0 else ["hf", "megatron"]
        for name in order:
            trainer = trainers[name]
            trainer.random.rollout.manual_seed(0)
            trainer.random.estimator.manual_seed(1)
            started = time.perf_counter()
            trainer.train_step(examples)
            times[name].append(time.perf_counter() - started)
    return times["megatron"][args.warmup :], times["hf"][args.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "megatron_backend.json")
    parser.add_argument("--gpu", action="store_true", help="the GPU measurement only: MFU (Qwen3-0.6B shape, bf16) "
                        "and bf16 parity against the HF backend")
    parser.add_argument("--seq-len", type=int, default=4096, help="--gpu: tokens per sequence")
    parser.add_argument("--rows", type=int, default=8, help="--gpu: sequences per step, one per micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="--gpu: timed steps (after --warmup)")
    parser.add_argument("--recompute", action="store_true", help="--gpu: full activation recomputation")
    parser.add_argument("--parity-seq-len", type=int, default=1024, help="--gpu: tokens per sequence of the parity check")
    parser.add_argument("--peak-tflops", type=float, help="--gpu: the device's dense bf16 TFLOP/s (known H100/H200 names: "
                        "looked up)")
    args = parser.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("error: --gpu needs a CUDA device; run without --gpu for the CPU measurements")
        gpu = measure_gpu(args)
        print(json.dumps(gpu, indent=2))
        args.out.with_name("megatron_backend_gpu.json").write_text(json.dumps(gpu, indent=2) + "\n")
        return
    if args.quick:
        args.repeats, args.warmup = 3, 1
        args.mem_tokens, args.mem_vocab, args.mem_hidden = 1024, 32768, 256
    torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        from megatron_cpu import patch_megatron_for_cpu
        from nemo_jq.backends import MEGATRON_ON_CPU

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
