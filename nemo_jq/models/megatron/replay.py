"""Routing replay in megatron-core's routers: each token goes to the experts the rollout engine sent it to
(:mod:`nemo_jq.models.routes`), in the scoring and the training forward alike (docs/moe.md).

megatron-core 0.16.1's router asks a replay object for its top-k (``moe/router_replay.py``: ``RouterReplay
.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``, called by
``topk_routing_with_score_function``) and, replaying, gathers the router's own scores at the replayed experts: its
softmax over the gathered logits (Qwen3's renormalised top-k) or the full softmax's entries, so an expert the
trainer's router would not pick still gets a gradient (gathering from the post-top-k weights would give it none).
Its ``RouterReplay`` replays every token of a forward and registers its instances in one class-wide list;
:class:`ReplayedRoutes` answers the same call for one router of this model, and routes the tokens marked
``ROUTE_YOURSELF`` (whatever the engine did not run: a teacher-forced answer, the last sampled token, padding) by
the router's own top-k. It also counts the routing disagreement: the share of replayed expert choices the trainer's
router would not have made.

The load-balancing loss counts the routes actually dispatched (:func:`dispatched_routes_balanced`): it penalises the
load each expert carried in this forward, ``tokens_e``, weighted by the router's own probabilities ``P_e`` (where the
gradient flows). megatron-core counts the router's own top-k instead, which under replay is a load no expert carried.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jq.models.megatron.context_parallel import split_for_rank
from nemo_jq.models.routes import ROUTE_YOURSELF, empty_routes

#: The experts the last replayed router dispatched to, ``[tokens, k]``, until its load-balancing loss reads them.
_DISPATCHED: list[torch.Tensor | None] = [None]


class ReplayedRoutes:
    """One router's routes to replay in the next forwards (``[tokens, k]`` in the router's token order; None: none),
    and how many of its replayed choices its own top-k would not have made."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        self.disagreeing = self.replayed = torch.zeros((), dtype=torch.long)

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return own_scores, own
        target = self.target.to(scores.device)
        yourself = (target == ROUTE_YOURSELF).any(-1, keepdim=True)
        chosen = torch.where(yourself, own, target.long())
        agreed = (chosen.unsqueeze(-1) == own.unsqueeze(-2)).any(-1)  # each chosen expert among the router's own
        self.disagreeing = self.disagreeing.to(scores.device) + (~agreed).sum()
        self.replayed = self.replayed.to(scores.device) + (~yourself).sum() * topk
        if torch.is_grad_enabled():
            _DISPATCHED[0] = chosen
        return scores.gather(1, chosen), chosen


class RoutingReplay:
    """The replay objects of a ``GPTModel``'s routers, one per layer of this stage, and the routes they replay."""

    def __init__(self, model: Any, *, tp_rank: int, tp_size: int, sequence_parallel: bool, layer_offset: int = 0,
                 cp_rank: int = 0, cp_size: int = 1):
        self.replays = [ReplayedRoutes() for _ in model.decoder.layers]
        for layer, replay in zip(model.decoder.layers, self.replays):
            layer.mlp.router.router_replay = replay
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.cp_rank, self.cp_size = cp_rank, cp_size
        #: This pipeline stage's first layer in the whole model: the routes hold every layer's.
        self.layer_offset = layer_offset
        dispatched_routes_balanced()

    def load(self, routes: torch.Tensor | None) -> None:
        """Replay ``routes`` (``[N, L, layers, k]`` for the forward's ``[N, L]`` input; None: route every token) from
        the next forward on, until the next ``load``: a recomputation in backward routes as its forward did when the
        policy loads them again as that backward begins (under pipeline parallelism other micro-batches' forwards run
        in between). The router sees this CP rank's positions (``context_parallel.split_for_rank``) as ``[L / CP, N]``
        flattened (under sequence parallelism this TP rank's run of them). The disagreement counts start again."""
        _DISPATCHED[0] = None
        for layer, replay in enumerate(self.replays, start=self.layer_offset):
            replay.disagreeing = replay.replayed = torch.zeros((), dtype=torch.long)
            if routes is None:
                replay.target = None
                continue
            target = split_for_rank(routes[:, :, layer], self.cp_rank, self.cp_size).transpose(0, 1)
            if self.sequence_parallel and self.tp_size > 1:
                target = target.chunk(self.tp_size)[self.tp_rank]
            replay.target = target.reshape(-1, target.shape[-1])

    def take_counts(self) -> torch.Tensor:
        """The replayed expert choices the routers' own top-k would not have made and all replayed choices, since the
        last ``load`` or ``take_counts`` (``[2]``, this rank's; the counts start again)."""
        counts = torch.stack([torch.stack([replay.disagreeing, replay.replayed.to(replay.disagreeing.device)])
                              for replay in self.replays]).sum(0).float()
        for replay in self.replays:
            replay.disagreeing = replay.replayed = torch.zeros((), dtype=torch.long)
        return counts


def padded_routes(routes: torch.Tensor | None, rows: int, length: int) -> torch.Tensor | None:
    """``routes`` ``[N, L, layers, k]`` right-padded to ``rows`` x ``length`` positions that route themselves."""
    if routes is None or routes.shape[:2] == (rows, length):
        return routes
    padded = empty_routes(rows, length, *routes.shape[2:], device=routes.device)
    padded[: routes.shape[0], : routes.shape[1]] = routes
    return padded


def dispatched_routes_balanced() -> None:
    """megatron-core 0.16.1's load-balancing loss (``TopKRouter.routing`` calls ``compute_routing_scores_for_aux_loss``
    for the routing map it counts) counting the experts the replayed router just dispatched to, where it replayed;
    the router's own top-k elsewhere (idempotent)."""
    from megatron.core.transformer.moe import router

    original = router.compute_routing_scores_for_aux_loss
    if getattr(original, "counts_dispatched", False):
        return

    def counted(logits: torch.Tensor, topk: int, score_function: str, fused: bool = False,
                padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        routing_map, scores = original(logits, topk, score_function, fused=fused, padding_mask=padding_mask)
        dispatched, _DISPATCHED[0] = _DISPATCHED[0], None
        if dispatched is not None and dispatched.shape == (logits.shape[0], topk):
            routing_map = torch.zeros_like(routing_map).scatter(1, dispatched, True)
            if padding_mask is not None:  # True at the padding, as megatron-core's own masking reads it
                routing_map = routing_map & ~padding_mask.unsqueeze(-1)
        return routing_map, scores

    counted.counts_dispatched = True
    router.compute_routing_scores_for_aux_loss = counted
