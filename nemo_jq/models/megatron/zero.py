"""AdamW with its fp32 master weights and moments split over the data-parallel ranks (ZeRO stage 1).

Each DP rank owns one contiguous slice of the flattened parameters: gradients are reduce-scattered
(each rank receives the DP sum of its slice, at the cost of one all-reduce), the rank steps AdamW on
its slice only, and the updated slices are all-gathered back into every replica's parameters.
AdamW is elementwise, so the result equals the replicated optimizer's; the optimizer memory per
rank falls from 12 bytes per parameter (master, two moments) to 12 / DP.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class DistributedAdamW:
    """ZeRO-1 AdamW over ``params`` (this rank's model shard, the same list on every DP rank)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup, *, counted_in_norm: Sequence[bool],
                 lr: float, weight_decay: float, betas: tuple[float, float], eps: float):
        self.params, self.group = list(params), group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.total = sum(param.numel() for param in self.params)
        self.shard = -(-self.total // self.size)
        self.start = self.rank * self.shard
        flat = self._flat([param.detach() for param in self.params])
        self.master = torch.nn.Parameter(flat[self.start:self.start + self.shard].clone())
        #: 1 where an element's gradient counts in the global norm (its parameter's TP slice, or TP rank 0's copy).
        self.norm_mask = self._flat([torch.full((param.numel(),), float(counted), device=param.device)
                                     for param, counted in zip(self.params, counted_in_norm)])[self.start:self.start + self.shard]
        self.optimizer = torch.optim.AdamW([self.master], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

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

    def _flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors flattened into one fp32 vector, zero-padded to ``shard * size`` elements."""
        flat = torch.cat([tensor.reshape(-1).float() for tensor in tensors])
        return torch.nn.functional.pad(flat, (0, self.shard * self.size - self.total))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None

    def step(self, grads: Sequence[torch.Tensor | None], max_norm: float, norm_group: dist.ProcessGroup | None) -> torch.Tensor:
        """Reduce-scatter ``grads`` (one per parameter, this rank's replica's; None for none), clip by the global
        norm (over DP, then ``norm_group``: the replica's TP and PP ranks), step this rank's fp32 slice of the
        master weights and all-gather it into the parameters (rounded to their dtype); return the pre-clip norm."""
        grads = self._flat([grad if grad is not None else torch.zeros_like(param, dtype=torch.float32)
                            for param, grad in zip(self.params, grads)])
        mine = torch.empty(self.shard, dtype=torch.float32, device=grads.device)
        dist.reduce_scatter_tensor(mine, grads, group=self.group)
        squares = (mine.square() * self.norm_mask).sum()
        dist.all_reduce(squares, group=self.group)
        if norm_group is not None:
            dist.all_reduce(squares, group=norm_group)
        norm = squares.sqrt()
        self.master.grad = mine * (max_norm / (norm + 1e-6)).clamp(max=1.0)
        self.optimizer.step()
        self.master.grad = None
        self._scatter_into_params(self._gather(self.master.detach()))
        self.zero_grad()
        return norm

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.shard * self.size, dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(full, mine.contiguous(), group=self.group)
        return full

    def _scatter_into_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for param, piece in zip(self.params, flat[:self.total].split([param.numel() for param in self.params])):
                param.copy_(piece.view_as(param))

    def replicated(self) -> torch.optim.AdamW:
        """The equivalent replicated AdamW over the parameters, its moments gathered (a collective): what a
        checkpoint stores, so it resumes with or without this optimizer, at any DP size. Parameters that are
        not fp32 (bf16 weights) also get their fp32 master weights, as ``master``, which they cannot hold."""
        replicated = torch.optim.AdamW(self.params, **{key: value for key, value in self.optimizer.param_groups[0].items()
                                                        if key in ("lr", "weight_decay", "betas", "eps")})
        mine = self.optimizer.state.get(self.master)
        if mine:
            numels = [param.numel() for param in self.params]
            keys = ("exp_avg", "exp_avg_sq", *(("master",) if self.holds_more_than_params else ()))
            slices = {**mine, "master": self.master.detach()}
            moments = {key: self._gather(slices[key])[:self.total].split(numels) for key in keys}
            for index, param in enumerate(self.params):
                replicated.state[param] = {"step": mine["step"].clone(),
                                           **{key: pieces[index].view_as(param).clone() for key, pieces in moments.items()}}
        return replicated

    def load_replicated(self, replicated: torch.optim.Optimizer | None) -> None:
        """After the parameters were loaded: take this rank's slice of them as the master weights and, given a
        replicated AdamW filled from a checkpoint, of its moments (and of the master weights, where it has them)."""
        states = [replicated.state[param] for param in self.params] if replicated is not None else []
        masters = [state["master"] for state in states] if states and "master" in states[0] else self.params
        self.master.data.copy_(self._flat([master.detach() for master in masters])[self.start:self.start + self.shard])
        if replicated is not None:
            self.optimizer.state[self.master] = {
                "step": states[0]["step"].clone(),
                **{key: self._flat([state[key] for state in states])[self.start:self.start + self.shard].clone()
                   for key in ("exp_avg", "exp_avg_sq")}}
