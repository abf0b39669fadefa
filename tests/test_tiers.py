"""The tiers of docs/testing.md select what they say: tests/conftest.py's marker table is applied before ``-m``
deselects, the stored three-step numbers are in the fast tier, and a stale name in the table is an error."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_fast_tier_keeps_the_stored_numbers_and_leaves_out_what_is_marked_slow():
    files = ["tests/test_trainer.py", "tests/test_slurm_launch.py", "tests/test_bench.py"]
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-m", "not slow", *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    selected = [line for line in result.stdout.splitlines() if "::" in line]
    assert any("test_three_step_run_per_estimator[garl]" in line for line in selected), selected
    assert not any(line.startswith(("tests/test_slurm_launch.py", "tests/test_bench.py")) for line in selected), selected


def test_a_stale_name_in_the_marker_table_is_an_error(monkeypatch):
    import conftest

    collected = [SimpleNamespace(path=Path(__file__), name="test_that_is_here", originalname="test_that_is_here")]
    monkeypatch.setitem(conftest.MARKS, "test_tiers.py", {"test_that_was_renamed": ("slow",)})
    with pytest.raises(pytest.UsageError, match=r"test_tiers.py::test_that_was_renamed; rename or remove"):
        conftest._check_the_table_names_real_tests(SimpleNamespace(args=["tests"]), collected)
    monkeypatch.setitem(conftest.MARKS, "test_tiers.py", {"test_that_is_here": ("slow",), "*": ("slow",)})
    conftest._check_the_table_names_real_tests(SimpleNamespace(args=["tests"]), collected)
