"""`nemo-jq experiment escape-rates`: its bookkeeping on scripted runs, its knob and optimizer, and the quick size."""

import json
import math
import random
import re

import pytest
import torch

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.config import ConfigError, load_config
from nemo_jq.data import SyntheticArithmetic
from nemo_jq.experiments import escape_rates
from nemo_jq.experiments.common import Progress
from nemo_jq.experiments.escape_rates import escape, fit_line, growth, run_experiment, step_log_p, theory_time, time_scale
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.monitor import read_metrics


def train_records(log_ps, **extra):
    return [{"kind": "train", "step": step, "log_p_hat": value, **extra} for step, value in enumerate(log_ps, 1)]


def test_escape_is_the_first_step_past_the_threshold_and_a_run_that_never_passes_it_by_the_cap_is_censored():
    records = [*train_records([-30.0, -12.0, -5.0, -4.9, -8.0]), {"kind": "validation", "step": 5}]
    assert escape(records, -5.0, cap=10) == {"steps": 4, "censored": False, "log_p0": -30.0}  # strictly above
    assert escape(records, -5.0, cap=3) == {"steps": 3, "censored": True, "log_p0": -30.0}  # past the cap: censored
    assert escape(records, -1.0, cap=10)["censored"]
    grpo = [{"kind": "train", "step": 1, "train_reward": 0.0}, {"kind": "train", "step": 2, "train_reward": 1 / 32}]
    assert [step_log_p(r) for r in grpo] == [-math.inf, math.log(1 / 32)]  # GRPO: log of the mean reward
    assert escape(grpo, -5.0, cap=10) == {"steps": 2, "censored": False, "log_p0": -math.inf}
    with pytest.raises(ValueError, match="without train records"):
        escape([{"kind": "validation", "step": 1}], -5.0, cap=10)


def test_fits_recover_a_known_law_and_the_time_scale_maps_the_theory_onto_steps():
    assert fit_line([1.0, 2.0, 3.0], [5.0, 7.0, 9.0]) == pytest.approx({"slope": 2.0, "intercept": 3.0, "points": 3})
    assert fit_line([2.0, 2.0], [1.0, 3.0]) is None  # one p0: no growth to fit
    runs = [{"width": w, "log_p0": -x, "steps": math.exp(0.25 * x + 1.0), "censored": False}
            for w, x in ((2, 12.0), (3, 16.0), (4, 20.0))]
    runs.append({"width": 5, "log_p0": -40.0, "steps": 300, "censored": True})  # censored runs are not fitted
    fitted = growth(0.75, runs)
    assert fitted["fit"]["slope"] == pytest.approx(0.25) and fitted["fit"]["points"] == 3 and fitted["theory_slope"] == 0.25
    linear = growth(1.0, [{"width": w, "log_p0": -x, "steps": 3 * x, "censored": False} for w, x in ((2, 10.0), (3, 20.0))])
    assert linear["fit"]["slope"] == pytest.approx(3.0) and linear["theory_slope"] is None
    one_width = [{"width": 2, "log_p0": -x, "steps": s, "censored": False} for x, s in ((12.0, 150), (12.4, 140))]
    assert growth(0.75, one_width)["fit"] is None  # the seeds' p0 at one width carry no slope
    # q = 1 runs that take exactly 7 steps per unit of gradient-flow time give a scale of 7
    q1 = [{"log_p0": -x, "steps": 7 * theory_time(1.0, -x), "censored": False} for x in (15.0, 25.0)]
    assert time_scale([*q1, {"log_p0": -30.0, "steps": 5, "censored": True}]) == pytest.approx(7.0)
    assert time_scale([{"log_p0": -30.0, "steps": 5, "censored": True}]) is None
    assert theory_time(0.5, -20.0) > 100 * theory_time(1.0, -20.0)  # the separation the experiment tests


def test_the_experiment_places_runs_at_the_measured_p0_fits_and_censors(tmp_path, monkeypatch):
    """A scripted trainer whose runs escape on a known law: q=1 after 2 steps per nat of log(p0/δ), q=0.5 after
    e^{0.5·log(1/p0)}/134 steps, GRPO never (its P̂ is a reward: log 0 at the first step); p0 = e^{-6·W - seed/10}."""
    monkeypatch.setattr(escape_rates, "OPTIMIZERS", {"SGD": ["optim.name=sgd", "optim.lr=1"]})

    def scripted(overrides, cap):
        knobs = dict(item.split("=", 1) for item in overrides)
        log_p0 = -6.0 * int(knobs["data.answer_width"]) - int(knobs["train.seed"]) / 10
        method = knobs["objective.name"] if knobs["objective.name"] == "grpo" else float(knobs["objective.q"])
        if method == "grpo":
            return [{"kind": "train", "step": s, "train_reward": 0.0} for s in range(1, cap + 1)]
        steps = round(2 * (-5.0 - log_p0)) if method == 1.0 else round(math.exp(-0.5 * log_p0) / 134)
        log_ps = [log_p0] + [log_p0 / 2] * (steps - 2) + [-4.0] if steps <= cap else [log_p0] * cap
        return train_records(log_ps)

    summary = run_experiment(tmp_path / "out", seeds=[0, 1, 2], widths=[2, 3, 4], cap=100, only=["GRPO", "q=0.5", "q=1"],
                             train=scripted)
    assert summary["log_p0"]["3"]["mean"] == pytest.approx(-18.1)  # measured from the GARL runs, not assumed
    rows = summary["optimizers"]["SGD"]["methods"]
    assert rows["q=1"]["growth"]["fit"]["slope"] == pytest.approx(2.0, abs=0.1)
    assert {key: rows["q=1"]["widths"]["4"][key] for key in ("escaped", "runs", "mean", "sd")} == {
        "escaped": 3, "runs": 3, "mean": 38, "sd": 0}
    half = rows["q=0.5"]
    assert half["widths"]["2"]["escaped"] == 3 and half["widths"]["4"]["escaped"] == 0  # e^12/134 = 1215 > cap: censored
    assert half["growth"]["fit"]["slope"] == pytest.approx(0.5, abs=0.05) and half["growth"]["theory_slope"] == 0.5
    assert rows["GRPO"]["widths"]["2"]["escaped"] == 0 and rows["GRPO"]["growth"]["fit"] is None
    grpo_run = summary["runs"]["SGD"]["GRPO"][0]
    assert grpo_run["log_p0"] == pytest.approx(-12.0) and grpo_run["censored"]  # placed at its width and seed's p0
    scale = summary["optimizers"]["SGD"]["steps_per_unit_time"]
    assert scale == pytest.approx(2.0, rel=0.1)  # 2 steps per nat, and T_1 is log(δ/p0) plus a little
    assert half["widths"]["4"]["theory_steps"] > 100 * rows["q=1"]["widths"]["4"]["theory_steps"]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| SGD | GRPO | >100 [" in table and "W=3: log p0 -18.1" in table
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["cap"] == 100
    assert (tmp_path / "out" / "escape_rates.png").stat().st_size > 0
    # GRPO's log p0 (log of no reward) is JSON every reader takes, and the record read back for a resume holds -inf
    for name in ("summary.json", "experiment.json"):
        json.loads((tmp_path / "out" / name).read_text(), parse_constant=lambda word: pytest.fail(f"{name}: {word}"))
    recorded = Progress.read(tmp_path / "out", "escape-rates").runs
    assert [run["log_p0"] for key, run in recorded.items() if "/GRPO/" in key] == [-math.inf] * 9


#: Per experiment: options that keep it small, then bad input and what its one-line error must say.
REFUSED = {
    "escape-rates": (["--methods", "q=1", "--widths", "2"], [
        (["--seeds", "0", "0"], ["--seeds: 0 is given twice, which would train one run twice: drop one"]),
        (["--widths", "2", "3", "2"], ["--widths: 2 is given twice"]),
        (["--methods", "q=1,GRPO,q=1"], ["--methods: q=1 is given twice"]),
        (["objective.q=0.3"], ["override objective.q=0.3", "sets objective.q per method", "use --methods"]),
        (["data.answer_width=4"], ["sets data.answer_width per width", "use --widths"]),
        (["train.run_dir=elsewhere"], ["sets train.run_dir", "use --out"]),
        (["train={seed: 3}"], ["sets train.seed per seed", "use --seeds"]),
        (["optim.lr=0.001"], ["sets optim.lr per optimizer", "drop it"]),
        # a run stopped before the cap was reported censored at it
        (["train.max_steps=2"], ["sets train.max_steps to --cap", "use --cap"]),
        (["--widths", "1"], ["--widths (data.answer_width of its runs): data.answer_width=1 cannot hold"])]),
    "noisy-cold-start": (["--methods", "q=1"], [
        (["--seeds", "1", "0", "1", "1"], ["--seeds: 1 is given 3 times, which would train one run 3 times: drop all but one"]),
        (["--methods", ","], ["--methods: an empty name (a comma too many?); choose from 'GRPO'"]),
        (["data.label_noise=0.3"], ["sets data.label_noise from --label-noise", "use --label-noise"]),
        (["data.seed=4"], ["sets data.seed per seed", "use --seeds"]),
        (["objective.q_schedule={name: linear, num_steps: 4}"], ["sets objective.q_schedule per method"]),
        # no training label made wrong: it trained a run, then failed on its memorisation ("error: memorisation")
        (["--label-noise", "0"], ["--label-noise 0 makes none of the 24 training labels wrong", "at least 0.042"]),
        (["--label-noise", "1.5"], ["--label-noise (data.label_noise of its runs): data.label_noise must be"]),
        (["--methods", "adaptive", "--adaptive", "foo=1"], ["--adaptive (objective.q_schedule of its runs)",
                                                           "unknown key(s) ['foo']"])]),
    "warm-start": (["--methods", "GRPO", "--dependences", "none"], [
        (["--dependences", "none", "sum", "none"], ["--dependences: none is given twice"]),
        (["--methods", "GRPO,PAFT q=0.25,GRPO"], ["--methods: GRPO is given twice"]),
        (["data.rationale_dependence=sum"], ["sets data.rationale_dependence per setting", "use --dependences"]),
        (["train.seed=1"], ["sets train.seed per seed", "use --seeds"]),
        (["--methods-override", "objective.q=0.5"], ["--methods-override objective.q=0.5", "use --methods"]),
        (["--methods-override", "model.path=elsewhere"], ["sets model.path to the warm policy", "drop it"])]),
}


def test_each_experiment_refuses_repeated_values_and_overrides_of_keys_its_runs_set_before_anything_is_written(
        tmp_path, capsys, monkeypatch):
    """A seed given twice used to train its runs, then die at the second one's folder (`--resume`, the wrong fix); an
    override of a key each run sets was ignored yet recorded among the settings."""
    def refuse_to_train(config):
        raise AssertionError("a run started")

    monkeypatch.setattr("nemo_jq.recipe.trainer.Trainer", refuse_to_train)
    monkeypatch.chdir(tmp_path)  # where train.run_dir=elsewhere would land
    for name, (small, cases) in REFUSED.items():
        for extra, fragments in cases:
            base = without_options([*small, "--seeds", "0"], {word for word in extra if word.startswith("--")})
            one_line_error(*run_cli(capsys, "experiment", name, "--out", "out", *base, "--quick", *extra)[::2], *fragments)
    assert not list(tmp_path.iterdir())


def without_options(words: list[str], options: set[str]) -> list[str]:
    """``words`` less each of ``options`` and its values (a case gives it instead: an option is given once)."""
    kept, dropping = [], False
    for word in words:
        dropping = word in options or (dropping and not word.startswith("--"))
        if not dropping:
            kept.append(word)
    return kept


def test_overrides_of_keys_no_run_sets_are_kept(tmp_path):
    escaped = lambda overrides, cap: train_records([-4.0])  # noqa: E731
    summary = run_experiment(tmp_path / "out", seeds=[0], widths=[2], cap=2, only=["q=1"], train=escaped,
                             overrides=["train={epochs: 3}", "objective.importance=none"])
    assert summary["settings"][-2:] == ["train={epochs: 3}", "objective.importance=none"]


def test_each_experiment_s_methods_help_gives_methods_it_takes(capsys):
    """The shared --methods help said "e.g. adaptive,q=1" under escape-rates, which has no adaptive method."""
    from nemo_jq.experiments import noisy_cold_start, warm_start

    takes = {"noisy-cold-start": noisy_cold_start.methods(steps=8), "escape-rates": escape_rates.methods(),
             "warm-start": warm_start.methods()}
    for name, plan in takes.items():
        with pytest.raises(SystemExit):
            run_cli(capsys, "experiment", name, "--help")
        example = re.search(r"run only these methods \(e\.g\. (.+?)\); default", " ".join(capsys.readouterr().out.split()))
        assert set(example.group(1).strip("'").split(",")) <= set(plan), (name, example.group(1))


def test_answer_width_pads_the_answer_and_only_the_padded_answer_earns_the_reward():
    task, plain = SyntheticArithmetic(answer_width=4), SyntheticArithmetic()
    padded, original = task.splits(8, 1, 1, seed=3).train, plain.splits(8, 1, 1, seed=3).train
    assert [e.answer for e in padded] == [e.answer.zfill(4) for e in original] and all(len(e.answer) == 4 for e in padded)
    rng = random.Random(0)
    for example in padded:
        assert task.reward(f"think\n\n{example.answer}", example) == 1.0
        assert task.reward(str(int(example.answer)), example) == 0.0  # the unpadded sum is not the answer
        for _ in range(50):
            guess = "".join(rng.choice("0123456789 \n") for _ in range(rng.randint(0, 6)))
            assert task.reward(guess, example) == float(task.extract_answer(guess) == example.answer)
    with pytest.raises(ConfigError, match="data.answer_width=1 cannot hold sums of 3 digits"):
        load_config(None, ["data.answer_width=1"])


@pytest.mark.slow
def test_sgd_is_plain_gradient_descent_without_clipping_and_needs_the_hf_backend(tmp_path):
    config = load_config(None, [*TINY_RUN, "optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0",
                                f"train.run_dir={tmp_path / 'run'}"])
    trainer = Trainer(config)
    assert type(trainer.policy.optimizer) is torch.optim.SGD
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    for p in trainer.policy.model.parameters():
        p.grad = torch.full_like(p, 3.0)  # a gradient norm far above the default clip of 1
    trainer.policy.optimizer_step()
    assert all(torch.allclose(p, b - 1.5) for p, b in zip(trainer.policy.model.parameters(), before))
    with pytest.raises(ConfigError, match="optim.name=sgd trains with model.backend=hf only"):
        load_config(None, ["optim.name=sgd", "model.backend=megatron"])


def test_fit_stops_after_the_first_step_until_accepts(tmp_path):
    config = load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'run'}", "eval.every=1000"])
    assert Trainer(config).fit(until=lambda record: "loss" in record) == {"step": 1}
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"] == [1]


@pytest.mark.slow
def test_quick_run_measures_p0_per_width_and_another_experiments_option_is_an_error(tmp_path, capsys):
    out = tmp_path / "escape"
    code, stdout, err = run_cli(capsys, "experiment", "escape-rates", "--quick", "--seeds", "0", "--out", out,
                                "--methods", "q=0.5,q=1")
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"SGD", "AdamW"} and summary["cap"] == 4
    assert summary["log_p0"]["3"]["mean"] < summary["log_p0"]["2"]["mean"] - 3  # one more digit: ~1/V less likely
    for per_method in summary["runs"].values():
        assert all(1 <= r["steps"] <= 4 and (r["steps"] == 4 or not r["censored"]) for rs in per_method.values() for r in rs)
    assert "| SGD | q=1 |" in stdout and (out / "escape_rates.png").exists() and (out / "curves_AdamW.png").exists()
    one_line_error(*run_cli(capsys, "experiment", "escape-rates", "--label-noise", "0.1", "--out", tmp_path / "x")[::2],
                   "takes no --label-noise")


def test_an_experiments_run_resolves_micro_batch_rows_auto_as_nemo_jq_train_does(tmp_path, capsys):
    """``train.micro_batch_rows=auto`` over an experiment's runs: each resolves it as ``nemo-jq train`` does (here, on
    the CPU, whole groups). It was refused at the first run, after experiment.json was written with it, so that
    neither ``--resume`` nor a corrected override could go on."""
    from nemo_jq.experiments.common import start_run

    trainer = start_run(load_config(None, [*TINY_RUN, "train.micro_batch_rows=auto", f"train.run_dir={tmp_path / 'run'}"]))
    assert trainer.config.train.micro_batch_rows is None
    assert "train.micro_batch_rows=auto: whole groups (the CPU" in capsys.readouterr().out
