"""Every figure fedlr draws, checked for what misleads a reader.

:func:`misleading` looks at a matplotlib ``Figure`` and names each problem
it finds:

- a series (line, bars, dots with error bars) without a label in a legend
  (one series alone may instead be named in its panel's title);
- a cut axis: an axis whose label names a non-negative size (bytes / MB,
  epsilon, a gap, a rank) that does not reach 0, unless it is a plain log
  axis on purpose; and bars whose value axis does not start at 0.

It is applied to every figure function of :mod:`fedlr.runs.plots`,
:mod:`fedlr.runs.table` and the studies' figures (robustness, privacy),
drawn from small synthetic runs that exercise every panel; and a test
checks that no figure function is left out.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.figure import Figure

from fedlr.runs import plots, table
from fedlr.runs.plots import (
    ROUNDING_RELATIVE_GAP,
    TIME_AXIS,
    accuracy_matrix_figure,
    epsilon_figure,
    figures,
    lm_figure,
    load_run,
)
from fedlr.runs.results import COLUMNS, ResultsWriter
from fedlr.runs.table import collect, comparison_figure, summarise, summary_figure

NONNEGATIVE = re.compile(r"\b(MB|bytes?|epsilon|gap|rank)\b", re.IGNORECASE)
"""Axis labels of quantities that cannot be negative: their axis shows 0."""


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------- the checker


def _legend_texts(fig: Figure, ax: Any) -> set[str]:
    legends = [ax.get_legend(), *fig.legends]
    return {t.get_text() for lg in legends if lg is not None for t in lg.get_texts()}


def _series(ax: Any) -> list[tuple[str, Any]]:
    """``(label, artist)`` of every data series on ``ax``: containers (bars,
    error bars) as one series each, then the lines no container holds."""
    out: list[tuple[str, Any]] = []
    held: set[int] = set()
    bar_errors = {
        id(c.errorbar) for c in ax.containers if isinstance(c, BarContainer)
    }  # a bar's error bars are part of its series
    for container in ax.containers:
        if id(container) in bar_errors:
            for child in container.get_children():
                held.add(id(child))
        elif isinstance(container, (BarContainer, ErrorbarContainer)):
            out.append((str(container.get_label()), container))
            for child in container.get_children():
                held.add(id(child))
    for line in ax.get_lines():
        if id(line) not in held and len(line.get_xdata()):
            out.append((str(line.get_label()), line))
    return out


def _cut(ax: Any, which: str) -> bool:
    """The axis does not reach 0 (a plain log axis is deliberate)."""
    scale = ax.get_yscale() if which == "y" else ax.get_xscale()
    low, high = ax.get_ylim() if which == "y" else ax.get_xlim()
    return scale != "log" and min(low, high) > 0


def misleading(fig: Figure) -> list[str]:
    """Every unlabelled series and cut axis of ``fig``, in words."""
    fig.canvas.draw()
    problems = []
    for ax in fig.axes:
        if hasattr(ax, "_colorbar"):
            continue
        where = repr(ax.get_title().splitlines()[0] if ax.get_title() else ax)
        series = _series(ax)
        shown = _legend_texts(fig, ax)
        for label, _ in series:
            alone_in_title = len(series) == 1 and label in ax.get_title()
            if label.startswith("_") or not (label in shown or alone_in_title):
                problems.append(f"{where}: series {label!r} is in no legend")
        for which in ("y", "x"):
            name = ax.get_ylabel() if which == "y" else ax.get_xlabel()
            if NONNEGATIVE.search(name) and _cut(ax, which):
                problems.append(f"{where}: {name!r} axis does not reach 0")
        bars = [c for c in ax.containers if isinstance(c, BarContainer)]
        for container in bars:
            which = "y" if container.orientation == "vertical" else "x"
            if _cut(ax, which):
                problems.append(f"{where}: bars on an axis that does not reach 0")
        for band in ax.collections:
            if isinstance(band, PolyCollection) and band.get_alpha() in (None, 1):
                problems.append(f"{where}: an opaque area with no series")
    return problems


def test_the_checker_finds_a_cut_axis_and_an_unlabelled_series() -> None:
    fig, (a, b, c) = plt.subplots(1, 3)
    a.plot([1, 2], [3e6, 4e6], label="up")
    a.set_ylim(2.5e6, 4.5e6)
    a.set(ylabel="MB")
    a.legend()
    b.plot([1, 2], [0.5, 0.6])  # no label
    b.plot([1, 2], [0.4, 0.5], label="shown")
    b.legend()
    c.bar([0, 1], [0.70, 0.75], label="accuracy")
    c.set_ylim(0.6, 0.8)
    c.legend()
    problems = misleading(fig)
    assert len(problems) == 3, problems
    assert "'MB' axis does not reach 0" in problems[0]
    assert "is in no legend" in problems[1]
    assert "bars on an axis that does not reach 0" in problems[2]
    a.set_yscale("log")  # a log axis on purpose is not a cut axis
    assert len(misleading(fig)) == 2


def test_one_series_may_be_named_by_its_title_instead() -> None:
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], label="fedavg-lora")
    ax.set(title="fedavg-lora: rank", ylabel="rank")
    assert misleading(fig) == []
    ax.set(title="rank")
    assert misleading(fig) == ["'rank': series 'fedavg-lora' is in no legend"]


# --------------------------------------------------------- synthetic runs


def _run(
    root: Path,
    name: str,
    method: str,
    *,
    config: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
    rows: list[dict[str, Any]],
) -> Path:
    run_dir = root / name
    extra = tuple(dict.fromkeys(k for r in rows for k in r if k not in COLUMNS))
    writer = ResultsWriter(
        run_dir,
        method=method,
        config={"method": method, **(config or {})},
        extra_columns=extra,
    )
    for row in rows:
        writer.append(row)
    writer.close()
    (run_dir / "summary.json").write_text(
        json.dumps({"initial-accuracy": 0.5, "initial-loss": 1.2, **(summary or {})})
    )
    return run_dir


def _rows(n: int, **columns: list[float]) -> list[dict[str, Any]]:
    base = {"accuracy": 0.6, "loss": 0.7, "bytes-up": 1e6, "bytes-down": 2e6}
    return [
        {"round": t + 1, **base, **{k: v[t] for k, v in columns.items()}}
        for t in range(n)
    ]


def _every_kind(root: Path) -> list[Path]:
    """A run of every kind a figure draws differently."""
    eps = ROUNDING_RELATIVE_GAP / 10
    return [
        _run(  # a gap spanning decades, a growing rank, a stage switch
            root,
            "spec",
            "fedspec",
            config={"seed": 0},
            rows=_rows(
                4,
                **{
                    "frobenius-gap": [0.3, 0.01, 0.002, 0.001],
                    "relative-gap": [0.5, 0.1, 0.01, 0.01],
                    "rank": [4.0, 6.0, 8.0, 8.0],
                    "stage": [1.0, 1.0, 2.0, 2.0],
                },
            ),
        ),
        _run(  # an exact method: its gap is rounding, drawn as 0
            root,
            "rolora",
            "rolora",
            config={"seed": 0},
            rows=_rows(
                4,
                **{
                    "frobenius-gap": [1e-9, 2e-9, 1.5e-8, 3e-9],
                    "relative-gap": [eps, eps, eps, eps],
                },
            ),
        ),
        _run(  # DP-SGD with a budget, client-level DP
            root,
            "dp",
            "fedavg-lora",
            config={"seed": 1, "dp-epsilon": 3.0},
            rows=_rows(
                3,
                **{
                    "dp-epsilon": [1.8, 2.4, 2.9],
                    "client-dp-epsilon": [0.5, 0.8, 1.0],
                    "frobenius-gap": [0.2, 0.1, 0.1],
                },
            ),
        ),
        _run(  # personalised
            root,
            "fedsa",
            "fedsa-lora",
            config={"seed": 0},
            summary={"evaluation": "personalised"},
            rows=_rows(3, **{"frobenius-gap": [2.0, 2.1, 2.2]}),
        ),
        _run(  # folds its gap into W0
            root,
            "fedex",
            "fedex-lora",
            config={"seed": 0},
            summary={"folds-base": True},
            rows=_rows(3, **{"frobenius-gap": [0.2, 0.1, 0.05]}),
        ),
    ]


def _async_runs(root: Path) -> list[Path]:
    """FedAsync-like: a version per reply, some with 0 bytes down, some not
    evaluated."""
    nan = float("nan")
    return [
        _run(
            root,
            f"fedasync-{seed}",
            "fedasync-lora",
            config={"seed": seed},
            rows=_rows(
                4,
                **{
                    "virtual-time": [3.0 + seed, 5.0, 9.5, 12.0],
                    "bytes-down": [2e6, 0.0, 0.0, 2e6],
                    "accuracy": [0.55, nan, 0.6, 0.62],
                },
            ),
        )
        for seed in (0, 1)
    ]


def _lm_runs(root: Path) -> list[Path]:
    out = []
    for method, personal in (("fedavg-lora", False), ("fedsa-lora", True)):
        for seed in (0, 1):
            out.append(
                _run(
                    root,
                    f"{method}-{seed}",
                    method,
                    config={"seed": seed},
                    summary={
                        "evaluation": "personalised" if personal else "global",
                        "initial-exact-match": 0.0,
                        "initial-perplexity": 67.0,
                    },
                    rows=_rows(
                        3,
                        **{
                            "exact-match": [0.01, 0.02 + seed / 100, 0.04],
                            "perplexity": [4.8, 4.1, 3.9 + seed / 10],
                            "frobenius-gap": [0.5, 0.4, 0.3],
                        },
                    ),
                )
            )
    return out


# ------------------------------------------------------ every figure checked


def _figures_of(root: Path) -> dict[str, Figure]:
    """Every figure function's figures on the synthetic runs."""
    kinds = _every_kind(root / "kinds")
    asynchronous = _async_runs(root / "async")
    lm = _lm_runs(root / "lm")
    runs = [load_run(d) for d in kinds]
    out = {f"figures/{k}": v for k, v in figures(runs).items()}
    one = {f"one/{k}": v for k, v in figures([load_run(kinds[1])]).items()}
    out.update(one)
    async_runs = [load_run(d) for d in asynchronous]
    out.update({f"async/{k}": v for k, v in figures(async_runs).items()})
    out["epsilon_figure"] = epsilon_figure(runs)
    out["lm_figure"] = lm_figure([load_run(d) for d in lm])
    matrix = load_run(kinds[0])
    matrix.matrix = pd.DataFrame([[0.9, float("nan")], [0.7, 0.95]]).to_numpy()
    out["accuracy_matrix_figure"] = accuracy_matrix_figure([matrix])
    out["comparison_figure"] = comparison_figure([*kinds, *asynchronous])
    out["comparison_figure/async"] = comparison_figure(asynchronous)
    out["comparison_figure/lm"] = comparison_figure(lm)
    summarised = summarise(collect([*kinds, *asynchronous]))
    out["summary_figure"] = summary_figure(summarised, reference="fedavg-lora")
    out["summary_figure/lm"] = summary_figure(summarise(collect(lm)))
    return out


def test_no_figure_misleads(tmp_path: Path) -> None:
    drawn = _figures_of(tmp_path)
    assert {"figures/gap.png", "figures/bytes.png", "figures/epsilon.png"} <= set(drawn)
    assert {"figures/rank.png", "async/bytes.png", "one/gap.png"} <= set(drawn)
    problems = {name: misleading(fig) for name, fig in drawn.items()}
    assert {k: v for k, v in problems.items() if v} == {}


def test_every_figure_function_is_checked() -> None:
    """A new figure function must join :func:`_figures_of`."""
    drawn = {"figures", "epsilon_figure", "lm_figure", "accuracy_matrix_figure"}
    drawn |= {"comparison_figure", "summary_figure"}
    found = {
        name
        for module in (plots, table)
        for name, value in inspect.getmembers(module, inspect.isfunction)
        if value.__module__ == module.__name__
        and (name.endswith("_figure") or name == "figures")
        and not name.startswith("_")
    }
    assert found == drawn


def test_study_figures_do_not_mislead() -> None:
    from benchmarks import privacy, robustness

    rows = pd.DataFrame(
        {
            "defence": ["none", "none", "serverclip", "serverclip"],
            "robust": ["none", "none", "norm-clip", "norm-clip"],
            "seed": [0, 1, 0, 1],
            "attack": ["none", "sign-flip", "none", "sign-flip"],
            "attackers": [0, 1, 0, 1],
            "final-accuracy": [0.76, 0.50, 0.75, 0.72],
        }
    )
    fig = robustness.figure(rows, "title")
    assert misleading(fig) == []
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert any('robust = "auto"' in label for label in labels)
    assert not any(label == "serverclip" for label in labels)
    privacy_rows = pd.DataFrame(
        {
            "method": ["fedavg-lora"] * 4,
            "level": ["1", "1", privacy.NO_DP, privacy.NO_DP],
            "epsilon-spent": [0.98, 0.99, float("nan"), float("nan")],
            "seed": [0, 1, 0, 1],
            "final-accuracy": [0.55, 0.56, 0.73, 0.74],
        }
    )
    assert misleading(privacy.figure(privacy_rows)) == []


# ------------------------------------------------------ what the fixes draw


def test_rounding_gaps_are_drawn_as_zero_and_said(tmp_path: Path) -> None:
    run = load_run(_every_kind(tmp_path)[1])
    ax = figures([run])["gap.png"].axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0.0] * 4]
    assert "float32 rounding" in ax.get_title()
    assert "the largest 1.5e-08" in ax.get_title()
    assert ax.get_ylim()[0] == 0.0
    gap = comparison_figure([run.path]).axes[-1]
    assert [list(line.get_ydata()) for line in gap.get_lines()] == [[0.0] * 4]
    assert "float32 rounding" in gap.get_title()
    # a real gap is kept: FedSpec's 0.3 .. 0.001 on the same axes
    spec = load_run(_every_kind(tmp_path / "b")[0])
    ax = figures([spec])["gap.png"].axes[0]
    assert list(ax.get_lines()[0].get_ydata()) == [0.3, 0.01, 0.002, 0.001]
    assert "rounding" not in ax.get_title() and ax.get_yscale() == "symlog"


def test_epsilon_from_zero_with_the_budget_labelled(tmp_path: Path) -> None:
    dp = load_run(_every_kind(tmp_path)[2])
    sgd, client = epsilon_figure([dp]).axes
    assert sgd.get_ylim()[0] == 0.0 and client.get_ylim()[0] == 0.0
    budget = [line for line in sgd.get_lines() if "budget" in line.get_label()]
    assert len(budget) == 1 and list(budget[0].get_ydata()) == [3.0, 3.0]
    assert "budget epsilon = 3" in budget[0].get_label()
    assert sgd.get_ylim()[1] > 3.0  # the budget is inside the panel
    assert sgd.get_xlim()[0] > 0.0  # the budget line does not widen the rounds
    assert not [line for line in client.get_lines() if "budget" in line.get_label()]


def test_asynchronous_runs_are_drawn_on_the_virtual_clock(tmp_path: Path) -> None:
    runs = [load_run(d) for d in _async_runs(tmp_path)]
    drawn = figures(runs)
    acc = drawn["accuracy_loss.png"].axes[0]
    assert acc.get_xlabel() == TIME_AXIS.label
    # round 0 at time 0, then the evaluated versions only
    assert list(acc.get_lines()[0].get_xdata()) == [0.0, 3.0, 9.5, 12.0]
    down = drawn["bytes.png"].axes[1]
    assert list(down.get_lines()[0].get_ydata()) == [2.0, 0.0, 0.0, 2.0]
    assert down.get_ylim()[0] == 0.0
    mean = comparison_figure([r.path for r in runs]).axes[0].get_lines()[0]
    # the seeds' mean time of each evaluated version
    assert list(mean.get_xdata()) == [0.0, 3.5, 9.5, 12.0]


def test_mixed_runs_say_an_asynchronous_round_is_a_version(tmp_path: Path) -> None:
    runs = [load_run(d) for d in [*_async_runs(tmp_path), _every_kind(tmp_path)[0]]]
    ax = figures(runs)["accuracy_loss.png"].axes[0]
    assert ax.get_xlabel() == "round (asynchronous: server version)"


def test_personalised_lm_runs_have_panels_of_their_own(tmp_path: Path) -> None:
    fig = comparison_figure(_lm_runs(tmp_path))
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 5
    for ax, title in zip(fig.axes[:4], titles[:4], strict=True):
        labels = [line.get_label() for line in ax.get_lines()]
        if "personalised" in title:
            assert labels == ["fedsa-lora [personalised] (n=2)"]
        else:
            assert "global models" in title
            assert labels == ["fedavg-lora (n=2)"]
    assert sum("personalised" in t for t in titles[:4]) == 2


def test_summary_figure_puts_personalised_rows_apart(tmp_path: Path) -> None:
    summarised = summarise(collect(_every_kind(tmp_path)))
    fig = summary_figure(summarised, reference="fedavg-lora")
    (global_acc, global_mb, personal_acc, personal_mb) = fig.axes
    ticks = [t.get_text() for t in global_acc.get_yticklabels()]
    assert all("fedsa-lora" not in t for t in ticks)
    assert [t.get_text() for t in personal_acc.get_yticklabels()] == [
        "fedsa-lora (personalised) (n=1)"
    ]
    assert "personalised" in personal_acc.get_title()
    # one log axis for the bytes of every row (they span 50x and more)
    assert global_mb.get_xscale() == personal_mb.get_xscale() == "log"
    assert global_mb.get_xlim() == personal_mb.get_xlim()
    reference = [line for line in global_acc.get_lines() if "mean" in line.get_label()]
    assert reference and reference[0].get_label() == "fedavg-lora's mean"
