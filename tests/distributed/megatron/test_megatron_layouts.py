"""The Megatron backend's layouts and their errors, on CPU: the HF <-> Megatron weight mapping, Qwen3 configs it
refuses, impossible layouts (validated alone and in the recipe), the context-parallel split, and which process group
a one-process run starts (NCCL on a GPU); without the CPU test patches the backend says it needs CUDA."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from helpers import tiny_setup  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import (  # noqa: E402
    megatron_names,
    untied_qwen3,
)
from nemo_jq.models.megatron.layout import MegatronLayout  # noqa: E402
from nemo_jq.models.megatron.mapping import hf_to_megatron, megatron_to_hf  # noqa: E402
from nemo_jq.models.megatron.provider import read_qwen3_config  # noqa: E402


@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-spec", "te-spec"])
def test_mapping_layouts_and_bit_exact_round_trip(fused_norms):
    model = untied_qwen3()
    arch = read_qwen3_config(model.config)
    hf_state = model.state_dict()
    names = megatron_names(2, tied=False, fused_norms=fused_norms)
    shards = [hf_to_megatron(hf_state, names, arch, tp_size=2, tp_rank=rank) for rank in range(2)]

    attention, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    d, q = arch.head_dim, hf_state[attention + "q_proj.weight"]
    k, v = hf_state[attention + "k_proj.weight"], hf_state[attention + "v_proj.weight"]
    # rank 1 holds query group 1: its two query heads, then its key head, then its value head
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"],
                       torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))
    gate, up = hf_state[mlp + "gate_proj.weight"], hf_state[mlp + "up_proj.weight"]
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[32:], up[32:]]))
    assert torch.equal(shards[0]["decoder.layers.0.mlp.linear_fc2.weight"], hf_state[mlp + "down_proj.weight"][:, :32])
    # 317 rows pad to 384 (a multiple of 128, whatever the TP size): rank 1 holds rows 192..383, the last 67 zero
    embedding = shards[1]["embedding.word_embeddings.weight"]
    assert embedding.shape[0] == 192 and torch.equal(embedding[:125], hf_state["model.embed_tokens.weight"][192:])
    assert not embedding[125:].any()

    back = megatron_to_hf(shards, arch)
    assert back.keys() == hf_state.keys() and all(torch.equal(back[name], hf_state[name]) for name in back)


def test_mapping_names_missing_misshapen_and_unused_weights():
    _, _, _, model = tiny_setup()
    arch = read_qwen3_config(model.config)
    hf_state = {name: t for name, t in model.state_dict().items() if name != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 'model\.layers\.1\.mlp\.up_proj\.weight' .*decoder\.layers\.1\.mlp\.linear_fc1\.weight"):
        hf_to_megatron(hf_state, megatron_names(2, tied=True), arch, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.2\.mlp\.down_proj\.weight'\]"):
        hf_to_megatron({**model.state_dict(), "model.layers.2.mlp.down_proj.weight": torch.zeros(1)},
                       megatron_names(2, tied=True), arch)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_norm.weight' has shape \[16\]; the config implies \[8\]"):
        hf_to_megatron({**model.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(16)},
                       megatron_names(2, tied=True), arch)
    with pytest.raises(ValueError, match="no HF mapping for Megatron parameter 'decoder.layers.0.mlp.shared_experts.linear_fc1.weight'"):
        hf_to_megatron(model.state_dict(), ["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"], arch)


def test_config_errors_name_what_is_missing_or_unsupported(tmp_path):
    _, _, _, model = tiny_setup()
    config = model.config.to_dict()
    for name in ("hidden_size", "rope_parameters"):
        del config[name]
    with pytest.raises(ValueError, match=r"not a Qwen3-like config: missing hidden_size, rope_theta"):
        read_qwen3_config(config)

    good = model.config.to_dict()
    for change, message in [({"model_type": "llama"}, "model_type 'llama'"), ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                            ({"attention_bias": True}, "attention_bias"), ({"use_sliding_window": True}, "sliding"),
                            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope type 'yarn'")]:
        with pytest.raises(ValueError, match=message):
            read_qwen3_config({**good, **change})

    (tmp_path / "config.json").write_text(json.dumps({**good, "rope_theta": 5e5, "rope_parameters": None}))
    assert read_qwen3_config(tmp_path).rope_theta == 5e5  # a folder, and the transformers 4 form of the rope base
    with pytest.raises(FileNotFoundError, match="no HF config"):
        read_qwen3_config(tmp_path / "absent")


def test_impossible_layouts_are_refused_by_the_one_validate():
    arch = read_qwen3_config(untied_qwen3().config)  # 4 heads, 2 KV groups, intermediate 64, 2 layers
    cases = [(MegatronLayout(tensor_parallel=3), "megatron.tensor_parallel=3 does not divide num_attention_heads=4"),
             (MegatronLayout(tensor_parallel=4), "megatron.tensor_parallel=4 does not divide num_key_value_heads=2"),
             (MegatronLayout(sequence_parallel=True), "megatron.sequence_parallel needs megatron.tensor_parallel > 1"),
             (MegatronLayout(pipeline_parallel=3), "megatron.pipeline_parallel=3 does not divide num_hidden_layers=2"),
             (MegatronLayout(context_parallel=0), "megatron.context_parallel must be >= 1; got 0"),
             (MegatronLayout(bf16_weights=True), "megatron.bf16_weights=true keeps the fp32 master weights"),
             (MegatronLayout(optimizer_cpu_offload=True), "megatron.optimizer_cpu_offload=true moves the distributed "
                                                          "optimizer's state to the host")]
    for layout, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            layout.validate(arch)
        assert not layout.divides(arch, 8)
    with pytest.raises(ValueError, match=r"megatron.tensor_parallel=2 x pipeline_parallel=1 x context_parallel=1 does not "
                                         r"divide the 3 processes"):
        MegatronLayout(tensor_parallel=2).validate(arch, world_size=3)
    assert MegatronLayout(tensor_parallel=2, pipeline_parallel=2).divides(arch, 8)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_context_parallel_split_gives_each_rank_a_balanced_share_of_every_position(size):
    from nemo_jq.models.megatron.context_parallel import _in_sequence_order, split_for_rank

    length = 2 * size * 3
    positions = torch.arange(length).expand(2, length)
    parts = [split_for_rank(positions, rank, size) for rank in range(size)]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(length))  # every position once
    # causal work (the number of earlier positions each attends to) is equal on every rank
    assert len({int(part[0].sum()) for part in parts}) == 1
    assert torch.equal(_in_sequence_order(parts, 1), positions)
    if size > 1:
        with pytest.raises(ValueError, match=f"a sequence of {length + 1} does not split into 2 x {size} equal chunks"):
            split_for_rank(torch.arange(length + 1)[None], 0, size)


def context_parallel_worker() -> dict[str, bool]:
    """The split against megatron-core's own (``get_batch_on_this_cp_rank``), and the gather with its gradient."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from nemo_jq.models.megatron.context_parallel import gather_sequence, split_for_rank

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    whole = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mine = split_for_rank(whole, group.rank(), 2).clone().requires_grad_()
    gathered = gather_sequence(mine, group)
    weights = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (gathered * weights).sum().backward()  # the same loss on both ranks
    return {"as_megatron": torch.equal(mine, get_batch_on_this_cp_rank({"tokens": whole.clone()})["tokens"]),
            "gathered": torch.equal(gathered, whole), "grad": torch.equal(mine.grad, split_for_rank(weights, group.rank(), 2))}


def model_parallel_groups_worker() -> dict[str, bool]:
    """The groups the policy starts megatron-core with: its own, and no gloo twin of each."""
    from megatron.core import parallel_state

    from nemo_jq.models.megatron.policy import _initialize_model_parallel

    _initialize_model_parallel(2, 1, 1)
    return {"tensor_parallel": parallel_state.get_tensor_model_parallel_world_size() == 2,
            "gloo_twins": parallel_state._DATA_PARALLEL_GROUP_GLOO is not None}


@pytest.mark.distributed
def test_megatron_core_starts_without_gloo_twins_of_its_groups():
    """Issue 43's N4: megatron-core makes a gloo twin of every group by default, unused here, and across nodes each is
    a socket that must find the right network interface; the policy starts it without them, as the dry run does."""
    assert run_in_processes(model_parallel_groups_worker, 2) == [{"tensor_parallel": True, "gloo_twins": False}] * 2


@pytest.mark.distributed
def test_context_parallel_split_is_megatrons_and_the_gather_undoes_it():
    assert run_in_processes(context_parallel_worker, 2) == [{"as_megatron": True, "gathered": True, "grad": True}] * 2


def test_context_parallel_without_transformer_engine_is_a_clear_error():
    """megatron-core's local attention asserts CP == 1 deep inside the model build; the provider says why first.
    (This test process has none of the test patches, whose stand-in attention makes CP run on CPU.)"""
    from nemo_jq.models.megatron.provider import build_gpt_model

    with pytest.raises(ValueError, match=r"context_parallel=2 needs Transformer Engine's attention on GPU .*"
                                         r"or set context_parallel=1"):
        build_gpt_model(read_qwen3_config(untied_qwen3().config), MegatronLayout(context_parallel=2))


def test_policy_needs_torch_distributed():
    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, _, _, model = tiny_setup()
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        MegatronPolicy.from_hf_model(model)


def refuse_a_layout(run_dir, overrides: list[str]) -> None:
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    Trainer(load_config(None, [*TINY_RUN, "model.backend=megatron", f"train.run_dir={run_dir}", *overrides]))


@pytest.mark.parametrize("world_size, overrides, message", [
    (2, ["megatron.tensor_parallel=3"], "tensor_parallel=3 does not divide num_attention_heads=4"),
    (3, ["megatron.tensor_parallel=2"],
     "megatron.tensor_parallel=2 x pipeline_parallel=1 x context_parallel=1 does not divide the 3 processes"),
    (2, ["train.batch_size=3"], "train.batch_size=3 does not split over 2 data-parallel replicas"),
])
@pytest.mark.distributed
def test_impossible_layouts_are_named(world_size, overrides, message, tmp_path):
    with pytest.raises(Exception, match=message):
        run_in_processes(refuse_a_layout, world_size, tmp_path / "run", overrides)


def test_a_one_process_run_on_a_gpu_joins_an_nccl_group_as_torchrun_ranks_do(tmp_path, monkeypatch):
    """Without torchrun the backend makes its own one-process group: NCCL for a GPU (gloo would move every CUDA
    tensor of a collective through the host), gloo on CPU. This CPU build has no NCCL: the group's start is
    stood in for by a recorder that stops the build there (on the H100, calls 5-7 of docs/results/real_gpu.md)."""
    import torch.distributed as dist

    from helpers import small_qwen3
    from nemo_jq.backends import BackendRequest, megatron_backend
    from nemo_jq.config import load_config

    class Started(Exception):
        pass

    def record(backend, **_):
        raise Started(backend)

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", record)
    monkeypatch.setenv("NEMO_JQ_MEGATRON_ON_CPU", "1")
    folder = small_qwen3(tmp_path / "model", layers=2, tied=True)  # its config is all the build reads first
    config = load_config(None, [f"model.path={folder}", "model.backend=megatron"])
    for device, backend in (("cuda", "nccl"), ("cpu", "gloo")):
        request = BackendRequest(load_model=None, model_dir=folder, config=config, chat=None, device=torch.device(device))
        with pytest.raises(Started, match=f"^{backend}$"):
            megatron_backend(request)


def test_the_megatron_backend_on_cpu_without_the_patches_is_a_clear_error(tmp_path, capsys):
    from helpers import TINY_RUN
    from nemo_jq.cli import main

    code = main(["train", *TINY_RUN, "model.backend=megatron", f"train.run_dir={tmp_path / 'run'}"])
    assert code == 2 and "model.backend=megatron needs a CUDA device" in capsys.readouterr().err
