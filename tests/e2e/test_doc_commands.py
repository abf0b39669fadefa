"""The training commands docs/training.md (q schedules) and docs/off_policy_rollouts.md show, each through
``nemo-jq train`` as written, cut to two steps of the tiny run: a flag or key the docs spell wrong, or a schedule file
that is gone, fails here. (docs/estimators.md's are run in tests/unit/objectives/test_estimator_variants.py; the vLLM
line, which needs vLLM, by the demo config's run in tests/unit/rollouts/test_vllm.py.)"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from helpers import TINY_RUN, run_cli
from nemo_jq.runtime.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a run each, about 3 s


def train_commands(page: str, marker: str) -> list[list[str]]:
    """The ``nemo-jq train`` lines of the first bash block after ``marker`` in ``docs/page``: their words after
    ``nemo-jq train``, comments dropped."""
    text = (ROOT / "docs" / page).read_text()
    block = text.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True)[2:] for line in block.splitlines() if line.startswith("nemo-jq train ")]


COMMANDS = [*train_commands("training.md", "**q schedules.**"),
            *[words for words in train_commands("off_policy_rollouts.md", "token-level one on top of its clip.")
              if "rollout.engine=vllm" not in words]]


def test_each_block_is_what_it_says_and_each_command_a_run_of_its_own():
    folders = [word for words in COMMANDS for word in words if word.startswith("train.run_dir=")]
    assert len(COMMANDS) == 5 and len(folders) == len(set(folders)) == len(COMMANDS)


@pytest.mark.parametrize("words", COMMANDS, ids=lambda words: words[0].split("/")[-1])
def test_the_documented_command_trains(tmp_path, capsys, monkeypatch, words):
    monkeypatch.chdir(ROOT)  # the docs' relative paths (configs/schedules/...) are the repository's
    run_dir = tmp_path / "run"
    own = [word for word in words if not word.startswith("train.run_dir=")]
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "train.max_steps=2", "eval.every=1000", *own,
                           f"train.run_dir={run_dir}")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2]
    results = json.loads((run_dir / "results.json").read_text())
    if any(word.startswith("objective.q_schedule=") for word in own):  # the schedule reached the run
        assert results["q_schedule"] and "final_q" in results
