"""Step overhead of the J_Q estimators, against TRL, plus log-prob memory.

All in one run, on one model, batch, M and lengths:

1. step time of GARL(q) and PAFT(q) relative to RB-RLOO and to GRPO (our trainer's full step:
   rollout + forward/backward + AdamW); lr=0 keeps the weights, hence the rollouts, identical
   across repeats, and the estimators are timed interleaved (A B C D, B C D A, ...) so drift hits
   all alike. Each ratio is the median of the per-round ratios with a bootstrap 95% interval over
   rounds, and the estimator's own share of the step (its forward call) is reported beside it;
   GARL(q) with the importance correction on (objective.importance=truncate: the ratios of the
   engine's log-probs, which it always reports) relative to GARL(q) without it;
2. our RB-RLOO step relative to TRL's GRPOTrainer on the same weights, prompts and completion
   length (TRL generates, scores and steps inside ``training_step``);
3. peak memory of the chunked log-probs vs a full log_softmax at V=151936, T=4096, H=1024
   (a one-layer stand-in: hidden states and LM head only), each in a fresh process.

Targets: GARL and PAFT within 2% of RB-RLOO, and the correction within 2% of GARL's step; chunked
log-probs <= 15% of the naive peak;
our step faster than TRL's. Usage: python bench/step_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nemo_jq.recipe.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tiny_overrides(args, run_dir: Path) -> list[str]:
    return [
        f"model.tiny.hidden_size={args.hidden}", f"model.tiny.intermediate_size={3 * args.hidden}",
        f"rollout.num_samples={args.samples}", f"rollout.max_thinking_tokens={args.thinking}",
        f"rollout.max_answer_tokens={args.answer}", f"train.batch_size={args.prompts}",
        f"train.micro_batch_size={args.prompts}", "optim.lr=0.0", "train.tensorboard=false",
        f"data.train_size={max(args.prompts, 64)}", f"train.run_dir={run_dir}",
    ]


def paired_ratio(numerator: list[float], denominator: list[float], resamples: int = 2000) -> dict[str, float]:
    """Median of the per-round ratios, with a bootstrap 95% interval over rounds (seeded)."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(ratios), (resamples, len(ratios)), generator=generator)
    medians = torch.tensor(ratios, dtype=torch.float64)[picks].median(dim=1).values
    low, high = torch.quantile(medians, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"median": statistics.median(ratios), "ci95_low": low, "ci95_high": high}


def timed_estimator(trainer, seconds: list[float]) -> None:
    """Make ``trainer`` record how long each call of its estimator takes (the forward part of its work)."""
    import dataclasses

    estimator = trainer.objective.estimator.fn

    def timed(inputs, options):
        started = time.perf_counter()
        out = estimator(inputs, options)
        seconds[-1] += time.perf_counter() - started
        return out

    trainer.objective.estimator = dataclasses.replace(trainer.objective.estimator, fn=timed)


def estimator_step_times(args, work: Path) -> tuple[dict[str, list[float]], dict[str, list[float]], "Trainer"]:
    """Per-round step seconds and estimator seconds of each method, measured interleaved."""
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    methods = {
        "rb_rloo": ["objective.name=rb_rloo"],
        f"garl_q{args.q}": ["objective.name=garl", f"objective.q={args.q}"],
        f"paft_q{args.q}": ["objective.name=paft", f"objective.q={args.q}"],
        "grpo": ["objective.name=grpo"],
        f"garl_q{args.q}_corrected": ["objective.name=garl", f"objective.q={args.q}", "objective.importance=truncate"],
    }
    trainers = {name: Trainer(load_config(None, tiny_overrides(args, work / name) + extra)) for name, extra in methods.items()}
    examples = trainers["rb_rloo"].components.splits.train[: args.prompts]
    times: dict[str, list[float]] = {name: [] for name in trainers}
    estimator: dict[str, list[float]] = {name: [] for name in trainers}
    for name, trainer in trainers.items():
        timed_estimator(trainer, estimator[name])
    names = list(trainers)
    for repeat in range(args.warmup + args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # rotate who goes first
            trainer = trainers[name]
            trainer.random.rollout.manual_seed(0)
            trainer.random.estimator.manual_seed(1)
            estimator[name].append(0.0)
            started = time.perf_counter()
            trainer.train_step(examples)
            times[name].append(time.perf_counter() - started)
    warm = slice(args.warmup, None)
    return ({name: values[warm] for name, values in times.items()},
            {name: values[warm] for name, values in estimator.items()}, trainers["rb_rloo"])


def trl_step_time(args, trainer, work: Path) -> tuple[float, float]:
    """Median TRL GRPOTrainer step time and its mean completion length (tokens)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir = work / "trl_model"
    parts = trainer.components
    parts.policy.export(model_dir, parts.tokenizer)
    prompts = [parts.tokenizer.decode(p) for p in parts.prompt_ids(parts.splits.train[: args.prompts])]
    completion_length = args.thinking + 1 + args.answer
    durations: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs):
            durations.append(time.perf_counter() - self.started)

    config = GRPOConfig(
        output_dir=str(work / "trl_out"), per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples, max_completion_length=completion_length, temperature=1.0, top_p=1.0,
        beta=0.0, learning_rate=0.0, max_steps=args.warmup + args.repeats, logging_steps=1, report_to="none",
        use_cpu=True, save_strategy="no", seed=0, bf16=False, num_iterations=1, shuffle_dataset=False,
    )
    grpo = GRPOTrainer(
        model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=parts.tokenizer,
        callbacks=[StepTimer()],
    )
    grpo.train()
    lengths = [float(log["completions/mean_length"]) for log in grpo.state.log_history if "completions/mean_length" in log]
    return statistics.median(durations[args.warmup :]), statistics.mean(lengths)


def memory_probe(variant: str, tokens: int, vocab: int, hidden: int, chunk: int) -> None:
    """Run in a fresh process: print the peak extra memory (bytes) of one forward+backward."""
    from nemo_jq.models.logprobs import chunked_token_logprobs

    torch.manual_seed(0)
    h = (torch.randn(tokens, hidden) * 0.02).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    cuda = torch.cuda.is_available()
    if cuda:
        h, w, targets = h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), targets.cuda()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:  # current resident set: an import-time high-water mark above it can only overstate the peak
        baseline = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    if variant == "naive":
        logprobs = torch.log_softmax(h @ w.T, -1).gather(1, targets[:, None]).squeeze(1)
    else:
        logprobs = chunked_token_logprobs(h, w, targets, chunk)
    logprobs.sum().backward()
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"variant": variant, "extra_bytes": peak - baseline, "device": "cuda" if cuda else "cpu"}))


def memory_comparison(args) -> dict[str, float]:
    results = {}
    for variant in ("naive", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-probe", variant, "--mem-tokens", str(args.mem_tokens),
             "--mem-vocab", str(args.mem_vocab), "--mem-hidden", str(args.mem_hidden), "--chunk", str(args.chunk)],
            capture_output=True, text=True, check=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]
    return {"naive_peak_gb": results["naive"] / 2**30, "chunked_peak_gb": results["chunked"] / 2**30,
            "chunked_over_naive": results["chunked"] / results["naive"]}


#: The settings every benchmark here records in its results.
SETUP_KEYS = ("prompts", "samples", "thinking", "answer", "hidden", "q", "repeats", "threads", "mem_tokens", "mem_vocab",
              "mem_hidden", "chunk")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The tiny training setup and the memory case, shared by the benchmarks in bench/."""
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="M")
    parser.add_argument("--thinking", type=int, default=24)
    parser.add_argument("--answer", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--q", type=float, default=0.75)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mem-tokens", type=int, default=4096)
    parser.add_argument("--mem-vocab", type=int, default=151936)
    parser.add_argument("--mem-hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="few repeats and a small memory case (smoke test)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "step_overhead.json")
    parser.add_argument("--memory-probe", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(args.memory_probe, args.mem_tokens, args.mem_vocab, args.mem_hidden, args.chunk)
        return
    if args.quick:
        args.repeats, args.warmup = 3, 1
        args.mem_tokens, args.mem_vocab, args.mem_hidden = 4096, 32768, 256
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rounds, estimator_rounds, reference = estimator_step_times(args, work)
        trl, trl_length = (None, None) if args.skip_trl else trl_step_time(args, reference, work)
    memory = memory_comparison(args)

    q = args.q
    steps = {name: statistics.median(values) for name, values in rounds.items()}
    rb = steps["rb_rloo"]
    paired = {f"{a}_over_{b}": paired_ratio(rounds[a], rounds[b])
              for a, b in ((f"garl_q{q}", "rb_rloo"), (f"paft_q{q}", "rb_rloo"), (f"garl_q{q}", "grpo"), (f"paft_q{q}", "grpo"),
                           (f"garl_q{q}_corrected", f"garl_q{q}"))}
    estimator_share = {name: statistics.median(e / s for e, s in zip(estimator_rounds[name], rounds[name]))
                       for name in rounds}
    result = {
        "setup": {k: getattr(args, k) for k in SETUP_KEYS},
        "torch": torch.__version__,
        "step_seconds": {**steps, **({"trl_grpo": trl} if trl is not None else {})},
        "paired_step_ratios": paired,
        "estimator_share_of_step": estimator_share,
        "ratios": {
            "garl_over_rb_rloo": paired[f"garl_q{q}_over_rb_rloo"]["median"],
            "paft_over_rb_rloo": paired[f"paft_q{q}_over_rb_rloo"]["median"],
            "garl_over_grpo": paired[f"garl_q{q}_over_grpo"]["median"],
            "paft_over_grpo": paired[f"paft_q{q}_over_grpo"]["median"],
            "corrected_garl_over_garl": paired[f"garl_q{q}_corrected_over_garl_q{q}"]["median"],
            **({"rb_rloo_over_trl_grpo": rb / trl} if trl is not None else {}),
            "chunked_over_naive_memory": memory["chunked_over_naive"],
        },
        "trl_mean_completion_tokens": trl_length,
        "memory": memory,
    }
    result["targets_met"] = {
        "garl_within_2pct_of_rb_rloo": abs(result["ratios"]["garl_over_rb_rloo"] - 1) <= 0.02,
        "paft_within_2pct_of_rb_rloo": abs(result["ratios"]["paft_over_rb_rloo"] - 1) <= 0.02,
        "correction_within_2pct_of_garl": result["ratios"]["corrected_garl_over_garl"] - 1 <= 0.02,
        "chunked_memory_at_most_15pct": memory["chunked_over_naive"] <= 0.15,
        **({"faster_than_trl": rb < trl} if trl is not None else {}),
    }
    print(f"{'quantity':<44}{'value':>14}")
    for key, value in {**{f"step s {k}": v for k, v in result["step_seconds"].items()}, **result["ratios"],
                       **memory}.items():
        print(f"{key:<44}{value:>14.4f}")
    for key, value in paired.items():
        print(f"{'paired ' + key:<44}{value['median']:>14.4f}  95% CI [{value['ci95_low']:.4f}, {value['ci95_high']:.4f}]")
    for key, value in estimator_share.items():
        print(f"{'estimator share of step ' + key:<44}{value:>14.4f}")
    for key, value in result["targets_met"].items():
        print(f"{'target ' + key:<44}{'met' if value else 'MISSED':>14}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
