"""The documented extension routes (docs/extending.md): a backend and an estimator, each a plugin file."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import TINY_RUN, one_line_error
from nemo_jq.cli import main
from nemo_jq.config import ConfigError, load_config
from nemo_jq.runtime.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
BIGRAM = Path(__file__).resolve().parents[1] / "plugins" / "bigram_backend.py"


@pytest.mark.slow
def test_a_backend_that_implements_only_the_protocols_trains_resumes_and_evaluates(tmp_path):
    """No HF model anywhere: the recipe trains a plain-torch bigram policy whose sampler is refitted each step."""
    from nemo_jq.recipe.trainer import Trainer

    overrides = [*TINY_RUN, f"plugins=[{BIGRAM}]", "model.backend=bigram", "objective.name=garl", "train.max_steps=4",
                 "optim.lr=0.05", f"train.run_dir={tmp_path / 'run'}"]
    trainer = Trainer(load_config(None, overrides))
    assert trainer.fit(max_steps=2) == {"step": 2}
    sampler = trainer.components.engine.engine.sampler
    assert sampler.refits == 2  # the initial weights, then step 1's (step 2's are not sampled from yet)
    assert sampler.table.abs().sum() > 0  # the trained weights reached it
    resumed = Trainer.resume(tmp_path / "run")
    result = resumed.fit()
    assert set(result["test"]) == {"p@1", "p@4", "m@4"}
    train = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in train)


def test_a_backend_missing_a_protocol_member_is_named_when_it_is_built(tmp_path):
    plugin = tmp_path / "half_backends.py"
    plugin.write_text(textwrap.dedent("""
        import types

        from nemo_jq.runtime.distributed import DataParallel
        from nemo_jq.backends import register_backend
        from nemo_jq.rollouts import register_sampler
        from nemo_jq.rollouts.refit import RefittedRolloutEngine


        class TrainsOnly:  # a Policy, but not a RefittablePolicy
            data_parallel = DataParallel()
            def token_logprobs(self, batch): ...
            def forward_backward(self, micro_batches, loss_fn): ...
            def optimizer_step(self): ...
            def set_learning_rate(self, lr): ...
            def save(self, directory): ...
            def load(self, directory, *, with_optimizer=True): ...
            def export(self, out_dir, tokenizer): ...


        class Engine:  # an engine that evaluation's calls (routes=False) would fail at the first evaluation
            tokens_generated, on_policy, lockstep = 0, False, False
            def generate(self, prompts, num_samples, *, sample_answers, generator, greedy=False): ...


        @register_backend("takes_no_routes")
        def takes_no_routes(request):
            return TrainsOnly(), Engine()


        @register_backend("no_refit")
        def no_refit(request):
            return TrainsOnly(), RefittedRolloutEngine(None, TrainsOnly())


        class SamplesOnly:  # a sampler its engine could not refit
            def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False): ...


        @register_sampler("no_load_weights")
        def no_load_weights(request):
            return SamplesOnly()


        @register_backend("no_export")
        def no_export(request):
            members = ("data_parallel", "token_logprobs", "forward_backward", "optimizer_step",
                       "set_learning_rate", "save", "load")
            return types.SimpleNamespace(**{name: getattr(TrainsOnly(), name) for name in members}), Engine()
    """))
    import torch

    from nemo_jq.recipe.components import build_components

    for backend, message in [("hf rollout.engine=no_load_weights", "rollout.engine=no_load_weights.s sampler "
                                                                   f"\\(SamplesOnly, {plugin}\\) does not implement Sampler: "
                                                                   "it lacks load_weights, tensor_parallel \\(docs/extending.md\\)$"),
                             ("no_refit", "does not implement RefittablePolicy: it lacks gathers_over_replicas, iter_hf, "
                                          "model_parallel_group, weights_version \\(docs/extending.md\\)$"),
                             ("no_export", "the policy of backend 'no_export' \\(SimpleNamespace\\) does not implement Policy: "
                                           "it lacks export \\(docs/extending.md\\)$"),
                             ("takes_no_routes", f"the rollout engine of backend 'takes_no_routes' \\(Engine, {plugin}\\) does not "
                                                 "implement RolloutEngine: it lacks generate\\(\\.\\.\\., routes=\\.\\.\\.\\) "
                                                 "\\(docs/extending.md\\)$")]:
        config = load_config(None, [*TINY_RUN, f"plugins=[{plugin}]", *f"model.backend={backend}".split()])
        with pytest.raises(TypeError, match=message):
            build_components(config, torch.device("cpu"))


def doc_example(holding: str) -> str:
    """The Python block of docs/extending.md that holds ``holding``: the tests run the documented code itself."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), flags=re.S)
    return next(block for block in blocks if holding in block)


def _cli(*args, env_path: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{env_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "nemo_jq.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.mark.slow
def test_a_one_file_estimator_in_a_package_trains_through_nemo_jq_train(tmp_path):
    package = tmp_path / "site" / "my_estimators"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "scaled.py").write_text(doc_example("class ScaledOptions:"))
    run_dir = tmp_path / "run"
    common = [*TINY_RUN, "plugins=[my_estimators.scaled]", "objective.name=scaled_reinforce"]
    bad = _cli("train", *common, "objective.options.scal=2", f"train.run_dir={run_dir}", env_path=tmp_path / "site")
    assert bad.returncode == 2 and "objective.options.scal is not an option of 'scaled_reinforce'" in bad.stderr
    assert "did you mean 'scale'" in bad.stderr and not run_dir.exists()
    done = _cli("train", *common, "objective.options.scale=2", "train.max_steps=2", f"train.run_dir={run_dir}",
                env_path=tmp_path / "site")
    assert done.returncode == 0, done.stderr[-2000:]
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["scale"] == 2.0 for r in train)
    assert json.loads((run_dir / "results.json").read_text())["objective"] == "scaled_reinforce"
    # the run remembers its plugins: resuming imports them again
    resumed = _cli("train", "--resume", run_dir, "train.max_steps=3", env_path=tmp_path / "site")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2, 3]


def test_a_plugin_that_does_not_import_is_one_line(tmp_path, capsys):
    code = main(["train", *TINY_RUN, "plugins=[no_such_plugin_module]", f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "plugins: cannot import 'no_such_plugin_module'" in err and not (tmp_path / "run").exists()
    # a module that imports but lacks a package of its own was "cannot import it: add its folder to PYTHONPATH"
    (tmp_path / "needs_more.py").write_text("import no_such_package_of_its_own\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ConfigError, match=f"plugins: needs_more failed to import: ModuleNotFoundError: No module named "
                                              f"'no_such_package_of_its_own' \\({tmp_path / 'needs_more.py'}:1\\)"):
            load_config(None, ["plugins=[needs_more]"])
    finally:
        sys.path.remove(str(tmp_path))
    # a run's plugin file moved since it trained: its saved config is as it was (the fix is where it points)
    from nemo_jq.config import save_config

    (tmp_path / "mine.py").write_text(ESTIMATOR.format(name="moving"))
    save_config(load_config(None, [f"plugins=[{tmp_path / 'mine.py'}]"]), tmp_path / "config.yaml")
    (tmp_path / "mine.py").rename(tmp_path / "moved.py")
    for name in [name for name in sys.modules if name.startswith("nemo_jq_plugin_mine_")]:  # as a new process has it
        del sys.modules[name]
    with pytest.raises(ConfigError, match="does not exist \\(the run trained with it\\): put it back there, or set "
                                          "plugins in the run's config.yaml to where it is now"):
        load_config(tmp_path / "config.yaml", saved=True)


def test_a_plugin_that_fails_to_import_is_one_line_naming_it_and_imports_once_fixed(tmp_path, capsys):
    """A syntax error was a traceback, and a .py plugin that failed once was skipped for the rest of the process (a
    notebook's fixed cell said "unknown objective"); two plugins of one file name in two folders: the second was
    skipped without a word."""
    plugin = tmp_path / "flaky.py"
    plugin.write_text("def broken(:\n")
    code = main(["train", *TINY_RUN, f"plugins=[{plugin}]", f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"plugins: {plugin} failed to import: SyntaxError" in err and "Traceback" not in err, err
    assert f"({plugin}:1)" in err and not (tmp_path / "run").exists()
    plugin.write_text(ESTIMATOR.format(name="fixed_one"))
    assert load_config(None, [f"plugins=[{plugin}]", "objective.name=fixed_one"]).objective.name == "fixed_one"
    for folder, name in (("a", "from_a"), ("b", "from_b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "plug.py").write_text(ESTIMATOR.format(name=name))
    plugins = f"plugins=[{tmp_path / 'a' / 'plug.py'},{tmp_path / 'b' / 'plug.py'}]"
    assert load_config(None, [plugins, "objective.name=from_b"]).objective.name == "from_b"
    taken = tmp_path / "taken.py"
    taken.write_text("from nemo_jq.data.qa import QATask, register_dataset\n\n"
                     "@register_dataset('synthetic')\nclass Mine(QATask):\n    name: str = 'synthetic'\n")
    code = main(["train", *TINY_RUN, f"plugins=[{taken}]", f"train.run_dir={tmp_path / 'run'}"])
    assert code == 2 and "dataset 'synthetic' is already registered (built in)" in capsys.readouterr().err
    (tmp_path / "twice.py").write_text(ESTIMATOR.format(name="from_a"))  # a name another plugin took: that plugin named
    code = main(["train", *TINY_RUN, f"plugins=[{tmp_path / 'twice.py'}]", f"train.run_dir={tmp_path / 'run'}"])
    one_line_error(code, capsys.readouterr().err, f"objective 'from_a' is already registered (by {tmp_path / 'a' / 'plug.py'})")
    script = tmp_path / "script.py"  # a script's code at import: its argument parsing exits (it ended the command, silent)
    script.write_text("import sys\nsys.exit(3)\n")
    code = main(["train", *TINY_RUN, f"plugins=[{script}]", f"train.run_dir={tmp_path / 'run'}"])
    one_line_error(code, capsys.readouterr().err, f"plugins: {script} exited as it was imported (SystemExit: 3)",
                   'if __name__ == "__main__":')
    assert not (tmp_path / "run").exists()


#: A one-file estimator, its name to fill in: each prompt's loss, as the trainer takes it.
ESTIMATOR = """\
from nemo_jq.objectives import ObjectiveOutput, register_objective, Need


@register_objective("{name}", needs={{Need.REFERENCE_ANSWER_LOGPROB}}, uses_q=False)
def estimator(inputs, options):
    loss = -inputs.answer_logprob.mean()
    return ObjectiveOutput(loss=loss, per_example=-inputs.answer_logprob.mean(-1), metrics={{}})
"""


@pytest.mark.parametrize("returned, message", [
    ("per_example=-inputs.answer_logprob, metrics={}", "returned per_example of shape [2, 4]: it must hold one loss a "
                                                        "prompt, shape [2] (average a prompt's M samples: .mean(-1))"),
    ("per_example=-inputs.answer_logprob.mean(-1), metrics={'step': 999.0}", "reports a metric 'step', a name a step's "
                                                                              "record holds itself: rename it"),
    ("per_example=-inputs.answer_logprob.mean(-1), metrics={'w': inputs.answer_logprob.mean()}",
     "reports its metric 'w' as Tensor: report a number"),
    # an AttributeError's traceback each
    ("per_example=[0.0, 0.0], metrics={}", "returned per_example as list and metrics as dict: per_example is a tensor"),
    ("per_example=-inputs.answer_logprob.mean(-1), metrics=None", "returned per_example as Tensor and metrics as NoneType"),
    # a NaN from the initial weights was "the run diverged ...: start it again with a lower optim.lr"
    ("per_example=-inputs.answer_logprob.mean(-1) * float('nan'), metrics={}",
     "computed it from the initial weights, so no learning rate is to blame")])
def test_an_estimators_output_the_trainer_cannot_take_is_one_line_naming_it(tmp_path, capsys, returned, message):
    """A [B, M] per_example trained with M times the gradient, and a metric named ``step`` overwrote the record's
    (its resume then dropped the run's training history), without a word."""
    plugin = tmp_path / "mine.py"
    plugin.write_text(ESTIMATOR.format(name="mine").replace("per_example=-inputs.answer_logprob.mean(-1), metrics={}",
                                                            returned))
    code = main(["train", *TINY_RUN, f"plugins=[{plugin}]", "objective.name=mine", "train.max_steps=1",
                 f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"objective 'mine' {message}" in err and "Traceback" not in err, err


def test_the_names_an_estimators_metric_may_not_take_are_those_a_steps_record_holds_without_it(tmp_path):
    """``learn.RECORD_KEYS`` (what ``check_output`` refuses as a metric's name) is every key a step's record holds
    when the estimator reports none: a name it lacks is overwritten without a word."""
    from nemo_jq.recipe.learn import RECORD_KEYS

    plugin = tmp_path / "mine.py"
    plugin.write_text(ESTIMATOR.format(name="mine"))
    assert main(["train", *TINY_RUN, f"plugins=[{plugin}]", "objective.name=mine", "train.max_steps=1",
                 f"train.run_dir={tmp_path / 'run'}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(record for record in records if record["kind"] == "train")
    assert set(step) <= RECORD_KEYS, sorted(set(step) - RECORD_KEYS)


def test_an_input_passed_as_an_option_is_refused_at_load_with_no_run_directory(tmp_path, capsys):
    """The exact command that used to fail at step 1 with a TypeError traceback."""
    code = main(["train", "objective.name=grpo", "objective.options.rewards=1", "train.max_steps=1",
                 f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("nemo-jq")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert "'rewards' is an input the trainer supplies to 'grpo', not an option" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_documented_dataset_prepares_through_a_plugin(tmp_path):
    plugin = tmp_path / "trivia.py"
    plugin.write_text(doc_example("class Trivia(QATask):"))
    rows = [{"id": i, "q": f"What is {i} plus one?", "a": str(i + 1)} for i in range(9)] + [{"id": 99, "q": "no answer"}]
    source = tmp_path / "trivia.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "prepared"
    done = _cli("data", "prepare", "--dataset", "trivia", "--plugin", plugin, "--source", source, "--sizes", "5,2,2",
                "--out", out, env_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 bad" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"] == "trivia" and manifest["plugin"] == str(plugin)
    assert len((out / "train.jsonl").read_text().splitlines()) == 5
    # its fixes name the plugin: "prepare it again" without --plugin could not run; a run without it, only "unknown"
    done = _cli("train", *TINY_RUN, f"data.prepared_dir={out}", f"train.run_dir={tmp_path / 'run'}", env_path=tmp_path)
    assert done.returncode == 2 and f"was prepared with the plugin that registers it (its manifest.json): add plugins=" \
        f"[{plugin}]" in done.stderr, done.stderr[-2000:]
    (out / "train.jsonl").write_text((out / "train.jsonl").read_text().replace('"answer": "', '"answer": 5, "x": "', 1))
    done = _cli("train", *TINY_RUN, f"plugins=[{plugin}]", f"data.prepared_dir={out}", f"train.run_dir={tmp_path / 'run'}",
                env_path=tmp_path)
    again = re.search(r"prepare the data again \((nemo-jq data prepare [^)]*)\)", done.stderr)
    assert done.returncode == 2 and again and f"--dataset trivia --plugin {plugin} " in again.group(1), done.stderr[-2000:]
    redone = _cli(*again.group(1).split()[1:], env_path=tmp_path)
    assert redone.returncode == 0 and "moved the earlier" in redone.stdout, redone.stderr[-2000:]


@pytest.mark.slow
def test_a_plugins_mistakes_as_it_runs_are_one_line_naming_it_and_its_line(tmp_path, capsys):
    """An estimator that returns a tuple (an AttributeError traceback), a detached loss (torch's "does not require
    grad" traceback), or raises (a line naming neither the estimator nor its file); a dataset whose build fails on a
    row (a KeyError traceback)."""
    plugin = tmp_path / "mistakes.py"
    plugin.write_text(ESTIMATOR.format(name="as_tuple").replace("return ObjectiveOutput(loss=loss, per_example=", "return (loss, ")
                      .replace(", metrics={})", ")")
                      + ESTIMATOR.format(name="detached").replace("loss = -inputs.answer_logprob.mean()",
                                                                 "inputs = inputs.__class__(**{**inputs.__dict__, "
                                                                 "'token_logprob': inputs.token_logprob.detach()})\n"
                                                                 "    loss = -inputs.answer_logprob.mean()")
                      + ESTIMATOR.format(name="raising").replace("    loss = -inputs", "    raise ValueError('my estimator "
                                                                 "broke')\n    loss = -inputs"))
    for name, said in (("as_tuple", "objective 'as_tuple' returned tuple: an estimator returns ObjectiveOutput("),
                       ("detached", "objective 'detached' returned a per_example loss with no gradient"),
                       ("raising", f"objective 'raising' ({plugin}:")):
        code = main(["train", *TINY_RUN, f"plugins=[{plugin}]", f"objective.name={name}", f"train.run_dir={tmp_path / name}"])
        line = one_line_error(code, capsys.readouterr().err, said)
        assert name != "raising" or "raised ValueError: my estimator broke; fix it there" in line
    dataset = tmp_path / "keyed.py"
    dataset.write_text("from dataclasses import dataclass\nfrom nemo_jq.data.base import Example\n"
                       "from nemo_jq.data.qa import QATask, register_dataset\n\n\n@register_dataset('keyed')\n@dataclass\n"
                       "class Keyed(QATask):\n    name: str = 'keyed'\n\n    def build(self, record):\n"
                       "        return Example(id=str(record['id']), question=record['qq'], answer=record['a'])\n")
    source = tmp_path / "keyed.jsonl"
    source.write_text('{"id": 1, "q": "x", "a": "y"}\n')
    code = main(["data", "prepare", "--dataset", "keyed", "--plugin", str(dataset), "--source", str(source), "--sizes",
                 "1,1,1", "--out", str(tmp_path / "prepared")])
    one_line_error(code, capsys.readouterr().err, f"{source}: row 1 (id 1): the build of dataset 'keyed' ({dataset}:12) "
                   "raised KeyError: 'qq'; fix it there")


def line_of(path: Path, needle: str) -> int:
    """The number of the first line of ``path`` that holds ``needle``."""
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


#: A dataset plugin whose reward is to fill in (``{reward}``: its body).
SCORED_DATASET = """\
from dataclasses import dataclass

from nemo_jq.data.base import Example
from nemo_jq.data.qa import QATask, register_dataset


@register_dataset("scored")
@dataclass
class Scored(QATask):
    name: str = "scored"

    def build(self, record):
        return Example(id=str(record["id"]), question=record["q"], answer=record["a"])

    def reward(self, output, example):
        {reward}
"""


@pytest.mark.parametrize("reward, said", [
    ("raise IndexError('my reward broke')", "raised IndexError: my reward broke; fix it there"),
    ("return None", "returned None (NoneType) for the output '9': return a number in [0, 1] (1 for a right answer)"),
    ("return 5.0", "returned 5.0 (float)"), ("return '1'", "returned '1' (str)"), ("return float('nan')", "returned nan")])
def test_a_dataset_plugins_reward_that_fails_or_is_no_reward_is_one_line_before_the_run(tmp_path, capsys, reward, said):
    """A reward that raised was a traceback after the run's steps (its first validation: no checkpoint kept); None a
    traceback; '1' "too many dimensions 'str'"; 5.0 trained without a word (and never counted as correct)."""
    plugin = tmp_path / "scored.py"
    plugin.write_text(SCORED_DATASET.format(reward=reward))
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"id": i, "q": f"what is {i}?", "a": str(i + 1)}) + "\n" for i in range(12)))
    code = main(["train", *TINY_RUN, f"plugins=[{plugin}]", "data.name=scored", f"data.source={source}",
                 "data.train_size=4", "data.validation_size=4", "data.test_size=4", f"train.run_dir={tmp_path / 'run'}"])
    where = line_of(plugin, "raise" if "raise" in reward else "def reward")  # the line it raised at, or its own
    one_line_error(code, capsys.readouterr().err, f"the reward of dataset 'scored' ({plugin}:{where}) {said}")
    assert not (tmp_path / "run").exists()


def test_a_plugins_definitions_are_held_to_what_it_declares_where_it_registers_them(tmp_path, capsys):
    """An option's default out of its own range trained a reversed loss; a Literal option was a TypeError whatever
    its value; a schedule's own check (an assert) and its q (a KeyError) were tracebacks; a refused in-place sampler
    left the built-in vLLM engine marked in place; a registration's error pointed into nemo_jq, not the plugin."""
    from nemo_jq.config import ConfigError
    from nemo_jq.rollouts import IN_PLACE, register_sampler

    plugin = tmp_path / "declared.py"
    plugin.write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from typing import Literal

        from nemo_jq.objectives import StepOnlyQ, register_q_schedule
        from nemo_jq.typed import option

        exec(open(__file__.replace("declared.py", "estimator.py")).read())


        @dataclass(frozen=True)
        class Modes:
            mode: Literal["a", "b"] = "a"


        register_objective("moded", needs={Need.REFERENCE_ANSWER_LOGPROB}, uses_q=False, options=Modes)(estimator)


        @register_q_schedule("strict")
        @dataclass
        class Strict(StepOnlyQ):
            start: float = 0.5

            def __post_init__(self):
                assert 0 <= self.start <= 1, "start must be in [0, 1]"

            def __call__(self, step):
                return {}["oops"] if self.start == 0.25 else self.start
    """))
    (tmp_path / "estimator.py").write_text(ESTIMATOR.format(name="plain"))
    assert load_config(None, [f"plugins=[{plugin}]", "objective.name=moded", "objective.options={mode: b}"])
    with pytest.raises(ConfigError, match="^objective.options.mode must be one of 'a', 'b'; got 'c'$"):
        load_config(None, [f"plugins=[{plugin}]", "objective.name=moded", "objective.options={mode: c}"])
    with pytest.raises(ConfigError, match=f"q schedule 'strict' \\({plugin}:{line_of(plugin, 'assert 0')}\\) raised "
                                          "AssertionError: start must be"):
        load_config(None, [f"plugins=[{plugin}]", "objective.q_schedule={name: strict, start: 1.5}"])
    code = main(["train", *TINY_RUN, f"plugins=[{plugin}]", "objective.q_schedule={name: strict, start: 0.25}",
                 f"train.run_dir={tmp_path / 'run'}"])
    one_line_error(code, capsys.readouterr().err,
                   f"objective.q_schedule Strict ({plugin}:{line_of(plugin, 'oops')}) raised KeyError: 'oops'")
    ranged = tmp_path / "ranged.py"
    ranged.write_text(ESTIMATOR.format(name="ranged").replace("uses_q=False)", "uses_q=False, options=Scale)").replace(
        "\n\n@register", "\n\n@dataclass(frozen=True)\nclass Scale:\n    scale: float = option(-1.0, 'a factor', gt=0.0)"
        "\n\n\n@register").replace("from nemo_jq", "from dataclasses import dataclass\nfrom nemo_jq.typed import option\n"
                                      "from nemo_jq", 1))
    with pytest.raises(ConfigError, match=f"objective 'ranged': the default of options.scale must be > 0.0; got -1.0 "
                                          f"\\({ranged}:{line_of(ranged, '@register')}\\)"):
        load_config(None, [f"plugins=[{ranged}]"])
    with pytest.raises(ValueError, match="rollout engine 'vllm' is already registered"):
        register_sampler("vllm", in_place=True)(lambda request: None)
    assert "vllm" not in IN_PLACE


def test_an_adaptive_q_over_an_estimator_that_reports_no_log_p_hat_is_said(tmp_path, capsys):
    """The adaptive rule reads log P̂ from the step's metrics: over a plugin estimator that reports none, q stayed at
    q_max for the whole run without a word."""
    plugin = tmp_path / "no_log_p.py"
    plugin.write_text(ESTIMATOR.format(name="no_log_p").replace("uses_q=False", "uses_q=True"))
    code = main(["train", *TINY_RUN, f"plugins=[{plugin}]", "objective.name=no_log_p", "train.max_steps=2",
                 "objective.q_schedule={name: adaptive}", f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 0 and err.count("objective.q_schedule adaptive reads log P̂, which objective.name=no_log_p does not "
                                   "report (no log_p_hat metric): q stays at its q_max") == 1, err


def test_a_q_schedule_of_ones_own_registered_in_a_plugin_sets_each_steps_q(tmp_path, capsys):
    """docs/extending.md's ``register_q_schedule`` block, as written: a dataclass of the step, its fields the config's
    keys (checked as the built-ins' are); the q it gives is each step's; a q outside [0, 1] stops the run in one line
    naming it and the step."""
    plugin = tmp_path / "halving.py"
    plugin.write_text(doc_example("class Halving(StepOnlyQ):"))
    run = ["train", *TINY_RUN, f"plugins=[{plugin}]", "objective.name=garl", "train.max_steps=3"]
    assert main([*run, "objective.q_schedule={name: halving, start: 0.8}", f"train.run_dir={tmp_path / 'a'}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [record["q"] for record in records if record["kind"] == "train"] == [0.8, 0.4, 0.2]
    code = main([*run, "objective.q_schedule={name: halving, stop: 1}", f"train.run_dir={tmp_path / 'b'}"])
    assert code == 2 and "unknown key(s) ['stop'] for q schedule 'halving'; allowed: ['start']" in capsys.readouterr().err
    # the doc's file has no `from __future__ import annotations`: its fields' types are types, checked all the same
    code = main([*run, "objective.q_schedule={name: halving, start: oops}", f"train.run_dir={tmp_path / 'typed'}"])
    one_line_error(code, capsys.readouterr().err, "q schedule 'halving': start must be a finite number; got 'oops'")
    assert not (tmp_path / "typed").exists()
    code = main([*run, "objective.q_schedule={name: halving, start: 2.0}", f"train.run_dir={tmp_path / 'c'}"])
    assert code == 2 and "objective.q_schedule Halving gave q=2.0 at step 0: a q schedule gives a number in [0, 1]" \
        in capsys.readouterr().err
