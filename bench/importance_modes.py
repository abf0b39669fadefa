"""Which ``objective.importance`` for long rationales: each mode's bias and spread against the exact gradient.

Issue 43's L5: ``objective.importance=auto`` picks sequence truncation for vLLM; over 1k-4k-token rationales a
sequence ratio spreads over e^{±σ√T}. This measures, on the CPU, every mode of the project's own GARL estimator
(``nemo_jq.objectives.garl`` with each :class:`~nemo_jq.objectives.importance.Correction`) against the exact gradient
of ℓ_q, in a model small enough to have one and long enough to matter:

* a rationale of T binary tokens, the policy's log-odds θ the same at every position (p = σ(θ) = 0.3), and w(z) =
  p(y*|z) = σ(-3 + 4 (n - T p)/√T), n the count of ones: P = E_p[w] and ∇_θ ℓ_q = -P^{-q} E_p[w (n - T p)] are sums over
  n ~ Binomial(T, p), exact;
* the engine samples each token with its log-odds off by ±δ (half the positions +δ, half -δ: a per-token error that
  averages out, as a bf16 engine's does, not a shift), δ chosen so that the per-token log-ratio log p(z_t) - log π(z_t)
  has standard deviation ``gap`` under π. The gap assumed: 0.04 and 0.02. A bf16 engine against an fp32 trainer shows a
  per-token KL(π‖p) of ~1e-3 (peers' mismatch metrics, e.g. verl's and NeMo-RL's logs; the k3 estimate this project
  logs as ``kl_k3``), and for small errors KL ≈ σ²/2: σ ≈ 0.045; 0.02 is a closer engine.

Per mode: the per-group gradient of ``garl(...)`` over many groups of M rationales sampled from π; its mean's distance
to the exact ∇ℓ_q (bias), its standard deviation over groups (spread), and the error of a step of 64 prompts
(√(bias² + spread²/64), the 8B configs' batch), all relative to |∇ℓ_q|; and the effective sample size the estimator
reports (``is_ess_fraction``). ``on-policy`` samples from p itself: its error is the estimator's own (q > 0's O(1/M)).

Usage: python bench/importance_modes.py [--quick] (writes bench/results/importance_modes.json and .md)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from nemo_jq.objectives.garl import garl
from nemo_jq.objectives.importance import Correction, SampledTokens

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "importance_modes.json"
TABLE = ROOT / "bench" / "results" / "importance_modes.md"
P_TOKEN, W_OFFSET, W_SLOPE = 0.3, -3.0, 4.0
#: The modes measured: the correction (None: none, the engine's samples taken as the policy's), and on-policy samples.
MODES = {"on-policy": None, "none": None, "plain": Correction("plain"), "truncate": Correction("truncate", cap=2.0),
         "mask": Correction("mask", low=0.5, high=2.0), "token_truncate": Correction("token_truncate", cap=2.0),
         "geometric": Correction("geometric", cap=2.0)}


def log_w(ones: torch.Tensor, tokens: int) -> torch.Tensor:
    """log p(y*|z) of rationales with ``ones`` ones among ``tokens``."""
    return torch.nn.functional.logsigmoid(W_OFFSET + W_SLOPE * (ones - tokens * P_TOKEN) / math.sqrt(tokens))


def exact_gradient(tokens: int, q: float) -> float:
    """∇_θ ℓ_q at θ = logit(P_TOKEN): -P^{-q} Σ_n Binom(n) w(n) (n - T p), in float64."""
    n = torch.arange(tokens + 1, dtype=torch.float64)
    log_binom = (torch.lgamma(torch.tensor(tokens + 1.0, dtype=torch.float64)) - torch.lgamma(n + 1)
                 - torch.lgamma(tokens - n + 1) + n * math.log(P_TOKEN) + (tokens - n) * math.log(1 - P_TOKEN))
    weights = torch.exp(log_binom + log_w(n, tokens))
    big_p = float(weights.sum())
    return -big_p ** -q * float((weights * (n - tokens * P_TOKEN)).sum())


def engine_offset(gap: float) -> float:
    """δ such that the per-token log-ratio under π has standard deviation ``gap`` (half the positions at +δ, half -δ)."""
    theta = math.log(P_TOKEN / (1 - P_TOKEN))

    def spread(delta: float) -> float:
        values, probs = [], []
        for sign in (1.0, -1.0):
            engine = 1 / (1 + math.exp(-(theta + sign * delta)))
            for token, pi in ((1, engine), (0, 1 - engine)):
                p = P_TOKEN if token else 1 - P_TOKEN
                values.append(math.log(p) - math.log(pi))
                probs.append(pi / 2)
        mean = sum(v * w for v, w in zip(values, probs))
        return math.sqrt(sum(w * (v - mean) ** 2 for v, w in zip(values, probs)))

    low, high = 0.0, 2.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if spread(mid) < gap else (low, mid)
    return (low + high) / 2


def group_gradients(mode: str, tokens: int, samples: int, groups: int, q: float, gap: float,
                    generator: torch.Generator) -> tuple[torch.Tensor, float | None]:
    """Per-group gradient estimates ``[groups]`` of one mode, and its mean ``is_ess_fraction``."""
    theta = torch.full((groups, 1, 1), math.log(P_TOKEN / (1 - P_TOKEN)), dtype=torch.float64, requires_grad=True)
    delta = engine_offset(gap) if mode != "on-policy" else 0.0
    signs = torch.where(torch.arange(tokens) % 2 == 0, 1.0, -1.0).to(torch.float64)
    engine_odds = theta.detach() + delta * signs
    z = torch.bernoulli(torch.sigmoid(engine_odds).expand(groups, samples, tokens), generator=generator)
    policy = torch.where(z > 0, torch.nn.functional.logsigmoid(theta), torch.nn.functional.logsigmoid(-theta))
    policy = policy.expand(groups, samples, tokens)
    behavior = torch.where(z > 0, torch.nn.functional.logsigmoid(engine_odds), torch.nn.functional.logsigmoid(-engine_odds))
    answer = log_w(z.sum(-1), tokens)
    correction = MODES[mode]
    plain = dict(normalize=False)  # the gradient of l_q itself, not Alg. 1's 1/M^q-scaled one
    if correction is None:
        out = garl(policy.sum(-1), answer, q, **plain)
    elif correction.per_token:
        out = garl(policy.sum(-1), answer, q, correction=correction, **plain,
                   behavior_logprob=SampledTokens(policy, behavior, torch.ones_like(z, dtype=torch.bool)))
    else:
        out = garl(policy.sum(-1), answer, q, correction=correction, behavior_logprob=behavior.sum(-1), **plain)
    (grad,) = torch.autograd.grad(out.per_example.sum(), theta)
    return grad.flatten(), out.metrics.get("is_ess_fraction")


def measure(tokens: int, q: float, gap: float, samples: int, groups: int, chunk: int, seed: int) -> dict:
    exact = exact_gradient(tokens, q)
    rows = {}
    for mode in MODES:
        generator = torch.Generator().manual_seed(seed)
        parts, ess = [], []
        for _ in range(groups // chunk):
            grads, fraction = group_gradients(mode, tokens, samples, chunk, q, gap, generator)
            parts.append(grads)
            ess.append(fraction)
        grads = torch.cat(parts)
        bias, spread = float(grads.mean()) - exact, float(grads.std())
        rows[mode] = {"relative_bias": bias / abs(exact), "relative_bias_se": spread / math.sqrt(len(grads)) / abs(exact),
                      "relative_spread": spread / abs(exact),
                      "relative_error_64": math.sqrt(bias ** 2 + spread ** 2 / 64) / abs(exact),
                      "ess_fraction": None if ess[0] is None else sum(ess) / len(ess)}
    return {"tokens": tokens, "q": q, "gap": gap, "exact_gradient": exact, "modes": rows}


def markdown(results: list[dict], settings: dict) -> str:
    lines = ["# objective.importance over long rationales (`python bench/importance_modes.py`)", "",
             f"M={settings['samples']}, {settings['groups']} groups a case, GARL; relative to |∇ℓ_q| (exact): bias ± "
             "its standard error, the spread of one group's estimate, and the error of a 64-prompt step "
             "(√(bias² + spread²/64)); ESS: the estimator's `is_ess_fraction`. The model and the gap: the script's "
             "docstring.", "",
             "| T | gap | q | mode | bias | spread | error, 64 prompts | ESS |", "| --- " * 8 + "|"]
    for case in results:
        for mode, row in case["modes"].items():
            ess = "–" if row["ess_fraction"] is None else f"{row['ess_fraction']:.2f}"
            lines.append(f"| {case['tokens']} | {case['gap']} | {case['q']} | {mode} | {row['relative_bias']:+.3f} ± "
                         f"{row['relative_bias_se']:.3f} | {row['relative_spread']:.2f} | {row['relative_error_64']:.3f} | "
                         f"{ess} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke size (not a result)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = dict(samples=16, groups=64 if args.quick else 4096, chunk=64 if args.quick else 256)
    lengths, gaps, qs = ([256], [0.04], [0.0]) if args.quick else ([1024, 2048, 4096], [0.02, 0.04], [0.0, 0.75])
    started, results = time.perf_counter(), []
    for tokens in lengths:
        for gap in gaps:
            for q in qs:
                results.append(measure(tokens, q, gap, settings["samples"], settings["groups"], settings["chunk"], seed=0))
                best = min((m for m in results[-1]["modes"] if m != "on-policy"),
                           key=lambda m: results[-1]["modes"][m]["relative_error_64"])
                print(f"T={tokens} gap={gap} q={q}: least error {best} "
                      f"{results[-1]['modes'][best]['relative_error_64']:.3f} ({time.perf_counter() - started:.0f} s)",
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    if not args.quick:
        TABLE.write_text(markdown(results, settings))
    print(markdown(results, settings))


if __name__ == "__main__":
    main()
