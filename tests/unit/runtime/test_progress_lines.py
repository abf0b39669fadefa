"""A batch log's progress lines (``nemo_jq.runtime.monitor.ProgressLines``): what a SLURM log shows of a run."""

from nemo_jq.runtime import monitor


def test_a_logs_progress_line_names_its_unit_and_the_time_left(monkeypatch, capsys):
    """A real run's steps take tens of seconds: "(0.0345/s)" said neither what nor how long; the line gives seconds a
    step there, steps a second where they are quicker, and the time left at that pace, every tenth of the run."""
    clock = iter([0.0, 300.0, 600.0, 1200.0])
    monkeypatch.setattr(monitor.time, "perf_counter", lambda: next(clock))
    with monitor.ProgressLines(total=100, initial=80, desc="train run", unit="step") as lines:
        for step in range(10):
            lines.update()
            lines.set_postfix({"loss": f"{step:.1f}"})
        lines.update(10)
    assert capsys.readouterr().err.splitlines() == [
        "train run: 90/100 (30 s/step, 5 min left), loss=9.0", "train run: 100/100 (30 s/step), loss=9.0"]
    assert monitor.pace(10, 4.0, 30, "prompt") == "2.5 prompts/s, 12 s left"
    assert monitor.pace(10, 36_000.0, 200, "step") == "60 min/step, 200.0 h left"
