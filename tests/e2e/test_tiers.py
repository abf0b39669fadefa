"""The tiers of docs/testing.md select what they say: each file's own markers are applied before ``-m`` deselects,
the stored three-step numbers are in the fast tier, and under pytest-xdist the files with the most slow tests start
first (tests/conftest.py)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_fast_tier_keeps_the_stored_numbers_and_leaves_out_what_is_marked_slow():
    files = ["tests/recipe/test_trainer.py", "tests/distributed/test_slurm_launch.py", "tests/e2e/test_bench.py"]
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-m", "not slow", *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    selected = [line for line in result.stdout.splitlines() if "::" in line]
    assert any("test_three_step_run_per_estimator[garl]" in line for line in selected), selected
    assert not any(line.startswith(tuple(files[1:])) for line in selected), selected


def root_conftest(config: pytest.Config):
    """tests/conftest.py as pytest loaded it (``import conftest`` could name a subfolder's conftest instead)."""
    path = str(ROOT / "tests" / "conftest.py")
    return next(plugin for plugin in config.pluginmanager.get_plugins() if getattr(plugin, "__file__", None) == path)


def test_the_files_with_the_most_slow_tests_come_first_and_ties_keep_their_order(pytestconfig):
    def item(file: str, slow: bool):
        return SimpleNamespace(path=Path(file), get_closest_marker=lambda name: slow and name == "slow" or None)

    items = [item("a.py", False), item("b.py", True), item("c.py", True), item("c.py", True), item("d.py", False),
             item("b.py", False)]
    root_conftest(pytestconfig)._files_with_most_slow_tests_first(items)
    assert [(str(i.path), bool(i.get_closest_marker("slow"))) for i in items] == [
        ("c.py", True), ("c.py", True), ("b.py", True), ("b.py", False), ("a.py", False), ("d.py", False)]
