"""How the Megatron backend lays one model out over the processes: the ``megatron:`` config section.

One :meth:`MegatronLayout.validate` holds every rule, and the config loader, the backend, the policy and
``nemo-jq plan`` all call it, so a layout is refused the same way (one line naming the key) wherever it
comes from. Imports nothing heavy: a config loads without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_jq.typed import option


@dataclass
class MegatronLayout:
    tensor_parallel: int = option(1, "ranks that split each layer (must divide the attention heads, KV heads and "
                                  "MLP width)", ge=1)
    pipeline_parallel: int = option(1, "pipeline stages, each an equal run of layers (must divide the layer count), "
                                    "scheduled 1F1B", ge=1)
    context_parallel: int = option(1, "ranks that split every sequence (load-balanced, 2 chunks each) for long "
                                   "contexts; needs Transformer Engine's attention, so GPU only", ge=1)
    sequence_parallel: bool = option(False, "split the norms' and dropouts' activations over the tensor-parallel ranks "
                                     "too (needs tensor_parallel > 1)")
    recompute_activations: bool = option(False, "keep only each layer's input and recompute the layer in backward "
                                         "(less activation memory, about a third more compute)")
    distributed_optimizer: bool = option(False, "split AdamW's fp32 master weights and moments over the data-parallel "
                                         "ranks (ZeRO-1: 12/DP bytes of optimizer state per parameter)")
    bf16_weights: bool = option(False, "bf16 parameters and activations, with fp32 gradient accumulation and the fp32 "
                                "master weights in the distributed optimizer (needs distributed_optimizer=true)")
    expert_parallel: int = option(1, "Qwen3-MoE: ranks that split the experts of each layer (each holds num_experts / "
                                  "expert_parallel of them; must divide num_experts), carved from the tensor x context "
                                  "x data parallel ranks", ge=1)
    expert_tensor_parallel: int = option(1, "Qwen3-MoE: ranks that split each expert's MLP (must divide "
                                         "moe_intermediate_size)", ge=1)
    moe_aux_loss_coef: float | None = option(None, "Qwen3-MoE: the load-balancing loss's coefficient; null = the "
                                             "model's router_aux_loss_coef (0.001 for the released models); 0 = none",
                                             ge=0)
    optimizer_cpu_offload: bool = option(False, "keep the distributed optimizer's fp32 master weights and moments in "
                                         "host memory and step them on the CPU: 12/DP bytes a parameter off each GPU, "
                                         "16/DP on the host (needs distributed_optimizer=true)")

    @property
    def replica_size(self) -> int:
        """Ranks that hold one copy of the model: TP x PP x CP."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def is_single_process(self) -> bool:
        """Whether this layout asks for nothing beyond one process's plain training (what the hf backend does)."""
        return self == MegatronLayout()

    def data_parallel(self, world_size: int) -> int:
        return world_size // self.replica_size

    def validate(self, arch: Any = None, world_size: int | None = None,
                 processes_from: str = "torchrun --nproc-per-node") -> MegatronLayout:
        """Raise ``ValueError`` naming the key for a layout that cannot work: on its own, for this model
        (``arch``: its head, KV-head, MLP and layer counts), or over ``world_size`` processes (which the option
        ``processes_from`` sets)."""
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel",
                    "expert_tensor_parallel"):
            if getattr(self, key) < 1:
                raise ValueError(f"megatron.{key} must be >= 1; got {getattr(self, key)}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("megatron.sequence_parallel needs megatron.tensor_parallel > 1 (it splits the sequence over "
                             "the TP ranks)")
        if self.optimizer_cpu_offload and not self.distributed_optimizer:
            raise ValueError("megatron.optimizer_cpu_offload=true moves the distributed optimizer's state to the host: set "
                             "megatron.distributed_optimizer=true too")
        if self.bf16_weights and not self.distributed_optimizer:
            raise ValueError("megatron.bf16_weights=true keeps the fp32 master weights in the distributed optimizer: set "
                             "megatron.distributed_optimizer=true too (it is plain AdamW on fp32 masters at DP=1)")
        if arch is not None:
            self._check_model(arch)
        if world_size is not None and world_size % self.replica_size:
            raise ValueError(f"megatron.tensor_parallel={self.tensor_parallel} x pipeline_parallel={self.pipeline_parallel} "
                             f"x context_parallel={self.context_parallel} does not divide the {world_size} processes: "
                             f"use a multiple of {self.replica_size} ({processes_from})")
        experts = self.expert_parallel * self.expert_tensor_parallel
        if world_size is not None and (world_size // self.pipeline_parallel) % experts:
            raise ValueError(f"megatron.expert_parallel={self.expert_parallel} x expert_tensor_parallel="
                             f"{self.expert_tensor_parallel} does not divide the {world_size // self.pipeline_parallel} "
                             f"ranks of a pipeline stage ({world_size} processes / pipeline_parallel="
                             f"{self.pipeline_parallel}): the expert groups are carved from them")
        return self

    def _check_model(self, arch: Any) -> None:
        """Megatron gives each TP rank whole query heads and whole KV groups (the fused QKV weight is cut per
        group) and an equal slice of the MLP (a Qwen3-MoE's: an equal share of the experts over EP, each expert split
        over ETP), and each pipeline stage an equal run of whole layers. CP splits
        sequences, not weights: any size works (the policy pads sequences to fit it)."""
        if arch.num_attention_heads % arch.num_key_value_heads:
            raise ValueError(f"num_attention_heads={arch.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={arch.num_key_value_heads}")
        moe = getattr(arch, "is_moe", False)
        if not moe and self.expert_parallel * self.expert_tensor_parallel > 1:
            raise ValueError(f"megatron.expert_parallel={self.expert_parallel} and expert_tensor_parallel="
                             f"{self.expert_tensor_parallel} split a Qwen3-MoE's experts; this model is dense: set both "
                             "to 1")
        if not moe and self.moe_aux_loss_coef is not None:
            raise ValueError(f"megatron.moe_aux_loss_coef={self.moe_aux_loss_coef} weighs a Qwen3-MoE's load-balancing "
                             "loss; this model is dense: drop it")
        if moe and arch.num_experts % self.expert_parallel:
            raise ValueError(f"megatron.expert_parallel={self.expert_parallel} does not divide num_experts="
                             f"{arch.num_experts}: each rank holds an equal share of every layer's experts")
        if moe and arch.moe_intermediate_size % self.expert_tensor_parallel:
            raise ValueError(f"megatron.expert_tensor_parallel={self.expert_tensor_parallel} does not divide "
                             f"moe_intermediate_size={arch.moe_intermediate_size}")
        for name in ("num_attention_heads", "num_key_value_heads", *(() if moe else ("intermediate_size",))):
            if getattr(arch, name) % self.tensor_parallel:
                raise ValueError(f"megatron.tensor_parallel={self.tensor_parallel} does not divide {name}="
                                 f"{getattr(arch, name)}: choose a TP size that divides num_attention_heads, "
                                 "num_key_value_heads and intermediate_size")
        if arch.num_layers % self.pipeline_parallel:
            raise ValueError(f"megatron.pipeline_parallel={self.pipeline_parallel} does not divide num_hidden_layers="
                             f"{arch.num_layers}: choose a PP size that divides num_hidden_layers (each stage holds an "
                             "equal run of layers)")

    def check_trainable(self, arch: Any) -> None:
        """Refuse, in one line naming the key, a layout the policy cannot train this model at yet, though megatron-core
        builds it: a Qwen3-MoE trains with TP only under sequence parallelism (each TP rank routes its own part of the
        tokens) and with EP a multiple of it (docs/moe.md)."""
        if not getattr(arch, "is_moe", False):
            return
        tp, ep = self.tensor_parallel, self.expert_parallel
        if tp > 1 and not self.sequence_parallel:
            raise ValueError(f"megatron.tensor_parallel={tp} with a Qwen3-MoE needs megatron.sequence_parallel=true: each "
                             "TP rank routes its own part of the tokens (megatron-core's MoE layer, and its load-balancing "
                             "loss, count them so)")
        if tp > 1 and ep % tp:
            raise ValueError(f"megatron.tensor_parallel={tp} with megatron.expert_parallel={ep}: for now experts train "
                             "with expert_parallel a multiple of tensor_parallel (the TP ranks then hold different experts, "
                             "as tested; docs/moe.md)")

    def divides(self, arch: Any, world_size: int) -> bool:
        """Whether :meth:`validate` accepts this layout and the policy trains at it (:meth:`check_trainable`): what
        ``nemo-jq plan`` enumerates."""
        try:
            self.validate(arch, world_size)
            self.check_trainable(arch)
        except ValueError:
            return False
        return True


#: Keys of :class:`MegatronLayout` that lived in the ``model:`` section before 0.2 (read with a deprecation
#: message, naming the new key, until 0.3).
DEPRECATED_MODEL_KEYS = ("tensor_parallel", "pipeline_parallel", "context_parallel", "sequence_parallel",
                         "recompute_activations", "distributed_optimizer", "bf16_weights")
