"""The tiny models, batches and steps that the Megatron backend's CPU tests (this folder) share; imported by name
(this folder is on the import path, as pytest puts it there), in the test processes and in the gloo workers."""

from __future__ import annotations

import pytest
import torch

from nemo_jq.models.interfaces import TokenBatch
from nemo_jq.objectives import garl

CPU = torch.device("cpu")
PROMPTS, SAMPLES, LENGTH = 2, 4, 14  # one micro-batch per prompt group
#: Optimizer settings for the step comparison: clipping active, and an Adam eps that keeps the
#: first step (~ lr * g / (|g| + eps)) smooth in g, so float-level gradient differences stay small.
OPTIM = {"lr": 1e-2, "eps": 1e-3, "grad_clip": 0.1}


def untied_qwen3(seed: int = 0):
    """Like Qwen3-8B in the ways that matter here: untied LM head, head_dim != hidden/heads, rope base 1e6;
    and a vocabulary (317) that Megatron must pad."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=317, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                         max_position_embeddings=128, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)


def megatron_names(num_layers: int, tied: bool, fused_norms: bool = False) -> list[str]:
    """The GPTModel parameter names of a Qwen3: the local spec's, or Transformer Engine's (norms fused into linears)."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", *([] if tied else ["output_layer.weight"])]
    for layer in range(num_layers):
        prefix = f"decoder.layers.{layer}."
        names += [prefix + name for name in (
            "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight",
            "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
            "self_attention.linear_proj.weight",
            "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
        )]
    return names


def garl_batch(vocab_size: int, seed: int = 1) -> TokenBatch:
    """``PROMPTS x SAMPLES`` right-padded rows: a 3-token prompt, rationale targets at 3..7, answer targets from 8."""
    generator = torch.Generator().manual_seed(seed)
    rows = PROMPTS * SAMPLES
    lengths = torch.randint(LENGTH - 4, LENGTH + 1, (rows,), generator=generator)
    attention = (torch.arange(LENGTH) < lengths[:, None]).long()
    input_ids = torch.randint(vocab_size, (rows, LENGTH), generator=generator) * attention
    predicted = torch.arange(1, LENGTH)  # the position each target token sits at
    real = attention[:, 1:].bool()
    return TokenBatch(input_ids, attention, real & (predicted >= 3) & (predicted < 8), real & (predicted >= 8))


def garl_loss_fn(micro_batches: list[TokenBatch], losses: list[float]):
    """The trainer's loss: GARL(q=0.75) per prompt group, summed and divided by all prompts (over all DP ranks)."""
    def loss_fn(logprobs: torch.Tensor, index: int) -> tuple[torch.Tensor, dict[str, float]]:
        micro = micro_batches[index]
        rationale = (logprobs * micro.rationale_mask).sum(-1).view(-1, SAMPLES)
        answer = (logprobs * micro.answer_mask).sum(-1).view(-1, SAMPLES)
        loss = garl(rationale, answer, q=0.75).per_example.sum() / PROMPTS
        losses.append(float(loss.detach()))  # the calls on this rank
        return loss, {"loss": float(loss.detach()), "micro_batch": index}
    return loss_fn


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def garl_step(policy, batch: TokenBatch) -> None:
    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    policy.forward_backward(micro_batches, garl_loss_fn(micro_batches, []))
    policy.optimizer_step()


def train_steps(run_dir, overrides: list[str], steps: int = 3, resume: bool = False) -> list[dict[str, float]]:
    """``steps`` steps of the recipe (a new run, or ``resume``d with ``overrides``); the per-step training metrics
    from metrics.jsonl."""
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.monitor import read_metrics

    if resume:
        Trainer.resume(run_dir, [f"train.max_steps={steps}", *overrides]).fit()
    else:
        Trainer(load_config(None, [*TINY_RUN, f"train.max_steps={steps}", "eval.every=1000", f"train.run_dir={run_dir}",
                                   *overrides])).fit()
    keys = ("loss", "grad_norm", "rollout_tokens", "routing_disagreement", "load_balancing_loss")
    return [{key: record.get(key) for key in keys} for record in read_metrics(run_dir) if record["kind"] == "train"]


def assert_same_training(ours: list[dict], theirs: list[dict]) -> None:
    assert [r["rollout_tokens"] for r in ours] == [r["rollout_tokens"] for r in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(other[key], rel=1e-4, abs=1e-5), (key, mine, other)


#: The tiny Qwen3-MoE's experts, and how many each token is routed to.
EXPERTS, TOP_K = 4, 2


def tiny_qwen3_moe(folder, *, norm_topk_prob: bool = True, seed: int = 0, vocab_size: int = 317):
    """A random Qwen3-MoE of two layers, 4 experts, top-2, saved as transformers saves one (per-expert tensors)."""
    from helpers import tiny_qwen3_moe_model

    tiny_qwen3_moe_model(experts=EXPERTS, top_k=TOP_K, norm_topk_prob=norm_topk_prob, seed=seed,
                         vocab_size=vocab_size).save_pretrained(folder)
    return folder


def switch_loss(router_logits: torch.Tensor, real: torch.Tensor, coef: float,
                dispatched: torch.Tensor | None = None) -> torch.Tensor:
    """megatron-core's load-balancing loss of one layer and micro-batch, written out: over the real tokens,
    ``coef * E / (k T^2) * sum_e tokens_e * P_e`` (P: the summed softmax over all experts; tokens: the experts each
    token was ``dispatched`` to ``[T, k]``, by default the softmax's top-k)."""
    probs = torch.softmax(router_logits.float(), dim=-1)[real]
    picked = probs.topk(TOP_K, dim=-1).indices if dispatched is None else dispatched[real]
    chosen = torch.nn.functional.one_hot(picked, EXPERTS).sum((0, 1)).float()
    tokens = probs.shape[0]
    return (probs.sum(0) * chosen).sum() * EXPERTS * coef / (TOP_K * tokens * tokens)
