"""``MegatronPolicy``: the ``Policy`` protocol on a megatron-core ``GPTModel``, tensor- and data-parallel.

It runs SPMD: every rank of the ``torch.distributed`` world builds the policy from the same HF
config and weights and keeps its own shard. Consecutive ranks form tensor-parallel (TP) groups,
which see the same micro-batches; the TP groups are data-parallel (DP) replicas, which see
different ones. Weights come in and exports go out in HF layout (``mapping``); checkpoints are
Megatron distributed checkpoints (``checkpoint``), which resume at any TP size.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from nemo_jq import distributed
from nemo_jq.distributed import DataParallel
from nemo_jq.models.hf import WEIGHTS_FILE, autocast_context, check_precision, export_hf_stream
from nemo_jq.models.interfaces import LossFn, TokenBatch
from nemo_jq.models.megatron import transformer_engine_usable
from nemo_jq.models.megatron.checkpoint import has_sharded_checkpoint, load_sharded, save_sharded
from nemo_jq.models.megatron.logprobs import vocab_parallel_token_logprobs
from nemo_jq.models.megatron.mapping import hf_to_megatron, is_tensor_parallel, megatron_to_hf
from nemo_jq.models.megatron.provider import (
    build_gpt_model,
    check_parallel_layout,
    padded_vocab_size,
    read_qwen3_config,
    uses_transformer_engine,
)

transformer_engine_usable()  # a broken Transformer Engine must not break the megatron.core import below
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402


class MegatronPolicy:
    """Trains Qwen3 as a megatron-core ``GPTModel``: TP-sharded, DP-replicated, AdamW on each shard.

    fp32 weights; on GPU, ``precision`` "auto"/"bf16" runs under bf16 autocast as ``HFPolicy`` does.

    Gradients are synchronised at the end of ``forward_backward``: replicated weights whose
    gradient each TP rank sees only in part (the q/k norms, which act on the rank's own heads,
    and under sequence parallelism every norm, which sees the rank's own positions) are summed
    over TP, then every gradient is summed over DP. Summing, not averaging, means a DP rank's
    ``loss_fn`` must return its share of the global loss (normalised by the global batch, as the
    trainer's is), so that the result equals ``HFPolicy`` accumulating all micro-batches.
    """

    def __init__(self, hf_config: Any, hf_state: Mapping[str, torch.Tensor], *, tensor_parallel: int = 1,
                 sequence_parallel: bool = False, recompute_activations: bool = False,
                 device: torch.device | str = "cpu", precision: str = "auto",
                 lr: float = 1e-6, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, grad_clip: float = 1.0, logprob_chunk_size: int = 256):
        self.arch = read_qwen3_config(hf_config)
        check_parallel_layout(self.arch, tensor_parallel, sequence_parallel)
        self.device = torch.device(device)
        self.precision = check_precision(precision)
        self.sequence_parallel = sequence_parallel
        self.grad_clip = grad_clip
        self.logprob_chunk_size = logprob_chunk_size
        _initialize_model_parallel(tensor_parallel)
        if self.device.type == "cuda":
            if self.device.index is None:  # the launcher has picked this rank's GPU
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            model_parallel_cuda_manual_seed(0)  # Qwen3 has no dropout; megatron's RNG tracker only has to exist
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size, self.tp_rank = tensor_parallel, parallel_state.get_tensor_model_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.data_parallel = DataParallel(parallel_state.get_data_parallel_rank(),
                                          parallel_state.get_data_parallel_world_size(), self.dp_group)
        #: The ranks holding one replica (its TP ranks): they see the same data.
        self.model_parallel_group = parallel_state.get_model_parallel_group()
        self.uses_transformer_engine = uses_transformer_engine()
        self.model = build_gpt_model(self.arch, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
                                     recompute_activations=recompute_activations,
                                     use_cpu_initialization=self.device.type == "cpu")
        self.vocab_start = self.tp_rank * padded_vocab_size(self.arch.vocab_size, tensor_parallel) // tensor_parallel
        #: The parameters whose gradient this rank adds to the norm: its TP slices, and replicated ones on rank 0 only.
        self._counted_in_norm = [param for name, param in self.model.named_parameters()
                                 if is_tensor_parallel(name) or self.tp_rank == 0]
        self._load_hf_state(hf_state)
        #: Moves whenever the weights change, so an engine sampling from a copy knows to refit.
        self.weights_version = 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    @classmethod
    def from_hf_model(cls, model: Any, **kwargs: Any) -> "MegatronPolicy":
        """From an HF ``Qwen3ForCausalLM`` (its config and weights); ``kwargs`` as for the constructor."""
        return cls(model.config, model.state_dict(), **kwargs)

    # ----------------------------------------------------------------- training
    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """``[N, L-1]`` fp32 log-probs of the target tokens (0 elsewhere), the same on every TP rank."""
        batch = batch.to(self.device)
        targets = batch.target_mask
        input_ids = batch.input_ids
        if self.sequence_parallel:  # the sequence is split evenly over the TP ranks; padding goes at the end
            input_ids = torch.nn.functional.pad(input_ids, (0, -input_ids.shape[1] % self.tp_size))
        length = input_ids.shape[1]
        positions = torch.arange(length, device=self.device).expand_as(input_ids)
        # Rows are right-padded, so the causal mask alone keeps padding out of every real token's view.
        # TE builds its own; megatron-core's local attention would build its default one on CUDA.
        causal_mask = None if self.uses_transformer_engine else (
            torch.ones(length, length, dtype=torch.bool, device=self.device).triu(1)[None, None])  # True: masked
        with autocast_context(self.device, self.precision):
            logits = self.model(input_ids, positions, causal_mask)  # [N, length, V_padded / TP]
        picked = vocab_parallel_token_logprobs(
            logits[:, : targets.shape[1]][targets], batch.input_ids[:, 1:][targets], vocab_start=self.vocab_start,
            vocab_size=self.arch.vocab_size, group=self.tp_group, chunk_size=self.logprob_chunk_size,
        )
        out = torch.zeros(targets.shape, dtype=torch.float32, device=self.device)
        return out.index_put((targets,), picked.float())

    def forward_backward(self, micro_batches: Sequence[TokenBatch], loss_fn: LossFn) -> None:
        """Accumulate gradients of ``loss_fn`` over the micro-batches, synchronised over TP and DP."""
        self.model.train()
        earlier = {param: param.grad for param in self.model.parameters()}
        self.optimizer.zero_grad(set_to_none=True)
        for index, micro in enumerate(micro_batches):
            loss_fn(self.token_logprobs(micro), index).backward()
        self._synchronise_gradients()
        for param, grad in earlier.items():  # gradients of earlier calls are synchronised already
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad.add_(grad)

    def _synchronise_gradients(self) -> None:
        params = [param for param in self.model.parameters() if param.requires_grad]
        for param in params:
            if param.grad is None:  # so every rank takes part in the same all-reduces
                param.grad = torch.zeros_like(param)
        tp_summed = [param.grad for name, param in self.model.named_parameters() if self._grad_is_partial_over_tp(name, param)]
        _all_reduce_flat(tp_summed, self.tp_group)
        _all_reduce_flat([param.grad for param in params], self.dp_group)

    def _grad_is_partial_over_tp(self, name: str, param: torch.nn.Parameter) -> bool:
        """As megatron-core's ``finalize_model_grads``: sequence-parallel norms and the q/k norms."""
        return (self.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
            "q_layernorm" in name or "k_layernorm" in name
        )

    def optimizer_step(self) -> dict[str, float]:
        """Clip to ``grad_clip`` by the norm over the whole model (as ``clip_grad_norm_``), step, zero."""
        grads = [param.grad for param in self.model.parameters() if param.grad is not None]
        grad_norm = self._grad_norm()
        clip = (self.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_version += 1
        return {"grad_norm": float(grad_norm)}

    def _grad_norm(self) -> torch.Tensor:
        """The L2 norm of the full model's gradient: shards summed over TP, replicated weights counted once."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for param in self._counted_in_norm:
            if param.grad is not None:
                squares += param.grad.float().square().sum()
        if self.tp_size > 1:
            dist.all_reduce(squares, group=self.tp_group)
        return squares.sqrt()

    # ----------------------------------------------------------------- weights
    def gather_hf(self, per_parameter: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-parameter tensors (weights, gradients, ...) of this rank's shard, gathered over TP into HF layout.

        A collective: every TP rank calls it, and each gets the full HF-named result: copies, never
        views of the live tensors, so later training steps do not change it.
        """
        return dict(self.iter_hf(per_parameter))

    def iter_hf(self, per_parameter: Mapping[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``gather_hf`` one parameter at a time (default: the weights), so at most one full tensor is held
        at once: for exports and weight refits of models that do not fit one rank. Every TP rank must
        consume it to the end, in step (each item is an all-gather)."""
        for name, tensor in (per_parameter or dict(self.model.named_parameters())).items():
            pieces = [tensor.detach().clone()]
            if self.tp_size > 1:
                pieces = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                dist.all_gather(pieces, tensor.detach().contiguous(), group=self.tp_group)
            yield from megatron_to_hf([{name: piece} for piece in pieces], self.arch).items()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights in HF layout (a collective, as ``gather_hf``)."""
        return self.gather_hf(dict(self.model.named_parameters()))

    def _load_hf_state(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        shards = hf_to_megatron(hf_state, params, self.arch, tp_size=self.tp_size, tp_rank=self.tp_rank)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(shards[name])

    def save(self, directory: Path) -> None:
        """A Megatron distributed checkpoint of the weights and AdamW state (``checkpoint.save_sharded``):
        every rank writes its own shard, and any TP size can load it."""
        save_sharded(directory, self.model, self.optimizer, self.arch)

    def load(self, directory: Path, *, with_optimizer: bool = True) -> None:
        """From ``save`` at any TP size; or, weights only, from an HF ``model.safetensors`` (``HFPolicy.save``)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if with_optimizer or has_sharded_checkpoint(directory) or not (directory / WEIGHTS_FILE).exists():
            load_sharded(directory, self.model, self.optimizer if with_optimizer else None, self.arch)
        else:
            self._load_hf_state(load_file(str(directory / WEIGHTS_FILE), device=str(self.device)))
        self.weights_version += 1

    def export(self, out_dir: Path, tokenizer: Any) -> None:
        """Stream the weights, gathered one tensor at a time, into an HF folder written by global rank 0
        (:func:`export_hf_stream`); the model is never whole in one process."""
        from transformers import Qwen3Config

        tensors = ((name, tensor.cpu()) for name, tensor in self.iter_hf())
        if distributed.is_writer():
            config = Qwen3Config.from_dict(self.arch.hf_config)
            distributed.everywhere(lambda: export_hf_stream(config, tensors, out_dir, tokenizer))
        else:
            distributed.everywhere(lambda: collections.deque(tensors, maxlen=0))


def _initialize_model_parallel(tensor_parallel: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError("MegatronPolicy needs torch.distributed initialised first (e.g. run under torchrun)")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel:
            raise ValueError(f"megatron parallel state has tensor-parallel size "
                             f"{parallel_state.get_tensor_model_parallel_world_size()}; asked for {tensor_parallel}")
        return
    if dist.get_world_size() % tensor_parallel:
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tensor_parallel={tensor_parallel}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)


def _all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` in place over ``group`` in one all-reduce of their concatenation."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, synced in zip(tensors, flat.split([tensor.numel() for tensor in tensors])):
        tensor.copy_(synced.view_as(tensor))
