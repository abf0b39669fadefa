"""The recipe: estimator inputs, exact micro-batching, runs per estimator, resume, preemption."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import TINY_RUN, from_a_terminal, learn_on, machine_kind, one_line_error, run_cli
from nemo_jq.config import load_config, save_config
from nemo_jq.objectives import get_objective, list_objectives
from nemo_jq.recipe.experience import Experience
from nemo_jq.recipe.sequences import reference_answer_batch
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from nemo_jq.runtime.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"step_time", "rollout_tokens_per_s"}


def make_trainer(tmp_path, *overrides, name="run"):
    return Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / name}", *overrides]))


def test_trainer_passes_the_estimator_what_a_direct_call_gets(tmp_path):
    trainer = make_trainer(tmp_path, "objective.name=garl", "objective.q=0.5", "train.micro_batch_size=4")
    calls = []
    registered = trainer.objective.estimator.fn

    def recording(inputs, options):
        calls.append((inputs, options))
        return registered(inputs, options)

    trainer.objective.estimator = dataclasses.replace(trainer.objective.estimator, fn=recording)
    batches = []
    original = trainer.policy.forward_backward
    trainer.policy.forward_backward = lambda micro, fn: (batches.extend(micro), original(micro, fn))[1]
    examples = trainer.components.splits.train[:4]
    weights_before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    trainer.train_step(examples)
    trainer.policy.model.load_state_dict(weights_before)  # the step has updated them

    ((inputs, options),) = calls
    m = trainer.config.rollout.num_samples
    assert inputs.q == 0.5 and inputs.num_samples == m and inputs.rewards is None and inputs.generator is trainer.random.estimator
    assert options == get_objective("garl").options()  # the defaults: objective.options is empty
    (batch,) = batches
    # Direct: score every row with the model's own logits and sum each span.
    with torch.no_grad():
        logits = trainer.policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    token_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    direct_rationale = (token_lp * batch.rationale_mask).sum(-1).view(4, m)
    direct_answer = (token_lp * batch.answer_mask).sum(-1).view(4, m)
    torch.testing.assert_close(inputs.rationale_logprob.detach(), direct_rationale, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(inputs.answer_logprob.detach(), direct_answer, atol=1e-4, rtol=1e-5)
    # The global normaliser is the whole batch's target tokens per prompt.
    assert inputs.tokens_per_example == pytest.approx(float(batch.target_mask.sum()) / 4)
    # Each answer span is exactly its prompt's formatted y*.
    for row in range(batch.num_rows):
        targets = batch.input_ids[row, 1:][batch.answer_mask[row]].tolist()
        assert targets == trainer.components.chat.answer_ids(examples[row // m].answer)


@pytest.mark.parametrize("name, options", [("garl", ""), ("grpo", ""), ("grpo", "{scale_rewards: batch}"), ("sft", "")])
def test_micro_batching_gives_the_full_batch_gradient(tmp_path, name, options):
    trainer = make_trainer(tmp_path, f"objective.name={name}", *([f"objective.options={options}"] if options else []))
    parts = trainer.components
    examples = parts.splits.train[:4]
    prompts = parts.prompt_ids(examples)
    rollouts = parts.engine.generate(prompts, 4, sample_answers=True, generator=torch.Generator().manual_seed(0))
    answers = [parts.chat.answer_ids(e.answer) for e in examples]
    if name == "garl":
        batch, group, rewards = reference_answer_batch(rollouts, answers, parts.chat.think_end_id, parts.chat.pad_id), 4, None
    elif name == "grpo":
        from nemo_jq.recipe.sequences import sampled_answer_batch

        batch, group = sampled_answer_batch(rollouts, parts.chat.think_end_id, parts.chat.pad_id), 4
        rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    else:
        from nemo_jq.recipe.sequences import given_target_batch

        rationales = [parts.chat.rationale_ids(e.rationale) for e in examples]
        batch, group, rewards = given_target_batch(prompts, rationales, answers, parts.chat.think_end_id, parts.chat.pad_id), 1, None
    experience = Experience(batch, group, rewards, rollout_tokens=0, rollout_seconds=0.0)

    def gradient(micro_batch_size):
        trainer.config.train.micro_batch_size = micro_batch_size
        learn_on(trainer, experience, 0.5 if get_objective(name).uses_q else None, 4)
        grads = [p.grad.clone() for p in trainer.policy.model.parameters()]
        trainer.policy.optimizer.zero_grad(set_to_none=True)
        return grads

    for full, split in zip(gradient(4), gradient(1)):
        torch.testing.assert_close(full, split, atol=1e-6, rtol=1e-4)


#: The numbers of each estimator's three-step run (below), stored: a change in any of them is a change in what the
#: estimator computes (or in the run around it), to be made on purpose. Regenerate after one with
#: ``NEMO_JQ_WRITE_METRICS=1 python -m pytest tests/recipe/test_trainer.py -k "three_step or stand_in"`` and say why in the commit.
STORED_METRICS = Path(__file__).resolve().parents[1] / "fixtures" / "three_step_metrics.json"
STORED_KEYS = ("loss", "grad_norm", "log_p_hat", "train_reward", "rollout_tokens")
#: The stored file's entry of machine kinds' own numbers (docs/testing.md, "The stored three-step numbers").
MACHINE_KINDS = "_machine_kinds"


def stored_numbers(train: list[dict]) -> list[dict]:
    return [{key: r[key] for key in STORED_KEYS if r.get(key) is not None} for r in train]


def assert_stored_numbers(name: str, train: list[dict]) -> None:
    """The run's numbers are the stored ones: this machine kind's where ``MACHINE_KINDS`` holds its own for ``name``
    (an estimator whose three steps round differently on its CPU's kernels beyond 1e-5), else every machine's."""
    stored = json.loads(STORED_METRICS.read_text()) if STORED_METRICS.exists() else {}
    kinds = stored.setdefault(MACHINE_KINDS, {})
    mode = os.environ.get("NEMO_JQ_WRITE_METRICS")
    if mode == "1":
        stored[name] = stored_numbers(train)
    elif mode == "machine":
        kinds.setdefault(machine_kind(), {})[name] = stored_numbers(train)
    if mode in ("1", "machine"):
        STORED_METRICS.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    assert name in stored, f"no stored numbers for {name!r} in {STORED_METRICS} (see STORED_METRICS)"
    expected_steps = kinds.get(machine_kind(), {}).get(name, stored[name])
    for step, (got, expected) in enumerate(zip(stored_numbers(train), expected_steps, strict=True), start=1):
        assert got.keys() == expected.keys(), (name, step, got, expected)
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, step, key)  # GRPO's loss is ~0: rounding


@pytest.mark.parametrize("name", list_objectives())
def test_three_step_run_per_estimator(tmp_path, name):
    """Three steps of each registered estimator on the tiny run: they run and log what they should, and their
    numbers (loss, gradient norm, log p-hat, reward, rollout tokens per step) are the stored ones, to 1e-5."""
    trainer = make_trainer(tmp_path, f"objective.name={name}", "train.max_steps=3")
    result = trainer.fit()
    records = read_metrics(trainer.run_dir)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["step_time"] > 0
    if get_objective(name).uses_q or name == "rb_rloo":
        assert all(math.isfinite(r["log_p_hat"]) and "max_amplified_advantage" in r for r in train)
    if name in ("grpo", "rloo"):
        assert all(0.0 <= r["train_reward"] <= 1.0 for r in train)
    if name != "sft":  # sampled rollouts: the engine's log-probs agree with the policy's (fp32, same weights)
        assert all(0 <= r["logprob_gap"] <= r["max_logprob_gap"] < 1e-4 for r in train)
    assert [r["step"] for r in records if r["kind"] == "validation"] == [3]
    assert set(result["test"]) == {"p@1", "p@4", "m@4"}
    results = json.loads((trainer.run_dir / "results.json").read_text())
    validation = next(r["m@4"] for r in records if r["kind"] == "validation")
    assert (results["best_step"], results["best_validation"]) == ((3, validation) if validation > 0 else (None, None))
    assert results["tested"].startswith("the best validation m@4 (step 3)" if validation > 0 else "the latest (step 3)")
    assert latest_checkpoint(trainer.run_dir / "checkpoints").name == "step_00000003"
    assert (trainer.run_dir / "training.png").exists() and (trainer.run_dir / "config.yaml").exists()
    assert_stored_numbers(name, train)


def longer_earns_more(output: str, example) -> float:
    """A stand-in reward that differs between a group's samples (the tiny model's answers are random tokens, which
    match no reference, not even in part): the longer the sampled answer, the more it earns."""
    return len(output) / (1 + len(output))


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_the_reward_estimators_numbers_with_a_stand_in_reward(tmp_path, name):
    """The tiny model earns no exact-match reward in three steps, so GRPO's and RLOO's numbers above are all 0 and
    show no drift: here the task's reward is :func:`longer_earns_more` (everything else as above), and their numbers
    are the stored ones, to 1e-5."""
    trainer = make_trainer(tmp_path, f"objective.name={name}", "train.max_steps=3", "eval.every=1000")
    trainer.components.task.reward = longer_earns_more
    trainer.fit()
    train = [r for r in read_metrics(trainer.run_dir) if r["kind"] == "train"]
    assert all(r["grad_norm"] > 0 for r in train)  # rewards that differ within a group: a gradient to check
    assert_stored_numbers(f"{name} (stand-in reward)", train)


def test_an_off_policy_gap_above_the_threshold_warns(tmp_path, capsys):
    make_trainer(tmp_path, "rollout.engine=hf", "rollout.max_logprob_gap=1e-12", "train.max_steps=1").fit()
    assert "warning: step 1: the rollouts are off-policy" in capsys.readouterr().out


def _without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.mark.parametrize("name", ["paft", "grpo"])
def test_resume_continues_exactly(tmp_path, name):
    uninterrupted = make_trainer(tmp_path, f"objective.name={name}", "train.max_steps=5", name="a")
    uninterrupted.fit()
    interrupted = make_trainer(tmp_path, f"objective.name={name}", "train.max_steps=5", name="b")
    assert interrupted.fit(max_steps=3) == {"step": 3}
    del interrupted
    Trainer.resume(tmp_path / "b").fit()
    assert _without_timing(read_metrics(tmp_path / "a")) == _without_timing(read_metrics(tmp_path / "b"))
    a = load_checkpoint(latest_checkpoint(tmp_path / "a" / "checkpoints"), uninterrupted.policy, with_optimizer=False)
    assert a[0]["step"] == 5


def test_a_signal_during_the_ends_evaluation_stops_the_run_and_its_resume_evaluates_again(tmp_path):
    """A stop signal in the end's test evaluation (after the last step's checkpoint) was taken as "finish this step":
    the evaluation went on (a minute at eval.num_samples=1024), results.json was written and the command ended 0 (an
    experiment's last run ended the experiment). It stops before the next generation call, writing nothing; the run
    is not finished, and its resume evaluates the end again."""
    from nemo_jq.runtime.preemption import StopSignals

    trainer = make_trainer(tmp_path, "train.max_steps=2", "eval.every=1000", "eval.batch_size=1")
    evaluate = trainer.evaluator.evaluate

    def signalled(split, *args, **options):
        if split == "test":
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(split, *args, **options)

    trainer.evaluator.evaluate = signalled
    with StopSignals() as stop:
        assert trainer.fit(stop=stop) == {"preempted": signal.SIGTERM, "step": 2}
    assert not (tmp_path / "run" / "results.json").exists()
    resumed = Trainer.resume(tmp_path / "run")
    assert resumed.finished() is None and resumed.fit()["step"] == 2 and (tmp_path / "run" / "results.json").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
@pytest.mark.slow
def test_a_signal_writes_a_loadable_checkpoint_and_exits_zero(tmp_path, signum):
    run_dir = tmp_path / "preempted"
    args = [sys.executable, "-m", "nemo_jq.cli", "train", *TINY_RUN, "train.epochs=50", "train.save_every=1000",
            "eval.every=1000", f"train.run_dir={run_dir}"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=from_a_terminal)
    deadline = time.time() + 120
    while time.time() < deadline and not any(r["kind"] == "train" for r in read_metrics(run_dir)):
        time.sleep(0.2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert f"nemo-jq train: stopped by {signum.name} at step {int(checkpoint.name.split('_')[1])} with a checkpoint; " \
        f"`nemo-jq train --resume {run_dir}` continues" in out.decode() and '"preempted"' not in out.decode(), out
    trainer = Trainer.resume(run_dir)
    assert trainer.state.step == int(checkpoint.name.split("_")[1]) >= 1
    assert trainer.state.step < trainer.total_steps


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="a pseudo-terminal needs fork")
def test_a_run_whose_terminal_closes_stops_with_a_checkpoint(tmp_path):
    """``nemo-jq train`` on a terminal (a pseudo-terminal here, stdout and stderr both) that goes away mid-run: SIGHUP,
    and every later write to it fails (EIO), the stop's own line included. The run writes its checkpoint and exits 0
    (it was killed by SIGHUP before, with no checkpoint; with the signal handled but the lines still written to the
    terminal, it failed with "Input/output error" after its checkpoint)."""
    import pty
    import select

    run_dir = tmp_path / "hung_up"
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the command, its terminal the pseudo-terminal
        os.environ["OMP_NUM_THREADS"] = "1"
        from_a_terminal()
        os.execv(sys.executable, [sys.executable, "-m", "nemo_jq.cli", "train", *TINY_RUN, "train.epochs=50",
                                  "train.save_every=1000", "eval.every=1000", f"train.run_dir={run_dir}"])
    deadline = time.time() + 120
    while time.time() < deadline and not any(r["kind"] == "train" for r in read_metrics(run_dir)):
        if select.select([terminal], [], [], 0.2)[0]:
            os.read(terminal, 1 << 16)  # what it says while it trains, read as a terminal would
    os.close(terminal)  # the window closes
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    trainer = Trainer.resume(run_dir)
    assert trainer.state.step == int(checkpoint.name.split("_")[1]) >= 1
    assert trainer.state.step < trainer.total_steps  # stopped by the hang-up, not at the end


def test_a_second_ctrl_c_says_which_checkpoint_the_run_goes_on_from(tmp_path, capsys, monkeypatch):
    """A second Ctrl-C raises KeyboardInterrupt mid-step (StopSignals); train exits 130 naming the last checkpoint
    written, or saying there is none. Here fit is interrupted by hand: two real signals coalesce when they arrive
    together, and one apart races the checkpoint the first asks for."""
    def interrupted(self, **_):
        if self.config.train.save_every == 1:
            self.save()
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", interrupted)
    for save_every, said in ((1, "the last checkpoint written, {run}/checkpoints/step_00000000, is intact (this step's "
                                 "is not written): `nemo-jq train --resume {run}` continues from it"),
                             (1000, "{run} has no checkpoint yet: the next start there moves it aside and begins afresh")):
        run_dir = tmp_path / f"every_{save_every}"
        code, _, err = run_cli(capsys, "train", *TINY_RUN, f"train.save_every={save_every}", f"train.run_dir={run_dir}")
        assert code == 130 and f"nemo-jq train: interrupted; {said.format(run=run_dir)}" in err, err


def test_a_crash_mid_save_leaves_the_last_good_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path)
    good = trainer.save()
    trainer.state.step = 7

    def crash(directory):
        (Path(directory) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt  # as if killed while writing

    trainer.policy.save = crash
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    root = trainer.run_dir / "checkpoints"
    assert latest_checkpoint(root) == good
    assert list(root.glob(".tmp-*"))  # the partial write is only in a temporary directory
    state, _ = load_checkpoint(good, make_trainer(tmp_path, name="other").policy)
    assert state["step"] == 0


def test_a_crash_in_the_end_evaluation_is_evaluated_again_on_resume(tmp_path):
    """Killed in its test evaluation after a resume that trained on, a run kept the earlier end's results.json, and
    every later --resume said it had nothing left to train."""
    schedule = "objective.q_schedule={name: linear, num_steps: 3, q_start: 1, q_end: 0}"
    make_trainer(tmp_path, schedule, "train.max_steps=2", "eval.every=1000").fit()
    crashing = Trainer.resume(tmp_path / "run", ["train.max_steps=3"])
    evaluate = crashing.evaluator.evaluate

    def killed_in_test(split, **options):
        if split == "test":
            raise KeyboardInterrupt(split)
        return evaluate(split, **options)

    crashing.evaluator.evaluate = killed_in_test
    with pytest.raises(KeyboardInterrupt, match="test"):
        crashing.fit()
    resumed = Trainer.resume(tmp_path / "run")
    assert resumed.finished() is None
    results = resumed.fit()
    assert results["step"] == 3 == json.loads((tmp_path / "run" / "results.json").read_text())["step"]
    assert results["final_q"] == [r["q"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"][-1]
    assert "nothing left to train" in Trainer.resume(tmp_path / "run").finished()
    # as a sweep counts it: results written before they named their step are this step's; cut short, they are not
    results_file = tmp_path / "run" / "results.json"
    results_file.write_text(json.dumps({key: value for key, value in results.items() if key != "step"}))
    assert "nothing left to train" in Trainer.resume(tmp_path / "run").finished()
    results_file.write_text(json.dumps(results)[:-1])
    assert Trainer.resume(tmp_path / "run").finished() is None


def test_missing_checkpoint_files_are_named(tmp_path):
    trainer = make_trainer(tmp_path)
    path = save_checkpoint(tmp_path / "ck", 1, trainer.policy, {"step": 1}, {})
    (path / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        load_checkpoint(path, trainer.policy)
    with pytest.raises(FileNotFoundError, match="not a run directory: no config.yaml"):
        Trainer.resume(trainer.run_dir)
    trainer.run_dir.mkdir(exist_ok=True)  # the trainer holds its directory (a lock file in it) from the start
    save_config(trainer.config, trainer.run_dir / "config.yaml")
    with pytest.raises(FileNotFoundError, match="has no checkpoint"):
        Trainer.resume(trainer.run_dir)


@pytest.mark.slow
def test_eval_and_export_commands(tmp_path):
    trainer = make_trainer(tmp_path, "train.max_steps=2", "train.tensorboard=true")
    trainer.fit()
    assert list((trainer.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    def run(*a):
        return subprocess.run([sys.executable, "-m", "nemo_jq.cli", *a], cwd=ROOT, capture_output=True, text=True, timeout=300)
    result = run("eval", str(trainer.run_dir), "--split", "validation", "eval.num_samples=2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"split", "run_dir", "run_id", "checkpoint", "step", "selected", "p@1", "p@2", "m@2",
                           "sampled_with"}
    assert report["run_id"] == trainer.run_id and len(trainer.run_id) == 32
    assert (report["sampled_with"]["eval.num_samples"], report["sampled_with"]["eval.batch_size"]) == (
        2, trainer.config.eval.batch_size)
    assert json.loads((trainer.run_dir / "evals" / f"validation-step_{report['step']:08d}.json").read_text()) == report
    result = run("export", str(trainer.run_dir), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").convert_tokens_to_ids("</think>") == trainer.components.chat.think_end_id
    torch.testing.assert_close(model.state_dict()["lm_head.weight"], trainer.policy.model.state_dict()["lm_head.weight"])
    # the export's model card: the method, the checkpoint and why, its test scores, the budgets, the whole config
    card = (tmp_path / "hf" / "README.md").read_text()
    results = json.loads((trainer.run_dir / "results.json").read_text())
    step = json.loads((tmp_path / "hf" / "nemo_jq_export.json").read_text())["source"]["step"]
    assert f"with **garl** (q = {trainer.config.objective.q:g})" in card and f", step {step}" in card
    assert "- test (the run's own evaluation of this checkpoint): " + ", ".join(
        f"{key} {value:.1f}" for key, value in results["test"].items()) in card
    assert f"a thinking budget of {trainer.config.rollout.max_thinking_tokens} tokens" in card
    assert card.split("```yaml\n")[1].split("```")[0] == (trainer.run_dir / "config.yaml").read_text()
    assert "README.md" in json.loads((tmp_path / "hf" / "nemo_jq_export.json").read_text())["files"]
    assert run("export", str(trainer.run_dir), "--out", str(tmp_path / "hf"), "--step", "latest").returncode == 0
    result = run("eval", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "neither a checkpoint" in result.stderr


def test_training_from_a_local_hf_folder(tmp_path):
    source = make_trainer(tmp_path, name="source")
    source.policy.export(tmp_path / "hf", source.components.tokenizer)
    trainer = make_trainer(tmp_path, f"model.path={tmp_path / 'hf'}", "train.max_steps=1", name="from_folder")
    torch.testing.assert_close(trainer.policy.model.state_dict()["lm_head.weight"], source.policy.model.state_dict()["lm_head.weight"])
    assert trainer.components.tokenizer.get_vocab() == source.components.tokenizer.get_vocab()
    trainer.fit()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_trainer(tmp_path, f"model.path={tmp_path / 'absent_model'}", name="missing")


@pytest.mark.slow
def test_a_hub_name_resolves_to_its_cached_snapshot_offline_and_an_uncached_one_is_one_line(tmp_path):
    """C2: a hub name used to reach the megatron backend as "no local folder", so every rank built an fp32 copy on CPU;
    now it resolves once to the Hugging Face cache's snapshot folder (no network: HF_HUB_OFFLINE)."""
    source = make_trainer(tmp_path, name="source")
    snapshot = tmp_path / "hub" / "models--org--tiny-qwen3" / "snapshots" / "0123abcd"
    source.policy.export(snapshot, source.components.tokenizer)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def train(name: str, run: str):
        return subprocess.run([sys.executable, "-m", "nemo_jq.cli", "train", *TINY_RUN, f"model.path={name}",
                               "train.max_steps=1", "eval.every=1000", f"train.run_dir={tmp_path / run}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    done = train("org/tiny-qwen3", "cached")
    assert done.returncode == 0, done.stderr[-2000:]
    assert load_config(tmp_path / "cached" / "config.yaml").model.path == "org/tiny-qwen3"  # the name, not the cache path
    missing = train("org/not-downloaded", "missing")
    error = one_line_error(missing.returncode, missing.stderr, "model.path=org/not-downloaded is not in the local "
                           "Hugging Face cache", "huggingface-cli download org/not-downloaded")
    assert error and not (tmp_path / "missing").exists()


def test_each_step_logs_its_own_gpu_peak_and_a_cpu_step_none(tmp_path, monkeypatch):
    """On CUDA every step's record carries the most GPU memory allocated since that step began, the fullest rank's, to
    hold a real run against ``plan`` and the dry run. No GPU here: torch.cuda's two counters are stand-ins below,
    behind the real device-type check; a CPU step records no such key (not a made-up 0)."""
    from nemo_jq.models import common

    counter = {"peak": 0, "resets": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: counter.update(peak=0, resets=counter["resets"] + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: counter["peak"])
    cuda = torch.device("cuda")
    common.reset_peak_memory(cuda)
    counter["peak"] = 3 * 2**30
    assert common.peak_memory_gib(cuda) == 3.0 and counter["resets"] == 1
    assert common.peak_memory_gib(torch.device("cpu")) is None
    common.reset_peak_memory(torch.device("cpu"))
    assert counter["resets"] == 1

    trainer = make_trainer(tmp_path, "train.max_steps=2", "eval.every=1000")
    trainer.fit()
    assert all("gpu_peak_gib" not in r for r in read_metrics(trainer.run_dir) if r["kind"] == "train")
    steps = iter([1.5, 2.5])
    monkeypatch.setattr("nemo_jq.recipe.trainer.peak_memory_gib", lambda device: next(steps))
    monkeypatch.setattr("nemo_jq.recipe.trainer.reset_peak_memory", lambda device: counter.update(resets=counter["resets"] + 1))
    trainer = make_trainer(tmp_path, "train.max_steps=2", "eval.every=1000", name="on_gpu")
    trainer.fit()
    assert [r["gpu_peak_gib"] for r in read_metrics(trainer.run_dir) if r["kind"] == "train"] == [1.5, 2.5]
    assert counter["resets"] == 3  # once at each step's start


def test_a_megatron_checkpoint_whose_layout_its_processes_cannot_hold_is_told_the_keys_that_place_it():
    """eval, generate and export load a checkpoint at any layout; one trained at PP=2 or EP=2, exported in one
    process, was told only to use more processes."""
    from nemo_jq.recipe.components import _layout_runs_here
    from nemo_jq.typed import ConfigError

    for layout, command, placing in (
            (["megatron.pipeline_parallel=2"], "export", ["megatron.pipeline_parallel=1"]),
            (["megatron.expert_parallel=2"], "eval", ["megatron.expert_parallel=1"]),
            (["megatron.tensor_parallel=2", "megatron.sequence_parallel=true"], "eval",
             ["megatron.tensor_parallel=1", "megatron.sequence_parallel=false"])):
        config = load_config(None, ["model.backend=megatron", *layout])
        with pytest.raises(ConfigError, match=f"; or place the checkpoint here: {command} loads it at any layout "
                                              f"\\({' '.join(placing)} for one process\\)"):
            _layout_runs_here(config, command)
        _layout_runs_here(load_config(None, ["model.backend=megatron", *layout, *placing]), command)  # the keys place it
    _layout_runs_here(load_config(None, ["model.backend=megatron"]), "generate")
