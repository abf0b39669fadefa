"""Qwen3's decode step over a static KV cache, for :mod:`nemo_jq.rollouts.graphs` (one file per model family).

One token per row through the HF model's own modules and tensors: its RMS norms and rotary embedding are called as
they are; its matrix products take the weights in the compute dtype, cast once per sampling call where the model
holds them in another (an fp32 policy under bf16 autocast: the cast autocast would redo at every step), else the
model's own tensors (a bf16 sampler copy, refitted in place, which a captured graph then reads). Keys and values go
into the caller's buffers at one column for every row, and attention reads the first ``length`` columns under the
caller's mask. The dtypes follow what HF's forward does under autocast: the residual stream in the embedding's
dtype, matrix products and attention in the compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nemo_jq.rollouts.graphs import fused, register_decode_step

#: Rotary embeddings whose HF module computes cos/sin from the positions alone (the dynamic kinds read the longest
#: position on the host at every call, which a captured graph cannot).
STATIC_ROPE = ("default", "linear", "yarn", "llama3")


def supports(model: Any) -> bool:
    """Whether the model's shape is the one :class:`Qwen3DecodeStep` computes: full attention in every layer, a rotary
    embedding of a static kind, SiLU gates, no biases."""
    config = model.config.get_text_config(decoder=True)
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    return (rotary is not None and getattr(rotary, "rope_type", "default") in STATIC_ROPE
            and config.hidden_act == "silu" and not getattr(config, "attention_bias", False)
            and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
            and not getattr(config, "use_sliding_window", False))


@register_decode_step("qwen3", supports=supports)
class Qwen3DecodeStep:
    """``step(tokens [b], positions [b], column [1], mask [b, length], keys, values, attend) -> logits [b, V]``.

    Each layer is two pure functions of tensors around the cache write and attention (:func:`attention_inputs`,
    :func:`layer_output`): the same code for every layer, so that ``compiled`` (``torch.compile``, shapes dynamic)
    compiles each once and fuses its elementwise work, and the cache, written in place, stays outside it."""

    def __init__(self, model: Any, compute_dtype: torch.dtype | None, compiled: bool = False):
        decoder, config = model.get_decoder(), model.config.get_text_config(decoder=True)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale, self.eps = self.head_dim ** -0.5, config.rms_norm_eps
        self.dtype = compute_dtype or decoder.embed_tokens.weight.dtype
        #: The weights cast to ``dtype`` for this step (the memory it holds beyond the model's).
        self.copies: list[torch.Tensor] = []
        self.embedding, self.rotary, self.final_norm = decoder.embed_tokens.weight, decoder.rotary_emb, decoder.norm.weight
        self.layers = [self._layer(layer) for layer in decoder.layers]
        (self.head,) = self._cast([model.get_output_embeddings().weight])
        self.inputs, self.output = (fused(attention_inputs), fused(layer_output)) if compiled else (attention_inputs, layer_output)

    def _cast(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``tensors`` as the step reads them: the model's own where already in ``dtype``, else one cast of them all,
        stacked along the output features."""
        if all(tensor.dtype == self.dtype for tensor in tensors):
            return tuple(tensor.detach() for tensor in tensors)
        stacked = tensors[0].new_empty((sum(tensor.shape[0] for tensor in tensors), *tensors[0].shape[1:]), dtype=self.dtype)
        for part, tensor in zip(stacked.split([tensor.shape[0] for tensor in tensors]), tensors):
            part.copy_(tensor.detach())  # cast in place: no fp32 stack, no bf16 pieces beside it
        self.copies.append(stacked)
        return (stacked,)

    def _layer(self, layer: Any) -> dict[str, Any]:
        """The layer's weights: where they are cast anyway, q/k/v and gate/up each cast into one matrix (one matrix
        product where there were three and two: fewer kernels a step, no memory beyond the cast's)."""
        attention, mlp = layer.self_attn, layer.mlp
        groups = {"qkv": (attention.q_proj, attention.k_proj, attention.v_proj), "o": (attention.o_proj,),
                  "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}
        weights = {name: self._cast([linear.weight for linear in linears]) for name, linears in groups.items()}
        norms = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                 "q_norm": attention.q_norm.weight, "k_norm": attention.k_norm.weight}
        return {**weights, **{name: weight.detach() for name, weight in norms.items()}}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, column: torch.Tensor, mask: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor], attend) -> torch.Tensor:
        x = F.embedding(tokens, self.embedding)[:, None]  # [b, 1, H]
        cos, sin = self.rotary(x, positions[:, None])
        length = mask.shape[1]
        for w, layer_keys, layer_values in zip(self.layers, keys, values):
            q, k, v = self.inputs(x, cos, sin, w["input_norm"], w["qkv"], w["q_norm"], w["k_norm"],
                                  self.heads, self.kv_heads, self.head_dim, self.eps, layer_keys.dtype)
            layer_keys.index_copy_(2, column, k)
            layer_values.index_copy_(2, column, v)
            out = attend(q, layer_keys[:, :, :length], layer_values[:, :, :length], mask, self.scale)
            x = self.output(x, out, w["o"][0], w["post_norm"], w["gate_up"], w["down"][0], self.eps)
        return F.linear(rms_norm(x, self.final_norm, self.eps)[:, 0].to(self.dtype), self.head)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3RMSNorm: normalised in fp32, back in ``x``'s dtype, times the weight (in their promoted dtype)."""
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def attention_inputs(x, cos, sin, input_norm, qkv: tuple, q_norm, k_norm, heads: int, kv_heads: int, dim: int,
                     eps: float, kv_dtype: torch.dtype):
    """The layer's queries [b, heads, 1, d], keys and values [b, kv_heads, 1, d] (keys and values in ``kv_dtype``);
    ``qkv``: the three projections' weights, or one matrix stacking them."""
    rows = x.shape[0]
    h = rms_norm(x, input_norm, eps).to(qkv[0].dtype)
    q, k, v = project(h, qkv, [heads * dim, kv_heads * dim, kv_heads * dim])
    q = rms_norm(q.view(rows, 1, heads, dim), q_norm, eps).transpose(1, 2)
    k = rms_norm(k.view(rows, 1, kv_heads, dim), k_norm, eps).transpose(1, 2)
    v = v.view(rows, 1, kv_heads, dim).transpose(1, 2)
    return rotate(q, cos, sin).to(kv_dtype), rotate(k, cos, sin).to(kv_dtype), v.to(kv_dtype)


def layer_output(x, attended, wo, post_norm, gate_up: tuple, down, eps: float):
    """The residual stream after the attention's projection and the MLP (``gate_up``: two weights, or one stacking
    them)."""
    x = x + F.linear(attended.reshape(x.shape[0], 1, -1).to(wo.dtype), wo)
    h = rms_norm(x, post_norm, eps).to(gate_up[0].dtype)
    gate, up = project(h, gate_up, [down.shape[1]] * 2)
    return x + F.linear(F.silu(gate) * up, down)


def project(h: torch.Tensor, weights: tuple, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """``h`` through each weight, or through one stacking them all, split into ``sizes`` features."""
    if len(weights) == 1:
        return F.linear(h, weights[0]).split(sizes, dim=-1)
    return tuple(F.linear(h, weight) for weight in weights)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding on ``x`` [b, heads, 1, d] (``cos``, ``sin``: [b, 1, d]), written here: importing HF's
    modeling file would load transformers with ``nemo_jq.rollouts``, and its ``apply_rotary_pos_emb`` may be replaced
    by a hub kernel."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
