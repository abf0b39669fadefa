"""AdamW with its fp32 master weights and moments split over the data-parallel ranks (ZeRO stage 1).

Laid out as megatron-core's ``_ParamAndGradBuffer`` and distributed optimizer: every parameter's gradient
accumulates, micro-batch after micro-batch, into ``param.main_grad``, a view of one contiguous fp32
buffer (a backward hook adds each new gradient in and frees it). At the step the buffer is
reduce-scattered in place, so this rank's slice holds the DP sum of its share of the flattened
parameters; AdamW steps the rank's fp32 master copy of that share; the updated shares are all-gathered,
in the parameters' dtype, into every replica's parameters. AdamW is elementwise, so the result equals the
replicated optimizer's.

Bytes per parameter held between steps on each rank, D ranks: the weights (4 fp32, 2 bf16) + 4 (the
gradient buffer) + 12 / D (master, two moments; with ``offload``, in host memory instead, beside a 4 / D copy of the
gradient shard, and AdamW steps there: megatron-core's ``optimizer_cpu_offload``, without its partial GPU
share); nothing else grows with the model (the gradient norm's
mask is a list of index ranges). A step adds the gathered weights (2 or 4) and a few D-th parts; a
checkpoint save at most :data:`SAVE_PIECE_BYTES` on the device (the replicated state is put together in host
memory, piece by piece, on DP rank 0 alone: the replica megatron-core's checkpoint writes); a load reads only the
rank's shard of the state (``checkpoint.load_sharded``).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.distributed as dist

from nemo_jq.models.common import build_optimizer

#: torch 2.13 renames the flat collectives; the images' older torch has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: The most device memory a checkpoint save's gather of the replicated AdamW state takes at once (all ranks' pieces).
SAVE_PIECE_BYTES = 256 * 2**20


def _accumulate(param: torch.nn.Parameter) -> None:
    """Backward hook: add the gradient just produced into the fp32 buffer, and free it."""
    param.main_grad.add_(param.grad)
    param.grad = None


class DistributedAdamW:
    """ZeRO-1 AdamW over ``params`` (this rank's model shard, the same list on every rank of ``group``)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup, *, counted_in_norm: Sequence[bool],
                 lr: float, weight_decay: float, betas: tuple[float, float], eps: float, offload: bool = False):
        self.params, self.group = list(params), group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        numels = [param.numel() for param in self.params]
        self.total = sum(numels)
        self.shard = -(-self.total // self.size)
        self.start = self.rank * self.shard
        self.offsets = list(itertools.accumulate(numels, initial=0))[:-1]
        device = self.params[0].device
        #: The one fp32 gradient buffer, padded to ``shard x size``; each parameter's ``main_grad`` is a view of it.
        self.grad_buffer = torch.zeros(self.shard * self.size, dtype=torch.float32, device=device)
        for param, offset, numel in zip(self.params, self.offsets, numels):
            param.main_grad = self.grad_buffer[offset:offset + numel].view_as(param)
            param.register_post_accumulate_grad_hook(_accumulate)
        #: This rank's slice of the buffer, where the reduce-scatter leaves the summed gradients of its share.
        self.grad_shard = self.grad_buffer[self.start:self.start + self.shard]
        #: ``(parameter index, its elements [a, b), the shard's [s, t))`` of each parameter overlapping this shard.
        self.pieces = [(index, max(offset, self.start) - offset, min(offset + numel, self.start + self.shard) - offset,
                        max(offset, self.start) - self.start, min(offset + numel, self.start + self.shard) - self.start)
                       for index, (offset, numel) in enumerate(zip(self.offsets, numels))
                       if max(offset, self.start) < min(offset + numel, self.start + self.shard)]
        #: The shard's ranges whose gradient counts in the global norm (a TP slice, or TP rank 0's copy).
        self.norm_ranges = [(s, t) for index, _, _, s, t in self.pieces if counted_in_norm[index]]
        #: Where the master weights and moments live and AdamW steps: the host with ``offload`` (pinned beside a GPU,
        #: so the copies each way are DMA), else the parameters' device.
        self.state_device = torch.device("cpu") if offload else device
        pinned = offload and device.type == "cuda" and torch.cuda.is_available()
        self.master = torch.nn.Parameter(torch.zeros(self.shard, dtype=torch.float32, device=self.state_device,
                                                     pin_memory=pinned))
        #: With ``offload``, the host copy of the reduced gradient shard that AdamW reads.
        self.host_grad = torch.empty(self.shard, dtype=torch.float32, pin_memory=pinned) if offload else None
        self._copy_params_into_master(self.params)
        # torch's foreach kernel, as a GPU picks it, on the dry run's stand-in too: on one tensor the per-tensor one
        # holds sqrt(v) twice while it steps (measured on an H100: docs/results/real_gpu.md)
        self.optimizer = build_optimizer([self.master], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    @torch.no_grad()
    def _copy_params_into_master(self, sources: Sequence[torch.Tensor]) -> None:
        """The master takes this shard's elements of ``sources`` (one tensor per parameter), piece by piece, so no
        full-length copy is ever made."""
        for index, a, b, s, t in self.pieces:
            self.master[s:t].copy_(sources[index].detach().reshape(-1)[a:b])

    @property
    def holds_more_than_params(self) -> bool:
        """Whether the fp32 master weights are more precise than the parameters (bf16 weights)."""
        return any(param.dtype != torch.float32 for param in self.params)

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_buffer.zero_()
        for param in self.params:
            param.grad = None

    def step(self, max_norm: float, norm_group: dist.ProcessGroup | None) -> torch.Tensor:
        """Reduce-scatter the gradient buffer, clip by the global norm (over ``group``, then ``norm_group``: the
        replica's TP and PP ranks), step this rank's fp32 slice of the master weights, all-gather it into the
        parameters (rounded to their dtype), and zero the buffer; return the pre-clip norm."""
        return clipped_step(max_norm, (self, norm_group))

    def reduce_gradients(self) -> torch.Tensor:
        """The step's first half: reduce-scatter the gradient buffer (this rank's slice holds the sum over ``group``
        of its share) and return the squares of the gradient counted in the norm, summed over ``group``."""
        if self.size > 1:
            _reduce_scatter(self.grad_shard, self.grad_buffer, group=self.group)  # in place, into this rank's slice
        squares = torch.zeros((), dtype=torch.float32, device=self.grad_buffer.device)
        for s, t in self.norm_ranges:
            squares += torch.dot(self.grad_shard[s:t], self.grad_shard[s:t])
        if self.size > 1:
            dist.all_reduce(squares, group=self.group)
        return squares

    def apply(self, clip: torch.Tensor) -> None:
        """The step's second half: scale the reduced gradient by ``clip``, step the master slice, gather it into the
        parameters and zero the buffer."""
        self.grad_shard.mul_(clip)
        # a view of the buffer (no copy), or its host copy beside the offloaded state
        self.master.grad = self.grad_shard if self.host_grad is None else self.host_grad.copy_(self.grad_shard)
        self.optimizer.step()
        self.master.grad = None
        self._gather_into_params()
        self.zero_grad()

    @torch.no_grad()
    def _gather_into_params(self) -> None:
        if self.size == 1:  # the master is every parameter's: each copied (and rounded) straight in, no whole-vector copy
            for index, a, b, s, t in self.pieces:
                self.params[index].view(-1)[a:b].copy_(self.master.detach()[s:t])
            return
        dtype = self.params[0].dtype
        full = self._gather(self.master.detach().to(device=self.grad_buffer.device, dtype=dtype))
        for param, piece in zip(self.params, full[:self.total].split([param.numel() for param in self.params])):
            param.copy_(piece.view_as(param))

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        full = torch.empty(mine.numel() * self.size, dtype=mine.dtype, device=mine.device)
        _all_gather(full, mine.contiguous(), group=self.group)
        return full

    def _gather_to_host(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's ``mine`` (a shard-long vector), put together in host memory on DP rank 0, the replica whose
        copy a checkpoint writes, from device pieces of at most :data:`SAVE_PIECE_BYTES` over all ranks. The other
        ranks send their pieces and get a zero of the whole vector's shape that holds no memory: megatron-core's
        checkpoint writes only the main replica (DP rank 0's), so their copy is never read."""
        if self.size == 1 and mine.device.type == "cpu":  # whole in host memory already (offloaded): no second copy
            return mine.detach().view(-1)
        writer = dist.get_global_rank(self.group, 0)
        step = max(1, SAVE_PIECE_BYTES // (mine.element_size() * self.size))
        full = torch.empty(self.size, self.shard, dtype=mine.dtype, device="cpu") if self.rank == 0 else None
        device = self.grad_buffer.device  # where the group's collectives run (offloaded state is sent from there)
        received = torch.empty(self.size, min(step, self.shard), dtype=mine.dtype, device=device) if full is not None \
            else None  # one piece's, reused
        for start in range(0, self.shard, step):
            piece = mine[start:start + step].to(device).contiguous()
            into = list(received[:, :piece.numel()]) if received is not None else None
            dist.gather(piece, into, dst=writer, group=self.group)
            if full is not None:
                full[:, start:start + piece.numel()].copy_(received[:, :piece.numel()])
        return full.view(-1) if full is not None else torch.zeros((), dtype=mine.dtype).expand(self.size * self.shard)

    def replicated(self) -> torch.optim.AdamW:
        """The equivalent replicated AdamW over the parameters, its moments gathered (a collective) into DP rank 0's
        host memory (:meth:`_gather_to_host`; the other ranks' are zeros that hold nothing): what a checkpoint stores,
        so it resumes with or without this optimizer, at any DP size. Parameters that are not fp32 (bf16 weights)
        also get their fp32 master weights, as ``master``, which they cannot hold."""
        replicated = torch.optim.AdamW(self.params, **{key: value for key, value in self.optimizer.param_groups[0].items()
                                                        if key in ("lr", "weight_decay", "betas", "eps")})
        mine = self.optimizer.state.get(self.master)
        if mine:
            numels = [param.numel() for param in self.params]
            slices = {**mine, "master": self.master.detach()}
            for param in self.params:
                replicated.state[param] = {"step": mine["step"].clone()}
            for key in ("exp_avg", "exp_avg_sq", *(("master",) if self.holds_more_than_params else ())):
                full = self._gather_to_host(slices[key])
                for param, piece in zip(self.params, full[:self.total].split(numels)):
                    replicated.state[param][key] = piece.view_as(param)
        return replicated

    def state_to_load(self, with_master: bool) -> dict[str, torch.Tensor]:
        """Where ``checkpoint.load_sharded`` reads this rank's shard of a checkpoint's AdamW state: the moments (in
        place when they exist) and, where the checkpoint has them (a bf16-weights run's), the master weights."""
        state = self.optimizer.state.get(self.master, {})
        targets = {key: state[key] if key in state else torch.zeros_like(self.master.detach())
                   for key in ("exp_avg", "exp_avg_sq")}
        return {**targets, **({"master": self.master.detach()} if with_master else {})}

    def load_shard(self, state: dict[str, torch.Tensor] | None, step: torch.Tensor | None = None) -> None:
        """After the parameters were loaded: take the master weights from ``state`` (``state_to_load``'s, read) where
        it has them, else this rank's slice of the parameters; and the moments and ``step`` from ``state``."""
        if state is None or "master" not in state:
            self._copy_params_into_master(self.params)
        if state is not None:
            self.optimizer.state[self.master] = {"step": step.clone(), "exp_avg": state["exp_avg"],
                                                 "exp_avg_sq": state["exp_avg_sq"]}


class DenseAndExpertAdamW:
    """A Qwen3-MoE's distributed AdamW: the dense weights' :class:`DistributedAdamW` over the data-parallel ranks and
    the experts' over the expert-data-parallel ranks (those holding the same experts), as megatron-core's DDP keeps
    expert buffers apart, clipped by one norm: the dense squares summed as the dense optimizer sums them, the experts'
    over ``expert_norm_group`` too (the expert-parallel ranks, each holding other experts)."""

    def __init__(self, dense: DistributedAdamW, experts: DistributedAdamW, expert_norm_group: dist.ProcessGroup):
        self.dense, self.experts, self.expert_norm_group = dense, experts, expert_norm_group
        self.parts = (dense, experts)

    @property
    def param_groups(self) -> list[dict]:
        return [*self.dense.param_groups, *self.experts.param_groups]

    def step(self, max_norm: float, norm_group: dist.ProcessGroup | None) -> torch.Tensor:
        return clipped_step(max_norm, (self.dense, norm_group), (self.experts, self.expert_norm_group))

    def replicated(self) -> torch.optim.AdamW:
        """Both parts' :meth:`DistributedAdamW.replicated` as one AdamW over every parameter (what a checkpoint
        stores)."""
        dense, experts = self.dense.replicated(), self.experts.replicated()
        merged = torch.optim.AdamW([*dense.param_groups[0]["params"], *experts.param_groups[0]["params"]],
                                   **{key: value for key, value in dense.param_groups[0].items()
                                      if key in ("lr", "weight_decay", "betas", "eps")})
        merged.state.update(dense.state)
        merged.state.update(experts.state)
        return merged

    def load_shard(self, state: None = None) -> None:
        """Each part's master weights from the parameters (a load of the weights alone)."""
        for part in self.parts:
            part.load_shard(None)


def clipped_step(max_norm: float, *parts: tuple[DistributedAdamW, dist.ProcessGroup | None]) -> torch.Tensor:
    """Step optimizer parts clipped by one global norm: each part's gradient reduced and its squares summed over its
    group and then over the part's own further group (None: none), the parts' sums added; return the pre-clip norm."""
    total = None
    for part, norm_group in parts:
        squares = part.reduce_gradients()
        if norm_group is not None:
            dist.all_reduce(squares, group=norm_group)
        total = squares if total is None else total + squares
    norm = total.sqrt()
    clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for part, _ in parts:
        part.apply(clip)
    return norm
