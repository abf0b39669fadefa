"""Label noise (exact share, seeded, evaluation splits clean) and the memorisation metric."""

import json
import random

import pytest

from helpers import TINY_RUN
from nemo_jq.config import ConfigError, load_config
from nemo_jq.data import SyntheticArithmetic
from nemo_jq.data.base import Example
from nemo_jq.data.noise import CLEAN_ANSWER, corrupt_labels, noisy_examples
from nemo_jq.data.prepare import build_task
from nemo_jq.recipe.evaluation import chance_memorised, memorised
from nemo_jq.recipe.trainer import Trainer

TASK = SyntheticArithmetic(num_operands=3)


@pytest.mark.parametrize("size, rate", [(768, 0.2), (10, 0.25), (37, 0.5), (5, 0.0), (64, 0.99)])
def test_exactly_the_rounded_share_is_corrupted_each_with_a_wrong_label(size, rate):
    train = TASK.splits(size, 1, 1, seed=3).train
    corrupted = corrupt_labels(train, rate, seed=0, task=TASK)
    noisy = noisy_examples(corrupted)
    assert len(corrupted) == size and len(noisy) == round(rate * size)
    for before, after in zip(train, corrupted):
        if CLEAN_ANSWER in after.meta:
            assert after.meta[CLEAN_ANSWER] == before.answer and after.question == before.question
            assert not TASK.is_correct(after.answer, before) and after.answer in {e.answer for e in train}
        else:
            assert after == before


def test_a_corrupted_finqa_label_pays_only_the_wrong_answer_it_now_has():
    """FinQA's reward accepts its row's executed answer (``exe_ans``) too: a corrupted row kept the clean one in its
    meta, so the clean answer still earned the reward against the wrong label, and memorisation counted it."""
    from pathlib import Path

    from nemo_jq.data.answers import executed_number
    from nemo_jq.data.noise import clean_of
    from nemo_jq.data.qa import FinQA
    from nemo_jq.data.sources import read_rows

    task = FinQA()
    rows = Path(__file__).resolve().parents[2] / "fixtures" / "real" / "finqa_dev.json"
    examples = [task.parse(row) for _, row in read_rows(rows)]
    noisy = noisy_examples(corrupt_labels(examples, 0.5, 0, task))
    assert len(noisy) >= 4
    for example in noisy:
        clean = clean_of(example)
        assert clean == next(e for e in examples if e.id == example.id) and "exe_ans" not in example.meta
        executed = executed_number(clean.meta["exe_ans"])
        written = [] if executed is None else [f"{executed}", f"{100 * executed:.2f}%"]
        for answer in (clean.answer, *written):  # the clean answer, however written
            if not task.reward(answer, clean):
                continue
            assert task.reward(answer, example) == 0.0, (example.answer, answer)
            assert memorised(task, [example], [[answer]]) == [False]
        assert task.reward(example.answer, example) == 1.0 and memorised(task, [example], [[example.answer]]) == [True]


def test_the_corrupted_set_follows_the_seed():
    train = TASK.splits(200, 1, 1, seed=0).train
    ids = [{e.id for e in noisy_examples(corrupt_labels(train, 0.2, seed, TASK))} for seed in (0, 0, 1)]
    assert ids[0] == ids[1] != ids[2]
    assert corrupt_labels(train, 0.2, 0, TASK) == corrupt_labels(train, 0.2, 0, TASK)


def test_a_run_corrupts_training_labels_only_and_bad_rates_are_refused():
    clean = load_config(None, ["data.train_size=100", "data.validation_size=20", "data.test_size=30"])
    noisy = load_config(None, ["data.train_size=100", "data.validation_size=20", "data.test_size=30", "data.label_noise=0.3"])
    (_, clean_splits), (_, noisy_splits) = build_task(clean.data), build_task(noisy.data)
    assert noisy_splits.validation == clean_splits.validation and noisy_splits.test == clean_splits.test
    assert len(noisy_examples(noisy_splits.train)) == 30 and not noisy_examples(clean_splits.train)
    for value in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match="data.label_noise must be >= 0.0 and < 1.0"):
            load_config(None, [f"data.label_noise={value}"])


def test_memorised_counts_only_outputs_that_reproduce_the_corrupted_label_and_not_the_clean_one():
    rng = random.Random(0)
    for _ in range(300):
        clean, wrong = rng.sample(range(100), 2)
        example = Example("x", "1+2+3", str(wrong), meta={CLEAN_ANSWER: str(clean)})
        numbers = rng.sample([clean, wrong, rng.randrange(100, 200)], rng.randint(0, 3))
        output = " ".join(map(str, numbers)) or "no number"
        assert memorised(TASK, [example], [[output]]) == [wrong in numbers and clean not in numbers]


@pytest.mark.slow
def test_a_noisy_run_reports_the_memorisation_of_its_final_and_tested_models(tmp_path):
    trainer = Trainer(load_config(None, [*TINY_RUN, "data.label_noise=0.25", "train.max_steps=2", f"train.run_dir={tmp_path / 'run'}"]))
    results = trainer.fit()
    assert len(noisy_examples(trainer.components.splits.train)) == 6
    assert set(results["memorisation"]) == {"final", "tested", "chance"}
    for value in (results["memorisation"]["final"], results["memorisation"]["tested"]):
        assert 0 <= value <= 100 and value * 6 / 100 == pytest.approx(round(value * 6 / 100))
    assert json.loads((tmp_path / "run" / "results.json").read_text())["memorisation"] == results["memorisation"]
    # the engine's greedy answers are what the metric scores: make them the corrupted labels and it is 100
    noisy = noisy_examples(trainer.components.splits.train)
    trainer.components.engine.generate = _answering(trainer, {tuple(trainer.components.prompt_ids([e])[0]): e.answer for e in noisy})
    train = trainer.components.splits.train
    pool = {e.meta.get(CLEAN_ANSWER, e.answer) for e in train}
    # by chance: each greedy answer is one of the wrong labels its prompt could have drawn
    chance = sum(1 / len([a for a in pool if not TASK.is_correct(a, Example("x", "", e.meta[CLEAN_ANSWER]))]) for e in noisy)
    assert trainer.evaluator.memorisation() == {"memorised": 100, "chance": pytest.approx(100 * chance / len(noisy))}


def test_memorisation_by_chance_is_the_share_of_the_wrong_labels_an_output_matches():
    """The rate at which an output reproduces a wrong label drawn afresh (from the training answers the task counts
    wrong for the prompt): an output naming many numbers memorises by chance what one naming a single one does not."""
    rng = random.Random(1)
    train = [Example(f"t{i}", "", str(answer)) for i, answer in enumerate(rng.sample(range(100), 40))]
    answers = sorted({e.answer for e in train})
    for _ in range(200):
        clean, wrong = rng.sample(answers, 2)
        example = Example("x", "1+2", wrong, meta={CLEAN_ANSWER: clean})
        named = rng.sample(answers + ["999"], rng.randint(0, 8))
        output = " ".join(named) or "no number"
        (share,) = chance_memorised(TASK, [*train, example], [example], [[output]])
        expected = 0.0 if clean in named else len([a for a in named if a != clean and a in answers]) / (len(answers) - 1)
        assert share == pytest.approx(expected)
        assert chance_memorised(TASK, [*train, example], [example], [[output]], draws=10)[0] <= 1.0


def test_eval_of_a_noisy_runs_train_split_says_its_labels_are_the_corrupted_ones(tmp_path, capsys):
    from helpers import run_cli

    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *TINY_RUN, "data.label_noise=0.25", "train.max_steps=1", "eval.num_samples=2",
                   f"train.run_dir={run_dir}")[0] == 0
    code, _, err = run_cli(capsys, "eval", run_dir, "--split", "train", "eval.num_samples=2")
    assert code == 0 and "the train split is scored against its labels as the run trained on them: " \
        "data.label_noise=0.25 of them made wrong" in err, err
    code, _, err = run_cli(capsys, "eval", run_dir, "--split", "test", "eval.num_samples=2")
    assert code == 0 and "label_noise" not in err  # the evaluation splits are clean


def _answering(trainer, answers):
    from nemo_jq.models.interfaces import Rollout

    def generate(prompts, num_samples, *, sample_answers, generator, greedy=False, routes=True):
        assert greedy and not routes and num_samples == 1
        return [[Rollout(list(p), [], True, trainer.components.chat.answer_ids(answers[tuple(p)]))] for p in prompts]

    return generate
