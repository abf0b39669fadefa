"""PyTorch SDPA as the core attention of megatron-core's local layer spec (GPU without Transformer Engine).

megatron-core's local ``DotProductAttention`` forms the scores ``[b, heads / TP, s, s]`` with ``baddbmm`` and
keeps their softmax for backward: at s = 4k and 16 heads, 0.5 GiB per sequence and layer in bf16. PyTorch's
``scaled_dot_product_attention`` computes the same attention in flash or memory-efficient kernels that keep
only ``[b, heads, s]`` log-sum-exps. The spec names its core attention as a submodule
(``SelfAttentionSubmodules.core_attention``), built with ``DotProductAttention``'s arguments and called with
its ``forward`` arguments, so a subclass that keeps its constructor and replaces ``forward`` is a drop-in.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jq.models.megatron import transformer_engine_usable

transformer_engine_usable()  # before importing megatron.core
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402


class SDPADotProductAttention(DotProductAttention):
    """``DotProductAttention`` (its constructor, scale, heads per TP rank, dropout) whose ``forward`` is PyTorch's
    SDPA: ``[s, b, heads / TP, d]`` queries and ``[s, b, groups / TP, d]`` keys and values in, ``[s, b, heads / TP
    x d]`` out. With no mask it is causal (the layer's ``attn_mask_type``), which lets SDPA pick a flash kernel;
    a boolean mask (True: masked, megatron-core's convention) is honoured as given."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None or self.softmax_offset is not None:
            raise NotImplementedError("SDPA core attention: no attention bias, packed sequences or softmax offset")
        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))  # [b, heads, s, d]
        if repeats > 1:
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        context = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=None if attention_mask is None else ~attention_mask, is_causal=causal,
            dropout_p=self.attention_dropout.p if self.training else 0.0, scale=self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)
