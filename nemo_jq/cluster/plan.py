"""``nemo-jq plan``: per-GPU memory of every feasible TP x PP x DP layout (at a given CP), before a run is queued.

An estimate from shapes, not a measurement; what it assumes (the table's last line points here):

* parameters are counted exactly from the Qwen3 config (embedding, untied head, per layer: QKV,
  output projection, SwiGLU MLP, four norms);
* ``fp32-adamw`` (``model.backend=megatron``'s default): fp32 weights and gradients and two
  fp32 AdamW moments, 16 bytes a parameter, split over TP x PP and replicated over DP;
  ``fp32-distopt`` (``megatron.distributed_optimizer=true``): fp32 weights, a persistent fp32 gradient
  buffer, and fp32 master weights plus moments (12 bytes) sharded over DP (measured:
  tests/distributed/megatron/test_megatron_optimizer_memory.py);
  ``bf16-distopt`` (``megatron.bf16_weights=true``, Megatron's usual recipe): bf16 weights, the fp32 gradient
  buffer, and the 12 bytes of master weights and moments sharded over DP; ``fp32-distopt-offload`` and
  ``bf16-distopt-offload`` (``megatron.optimizer_cpu_offload=true``): that shard in host memory (16 / DP bytes a
  parameter with the gradient shard's host copy, which the dry run reports), none of it on the GPU;
* activations in bf16 for one micro-batch of ``micro_batch`` sequences of ``seq_len`` tokens per
  layer, with fused (flash) attention, so nothing quadratic in the length is kept: the
  tensors backward needs (norm inputs and outputs, Q/K/V before and after their norms, the
  attention output, fc1's output and SwiGLU's); the hidden-size ones split over TP only with
  sequence parallelism. 1F1B keeps ``min(PP, micro-batches)`` micro-batches in flight on the
  first stage. Full recomputation keeps one bf16 layer input per layer plus, while one layer runs backward, its
  recomputed forward tensors, their gradients and the sequence-parallel all-gathered inputs
  (``RECOMPUTED_LAYER_BACKWARD`` times the forward set, measured by the dry run);
  context parallelism (``context_parallel``, CP) leaves each rank ``seq_len / CP`` of every sequence's tokens,
  and shards the distributed optimizer's state over DP x CP;
* the log-prob head projects ``model.logprob_chunk_size`` positions at a time (both backends), in forward and again
  in backward: it holds the gradient of the hidden states (``micro_batch x seq_len / CP`` positions, whole on every TP
  rank; fp32 under hf, bf16 under megatron) and the fp32 gradient of its ``V/TP`` x hidden weight slice, with its
  loop's chunks of logits or, with bf16 weights, that gradient's bf16 copy it returns (whichever is larger);
* rollouts, by ``rollout_engine``: ``native``/``hf`` decode one HF copy of the whole model in the compute dtype (bf16;
  fp32 with ``model.precision=fp32``, as are the KV cache and vLLM's weights) on each replica's
  sampling rank (the rank this estimate is for: the layout's fullest; with ``model.backend=hf`` the policy's own
  model, or an fp32 copy one step ahead) with a KV cache of at most ``kv_cache_tokens`` tokens
  (``rollout.kv_cache_tokens``: the thinking phase samples chunks of whole groups, at least one prompt's M rows;
  the answer phase chunks of rows; an evaluation call's too), or of all of the replica's rows when that is fewer,
  plus a decode step's copies of one layer's keys and values (``KV_COPIES``), and an answer phase's prefill of its
  chunk of whole contexts at once (``prefill_bytes``: an evaluation's, and the rollouts' of GRPO and RLOO), and,
  with the hf backend's CUDA-graph decode (a dense Qwen3's, under bf16 autocast), a bf16 cast of the fp32 policy's
  weights while it samples; ``vllm`` keeps no HF copy and takes
  ``vllm_memory_utilization`` of the GPU (its weights, shared over
  ``vllm_tensor_parallel`` ranks, and its KV cache) while it samples, and sleeps (holds ~nothing) while the
  policy trains, and a share that cannot hold its engine's weights does not fit;
* a Qwen3-MoE: its experts split over ``expert_parallel`` (EP) ranks and their optimizer state over the expert-DP ranks
  (TP x CP x DP / EP), the rest as a dense model's; each layer's activations hold the router's and, routing
  balanced, k experts' tensors for each of the rank's tokens (``expert_activation_bytes``), and its backward the
  tokens the dispatcher gathers from the EP group (``dispatched_bytes``: it grows with EP); its layouts are those
  experts train at (with TP, sequence parallelism and EP a multiple of TP: ``MegatronLayout.check_trainable``), each
  EP that divides the experts and a stage's ranks;
* a Megatron rank's refit (its weights gathered into HF tensors for the sampler's copy, a vLLM engine or the
  rollout ranks, a batch at a time) holds twice the batch in the weights' dtype: the largest tensor whole (the
  embedding or the head), or the largest run of one layer's experts and its share of it (``refit_bytes``), while a
  vLLM engine is awake (the dry run's refit peak at 8B, 32B and Qwen3-30B-A3B); a split world's sending rank
  (``rollout_ranks``) holds two of the sync's buckets beside it (``SENT_BUCKETS``), whatever the backend;
* the peak is what stays (weights, optimizer state, the distributed optimizer's gradient buffer, the rollout
  copy) plus the largest of the training working set (gradients without the distributed optimizer,
  activations, log-prob head), the rollout working set (the fuller phase of a sampling call: the thinking phase's KV
  cache, or an answer phase's cache and prefill; or vLLM's share), the refit's (with vLLM's
  share) and the optimizer step's
  (the square root of AdamW's second moment, which torch's foreach kernels hold for every parameter they step at
  once on a GPU, plus the gradients without the distributed optimizer: measured on an H100 for both backends and
  both optimizers, ``bench/results/real_gpu.json``), which do not coexist; with the hf backend's rollouts one step
  ahead (``rollout.async_steps=1``, native or hf engine), the copy samples the next step in a child process while
  this one trains, so the sampling working set joins the training one (the dry run, one process, cannot show it).

With ``rollout_ranks`` (``rollout.placement=separate``) the last ``rollout_ranks`` GPUs only sample: the layouts
are of the other GPUs, whose ranks hold no rollout copy, KV cache or vLLM share; each rollout rank holds the whole
model in bf16 and the KV cache as above (one replica's request at a time), or vLLM's share, and the sync's receiving
side: one bucket (``rollout.sync_bucket_mb``) and a tensor spread over buckets put together whole; no optimizer (the
dry run of a rollout rank agrees: ``nemo-jq dryrun ... rollout.placement=separate``). Each optimizer step sends the
whole model to them as the policy holds it, bf16 with ``bf16-distopt`` and fp32 otherwise (``weight_sync``), at
``sync_bandwidth`` GB/s (a broadcast over NCCL: the slowest link between the first training rank and a rollout rank;
across nodes, one InfiniBand port's rate).

When nothing fits, the report names the component of the closest layout that takes the most and the setting
that shrinks it (one not already chosen). Sizes are GiB (2^30 bytes).

A layout is feasible when TP divides the heads, KV heads and MLP width and fits in a node, PP
divides the layers, TP x PP x CP divides the GPUs, and DP divides the batch. The recommendation is
the fitting layout (under ``headroom`` of the GPU) with the largest DP, then the smallest TP (and EP).

One file (past 1,000 lines): the memory model is one set of formulas (each component's bytes, the peak, the advice that
names the setting that shrinks it) that the layouts, ``train.micro_batch_rows=auto`` and the dry run's comparison
all read; split, each part would import the others.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from nemo_jq.models.megatron.layout import MegatronLayout
from nemo_jq.models.megatron.provider import Qwen3Architecture, read_qwen3_config
from nemo_jq.typed import ConfigError

GiB = 1024**3
#: Bytes per parameter of the weights, of the gradients and of the optimizer state, and whether that state is
#: sharded over DP.
OPTIMIZER_MODES = {"fp32-adamw": (4, 4, 8, False), "fp32-distopt": (4, 4, 12, True), "bf16-distopt": (2, 4, 12, True),
                   "fp32-distopt-offload": (4, 4, 0, True), "bf16-distopt-offload": (2, 4, 0, True)}

_QWEN3_COMMON = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
#: The released Qwen3 dense shapes (their HF config.json values that differ between sizes).
QWEN3_SIZES = {
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "tie_word_embeddings": True},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "tie_word_embeddings": True},
    "4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
           "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
           "tie_word_embeddings": False},
    "14b": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40,
            "tie_word_embeddings": False},
    "32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
            "tie_word_embeddings": False},
}


_QWEN3_MOE_COMMON = {**_QWEN3_COMMON, "model_type": "qwen3_moe", "num_key_value_heads": 4, "num_experts": 128,
                     "num_experts_per_tok": 8, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
                     "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
#: The released Qwen3-MoE shapes (experts in every layer; ``intermediate_size`` is unused where every MLP is experts).
QWEN3_SIZES.update({
    "30b-a3b": {**_QWEN3_MOE_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_hidden_layers": 48, "num_attention_heads": 32},
    "235b-a22b": {**_QWEN3_MOE_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                  "num_hidden_layers": 94, "num_attention_heads": 64},
})


def hf_config_dict(model: str) -> dict[str, Any]:
    """The HF config.json values of a released Qwen3 size (``8b``, ``Qwen3-8B``, ``Qwen/Qwen3-8B``, ``30b-a3b``), or of a
    release of the same shape (``Qwen3-8B-Base``, ``Qwen3-4B-Thinking-2507``, ``Qwen3-30B-A3B-Instruct-2507``: their
    context is taken as the first release's, which a 2507 release's longer one only widens)."""
    size = model.lower().removeprefix("qwen/").removeprefix("qwen3-").removeprefix("qwen3")
    size = re.sub(r"-(base|(instruct|thinking)(-\d{4})?)$", "", size)
    if size not in QWEN3_SIZES:
        raise ValueError(f"model {model!r} is neither a Qwen3 size ({', '.join(QWEN3_SIZES)}) nor a local folder: "
                         "give a size or an HF config.json / model folder")
    return {**_QWEN3_COMMON, **QWEN3_SIZES[size]}


def architecture(model: str, given_as: str = "--model") -> Qwen3Architecture:
    """A Qwen3 or Qwen3-MoE size (``8b``, ``Qwen3-8B``, ``Qwen/Qwen3-30B-A3B``) or a path to an HF config.json /
    model folder; ``given_as``: where the user gave it, for the error (``model.path in C.yaml``)."""
    with contextlib.suppress(ValueError):
        return read_qwen3_config(hf_config_dict(model))
    try:
        return read_qwen3_config(model)
    except FileNotFoundError:
        raise ValueError(f"{given_as} {model!r} is neither a Qwen3 size ({', '.join(QWEN3_SIZES)}) nor an HF config "
                         f"path: give a size or a config.json / model folder") from None


#: The longest prompt a plan or a dry run of a config assumes where ``--prompt-tokens`` gives none.
PROMPT_TOKENS = 1024


def model_context(config: Any) -> tuple[int, str]:
    """The context of ``config``'s model in tokens (``max_position_embeddings``), and the setting that says it."""
    if config.model.path is None:
        return config.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    path = str(config.model.path)
    return architecture(path, "model.path").max_position_embeddings, f"max_position_embeddings of {path}"


def check_context(config: Any, prompt_tokens: int, context: int, where: str) -> None:
    """A row of the longest prompt (``prompt_tokens``), the thinking budget, ``</think>`` and the answer budget fits
    the model's ``context`` (``where``: the setting that says it), as ``train`` checks each of its prompts; else one
    line (a plan or dry run of a config ``train`` refuses would report it as fitting)."""
    rollout = config.rollout
    check_row(prompt_tokens + rollout.max_thinking_tokens + 1 + rollout.max_answer_tokens, context, where,
              f"a prompt of {prompt_tokens} tokens (--prompt-tokens), rollout.max_thinking_tokens="
              f"{rollout.max_thinking_tokens}, </think> and rollout.max_answer_tokens={rollout.max_answer_tokens} make "
              "rows of", "train refuses them: lower rollout.max_thinking_tokens or --prompt-tokens")


def check_row(row: int, context: int, where: str, made_of: str, fix: str) -> None:
    """Rows of ``row`` tokens (``made_of`` says what makes them) fit the model's ``context`` (``where`` says it); else
    one line ending in ``fix``."""
    if row > context:
        raise ConfigError(f"{made_of} {row} tokens, beyond the model's context of {context} tokens ({where}): {fix}")


def layer_parameters(arch: Qwen3Architecture) -> int:
    h, d = arch.hidden_size, arch.head_dim
    attention = h * arch.num_attention_heads * d * 2 + h * arch.num_key_value_heads * d * 2  # q, o; k, v
    # a SwiGLU MLP, or a Qwen3-MoE's experts (each a SwiGLU MLP) and their router
    mlp = (arch.num_experts * (3 * h * arch.moe_intermediate_size + h)) if arch.is_moe else 3 * h * arch.intermediate_size
    return attention + mlp + 2 * h + 2 * d  # + two norms + q/k norms


def expert_parameters(arch: Qwen3Architecture) -> int:
    """A Qwen3-MoE's expert weights (every layer's), which expert parallelism splits; 0 for a dense Qwen3."""
    return arch.num_layers * arch.num_experts * 3 * arch.hidden_size * arch.moe_intermediate_size


def parameter_count(arch: Qwen3Architecture) -> int:
    embedding = arch.vocab_size * arch.hidden_size
    return embedding * (1 if arch.tie_word_embeddings else 2) + arch.num_layers * layer_parameters(arch) + arch.hidden_size


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096
    micro_batch: int = 1
    samples: int = 32  # M
    batch_prompts: int = 64
    recompute: bool = False
    sequence_parallel: bool = True
    optimizer: str = "fp32-adamw"
    context_parallel: int = 1
    rollout_engine: str = "native"
    kv_cache_tokens: int | None = 131072
    vllm_memory_utilization: float = 0.5
    vllm_tensor_parallel: int = 1
    #: ``rollout.vllm_kv_cache_gb``: vLLM's KV cache sized in GiB (its weights beside it), not by its share.
    vllm_kv_cache_gb: float | None = None
    #: ``model.backend``: megatron (the layouts), or hf (one process on one GPU; its activations as HF keeps them).
    backend: str = "megatron"
    #: Rollouts sampled one step ahead (``rollout.async_steps=1``) by a copy of the model: hf's own (fp32), refitted;
    #: in a world of one process that copy samples in a child process while the step trains (``samples_in_a_child``).
    async_copy: bool = False
    #: hf: positions the log-prob kernel projects at once (``model.logprob_chunk_size``).
    logprob_chunk: int = 256
    #: The native engine's decode from a static cache (``rollout.cuda_graphs``): no compaction rebuilds a layer's
    #: buffer whole (``KV_COPIES``): it copies the kept rows' filled columns, one layer's keys or values at a time,
    #: under a quarter of a layer's share of the cache once half the rows are done (left uncounted).
    graph_decode: bool = False
    #: hf with that decode under bf16 autocast: each sampling call decodes from a bf16 cast of the fp32 policy's
    #: weights, held while it samples.
    decode_cast: bool = False
    #: The model computes in bf16 (``model.precision`` other than fp32, on a GPU): hf's forward and its log-prob head's
    #: backward products under bf16 autocast, and every sampler's weights, keys and values in bf16 (in fp32 without).
    autocast: bool = True
    #: The answer budget within ``seq_len`` (the thinking phase's rows end before it).
    answer_tokens: int = 0
    #: The rollouts sample answers (GRPO, RLOO): their answer phase prefills each chunk's whole contexts at once, as an
    #: evaluation's does.
    sampled_answers: bool = False
    #: An evaluation call's prompts and samples of each (``eval.batch_size``, ``eval.num_samples``).
    eval_call: tuple[int, int] = (32, 16)
    #: ``rollout.ranks`` under ``rollout.placement=separate`` (the world's last GPUs only sample); 0: colocated.
    rollout_ranks: int = 0
    #: ``rollout.sync_bucket_mb``: the weight sync's bucket (MiB; a rollout rank holds two).
    sync_bucket_mb: float = 256.0
    #: ``megatron.expert_parallel``: a Qwen3-MoE's experts split over that many ranks.
    expert_parallel: int = 1
    #: ``megatron.expert_tensor_parallel``: each expert's MLP split over that many ranks.
    expert_tensor_parallel: int = 1
    #: A run config's workload: advice names its config keys, not ``plan``'s flags (refused beside ``--config``).
    config_keys: bool = False

    @classmethod
    def from_config(cls, config: Any, prompt_tokens: int) -> Workload:
        """The workload a run config trains, in the trainer's units: a micro-batch is ``train.micro_batch_size``
        prompts x M rollouts (or ``train.micro_batch_rows`` of them, when fewer), each ``prompt_tokens`` + thinking
        budget + ``</think>`` + answer budget long; recomputation is the backend's (hf: model.activation_checkpointing)."""
        from nemo_jq.objectives import Need, get_objective
        from nemo_jq.rollouts import samples_in_a_child

        layout, rollout = config.megatron, config.rollout
        optimizer = ("bf16-distopt" if layout.bf16_weights else "fp32-distopt" if layout.distributed_optimizer
                     else "fp32-adamw") + ("-offload" if layout.optimizer_cpu_offload else "")
        group_rows = config.train.micro_batch_size * rollout.num_samples
        hf = config.model.backend == "hf"
        separate = rollout.placement == "separate"
        return cls(seq_len=prompt_tokens + rollout.max_thinking_tokens + 1 + rollout.max_answer_tokens,
                   micro_batch=min(group_rows, rows if isinstance(rows := config.train.micro_batch_rows, int) else group_rows),
                   samples=rollout.num_samples, batch_prompts=config.train.batch_size,
                   recompute=config.model.activation_checkpointing if hf else layout.recompute_activations,
                   sequence_parallel=layout.sequence_parallel, optimizer=optimizer,
                   context_parallel=layout.context_parallel, rollout_engine=rollout.engine,
                   kv_cache_tokens=rollout.kv_cache_tokens, vllm_memory_utilization=rollout.vllm_memory_utilization,
                   vllm_kv_cache_gb=rollout.vllm_kv_cache_gb,
                   vllm_tensor_parallel=rollout.tensor_parallel, backend=config.model.backend,
                   async_copy=samples_in_a_child(config, world_size=1),
                   logprob_chunk=config.model.logprob_chunk_size, answer_tokens=rollout.max_answer_tokens,
                   sampled_answers=Need.SAMPLED_ANSWER_REWARD in get_objective(config.objective.name).needs,
                   graph_decode=rollout.engine == "native" and rollout.cuda_graphs,
                   decode_cast=(hf and rollout.engine == "native" and rollout.cuda_graphs and not separate
                                and config.model.precision != "fp32"),
                   autocast=config.model.precision != "fp32",
                   eval_call=(config.eval.batch_size, config.eval.num_samples),
                   rollout_ranks=rollout.ranks if separate else 0, sync_bucket_mb=rollout.sync_bucket_mb,
                   expert_parallel=layout.expert_parallel if not hf else 1,
                   expert_tensor_parallel=layout.expert_tensor_parallel if not hf else 1, config_keys=True)

    @property
    def tokens_per_rank(self) -> float:
        """Tokens of one micro-batch on each rank: its sequences' share under context parallelism."""
        return self.seq_len * self.micro_batch / self.context_parallel

    def own_tokens(self, tp: int) -> float:
        """Tokens of one micro-batch whose hidden states each TP rank holds: its share under sequence parallelism."""
        return self.tokens_per_rank / (tp if self.sequence_parallel else 1)

    @property
    def compute_bytes(self) -> int:
        """An element's bytes in the compute dtype, the sampler's weights, keys and values' (bf16; fp32 without
        :attr:`autocast`)."""
        return 2 if self.autocast else 4

    @property
    def engine_gpus(self) -> int:
        """The GPUs one sampling engine spans: a vLLM engine's ``rollout.tensor_parallel`` ranks; one otherwise."""
        return self.vllm_tensor_parallel if self.rollout_engine == "vllm" else 1


#: The components of a layout's estimate, in the report's order (each in GiB).
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logprob_head", "rollout_copy", "kv_cache", "prefill",
              "decode_cast", "refit", "vllm")


#: The share of a GPU's memory a layout may fill (the rest: the allocator's fragmentation, CUDA's context, NCCL).
HEADROOM = 0.9


def auto_micro_batch_rows(config: Any, prompt_tokens: int, gpu_gb: float, world_size: int = 1,
                          headroom: float = HEADROOM) -> tuple[int, LayoutEstimate]:
    """``train.micro_batch_rows=auto``: the most rows a forward/backward may hold (at most ``micro_batch_size`` x M)
    for which this memory model (the dry run's within a few percent: docs/results/dryrun_configs.md) fits the run's
    layout on a GPU of ``gpu_gb`` GiB, and that estimate. A row count that fits nowhere is a ``ValueError`` naming
    what takes the most at one row."""
    arch = architecture(str(config.model.path))
    work = Workload.from_config(config, prompt_tokens)
    layout = config.megatron
    tp, pp = (layout.tensor_parallel, layout.pipeline_parallel) if work.backend == "megatron" else (1, 1)
    dp = max(1, world_size // (tp * pp * work.context_parallel)) if work.backend == "megatron" else 1
    group_rows = config.train.micro_batch_size * config.rollout.num_samples
    for rows in range(group_rows, 0, -1):
        fitted = estimate(arch, replace(work, micro_batch=rows), tp, pp, dp, gpu_gb, headroom)
        if fitted.fits:
            return rows, fitted
    raise ValueError(f"train.micro_batch_rows=auto: even 1 row needs {fitted.total_gib} GiB of the "
                     f"{gpu_gb * headroom:.4g} usable, most of it the {fitted.largest.replace('_', ' ')}: try "
                     f"{fitted.advice}")


@dataclass(frozen=True)
class LayoutEstimate:
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    #: A Qwen3-MoE's ``megatron.expert_parallel`` (1 for a dense Qwen3).
    expert_parallel: int
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    logprob_head_gib: float
    rollout_copy_gib: float
    kv_cache_gib: float
    prefill_gib: float
    decode_cast_gib: float
    refit_gib: float
    vllm_gib: float
    total_gib: float
    fits: bool
    #: What takes the most of the peak, and the setting that shrinks it.
    largest: str = ""
    advice: str = ""


def layer_activation_bytes(arch: Qwen3Architecture, work: Workload, tp: int) -> float:
    """bf16 bytes one layer keeps for backward, per TP and CP rank, for one micro-batch."""
    tokens = work.tokens_per_rank
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    hidden_terms = 4 * arch.hidden_size / (tp if work.sequence_parallel else 1)  # two norms' inputs and outputs
    mlp = 0 if arch.is_moe else 3 * arch.intermediate_size  # fc1, SwiGLU
    split_terms = (2 * (q + 2 * kv) + q + mlp) / tp  # Q/K/V twice, attention out, the MLP
    named = 2 * tokens * (hidden_terms + split_terms)
    return (named + expert_activation_bytes(arch, work, tp)) * EXPERT_LAYER_KEPT if arch.is_moe else named


def expert_activation_bytes(arch: Qwen3Architecture, work: Workload, tp: int) -> float:
    """What a Qwen3-MoE layer's router and experts keep for backward on one rank, routing balanced: each TP rank routes
    its own part of the tokens (sequence parallelism) and runs the ones its EP group routed to its experts, k per token
    of its own part: each bf16, its permuted input, fc1 input and output, SwiGLU output and fc2 output (3H + 3I); with
    expert-TP it runs ETP times as many through a 1/ETP slice of each expert, and keeps one more input (H) for each
    ETP peer (the dry run at 30B-A3B, EP 8 x ETP 2: 0.27 GiB a 4-layer model above EP 16, plan 0.30). The router's
    fp32 input and its logits and probabilities over the E experts for its own tokens. The tokens the dispatcher
    gathers are not kept (:func:`dispatched_bytes`)."""
    own = work.own_tokens(tp)
    etp = work.expert_tensor_parallel
    experts = 2 * own * arch.num_experts_per_tok * ((2 + etp) * arch.hidden_size + 3 * arch.moe_intermediate_size)
    router = 4 * own * (arch.hidden_size + 2 * arch.num_experts)
    return experts + router


def dispatched_bytes(arch: Qwen3Architecture, work: Workload, tp: int) -> float:
    """What a Qwen3-MoE layer's backward holds for the tokens megatron-core's all-gather dispatcher gathers from the
    rank's expert group (``EP x ETP x`` its own part): :data:`DISPATCHED_COPIES` bf16 copies of them (H each) and their fp32
    routing probabilities (E each). It grows with EP, the layer's kept tensors do not."""
    gathered = work.own_tokens(tp) * work.expert_parallel * work.expert_tensor_parallel
    return gathered * (DISPATCHED_COPIES * 2 * arch.hidden_size + 4 * arch.num_experts)


#: What the megatron backend holds while one recomputed layer runs backward, in multiples of that layer's forward
#: tensors (:func:`layer_activation_bytes`): the recomputed tensors, their gradients, and the sequence-parallel
#: all-gathered inputs. Measured by the megatron dry run (local spec, TP=2 with SP): 3.19 at a 4-layer 256-wide model,
#: 3.25 at the 8B paper config (tests/unit/dryrun/test_dryrun_megatron.py holds plan to it).
RECOMPUTED_LAYER_BACKWARD = 3.2
#: What a Qwen3-MoE layer keeps for backward, in multiples of the tensors :func:`layer_activation_bytes` names: the
#: megatron dry run of cut models (4 and 8 layers) at Qwen3-30B-A3B's width (TP 2, SP, EP 8 and 32) and at
#: Qwen3-235B-A22B's (TP 4, SP, EP 64) measured 1.157 and 1.159, the same whatever EP.
EXPERT_LAYER_KEPT = 1.16
#: The copies of the dispatcher's gathered tokens a Qwen3-MoE layer's backward holds (:func:`dispatched_bytes`;
#: the gathered input, the experts' output over it, and both gradients): the same dry runs, recomputed, measured 4.1
#: a token of the EP group at both widths and at EP 4 to 64, beside the recomputed layer's kept tensors and 8% more.
DISPATCHED_COPIES = 4
#: What a Qwen3-MoE layer's backward holds beyond its kept tensors and :func:`dispatched_bytes`, in multiples of the
#: kept tensors (the same dry runs: 0.08 recomputed).
EXPERT_LAYER_BACKWARD = 0.08

#: Buffers of one layer's keys (or values) a decode step holds beside the cache at once: a compaction rebuilds
#: keys then values, each from a copy of the rows it keeps into a new buffer while the old one lives (measured by
#: the dry run; a growing cache's concatenation holds fewer).
KV_COPIES = 3


def answer_rows(work: Workload, prompts: int, samples: int) -> int:
    """The rows of the answer phase's chunk in a call over ``prompts`` x ``samples``: the whole sequence each, as
    ``rollout.kv_cache_tokens`` bounds them."""
    rows, budget = prompts * samples, work.kv_cache_tokens
    return rows if budget is None else min(rows, max(1, budget // work.seq_len))


def thinking_kv_tokens(work: Workload, prompts: int, samples: int) -> int:
    """The keys and values the thinking phase's largest chunk of whole groups holds (prompt + thinking budget each), as
    ``rollout.kv_cache_tokens`` bounds it."""
    group, budget = samples * (work.seq_len - 1 - work.answer_tokens), work.kv_cache_tokens
    return group * (prompts if budget is None else min(prompts, max(1, budget // group)))


def hf_activation_bytes(arch: Qwen3Architecture, work: Workload) -> float:
    """Bytes the hf backend keeps for one micro-batch's backward, as the dry run counts them. Under bf16 autocast over
    fp32 weights, per layer and token: the fp32 residual stream and both norms' fp32 inputs and outputs with each
    projection's own bf16 cast of its input and the layer's fp32 output (30h), Q's norm (fp32 input, bf16 output),
    the attention's Q, K and V repeated to Q's heads, its output and o_proj's contiguous copy of it (16q), K's norm
    and projection (6kv), SwiGLU's four bf16 tensors (8I), and for padded rows the bf16 bias SDPA makes of the
    boolean mask in every layer (2 bytes x L). Beyond the layers: the final norm and the gathered last hidden
    states (12h per token), and the bf16 weight casts autocast saves (2 bytes per layer parameter). In fp32
    (``model.precision=fp32``: no casts, every tensor fp32), fitted to the dry run of dense Qwen3 shapes with 128-wide
    heads (within 7%, and of 64-wide ones within 10%): 8h + 16q + 8kv + 24I + 4L a layer and 8h + 16I beyond them (a
    layer's MLP tensors at the forward's end). With ``model.activation_checkpointing`` a layer keeps only its fp32
    input (4h per token), and backward holds one layer's set again while it recomputes it."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    tokens, width = work.tokens_per_rank, arch.intermediate_size
    if work.autocast:
        per_layer = tokens * (30 * h + 16 * q + 6 * kv + 8 * width + 2 * work.seq_len)
        beyond_layers, casts = 12 * h * tokens, 2 * layer_parameters(arch)
    else:
        per_layer = tokens * (8 * h + 16 * q + 8 * kv + 24 * width + 4 * work.seq_len)
        beyond_layers, casts = (8 * h + 16 * width) * tokens, 0
    if work.recompute:  # model.activation_checkpointing: each layer's fp32 input, and one layer run again in backward
        return arch.num_layers * 4 * h * tokens + per_layer + beyond_layers + casts
    return arch.num_layers * (per_layer + casts) + beyond_layers


def logprob_head_bytes(arch: Qwen3Architecture, work: Workload, tp: int = 1) -> float:
    """The chunked log-prob kernel in backward, as the dry run counts it. hf: fp32 weights and hidden states, so the
    fp32 gradients of both and two fp32 chunks of logits; under autocast its products run in bf16: the head's bf16
    copy, and at the peak one fp32 chunk, its bf16 copy and their [V, H] product before it joins the fp32 gradient.
    Megatron: bf16 hidden states (its norms run under
    autocast), so their bf16 gradient, the fp32 gradient of the head's ``V/TP`` slice, the slice's bf16 copy where
    the weights are fp32 (the products run in bf16), and the larger of the loop's chunks (the last chunk's fp32
    gradient, the next one's bf16 product and its fp32 copy) and, with bf16 weights, the gradient's bf16 copy the
    kernel returns once the loop is done (at 8B TP=2 the larger: 0.58 GiB)."""
    vocab, h, tokens, chunk = math.ceil(arch.vocab_size / tp), arch.hidden_size, work.tokens_per_rank, work.logprob_chunk
    if work.backend == "hf" and work.autocast:
        return 4 * tokens * h + 4 * vocab * h + 2 * 2 * vocab * h + (4 + 2) * chunk * vocab
    if work.backend == "hf":
        return 4 * tokens * h + 4 * vocab * h + 2 * 4 * chunk * vocab
    bf16_weights = OPTIMIZER_MODES[work.optimizer][0] == 2
    held = 2 * tokens * h + 4 * vocab * h + (0 if bf16_weights else 2 * vocab * h)
    return held + max((4 + 2 + 4) * chunk * vocab, 2 * vocab * h if bf16_weights else 0)


def estimate(arch: Qwen3Architecture, work: Workload, tp: int, pp: int, dp: int, gpu_gb: float,
             headroom: float) -> LayoutEstimate:
    parts = component_bytes(arch, work, tp, pp, dp, gpu_gb)
    total, largest = _peak(parts, work, tp * pp * dp * work.context_parallel)
    sizes = [*(round(parts[name] / GiB, 2) for name in COMPONENTS), round(total, 2)]
    if parts["vllm"] > 0 and (short := vllm_share_short(arch, work, parts["vllm"])):
        return LayoutEstimate(tp, pp, dp, work.expert_parallel, *sizes, False, "vllm", short)
    return LayoutEstimate(tp, pp, dp, work.expert_parallel, *sizes, total <= gpu_gb * headroom, largest,
                          advice(largest, arch, work, (tp, pp, dp), gpu_gb, total))


def _peak(parts: dict[str, float], work: Workload, world: int) -> tuple[float, str]:
    """The peak (GiB) of a layout's components (:func:`component_bytes`) over ``world`` processes, and the one that
    takes the most of it."""
    sharded = OPTIMIZER_MODES[work.optimizer][3]
    # What stays all run, and the two phases' working sets, which do not coexist.
    staying = ["weights", "optimizer", "rollout_copy", *(["gradients"] if sharded else [])]
    training = [*([] if sharded else ["gradients"]), "activations", "logprob_head"]
    rollout = ["sampling", "decode_cast", "vllm"]  # the sampling call whose KV cache and prefill hold the most
    if work.async_copy and world == 1:  # the copy samples the next step in a child process while this one trains
        training += ["sampling", "decode_cast"]
    refitting = ["refit", "vllm"]  # a vLLM engine is awake while it loads the weights; a KV cache is not yet held
    # torch's foreach AdamW holds sqrt(v) for every parameter it steps at once: half the replicated state, a third of
    # the distributed optimizer's shard (master weights and moments); measured on an H100: docs/results/real_gpu.md
    stepping = ([], parts["optimizer"] / 3) if sharded else (["gradients"], parts["gradients"] + parts["optimizer"] / 2)
    phase, phase_bytes = max([(names, sum(parts[name] for name in names)) for names in (training, rollout, refitting)] + [stepping],
                             key=lambda working: working[1])
    named = [name for name in staying + phase if name != "sampling"] + (["kv_cache", "prefill"] if "sampling" in phase else [])
    return (sum(parts[name] for name in staying) + phase_bytes) / GiB, max(named, key=lambda name: parts[name])


def component_bytes(arch: Qwen3Architecture, work: Workload, tp: int, pp: int, dp: int, gpu_gb: float) -> dict[str, float]:
    """Each of :data:`COMPONENTS` in bytes, on the layout's fullest rank. A Qwen3-MoE's experts are split over the
    expert-parallel ranks, their optimizer state over the expert-data-parallel ones (TP x CP x DP / EP: the ranks
    holding the same experts); the rest over TP (and its state over DP x CP)."""
    experts = expert_parameters(arch)
    split = work.expert_parallel * work.expert_tensor_parallel
    params_per_rank = (parameter_count(arch) - experts) / (tp * pp) + experts / (split * pp)
    weight_bytes, gradient_bytes, optimizer_bytes, sharded = OPTIMIZER_MODES[work.optimizer]
    layers = arch.num_layers // pp
    micro_batches = max(1, math.ceil(work.batch_prompts * work.samples / dp / work.micro_batch))
    in_flight = min(pp, micro_batches)
    per_layer = layer_activation_bytes(arch, work, tp)
    # a Qwen3-MoE layer's backward: the dispatcher's gathered tokens and a little more (recomputed: the layer again)
    backward = dispatched_bytes(arch, work, tp) + EXPERT_LAYER_BACKWARD * per_layer if arch.is_moe else 0.0
    if work.recompute:
        inputs = 2 * work.own_tokens(tp) * arch.hidden_size
        activations = in_flight * layers * inputs + backward + (1 if arch.is_moe else RECOMPUTED_LAYER_BACKWARD) * per_layer
    else:
        activations = in_flight * layers * per_layer + backward
    vllm = work.rollout_engine == "vllm"
    hf = work.backend == "hf"
    in_place = hf and not vllm and not work.async_copy  # the native/hf samplers decode the policy's own model
    samples_here = not work.rollout_ranks  # separate: the rollout ranks sample (rollout_rank_bytes)
    parts = {
        "weights": weight_bytes * params_per_rank,
        "gradients": gradient_bytes * params_per_rank,
        "optimizer": optimizer_bytes * (shard_parameters(arch, work, tp, pp, dp) if sharded else params_per_rank),
        "activations": hf_activation_bytes(arch, work) if hf else activations,
        "logprob_head": logprob_head_bytes(arch, work, 1 if hf else tp),
        "rollout_copy": 0.0 if vllm or in_place or not samples_here else (4 if hf else work.compute_bytes) * parameter_count(arch),
        **(sampler_bytes(arch, work, work.batch_prompts // dp, policy=hf) if samples_here and not vllm else
           dict.fromkeys(("kv_cache", "prefill", "sampling"), 0.0)),
        "decode_cast": 2 * parameter_count(arch) if work.decode_cast and graph_decode(arch, work) and samples_here else 0.0,
        "refit": refit_bytes(arch, work) + (SENT_BUCKETS * work.sync_bucket_mb * 2**20 if work.rollout_ranks else 0.0),
        "vllm": vllm_bytes(arch, work, gpu_gb) if vllm and samples_here else 0.0,
    }
    return parts


def shard_parameters(arch: Qwen3Architecture, work: Workload, tp: int, pp: int, dp: int) -> float:
    """The parameters of a rank's distributed-optimizer shard: its TP x PP share of the dense ones over DP x CP, and
    its EP x ETP share of a Qwen3-MoE's experts over the ranks holding the same experts (TP x CP x DP / EP x ETP)."""
    experts = expert_parameters(arch)
    split = work.expert_parallel * work.expert_tensor_parallel
    expert_data_parallel = max(1, tp * work.context_parallel * dp // split)
    return ((parameter_count(arch) - experts) / (tp * pp * dp * work.context_parallel)
            + experts / (split * pp * expert_data_parallel))


#: What ``megatron.optimizer_cpu_offload`` keeps in host memory a parameter of the rank's shard: fp32 master weights,
#: AdamW's two moments and the gradient copied over (the dry run: 56.9 GiB a process at the Qwen3-30B-A3B one-node
#: example, its shard's 3.8B parameters).
HOST_STATE_BYTES = 16


def host_state_gib(arch: Qwen3Architecture, work: Workload, tp: int, pp: int, dp: int) -> float:
    """With ``megatron.optimizer_cpu_offload``, the optimizer state each process holds in host memory between steps
    (GiB; its AdamW step on the host holds more: the dry run measures it)."""
    return round(HOST_STATE_BYTES * shard_parameters(arch, work, tp, pp, dp) / GiB, 2)


#: The weight sync's buckets its sending rank holds at once (``rollouts/sync.py``: one in flight, the next filling),
#: beside the batch its refit gathers (the dry run of a split world's training rank).
SENT_BUCKETS = 2


#: Copies of one gathered batch a refit holds at once (``MegatronPolicy.iter_hf``): the pieces gathered from the ranks
#: and the HF tensors merged from them (the dry run: twice the embedding at 8B and 32B, at TP 1 and 2, tied or not, in
#: bf16 and fp32; twice the largest batch of experts and this rank's share of it at Qwen3-30B-A3B, EP 8).
REFIT_COPIES = 2


def refit_bytes(arch: Qwen3Architecture, work: Workload) -> float:
    """What a Megatron rank holds beyond its weights while it gathers them into HF tensors for its sampler's copy, a
    vLLM engine or the rollout ranks (``MegatronPolicy.iter_hf``), a batch at a time in the weights' dtype: the largest
    tensor whole (the embedding or the head), or the largest run of one layer's experts (``mapping.gather_batches``
    under :data:`~nemo_jq.models.megatron.mapping.EXPERT_GATHER_BYTES`) and this rank's share of it, flattened for
    the gather. hf: none (its sampler copies the weights one tensor at a time, or samples from them)."""
    import torch

    from nemo_jq.models.megatron.mapping import EXPERT_GATHER_BYTES, gather_batches

    if work.backend == "hf":
        return 0.0
    weight = OPTIMIZER_MODES[work.optimizer][0]
    largest = max(arch.vocab_size, 0 if arch.is_moe else 2 * arch.intermediate_size) * arch.hidden_size * weight
    if not arch.is_moe:
        return REFIT_COPIES * largest
    group, slices = work.expert_parallel * work.expert_tensor_parallel, work.expert_tensor_parallel
    fc1, fc2 = 2 * arch.moe_intermediate_size * arch.hidden_size // slices, arch.moe_intermediate_size * arch.hidden_size // slices
    dtype = torch.bfloat16 if weight == 2 else torch.float32
    entries = [(f"decoder.layers.0.mlp.experts.local_experts.{index}.linear_fc{fc}.weight", dtype, elements)
               for index in range(arch.num_experts // work.expert_parallel) for fc, elements in ((1, fc1), (2, fc2))]
    sizes = {name: group * elements * weight for name, _, elements in entries}
    batch = max(sum(sizes[name] for name in names) for names in gather_batches(entries, group, EXPERT_GATHER_BYTES))
    return max(REFIT_COPIES * largest, REFIT_COPIES * batch + batch / group)


def decode_shape(arch: Qwen3Architecture, engine_gpus: int) -> dict[str, float]:
    """What a decode step's bound needs beyond the sampler's weight bytes (``bounds.sampling_seconds``): the GPUs one
    engine spans (each reads its share of the weights and does its share of the FLOPs), the parameters a token runs
    through (a Qwen3-MoE's k of E experts), the expert parameters and the share of them a token routes to (a step
    reads the experts its rows route to), and the shards of the keys and values (vLLM splits the KV heads over its
    tensor-parallel ranks, replicating them past the heads' count)."""
    experts = expert_parameters(arch)
    share = arch.num_experts_per_tok / arch.num_experts if arch.is_moe else 0.0
    return {"engine_gpus": engine_gpus, "active_parameters": parameter_count(arch) - experts * (1 - share),
            "expert_parameters": experts, "expert_share": share,
            "kv_shards": min(engine_gpus, arch.num_key_value_heads), "kv_bytes_per_token": kv_bytes_per_token(arch)}


def vllm_least_bytes(arch: Qwen3Architecture, work: Workload) -> float:
    """The least a vLLM engine's share of a GPU must hold for vLLM to start: its weights (bf16; fp32 with
    ``model.precision=fp32``), split over its ``rollout.tensor_parallel`` GPUs, and the keys and values of one sequence
    of ``seq_len`` tokens (vLLM refuses a cache that cannot hold one; its own working memory beside them is not
    counted)."""
    shape = decode_shape(arch, work.vllm_tensor_parallel)
    per_token = kv_bytes_per_token(arch, work.compute_bytes)
    return work.compute_bytes * parameter_count(arch) / work.vllm_tensor_parallel + work.seq_len * per_token / shape["kv_shards"]


def vllm_share_short(arch: Qwen3Architecture, work: Workload, share: float) -> str | None:
    """Why vLLM refuses to start in ``share`` bytes a GPU (the advice), or None where it starts."""
    least = vllm_least_bytes(arch, work)
    if share >= least:
        return None
    # beside the training's state a GPU holds (colocated) a large model's engine may have no share that starts
    apart = "" if work.rollout_ranks else (", or rollout.placement=separate with rollout.ranks (vLLM on GPUs of its own, "
                                           "none of the training's state beside it)")
    return (f"a larger rollout.vllm_memory_utilization or rollout.tensor_parallel{apart}: vLLM's share holds less than "
            f"its engine's {'bf16' if work.autocast else 'fp32'} weights and one sequence's keys and values "
            f"({least / GiB:.1f} GiB a GPU at rollout.tensor_parallel={work.vllm_tensor_parallel}), and vLLM refuses to "
            "start")


def vllm_bytes(arch: Qwen3Architecture, work: Workload, gpu_gb: float) -> float:
    """What a vLLM engine holds on each of its GPUs: its share (``rollout.vllm_memory_utilization``), or, with
    ``rollout.vllm_kv_cache_gb``, its weights (:meth:`Workload.compute_bytes` each) and that cache."""
    if work.vllm_kv_cache_gb is not None:
        return work.compute_bytes * parameter_count(arch) / work.vllm_tensor_parallel + work.vllm_kv_cache_gb * GiB
    return work.vllm_memory_utilization * gpu_gb * GiB


def kv_bytes_per_token(arch: Qwen3Architecture, element_bytes: int = 2) -> int:
    """A token's keys and values over every layer (bf16; ``element_bytes`` 4: fp32)."""
    return 2 * element_bytes * arch.num_layers * arch.num_key_value_heads * arch.head_dim


def graph_decode(arch: Qwen3Architecture, work: Workload) -> bool:
    """Whether the native engine decodes from its static cache (:attr:`Workload.graph_decode`): a dense Qwen3 only
    (``rollouts.qwen3_decode`` is the one family's decode step; a Qwen3-MoE decodes eagerly)."""
    return work.graph_decode and not arch.is_moe


def sampler_bytes(arch: Qwen3Architecture, work: Workload, prompts: int, *, policy: bool) -> dict[str, float]:
    """The native/hf samplers' working set over a step's sampling calls (its rollouts of ``prompts`` x M rows, an
    evaluation call): the most KV cache any phase of them holds (``kv_cache``), the most prefill temporaries (an
    answer phase prefills its chunk's whole contexts at once; a thinking phase only its prompts, left uncounted), and
    ``sampling``, the most the two take together in one phase (an answer phase's chunk prefills beside a smaller cache
    than the thinking phase's). Evaluation samples answers; the rollouts where ``sampled_answers``. ``policy``: the hf
    policy samples from its own weights (:func:`prefill_bytes`)."""
    copies = 1 + KV_COPIES * (not graph_decode(arch, work)) / (2 * arch.num_layers)
    per_token = kv_bytes_per_token(arch, work.compute_bytes) * copies
    held = []  # each phase's KV cache and prefill temporaries
    for call, answers in (((prompts, work.samples), work.sampled_answers), (work.eval_call, True)):
        held.append((per_token * thinking_kv_tokens(work, *call), 0.0))
        if answers:
            rows = answer_rows(work, *call)
            held.append((per_token * rows * work.seq_len, prefill_bytes(arch, work, rows, policy=policy)))
    return {"kv_cache": max(kv for kv, _ in held), "prefill": max(prefill for _, prefill in held),
            "sampling": max(kv + prefill for kv, prefill in held)}


def prefill_bytes(arch: Qwen3Architecture, work: Workload, rows: int, *, policy: bool) -> float:
    """The temporaries of an answer phase's prefill of ``rows`` (:func:`answer_rows`): one forward over the chunk's
    contexts (prompt, thinking budget and ``</think>`` each). A model in its compute dtype (a rollout rank's,
    Megatron's sampler copy): three MLP widths and five query widths a position (a Qwen3-MoE's MLP width: its k experts'), fitted
    to the dry run's rollout ranks of the 0.6B and 8B FinQA configs (4.45 and 13.13 GiB, measured 4.40 and 12.84).
    The hf ``policy``'s fp32 weights under bf16 autocast: HF's rotary embedding makes four fp32 query-width tensors
    beside three fp32 hidden states and a key's fp32 and bf16, or the MLP three bf16 widths beside four fp32 hidden
    states, whichever is more; and the boolean causal mask (a byte a position of the row) and the fp32 rotary tables
    (the dry run of the 0.6B, 1.7B, 4B and 8B at the 0.6B FinQA config: 6.57, 8.68, 12.43 and 16.65 GiB, each within
    0.1%); without autocast, the same as a model in fp32."""
    context = work.seq_len - work.answer_tokens
    mlp = arch.num_experts_per_tok * arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    if not policy or not work.autocast:
        return rows * context * work.compute_bytes * (3 * mlp + 5 * q)
    return rows * context * (max(16 * q + 12 * h + 6 * kv, 6 * mlp + 16 * h) + context + 8 * arch.head_dim)


def rollout_rank_bytes(arch: Qwen3Architecture, work: Workload, data_parallel: int, gpu_gb: float) -> dict[str, float]:
    """A rollout rank's memory (``rollout.placement=separate``), in bytes: the native/hf samplers' whole model in bf16
    and KV cache of one replica's request (it serves one at a time), or vLLM's share of the GPU (its weights, a
    ``vllm_tensor_parallel``-th of them where an engine spans that many rollout ranks, and KV cache are inside it, and
    it never sleeps here), and what the sync's receiving side holds (every rank of an engine receives it all): a tensor spread over
    buckets put together whole (the embedding or the head, at real vocabularies) and the bucket it ends in, and with
    an untied head (the last tensor) the bucket before, of which the engine still holds the view it loaded last; no
    gradients, no optimizer."""
    # the largest tensor arrives whole after the bucket it ends in; an untied head arrives last, while the engine
    # still holds its view of the bucket before (a tied embedding arrives first): measured by the dry run
    held_buckets = 1 if arch.tie_word_embeddings else 2
    buckets = {"sync_buckets": held_buckets * work.sync_bucket_mb * 2**20 + largest_tensor_bytes(arch, work)}
    if work.rollout_engine == "vllm":
        return {"vllm": vllm_bytes(arch, work, gpu_gb), **buckets}
    prompts = max(1, work.batch_prompts // data_parallel)
    return {"weights": work.compute_bytes * parameter_count(arch), **sampler_bytes(arch, work, prompts, policy=False),
            **buckets}


def sent_bytes_per_parameter(work: Workload) -> int:
    """The weight sync sends the policy's weights as they are: bf16 with Megatron's bf16 weights (``bf16-distopt``),
    else fp32."""
    return OPTIMIZER_MODES[work.optimizer][0]


def largest_tensor_bytes(arch: Qwen3Architecture, work: Workload) -> int:
    """The largest weight the sync sends (the embedding or an MLP projection), in its sent dtype."""
    return max(arch.vocab_size, arch.intermediate_size) * arch.hidden_size * sent_bytes_per_parameter(work)


def weight_sync(arch: Qwen3Architecture, work: Workload, bandwidth_gb_s: float) -> dict[str, float]:
    """What each optimizer step sends the rollout ranks: the whole model as the policy holds it
    (:func:`sent_bytes_per_parameter`), in buckets, and the seconds it takes at ``bandwidth_gb_s`` (10^9 bytes/s)."""
    sent = sent_bytes_per_parameter(work) * parameter_count(arch)
    return {"bytes": sent, "buckets": math.ceil(sent / (work.sync_bucket_mb * 2**20)), "gb_per_s": bandwidth_gb_s,
            "seconds": sent / (bandwidth_gb_s * 1e9)}


#: ``nemo-jq plan``'s workload flags and the config keys they stand for.
FLAG_KEYS = {"--micro-batch": "train.micro_batch_rows", "--batch-prompts": "train.batch_size",
             "--recompute": "megatron.recompute_activations", "--context-parallel": "megatron.context_parallel",
             "--rollout-engine": "rollout.engine", "--kv-cache-tokens": "rollout.kv_cache_tokens",
             "--vllm-memory-utilization": "rollout.vllm_memory_utilization",
             "--rollout-tensor-parallel": "rollout.tensor_parallel", "--rollout-ranks": "rollout.ranks"}


def setting(flag: str, config_keys: bool, value: Any = None) -> str:
    """How advice names a setting: ``plan``'s flag with its config key beside it, or, for a run config's workload
    (``config_keys``: the flags are refused beside ``--config``), the key alone (``key=value`` with a ``value``)."""
    key = FLAG_KEYS[flag]
    if config_keys:
        return key if value is None else f"{key}={str(value).lower() if isinstance(value, bool) else value}"
    if value is None:
        return f"{flag} ({key})"
    return f"{flag} ({key}={str(value).lower()})" if isinstance(value, bool) else f"{flag} {value} ({key}={value})"


def remedies(component: str, work: Workload) -> list[tuple[str, Workload | None]]:
    """The settings that may shrink ``component`` (ones ``work`` has not already chosen), each with the workload it
    gives (None: a change of layout or GPUs, which no workload field holds)."""
    if work.backend == "hf" and component in ("weights", "gradients", "optimizer"):
        return [("model.backend=megatron with megatron.distributed_optimizer=true and more GPUs (hf trains the whole "
                 "model and its AdamW state on one GPU)", None)]
    if component == "rollout_copy" or (component in ("kv_cache", "prefill") and work.rollout_engine != "vllm"):
        why = ("no HF copy of the whole model on the sampling rank" if component == "rollout_copy" else
               f"its {'KV cache' if component == 'kv_cache' else 'prefill'} in its own share of the GPU, which sleeps "
               "while the policy trains")
        found = [(f"{setting('--rollout-engine', work.config_keys, 'vllm')}: {why}", replace(work, rollout_engine="vllm"))]
        if component != "rollout_copy" and work.kv_cache_tokens:  # it bounds the answer phase's chunk too
            found.insert(0, (f"a smaller {setting('--kv-cache-tokens', work.config_keys)}",
                             replace(work, kv_cache_tokens=work.kv_cache_tokens // 2)))
        return found
    if component == "decode_cast":
        return [("rollout.cuda_graphs=false (the eager decode, no bf16 cast of the fp32 policy; slower on a GPU)",
                 replace(work, decode_cast=False))]
    if component == "vllm":
        return [(f"a smaller {setting('--vllm-memory-utilization', work.config_keys)}",
                 replace(work, vllm_memory_utilization=work.vllm_memory_utilization * 0.75))]
    if component == "optimizer" and work.optimizer in OPTIMIZER_LADDER:
        now = OPTIMIZER_FLAGS[work.optimizer].split()
        return [(" ".join(key for key in OPTIMIZER_FLAGS[mode].split() if key not in now) if work.config_keys
                 else f"--optimizer {mode} ({OPTIMIZER_FLAGS[mode]})", replace(work, optimizer=mode))
                for mode in OPTIMIZER_LADDER[OPTIMIZER_LADDER.index(work.optimizer) + 1:]]
    if component == "activations":
        found = []
        if not work.recompute:
            found.append(("model.activation_checkpointing=true" if work.backend == "hf"
                          else setting("--recompute", work.config_keys, True), replace(work, recompute=True)))
        if work.micro_batch > 1:
            found.append((f"fewer rows per forward/backward, whatever M (the same gradient for one more forward pass): "
                          f"{setting('--micro-batch', work.config_keys, max(1, work.micro_batch // 2))}",
                          replace(work, micro_batch=max(1, work.micro_batch // 2))))
        return found
    if component == "logprob_head":
        return [(f"more tensor parallelism (more GPUs per node) or {setting('--context-parallel', work.config_keys)}",
                 None)]
    return []


def advice(component: str, arch: Qwen3Architecture, work: Workload, layout: tuple[int, int, int], gpu_gb: float,
           now: float) -> str:
    """The first of :func:`remedies` that lowers this layout's peak ``now`` (GiB) by 1% or more (a change that would
    raise it, as the bf16 distributed optimizer does at DP=1, is never advised), else more GPUs."""
    for text, changed in remedies(component, work):
        if changed is None or _peak(component_bytes(arch, changed, *layout, gpu_gb), changed,
                                    math.prod(layout) * work.context_parallel)[0] < 0.99 * now:
            offloads = changed is not None and changed.optimizer.endswith("-offload") and not work.optimizer.endswith("-offload")
            return text + (f" (each process's host then holds its {host_state_gib(arch, changed, *layout)} GiB of "
                           "optimizer state, and more in its AdamW step)" if offloads else "")
    return "more GPUs (--nodes): more tensor, pipeline or data parallelism"


#: What each optimizer mode is in config keys (model.backend=megatron).
OPTIMIZER_FLAGS = {"fp32-adamw": "megatron.distributed_optimizer=false",
                   "fp32-distopt": "megatron.distributed_optimizer=true",
                   "bf16-distopt": "megatron.distributed_optimizer=true megatron.bf16_weights=true",
                   "fp32-distopt-offload": "megatron.distributed_optimizer=true megatron.optimizer_cpu_offload=true",
                   "bf16-distopt-offload": "megatron.distributed_optimizer=true megatron.bf16_weights=true "
                                           "megatron.optimizer_cpu_offload=true"}
#: The optimizer modes in the order advice walks them, each holding less of the optimizer on the GPU.
OPTIMIZER_LADDER = ("fp32-adamw", "fp32-distopt", "bf16-distopt", "bf16-distopt-offload")


#: What turns an hf run's config into a Megatron one: its recomputation is Megatron's own key.
MEGATRON_SWITCH = "model.backend=megatron model.activation_checkpointing=false megatron.recompute_activations=true"


def overrides(layout: LayoutEstimate, work: Workload) -> str:
    """The ``key=value`` overrides that train ``work`` at ``layout``, for ``nemo-jq train`` (under torchrun with
    TP x PP x CP x DP processes)."""
    if work.backend == "hf":
        return ("model.backend=hf" + (" model.activation_checkpointing=true" if work.recompute else "")
                + f" train.micro_batch_rows={work.micro_batch}")
    keys = [f"model.backend=megatron megatron.tensor_parallel={layout.tensor_parallel}",
            f"megatron.pipeline_parallel={layout.pipeline_parallel}",
            f"megatron.context_parallel={work.context_parallel}",
            f"megatron.sequence_parallel={str(work.sequence_parallel and layout.tensor_parallel > 1).lower()}",
            f"megatron.recompute_activations={str(work.recompute).lower()}", OPTIMIZER_FLAGS[work.optimizer],
            *([f"megatron.expert_parallel={layout.expert_parallel}"] if layout.expert_parallel > 1 else []),
            f"train.micro_batch_rows={work.micro_batch}", f"rollout.engine={work.rollout_engine}"]
    if work.rollout_engine == "vllm":
        keys.append(f"rollout.tensor_parallel={work.vllm_tensor_parallel} "
                    f"rollout.vllm_memory_utilization={work.vllm_memory_utilization:g}")
    if work.rollout_ranks:
        keys.append(f"rollout.placement=separate rollout.ranks={work.rollout_ranks}")
    return " ".join(keys)


def decode_engines(work: Workload, tp: int, pp: int) -> int:
    """The engines that sample one replica's rollouts: colocated vLLM has one on every ``vllm_tensor_parallel``
    ranks of the replica (each decodes a share of every call: ``rollouts.refit.ReplicaShares``); the native and hf
    samplers decode on the replica's first rank alone; rollout ranks of their own serve whole replicas."""
    if work.rollout_engine == "vllm" and not work.rollout_ranks:
        return tp * pp * work.context_parallel // work.vllm_tensor_parallel
    return 1


def decode_work(work: Workload, tp: int, pp: int, dp: int) -> dict[str, Any] | None:
    """How a step's rollouts are decoded at a layout, and what the setting leaves unused while they are: each
    replica's prompts, its engines and the prompts each decodes, its ranks that decode nothing (they wait), and its
    engines that get no prompt (fewer prompts than engines: they step with the others, empty). None with rollout ranks
    of their own, which sample while the training ranks train."""
    if work.rollout_ranks:
        return None
    engines, ranks = decode_engines(work, tp, pp), tp * pp * work.context_parallel
    prompts = math.ceil(work.batch_prompts / dp)
    return {"replica_prompts": prompts, "samples": work.samples, "replica_ranks": ranks, "engines": engines,
            "prompts_per_engine": math.ceil(prompts / engines), "waiting_ranks": ranks - engines * work.engine_gpus,
            "empty_engines": max(0, engines - prompts)}


def format_decode(decode: dict[str, Any], engine: str, config_keys: bool = False) -> str:
    """:func:`decode_work` in one line, naming the setting that puts what waits to work (as :func:`setting` does)."""
    line = f"decode: each replica's {decode['replica_prompts']} prompts x {decode['samples']} rollouts"
    if engine == "vllm":
        line += (f" over its {decode['engines']} vLLM engine{'s' * (decode['engines'] > 1)} "
                 f"({decode['prompts_per_engine']} prompts each, none decoded twice)")
        if decode["empty_engines"]:
            line += (f"; {decode['empty_engines']} engines get no prompt (fewer prompts than engines): a larger "
                     f"{setting('--batch-prompts', config_keys)} or {setting('--rollout-tensor-parallel', config_keys)}")
        return line
    line += " on its first rank"
    if decode["waiting_ranks"]:
        line += (f"; its other {decode['waiting_ranks']} ranks wait while it decodes: "
                 f"{setting('--rollout-engine', config_keys, 'vllm')} splits the prompts over the replica's ranks")
    return line


def plan(arch: Qwen3Architecture, work: Workload, *, gpus_per_node: int, nodes: int, gpu_gb: float,
         headroom: float = HEADROOM) -> list[LayoutEstimate]:
    """Every feasible layout's estimate, in recommendation order (fitting ones first, then the least memory)."""
    if work.optimizer not in OPTIMIZER_MODES:
        raise ValueError(f"--optimizer {work.optimizer!r}: choose one of {', '.join(OPTIMIZER_MODES)}")
    gpus, cp = gpus_per_node * nodes - work.rollout_ranks, work.context_parallel
    if work.rollout_ranks:
        from nemo_jq.config import SEPARATE_ENGINES

        if gpus < 1:
            raise ValueError(f"{setting('--rollout-ranks', work.config_keys, work.rollout_ranks)} of "
                             f"{gpus + work.rollout_ranks} GPUs leaves none to train: fewer rollout ranks, or more "
                             "--nodes/--gpus-per-node")
        if work.rollout_engine not in SEPARATE_ENGINES:
            raise ValueError(f"rollout ranks of their own sample with {', '.join(SEPARATE_ENGINES)} for now, not "
                             f"{work.rollout_engine}: {setting('--rollout-engine', work.config_keys, 'native')}, or "
                             f"colocated rollouts ({'' if work.config_keys else 'no --rollout-ranks; '}"
                             "rollout.placement=colocated)")
        if work.vllm_tensor_parallel > 1 and (work.rollout_engine != "vllm" or work.rollout_ranks % work.vllm_tensor_parallel):
            keys = work.config_keys
            raise ValueError(f"{setting('--rollout-tensor-parallel', keys, work.vllm_tensor_parallel)} with "
                             f"{setting('--rollout-ranks', keys, work.rollout_ranks)}: a vLLM engine over that many "
                             f"rollout ranks needs {setting('--rollout-engine', keys, 'vllm')} and "
                             f"{setting('--rollout-ranks', keys)} a multiple of it")
    if work.backend == "hf":  # one training process, one GPU
        return [estimate(arch, work, 1, 1, 1, gpu_gb, headroom)]
    layouts = []
    for tp in range(1, gpus_per_node + 1):
        for pp in range(1, arch.num_layers + 1):
            for ep in expert_parallel_sizes(arch):
                layout = MegatronLayout(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                                        sequence_parallel=work.sequence_parallel and tp > 1, expert_parallel=ep,
                                        expert_tensor_parallel=work.expert_tensor_parallel)
                if (not layout.divides(arch, gpus) or work.batch_prompts % layout.data_parallel(gpus)
                        or (work.rollout_engine == "vllm" and not work.rollout_ranks and tp % work.vllm_tensor_parallel)):
                    continue
                layouts.append(estimate(arch, replace(work, expert_parallel=ep), tp, pp, layout.data_parallel(gpus),
                                        gpu_gb, headroom))
    if not layouts:
        which = "training GPUs" if work.rollout_ranks else "GPUs"
        engine_tp = work.rollout_engine == "vllm" and not work.rollout_ranks and work.vllm_tensor_parallel > 1
        raise ValueError(f"no TP x PP x DP layout of {gpus} {which} at CP={cp} divides this model and a batch of "
                         f"{work.batch_prompts} prompts" + (f", with a TP that is a multiple of the vLLM engine's "
                                                            f"{work.vllm_tensor_parallel} GPUs" if engine_tp else "")
                         + f": change --nodes/--gpus-per-node, {setting('--context-parallel', work.config_keys)}"
                         + (f", {setting('--rollout-tensor-parallel', work.config_keys)}" if engine_tp else "")
                         + f" or {setting('--batch-prompts', work.config_keys)}"
                         + ("" if not arch.is_moe or work.sequence_parallel else  # check_trainable: no TP > 1 without it
                            "; a Qwen3-MoE takes TP > 1 only with sequence parallelism: " + (
                                "megatron.sequence_parallel=true" if work.config_keys else "drop --no-sequence-parallel")))
    fitting = sorted((e for e in layouts if e.fits),
                     key=lambda e: (-e.data_parallel, e.tensor_parallel, e.expert_parallel, e.total_gib))
    return fitting + sorted((e for e in layouts if not e.fits), key=lambda e: e.total_gib)


def fewest_nodes(arch: Qwen3Architecture, work: Workload, gpus_per_node: int, nodes: int, gpu_gb: float,
                 most: int = 128) -> tuple[int, dict[str, Any]] | None:
    """The fewest nodes past ``nodes`` (doubling, up to ``most``) at which a layout fits, and the one plan recommends
    there; None where none does (or no layout divides the model and batch there)."""
    more = nodes * 2
    while more <= most:
        try:
            layouts = plan(arch, work, gpus_per_node=gpus_per_node, nodes=more, gpu_gb=gpu_gb)
        except ValueError:  # no layout of that many GPUs divides the model and the batch
            layouts = []
        if layouts and layouts[0].fits:
            return more, asdict(layouts[0])
        more *= 2
    return None


def expert_parallel_sizes(arch: Qwen3Architecture) -> list[int]:
    """The ``expert_parallel`` sizes to try: those dividing a Qwen3-MoE's experts (``[1]`` for a dense Qwen3); which of
    them a layout takes, and at which TP, PP and CP experts train, :meth:`MegatronLayout.divides` says."""
    return [ep for ep in range(1, arch.num_experts + 1) if arch.num_experts % ep == 0] if arch.is_moe else [1]


def report(arch: Qwen3Architecture, work: Workload, layouts: list[LayoutEstimate], gpu_gb: float,
           headroom: float, sync_gb_s: float = 25.0, gpus: int = 1, gpus_per_node: int = 1) -> dict[str, Any]:
    """The layouts, the recommendation and its overrides; with rollout ranks, also a rollout rank's memory (GiB) at
    the first layout's DP and the weight sync (``sync_gb_s``: GB/s); a rollout rank that does not fit leaves no
    recommendation."""
    best = layouts[0] if layouts[0].fits else None
    result = {"parameters": parameter_count(arch), "workload": asdict(work), "gpus": gpus, "gpus_per_node": gpus_per_node,
              "gpu_memory_gib": gpu_gb, "headroom": headroom}
    if work.rollout_ranks:
        sizes = rollout_rank_bytes(arch, work, layouts[0].data_parallel, gpu_gb)
        parts = {name: round(size / GiB, 2) for name, size in sizes.items()}
        total = round(sum(size for name, size in parts.items() if name not in ("kv_cache", "prefill")), 2)  # in sampling
        # each engine's share holds its bf16 weights, split over its rollout.tensor_parallel ranks, and a sequence's KV
        least = vllm_least_bytes(arch, work)
        fits = total <= gpu_gb * headroom and sizes.get("vllm", math.inf) >= least
        result["rollout_rank"] = {**parts, "total": total, "fits": fits}
        if "vllm" in sizes:  # the shares that hold the engine and keep the rank (its sync's buckets beside) in the headroom
            others = (total - parts["vllm"]) * GiB
            result["rollout_rank"]["vllm_utilization_range"] = [
                math.ceil(100 * least / (gpu_gb * GiB)) / 100, math.floor(100 * (gpu_gb * headroom * GiB - others) / (gpu_gb * GiB)) / 100]
        result["weight_sync"] = weight_sync(arch, work, sync_gb_s)
        best = best if result["rollout_rank"]["fits"] else None
    shown = best or layouts[0]
    result["decode"] = decode_work(work, shown.tensor_parallel, shown.pipeline_parallel, shown.data_parallel)
    if work.optimizer.endswith("-offload"):
        result["host_state_gib"] = host_state_gib(arch, work, shown.tensor_parallel, shown.pipeline_parallel,
                                                  shown.data_parallel)
    return {**result, "recommended": asdict(best) if best else None, "overrides": overrides(best, work) if best else None,
            "layouts": [asdict(layout) for layout in layouts]}


def layout_words(layout: dict[str, Any], context: str, experts: bool) -> str:
    """A layout as the report names it: ``TP=2 PP=1 DP=4`` (`` CP=...`` after PP where ``context`` gives it, ``EP=``
    last where a Qwen3-MoE's ``experts`` split)."""
    return (f"TP={layout['tensor_parallel']} PP={layout['pipeline_parallel']}{context} DP={layout['data_parallel']}"
            + (f" EP={layout['expert_parallel']}" if experts else ""))


def run_hours_column(timed: list[dict[str, Any]]) -> str:
    """The table's time column: the run's expected hours where every phase's fraction is measured, else its least."""
    return "expected h" if all(row["run"] and "hours_expected" in row["run"] for row in timed) else "least h"


def format_report(result: dict[str, Any]) -> str:
    experts = any(layout["expert_parallel"] > 1 for layout in result["layouts"])
    keys = [name for name in LayoutEstimate.__dataclass_fields__][:-2]
    columns = ["TP", "PP", "DP", "EP", *(key.removesuffix("_gib").replace("_", " ") for key in keys[4:-2]), "total GiB",
               "fits"]
    if not experts:  # a dense Qwen3's table has no EP column
        keys, columns = [key for key in keys if key != "expert_parallel"], [c for c in columns if c != "EP"]
    timed = result.get("time", {}).get("layouts")
    lines = [f"{result['parameters'] / 1e9:.3f}B parameters; workload: "
             + ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in result["workload"].items()
                         if key != "config_keys"),
             " ".join(f"{c:>12}" for c in columns + ([run_hours_column(timed)] if timed else []))]
    for index, layout in enumerate(result["layouts"]):
        run = timed[index]["run"] if timed else None
        hours = ([f"{run.get('hours_expected', run['hours_at_least']):>12}"] if run else [f"{'?':>12}"]) if timed else []
        lines.append(" ".join([*(f"{str(layout[k]):>12}" for k in keys), *hours]))
    best, closest = result["recommended"], result["layouts"][0]
    budget = result["gpu_memory_gib"] * result["headroom"]
    context = f" CP={result['workload']['context_parallel']}" if result["workload"]["context_parallel"] > 1 else ""
    sampler = result.get("rollout_rank")
    if sampler:
        sync = result["weight_sync"]
        vllm = "vllm" in sampler
        held = (f"{sampler['vllm']} GiB vLLM share (its weights and KV cache)" if vllm else
                f"{sampler['weights']} GiB bf16 weights + {sampler['sampling']} of a sampling call's KV cache and prefill "
                f"temporaries (each at most {sampler['kv_cache']} and {sampler['prefill']})")
        keys = result["workload"]["config_keys"]
        low, high = sampler.get("vllm_utilization_range", (None, None))
        advice = ((f"a {setting('--vllm-memory-utilization', keys)} from {low:g} (its share holds the bf16 weights and "
                   f"one sequence's keys and values) to {high:g} (the rank within the headroom)" if low <= high else
                   f"a larger {setting('--rollout-tensor-parallel', keys)}: no --vllm-memory-utilization holds the "
                   "weights and one sequence within the headroom") if vllm else f"a smaller {setting('--kv-cache-tokens', keys)}")
        lines.append(f"rollout ranks (the last {result['workload']['rollout_ranks']} GPUs; the layouts above are the "
                     f"others'): each {held} + {sampler['sync_buckets']} sync buckets = {sampler['total']} GiB"
                     + ("" if sampler["fits"] else f": does not fit in {budget:.4g} GiB: try {advice}"))
        lines.append(f"weight sync per step: {sync['bytes'] / 1e9:.2f} GB in {sync['buckets']} buckets, "
                     f"{sync['seconds']:.2f} s at {sync['gb_per_s']:g} GB/s (--sync-bandwidth)")
    if best:
        lines.append(f"recommended: {layout_words(best, context, experts)} ({best['total_gib']} of {budget:.4g} GiB)" + (
                         ": of the layouts that fit, the most data parallelism, then the least tensor parallelism (the "
                         "time column leaves its all-reduces out)" if sum(layout["fits"] for layout in result["layouts"]) > 1
                         else ""))
        lines.append(f"overrides: {result['overrides']}")
    elif closest["fits"]:
        lines.append("nothing recommended: a training layout fits, the rollout ranks do not")
    else:
        largest = closest["largest"]
        lines.append(f"nothing fits in {budget:.4g} GiB: the closest layout, {layout_words(closest, context, experts)}, "
                     f"needs {closest['total_gib']} GiB, most of it the {largest.replace('_', ' ')} "
                     f"({closest[largest + '_gib']} GiB): try {closest['advice']}")
        if (more := result.get("fits_at_nodes")) is not None:
            nodes, layout = more
            lines.append(f"or more GPUs: --nodes {nodes} fits {layout_words(layout, context, experts)} "
                         f"({layout['total_gib']} of {budget:.4g} GiB)")
    if result.get("host_state_gib") is not None:
        per_node = result.get("gpus_per_node", 1)
        lines.append(f"host memory: each process holds its {result['host_state_gib']} GiB of optimizer state "
                     f"(megatron.optimizer_cpu_offload) between steps, a node of {per_node} GPUs "
                     f"{result['host_state_gib'] * per_node:.1f} GiB; its AdamW step on the host holds more (`nemo-jq "
                     "dryrun --config ...` measures it: host GiB a node)" + ("" if best else " (at the closest layout)"))
    if result.get("decode"):
        lines.append(format_decode(result["decode"], result["workload"]["rollout_engine"], result["workload"]["config_keys"])
                     + ("" if best else " (at the closest layout)"))
    if result["workload"]["backend"] == "hf" and result.get("gpus", 1) > 1:
        lines.append(f"model.backend=hf trains a run on one GPU: the other {result['gpus'] - 1} of the {result['gpus']} "
                     f"would idle. Use them for a sweep of runs (nemo-jq sweep --slurm: one GPU a run, "
                     f"{result['gpus']} at once; docs/sweeps.md), or train this run over them with {MEGATRON_SWITCH} "
                     f"(plan --config ... {MEGATRON_SWITCH} gives its layout)")
    lines.append("assumptions: see `nemo-jq plan --help` (estimates from shapes, not measurements)")
    return "\n".join(lines)
