"""``training.png``'s panels (``nemo_jq.runtime.monitor.panels``): what was logged, labelled for what it is."""

from nemo_jq.runtime.monitor import KL_NOISE, panels, plot_runs


def _train(step, **values):
    return {"kind": "train", "step": step, **values}


def test_panels_plot_what_was_logged_and_say_what_each_is(tmp_path):
    """GRPO's sampled reward and GARL's P̂ are not one axis; validation m@k is the k logged; an on-policy run's
    float-noise KL is named, not drawn; a scheduled q is drawn, a fixed one is not."""
    runs = {
        "grpo": [_train(s, reward=0.1 * s, q=None, kl_k3=1e-13) for s in (1, 2)]
                + [{"kind": "validation", "step": 2, "m@4": 25.0, "p@1": 10.0}],
        "garl scheduled": [_train(s, p_hat=0.01, log_p_hat=-4.6, q=1.0 - 0.5 * s, kl_k3=0.02) for s in (1, 2)]
                          + [{"kind": "validation", "step": 2, "m@4": 50.0}],
        "garl fixed": [_train(s, p_hat=0.02, log_p_hat=-3.9, q=0.75, kl_k3=2e-14) for s in (1, 2)],
    }
    by_title = {panel.title: panel for panel in panels(runs)}
    assert list(by_title["sampled reward (mean over rollouts)"].lines) == ["grpo"]
    assert set(by_title["log P̂ (mean log w̄)"].lines) == {"garl scheduled", "garl fixed"}
    assert "validation m@16" not in by_title and set(by_title["validation m@4"].lines) == {"grpo", "garl scheduled"}
    kl = by_title["KL(engine ‖ policy) per token, k3"]
    assert kl.note == f"below {KL_NOISE:g} (float rounding), not drawn: garl fixed, grpo"
    assert list(kl.lines) == ["garl scheduled"]
    assert by_title["q"].lines == {"garl scheduled": ([1, 2], [0.5, 0.0])}
    assert not any(title.startswith("max amplified advantage") for title in by_title)  # nobody logged it
    plot_runs(runs, tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size > 0


def test_each_columns_lowest_panel_shows_the_steps(tmp_path, monkeypatch):
    """Five panels in two rows of three: the top-right one, nothing under it, had no step numbers (shared axes)."""
    import matplotlib.pyplot as plt

    runs = {"grpo": [_train(s, reward=0.1, kl_k3=0.01) for s in (1, 2)] + [{"kind": "validation", "step": 2, "m@4": 25.0}],
            "garl": [_train(s, log_p_hat=-4.0, max_amplified_advantage=0.1, kl_k3=0.02) for s in (1, 2)]}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_runs(runs, tmp_path / "training.png")
    visible = [ax for ax in figures[0].axes if ax.get_visible()]
    assert len(visible) == 5
    for ax in visible:
        below = [other for other in visible if other is not ax
                 and abs(other.get_position().x0 - ax.get_position().x0) < 1e-6 and other.get_position().y0 < ax.get_position().y0]
        assert ax.xaxis.get_tick_params()["labelbottom"] == (not below) and (ax.get_xlabel() == "step") == (not below), ax.get_title()


def test_more_runs_than_colours_are_told_apart(tmp_path, monkeypatch):
    """A q sweep of 12 runs: matplotlib's C10 is C0, so two runs were drawn alike, their legend entries too."""
    import matplotlib.pyplot as plt

    runs = {f"q={q}": [_train(s, log_p_hat=-4.0 + q, kl_k3=0.02) for s in (1, 2)] for q in range(12)}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_runs(runs, tmp_path / "training.png")
    styles = {(line.get_color(), line.get_linestyle()) for line in figures[0].legends[0].get_lines()}
    assert len(styles) == 12
