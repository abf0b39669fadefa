"""The Megatron backend's weights in and out, on CPU in gloo processes: HF round trips and the export, distributed
checkpoints resumed at another layout, HF folders read shard by shard, and bf16 weights over fp32 masters that a
checkpoint restores bit for bit."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import torch.distributed as dist  # noqa: E402

from helpers import tiny_setup  # noqa: E402
from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import (  # noqa: E402
    CPU,
    OPTIM,
    PROMPTS,
    SAMPLES,
    assert_same_training,
    garl_batch,
    garl_loss_fn,
    garl_step,
    max_diff,
    megatron_names,
    train_steps,
    untied_qwen3,
)
from nemo_jq.models.hf import HFPolicy  # noqa: E402


def export_worker(out_dir: str, scratch_dir: str) -> dict[str, float | bool]:
    """Untied odd-vocabulary model at TP=2: log-probs, HF -> shards -> HF round trip, export, state dicts."""
    from transformers import AutoModelForCausalLM

    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, tokenizer, _, _ = tiny_setup()
    model = untied_qwen3()
    policy = MegatronPolicy.from_hf_model(model, tensor_parallel=2)
    assert sorted(name for name, _ in policy.model.named_parameters()) == sorted(megatron_names(2, tied=False))
    batch = garl_batch(model.config.vocab_size)
    hf_state, round_trip = model.state_dict(), policy.hf_state_dict()
    results = {
        "logprobs": float((policy.token_logprobs(batch) - HFPolicy(model, device=CPU).token_logprobs(batch)).abs().max()),
        "round_trip_bit_exact": round_trip.keys() == hf_state.keys()
        and all(torch.equal(tensor, hf_state[name]) for name, tensor in round_trip.items()),
    }
    policy.export(out_dir, tokenizer)
    if dist.get_rank() == 0:
        exported = AutoModelForCausalLM.from_pretrained(out_dir)
        results["export_bit_exact"] = all(torch.equal(a, hf_state[name]) for name, a in exported.state_dict().items())
        with torch.no_grad():
            results["export_logits"] = float((exported(batch.input_ids).logits - model(batch.input_ids).logits).abs().max())
    refuse_foreign_weights(policy, scratch_dir, hf_state)
    return results


def refuse_foreign_weights(policy, scratch_dir: str, hf_state: dict[str, torch.Tensor]) -> None:
    """Weight files that do not fit the policy's model are errors that name the weight."""
    from safetensors.torch import save_file

    directory = Path(scratch_dir) / f"rank{dist.get_rank()}"
    directory.mkdir()
    save_file({name: tensor for name, tensor in hf_state.items() if name != "lm_head.weight"}, directory / "model.safetensors")
    with pytest.raises(ValueError, match="missing 'lm_head.weight'"):  # an untied model needs its own head
        policy.load(directory, with_optimizer=False)
    save_file({**hf_state, "model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 48)}, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight' has shape \[32, 48\]; the config implies \[32, 64\]"):
        policy.load(directory, with_optimizer=False)


@pytest.mark.distributed
def test_untied_tp2_round_trip_and_export_are_bit_exact(tmp_path):
    out_dir = tmp_path / "hf"
    results = run_in_processes(export_worker, 2, str(out_dir), str(tmp_path))
    for rank, result in enumerate(results):
        assert result["logprobs"] < 2e-5 and result["round_trip_bit_exact"], (rank, result)
    assert results[0]["export_bit_exact"] and results[0]["export_logits"] == 0, results[0]
    assert json.loads((out_dir / "config.json").read_text())["tie_word_embeddings"] is False


def train_and_save_worker(checkpoint_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Untied odd-vocabulary model at TP=2: a GARL step, a distributed checkpoint, a second step."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    policy = MegatronPolicy.from_hf_model(untied_qwen3(), tensor_parallel=2, **OPTIM)
    batch = garl_batch(policy.arch.vocab_size)
    garl_step(policy, batch)
    policy.save(Path(checkpoint_dir))
    after_one = policy.hf_state_dict()
    garl_step(policy, batch)
    return {"after_one": after_one, "after_two": policy.hf_state_dict()}


def resume_at_tp1_worker(checkpoint_dir: str, out_dir: str, scratch_dir: str) -> dict[str, Any]:
    """The TP=2 checkpoint resumed at TP=1 into other weights: loaded weights, the second step, the export;
    then the errors for a checkpoint without optimizer state, one that lacks a weight, one of another model, and one
    with a file cut short (each of megatron-core's files: one line naming the folder, not its traceback)."""
    from megatron.core import dist_checkpointing

    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, tokenizer, _, tied_model = tiny_setup()
    policy = MegatronPolicy.from_hf_model(untied_qwen3(seed=5), tensor_parallel=1, **OPTIM)
    policy.load(Path(checkpoint_dir))
    loaded = policy.hf_state_dict()
    garl_step(policy, garl_batch(policy.arch.vocab_size))
    policy.export(Path(out_dir), tokenizer)
    after_two = policy.hf_state_dict()  # before the refusals below, which may leave weights half loaded

    untrained = Path(scratch_dir) / "untrained"
    MegatronPolicy.from_hf_model(untied_qwen3(), **OPTIM).save(untrained)
    with pytest.raises(FileNotFoundError, match="holds no optimizer state"):
        policy.load(untrained)
    without_final_norm = Path(scratch_dir) / "without_final_norm"
    (without_final_norm / "megatron").mkdir(parents=True)
    dist_checkpointing.save({"model": {key: value for key, value in policy.model.sharded_state_dict().items()
                                       if "final_layernorm" not in key},
                             "hf_config": policy.arch.hf_config, "has_optimizer_state": False}, str(without_final_norm / "megatron"))
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\) this model needs: 'decoder.final_layernorm.weight'"):
        policy.load(without_final_norm, with_optimizer=False)
    tied = MegatronPolicy.from_hf_model(tied_model, **OPTIM)
    with pytest.raises(ValueError, match=r"saved from another model: vocab_size 317 there, \d+ here, .*"
                                         r"tie_word_embeddings False there, True here"):
        tied.load(untrained, with_optimizer=False)
    for name in sorted(path.name for path in (untrained / "megatron").iterdir()):
        cut = Path(scratch_dir) / f"cut{name}"
        shutil.copytree(untrained, cut)
        data = (cut / "megatron" / name).read_bytes()
        (cut / "megatron" / name).write_bytes(data[:len(data) // 2])
        with pytest.raises(ValueError, match=rf"checkpoint folder {cut / 'megatron'} is damaged \(truncated or corrupt: "):
            policy.load(cut, with_optimizer=False)
    return {"loaded": loaded, "after_two": after_two}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tp2_checkpoint_resumes_at_tp1_and_exports_the_same_model(tmp_path):
    """HF -> Megatron TP=2 -> distributed checkpoint -> resume at TP=1 (weights and AdamW moments resharded)
    -> the next step equals TP=2's own -> the export loads in plain transformers with the same logits."""
    from transformers import AutoModelForCausalLM

    checkpoint, out_dir = tmp_path / "checkpoint", tmp_path / "hf"
    trained = run_in_processes(train_and_save_worker, 2, str(checkpoint))
    assert max_diff(trained[0]["after_one"], untied_qwen3().state_dict()) > 1e-3  # the step moved the weights
    (resumed,) = run_in_processes(resume_at_tp1_worker, 1, str(checkpoint), str(out_dir), str(tmp_path))
    assert max_diff(resumed["loaded"], trained[0]["after_one"]) == 0
    assert max_diff(resumed["after_two"], trained[0]["after_two"]) < 1e-6
    exported, expected = AutoModelForCausalLM.from_pretrained(out_dir), untied_qwen3()
    expected.load_state_dict(trained[0]["after_two"])
    input_ids = garl_batch(317).input_ids
    with torch.no_grad():
        assert float((exported(input_ids).logits - expected(input_ids).logits).abs().max()) < 1e-5


def sharded_hf_folder(folder: Path, model, tokenizer=None) -> Path:
    """``model`` as an HF folder whose weights are split over several safetensors files and an index."""
    from nemo_jq.models.export import write_safetensors_shards

    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_safetensors_shards(((n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"), folder, 10_000)
    assert len(list(folder.glob("model-*.safetensors"))) > 5
    return folder


def folder_import_worker(folder: str) -> dict[str, float]:
    """The policy from the sharded folder against the one from the in-memory model, at TP=2; then broken folders."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, _, _, model = tiny_setup()
    from_folder = MegatronPolicy.from_hf_folder(Path(folder), tensor_parallel=2, **OPTIM)
    from_model = MegatronPolicy.from_hf_model(model, tensor_parallel=2, **OPTIM)
    diffs = {"weights": max_diff(from_folder.hf_state_dict(), from_model.hf_state_dict())}
    broken = Path(folder).parent / f"broken{dist.get_rank()}"
    shutil.copytree(folder, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="checkpoint is missing 'model.norm.weight'"):
        MegatronPolicy.from_hf_folder(broken, tensor_parallel=2, **OPTIM)
    (broken / index["weight_map"]["model.embed_tokens.weight"]).unlink()
    with pytest.raises(FileNotFoundError, match="lists weight files that do not exist: .*model-00001-of"):
        MegatronPolicy.from_hf_folder(broken, tensor_parallel=2, **OPTIM)
    return diffs


@pytest.mark.distributed
def test_an_hf_folder_is_read_shard_by_shard_bit_exact_and_names_what_is_missing(tmp_path):
    _, _, _, model = tiny_setup()
    folder = sharded_hf_folder(tmp_path / "hf", model)
    for rank, diffs in enumerate(run_in_processes(folder_import_worker, 2, str(folder))):
        assert diffs["weights"] == 0, (rank, diffs)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_recipe_from_a_sharded_hf_folder_at_tp2_trains_as_the_hf_backend(tmp_path):
    from helpers import TINY_RUN
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    source = Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'source'}"]))
    folder = sharded_hf_folder(tmp_path / "hf", source.policy.model, source.components.tokenizer)
    hf = train_steps(tmp_path / "hf_run", ["objective.name=garl", f"model.path={folder}"])
    ranks = run_in_processes(train_steps, 2, tmp_path / "megatron", ["objective.name=garl", "model.backend=megatron",
                                                                    "megatron.tensor_parallel=2", f"model.path={folder}"])
    assert_same_training(ranks[0], hf)


def bf16_weights_worker(scratch_dir: str, offload: bool = False) -> dict[str, Any]:
    """DP=2, bf16 weights: against HFPolicy in fp32, the masters' precision, and a checkpoint round trip; ``offload``:
    the optimizer's state in host memory (``megatron.optimizer_cpu_offload``)."""
    from nemo_jq.models.megatron.policy import MegatronPolicy

    _, _, _, model = tiny_setup()
    hf = HFPolicy(copy.deepcopy(model), device=CPU, **OPTIM)
    policy = MegatronPolicy.from_hf_model(model, distributed_optimizer=True, bf16_weights=True,
                                          optimizer_cpu_offload=offload, **OPTIM)
    batch = garl_batch(model.config.vocab_size)
    out: dict[str, Any] = {"dtypes": {param.dtype for param in policy.model.parameters()},
                           "master_dtype": policy.optimizer.master.dtype}
    with torch.no_grad():
        real = batch.target_mask
        out["logprobs"] = float((policy.token_logprobs(batch) - hf.token_logprobs(batch))[real].abs().max())
    micro_batches = [batch.rows(g * SAMPLES, (g + 1) * SAMPLES) for g in range(PROMPTS)]
    hf.forward_backward(micro_batches, garl_loss_fn(micro_batches, []))
    mine = micro_batches[dist.get_rank()::2]
    policy.forward_backward(mine, garl_loss_fn(mine, []))
    out["grad_dtypes"] = {param.main_grad.dtype for param in policy.model.parameters()}
    out["bf16_grads_left"] = sum(param.grad is not None for param in policy.model.parameters())
    grads = policy.gather_hf({name: param.main_grad for name, param in policy.model.named_parameters()})
    for grad in grads.values():  # the distributed optimizer sums over DP only at its step
        dist.all_reduce(grad)
    out["grad_error"] = max(float((grads[name] - param.grad).norm() / param.grad.norm())
                            for name, param in hf.model.named_parameters())
    policy.optimizer_step()
    hf.optimizer_step()
    masters = policy.gather_hf(_masters(policy))
    out["master_after_step"] = max_diff(masters, dict(hf.model.named_parameters()))
    # A step far below bf16's resolution: the fp32 masters move, the bf16 weights are those masters rounded.
    policy.set_learning_rate(1e-6)
    policy.forward_backward(mine, garl_loss_fn(mine, []))
    policy.optimizer_step()
    small = policy.gather_hf(_masters(policy))
    out["small_step_master_moved"] = max_diff(small, masters)
    out["weights_are_rounded_masters"] = max_diff(policy.hf_state_dict(), {n: t.to(torch.bfloat16) for n, t in small.items()})

    checkpoint = Path(scratch_dir) / "bf16"
    policy.save(checkpoint)
    policy.forward_backward(mine, garl_loss_fn(mine, []))
    policy.optimizer_step()
    after = policy.gather_hf(_masters(policy))
    other = MegatronPolicy.from_hf_model(tiny_setup(seed=3)[3], distributed_optimizer=True, bf16_weights=True,
                                         optimizer_cpu_offload=offload, **OPTIM)
    other.load(checkpoint)
    other.set_learning_rate(1e-6)
    out["resumed_masters"] = max_diff(other.gather_hf(_masters(other)), small)
    other.forward_backward(mine, garl_loss_fn(mine, []))
    other.optimizer_step()
    out["resumed_step"] = max_diff(other.gather_hf(_masters(other)), after)
    out["masters"], out["host_grad"] = after, policy.optimizer.host_grad is not None
    return out


def _masters(policy) -> dict[str, torch.Tensor]:
    """The distributed optimizer's fp32 master weights, gathered over DP, per parameter (megatron names)."""
    optimizer = policy.optimizer
    full = optimizer._gather(optimizer.master.detach())[:optimizer.total]
    pieces = full.split([param.numel() for param in optimizer.params])
    by_param = {id(param): piece.view_as(param) for param, piece in zip(optimizer.params, pieces)}
    return {name: by_param[id(param)] for name, param in policy.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_weights_train_on_fp32_masters_and_resume_them_bit_exact(tmp_path):
    """bf16 parameters with fp32 gradient accumulation and fp32 master weights in the distributed optimizer, at DP=2:
    log-probs and gradients within bf16's precision of HFPolicy in fp32, the masters after a step within a few bf16
    ulps of HF's weights; a step of 1e-6 moves the masters while the weights stay their bf16 rounding; a checkpoint
    restores the masters bit for bit, and the step after it equals the uninterrupted run's. With the optimizer's state
    offloaded (megatron.optimizer_cpu_offload: on CPU the host is the device, so what differs is the path: the gradient
    shard's host copy, the gathers from the state's device) every master equals the run without, bit for bit."""
    ranks = run_in_processes(bf16_weights_worker, 2, str(tmp_path / "resident"))
    offloaded = run_in_processes(bf16_weights_worker, 2, str(tmp_path / "offloaded"), True)
    for out, other in zip(ranks, offloaded):
        assert (out["host_grad"], other["host_grad"]) == (False, True)
        assert max_diff(out["masters"], other["masters"]) == 0.0
    for out in ranks:
        assert out["dtypes"] == {torch.bfloat16} and out["master_dtype"] == torch.float32
        assert out["grad_dtypes"] == {torch.float32} and out["bf16_grads_left"] == 0
        assert out["logprobs"] < 0.02, out
        assert out["grad_error"] < 0.05, out
        assert out["master_after_step"] < 1e-3, out
        assert 5e-7 < out["small_step_master_moved"] < 2e-5, out
        assert out["weights_are_rounded_masters"] == 0
        assert out["resumed_masters"] == 0 and out["resumed_step"] == 0, out



def test_megatron_cores_checkpoint_writer_helpers_never_act_on_a_stop_signal():
    """The signal that stops a run with a checkpoint reaches the writer's helpers too (torchrun sends SIGTERM to a
    worker's process group, SLURM its time-limit SIGUSR1 and scancel's SIGTERM to every process of the step): a helper
    killed by it broke that very save (under torchrun, SIGTERM: ``.tmp-step_...`` left and no checkpoint). Each helper
    the writer starts blocks the stop signals; this process's mask is as it was."""
    import signal
    import subprocess
    import sys

    probe = ("import json, multiprocessing, signal\n"
             "from nemo_jq.models.megatron.checkpoint import _start_writer_helpers\n"
             "_start_writer_helpers()\n"
             "helpers = [p.pid for p in multiprocessing.active_children()]\n"
             "print(json.dumps({'own': sorted(signal.pthread_sigmask(signal.SIG_BLOCK, set())), 'blocked': [next(\n"
             "    int(line.split()[1], 16) for line in open(f'/proc/{pid}/status') if line.startswith('SigBlk:'))\n"
             "    for pid in helpers]}))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout)
    assert seen["own"] == [] and seen["blocked"]  # this process blocks nothing; the manager is its child
    for blocked in seen["blocked"]:
        assert all(blocked >> (sig - 1) & 1 for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP)), bin(blocked)
