"""Typed config: YAML, overrides, and errors that name the key."""

import dataclasses

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


def test_an_unknown_key_of_options_built_apart_from_the_config_is_a_config_error():
    """An objective's options are built on their own (no whole config to look for the key in): still one line."""
    from nemo_jq.typed import build

    @dataclasses.dataclass
    class Options:
        baseline: str = "rloo"

    with pytest.raises(ConfigError, match=r"unknown config key 'objective.options.baselin'; did you mean "
                                          r"'objective.options.baseline'\?"):
        build(Options, {"baselin": "none"}, "objective.options.")
    with pytest.raises(ConfigError, match=r"unknown config key 'objective.options.zzz'; valid keys: \['baseline'\]"):
        build(Options, {"zzz": 1}, "objective.options.")


def test_a_mapping_given_for_a_section_sets_its_keys_and_an_empty_value_is_refused(tmp_path):
    """``objective={q: 0.5}`` replaced the file's whole section: its name and options were dropped without a word (a
    misspelt key with them); now it sets each key, as ``objective.q=0.5`` does. A mapping for a value (an objective's
    options, a q schedule) still replaces it. ``key=`` (an unset shell variable) read as null: a run of 768 steps."""
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({"objective": {"name": "paft", "q": 0.25, "options": {"num_resamples": 8}},
                                    "train": {"run_dir": "mine", "epochs": 3}, "model": {"tiny": {"num_layers": 3}}}))
    config = load_config(path, ["objective={q: 0.5}", "train={seed: 3}", "model.tiny={hidden_size: 16}",
                                "objective.options={num_resamples: 2}"])
    assert (config.objective.name, config.objective.q, config.objective.options) == ("paft", 0.5, {"num_resamples": 2})
    assert (config.train.run_dir, config.train.epochs, config.train.seed) == ("mine", 3, 3)
    assert (config.model.tiny.num_layers, config.model.tiny.hidden_size) == (3, 16)
    path.write_text(yaml.safe_dump({"train": {"epoch": 3}}))
    with pytest.raises(ConfigError, match="unknown config key 'train.epoch'"):  # not wiped out by train={...}
        load_config(path, ["train={seed: 3}"])
    for empty in ("train.max_steps=", "train.max_steps= "):
        with pytest.raises(ConfigError, match=f"override '{empty}' gives train.max_steps no value .*train.max_steps=null"):
            load_config(None, [empty])
    assert load_config(None, ["train.max_steps=null"]).train.max_steps is None
    path.write_text("train:\noptim:\n  lr: 0.1\n")  # a section's line left with nothing under it
    with pytest.raises(ConfigError, match=r"train is empty \(a `train:` line with nothing under it\): give its keys"):
        load_config(path)
    assert load_config(path, ["train.seed=3"]).train.seed == 3  # an override fills the empty section: it was refused


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective.nmae=garl"], "unknown config key 'objective.nmae'; did you mean 'objective.name'"),
        (["rollout.num_sample=4"], "did you mean 'rollout.num_samples'"),
        (["optimm.lr=1"], "unknown config key 'optimm'; did you mean 'optim'"),
        (["optim.epochs=3"], "unknown config key 'optim.epochs'; did you mean 'train.epochs'"),  # not optim.eps
        (["optim.batch_size=3"], "did you mean 'eval.batch_size' or 'train.batch_size'\\?"),
        (["objective.q=1.5"], r"objective.q must be >= 0.0 and <= 1.0; got 1.5"),
        (["objective.name=gerl"], "objective.name: unknown objective 'gerl' \\(did you mean 'garl'\\?\\); known: garl, "),
        (["rollout.num_samples=1"], "rollout.num_samples=1 but 'garl' needs at least 2"),
        (["objective.options={baseline: mean}", "objective.name=paft"], "objective.options.baseline is not an option of 'paft'"),
        (["objective.options={baseline: mean}"], "objective.options.baseline must be one of rloo, none; got 'mean'"),
        (["objective.options={num_resamples: 0}", "objective.name=paft"], "objective.options.num_resamples must be >= 1"),
        (["objective.name=grpo", "objective.options.rewards=1"],
         "objective.options.rewards: 'rewards' is an input the trainer supplies to 'grpo', not an option; 'grpo' takes clip_eps"),
        (["objective.name=grpo", "objective.options.tokens_per_example=3"], "'tokens_per_example' is an input the trainer supplies"),
        (["objective.name=grpo", "objective.options.old_logprob=3"], "'old_logprob' is an input the trainer supplies"),
        (["objective.name=grpo", "objective.options.clip_ep=0.1"], "did you mean 'clip_eps'"),
        (["objective.name=paft", "objective.options.q=1"], "'q' is an input the trainer supplies to 'paft'"),
        (["guard.enabled=true", "guard.estimator=paf"], "guard.estimator: unknown objective 'paf' \\(did you mean 'paft'\\?\\)"),
        # said before the model is loaded (minutes at real size)
        (["rollout.routing_replay=true"], "rollout.routing_replay=true replays routes in model.backend=megatron only"),
        # the sampling child sampled rationales for it: a batch of M rows a prompt (a crash), or SFT on sampled rationales
        (["guard.enabled=true", "guard.action=switch_estimator", "guard.estimator=sft", "rollout.async_steps=1"],
         "guard.estimator='sft' trains on given targets, but rollout.async_steps=1 samples rollouts ahead"),
        (["model.backend=tpu"], "model.backend: unknown backend 'tpu'; known: hf, megatron"),
        (["train.batch_size=many"], "train.batch_size must be int; got 'many'"),
        (["data.format=tepid"], "data.format must be one of cold, warm"),
        (["model.precision=fp8"], "model.precision must be one of"),
        (["objective.q_schedule={name: linear, steps: 3}"], r"unknown key\(s\) \['steps'\]"),
        (["justakey"], "must look like section.key=value"),
        (["train.batch_size.x=1"], "train.batch_size is not a section|train.batch_size must be"),
        (["megatron.recompute_activations=true"], "megatron.recompute_activations needs model.backend=megatron"),
        (["megatron.tensor_parallel=2"], "megatron.tensor_parallel needs model.backend=megatron"),
        (["megatron.pipeline_parallel=2", "megatron.context_parallel=2"],
         "megatron.pipeline_parallel, megatron.context_parallel need model.backend=megatron"),
        (["megatron.distributed_optimizer=true"], "megatron.distributed_optimizer needs model.backend=megatron"),
        (["model.backend=megatron", "megatron.bf16_weights=true"],
         "megatron.bf16_weights=true keeps the fp32 master weights in the distributed optimizer: set "
         "megatron.distributed_optimizer=true"),
        (["model.backend=megatron", "megatron.sequence_parallel=true"], "megatron.sequence_parallel needs megatron.tensor_parallel > 1"),
        (["model.backend=megatron", "megatron.tensor_parallel=0"], "megatron.tensor_parallel must be >= 1"),
        (["rollout.engine=sglang"], "rollout.engine: unknown rollout engine 'sglang'; known: hf, native, vllm"),
        (["rollout.max_logprob_gap=0"], "rollout.max_logprob_gap must be > 0.0"),
        (["objective.importance=clip"],
         "objective.importance must be one of auto, none, plain, truncate, mask, token_truncate, geometric; got 'clip'"),
        (["objective.importance=off"], r"objective.importance must be str; got False \(YAML reads yes/no/on/off"),
        (["objective.importance_cap=0.5"], "objective.importance_cap must be >= 1.0"),
        (["objective.importance_bounds=[1.5, 2]"], r"objective.importance_bounds must be \[low, high\] with 0 <= low <= 1 <= high"),
        (["objective.name=sft", "objective.importance=truncate"], "objective.importance=truncate corrects sampled rollouts, "
         "but 'sft' takes no correction: set objective.importance=none"),
        (["objective.name=sft", "rollout.async_steps=1"], "rollout.async_steps=1 samples rollouts ahead, but 'sft'"),
        (["rollout.async_steps=2"], "rollout.async_steps must be >= 0 and <= 1"),
        (["train.micro_batch_rows=0"], "train.micro_batch_rows must be >= 1, or auto; got 0"),
        (["train.micro_batch_rows=autoo"], "train.micro_batch_rows must be >= 1, or auto; got 'autoo'"),
        (["train.micro_batch_rows=2.5"], "train.micro_batch_rows must be int; got 2.5"),
        (["rollout.tensor_parallel=2"], "rollout.tensor_parallel=2 splits a vLLM engine .*got native, hf, 1"),
        (["rollout.tensor_parallel=3", "rollout.engine=vllm", "model.path=m", "model.backend=megatron",
          "megatron.tensor_parallel=4"], "a megatron.tensor_parallel it divides"),
        (["optim.betas=[0.9, b]"], r"optim.betas\[1\] must be float; got 'b'"),
        (["objective.importance_bounds=[a, 2]"], r"objective.importance_bounds\[0\] must be float; got 'a'"),
        (["plugins=[1]"], r"plugins\[0\] must be str; got 1"),
        (["rollout.temperature=.inf"], "rollout.temperature must be a finite number; got inf"),
        (["optim.lr=nan"], "optim.lr must be a finite number; got 'nan'"),
        (["objective.importance_bounds=[0.5, .inf]"], r"objective.importance_bounds\[1\] must be a finite number"),
        (["train.collective_timeout_minutes=1e300"], r"train.collective_timeout_minutes must be > 0.0 and <= 10080.0; got 1e\+300"),
        (["train.seed=4294967296"], r"train.seed must be >= 0 and <= 4294967295; got 4294967296"),
        (["eval.num_samples=99999999999999999999999"],  # no upper bound of its own: torch's sizes are 64-bit (an overflow
         r"eval.num_samples must be a whole number within ±9223372036854775807 \(64 bits\)"),  # at the first validation)
        (["data.template={question}"], r"data.template must be str; got \{'question': None\} \(YAML reads \{...\} as a mapping: "
         r"quote the value, e.g. data.template='\"\{...\}\"'\)"),
        (["data.template={question} Answer:"], r"invalid YAML .*; fix the syntax there, or quote a text value: data.template="),
        (["objective.options={baseline: none, baseline: rloo}"], "key 'baseline' is given twice"),
        (["model.tiny.num_heads=3"], "model.tiny: hidden_size must split into num_heads heads of an even width"),
        (["model.tiny.num_kv_heads=3"], "and num_kv_heads divide num_heads; got hidden_size=128 num_heads=4 num_kv_heads=3"),
        (["model.tiny.hidden_size=2"], "got hidden_size=2 num_heads=4"),
        # an empty path: "none" (a tiny model) or the current folder (a run written among the user's files)
        (["model.path=''"], r"model.path is empty \(an unset shell variable\?\): give a path, or null \(its default\)"),
        (["train.run_dir=''"], r"train.run_dir is empty \(an unset shell variable\?\): give a path$"),
        (["data.name=jsonl", "data.source=' '"], "data.source is empty"),
        # YAML 1.1's octal and base 60: a seed of 010 trained as 8, 1:10 as 70
        (["train.seed=010"], r"010 reads as 8 in YAML \(an octal or base-60 number\): write 8 for that number, or quote it "
         'as text: "010"'),
        (["data.seed=1:10"], "1:10 reads as 70 in YAML"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_resume_takes_a_mapping_for_a_section_as_the_keys_it_sets():
    """``train={max_steps: 3}`` was refused with --resume ("train cannot change"), where ``train.max_steps=3`` is not."""
    from nemo_jq.config import keys_set_by
    from nemo_jq.runtime.runs import refuse_overrides

    assert keys_set_by("train={max_steps: 3, eval: 1}") == ["train.max_steps", "train.eval"]
    assert keys_set_by("objective.options={baseline: none}") == ["objective.options"]  # a value, not a section
    refuse_overrides(["train={max_steps: 3}", "eval.every=2"], ("train.max_steps", "eval.every"), "--resume", "why")
    with pytest.raises(ValueError, match=r"why; train=\{max_steps: 3, seed: 4\} cannot change with --resume"):
        refuse_overrides(["train={max_steps: 3, seed: 4}"], ("train.max_steps",), "--resume", "why")


def test_a_q_schedule_files_error_names_the_file_and_key(tmp_path):
    """``q must lie in [0, 1]; got q=1.5`` named neither the file nor its key (q_after)."""
    path = tmp_path / "sched.yaml"
    path.write_text("name: step\nswitch_step: 100\nq_after: 1.5\n")
    with pytest.raises(ConfigError, match=f"^objective.q_schedule={path}: q_after must lie in \\[0, 1\\] .*got q_after=1.5$"):
        load_config(None, [f"objective.q_schedule={path}"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, message", [
    (b"\xff\xfetrain:\n  max_steps: 1\n", "bad.yaml:1: not UTF-8 text \\(byte 0xff\\); save the file as UTF-8"),
    (b"train:\n  max_steps: 1\n  run_dir: r\ntrain:\n  max_steps: 1\n",
     "bad.yaml:4: key 'train' is given twice \\(first on line 1\\): keep one"),
    (b"train:\n  max_steps: 1\n  max_steps: 2\n", "bad.yaml:3: key 'train.max_steps' is given twice \\(first on line 2\\)"),
    (b"", "bad.yaml sets nothing \\(it is empty or only comments\\): add keys to it, or pass no --config"),
    (b"# train:\n#   max_steps: 1\n", "bad.yaml sets nothing"),
    (b"train:\n  seed: abc\n", "bad.yaml: train.seed must be int; got 'abc'"),  # the file named, not an override
    (b"train:\n  sed: 3\n", "bad.yaml: unknown config key 'train.sed'; did you mean 'train.seed'"),
    (b"train: 3\n", "bad.yaml: train must be a mapping of its keys; got 3"),  # before an override sets a key in it
    (b"model:\n  tiny: [1]\n", "bad.yaml: model.tiny must be a mapping of its keys; got \\[1\\]"),
    # a config with a key named `name` was taken for a q schedule, whose advice then failed
    (b"name: mine\ntrain:\n  seed: 1\n", "bad.yaml: unknown config key 'name'; did you mean"),
    (b"train:\n  seed: 0010\n", "bad.yaml:2:9: invalid YAML \\(0010 reads as 8 in YAML"),
])
def test_a_config_file_that_cannot_be_read_as_written_is_named_with_the_fix(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, ["train.max_steps=2"])
    with pytest.raises(ConfigError) as raised:  # an override's own error names no file
        path.write_text("train:\n  seed: 1\n")
        load_config(path, ["train.seed=abc"])
    assert str(raised.value) == "train.seed must be int; got 'abc'"


def test_a_yaml_alias_is_a_copy_of_its_anchor(tmp_path):
    """``eval: *r`` shared the mapping of ``rollout: &r``: an override of eval.every edited rollout too, and was
    refused as 'rollout.every'. Aliases that expand past a million values ("a billion laughs") are one line."""
    path = tmp_path / "anchored.yaml"
    path.write_text("rollout: &r\n  num_samples: 4\neval: *r\n")
    config = load_config(path, ["eval.every=3", "eval.num_samples=8"])
    assert (config.eval.every, config.eval.num_samples, config.rollout.num_samples) == (3, 8, 4)
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(6))
    path.write_text(laughs)
    with pytest.raises(ConfigError, match="anchored.yaml: its aliases expand to more than 1,000,000 values"):
        load_config(path)
    path.write_text("train: &x {max_steps: 3, a: *x}\n")  # a RecursionError's traceback
    with pytest.raises(ConfigError, match="anchored.yaml: an alias refers to the value that holds it"):
        load_config(path)


def test_a_config_path_that_is_a_directory_is_named(tmp_path):
    (tmp_path / "adir.yaml").mkdir()
    with pytest.raises(ConfigError, match="adir.yaml is a directory: it must be a YAML file"):
        load_config(tmp_path / "adir.yaml")


def test_every_example_config_loads():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[3] / "configs" / "examples").glob("*.yaml"))
    assert files
    for path in files:
        config = load_config(path)
        assert config.train.run_dir.startswith("runs/")


@pytest.mark.parametrize("old, new, value", [
    ("model.tensor_parallel=2", "megatron.tensor_parallel", 2),
    ("model.bf16_weights=true", "megatron.bf16_weights", True),
    ("guard.action=paft", "guard.action=switch_estimator", "switch_estimator"),
])
def test_renamed_keys_still_load_with_one_line_naming_the_new_key(capsys, old, new, value):
    extra = ["model.backend=megatron", "model.distributed_optimizer=true"] if "bf16" in old else ["model.backend=megatron"]
    config = load_config(None, [old, *extra])
    section, key = new.partition("=")[0].split(".")
    assert getattr(getattr(config, section), key) == value
    warnings = [line for line in capsys.readouterr().err.splitlines() if old.partition("=")[0] in line]
    assert len(warnings) == 1 and f"use {new}" in warnings[0] and "deprecated" in warnings[0]
    if old.startswith("guard"):
        assert config.guard.estimator == "paft"


def test_a_saved_config_with_the_old_layout_keys_reads_back_the_same(tmp_path):
    """Run directories written before 0.2 hold model.tensor_parallel etc.: they resume with the same layout."""
    old = dataclasses.asdict(load_config(None, ["model.backend=megatron", "megatron.tensor_parallel=2"]))
    from nemo_jq.models.megatron.layout import DEPRECATED_MODEL_KEYS

    old["model"].update({key: old["megatron"].pop(key) for key in DEPRECATED_MODEL_KEYS})  # the keys 0.1 had
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    assert load_config(path).megatron.tensor_parallel == 2


def test_a_file_that_sets_a_key_under_both_names_is_refused(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("model:\n  tensor_parallel: 2\nmegatron:\n  tensor_parallel: 4\n")
    with pytest.raises(ConfigError, match="model.tensor_parallel and megatron.tensor_parallel are both set: keep megatron"):
        load_config(path)


def test_the_synthetic_tasks_width_check_is_its_rationale_dependences():
    """data.rationale_dependence=none answers one digit, which data.answer_width=1 holds; operations' do not fit."""
    assert load_config(None, ["data.rationale_dependence=none", "data.answer_width=1"]).data.answer_width == 1
    with pytest.raises(ConfigError, match="data.answer_width=1 cannot hold operations answers"):
        load_config(None, ["data.rationale_dependence=operations", "data.answer_width=1"])
