"""HF Qwen3 weights <-> Megatron ``GPTModel`` shards, per tensor-parallel rank (Bridge's Qwen3 mapping, compact).

Most weights rename one to one. Four layouts differ:

* the fused QKV weight ``[ng * (nq/ng + 2) * d, H]`` is interleaved per query group (each group's
  nq/ng query heads, then its key head, then its value head), so that cutting it into TP
  contiguous row blocks gives each rank whole groups;
* ``linear_fc1`` stacks gate and up ``[2F, H]``; rank r holds ``[gate_r; up_r]`` (each ``[F/TP, H]``),
  because the SwiGLU on each rank splits its own shard in halves;
* row-parallel weights (``linear_proj``, ``linear_fc2``) split their input dimension;
* the embedding and the untied LM head split the vocabulary, padded with zero rows to a
  multiple of 128 and of TP (``provider.padded_vocab_size``); gathering drops the padding again.

Norm weights are replicated on every rank. Only slicing and concatenation happen, so the round
trip HF -> shards -> HF is bit-exact. Pure torch: no megatron import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from nemo_jq.models.megatron.provider import Qwen3Architecture, padded_vocab_size

REPLICATED, ROW_PARALLEL, VOCAB_PARALLEL, QKV, GATED_MLP = "replicated", "row", "vocab", "qkv", "gated_mlp"


@dataclass(frozen=True)
class ParamMapping:
    #: Megatron parameter name; ``(\d+)`` captures the layer index.
    megatron: str
    #: The HF tensors it is made of, ``{}`` standing for the layer index.
    hf: tuple[str, ...]
    layout: str


_LAYER = r"decoder\.layers\.(\d+)\."
_HF_LAYER = "model.layers.{}."

#: Qwen3's mapping. The input norms have two Megatron names: the local spec keeps a separate
#: norm module, Transformer Engine's spec fuses it into the next linear (``layer_norm_weight``).
QWEN3_MAPPING = (
    ParamMapping(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), VOCAB_PARALLEL),
    ParamMapping(r"output_layer\.weight", ("lm_head.weight",), VOCAB_PARALLEL),
    ParamMapping(r"decoder\.final_layernorm\.weight", ("model.norm.weight",), REPLICATED),
    ParamMapping(_LAYER + r"(?:input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)",
                 (_HF_LAYER + "input_layernorm.weight",), REPLICATED),
    ParamMapping(_LAYER + r"(?:pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)",
                 (_HF_LAYER + "post_attention_layernorm.weight",), REPLICATED),
    ParamMapping(_LAYER + r"self_attention\.q_layernorm\.weight", (_HF_LAYER + "self_attn.q_norm.weight",), REPLICATED),
    ParamMapping(_LAYER + r"self_attention\.k_layernorm\.weight", (_HF_LAYER + "self_attn.k_norm.weight",), REPLICATED),
    ParamMapping(_LAYER + r"self_attention\.linear_qkv\.weight",
                 tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"), QKV),
    ParamMapping(_LAYER + r"self_attention\.linear_proj\.weight", (_HF_LAYER + "self_attn.o_proj.weight",), ROW_PARALLEL),
    ParamMapping(_LAYER + r"mlp\.linear_fc1\.weight", (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"),
                 GATED_MLP),
    ParamMapping(_LAYER + r"mlp\.linear_fc2\.weight", (_HF_LAYER + "mlp.down_proj.weight",), ROW_PARALLEL),
)


def _resolve(megatron_name: str) -> tuple[ParamMapping, tuple[str, ...]]:
    """The mapping entry of a Megatron parameter and the HF names it is made of."""
    for entry in QWEN3_MAPPING:
        match = re.fullmatch(entry.megatron, megatron_name)
        if match:
            return entry, tuple(name.format(*match.groups()) for name in entry.hf)
    raise ValueError(f"no HF mapping for Megatron parameter {megatron_name!r}")


def hf_names(megatron_name: str) -> tuple[str, ...]:
    """The HF tensors a Megatron parameter is made of, in the order ``megatron_to_hf`` yields them."""
    return _resolve(megatron_name)[1]


def is_tensor_parallel(megatron_name: str) -> bool:
    """Whether TP ranks hold different slices of the parameter (else each holds the same full copy).

    megatron-core marks this on the parameter only when it initialises the weights itself, which
    the provider skips (weights come from the checkpoint), so the mapping says it.
    """
    return _resolve(megatron_name)[0].layout != REPLICATED


def hf_shape(name: str, arch: Qwen3Architecture) -> tuple[int, ...]:
    """The shape the config implies for HF weight ``name`` (keyed by its module's name)."""
    hidden, head, ffn = arch.hidden_size, arch.head_dim, arch.intermediate_size
    queries, keys = arch.num_attention_heads * head, arch.num_key_value_heads * head
    return {
        "embed_tokens": (arch.vocab_size, hidden), "lm_head": (arch.vocab_size, hidden),
        "norm": (hidden,), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
        "q_norm": (head,), "k_norm": (head,),
        "q_proj": (queries, hidden), "k_proj": (keys, hidden), "v_proj": (keys, hidden), "o_proj": (hidden, queries),
        "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn),
    }[name.split(".")[-2]]


_TIED = {"model.embed_tokens.weight": "lm_head.weight", "lm_head.weight": "model.embed_tokens.weight"}


def _hf_tensor(hf_state: Mapping[str, torch.Tensor], name: str, arch: Qwen3Architecture, needed_by: str) -> torch.Tensor:
    """``hf_state[name]``, checked against the config's shape, so a checkpoint of another size fails by name."""
    stored = name
    # A tied checkpoint may store the shared matrix under either name (safetensors' save_model keeps lm_head),
    # and a tied model's last pipeline stage keeps its own copy of it as its LM head.
    if arch.tie_word_embeddings and name in _TIED and name not in hf_state:
        stored = _TIED[name]
    if stored not in hf_state:
        raise ValueError(f"checkpoint is missing {name!r} (needed for Megatron parameter {needed_by!r})")
    tensor, expected = hf_state[stored], hf_shape(name, arch)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint weight {stored!r} has shape {list(tensor.shape)}; the config implies {list(expected)}")
    return tensor


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], megatron_names: Iterable[str], arch: Qwen3Architecture,
                   *, tp_size: int = 1, tp_rank: int = 0, all_names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s shard of each Megatron parameter in ``megatron_names``, from an HF state dict
    (:func:`iter_hf_to_megatron`, collected)."""
    return dict(iter_hf_to_megatron(hf_state, megatron_names, arch, tp_size=tp_size, tp_rank=tp_rank, all_names=all_names))


def iter_hf_to_megatron(hf_state: Mapping[str, torch.Tensor], megatron_names: Iterable[str], arch: Qwen3Architecture,
                        *, tp_size: int = 1, tp_rank: int = 0,
                        all_names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``tp_rank``'s shard of each Megatron parameter, one at a time: with a lazy ``hf_state`` (an HF
    folder read tensor by tensor) a consumer that copies each shard away holds one HF tensor at a time.

    Raises ``ValueError`` naming a missing HF weight, one whose shape the config does not imply, or
    HF weights that no parameter of the model (``all_names``: every pipeline stage's; by default
    ``megatron_names``) uses, a tied model's ``lm_head.weight`` excepted: HF state dicts list the
    shared matrix twice.
    """
    megatron_names = list(megatron_names)
    for megatron_name in megatron_names:
        entry, names = _resolve(megatron_name)
        tensors = [_hf_tensor(hf_state, name, arch, megatron_name) for name in names]
        yield megatron_name, _split(entry.layout, tensors, arch, tp_size, tp_rank)
    used = {name for megatron_name in (all_names or megatron_names) for name in hf_names(megatron_name)}
    unused = set(hf_state) - used - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    if unused:
        raise ValueError(f"checkpoint has weights the Megatron Qwen3 model does not use: {sorted(unused)}")


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], arch: Qwen3Architecture) -> dict[str, torch.Tensor]:
    """The HF state dict from every TP rank's shards (``shards[r]``: rank r's ``{megatron name: tensor}``).

    A tied model has no ``lm_head.weight`` entry, as HF ``save_pretrained`` writes it.
    """
    hf_state = {}
    for megatron_name in shards[0]:
        entry, names = _resolve(megatron_name)
        merged = _merge(entry.layout, [shard[megatron_name] for shard in shards], arch)
        hf_state.update(zip(names, merged))
    return hf_state


def _split(layout: str, tensors: list[torch.Tensor], arch: Qwen3Architecture, tp_size: int, rank: int) -> torch.Tensor:
    if layout == REPLICATED:
        return tensors[0]
    if layout == ROW_PARALLEL:
        return tensors[0].chunk(tp_size, dim=1)[rank]
    if layout == VOCAB_PARALLEL:
        weight = tensors[0]
        padding = padded_vocab_size(arch.vocab_size, tp_size) - weight.shape[0]
        return torch.nn.functional.pad(weight, (0, 0, 0, padding)).chunk(tp_size, dim=0)[rank]
    if layout == QKV:
        return _interleave_qkv(*tensors, arch).chunk(tp_size, dim=0)[rank]
    if layout == GATED_MLP:
        gate, up = tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[rank], up.chunk(tp_size, dim=0)[rank]])
    raise AssertionError(layout)


def _merge(layout: str, shards: list[torch.Tensor], arch: Qwen3Architecture) -> tuple[torch.Tensor, ...]:
    if layout == REPLICATED:
        return (shards[0],)
    if layout == ROW_PARALLEL:
        return (torch.cat(shards, dim=1),)
    if layout == VOCAB_PARALLEL:
        return (torch.cat(shards)[: arch.vocab_size],)
    if layout == QKV:
        return _split_qkv(torch.cat(shards), arch)
    if layout == GATED_MLP:
        gates, ups = zip(*(shard.chunk(2) for shard in shards))
        return torch.cat(gates), torch.cat(ups)
    raise AssertionError(layout)


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Qwen3Architecture) -> torch.Tensor:
    """``q [nq*d, H]``, ``k``/``v`` ``[ng*d, H]`` -> ``[ng*(nq/ng + 2)*d, H]``, grouped as Megatron splits it."""
    groups, d = arch.num_key_value_heads, arch.head_dim
    per_group = arch.num_attention_heads // groups
    hidden = q.shape[1]
    return torch.cat(
        [q.reshape(groups, per_group * d, hidden), k.reshape(groups, d, hidden), v.reshape(groups, d, hidden)], dim=1
    ).reshape(-1, hidden)


def _split_qkv(qkv: torch.Tensor, arch: Qwen3Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``_interleave_qkv``."""
    groups, d = arch.num_key_value_heads, arch.head_dim
    per_group = arch.num_attention_heads // groups
    hidden = qkv.shape[1]
    grouped = qkv.reshape(groups, (per_group + 2) * d, hidden)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)
