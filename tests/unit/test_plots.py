"""Plots from fixture CSVs: the files, their panels and the continual metrics."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedlr.runs.plots import continual_metrics, figures, load_run, main, plot_runs
from fedlr.runs.results import ResultsWriter


@pytest.fixture(autouse=True)
def _close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _run(tmp_path, name, method, seed, rounds=4, rank=None, matrix=None):
    run_dir = tmp_path / name
    writer = ResultsWriter(run_dir, method=method, config={"seed": seed})
    for t in range(1, rounds + 1):
        writer.append(
            {
                "round": t,
                "accuracy": 0.5 + 0.05 * t,
                "loss": 1.0 / t,
                "frobenius-gap": 0.1 / t,
                "rank": float(rank + 2 * (t // 2)) if rank else float("nan"),
                "bytes-up": 1e6,
                "bytes-down": 2e6,
            }
        )
    if matrix is not None:
        frame = pd.DataFrame(matrix, columns=[f"task-{j}" for j in range(len(matrix))])
        frame.insert(0, "after-task", range(len(matrix)))
        frame.to_csv(run_dir / "accuracy_matrix.csv", index=False)
    return run_dir


MATRIX = np.array([[0.9, np.nan, np.nan], [0.7, 0.95, np.nan], [0.6, 0.8, 0.9]])


def test_continual_metrics_follow_their_definitions():
    acc, fgt = continual_metrics(MATRIX)
    assert acc == pytest.approx((0.6 + 0.8 + 0.9) / 3)
    assert fgt == pytest.approx(((0.9 - 0.6) + (0.95 - 0.8)) / 2)
    assert continual_metrics(np.array([[0.8]])) == (pytest.approx(0.8), 0.0)


def test_one_run_writes_every_figure_with_its_panels(tmp_path):
    run_dir = _run(tmp_path, "a", "fedspec", 0, rank=4, matrix=MATRIX)
    written = plot_runs([run_dir], run_dir)
    names = sorted(p.name for p in written)
    assert names == [
        "accuracy_loss.png",
        "accuracy_matrix.png",
        "bytes.png",
        "gap.png",
        "rank.png",
    ]
    assert all(p.stat().st_size > 5000 for p in written)
    figs = figures([load_run(run_dir)])
    assert len(figs["accuracy_loss.png"].axes) == 2
    gap_ax = figs["gap.png"].axes[0]
    # 0.1 / t over 4 rounds spans less than a decade: a linear axis from 0
    assert gap_ax.get_yscale() == "linear" and gap_ax.get_ylim()[0] == 0.0
    assert len(figs["accuracy_matrix.png"].axes) == 2  # heatmap + colour bar
    assert "ACC 0.767" in figs["accuracy_matrix.png"].axes[0].get_title()


def test_several_runs_share_axes_and_are_labelled(tmp_path):
    dirs = [
        _run(tmp_path, "a", "fedex-lora", 0),
        _run(tmp_path, "b", "fedex-lora", 1),
        _run(tmp_path, "c", "fedavg-lora", 0),
    ]
    figs = figures([load_run(d) for d in dirs])
    ax = figs["accuracy_loss.png"].axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    # labelled by the config key that differs between the runs
    assert labels == ["fedex-lora seed=0", "fedex-lora seed=1", "fedavg-lora seed=0"]
    assert "rank.png" not in figs and "accuracy_matrix.png" not in figs
    out = tmp_path / "plots"
    assert main([*map(str, dirs), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "accuracy_loss.png",
        "bytes.png",
        "gap.png",
    ]


def test_missing_results_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no results\.csv"):
        plot_runs([tmp_path], tmp_path)
    with pytest.raises(ValueError, match="no run directories"):
        plot_runs([], tmp_path)


def _xs(ax):
    return [list(map(float, line.get_xdata())) for line in ax.get_lines()]


def test_round_axes_are_whole_rounds_from_round_zero_with_a_legend(tmp_path):
    import json

    run_dir = _run(tmp_path, "a", "fedavg-lora", 0, rounds=1)
    (run_dir / "summary.json").write_text(
        json.dumps({"initial-accuracy": 0.41, "initial-loss": 1.7})
    )
    figs = figures([load_run(run_dir)])
    fig = figs["accuracy_loss.png"]
    fig.canvas.draw()
    for ax in fig.axes:
        assert _xs(ax) == [[0.0, 1.0]]  # the initial model is round 0
        ticks = [
            t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]
        ]
        assert ticks and all(float(t).is_integer() for t in ticks)
        assert ax.get_legend() is not None
    acc = fig.axes[0].get_lines()[0].get_ydata()
    assert list(acc) == [0.41, pytest.approx(0.55)]
    for name, fig in figs.items():
        for ax in fig.axes:
            assert ax.get_legend() is not None, name


def test_rank_panel_only_when_a_rank_changes(tmp_path):
    fixed = _run(tmp_path, "a", "fedavg-lora", 0, rank=None)
    frame = pd.read_csv(fixed / "results.csv")
    frame["rank"] = 8
    frame.to_csv(fixed / "results.csv", index=False)
    assert "rank.png" not in figures([load_run(fixed)])
    grows = _run(tmp_path, "b", "fedspec", 0, rank=4)
    assert "rank.png" in figures([load_run(grows)])


def test_bytes_up_and_down_are_two_panels_with_plain_ticks(tmp_path):
    figs = figures([load_run(_run(tmp_path, "a", "fedex-lora", 0))])
    up, down = figs["bytes.png"].axes
    assert "up" in up.get_title() and "down" in down.get_title()
    assert [list(line.get_ydata()) for line in up.get_lines()] == [[1.0] * 4]
    assert [list(line.get_ydata()) for line in down.get_lines()] == [[2.0] * 4]
    assert up.get_yscale() == "linear"  # 1 and 2 MB: no log axis


def test_a_stage_switch_and_task_boundaries_are_marked(tmp_path):
    run_dir = tmp_path / "q"
    writer = ResultsWriter(run_dir, method="qrmix", extra_columns=("stage",))
    for t, stage in zip(range(1, 5), (1, 1, 2, 2), strict=True):
        writer.append({"round": t, "accuracy": 0.5, "loss": 1.0, "stage": stage})
    ax = figures([load_run(run_dir)])["accuracy_loss.png"].axes[0]
    vertical = [
        line.get_xdata()[0]
        for line in ax.get_lines()
        if len(set(line.get_xdata())) == 1 and line.get_linestyle() == ":"
    ]
    assert vertical == [2.5]
