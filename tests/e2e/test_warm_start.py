"""`nemo-jq experiment warm-start`: its bookkeeping on scripted curves, the rationale-dependence knob, the Var_z[w]
measurement (which must not move training), and the quick size through the CLI."""

import json
import math
import re

import pytest
import torch

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.config import ConfigError, load_config
from nemo_jq.data import SyntheticArithmetic
from nemo_jq.experiments.warm_start import collapse, latent_variance, measure_variance, train_measured
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.monitor import read_metrics


def test_collapse_is_a_fall_below_the_fraction_of_the_peak_that_lasts_to_the_end():
    falls = [(0, 20.0), (16, 40.0), (32, 30.0), (48, 3.0), (64, 0.0), (80, 3.9)]
    assert collapse(falls) == {"peak": 40.0, "peak_step": 16, "final": 3.9, "collapse_step": 48}
    recovers = [(0, 20.0), (16, 40.0), (32, 0.0), (48, 25.0), (64, 2.0)]  # a dip that recovers counts from its last fall
    assert collapse(recovers)["collapse_step"] == 64
    assert collapse([(0, 20.0), (16, 40.0), (32, 0.0), (48, 4.0)])["collapse_step"] is None  # 10% of 40 is not below it
    assert collapse([(0, 20.0), (16, 40.0), (32, 0.0), (48, 4.0)], fraction=0.2)["collapse_step"] == 32
    assert collapse([(0, 0.0), (16, 0.0)]) == {"peak": 0.0, "peak_step": 0, "final": 0.0, "collapse_step": None}
    assert collapse([(0, 10.0), (16, 10.0), (32, 5.0)])["peak_step"] == 0  # a tied peak: its first step
    assert collapse([(0, 50.0), (16, 0.0)])["collapse_step"] == 16  # from the warm policy's own peak
    with pytest.raises(ValueError, match="empty validation curve"):
        collapse([])


def test_latent_variance_is_the_sample_variance_of_w_and_its_squared_coefficient_of_variation():
    w = torch.tensor([[0.1, 0.3, 0.5, 0.1], [0.2, 0.2, 0.2, 0.2], [1e-3, 2e-3, 0.0, 1e-3]], dtype=torch.float64)
    measured = latent_variance(torch.log(w))
    assert measured["var_w"] == pytest.approx(w.var(dim=1, unbiased=True).mean().item(), rel=1e-5)
    assert measured["cv2_w"] == pytest.approx((w.var(dim=1) / w.mean(dim=1) ** 2).mean().item(), rel=1e-5)
    assert measured["mean_w"] == pytest.approx(w.mean(dim=1).mean().item(), rel=1e-5)
    assert latent_variance(torch.log(w[1:2]))["var_w"] == pytest.approx(0.0, abs=1e-9)  # w independent of z
    underflowed = latent_variance(torch.full((2, 4), -200.0).index_fill_(0, torch.tensor([0]), math.log(0.25)))
    assert underflowed["cv2_w"] == pytest.approx(0.0, abs=1e-6)  # the underflowed prompt is left out of cv2
    with pytest.raises(ValueError, match="at least 2 rationales"):
        latent_variance(torch.zeros(3, 1))


def test_rationale_dependence_keeps_the_default_task_and_sets_how_far_the_answer_follows_from_the_rationale():
    default, none, operations = (SyntheticArithmetic(rationale_dependence=d) for d in ("sum", "none", "operations"))
    assert SyntheticArithmetic().splits(4, 1, 1, seed=0) == default.splits(4, 1, 1, seed=0)
    plain = default._example(864)
    assert (plain.id, plain.question, plain.rationale, plain.answer) == ("sum-8+6+4", "8+6+4", "8+6=14 14+4=18", "18")
    alone = none._example(864)
    assert (alone.question, alone.rationale, alone.answer) == (plain.question, plain.rationale, "8")  # same z, y* apart
    for example in operations.splits(200, 1, 1, seed=1).train:
        digits = [int(d) for d in example.question.split("?")]
        steps = example.rationale.split()
        assert "+" not in example.question and len(steps) == len(digits) - 1  # the operators are the rationale's
        total = digits[0]
        for step, digit in zip(steps, digits[1:]):
            left, op, right, result = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)", step).groups()
            assert (int(left), int(right)) == (total, digit) and op == ("-" if total >= digit else "+")
            total = eval(f"{left}{op}{right}")  # noqa: S307 - two small whole numbers
            assert int(result) == total
        assert example.answer == str(total)  # the result of the operations the rationale writes
    assert operations.messages(example, "warm")[0]["content"].startswith("Replace each ?")
    assert SyntheticArithmetic(answer_width=2, rationale_dependence="operations").splits(1, 1, 1, 0).train[0].answer == "06"
    with pytest.raises(ValueError, match=r"answer_width=1 cannot hold operations answers of 3 digits \(up to 17\)"):
        SyntheticArithmetic(answer_width=1, rationale_dependence="operations")
    with pytest.raises(ValueError, match="rationale_dependence must be one of none, sum, operations"):
        SyntheticArithmetic(rationale_dependence="all")
    assert load_config(None, ["data.rationale_dependence=operations"]).data.rationale_dependence == "operations"
    with pytest.raises(ConfigError, match="rationale_dependence"):
        load_config(None, ["data.rationale_dependence=all"])


@pytest.mark.slow
def test_measuring_the_variance_does_not_move_the_training_streams(tmp_path):
    """The same run with and without Var_z[w] measured at every validation: the same train records, and a measurement
    that draws from its own generator (the same seed, the same value)."""
    common = [*TINY_RUN, "objective.name=garl", "eval.every=2", "eval.num_samples=4", "train.tensorboard=false"]
    Trainer(load_config(None, [*common, f"train.run_dir={tmp_path / 'plain'}"])).fit()
    trainer, _, measured = train_measured([*common, f"train.run_dir={tmp_path / 'measured'}"], variance_seed=5)
    volatile = {"step_time", "rollout_tokens_per_s"}

    def trained(run):
        return [{k: v for k, v in r.items() if k not in volatile} for r in read_metrics(tmp_path / run) if r["kind"] == "train"]

    assert trained("measured") == trained("plain")
    assert [m["step"] for m in measured] == [0, *range(2, trainer.state.step + 1, 2)]
    assert measure_variance(trainer.components, 7) == measure_variance(trainer.components, 7)
    assert all(m["var_w"] >= 0 and 0 < m["mean_w"] < 1 for m in measured)


@pytest.mark.slow
def test_quick_run_through_the_cli_writes_table_summary_and_figures_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "warm"
    code, stdout, err = run_cli(capsys, "experiment", "warm-start", "--quick", "--seeds", "0", "--out", out,
                                "--dependences", "none", "--methods", "GRPO,GARL q=0.25 score only", "--target-p1", "10",
                                "--methods-override", "optim.lr=0.001")
    assert code == 0, err
    assert "Loading weights" not in err and "Writing model shards" not in err  # transformers' bars, per weight file
    assert "is ignored" not in err, err  # --quick's tiny shape, which the methods' runs (from the warm policy) do not read
    summary = json.loads((out / "summary.json").read_text())
    warm = summary["warm"]["none"]
    assert warm["target_p@1"] == 10 and warm["steps"] >= 1 and (out / "warm" / "none" / "policy" / "config.json").exists()
    for name in ("GRPO", "GARL q=0.25 score only"):
        (run,) = summary["runs"]["none"][name]
        assert run["curve"][0] == [0, warm["validation_m@4"]] and len(run["curve"]) == 3  # the warm point, 2 steps
        assert [v["step"] for v in run["variance"]] == [0, 1, 2]
        saved = load_config(out / "none" / name.replace(" ", "_") / "seed0" / "config.yaml", saved=True)
        assert saved.model.path == warm["policy"] and saved.optim.lr == 0.001  # the methods' phase only
    assert load_config(out / "warm" / "none" / "config.yaml", saved=True).optim.lr != 0.001
    assert "| none |" in stdout and (out / "table.md").exists() and (out / "curves_none.png").stat().st_size > 0
    one_line_error(*run_cli(capsys, "experiment", "warm-start", "--quick", "--seeds", "0", "--out", out)[::2],
                   "an earlier experiment")
    moved = out.rename(tmp_path / "moved")  # its runs' model.path names the warm policy where it was written
    code, _, err = run_cli(capsys, "eval", moved / "none" / "GRPO" / "seed0", "eval.num_samples=2")
    assert code == 0, err  # read from where it moved with them ("model folder ... does not exist" before)
    one_line_error(*run_cli(capsys, "experiment", "warm-start", "--dependences", "all", "--out", tmp_path / "x")[::2],
                   "--dependences", "'all'", "none, sum, operations")
    one_line_error(*run_cli(capsys, "experiment", "warm-start", "--widths", "2", "--out", tmp_path / "x")[::2],
                   "takes no --widths")
    one_line_error(*run_cli(capsys, "experiment", "escape-rates", "--dependences", "none", "--out", tmp_path / "x")[::2],
                   "takes no --dependences")
    one_line_error(*run_cli(capsys, "experiment", "warm-start", "--out", tmp_path / "x", "data.rationale_dependence=x")[::2],
                   "data.rationale_dependence")
    one_line_error(*run_cli(capsys, "experiment", "warm-start", "--out", tmp_path / "x", "--methods-override", "optim.lr=x")[::2],
                   "optim.lr")
    one_line_error(*run_cli(capsys, "experiment", "escape-rates", "--methods-override", "optim.lr=1", "--out", tmp_path / "x")[::2],
                   "takes no --methods-override")


def test_each_experiment_s_help_is_its_own():
    """``experiment NAME --help``: NAME's summary and the options it takes, not another's."""
    import subprocess
    import sys

    text = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "experiment", "warm-start", "--help"],
                          capture_output=True, text=True, timeout=60).stdout
    assert text.startswith("usage: nemo-jq experiment warm-start") and "does GARL collapse where PAFT stays" in text
    assert "--target-p1" in text and "--seeds" in text and "--widths" not in text and "--label-noise" not in text


@pytest.mark.slow
def test_a_run_stopped_in_the_methods_phase_starts_again_on_resume_and_the_warm_policy_is_kept(tmp_path, capsys,
                                                                                                monkeypatch):
    """What a method's run measures along the way (Var_z[w]) is in memory, not in its checkpoint: on `--resume` the
    stopped run starts again (its start moved aside), the warm-up is read back, and the summary is an unstopped one's.
    A second Ctrl-C stops the experiment at once, in one line that says how to go on."""
    import os
    import signal

    from nemo_jq.experiments.warm_start import run_experiment
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime.preemption import Stopped

    options = dict(seeds=[0], dependences=["none"], quick=True, only=["GRPO"], target_p1=10.0)
    unstopped = run_experiment(tmp_path / "unstopped", **options)
    step, calls, stops = Trainer.train_step, [], [1]

    def stopped_in_the_methods_first_step(self, batch):
        calls.append(self.run_dir.parent.name)
        if calls.count("GRPO") == 1 and stops:
            os.kill(os.getpid(), signal.SIGINT)
            stops.pop()
        return step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", stopped_in_the_methods_first_step)
    with pytest.raises(Stopped) as stop:
        run_experiment(tmp_path / "out", **options)
    assert "that run starts again" in str(stop.value) and f"finished runs: {tmp_path / 'out' / 'warm' / 'none'}" in str(stop.value)
    calls.clear()
    code, _, err = run_cli(capsys, "experiment", "warm-start", "--resume", tmp_path / "out")
    assert code == 0, err
    assert calls == ["GRPO", "GRPO"]  # the warm-up read back; GRPO's two steps from its start
    assert [path.name.split(".old-")[0] for path in (tmp_path / "out" / "none" / "GRPO").iterdir()] == ["seed0"] * 2
    resumed = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert resumed["runs"] == json.loads(json.dumps(unstopped["runs"]))

    def interrupted(self, batch):  # the second Ctrl-C of a user who will not wait for the checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    with pytest.raises(Stopped) as stop:
        run_experiment(tmp_path / "again", **options)
    assert stop.value.exit_code == 130 and "interrupted by a second Ctrl-C" in str(stop.value)
    assert f"`nemo-jq experiment warm-start --resume {tmp_path / 'again'}` goes on" in str(stop.value)
