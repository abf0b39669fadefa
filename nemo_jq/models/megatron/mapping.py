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

Qwen3-MoE adds each layer's router (``mlp.gate``, replicated) and its experts: expert-parallel rank e holds experts
``e * E/EP`` to ``(e + 1) * E/EP - 1`` under local indices from 0 (``expert_offset`` is its first), each split over
the expert-tensor-parallel ranks as the dense MLP is over TP. Checkpoints store one tensor per expert
(``mlp.experts.{j}.gate_proj.weight``), as transformers writes and reads them (it fuses them in memory only).
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
    #: Megatron parameter name; ``(\d+)`` captures the layer index (and an expert's local index).
    megatron: str
    #: The HF tensors it is made of, ``{}`` standing for the layer index (and the expert's global index).
    hf: tuple[str, ...]
    layout: str
    #: An expert's weight: its second index is local to the expert-parallel rank, split over expert-TP.
    expert: bool = False


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
    # Qwen3-MoE: the router, and each expert as the local spec (SequentialMLP) or Transformer Engine's grouped
    # experts name it
    ParamMapping(_LAYER + r"mlp\.router\.weight", (_HF_LAYER + "mlp.gate.weight",), REPLICATED),
    *(ParamMapping(_LAYER + pattern.format("fc1"), (_HF_LAYER + "mlp.experts.{}.gate_proj.weight",
                                                    _HF_LAYER + "mlp.experts.{}.up_proj.weight"), GATED_MLP, expert=True)
      for pattern in (r"mlp\.experts\.local_experts\.(\d+)\.linear_{}\.weight", r"mlp\.experts\.linear_{}\.weight(\d+)")),
    *(ParamMapping(_LAYER + pattern.format("fc2"), (_HF_LAYER + "mlp.experts.{}.down_proj.weight",), ROW_PARALLEL,
                   expert=True)
      for pattern in (r"mlp\.experts\.local_experts\.(\d+)\.linear_{}\.weight", r"mlp\.experts\.linear_{}\.weight(\d+)")),
)


def _resolve(megatron_name: str, expert_offset: int = 0) -> tuple[ParamMapping, tuple[str, ...]]:
    """The mapping entry of a Megatron parameter and the HF names it is made of (an expert's: its local index plus
    ``expert_offset``, the first expert of its expert-parallel rank)."""
    for entry in QWEN3_MAPPING:
        match = re.fullmatch(entry.megatron, megatron_name)
        if match:
            indices = (match[1], int(match[2]) + expert_offset) if entry.expert else match.groups()
            return entry, tuple(name.format(*indices) for name in entry.hf)
    raise ValueError(f"no HF mapping for Megatron parameter {megatron_name!r}")


def hf_names(megatron_name: str, expert_offset: int = 0) -> tuple[str, ...]:
    """The HF tensors a Megatron parameter is made of, in the order ``megatron_to_hf`` yields them."""
    return _resolve(megatron_name, expert_offset)[1]


def is_expert(megatron_name: str) -> bool:
    """Whether the parameter is one expert's (split over the expert-parallel and expert-TP ranks, not TP)."""
    return _resolve(megatron_name)[0].expert


def is_tensor_parallel(megatron_name: str) -> bool:
    """Whether TP ranks hold different slices of the parameter (else each holds the same full copy).

    megatron-core marks this on the parameter only when it initialises the weights itself, which
    the provider skips (weights come from the checkpoint), so the mapping says it.
    """
    return _resolve(megatron_name)[0].layout != REPLICATED


#: The most bytes one gather of experts brings in, all expert-parallel ranks' shares together
#: (``MegatronPolicy.iter_hf``): a Qwen3-30B-A3B layer's 128 experts (1.2 GB in bf16) take 3 gathers, not 32 at EP8;
#: what a refit holds beside the batch, ``nemo-jq plan`` counts (``plan.refit_bytes``).
EXPERT_GATHER_BYTES = 512 * 2**20


def gather_batches(entries: Iterable[tuple[str, torch.dtype, int]], ranks: int, limit_bytes: int) -> list[list[str]]:
    """The parameters ``entries`` names (``(megatron name, dtype, elements)``, in order) in the batches that one
    collective each gathers: a run of one layer's experts of one dtype, as many as fit ``limit_bytes`` once all
    ``ranks`` expert-parallel ranks' shares are in (at least one); any other parameter alone. A Qwen3-30B-A3B's 18k
    expert tensors then take a few gathers a layer, not one each."""
    batches: list[list[str]] = []
    key, held = None, 0
    for name, dtype, elements in entries:
        size = ranks * elements * dtype.itemsize
        mine = (re.match(_LAYER, name)[1], dtype) if is_expert(name) else None
        if not batches or mine is None or mine != key or held + size > limit_bytes:
            batches.append([])
            held = 0
        batches[-1].append(name)
        key, held = mine, held + size
    return batches


def hf_shape(name: str, arch: Qwen3Architecture) -> tuple[int, ...]:
    """The shape the config implies for HF weight ``name`` (keyed by its module's name)."""
    hidden, head = arch.hidden_size, arch.head_dim
    ffn = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size  # every MLP of a Qwen3-MoE is experts
    queries, keys = arch.num_attention_heads * head, arch.num_key_value_heads * head
    return {
        "embed_tokens": (arch.vocab_size, hidden), "lm_head": (arch.vocab_size, hidden), "gate": (arch.num_experts, hidden),
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


@dataclass(frozen=True)
class ExpertShard:
    """Which experts a rank holds: its expert-parallel rank's share (``expert_offset`` is the first's global index),
    each split over ``etp_size`` expert-TP ranks (this one's ``etp_rank``). The dense model's: none of it matters."""

    expert_offset: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    #: Every expert-parallel rank's first expert, so that a checkpoint's other experts are known as used.
    all_offsets: tuple[int, ...] = (0,)


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], megatron_names: Iterable[str], arch: Qwen3Architecture,
                   *, tp_size: int = 1, tp_rank: int = 0, all_names: Iterable[str] | None = None,
                   experts: ExpertShard = ExpertShard()) -> dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s shard of each Megatron parameter in ``megatron_names``, from an HF state dict
    (:func:`iter_hf_to_megatron`, collected)."""
    return dict(iter_hf_to_megatron(hf_state, megatron_names, arch, tp_size=tp_size, tp_rank=tp_rank, all_names=all_names,
                                    experts=experts))


def iter_hf_to_megatron(hf_state: Mapping[str, torch.Tensor], megatron_names: Iterable[str], arch: Qwen3Architecture,
                        *, tp_size: int = 1, tp_rank: int = 0, all_names: Iterable[str] | None = None,
                        experts: ExpertShard = ExpertShard()) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``tp_rank``'s shard of each Megatron parameter, one at a time: with a lazy ``hf_state`` (an HF
    folder read tensor by tensor) a consumer that copies each shard away holds one HF tensor at a time. A Qwen3-MoE's
    experts are the rank's own (``experts``): only those are read.

    Raises ``ValueError`` naming a missing HF weight, one whose shape the config does not imply, or
    HF weights that no parameter of the model (``all_names``: every pipeline stage's; by default
    ``megatron_names``; their experts on every expert-parallel rank) uses, a tied model's ``lm_head.weight``
    excepted: HF state dicts list the shared matrix twice.
    """
    megatron_names = list(megatron_names)
    for megatron_name in megatron_names:
        entry, names = _resolve(megatron_name, experts.expert_offset)
        tensors = [_hf_tensor(hf_state, name, arch, megatron_name) for name in names]
        size, rank = (experts.etp_size, experts.etp_rank) if entry.expert else (tp_size, tp_rank)
        yield megatron_name, _split(entry.layout, tensors, arch, size, rank)
    used = {name for megatron_name in (all_names or megatron_names) for offset in experts.all_offsets
            for name in hf_names(megatron_name, offset)}
    unused = set(hf_state) - used - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    if unused:
        raise ValueError(f"checkpoint has weights the Megatron Qwen3 model does not use: {sorted(unused)}")


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], arch: Qwen3Architecture, *,
                   expert_offsets: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The HF state dict from every TP rank's shards (``shards[r]``: rank r's ``{megatron name: tensor}``). A
    Qwen3-MoE's expert shards are rank r's expert-parallel rank's experts, the first of them ``expert_offsets[r]`` (TP
    ranks may hold different experts: the expert groups are carved from them); the shards of one offset are its
    expert-TP slices, in order.

    A tied model has no ``lm_head.weight`` entry, as HF ``save_pretrained`` writes it.
    """
    offsets = list(expert_offsets or [0] * len(shards))
    hf_state = {}
    for megatron_name in shards[0]:
        entry, names = _resolve(megatron_name)
        if not entry.expert:
            hf_state.update(zip(names, _merge(entry.layout, [shard[megatron_name] for shard in shards], arch)))
            continue
        for offset in dict.fromkeys(offsets):
            slices = [shard[megatron_name] for shard, held in zip(shards, offsets) if held == offset]
            hf_state.update(zip(hf_names(megatron_name, offset), _merge(entry.layout, slices, arch)))
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
