"""``MegatronPolicy``: the ``Policy`` protocol on a megatron-core ``GPTModel``, tensor-, context-, pipeline- and
data-parallel.

It runs SPMD: every rank of the ``torch.distributed`` world builds the policy from the same HF
config and weights and keeps its own shard. Consecutive ranks form tensor-parallel (TP) groups;
context-parallel (CP) ranks hold the same weights and each a part of every sequence; TP x CP
groups form pipeline (PP) stages, each holding a run of the layers; together they hold one
replica and see the same micro-batches. Replicas are data-parallel (DP): they see different ones.
Weights come in and exports go out in HF layout (``mapping``); checkpoints are Megatron
distributed checkpoints (``checkpoint``), which resume at any TP, PP, CP or DP size.
A Qwen3-MoE's experts are split over the expert-parallel (EP) ranks, carved from the data-parallel ones
(``experts``: what differs for them; ``layout``: the layouts they train at so far).

One class (most of the file's 700 lines): every method works on the process groups and shards the constructor sets up; what is
particular to one feature (the log-prob kernel, checkpoints, the distributed optimizer, experts) has its module.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from nemo_jq.models.common import (
    WEIGHTS_FILE,
    SafetensorsFolder,
    autocast_context,
    autocast_dtype,
    build_optimizer,
    check_precision,
    checkpoint_state,
)
from nemo_jq.models.export import export_hf_stream
from nemo_jq.models.interfaces import LossFn, TokenBatch, backward_each
from nemo_jq.models.megatron import experts as moe  # moe.reduced: the dry run answers it where values are fake
from nemo_jq.models.megatron import transformer_engine_usable
from nemo_jq.models.megatron.checkpoint import has_sharded_checkpoint, load_sharded, save_sharded
from nemo_jq.models.megatron.context_parallel import gather_sequence, split_for_rank
from nemo_jq.models.megatron.experts import RouterLog, expert_shard
from nemo_jq.models.megatron.layout import MegatronLayout
from nemo_jq.models.megatron.logprobs import vocab_parallel_head_logprobs
from nemo_jq.models.megatron.mapping import (
    EXPERT_GATHER_BYTES,
    gather_batches,
    hf_names,
    hf_shape,
    is_expert,
    is_tensor_parallel,
    iter_hf_to_megatron,
    megatron_to_hf,
)
from nemo_jq.models.megatron.provider import (
    build_gpt_model,
    padded_vocab_size,
    read_qwen3_config,
    uses_sdpa_attention,
    uses_transformer_engine,
)
from nemo_jq.models.megatron.replay import RoutingReplay, padded_routes
from nemo_jq.models.megatron.zero import DenseAndExpertAdamW, DistributedAdamW
from nemo_jq.runtime import distributed
from nemo_jq.runtime.distributed import DataParallel

transformer_engine_usable()  # a broken Transformer Engine must not break the megatron.core import below
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.utils import get_attr_wrapped_model, get_model_config  # noqa: E402


class MegatronPolicy:
    """Trains Qwen3 as a megatron-core ``GPTModel``: TP-sharded, CP-split, PP-staged, DP-replicated, AdamW on each shard.

    fp32 weights; on GPU, ``precision`` "auto"/"bf16" runs under bf16 autocast as ``HFPolicy`` does.
    With ``bf16_weights`` (Megatron's usual mixed precision) the parameters and activations are bf16,
    each micro-batch's gradient is added into the distributed optimizer's fp32 buffer (``main_grad``) as soon as
    backward produces it
    (so accumulation over micro-batches and the DP reduction are fp32), and AdamW steps the fp32 master
    weights that the distributed optimizer keeps, rounding them into the parameters after each step.

    Gradients are synchronised at the end of ``forward_backward``: replicated weights whose
    gradient each TP rank sees only in part (the q/k norms, which act on the rank's own heads,
    and under sequence parallelism every norm, which sees the rank's own positions) are summed
    over TP, a tied embedding's gradient is summed with its LM-head copy on the last pipeline stage,
    then every gradient is summed over DP and CP. Summing, not averaging, means a DP rank's
    ``loss_fn`` must return its share of the global loss (normalised by the global batch, as the
    trainer's is), so that the result equals ``HFPolicy`` accumulating all micro-batches.

    With ``pipeline_parallel > 1`` micro-batches run through megatron-core's 1F1B schedule and
    ``loss_fn`` runs on the last stage; ``token_logprobs`` is broadcast from it to every stage.

    With ``context_parallel > 1`` each CP rank runs its load-balanced part of every sequence
    (``context_parallel``) through the model, and attention exchanges keys and values over CP
    (Transformer Engine's attention: GPU only). Each rank scores the targets at its positions;
    the log-probs are gathered over CP before ``loss_fn``, which sees whole sequences on every CP rank.
    """

    def __init__(self, hf_config: Any, hf_state: Mapping[str, torch.Tensor], *, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, sequence_parallel: bool = False, context_parallel: int = 1,
                 recompute_activations: bool = False,
                 distributed_optimizer: bool = False, bf16_weights: bool = False, expert_parallel: int = 1,
                 expert_tensor_parallel: int = 1, moe_aux_loss_coef: float | None = None,
                 optimizer_cpu_offload: bool = False, device: torch.device | str = "cpu",
                 precision: str = "auto",
                 lr: float = 1e-6, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, grad_clip: float = 1.0, logprob_chunk_size: int = 256):
        self.arch = read_qwen3_config(hf_config)
        if self.arch.is_moe and moe_aux_loss_coef is not None:
            self.arch = dataclasses.replace(self.arch, router_aux_loss_coef=moe_aux_loss_coef)
        self.layout = MegatronLayout(tensor_parallel, pipeline_parallel, context_parallel, sequence_parallel,
                                     recompute_activations, distributed_optimizer, bf16_weights, expert_parallel,
                                     expert_tensor_parallel, moe_aux_loss_coef, optimizer_cpu_offload)
        self.layout.check_trainable(self.arch)
        if not dist.is_initialized():
            raise RuntimeError("MegatronPolicy needs torch.distributed initialised first (e.g. run under torchrun)")
        self.layout.validate(self.arch, dist.get_world_size())
        self.device = torch.device(device)
        self.precision = check_precision(precision)
        self.bf16_weights = bf16_weights
        self.sequence_parallel = sequence_parallel
        self.grad_clip = grad_clip
        self.logprob_chunk_size = logprob_chunk_size
        _initialize_model_parallel(tensor_parallel, pipeline_parallel, context_parallel, expert_parallel,
                                   expert_tensor_parallel)
        if self.device.type == "cuda":
            if self.device.index is None:  # the launcher has picked this rank's GPU
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            model_parallel_cuda_manual_seed(0)  # Qwen3 has no dropout; megatron's RNG tracker only has to exist
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size, self.tp_rank = tensor_parallel, parallel_state.get_tensor_model_parallel_rank()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size, self.pp_rank = pipeline_parallel, parallel_state.get_pipeline_model_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size, self.cp_rank = context_parallel, parallel_state.get_context_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.data_parallel = DataParallel(parallel_state.get_data_parallel_rank(),
                                          parallel_state.get_data_parallel_world_size(), self.dp_group)
        #: The ranks whose gradients of the same weights are summed: the replicas', and each replica's CP ranks'
        #: (each CP rank's gradient comes from its own positions of the sequences).
        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        #: A Qwen3-MoE's experts on this rank (experts.py), the ranks holding the others, and those holding the same.
        self.experts = expert_shard(self.arch)
        #: The ranks that split the experts (EP x expert-TP): the dispatcher exchanges tokens among them.
        self.ep_group = parallel_state.get_expert_tensor_and_model_parallel_group() if self.arch.is_moe else None
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group() if self.arch.is_moe else None
        #: The ranks holding one replica's experts, each other ones (EP x PP): where an expert's gradient counts in the norm.
        self.expert_shards_group = (parallel_state.get_expert_tensor_model_pipeline_parallel_group()
                                    if self.arch.is_moe else None)
        #: The ranks of one replica's TP ranks of every stage: each holds a different part of the weights.
        self._weight_shards_group = parallel_state.get_model_parallel_group()
        #: The ranks holding one replica (its TP and CP ranks of every stage): they see the same data.
        self.model_parallel_group = _replica_group(tensor_parallel, context_parallel, pipeline_parallel)
        #: Sequences are padded at the end to a multiple of this: 2 x CP chunks, each split over TP under SP.
        self.sequence_multiple = (2 * context_parallel if context_parallel > 1 else 1) * (
            tensor_parallel if sequence_parallel else 1)
        self.uses_transformer_engine = uses_transformer_engine()
        self.uses_sdpa_attention = uses_sdpa_attention(use_cpu_initialization=self.device.type == "cpu")
        params_dtype = torch.bfloat16 if bf16_weights else torch.float32
        self.model = build_gpt_model(self.arch, self.layout, params_dtype=params_dtype,
                                     activation_dtype=autocast_dtype(self.device, self.precision) or params_dtype,
                                     use_cpu_initialization=self.device.type == "cpu")
        self.model.to(device=self.device, dtype=params_dtype)  # every module on this rank's device, as Megatron-LM's get_model
        self.vocab_start = self.tp_rank * padded_vocab_size(self.arch.vocab_size, tensor_parallel) // tensor_parallel
        #: Megatron numbers a stage's layers from 0; HF names them by their index in the whole model.
        self._layer_offset = self.model.decoder.layers[0].layer_number - 1
        #: A tied model's last stage (when not also the first) holds a copy of the embedding as its LM head.
        self._tied_copy = self.model.shared_embedding_or_output_weight() if (
            self.arch.tie_word_embeddings and self.pp_size > 1 and self.model.post_process) else None
        #: The parameters whose gradient this rank adds to the norm: its TP slices, and replicated ones on TP rank 0
        #: only; a tied embedding once, on the first stage.
        self._counted_in_norm = [param for name, param in self.model.named_parameters()
                                 if (is_tensor_parallel(name) or self.tp_rank == 0) and param is not self._tied_copy
                                 and not is_expert(name)]
        #: A Qwen3-MoE's experts here: their gradients are summed over the expert-DP ranks, counted in the norm over EP.
        self._expert_params = {param for name, param in self.model.named_parameters() if is_expert(name)}
        #: Every stage's parameters, by global name, so that loading can name HF weights that no stage uses.
        self._all_names = [name for stage in self._gather_over_stages(
            [self._global_name(name) for name, _ in self.model.named_parameters()]) for name in stage]
        self._load_hf_state(hf_state)
        #: A Qwen3-MoE's routers replay the routes a batch carries (replay.py).
        self.routing_replay = RoutingReplay(self.model, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                            sequence_parallel=sequence_parallel,
                                            layer_offset=self._layer_offset, cp_rank=self.cp_rank,
                                            cp_size=self.cp_size) if self.arch.is_moe else None
        #: Moves whenever the weights change, so an engine sampling from a copy knows to refit.
        self.weights_version = 0
        #: Whether gradients of an earlier ``forward_backward`` (synchronised already) wait for the step.
        self._accumulated = False
        adamw = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        if distributed_optimizer:
            adamw["offload"] = optimizer_cpu_offload
            counted = {id(param) for param in self._counted_in_norm}
            params = [param for param in self.model.parameters() if param not in self._expert_params]
            self.optimizer = DistributedAdamW(params, self.dp_cp_group, counted_in_norm=[id(p) in counted for p in params], **adamw)
            if self._expert_params:  # reduced over the ranks holding the same experts, each counted once in the norm
                experts = [param for param in self.model.parameters() if param in self._expert_params]
                self.optimizer = DenseAndExpertAdamW(self.optimizer, DistributedAdamW(
                    experts, self.expert_dp_group, counted_in_norm=[True] * len(experts), **adamw),
                    self.expert_shards_group)
        else:  # torch's kernels as a GPU picks them, on the dry run's stand-in too (build_optimizer)
            self.optimizer = build_optimizer(self.model.parameters(), **adamw)

    @property
    def gathers_over_replicas(self) -> bool:
        """Whether gathering the weights (``iter_hf``) is a collective over every replica, not only this one's ranks:
        a Qwen3-MoE's experts come from the expert-parallel ranks, carved from the replicas."""
        return self.ep_group is not None and dist.get_world_size(self.ep_group) > 1

    @property
    def _zero(self) -> bool:
        """Whether the optimizer is the distributed one (each parameter's gradient in its ``main_grad`` buffer)."""
        return isinstance(self.optimizer, (DistributedAdamW, DenseAndExpertAdamW))

    @classmethod
    def from_hf_model(cls, model: Any, **kwargs: Any) -> "MegatronPolicy":
        """From an HF ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` (its config and weights, a Qwen3-MoE's experts
        one tensor each, as its checkpoint stores them); ``kwargs`` as for the constructor."""
        return cls(model.config, checkpoint_state(model.state_dict()), **kwargs)

    @classmethod
    def from_hf_folder(cls, folder: Path, **kwargs: Any) -> "MegatronPolicy":
        """From an HF folder (``config.json`` and safetensors weights, sharded or not), each rank reading one
        tensor at a time and keeping only its own shard: the model is never whole in one process."""
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(folder), SafetensorsFolder(folder), **kwargs)

    # ----------------------------------------------------------------- training
    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """``[N, L-1]`` fp32 log-probs of the target tokens (0 elsewhere), the same on every TP rank and stage."""
        batch = batch.to(self.device)
        if self.pp_size > 1:
            out = torch.empty(batch.target_mask.shape, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for logprobs in self._run_pipeline([batch]):  # on the last stage only
                    out.copy_(logprobs)
            dist.broadcast(out, parallel_state.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
            return out
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            return self._token_logprobs_alike_over_ep(batch)
        padding = (0, -batch.input_ids.shape[1] % self.sequence_multiple)
        input_ids = torch.nn.functional.pad(batch.input_ids, padding)
        # a Qwen3-MoE's routers leave the padding out of the load-balancing loss, and replay the engine's routes
        real = torch.nn.functional.pad(batch.attention_mask, padding).bool() if self.arch.is_moe else None
        routes = padded_routes(batch.routes, *input_ids.shape)
        return self._logprobs(self._forward(input_ids, real, routes), batch)

    def token_logprobs_each(self, batches: Sequence[TokenBatch]) -> list[torch.Tensor]:
        """No-grad :meth:`token_logprobs` of each batch (``models.interfaces.token_logprobs_each``): under pipeline
        parallelism all of them in one run of the schedule (:meth:`_run_pipeline`, which pads them as the training
        pass pads its micro-batches), so the stages work at once (one batch at a time through P stages leaves P - 1 of
        them idle: P times as long)."""
        with torch.no_grad():
            if self.pp_size == 1:
                return [self.token_logprobs(batch) for batch in batches]
            batches = [batch.to(self.device) for batch in batches]
            scored = self._run_pipeline(batches)  # on the last stage only
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        out = [scored[index].contiguous() if self.model.post_process else
               torch.empty(batch.target_mask.shape, dtype=torch.float32, device=self.device)
               for index, batch in enumerate(batches)]
        for logprobs in out:
            dist.broadcast(logprobs, last, group=self.pp_group)
        return out

    def _token_logprobs_alike_over_ep(self, batch: TokenBatch) -> torch.Tensor:
        """``token_logprobs`` where the expert-parallel ranks each run their own rows: megatron-core's all-gather
        dispatcher exchanges equal token counts, so every EP rank pads its rows to the group's most rows and longest
        sequence (padding takes no part in routing's loss and scores nothing), and the log-probs are cut back."""
        rows, length = moe.reduced([batch.num_rows, batch.input_ids.shape[1]], self.ep_group, dist.ReduceOp.MAX, self.device)
        padded = _right_padded(batch, rows, length + -length % self.sequence_multiple)
        real = padded.attention_mask.bool()
        logprobs = self._logprobs(self._forward(padded.input_ids, real, padded.routes), padded)
        return logprobs[: batch.num_rows, : batch.target_mask.shape[1]]

    def _forward(self, input_ids: torch.Tensor, real: torch.Tensor | None = None,
                 routes: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's hidden states ``[L / CP (/ TP under SP), N, H]`` for whole rows ``[N, L]`` (``L`` a multiple
        of ``sequence_multiple``), of this CP rank's positions: the last stage's after the final norm, without the
        LM head, which ``_logprobs`` applies a chunk of positions at a time. ``real``: a Qwen3-MoE's real (not padding)
        positions ``[N, L]``, for its routers; ``routes``: the engine's routes to replay ``[N, L, layers, k]``."""
        if self.routing_replay is not None:
            self.routing_replay.load(routes)
        length = input_ids.shape[1]
        positions = self._on_this_cp_rank(torch.arange(length, device=self.device).expand_as(input_ids))
        # Rows are right-padded, so the causal mask alone keeps padding out of every real token's view.
        # TE builds its own (under CP, over the split sequence), and SDPA's kernels are causal without one;
        # megatron-core's local attention would build its default one on CUDA.
        causal_mask = None if self.uses_transformer_engine or self.uses_sdpa_attention or self.cp_size > 1 else (
            torch.ones(length, length, dtype=torch.bool, device=self.device).triu(1)[None, None])  # True: masked
        # megatron-core 0.16.1's padding_mask is True at the padding, whatever its docstring says, and of the CP rank's
        # positions; under sequence parallelism its first stage splits it over TP (GPTModel._preprocess), the later
        # stages take it as given
        padding = None if real is None else self._on_this_cp_rank(~real)
        if padding is not None and self.sequence_parallel and not self.model.pre_process:
            padding = padding.chunk(self.tp_size, dim=1)[self.tp_rank]
        with autocast_context(self.device, self.precision), _without_lm_head(self.model):
            return self.model(self._on_this_cp_rank(input_ids), positions, causal_mask,
                              **({} if padding is None else {"padding_mask": padding}))

    def _on_this_cp_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """This CP rank's positions of ``[N, L]`` rows: chunks r and 2CP-1-r of 2CP (``context_parallel``)."""
        return split_for_rank(tensor, self.cp_rank, self.cp_size)

    def _logprobs(self, hidden: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """``token_logprobs`` of ``batch``'s rows from the last stage's hidden states of this CP rank's positions
        (``_forward``; their padded length may run past the batch's), gathered over CP: each rank scores the
        targets at its own positions. The LM head projects ``logprob_chunk_size`` positions at a time
        (``vocab_parallel_head_logprobs``): no logits of all positions are ever formed."""
        # As megatron-core's ColumnParallelLinear does with the LM head's input: under SP gather the positions over
        # TP (backward: reduce-scatter), else pass them as they are (backward: sum the vocabulary slices' parts).
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        length = hidden.shape[0] * self.cp_size
        padding = (0, length - batch.target_mask.shape[1])
        targets = self._on_this_cp_rank(torch.nn.functional.pad(batch.target_mask, padding))
        target_ids = self._on_this_cp_rank(torch.nn.functional.pad(batch.input_ids[:, 1:], padding))
        selected = hidden.transpose(0, 1)[targets]
        if not self.sequence_parallel:  # on the selected rows, whose gradient is contiguous: megatron-core's
            # backward all-reduce of a non-contiguous one (a transpose's) reduces a copy and returns it unreduced
            selected = copy_to_tensor_model_parallel_region(selected, group=self.tp_group)
        with autocast_context(self.device, self.precision):  # the products as the LM head's linear would run them
            picked = vocab_parallel_head_logprobs(
                selected, self._lm_head_weight(), target_ids[targets], vocab_start=self.vocab_start,
                vocab_size=self.arch.vocab_size, group=self.tp_group, chunk_size=self.logprob_chunk_size,
            )
        mine = torch.zeros(targets.shape, dtype=torch.float32, device=self.device).index_put((targets,), picked.float())
        return gather_sequence(mine, self.cp_group)[:, : batch.target_mask.shape[1]]

    def _lm_head_weight(self) -> torch.nn.Parameter:
        """This rank's ``[V_padded / TP, H]`` rows of the LM head: the embedding's where they are tied (on the last
        stage of several, its copy of it), as ``GPTModel`` passes the output layer."""
        if self.model.share_embeddings_and_output_weights:
            return self.model.shared_embedding_or_output_weight()
        return self.model.output_layer.weight

    def forward_backward(self, micro_batches: Sequence[TokenBatch], loss_fn: LossFn) -> list[dict[str, Any]]:
        """Accumulate gradients of ``loss_fn`` over the micro-batches, synchronised over TP, PP, CP and DP (the
        distributed optimizer sums over DP at its step); a second call before the step adds to the first's. The
        metrics of each, from the last stage (where ``loss_fn`` runs), on every stage."""
        self.model.train()
        log = RouterLog(micro_batches, self.dp_group, self.device, self.routing_replay,
                        self.arch.num_layers) if self.arch.is_moe else None
        earlier = {}
        if self._accumulated:  # what the sums below would count twice: set it aside, add it back after them
            earlier = {param: self._grad_of(param).clone() for param in self._synchronised_params()}
            for param in earlier:
                self._grad_of(param).zero_()
        if self.pp_size > 1:
            metrics = self._run_pipeline([micro.to(self.device) for micro in micro_batches], loss_fn, log)
            # the last stage's metrics (the dry run's broadcast, which carries no values, leaves the others' empty ones)
            box = [metrics if self.model.post_process else [{} for _ in micro_batches]]
            dist.broadcast_object_list(box, parallel_state.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
            metrics = box[0]
        else:
            metrics = backward_each(self, micro_batches, loss_fn, before_each=log.enter if log else None)
        if log is not None:  # what the routers logged, each micro-batch's over the stages and the TP and CP ranks
            tp_cp = parallel_state.get_tensor_and_context_parallel_group()
            metrics = [{**micro, **logged} for micro, logged in zip(metrics, log.metrics((tp_cp, self.pp_group)))]
        self._synchronise_gradients()
        for param, grad in earlier.items():
            self._grad_of(param).add_(grad)
        self._accumulated = True
        return metrics

    def _run_pipeline(self, micro_batches: Sequence[TokenBatch], loss_fn: LossFn | None = None,
                      log: RouterLog | None = None) -> list[Any]:
        """Megatron-core's 1F1B schedule over the micro-batches: backward of ``loss_fn`` of each one's log-probs,
        returning its metrics, or with ``loss_fn=None`` forward only, returning the log-probs (on the last stage;
        ``[]`` elsewhere).

        Every micro-batch is right-padded to the most rows and to its own length (a multiple of
        ``sequence_multiple``): where the lengths differ (row chunks of like length, :func:`~nemo_jq.recipe.learn.
        chunks_by_length`), the stages send each activation's shape before it (megatron-core's
        ``variable_seq_lengths``), so a short chunk is not computed at the longest one's length on every stage; a
        Qwen3-MoE's EP ranks pad each micro-batch alike (the dispatcher exchanges equal token counts). A micro-batch's
        backward runs after later ones' forwards: as it begins, ``log`` enters it again and its routes are loaded
        again, for its recomputed layers to replay.
        """
        rows = max(micro.num_rows for micro in micro_batches)
        lengths = [micro.input_ids.shape[1] for micro in micro_batches]
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            rows, *lengths = moe.reduced([rows, *lengths], self.ep_group, dist.ReduceOp.MAX, self.device)
        lengths = [length + -length % self.sequence_multiple for length in lengths]
        get_model_config(self.model).variable_seq_lengths = len(set(lengths)) > 1  # read by each run of the schedule

        def backward_begins(index: int, routes: torch.Tensor | None) -> None:
            log.enter(index)
            self.routing_replay.load(routes)

        def forward_step(data: Iterator[tuple[int, TokenBatch]], model: Any) -> tuple[torch.Tensor, Any]:
            index, micro = next(data)
            padded = _right_padded(micro, rows, lengths[index])
            if log is not None:
                log.enter(index)
            real = padded.attention_mask.bool() if self.arch.is_moe else None
            hidden = self._forward(padded.input_ids, real, padded.routes)
            if log is not None and hidden.requires_grad:  # fires before any of this stage's backward of the micro-batch
                hidden.register_hook(lambda grad: backward_begins(index, padded.routes))

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
                logprobs = self._logprobs(logits, padded)[: micro.num_rows, : micro.input_ids.shape[1] - 1]
                if loss_fn is None:
                    return logprobs.new_zeros(()), logprobs
                # The schedule averages the micro-batches' losses and multiplies by CP (for Megatron's DDP, which
                # averages gradients over DP x CP); the protocol sums them, and so do our gradient reductions.
                loss, metrics = loss_fn(logprobs, index)
                return loss * len(micro_batches) / self.cp_size, metrics

            return hidden, loss_func

        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(enumerate(micro_batches)), model=self.model,
                num_microbatches=len(micro_batches), seq_length=max(lengths), micro_batch_size=rows,
                forward_only=loss_fn is None,
            )
        finally:  # the schedule leaves the last received activation (and its gradient) set on the model
            get_attr_wrapped_model(self.model, "set_input_tensor")(None)

    def _grad_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The gradient accumulated for ``param``: its view of the distributed optimizer's fp32 buffer, or its
        ``grad`` (made zeros if it has none yet, so every rank joins the same all-reduces)."""
        if self._zero:
            return param.main_grad
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    def _tied_embedding(self) -> torch.nn.Parameter | None:
        """This rank's copy of a tied embedding whose gradient is summed with the other stage's, if it holds one."""
        if self.arch.tie_word_embeddings and self.pp_size > 1 and parallel_state.is_rank_in_embedding_group():
            return self.model.shared_embedding_or_output_weight()
        return None

    def _synchronised_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients ``_synchronise_gradients`` sums over other ranks."""
        if not self._zero:
            return [param for param in self.model.parameters() if param.requires_grad]
        partial = [param for name, param in self.model.named_parameters() if self._grad_is_partial_over_tp(name, param)]
        return partial + ([self._tied_embedding()] if self._tied_embedding() is not None else [])

    def _synchronise_gradients(self) -> None:
        tp_summed = [self._grad_of(param) for name, param in self.model.named_parameters() if self._grad_is_partial_over_tp(name, param)]
        _all_reduce_flat(tp_summed, self.tp_group)
        if self._tied_embedding() is not None:  # the embedding (first stage) and its LM-head copy (last stage): one weight
            _all_reduce_flat([self._grad_of(self._tied_embedding())], parallel_state.get_embedding_group())
        if not self._zero:  # the distributed optimizer reduce-scatters them at its step instead
            trained = [param for param in self.model.parameters() if param.requires_grad]
            _all_reduce_flat([self._grad_of(param) for param in trained if param not in self._expert_params],
                             self.dp_cp_group)
            if self._expert_params:  # each expert's gradient holds its EP group's tokens: summed over the groups
                _all_reduce_flat([self._grad_of(param) for param in trained if param in self._expert_params],
                                 self.expert_dp_group)

    def _grad_is_partial_over_tp(self, name: str, param: torch.nn.Parameter) -> bool:
        """As megatron-core's ``finalize_model_grads``: sequence-parallel norms and the q/k norms."""
        return (self.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
            "q_layernorm" in name or "k_layernorm" in name
        )

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> dict[str, float]:
        """Clip to ``grad_clip`` by the norm over the whole model (as ``clip_grad_norm_``), step, zero; then let go of
        megatron-core's gather buffer (sequence parallelism's gathered layer input, ``[S, B, H]``: 0.16 GiB at 8B),
        which it keeps for the next forward and which would otherwise sit beside the refit and the rollouts (a vLLM
        engine takes the freed blocks back: ``torch.cuda.empty_cache`` before it wakes)."""
        self._accumulated = False
        if self._zero:
            grad_norm = self.optimizer.step(self.grad_clip, self._weight_shards_group if self.tp_size * self.pp_size > 1 else None)
        else:
            grads = [param.grad for param in self.model.parameters() if param.grad is not None]
            grad_norm = self._grad_norm()
            clip = (self.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0)
            for grad in grads:
                grad.mul_(clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        parallel_state.get_global_memory_buffer().buffer.clear()
        self.weights_version += 1
        return {"grad_norm": float(grad_norm)}

    def _grad_norm(self) -> torch.Tensor:
        """The L2 norm of the full model's gradient: shards summed over TP and PP, replicated weights counted once."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for param in self._counted_in_norm:
            if param.grad is not None:
                squares += param.grad.float().square().sum()
        if self.tp_size * self.pp_size > 1:
            dist.all_reduce(squares, group=self._weight_shards_group)
        if self._expert_params:  # each expert on its own EP rank and stage
            experts = sum((param.grad.float().square().sum() for param in self._expert_params if param.grad is not None),
                          torch.zeros((), dtype=torch.float32, device=self.device))
            dist.all_reduce(experts, group=self.expert_shards_group)
            squares = squares + experts
        return squares.sqrt()

    # ----------------------------------------------------------------- weights
    def gather_hf(self, per_parameter: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-parameter tensors (weights, gradients, ...) of this rank's shard, gathered over TP and PP into HF layout.

        A collective: every rank of the replica calls it, and each gets the full HF-named result: copies, never
        views of the live tensors, so later training steps do not change it.
        """
        return dict(self.iter_hf(per_parameter))

    def iter_hf(self, per_parameter: Mapping[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``gather_hf`` a batch at a time (default: the weights), so at most one batch of full tensors is held at
        once: for exports and weight refits of models that do not fit one rank. Every rank of the replica must consume
        it to the end, in step: each batch is one all-gather (a parameter's slices over TP; a run of one layer's
        experts over EP, :data:`EXPERT_GATHER_BYTES` at most, ``mapping.gather_batches``), then, under PP, one
        broadcast from its stage."""
        per_parameter = {self._global_name(name): tensor for name, tensor in
                         (per_parameter or dict(self.model.named_parameters())).items()
                         if self._tied_copy is None or name != "output_layer.weight"}  # HF has no tied head
        ranks = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
        stages = self._gather_over_stages([(name, tensor.dtype, tensor.numel()) for name, tensor in per_parameter.items()])
        for stage, entries in enumerate(stages):
            dtypes = {name: dtype for name, dtype, _ in entries}
            for batch in gather_batches(entries, ranks, EXPERT_GATHER_BYTES):
                tensors = self._gathered(batch, per_parameter) if stage == self.pp_rank else None
                if self.pp_size > 1:
                    tensors = self._broadcast_from(stage, batch, dtypes[batch[0]], tensors)
                yield from tensors
                del tensors  # not held while the next batch is gathered (a third batch's bytes at the refit's peak)

    def _gathered(self, batch: list[str], per_parameter: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """One batch's HF tensors, in one all-gather: a parameter's slice from each TP rank, or experts from each EP
        rank (each expert-TP slice; fresh tensors, never views of ``per_parameter``'s)."""
        tensors = [per_parameter[name].detach() for name in batch]
        experts = self.arch.is_moe and is_expert(batch[0])
        group = self.ep_group if experts else self.tp_group
        flat = [tensor.reshape(-1) for tensor in tensors]
        mine = flat[0].contiguous() if len(flat) == 1 else torch.cat(flat)  # a lone tensor: no copy to gather it
        if dist.get_world_size(group) > 1:
            pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, mine, group=group)
        else:
            pieces = [mine.clone() if len(flat) == 1 else mine]
        # an expert group's rank e x expert-TP + t holds slice t of EP rank e's experts
        offsets = [self.experts.all_offsets[rank // self.experts.etp_size] for rank in range(len(pieces))] if experts else None
        per_rank = [piece.split([tensor.numel() for tensor in tensors]) for piece in pieces]
        return [item for index, (name, tensor) in enumerate(zip(batch, tensors))
                for item in megatron_to_hf([{name: parts[index].view(tensor.shape)} for parts in per_rank], self.arch,
                                           expert_offsets=offsets).items()]

    def _broadcast_from(self, stage: int, batch: list[str], dtype: torch.dtype,
                        tensors: list[tuple[str, torch.Tensor]] | None) -> list[tuple[str, torch.Tensor]]:
        """A batch's HF tensors (``tensors``, on its own stage) on every stage: a batch of experts in one broadcast over
        PP, any other tensor in its own (a copy of a whole batch would cost more than its few broadcasts)."""
        source = dist.get_global_rank(self.pp_group, stage)
        experts = self.arch.is_moe and is_expert(batch[0])
        if tensors is not None:
            names, shapes = [name for name, _ in tensors], [tensor.shape for _, tensor in tensors]
        else:
            offsets = self.experts.all_offsets if experts else (0,)
            names = [name for megatron_name in batch for offset in offsets for name in hf_names(megatron_name, offset)]
            shapes = [torch.Size(hf_shape(name, self.arch)) for name in names]
        if not experts:
            received = [tensor.contiguous() for _, tensor in tensors] if tensors is not None else [
                torch.empty(shape, dtype=dtype, device=self.device) for shape in shapes]
            for tensor in received:
                dist.broadcast(tensor, source, group=self.pp_group)
            return list(zip(names, received))
        flat = torch.cat([tensor.reshape(-1) for _, tensor in tensors]) if tensors is not None else torch.empty(
            sum(shape.numel() for shape in shapes), dtype=dtype, device=self.device)
        dist.broadcast(flat, source, group=self.pp_group)
        return [(name, part.view(shape)) for name, shape, part in zip(names, shapes, flat.split([s.numel() for s in shapes]))]

    def _global_name(self, name: str) -> str:
        """A parameter's name with its layer numbered in the whole model, as the mapping expects."""
        return re.sub(r"^decoder\.layers\.(\d+)\.", lambda match: f"decoder.layers.{int(match[1]) + self._layer_offset}.", name)

    def _gather_over_stages(self, value: Any) -> list[Any]:
        """Every pipeline stage's ``value`` (small picklable metadata), by stage."""
        if self.pp_size == 1:
            return [value]
        values = [None] * self.pp_size
        dist.all_gather_object(values, value, group=self.pp_group)
        return values

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights in HF layout (a collective, as ``gather_hf``)."""
        return self.gather_hf(dict(self.model.named_parameters()))

    def _load_hf_state(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's shard of each weight in as it is read (one HF tensor alive at a time)."""
        params = {self._global_name(name): param for name, param in self.model.named_parameters()}
        with torch.no_grad():
            for name, shard in iter_hf_to_megatron(hf_state, params, self.arch, tp_size=self.tp_size, tp_rank=self.tp_rank,
                                                   all_names=self._all_names, experts=self.experts):
                params[name].copy_(shard)

    def save(self, directory: Path) -> None:
        """A Megatron distributed checkpoint of the weights and AdamW state (``checkpoint.save_sharded``):
        every rank writes its own shard, and any TP size can load it."""
        replicated = self.optimizer.replicated() if self._zero else self.optimizer
        save_sharded(directory, self.model, replicated, self.arch)

    def load(self, directory: Path, *, with_optimizer: bool = True) -> None:
        """From ``save`` at any TP size; or, weights only, from an HF ``model.safetensors`` (``HFPolicy.save``)."""
        directory = Path(directory)
        if with_optimizer or has_sharded_checkpoint(directory) or not (directory / WEIGHTS_FILE).exists():
            load_sharded(directory, self.model, self.optimizer if with_optimizer else None, self.arch)
        else:
            self._load_hf_state(SafetensorsFolder(directory))
        if self._zero and not with_optimizer:
            self.optimizer.load_shard(None)  # its master weights from the weights just loaded
        self.weights_version += 1

    def export(self, out_dir: Path, tokenizer: Any) -> None:
        """Stream the weights, gathered one tensor at a time, into an HF folder written by global rank 0
        (:func:`export_hf_stream`); the model is never whole in one process."""
        from transformers import AutoConfig

        # Only the writer's TP and PP ranks gather (all of them must take part): other replicas, and the writer's
        # other CP ranks, hold the same weights; a Qwen3-MoE's experts are gathered over EP, from other replicas too.
        writes = (self.data_parallel.rank == 0 and self.cp_rank == 0) or self.gathers_over_replicas
        tensors = ((name, tensor.cpu()) for name, tensor in self.iter_hf()) if writes else iter(())
        if distributed.is_writer():
            settings = dict(self.arch.hf_config)
            config = AutoConfig.for_model(settings.pop("model_type", "qwen3"), **settings)
            distributed.everywhere(lambda: export_hf_stream(config, tensors, out_dir, tokenizer))
        else:
            distributed.everywhere(lambda: collections.deque(tensors, maxlen=0))


def _initialize_model_parallel(tensor_parallel: int, pipeline_parallel: int, context_parallel: int,
                               expert_parallel: int = 1, expert_tensor_parallel: int = 1) -> None:
    asked = (tensor_parallel, pipeline_parallel, context_parallel, expert_parallel, expert_tensor_parallel)
    if parallel_state.model_parallel_is_initialized():
        sizes = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_context_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size(),
                 parallel_state.get_expert_tensor_parallel_world_size())
        if expert_parallel * expert_tensor_parallel == 1:  # a dense model has no experts to place
            sizes, asked = sizes[:3], asked[:3]
        if sizes != asked:
            raise ValueError(f"megatron parallel state has tensor-, pipeline-, context-, expert- and expert-tensor-"
                             f"parallel sizes {sizes}; asked for {asked}")
        return
    timeout = distributed.collective_timeout()
    # no gloo twins of every group (megatron-core's default): nothing here uses them, and across nodes each is a
    # socket that must find the right network interface (issue 43's N4); the dry run builds the same groups
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             pipeline_model_parallel_size=pipeline_parallel,
                                             context_parallel_size=context_parallel,
                                             expert_model_parallel_size=expert_parallel,
                                             expert_tensor_parallel_size=expert_tensor_parallel,
                                             create_gloo_process_groups=False,
                                             **({"distributed_timeout_minutes": timeout / timedelta(minutes=1)}
                                                if timeout is not None else {}))


def _replica_group(tensor_parallel: int, context_parallel: int, pipeline_parallel: int) -> dist.ProcessGroup:
    """The group of this rank's replica: its TP, CP and PP ranks (megatron-core's model-parallel group has no CP).

    Every rank creates every replica's group, as ``torch.distributed.new_group`` requires, with the ranks
    megatron-core's default order (``tp-cp-ep-dp-pp``) assigns them, so the group's first ranks are the
    first stage's TP ranks of CP rank 0.
    """
    if context_parallel == 1:
        return parallel_state.get_model_parallel_group()
    data_parallel = dist.get_world_size() // (tensor_parallel * context_parallel * pipeline_parallel)
    ranks = parallel_state.RankGenerator(tp=tensor_parallel, ep=1, dp=data_parallel, pp=pipeline_parallel,
                                         cp=context_parallel, order="tp-cp-ep-dp-pp").get_ranks("tp-cp-pp")
    groups = {tuple(replica): dist.new_group(replica, timeout=distributed.collective_timeout()) for replica in ranks}
    return next(group for replica, group in groups.items() if dist.get_rank() in replica)


@contextlib.contextmanager
def _without_lm_head(model: Any) -> Iterator[None]:
    """Inside, ``model`` (a ``GPTModel``) returns its final hidden states ``[s, b, H]`` on the last stage too: with
    ``post_process`` off, megatron-core's ``GPTModel._postprocess`` returns them before the output layer, as it does
    on the earlier stages; the decoder keeps its final norm, which its own ``post_process`` (set when built) says."""
    post_process, model.post_process = model.post_process, False
    try:
        yield
    finally:
        model.post_process = post_process


def _right_padded(batch: TokenBatch, rows: int, length: int) -> TokenBatch:
    """``batch`` padded with zeros (no tokens, no targets) to ``rows`` rows of ``length`` tokens."""
    def pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1], 0, rows - tensor.shape[0]))

    return TokenBatch(pad(batch.input_ids, length), pad(batch.attention_mask, length),
                      pad(batch.rationale_mask, length - 1), pad(batch.answer_mask, length - 1),
                      routes=padded_routes(batch.routes, rows, length))


def _all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` in place over ``group`` in one all-reduce of their concatenation."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, synced in zip(tensors, flat.split([tensor.numel() for tensor in tensors])):
        tensor.copy_(synced.view_as(tensor))
