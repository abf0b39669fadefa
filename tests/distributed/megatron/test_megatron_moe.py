"""Qwen3-MoE on the Megatron backend, on CPU over gloo (the allgather dispatcher and SequentialMLP, which run here;
alltoall and grouped experts need CUDA): the architecture read from HF's config, the router and experts mapped from a
checkpoint as transformers writes it (one tensor per expert), each expert-parallel rank reading its own experts, and
the logits against transformers' ``Qwen3MoeForCausalLM`` on the same weights, at EP=2 with TP 1 and 2 (+SP)."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import torch.distributed as dist  # noqa: E402

from helpers import moe_run_folder  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import EXPERTS, switch_loss, tiny_qwen3_moe  # noqa: E402
from nemo_jq.models.common import checkpoint_state  # noqa: E402
from nemo_jq.models.megatron.layout import MegatronLayout  # noqa: E402
from nemo_jq.models.megatron.mapping import hf_names, is_expert  # noqa: E402
from nemo_jq.models.megatron.provider import read_qwen3_config  # noqa: E402
from nemo_jq.runtime.monitor import read_metrics  # noqa: E402


def test_the_architecture_is_read_and_a_layout_that_cannot_split_the_experts_is_refused(tmp_path):
    arch = read_qwen3_config(tiny_qwen3_moe(tmp_path / "moe"))
    assert (arch.is_moe, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size, arch.norm_topk_prob,
            arch.router_aux_loss_coef) == (True, 4, 2, 16, True, 0.001)
    MegatronLayout(tensor_parallel=2, expert_parallel=4).validate(arch, world_size=4)
    for layout, world, fragment in ((MegatronLayout(expert_parallel=3), None, "expert_parallel=3 does not divide num_experts=4"),
                                    (MegatronLayout(expert_tensor_parallel=3), None, "does not divide moe_intermediate_size=16"),
                                    (MegatronLayout(expert_parallel=4), 2, "does not divide the 2 ranks of a pipeline stage")):
        with pytest.raises(ValueError, match=fragment):
            layout.validate(arch, world_size=world)
    config = dict(arch.hf_config, decoder_sparse_step=2)
    with pytest.raises(ValueError, match="mixes dense and expert layers"):
        read_qwen3_config(config)
    dense = read_qwen3_config({**config, "model_type": "qwen3", "decoder_sparse_step": 1})
    with pytest.raises(ValueError, match="this model is dense"):
        MegatronLayout(expert_parallel=2).validate(dense)
    with pytest.raises(ValueError, match="moe_aux_loss_coef=0.01 weighs a Qwen3-MoE's load-balancing loss; this model is dense"):
        MegatronLayout(moe_aux_loss_coef=0.01).validate(dense)


def test_what_is_not_built_yet_is_refused_in_one_line(tmp_path):
    """Training a Qwen3-MoE at a layout whose experts' handling is not built says so instead of running a wrong
    model."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    folder = tiny_qwen3_moe(tmp_path / "moe")
    for setting, fragment in (({"tensor_parallel": 2, "sequence_parallel": True},
                               "megatron.tensor_parallel=2 with megatron.expert_parallel=1"),):
        with pytest.raises(ValueError, match=fragment + ": for now experts train with"):
            MegatronPolicy(str(folder), {}, **setting)
    with pytest.raises(ValueError, match="megatron.tensor_parallel=2 with a Qwen3-MoE needs megatron.sequence_parallel"):
        MegatronPolicy(str(folder), {}, tensor_parallel=2, expert_parallel=2)



def moe_logits_worker(folder: str, tensor_parallel: int, expert_parallel: int, sequence_parallel: bool) -> dict:
    """This rank's model built from the HF folder (its experts only), its logits gathered over TP against
    transformers', and the HF tensors its shards map back to against the checkpoint's."""
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    from nemo_jq.models.megatron.mapping import ExpertShard, iter_hf_to_megatron, megatron_to_hf
    from nemo_jq.models.megatron.provider import build_gpt_model

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=1,
                                             create_gloo_process_groups=False)
    arch = read_qwen3_config(folder)
    layout = MegatronLayout(tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
                            expert_parallel=expert_parallel).validate(arch, dist.get_world_size())
    model = build_gpt_model(arch, layout)
    stored = load_file(f"{folder}/model.safetensors")
    tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    per_rank = arch.num_experts // expert_parallel
    experts = ExpertShard(ep_rank * per_rank, all_offsets=tuple(range(0, arch.num_experts, per_rank)))
    params = dict(model.named_parameters())
    read = []
    with torch.no_grad():
        for name, shard in iter_hf_to_megatron(stored, params, arch, tp_size=tensor_parallel, tp_rank=tp_rank,
                                               experts=experts):
            params[name].copy_(shard)
            read.append(name)
    model.eval()
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(arch.vocab_size, (3, 12), generator=generator)
    with torch.no_grad():
        local = model(input_ids, torch.arange(12).expand_as(input_ids), torch.ones(12, 12, dtype=torch.bool).triu(1)[None, None])
        group = parallel_state.get_tensor_model_parallel_group()
        pieces = [torch.empty_like(local) for _ in range(tensor_parallel)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        logits = torch.cat(pieces, dim=-1)[..., : arch.vocab_size]
        reference = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids).logits
    shards, offsets = [None] * tensor_parallel, [None] * tensor_parallel
    dist.all_gather_object(shards, {name: param.detach() for name, param in params.items()}, group=group)
    dist.all_gather_object(offsets, experts.expert_offset, group=group)
    mapped = megatron_to_hf(shards, arch, expert_offsets=offsets)
    experts_here = {name for name in mapped if ".mlp.experts." in name}  # this TP group's experts
    return {"logits": float((logits - reference).abs().max()), "scale": float(reference.abs().max()),
            "round_trip": max(float((tensor - stored[name]).abs().max()) for name, tensor in mapped.items()),
            "experts_here": sorted(experts_here), "local_experts": sum(".local_experts." in name for name in read)}


@pytest.mark.parametrize("tensor_parallel, expert_parallel, sequence_parallel, world_size, norm_topk_prob",
                         [(1, 2, False, 2, True), (1, 2, False, 2, False), (2, 2, False, 2, True), (2, 2, True, 4, True)],
                         ids=["ep2", "ep2-top-k-not-renormalised", "tp2-ep2", "tp2-sp-ep2-dp2"])
@pytest.mark.distributed
def test_megatron_qwen3_moe_logits_equal_transformers_and_each_expert_rank_holds_its_own_experts(
        tmp_path, tensor_parallel, expert_parallel, sequence_parallel, world_size, norm_topk_prob):
    """Routing as Qwen3 routes (softmax over the experts, top-k, renormalised or not) and each expert where it is."""
    folder = tiny_qwen3_moe(tmp_path / "moe", norm_topk_prob=norm_topk_prob)
    results = run_in_processes(moe_logits_worker, world_size, str(folder), tensor_parallel, expert_parallel,
                               sequence_parallel)
    for rank, result in enumerate(results):
        assert result["logits"] < 1e-4 * result["scale"], (rank, result)
        assert result["round_trip"] == 0.0, (rank, result)
        assert result["local_experts"] == 2 * 2 * EXPERTS // expert_parallel  # fc1 and fc2, 2 layers, its share
    every = {f"model.layers.{layer}.mlp.experts.{j}.{proj}.weight" for layer in range(2) for j in range(EXPERTS)
             for proj in ("gate_proj", "up_proj", "down_proj")}
    assert set().union(*(result["experts_here"] for result in results)) == every


def expert_tp_worker(folder: str) -> dict:
    """EP=2 x expert-TP=2 on 4 ranks: each rank reads half of each of its EP rank's experts; the log-probs equal
    transformers', and the weights gathered back (each expert from its EP rank's two slices) equal the checkpoint's."""
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    from megatron_tiny import CPU, garl_batch, max_diff
    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.models.megatron.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf_folder(folder, expert_parallel=2, expert_tensor_parallel=2)
    hf = HFPolicy(Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32), device=CPU)
    batch = garl_batch(policy.arch.vocab_size)
    with torch.no_grad():
        logprobs = float((policy.token_logprobs(batch) - hf.token_logprobs(batch)).abs().max())
    # the group's ranks in the order the gathers assume: EP rank e's expert-TP slice t at e x 2 + t
    mine = torch.tensor([parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank()])
    order = [torch.empty_like(mine) for _ in range(4)]
    dist.all_gather(order, mine, group=policy.ep_group)
    local = {name: tuple(param.shape) for name, param in policy.model.named_parameters() if ".local_experts.0.linear_fc2" in name}
    return {"logprobs": logprobs, "order": [tuple(rank.tolist()) for rank in order], "local_fc2": sorted(local.values()),
            "weights": max_diff(policy.hf_state_dict(), load_file(f"{folder}/model.safetensors"))}


@pytest.mark.distributed
def test_experts_split_over_expert_tensor_parallel_ranks_compute_and_gather_as_transformers(tmp_path):
    folder = tiny_qwen3_moe(tmp_path / "moe")
    for rank, result in enumerate(run_in_processes(expert_tp_worker, 4, str(folder))):
        assert result["logprobs"] < 1e-5 and result["weights"] == 0.0, (rank, result)
        assert result["order"] == [(0, 0), (0, 1), (1, 0), (1, 1)], (rank, result)
        assert result["local_fc2"] == [(32, 8)] * 2, (rank, result)  # [hidden, moe_intermediate / 2], both layers


def adam_state(policy) -> dict:
    """Each parameter's AdamW first moment by name, gathered from the distributed optimizer's shards if it has them
    (a collective then)."""
    optimizer = policy.optimizer.replicated() if policy._zero else policy.optimizer
    return {name: optimizer.state[param]["exp_avg"] for name, param in policy.model.named_parameters()}


def moe_step_worker(folder: str, aux_coef: float, checkpoint: str, distributed_optimizer: bool,
                    tensor_parallel: int = 1, pipeline_parallel: int = 1, context_parallel: int = 1,
                    expert_tensor_parallel: int = 1) -> dict:
    """One GARL(q=0.75) AdamW step at EP=2 (DP 2: a micro-batch each; or TP 2 with SP; or over 2 pipeline stages; or
    CP 2; or each expert split over 2 expert-TP ranks instead)
    against transformers' model trained by HFPolicy on both micro-batches, its loss plus, per layer and micro-batch,
    the load-balancing loss weighted by the micro-batch's share of the rows (experts.py)."""
    import copy

    from megatron.core import parallel_state
    from transformers import Qwen3MoeForCausalLM

    from helpers import tiny_setup
    from megatron_tiny import CPU, OPTIM, PROMPTS, SAMPLES, garl_batch, garl_loss_fn, max_diff
    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.models.megatron.policy import MegatronPolicy

    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = HFPolicy(copy.deepcopy(model), device=CPU, **OPTIM)
    settings = dict(expert_parallel=2 // expert_tensor_parallel, expert_tensor_parallel=expert_tensor_parallel,
                    moe_aux_loss_coef=aux_coef, distributed_optimizer=distributed_optimizer,
                    tensor_parallel=tensor_parallel, sequence_parallel=tensor_parallel > 1,
                    pipeline_parallel=pipeline_parallel, context_parallel=context_parallel, **OPTIM)
    policy = MegatronPolicy.from_hf_folder(folder, **settings)
    batch = garl_batch(model.config.vocab_size)
    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    captured = []
    for layer in hf.model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: captured.append(out[0]))
    reference = garl_loss_fn(micro_batches, [])

    def with_balance(logprobs, index):
        loss, metrics = reference(logprobs, index)
        real = micro_batches[index].attention_mask.bool().flatten()
        balance = sum(switch_loss(logits, real, aux_coef) for logits in captured) if aux_coef else 0.0
        captured.clear()
        share = micro_batches[index].num_rows / batch.num_rows
        return loss + share * balance, {**metrics, "balance": float(balance) / aux_coef / len(hf.model.model.layers)
                                        if aux_coef else None}

    with torch.no_grad():
        logprobs = float((policy.token_logprobs(batch) - hf.token_logprobs(batch)).abs().max())
    captured.clear()
    expected = hf.forward_backward(micro_batches, with_balance)
    rank, replicas = policy.data_parallel.rank, policy.data_parallel.size
    got = policy.forward_backward(micro_batches[rank::replicas], garl_loss_fn(micro_batches[rank::replicas], []))
    hf_grads = checkpoint_state({name: param.grad for name, param in hf.model.named_parameters()})
    # the distributed optimizer sums the gradients over DP at its step: until then each rank holds its own part
    grads = 0.0 if distributed_optimizer else max_diff(
        policy.gather_hf({name: p.grad for name, p in policy.model.named_parameters()}), hf_grads)
    grad_norm = abs(policy.optimizer_step()["grad_norm"] - hf.optimizer_step()["grad_norm"])
    weights = max_diff(policy.hf_state_dict(), checkpoint_state(dict(hf.model.named_parameters())))
    # a checkpoint of the stepped policy (each rank its experts) resumes into a fresh one, AdamW state included, and
    # its weights load at EP=1 (DP 2: every rank all experts)
    policy.save(Path(checkpoint))
    resumed = MegatronPolicy.from_hf_folder(folder, **settings)
    resumed.load(Path(checkpoint))
    again = dict(resumed.model.named_parameters())
    moments, moments_again = adam_state(policy), adam_state(resumed)
    restored = max(max(float((param - again[name]).abs().max()), float((moments[name] - moments_again[name]).abs().max()))
                   for name, param in policy.model.named_parameters())
    with counted_collectives() as counts:
        stepped = policy.hf_state_dict()
    layers = policy.arch.num_layers
    dense = sum(len(hf_names(name)) for name in policy._all_names if not is_expert(name))  # HF tensors
    collectives = {"expert_gathers": counts[id(policy.ep_group), "all_gather"], "layers_here": layers // pipeline_parallel,
                   "stage_broadcasts": counts[id(policy.pp_group), "broadcast"],
                   "broadcasts": dense + layers if pipeline_parallel > 1 else 0}
    # the export (experts gathered over EP) is a folder transformers loads, bit-exact
    export = Path(checkpoint).parent / "export"
    policy.export(export, tiny_setup()[1])
    exported = max_diff(checkpoint_state(Qwen3MoeForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()), stepped)
    parallel_state.destroy_model_parallel()
    whole = MegatronPolicy.from_hf_folder(folder, **{**settings, "expert_parallel": 1, "expert_tensor_parallel": 1,
                                                     "tensor_parallel": 1,
                                                     "sequence_parallel": False, "pipeline_parallel": 1,
                                                     "context_parallel": 1})
    whole.load(Path(checkpoint))
    at_ep1 = max_diff(whole.hf_state_dict(), stepped)
    return {"logprobs": logprobs, "grads": grads, "grad_norm": grad_norm, "weights": weights,
            "grad_scale": max(float(g.abs().max()) for g in hf_grads.values()),
            "balance": [(logged.get("load_balancing_loss"), reference["balance"])
                        for logged, reference in zip(got, expected[rank::replicas])], "restored": restored,
            "at_ep1": at_ep1, "exported": exported, **collectives}


@contextlib.contextmanager
def counted_collectives():
    """Counts of ``all_gather`` and ``broadcast`` calls by (id of the group, name) while the block runs."""
    counts = collections.Counter()
    originals = {name: getattr(dist, name) for name in ("all_gather", "broadcast")}

    def counting(name):
        def call(*args, group=None, **kwargs):
            counts[id(group), name] += 1
            return originals[name](*args, group=group, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@pytest.mark.parametrize("aux_coef, distributed_optimizer, tensor_parallel, pipeline_parallel, context_parallel, etp", [
    (0.0, False, 1, 1, 1, 1), (0.5, False, 1, 1, 1, 1), (0.5, True, 1, 1, 1, 1), (0.5, False, 2, 1, 1, 1),
    (0.5, True, 1, 2, 1, 1), (0.5, False, 2, 2, 1, 1), (0.5, True, 1, 1, 2, 1), (0.5, True, 1, 1, 1, 2)],
    ids=["no-balancing-loss", "balancing-loss", "balancing-loss-distributed-optimizer", "balancing-loss-tp2-sp",
         "balancing-loss-pp2-distributed-optimizer", "balancing-loss-tp2-sp-pp2", "balancing-loss-cp2-distributed-optimizer",
         "balancing-loss-expert-tp2-distributed-optimizer"])
@pytest.mark.distributed
@pytest.mark.slow  # 5-9 s each on 2 cores
def test_a_garl_step_at_expert_parallel_2_equals_transformers_trained_on_the_whole_batch(
        tmp_path, aux_coef, distributed_optimizer, tensor_parallel, pipeline_parallel, context_parallel, etp):
    """Expert gradients from both ranks' tokens (the dispatcher's gather), dense ones summed over DP, the norm
    counting each expert once, the step; with the load-balancing loss at a coefficient large enough to matter; with
    the distributed optimizer (dense state over DP, the experts' over expert-DP, one norm); and over 2 pipeline
    stages (each stage's experts over EP, the norm over both stages' experts, the checkpoint loading at PP=1, the
    export gathering every stage's experts)."""
    folder = tiny_qwen3_moe(tmp_path / "moe")
    for rank, result in enumerate(run_in_processes(moe_step_worker, 2 * pipeline_parallel * context_parallel, str(folder),
                                                   aux_coef, str(tmp_path / "ckpt"), distributed_optimizer, tensor_parallel,
                                                   pipeline_parallel, context_parallel, etp)):
        assert result["logprobs"] < 1e-5, (rank, result)
        assert result["grads"] < 1e-5 * max(1.0, result["grad_scale"]), (rank, result)
        assert result["grad_norm"] < 1e-5 and result["weights"] < 1e-5, (rank, result)
        for logged, reference in result["balance"]:
            assert (logged is None) if not aux_coef else logged == pytest.approx(reference, rel=1e-4), (rank, result)
        assert result["restored"] == 0.0 and result["at_ep1"] == 0.0 and result["exported"] == 0.0, (rank, result)
        # each layer's experts in one gather over EP (not one per expert) and one broadcast over PP (not one per
        # HF tensor); every dense HF tensor in its own broadcast
        assert result["expert_gathers"] == result["layers_here"], (rank, result)
        assert result["stage_broadcasts"] == result["broadcasts"], (rank, result)


def test_a_router_log_starts_afresh_where_another_model_logged_in_this_process():
    """megatron-core's load-balancing loss tracker and aux-loss scale are the process's, shaped and placed by the first
    pass that set them: a 48-layer model's pass on the CPU after a 94-layer one's on the dry run's stand-in GPU
    (bench/dryrun_configs.py dry-runs 235B-A22B, then 30B-A3B) logs its own layers' losses (it failed adding the 94 to
    its 48) and scales them on its own device (a dry run after a CPU run met a host tensor)."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_moe_layer_wise_logging_tracker,
        save_to_aux_losses_tracker,
    )

    from nemo_jq.models.interfaces import TokenBatch
    from nemo_jq.models.megatron.experts import RouterLog

    get_moe_layer_wise_logging_tracker()["load_balancing_loss"] = {"values": torch.ones(94)}  # the deeper model's
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1, device="meta")  # set on the dry run's stand-in
    ids = torch.ones(2, 5, dtype=torch.long)
    spans = torch.zeros(2, 4, dtype=torch.bool)
    log = RouterLog([TokenBatch(ids, torch.ones_like(ids), spans, spans)], None,
                    torch.device("cpu"), None, num_layers=48)
    log.enter(0)
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.device == torch.device("cpu")
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), layer_number=3, num_layers=48)
    assert log.metrics([]) == [{"load_balancing_loss": 0.5}]

def test_a_layers_experts_are_gathered_in_a_few_batches():
    """Qwen3-30B-A3B at EP8 in bf16: 16 experts a rank, fc1 and fc2 (1.2 GB a layer once gathered): 3 gathers a layer
    under the 512 MiB limit, never across a layer or a dtype; every other parameter alone."""
    from nemo_jq.models.megatron.mapping import EXPERT_GATHER_BYTES, gather_batches

    hidden, ffn = 2048, 768
    entries = [("embedding.word_embeddings.weight", torch.bfloat16, 151936 * hidden)]
    for layer in range(48):
        entries.append((f"decoder.layers.{layer}.mlp.router.weight", torch.float32, 128 * hidden))
        entries += [(f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.linear_fc{fc}.weight", torch.bfloat16,
                     (2 if fc == 1 else 1) * ffn * hidden) for j in range(16) for fc in (1, 2)]
    batches = gather_batches(entries, 8, EXPERT_GATHER_BYTES)
    assert len(batches) == 1 + 48 * (1 + 3) and sum(map(len, batches)) == len(entries)
    assert [len(batch) for batch in batches[2:5]] == [14, 14, 4]
    assert len({name.split(".")[2] for batch in batches[1:] for name in batch[:1] + batch[-1:]}) == 48
    assert gather_batches(entries[:3] + [(entries[3][0], torch.float32, entries[3][2])], 8, EXPERT_GATHER_BYTES) == [
        [entries[0][0]], [entries[1][0]], [entries[2][0]], [entries[3][0]]]


@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_trains_a_qwen3_moe_at_expert_parallel_2_as_the_hf_backend_and_as_expert_parallel_1(tmp_path):
    """`nemo-jq train` on the model folder over 2 ranks (DP 2). SFT samples nothing: two steps at EP=2 equal the hf
    backend's (transformers' Qwen3-MoE in one process; it adds no load-balancing loss, so neither does this run).
    GARL samples each replica's rollouts from its refit HF copy: at EP=2 (each copy's experts gathered from both
    ranks) three steps equal EP=1's (every rank all experts), the same replicas drawing the same samples; both replay
    the routes their samplers recorded (rollout.routing_replay's default for a Qwen3-MoE on this backend)."""
    from megatron_tiny import assert_same_training, train_steps

    folder = moe_run_folder(tmp_path)
    megatron = [f"model.path={folder}", "model.backend=megatron", "megatron.moe_aux_loss_coef=0"]
    hf = train_steps(tmp_path / "hf_run", ["objective.name=sft", f"model.path={folder}"], 2)
    ranks = run_in_processes(train_steps, 2, tmp_path / "sft", ["objective.name=sft", *megatron,
                                                               "megatron.expert_parallel=2"], 2)
    assert_same_training(ranks[0], hf)
    garl = ["objective.name=garl", *megatron]
    whole = run_in_processes(train_steps, 2, tmp_path / "ep1", garl)
    split = run_in_processes(train_steps, 2, tmp_path / "ep2", [*garl, "megatron.expert_parallel=2"])
    assert_same_training(split[0], whole[0])
    # both replayed the routes their fp32 samplers recorded, which route as the trainer does
    assert [record["routing_disagreement"] for record in split[0]] == [0.0] * 3


@pytest.mark.slow
@pytest.mark.distributed
def test_an_epochs_short_last_batch_is_shared_equally_at_expert_parallel_2(tmp_path):
    """7 prompts in batches of 4 over 2 replicas: each epoch's last batch of 3 is cut to 2, one a replica. Shared
    2 and 1, the replica with one prompt made fewer forward passes than the other, whose expert all-reduce then waited
    for it until the collective timeout (the 0.6B-30B MoE configs' 9,067 prompts in batches of 64 hung at step 142)."""
    from megatron_tiny import train_steps

    folder = moe_run_folder(tmp_path)
    ranks = run_in_processes(train_steps, 2, tmp_path / "run", [
        "objective.name=sft", f"model.path={folder}", "model.backend=megatron", "megatron.expert_parallel=2",
        "data.train_size=7", "train.micro_batch_size=1", "train.epochs=2", "train.collective_timeout_minutes=1"], 10)
    assert len(ranks[0]) == 4  # two epochs of two batches


@pytest.mark.slow
@pytest.mark.distributed
def test_row_chunks_log_the_routers_metrics_as_micro_batches_do(tmp_path):
    """train.micro_batch_rows (the 30B-A3B example configs' 4) trains in row chunks, whose second pass's metrics, the
    load-balancing loss and the routing disagreement the policy adds, were dropped: those runs logged neither."""
    from megatron_tiny import train_steps

    folder = moe_run_folder(tmp_path)
    garl = ["objective.name=garl", f"model.path={folder}", "model.backend=megatron", "megatron.moe_aux_loss_coef=0.5"]
    [[whole]] = run_in_processes(train_steps, 1, tmp_path / "whole", garl, 1)
    [[chunked]] = run_in_processes(train_steps, 1, tmp_path / "chunks", [*garl, "train.micro_batch_rows=2"], 1)
    assert whole["load_balancing_loss"] is not None and whole["routing_disagreement"] is not None
    assert chunked["load_balancing_loss"] == pytest.approx(whole["load_balancing_loss"], rel=0.1)
    assert chunked["routing_disagreement"] == pytest.approx(whole["routing_disagreement"], abs=0.05)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_validation_smaller_than_the_replicas_is_sampled_at_expert_parallel_2(tmp_path):
    """One validation prompt over 2 replicas: the replica with none sampled nothing, so it never joined the refit that
    gathers the experts over both, and the other waited for it until the collective timeout."""
    from megatron_tiny import train_steps

    folder = moe_run_folder(tmp_path)
    ranks = run_in_processes(train_steps, 2, tmp_path / "run", [
        "objective.name=sft", f"model.path={folder}", "model.backend=megatron", "megatron.expert_parallel=2",
        "megatron.moe_aux_loss_coef=0", "data.validation_size=1", "eval.every=1", "train.collective_timeout_minutes=1",
        "rollout.engine=native"], 1)
    assert len(ranks[0]) == 1 and ranks[0] == ranks[1]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "validation"] == [1]


@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_trains_a_qwen3_moe_over_two_pipeline_stages_as_in_one_process(tmp_path):
    """`nemo-jq train` GARL with the load-balancing loss and recomputed layers over 2 pipeline stages (each stage its
    layer's router and experts; the refit gathering both stages' experts into the sampler's copy; each stage
    replaying its layer's routes, again in the recomputing backward) equals one process holding both layers."""
    from megatron_tiny import assert_same_training, train_steps

    folder = moe_run_folder(tmp_path)
    garl = ["objective.name=garl", f"model.path={folder}", "model.backend=megatron", "megatron.moe_aux_loss_coef=0.5",
            "megatron.recompute_activations=true"]
    [whole] = run_in_processes(train_steps, 1, tmp_path / "pp1", garl)
    staged = run_in_processes(train_steps, 2, tmp_path / "pp2", [*garl, "megatron.pipeline_parallel=2"])
    assert_same_training(staged[0], whole)
    assert [record["routing_disagreement"] for record in staged[0]] == [0.0] * 3


@pytest.mark.slow
@pytest.mark.distributed
def test_routes_cross_the_one_step_off_sampling_process(tmp_path):
    """rollout.async_steps=1 in one process: the next step's rollouts are sampled by a child process from the refit
    copy, and their routes come back with them (pickled in the Rollout) to be replayed: the disagreement is logged
    (None would mean no route was replayed) at every step: none on the first (sampled from the current weights), some
    on the second, whose routes the weights one step before chose (28% of the choices at this tiny model's rate)."""
    from megatron_tiny import train_steps

    folder = moe_run_folder(tmp_path)
    [records] = run_in_processes(train_steps, 1, tmp_path / "async", [
        "objective.name=garl", f"model.path={folder}", "model.backend=megatron", "megatron.moe_aux_loss_coef=0",
        "rollout.async_steps=1"], 2)
    first, second = (record["routing_disagreement"] for record in records)
    assert first == 0.0 and second is not None and second > 0.0, records


def masters(policy) -> dict:
    """The distributed optimizer's fp32 master weights by megatron name (each part's gathered over its own group)."""
    by_param = {}
    for part in policy.optimizer.parts:
        pieces = part._gather(part.master.detach())[:part.total].split([param.numel() for param in part.params])
        by_param.update({id(param): piece.view_as(param) for param, piece in zip(part.params, pieces)})
    return {name: by_param[id(param)] for name, param in policy.model.named_parameters()}


def bf16_moe_worker(folder: str, checkpoint: str) -> dict:
    """EP=2 over 2 ranks, bf16 weights on the fp32 masters of both parts of the distributed optimizer: the masters
    after a step within a few bf16 ulps of transformers' fp32 step, and a checkpoint restoring them bit for bit."""
    import copy

    from transformers import Qwen3MoeForCausalLM

    from megatron_tiny import CPU, OPTIM, PROMPTS, SAMPLES, garl_batch, garl_loss_fn, max_diff
    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.models.megatron.policy import MegatronPolicy

    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = HFPolicy(copy.deepcopy(model), device=CPU, **OPTIM)
    settings = dict(expert_parallel=2, moe_aux_loss_coef=0.0, distributed_optimizer=True, bf16_weights=True, **OPTIM)
    policy = MegatronPolicy.from_hf_folder(folder, **settings)
    batch = garl_batch(model.config.vocab_size)
    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    hf.forward_backward(micro_batches, garl_loss_fn(micro_batches, []))
    mine = micro_batches[policy.data_parallel.rank::2]
    policy.forward_backward(mine, garl_loss_fn(mine, []))
    policy.optimizer_step()
    hf.optimizer_step()
    stepped = policy.gather_hf(masters(policy))
    after_step = max_diff(stepped, checkpoint_state(dict(hf.model.named_parameters())))
    policy.save(Path(checkpoint))
    resumed = MegatronPolicy.from_hf_folder(folder, **settings)
    resumed.load(Path(checkpoint))
    return {"dtypes": {param.dtype for param in policy.model.parameters()}, "after_step": after_step,
            "resumed": max_diff(resumed.gather_hf(masters(resumed)), stepped),
            "weights_are_rounded_masters": max_diff(policy.hf_state_dict(),
                                                    {name: t.to(torch.bfloat16) for name, t in stepped.items()})}


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_weights_with_experts_step_on_fp32_masters_and_resume_them_bit_exact(tmp_path):
    folder = tiny_qwen3_moe(tmp_path / "moe")
    for rank, out in enumerate(run_in_processes(bf16_moe_worker, 2, str(folder), str(tmp_path / "ckpt"))):
        assert out["dtypes"] == {torch.bfloat16} and out["after_step"] < 1e-3, (rank, out)
        assert out["resumed"] == 0 and out["weights_are_rounded_masters"] == 0, (rank, out)
