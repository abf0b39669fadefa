"""Qwen3-MoE on the Megatron backend, on CPU over gloo (the allgather dispatcher and SequentialMLP, which run here;
alltoall and grouped experts need CUDA): the architecture read from HF's config, the router and experts mapped from a
checkpoint as transformers writes it (one tensor per expert), each expert-parallel rank reading its own experts, and
the logits against transformers' ``Qwen3MoeForCausalLM`` on the same weights, at EP=2 with TP 1 and 2 (+SP)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import torch.distributed as dist  # noqa: E402

from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.models.megatron.layout import MegatronLayout  # noqa: E402
from nemo_jq.models.megatron.provider import read_qwen3_config  # noqa: E402

EXPERTS, TOP_K = 4, 2


def tiny_qwen3_moe(folder, *, norm_topk_prob: bool = True, seed: int = 0):
    """A random Qwen3-MoE of two layers, 4 experts, top-2, saved as transformers saves one (per-expert tensors)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=317, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob,
                            rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(folder)
    return folder


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


def test_what_is_not_built_yet_is_refused_in_one_line(tmp_path, capsys):
    """Training a Qwen3-MoE, and sizing one in plan, say so instead of running a wrong model."""
    from helpers import one_line_error, run_cli
    from nemo_jq.models.megatron.policy import MegatronPolicy

    folder = tiny_qwen3_moe(tmp_path / "moe")
    with pytest.raises(ValueError, match="Qwen3-MoE .4 experts, top-2.: the Megatron backend builds it .* does not train"):
        MegatronPolicy(str(folder), {})
    code, _, err = run_cli(capsys, "plan", "--model", folder)
    one_line_error(code, err, "is a Qwen3-MoE (4 experts): plan and the dry run size dense Qwen3s only for now")


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
