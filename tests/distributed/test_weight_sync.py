"""The bucketed weight sync (nemo_jq/rollouts/sync.py) over real gloo processes: bit-exact at the receivers, whatever
the bucket boundaries cut, and into a sampler through its refit path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")  # megatron_cpu.run_in_processes starts the ranks (and patches megatron for CPU)

import torch.distributed as dist  # noqa: E402

from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.rollouts.sync import WeightSync  # noqa: E402

pytestmark = pytest.mark.distributed


def awkward_tensors() -> list[tuple[str, torch.Tensor]]:
    """A tensor many buckets long, many smaller than one, several dtypes, a scalar, an empty and a non-contiguous one."""
    generator = torch.Generator().manual_seed(0)
    tensors = [("large", torch.randn(1000, generator=generator))]
    tensors += [(f"small.{i}", torch.randn(3 + i % 5, generator=generator).to(torch.bfloat16)) for i in range(40)]
    tensors += [("scalar", torch.tensor(7, dtype=torch.int64)), ("empty", torch.zeros(0, 4)),
                ("mask", torch.rand(37, generator=generator) > 0.5),
                ("transposed", torch.randn(9, 13, generator=generator).t()),
                ("after", torch.randn(2, 300, generator=generator, dtype=torch.float64))]
    return tensors


def sync_worker(bucket_bytes: int) -> dict:
    """Rank 0 sends :func:`awkward_tensors`; the others return what they received, in order, with the stats."""
    sync = WeightSync(dist.group.WORLD, source=0, bucket_bytes=bucket_bytes, device=torch.device("cpu"))
    if dist.get_rank() == 0:
        stats = sync.send(awkward_tensors())
        return {"stats": stats}
    received = [(name, tensor.clone()) for name, tensor in sync.receive()]
    return {"stats": sync.last, "received": received}


@pytest.mark.parametrize("bucket_bytes", [64, 100, 4000, 1 << 20], ids=["64B", "100B", "one-large", "one-bucket"])
def test_every_tensor_arrives_bit_exact_whatever_the_buckets_cut(bucket_bytes):
    sent = awkward_tensors()
    source, *receivers = run_in_processes(sync_worker, 3, bucket_bytes)
    total = sum(tensor.numel() * tensor.element_size() for _, tensor in sent)
    assert source["stats"].bytes == total
    assert source["stats"].buckets >= -(-total // bucket_bytes)
    assert (source["stats"].buckets == 1) == (bucket_bytes == 1 << 20)
    for receiver in receivers:
        assert [name for name, _ in receiver["received"]] == [name for name, _ in sent]
        for (name, got), (_, want) in zip(receiver["received"], sent):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), name
        assert (receiver["stats"].bytes, receiver["stats"].buckets) == (total, source["stats"].buckets)


def sampler_refit_worker(bucket_bytes: int) -> dict:
    """Rank 0's policy (an HF model) syncs into a native sampler of another model on rank 1 through ``load_weights``."""
    from nemo_jq.models.hf import HFPolicy, tiny_qwen3
    from nemo_jq.rollouts.hf import NativeSampler

    model = tiny_qwen3(64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                       max_position_embeddings=64, seed=dist.get_rank())  # each rank's own weights
    sync = WeightSync(dist.group.WORLD, source=0, bucket_bytes=bucket_bytes, device=torch.device("cpu"))
    if dist.get_rank() == 0:
        policy = HFPolicy(model, device=torch.device("cpu"))
        sync.send(policy.iter_hf())
    else:
        NativeSampler(model, pad_id=0, device=torch.device("cpu")).load_weights(sync.receive())
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_a_sampler_takes_the_synced_weights_through_its_refit_path():
    source, receiver = run_in_processes(sampler_refit_worker, 2, 1000)
    assert source.keys() == receiver.keys()
    assert all(torch.equal(source[name], receiver[name]) for name in source)
    assert any(not torch.equal(source[name], tensor) for name, tensor in receivers_starting_weights().items())


def receivers_starting_weights() -> dict[str, torch.Tensor]:
    """The receiver's own starting weights (seed 1): the sync must have changed them."""
    from nemo_jq.models.hf import tiny_qwen3

    return tiny_qwen3(64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=64, seed=1).state_dict()


def test_a_bucket_smaller_than_its_alignment_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        WeightSync(None, source=0, bucket_bytes=8, device=torch.device("cpu"))
