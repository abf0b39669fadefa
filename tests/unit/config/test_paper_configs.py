"""Every paper run config loads and carries the paper's settings (Section 5, Appendix F)."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from nemo_jq.config import load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
PAPER_FILES = sorted((CONFIGS / "qwen3_0p6b").glob("*.yaml")) + sorted((CONFIGS / "qwen3_8b").glob("*.yaml"))
THINKING = {"finqa": 4096, "hotpotqa": 3072, "musique": 2048}
SIZES = {"finqa": (6145, 872, 1132), "hotpotqa": (9067, 342, 343), "musique": (9985, 579, 445)}


def test_the_papers_runs_are_all_there():
    names = {f"{p.parent.name}/{p.stem}" for p in PAPER_FILES}
    for required in ("qwen3_0p6b/hotpotqa_warm_paft_q0.75", "qwen3_0p6b/finqa_cold_garl_q0.75", "qwen3_8b/musique_cold_garl_q0.85",
                     "qwen3_0p6b/musique_cold_grpo", "qwen3_8b/finqa_warm_grpo", "qwen3_0p6b/hotpotqa_warm_garl_q0.25"):
        assert required in names
    assert len(PAPER_FILES) == 3 * (12 + 6)


@pytest.mark.parametrize("path", PAPER_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_paper_config_values(path):
    config = load_config(path)
    small = path.parent.name == "qwen3_0p6b"
    dataset = path.stem.split("_")[0]
    assert config.model.path == ("Qwen/Qwen3-0.6B" if small else "Qwen/Qwen3-8B")
    assert config.train.batch_size == 64 and config.train.epochs == 2
    assert config.optim.lr == (5e-7 if small else 1e-6)
    assert config.rollout.num_samples == (32 if small else 16)
    assert config.rollout.temperature == 1.0 and config.rollout.top_k == 0 and config.rollout.top_p == 1.0
    assert config.rollout.max_thinking_tokens == THINKING[dataset] and config.rollout.max_answer_tokens == 128
    assert config.eval.every == 50 and config.eval.num_samples == 16
    assert (config.data.train_size, config.data.validation_size, config.data.test_size) == SIZES[dataset]
    assert config.data.name == dataset and config.data.format == path.stem.split("_")[1]
    assert config.objective.name == path.stem.split("_")[2]
    if config.objective.name == "paft":
        assert config.objective.options == {"num_resamples": config.rollout.num_samples}  # K = M
    if "_q" in path.stem:
        assert config.objective.q == float(path.stem.split("_q")[1])
    raw = yaml.safe_load(path.read_text())
    # No warm-up, decay or KL: the optimiser section holds only a constant lr (and no weight decay).
    assert set(raw["optim"]) == {"lr", "weight_decay"} and raw["optim"]["weight_decay"] == 0.0
    assert "kl" not in path.read_text().lower()


def test_generator_and_files_agree(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("paper_runs", CONFIGS / "paper_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    for written in module.write_all():
        assert written.read_text() == (CONFIGS / written.parent.name / written.name).read_text()


#: What the paper runs are sized for: one node of eight 80 GB GPUs (an H100 or A100 80 GB), prompts of up to 1024 tokens.
GPUS_PER_NODE, GPU_GIB, PROMPT_TOKENS = 8, 80, 1024


def planned(config):
    """``nemo-jq plan --config``'s estimate of ``config`` at its own layout (hf: one GPU; megatron: TP x PP from the
    config, the rest of the node data-parallel). ``plan`` is held to the dry run within 10% (tests/unit/dryrun/test_dryrun.py,
    docs/results/dryrun_configs.md)."""
    from nemo_jq.cluster import plan

    layout = config.megatron
    tp, pp = (layout.tensor_parallel, layout.pipeline_parallel) if config.model.backend == "megatron" else (1, 1)
    dp = GPUS_PER_NODE // (tp * pp) if config.model.backend == "megatron" else 1
    return plan.estimate(plan.architecture(config.model.path), plan.Workload.from_config(config, PROMPT_TOKENS), tp, pp,
                         dp, GPU_GIB, 0.9)


@pytest.mark.parametrize("path", PAPER_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_paper_run_fits_its_gpus_at_its_layout(path):
    estimate = planned(load_config(path))
    assert estimate.fits, (estimate.total_gib, estimate.largest, estimate.advice)


@pytest.mark.parametrize("undone", ["model.activation_checkpointing=false", "train.micro_batch_rows=null"])
def test_the_small_runs_fit_only_with_their_memory_settings(undone):
    """The 0.6B runs train on the hf backend: without recomputation, or with a whole prompt's M=32 rows per
    forward/backward, their activations alone pass the GPU."""
    estimate = planned(load_config(CONFIGS / "qwen3_0p6b" / "finqa_cold_garl_q0.5.yaml", [undone]))
    assert not estimate.fits and estimate.largest == "activations", estimate


def test_the_readmes_train_commands_load_their_configs_with_their_overrides():
    """Every ``train --config configs/...`` command in README.md and docs/ (a GPU's, so not run here) loads: the file
    exists and its overrides are keys and values the config accepts (e.g. no hf-only memory key left on a megatron
    run), but for ``data.prepared_dir``, whose folder ``nemo-jq data prepare`` makes first."""
    import re
    import shlex

    import doc_pages

    commands = re.findall(r"train --config (configs/\S+\.yaml)([^\n#`]*)", doc_pages.text())
    assert len(commands) >= 3, commands
    for path, overrides in commands:
        load_config(CONFIGS.parent / path, [word for word in shlex.split(overrides) if "=" in word and
                                            not word.startswith(("-", "data.prepared_dir="))])  # data made elsewhere


def test_the_32b_example_fits_sixteen_nodes_at_its_layout():
    """configs/examples/qwen3_32b_*: docs/cluster.md's 32B example as a run config, at plan's recommendation for 16
    nodes of eight 80 GB GPUs (TP=8 x DP=16); the dry run of its rank 0 peaks at 68.8 GiB (docs/dryrun.md)."""
    from nemo_jq.cluster import plan

    config = load_config(CONFIGS / "examples" / "qwen3_32b_hotpotqa_cold_garl_q0.75.yaml")
    tp = config.megatron.tensor_parallel
    estimate = plan.estimate(plan.architecture(config.model.path), plan.Workload.from_config(config, PROMPT_TOKENS), tp,
                             config.megatron.pipeline_parallel, 16 * GPUS_PER_NODE // tp, GPU_GIB, 0.9)
    assert estimate.fits and (estimate.tensor_parallel, estimate.data_parallel) == (8, 16), estimate
    best = plan.plan(plan.architecture(config.model.path), plan.Workload.from_config(config, PROMPT_TOKENS),
                     gpus_per_node=GPUS_PER_NODE, nodes=16, gpu_gb=GPU_GIB)[0]
    assert (best.tensor_parallel, best.pipeline_parallel, best.data_parallel) == (8, 1, 16)


def test_the_30b_a3b_example_fits_eight_nodes_at_its_layout_and_one_node_not():
    """configs/examples/qwen3_30b_a3b_*: a Qwen3-MoE at plan's recommendation for 8 nodes of eight 80 GB GPUs (TP=2 x
    DP=32, EP=8); the dry run of its rank 0 agrees within 1.5% per component (docs/results/dryrun_configs.md). On one
    node no layout fits: EP is at most the node's 8 GPUs, so each holds an eighth of the experts' AdamW state whole."""
    from nemo_jq.cluster import plan

    config = load_config(CONFIGS / "examples" / "qwen3_30b_a3b_hotpotqa_cold_garl_q0.75.yaml")
    arch, work = plan.architecture(config.model.path), plan.Workload.from_config(config, PROMPT_TOKENS)
    assert arch.is_moe and (arch.num_experts, arch.num_experts_per_tok, arch.num_layers) == (128, 8, 48)
    best = plan.plan(arch, work, gpus_per_node=GPUS_PER_NODE, nodes=8, gpu_gb=GPU_GIB)[0]
    assert best.fits and (best.tensor_parallel, best.pipeline_parallel, best.data_parallel, best.expert_parallel) == (
        config.megatron.tensor_parallel, 1, 32, config.megatron.expert_parallel)
    one_node = plan.plan(arch, work, gpus_per_node=GPUS_PER_NODE, nodes=1, gpu_gb=GPU_GIB)
    assert not any(layout.fits for layout in one_node) and one_node[0].largest == "optimizer"
    assert {layout.expert_parallel for layout in one_node} <= {1, 2, 4, 8}
    assert one_node[0].advice.startswith("megatron.optimizer_cpu_offload=true ("), one_node[0]  # the config's keys, not plan's flags


def test_the_30b_a3b_one_node_example_fits_with_the_optimizer_state_in_host_memory():
    """configs/examples/qwen3_30b_a3b_one_node_*: the same run on one node of eight 80 GB GPUs, at plan's
    recommendation there once the optimizer's state is offloaded (TP=2 x DP=4, EP=8)."""
    from nemo_jq.cluster import plan

    config = load_config(CONFIGS / "examples" / "qwen3_30b_a3b_one_node_hotpotqa_cold_garl_q0.75.yaml")
    arch, work = plan.architecture(config.model.path), plan.Workload.from_config(config, PROMPT_TOKENS)
    assert work.optimizer == "bf16-distopt-offload"
    best = plan.plan(arch, work, gpus_per_node=GPUS_PER_NODE, nodes=1, gpu_gb=GPU_GIB)[0]
    assert best.fits and best.optimizer_gib == 0.0 and (
        best.tensor_parallel, best.pipeline_parallel, best.data_parallel, best.expert_parallel) == (
        config.megatron.tensor_parallel, 1, 4, config.megatron.expert_parallel)
    # the host memory the offloaded state takes, as the dry run holds it between steps (docs/moe.md: 56.9 GiB a process)
    assert plan.host_state_gib(arch, work, 2, 1, 4) == pytest.approx(56.9, abs=0.05)
    advised = plan.plan(arch, dataclasses.replace(work, optimizer="bf16-distopt"), gpus_per_node=GPUS_PER_NODE, nodes=1, gpu_gb=GPU_GIB)
    assert "megatron.optimizer_cpu_offload=true (each process's host then holds its" in advised[0].advice


def test_the_235b_a22b_example_fits_sixteen_nodes_with_engines_over_eight_rollout_ranks():
    """configs/examples/qwen3_235b_a22b_*: half the GPUs train (TP=4 x DP=16, EP=64, the optimizer's state offloaded),
    a layout plan fits with room (plan's first choice, TP=2, fits with 3 GiB to spare in the dry run); the other half
    sample, each vLLM engine over 8 rollout ranks, whose share holds an eighth of its bf16 weights (a whole engine's,
    470 GB, fits no GPU)."""
    from dataclasses import replace

    from nemo_jq.cluster import plan

    config = load_config(CONFIGS / "examples" / "qwen3_235b_a22b_hotpotqa_cold_garl_q0.75.yaml")
    arch, work = plan.architecture(config.model.path), plan.Workload.from_config(config, PROMPT_TOKENS)
    assert arch.is_moe and (arch.num_layers, arch.num_experts) == (94, 128) and work.rollout_ranks == 64
    layout = config.megatron
    trainers = 16 * GPUS_PER_NODE - work.rollout_ranks
    assert layout.divides(arch, trainers) and layout.data_parallel(trainers) == 16
    estimate = plan.estimate(arch, replace(work, expert_parallel=layout.expert_parallel), layout.tensor_parallel,
                             layout.pipeline_parallel, layout.data_parallel(trainers), GPU_GIB, plan.HEADROOM)
    assert estimate.fits and estimate.total_gib < 0.75 * GPU_GIB, estimate
    result = plan.report(arch, work, [estimate], GPU_GIB, plan.HEADROOM)
    assert result["rollout_rank"]["fits"] and result["rollout_rank"]["vllm"] > 2 * plan.parameter_count(arch) / 8 / 2**30
    whole_engines = plan.report(arch, replace(work, vllm_tensor_parallel=1), [estimate], GPU_GIB, plan.HEADROOM)
    assert not whole_engines["rollout_rank"]["fits"]
