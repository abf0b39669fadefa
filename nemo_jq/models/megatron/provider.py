"""HF Qwen3 ``config.json`` -> megatron-core ``TransformerConfig`` and ``GPTModel`` (as Bridge's GPTModelProvider).

Qwen3 on megatron-core is a GPT with RMSNorm, RMSNorm on each head's queries and keys
(``qk_layernorm``), SwiGLU, no biases, rotary embeddings with base ``rope_theta`` over
``kv_channels = head_dim`` (which Qwen3 sets explicitly: 128 at every size, not hidden/heads), and
embeddings tied to the LM head at 0.6B but not at 8B. Reading the config imports no megatron,
so ``mapping`` can use the architecture without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from nemo_jq.models.megatron import transformer_engine_usable
from nemo_jq.models.megatron.layout import MegatronLayout

#: config.json keys every Qwen3 config has, and the architecture field each fills.
REQUIRED_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
}


#: config.json keys a Qwen3-MoE config must have besides :data:`REQUIRED_KEYS` (the released configs say
#: ``num_experts``; transformers 5 writes ``num_local_experts``).
MOE_KEYS = ("num_experts|num_local_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class Qwen3Architecture:
    """What fixes the Megatron model and the weight layout, read from an HF Qwen3 config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    #: Qwen3-MoE (``model_type: qwen3_moe``): experts in every layer's MLP (0: the dense Qwen3), the experts each
    #: token is routed to, an expert's MLP width, whether the top-k router weights are renormalised to sum to one,
    #: and the load-balancing loss coefficient the model was trained with.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    #: The config as read, to write back on export.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_qwen3_config(config: Mapping[str, Any] | str | Path | Any) -> Qwen3Architecture:
    """Parse an HF Qwen3 config: a dict, a ``PretrainedConfig``, a config.json or a folder holding one.

    Raises ``ValueError`` naming every missing key, or the key whose value this backend cannot
    map (another model type, a non-SiLU activation, attention biases, rope scaling, sliding window).
    """
    values, source = _config_dict(config)
    missing = [key for key in REQUIRED_KEYS if key not in values]
    rope_theta = values.get("rope_theta", (values.get("rope_parameters") or {}).get("rope_theta"))
    if rope_theta is None:
        missing.append("rope_theta (or rope_parameters.rope_theta)")
    if missing:
        raise ValueError(f"{source} is not a Qwen3-like config: missing {', '.join(missing)}")
    _check_supported(values, source)
    moe = values.get("model_type") == "qwen3_moe"
    return Qwen3Architecture(
        **{field_name: values[key] for key, field_name in REQUIRED_KEYS.items()},
        head_dim=values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"],
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),  # Qwen3Config's default
        initializer_range=values.get("initializer_range", 0.02),
        attention_dropout=values.get("attention_dropout", 0.0),
        **({"num_experts": values.get("num_experts", values.get("num_local_experts")), "num_experts_per_tok": values["num_experts_per_tok"],
            "moe_intermediate_size": values["moe_intermediate_size"],
            "norm_topk_prob": bool(values.get("norm_topk_prob", False)),  # Qwen3MoeConfig's default
            "router_aux_loss_coef": float(values.get("router_aux_loss_coef", 0.001))} if moe else {}),
        hf_config=values,
    )


def _config_dict(config: Any) -> tuple[dict[str, Any], str]:
    if hasattr(config, "to_dict"):
        return config.to_dict(), f"{type(config).__name__}"
    if isinstance(config, Mapping):
        return dict(config), "config"
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at {path}")
    try:
        values = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not an HF config.json (not JSON: {error}): give the model's own config.json "
                         "or its folder") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not an HF config.json (it holds a {type(values).__name__}, not a mapping of "
                         "keys): give the model's own config.json or its folder")
    return values, str(path)


def _check_supported(values: Mapping[str, Any], source: str) -> None:
    model_type = values.get("model_type", "qwen3")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"{source} has model_type {model_type!r}; the Megatron backend maps Qwen3 ('qwen3') and "
                         "Qwen3-MoE ('qwen3_moe') only")
    if model_type == "qwen3_moe":
        missing = [key.replace("|", " or ") for key in MOE_KEYS if not any(name in values for name in key.split("|"))]
        if missing:
            raise ValueError(f"{source} is a Qwen3-MoE config without {', '.join(missing)}")
        if values.get("decoder_sparse_step", 1) != 1 or values.get("mlp_only_layers"):
            raise ValueError(f"{source} mixes dense and expert layers (decoder_sparse_step="
                             f"{values.get('decoder_sparse_step', 1)}, mlp_only_layers={values.get('mlp_only_layers')}); "
                             "the Megatron backend maps Qwen3-MoE with experts in every layer (decoder_sparse_step=1, "
                             "mlp_only_layers=[]), as the released 30B-A3B and 235B-A22B are")
    if values.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source} has hidden_act {values['hidden_act']!r}; Qwen3 uses 'silu' (SwiGLU)")
    if values.get("attention_bias"):
        raise ValueError(f"{source} has attention_bias=true; the Qwen3 mapping has no attention biases")
    if values.get("use_sliding_window"):
        raise ValueError(f"{source} has use_sliding_window=true; sliding-window attention is not supported")
    scaling = values.get("rope_scaling") or values.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source} has rope type {rope_type!r}; only unscaled rotary embeddings are supported")


#: Embedding rows are allocated in multiples of this (times TP where TP does not divide it), as Megatron-LM's
#: ``make_vocab_size_divisible_by``; so a checkpoint's padded vocabulary is the same at TP 1, 2, 4, ... 128.
VOCAB_PADDING_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """The embedding rows Megatron allocates: the vocabulary rounded up to a multiple of
    ``lcm(VOCAB_PADDING_MULTIPLE, TP)``, so it splits evenly over TP.

    Qwen3's 151936 (= 1187 x 128) needs no padding at any power-of-two TP; small tokenizers may.
    The padding rows are zeros that no input selects and whose logits ``logprobs`` masks out.
    """
    multiple = math.lcm(VOCAB_PADDING_MULTIPLE, tensor_parallel)
    return math.ceil(vocab_size / multiple) * multiple


def transformer_config(arch: Qwen3Architecture, layout: MegatronLayout = MegatronLayout(), *,
                       params_dtype: torch.dtype = torch.float32, activation_dtype: torch.dtype | None = None,
                       use_cpu_initialization: bool = True):
    """The megatron-core ``TransformerConfig`` of a Qwen3 (as Bridge's Qwen3 bridge sets it).

    Fusions that need CUDA kernels are off, and weights are not initialised: they come from the
    HF checkpoint. ``use_cpu_initialization`` allocates the weights on CPU (else on the current
    CUDA device). ``layout.recompute_activations`` keeps only each layer's input and recomputes the
    layer in backward (megatron-core's full, uniform recomputation): activation memory for compute.
    Pipeline stages exchange activations in ``activation_dtype`` (``pipeline_dtype``): the autocast dtype
    when the forward runs under autocast (its stage outputs are bf16 even over fp32 weights), else
    ``params_dtype``; a receive buffer of another dtype than the sent tensor corrupts it silently.
    """
    layout.validate(arch)
    transformer_engine_usable()  # before importing megatron.core
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        layernorm_epsilon=arch.rms_norm_eps,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=layout.tensor_parallel,
        sequence_parallel=layout.sequence_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        context_parallel_size=layout.context_parallel,
        pipeline_dtype=activation_dtype or params_dtype,
        params_dtype=params_dtype,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if layout.recompute_activations else {}),
        **(moe_settings(arch, layout) if arch.is_moe else {}),
    )


def moe_settings(arch: Qwen3Architecture, layout: MegatronLayout) -> dict[str, Any]:
    """Qwen3-MoE's router and experts in megatron-core's terms. Qwen3 routes by softmax over every expert, top-k,
    then (``norm_topk_prob``) renormalises the k: the same as megatron-core's top-k of the logits then softmax over the
    k (``moe_router_pre_softmax=False``); without renormalising, softmax over all then top-k (``pre_softmax=True``).
    The router runs in fp32 whatever the weights. Tokens are dispatched by all-gather over the TP x EP ranks (on CPU
    the only dispatcher that runs; alltoall needs CUDA streams) to experts that run one after another (SequentialMLP;
    Transformer Engine's grouped experts on GPU), each split over ``expert_tensor_parallel``."""
    grouped = uses_transformer_engine()
    return {"num_moe_experts": arch.num_experts, "moe_router_topk": arch.num_experts_per_tok,
            "moe_ffn_hidden_size": arch.moe_intermediate_size, "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not arch.norm_topk_prob, "moe_router_dtype": "fp32",
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": arch.router_aux_loss_coef,
            "moe_token_dispatcher_type": "alltoall" if grouped else "allgather", "moe_grouped_gemm": grouped,
            "moe_permute_fusion": False, "expert_model_parallel_size": layout.expert_parallel,
            "expert_tensor_parallel_size": layout.expert_tensor_parallel}


def uses_transformer_engine() -> bool:
    """TE layers on GPU when TE imports; megatron-core's local (pure torch) layers otherwise."""
    return torch.cuda.is_available() and transformer_engine_usable()


def uses_sdpa_attention(use_cpu_initialization: bool) -> bool:
    """Whether the local spec's core attention is PyTorch's SDPA (``attention.SDPADotProductAttention``): when the
    model is built on a GPU without TE. On CPU megatron-core's ``DotProductAttention`` stays (the CPU tests' context
    parallel stand-in replaces it)."""
    return not use_cpu_initialization and not uses_transformer_engine()


def build_gpt_model(arch: Qwen3Architecture, layout: MegatronLayout = MegatronLayout(), *,
                    params_dtype: torch.dtype = torch.float32, activation_dtype: torch.dtype | None = None,
                    use_cpu_initialization: bool = True):
    """This rank's ``GPTModel`` shard; ``parallel_state`` must be initialised with the same TP, PP and CP sizes.

    The LM head is vocab-parallel (``parallel_output``): logits come back ``[b, s, V_padded / TP]``.
    A pipeline stage holds its own layers, the first the embedding, the last the final norm and
    LM head (tied: a copy of the embedding); other stages return hidden states ``[s, b, H]``.
    Under context parallelism ``s`` is this rank's part of the sequence (``context_parallel``).

    Without TE the layers are megatron-core's local spec with :class:`LocalRMSNorm` as every norm (the final
    one included): built on the model's device, and correct under sequence parallelism, where megatron-core's
    own ``WrappedTorchNorm`` builds on CPU whatever the device and refuses sequence parallelism. On GPU its
    core attention is PyTorch's SDPA (:func:`uses_sdpa_attention`), which keeps no ``[b, heads / TP, s, s]`` scores.
    """
    config = transformer_config(arch, layout, params_dtype=params_dtype, activation_dtype=activation_dtype,
                                use_cpu_initialization=use_cpu_initialization)
    if arch.is_moe:
        router_without_transformer_engine()
        dispatcher_keeps_no_graph()
    if layout.recompute_activations:
        keep_autocast_in_recomputation()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    experts = {"num_experts": arch.num_experts, "moe_grouped_gemm": config.moe_grouped_gemm} if arch.is_moe else {}
    if uses_transformer_engine():
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True, **experts)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm", **experts)
    if layout.context_parallel > 1 and spec.submodules.self_attention.submodules.core_attention is DotProductAttention:
        raise ValueError(f"megatron.context_parallel={layout.context_parallel} needs Transformer Engine's attention on GPU "
                         f"(megatron-core's local attention has no context parallelism, and TE is "
                         f"{'not usable without CUDA' if transformer_engine_usable() else 'not importable here'}): "
                         f"run where TE imports (nemo-jq doctor says), or set context_parallel=1")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec if uses_transformer_engine() else local_block_spec(
            spec, config, sdpa_attention=uses_sdpa_attention(use_cpu_initialization)),
        vocab_size=padded_vocab_size(arch.vocab_size, layout.tensor_parallel),
        max_sequence_length=arch.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def router_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router projects with Transformer Engine's GEMM where ``moe_utils.te_general_gemm`` is not
    None, and defines that name only when TE imports: without TE the router's forward raises ``NameError``. Define it
    as None there, so the router takes its own torch path (idempotent)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def dispatcher_keeps_no_graph() -> None:
    """megatron-core 0.16.1's all-gather dispatcher keeps the probabilities it hands the experts (``local_probs``) as an
    attribute until the layer's next forward, read there for their dtype only. Kept with their graph, under
    recomputation they hold the recomputed layer's graph alive back to its checkpoint's detached input and that
    input's gradient: two ``[S/TP, B, H]`` tensors a MoE layer, all layers' by the end of every backward (3.3 GiB a
    rank at Qwen3-30B-A3B's config; found by the dry run, traced on CPU). The attribute keeps them detached
    (idempotent)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    original = MoEAllGatherTokenDispatcher.dispatch_postprocess
    if getattr(original, "keeps_no_graph", False):
        return

    def dispatch_postprocess(self: Any, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple:
        permuted, tokens_per_expert, local_probs = original(self, hidden_states, probs)
        self.local_probs = local_probs.detach()
        return permuted, tokens_per_expert, local_probs

    dispatch_postprocess.keeps_no_graph = True
    MoEAllGatherTokenDispatcher.dispatch_postprocess = dispatch_postprocess


class LocalRMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm: on the device megatron-core builds the rest of the model on (CPU with
    ``use_cpu_initialization``, else the current CUDA device), in ``params_dtype``. Under sequence parallelism
    each TP rank normalises its own positions, so the weight's gradient is partial over TP: it is marked
    ``sequence_parallel``, and the policy sums it over TP (as megatron-core's ``finalize_model_grads``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def local_block_spec(layer_spec: Any, config: Any, *, sdpa_attention: bool = False) -> Any:
    """This stage's layers as ``layer_spec`` with every norm (input, pre-MLP, q and k, and the block's final
    one) a :class:`LocalRMSNorm`, and with ``sdpa_attention`` PyTorch's SDPA as the core attention."""
    import dataclasses

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    attention = layer_spec.submodules.self_attention
    core_attention = {}
    if sdpa_attention:
        from nemo_jq.models.megatron.attention import SDPADotProductAttention

        core_attention = {"core_attention": SDPADotProductAttention}
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, q_layernorm=LocalRMSNorm, k_layernorm=LocalRMSNorm, **core_attention))
    layer = dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, input_layernorm=LocalRMSNorm, pre_mlp_layernorm=LocalRMSNorm, self_attention=attention))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=LocalRMSNorm)


def keep_autocast_in_recomputation() -> None:
    """Make megatron-core's activation recomputation re-run each layer under the autocast state of its first run.

    ``tensor_parallel.checkpoint``'s backward re-runs the forward under ``enable_grad`` only, and the policy
    calls ``backward()`` outside autocast (as the pipeline schedule does): under bf16 autocast over fp32
    weights the recomputed layers would run in fp32, on inputs saved in bf16 (megatron-core's residual adds
    follow the branch's dtype), which the local spec's linears refuse and TE computes in another precision
    than the loss. ``torch.utils.checkpoint`` restores autocast; this wraps megatron-core's checkpoint so it
    does too. Idempotent; the transformer block looks the function up at each call.
    """
    import contextlib

    from megatron.core import tensor_parallel

    if getattr(tensor_parallel.checkpoint, "keeps_autocast", False):
        return
    checkpoint = tensor_parallel.checkpoint

    def checkpoint_keeping_autocast(function, distribute_saved_activations, *args):
        states = [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                  for device in ("cuda", "cpu") if torch.amp.is_autocast_available(device)]
        cache = torch.is_autocast_cache_enabled()

        def replay(*inputs):
            with contextlib.ExitStack() as stack:
                for device, enabled, dtype in states:
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache))
                return function(*inputs)

        return checkpoint(replay, distribute_saved_activations, *args)

    checkpoint_keeping_autocast.keeps_autocast = True
    tensor_parallel.checkpoint = checkpoint_keeping_autocast
