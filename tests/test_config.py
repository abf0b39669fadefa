"""Typed config: YAML, overrides, and errors that name the key."""

import pytest
import yaml

from nemo_jq.config import Config, ConfigError, load_config, save_config


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({"objective": {"name": "paft", "q": 0.25}, "rollout": {"num_samples": 4}}))
    config = load_config(path, ["objective.q=0.75", "optim.lr=1e-6", "objective.options={num_resamples: 2}"])
    assert config.objective.name == "paft" and config.objective.q == 0.75
    assert config.optim.lr == 1e-6 and config.rollout.num_samples == 4
    assert config.objective.options == {"num_resamples": 2}
    save_config(config, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == config
    assert isinstance(load_config(), Config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective.nmae=garl"], "unknown config key 'objective.nmae'; did you mean 'objective.name'"),
        (["rollout.num_sample=4"], "did you mean 'rollout.num_samples'"),
        (["optimm.lr=1"], "unknown config key 'optimm'; did you mean 'optim'"),
        (["objective.q=1.5"], r"objective.q must be >= 0.0 and <= 1.0; got 1.5"),
        (["objective.name=gerl"], "objective.name: unknown objective 'gerl'.*Did you mean 'garl'"),
        (["rollout.num_samples=1"], "rollout.num_samples=1 but 'garl' needs at least 2"),
        (["objective.options={baseline: mean}", "objective.name=paft"], "objective.options.baseline is not an option of 'paft'"),
        (["train.batch_size=many"], "train.batch_size must be int; got 'many'"),
        (["data.format=tepid"], "data.format must be one of cold, warm"),
        (["model.precision=fp8"], "model.precision must be one of"),
        (["objective.q_schedule={name: linear, steps: 3}"], r"unknown key\(s\) \['steps'\]"),
        (["justakey"], "must look like section.key=value"),
        (["train.batch_size.x=1"], "train.batch_size is not a section|train.batch_size must be"),
        (["model.recompute_activations=true"], "recompute_activations/distributed_optimizer/bf16_weights need model.backend=megatron"),
        (["model.tensor_parallel=2"], "model.tensor_parallel/.* need model.backend=megatron"),
        (["model.pipeline_parallel=2"], "pipeline_parallel/.* need model.backend=megatron"),
        (["model.distributed_optimizer=true"], "distributed_optimizer/bf16_weights need model.backend=megatron"),
        (["model.bf16_weights=true"], "bf16_weights need model.backend=megatron"),
        (["model.backend=megatron", "model.bf16_weights=true"],
         "model.bf16_weights=true keeps the fp32 master weights in the distributed optimizer: set model.distributed_optimizer=true"),
        (["rollout.engine=sglang"], "rollout.engine must be one of native, hf, vllm"),
        (["rollout.engine=vllm"], "rollout.engine=vllm needs model.path"),
        (["rollout.max_logprob_gap=0"], "rollout.max_logprob_gap must be > 0.0"),
        (["rollout.tensor_parallel=2"], "rollout.tensor_parallel=2 splits a vLLM engine .*got native, hf, 1"),
        (["rollout.tensor_parallel=3", "rollout.engine=vllm", "model.path=m", "model.backend=megatron",
          "model.tensor_parallel=4"], "a model.tensor_parallel it divides"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_every_example_config_loads():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "configs" / "examples").glob("*.yaml"))
    assert files
    for path in files:
        config = load_config(path)
        assert config.train.run_dir.startswith("runs/")
