"""The rollout seam: a rollout engine added as docs/extending.md says, built and refitted by the recipe."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY_RUN
from nemo_jq.runtime.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
REPORT = """
import json
from nemo_jq.config import load_config
from nemo_jq.recipe.trainer import Trainer
trainer = Trainer(load_config(None, {overrides!r}))
trainer.fit()
sampler = trainer.components.engine.engine.sampler
print(json.dumps({{"sampler": type(sampler).__name__, "loaded": sampler.weights_loaded,
                  "parameters": len(list(trainer.components.policy.iter_hf()))}}))
"""


def documented_sampler() -> str:
    """docs/extending.md's rollout-engine block, as written."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), flags=re.S)
    return next(block for block in blocks if "@register_sampler" in block)


@pytest.mark.slow  # about 12 s: a fresh interpreter and a two-step run
def test_the_documented_rollout_engine_trains_and_is_refitted_after_every_step(tmp_path):
    """The doc's sampler, a plugin file, trains two steps through the recipe: it is built from the starting weights'
    folder (it decodes no HF model in place) and takes the policy's weights after each step, as the doc says."""
    plugin = tmp_path / "uniform.py"
    plugin.write_text(documented_sampler())
    overrides = [*TINY_RUN, f"plugins=[{plugin}]", "rollout.engine=uniform", "train.max_steps=2",
                 f"train.run_dir={tmp_path / 'run'}"]
    done = subprocess.run([sys.executable, "-c", REPORT.format(overrides=overrides)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["sampler"] == "UniformSampler"
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"] == [1, 2]
    # refitted whenever the policy's weights moved before it sampled: a whole copy each time, never a partial one
    assert report["loaded"] > 0 and report["loaded"] % report["parameters"] == 0
