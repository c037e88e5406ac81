"""Plots of one or several runs, from their CSVs (matplotlib, PNG).

Every run writes its plots at the end (:func:`write_run_plots`); the same
figures can be regenerated, or drawn for several runs on shared axes, with::

    python -m fedlr.runs.plots RUN_DIR [RUN_DIR ...] [--out DIR]

Figures (each written only when some run has the data):

``accuracy_loss.png``
    Accuracy and loss per round (two panels), from round 0 (the initial
    model, ``summary.json``'s ``initial-accuracy`` / ``initial-loss``) when
    the run recorded it.
``gap.png``
    Frobenius gap ``||ΔW_ideal - ΔW_agg||_F`` per round, from 0 (a
    symmetric-log axis, linear near 0, when the gaps span more than a
    decade); a gap at float32 rounding (relative gap at most
    :data:`ROUNDING_RELATIVE_GAP`) is drawn as 0, and the title says so. For
    a method that folds it into the base weights (FedEx-LoRA, VeRA-FedEx)
    the gap of the factors before the fold, which the title says (the fold
    makes the model exact).
``rank.png``
    Adapter rank per round, only when a rank changes (FedSpec grows it,
    HetLoRA prunes) or the runs differ in rank.
``bytes.png``
    MB sent up (clients to server) and down (server to clients) per round,
    one panel each, zeros included, from 0 (symmetric-log when the values
    span more than 50x).
``lm.png``
    Causal-LM runs: exact match of the greedy answers and response
    perplexity (log scale) per round (:func:`lm_figure`).
``epsilon.png``
    Runs with differential privacy: the epsilon spent per round from 0, one
    panel per mechanism (``dp-epsilon``, ``client-dp-epsilon``;
    :func:`epsilon_figure`), with the run's budget (``dp-epsilon`` in its
    config) as a labelled dashed line.
``accuracy_matrix.png``
    Continual runs: accuracy on task ``j`` (columns) after training task ``t``
    (rows), one heatmap panel per run, ACC and FGT in the title.

A run is labelled by its method plus ``key=value`` for every config key
whose value differs between the runs drawn (``lr=0.003`` against
``lr=0.01``; :func:`run_labels`). Accuracy and loss say whether they are the
global model's (server's held-out split) or personalised (FedSA-LoRA,
Global / Local SVD: each client's own model on its own held-out part,
averaged); personalised runs are dashed and labelled ``[personalised]``.
Round axes have integer ticks; when every run drawn is asynchronous (it
writes ``virtual-time``) the x axis is its seconds since the first
instruction instead (the virtual clock's in simulation),
and a mix of both reads "round (asynchronous: server version)". Every panel
has a legend, under the panel, outside the data; QR-Mix's switch to stage 2
and a continual run's task boundaries are dotted vertical lines on the
per-round panels.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator
from matplotlib.transforms import offset_copy

from fedlr.runs.results import read_results

__all__ = [
    "ROUNDING_RELATIVE_GAP",
    "RunData",
    "XAxis",
    "accuracy_matrix_figure",
    "continual_metrics",
    "differing_keys",
    "epsilon_figure",
    "figures",
    "gap_values",
    "lm_figure",
    "load_run",
    "main",
    "nonnegative_axis",
    "outside_legend",
    "per_round_axes",
    "plot_runs",
    "run_labels",
    "write_run_plots",
    "x_axis",
]

PERSONAL_COLUMN = "personal-clients"
"""A results column only personalised methods write."""

EPSILON_PANELS = {
    "dp-epsilon": "DP-SGD epsilon spent (largest over the nodes)",
    "client-dp-epsilon": "client-level DP epsilon spent",
}
"""The privacy columns and the titles of their panels in ``epsilon.png``."""

PERSONAL_LABEL = "personalised"
"""Added to a personalised run's label; its lines are dashed."""

FOLDED_GAP_TITLE = (
    "gap of the factors before the fold\n(the fold into W0 makes the model exact)"
)
"""The gap panel's title when every run folds its gap into the base weights."""

_UNLABELLED_KEYS = {"output-dir", "resume-from", "method"}
"""Config keys never used to tell runs apart (paths; the method leads)."""

MATRIX_FILE = "accuracy_matrix.csv"
"""Continual runs' accuracy matrix: columns ``after-task, task-0, ..``."""

ROUNDING_RELATIVE_GAP = 64 * float(np.finfo(np.float32).eps)
"""A relative gap (``relative-gap``: the gap over ``||ΔW_ideal||_F``) at or
under this, 64 float32 epsilons (7.6e-6), is rounding, drawn as 0: an exact
method's gap (RoLoRA, RAVAN, FFA-LoRA) is float32 arithmetic's, not an
error of the method."""

VIRTUAL_TIME = "virtual-time"
"""The column asynchronous runs write: virtual-clock seconds at each version."""


class XAxis(NamedTuple):
    """What the per-round panels' x axis is: a results column and its label."""

    column: str
    label: str


ROUND_AXIS = XAxis("round", "round")
TIME_AXIS = XAxis(VIRTUAL_TIME, "seconds since the first instruction (virtual-time)")
"""The virtual clock's seconds in simulation, real ones under ``flwr run``."""
MIXED_AXIS = XAxis("round", "round (asynchronous: server version)")


@dataclass
class RunData:
    """What the plots read from one run directory.

    Attributes
    ----------
    path : pathlib.Path
    results : pandas.DataFrame
        ``results.csv``.
    config : dict
        ``config.json`` (empty if absent).
    matrix : numpy.ndarray or None
        ``accuracy_matrix.csv`` of a continual run: (tasks, tasks), row ``t``
        = accuracies after training task ``t``, NaN for tasks not yet seen.
    label : str
    """

    path: Path
    results: pd.DataFrame
    config: dict[str, Any]
    matrix: np.ndarray | None
    label: str = ""
    initial: dict[str, float] | None = None
    """Round 0 (the initial model): ``accuracy`` and ``loss`` where recorded."""
    personalised: bool = False
    """The accuracy is personalised (each client's own model on its own
    held-out part, averaged), not the global model's on the server's split."""
    folds_base: bool = False
    """The method folds the factor gap into the base weights (FedEx-LoRA,
    VeRA-FedEx): its ``frobenius-gap`` is the gap before the fold, not an
    error of the model."""


def _read_matrix(path: Path) -> np.ndarray | None:
    """Columns ``task-0 .. task-{T-1}`` (one row per finished task)."""
    if not path.is_file():
        return None
    frame = pd.read_csv(path)
    numbered = {
        int(m.group(1)): c
        for c in frame.columns
        if (m := re.fullmatch(r"task[-_ ]?(\d+)", str(c).strip().lower()))
    }
    if not numbered:
        raise ValueError(
            f"{path} has no task-<j> columns; columns are {list(frame.columns)}"
        )
    columns = [numbered[j] for j in sorted(numbered)]
    return frame[columns].to_numpy(dtype=float)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_run(run_dir: Path | str) -> RunData:
    """Read a run directory (``results.csv`` required).

    Raises
    ------
    FileNotFoundError
        If ``results.csv`` is missing.
    """
    path = Path(run_dir)
    results = read_results(path)
    config, summary = (_json(path / name) for name in ("config.json", "summary.json"))
    method = str(results["method"].iloc[0]) if len(results) else path.name
    initial = {
        key: float(summary[f"initial-{key}"])
        for key in ("accuracy", "loss", "exact-match", "perplexity")
        if isinstance(summary.get(f"initial-{key}"), (int, float))
        and math.isfinite(summary[f"initial-{key}"])
    }
    return RunData(
        path=path,
        results=results,
        config=config,
        matrix=_read_matrix(path / MATRIX_FILE),
        label=method,
        initial=initial or None,
        personalised=_personalised(summary, results, method),
        folds_base=_folds_base(summary, method),
    )


def _registered(method: str) -> Any:
    """The method's registration, when the registry is loaded already (the
    ServerApp, ``fedlr.launch.compare``; plotting alone does not load it)."""
    registry = sys.modules.get("fedlr.strategies.registry")
    try:
        return registry.get_method(method) if registry else None
    except (KeyError, LookupError, ValueError):
        return None


def _trait(method: str, name: str) -> bool:
    """A registered method's trait (False when the registry is not loaded)."""
    spec = _registered(method)
    return spec is not None and bool(getattr(spec.traits, name))


def _personalised(summary: dict[str, Any], results: pd.DataFrame, method: str) -> bool:
    """``summary.json``'s ``evaluation``, else the personalised methods'
    ``personal-clients`` column (FedSA-LoRA, Global / Local SVD)."""
    if "evaluation" in summary:
        return summary["evaluation"] == "personalised"
    return PERSONAL_COLUMN in results or _trait(method, "personalised")


def _folds_base(summary: dict[str, Any], method: str) -> bool:
    """Whether the run folds each round's gap into the base weights (the gap
    panel's "before the fold"): ``summary.json``'s ``folds-base``, else the
    registry's trait, and not for a method whose fold is its initialisation
    only (its strategy's ``folds_gap``: ILoRA, whose W is unchanged after
    it and whose gap is what the clients receive)."""
    folds = (
        bool(summary["folds-base"])
        if "folds-base" in summary
        else _trait(method, "folds_base")
    )
    strategy = getattr(_registered(method), "strategy", None)
    return folds and bool(getattr(strategy, "folds_gap", True))


def differing_keys(configs: Sequence[dict[str, Any]]) -> list[str]:
    """The config keys whose values differ across ``configs``, in first-seen
    order; paths and the method left out. A key only some configs have (a
    method's own option) differs only if those that have it disagree."""
    keys = list(dict.fromkeys(k for c in configs for k in c))
    out = []
    for key in keys:
        if key in _UNLABELLED_KEYS:
            continue
        values = {
            json.dumps(c[key], sort_keys=True, default=str) for c in configs if key in c
        }
        if len(values) > 1:
            out.append(key)
    return out


def _value_text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def run_labels(runs: Sequence[RunData], skip: Sequence[str] = ()) -> list[str]:
    """A label per run: its method, then ``key=value`` for each config key
    that differs between the runs (e.g. ``fedex-lora lr=0.003``; keys in
    ``skip`` left out), and ``[personalised]`` for a personalised run. Runs
    still alike are told apart by their directory names."""
    methods = [
        str(r.results["method"].iloc[0]) if len(r.results) else r.path.name
        for r in runs
    ]
    keys = [k for k in differing_keys([r.config for r in runs]) if k not in skip]
    labels = []
    for run, method in zip(runs, methods, strict=True):
        parts = [method]
        parts += [f"{k}={_value_text(run.config[k])}" for k in keys if k in run.config]
        if run.personalised:
            parts.append(f"[{PERSONAL_LABEL}]")
        labels.append(" ".join(parts))
    if skip:
        return labels
    return [
        f"{label} ({run.path.name})" if labels.count(label) > 1 else label
        for run, label in zip(runs, labels, strict=True)
    ]


def _numbers(run: RunData, column: str) -> pd.Series:
    """The run's ``column`` as numbers (NaN where not one; empty if absent)."""
    if column not in run.results:
        return pd.Series(dtype=float)
    return pd.to_numeric(run.results[column], errors="coerce")


def _asynchronous(run: RunData) -> bool:
    """The run wrote the virtual clock's time (fedlr's asynchronous engine)."""
    return bool(_numbers(run, VIRTUAL_TIME).notna().any())


def x_axis(runs: Sequence[RunData]) -> XAxis:
    """The virtual clock when every run is asynchronous, else rounds (a
    version is an asynchronous run's round)."""
    asynchronous = [_asynchronous(run) for run in runs]
    if asynchronous and all(asynchronous):
        return TIME_AXIS
    return MIXED_AXIS if any(asynchronous) else ROUND_AXIS


def gap_values(frame: pd.DataFrame) -> pd.Series:
    """``frobenius-gap`` with the rounds at float32 rounding set to 0.

    A round whose ``relative-gap`` is at most :data:`ROUNDING_RELATIVE_GAP`
    counts as rounding; without a relative gap the value is kept.
    """
    gap = pd.to_numeric(frame["frobenius-gap"], errors="coerce")
    if "relative-gap" not in frame:
        return gap
    relative = pd.to_numeric(frame["relative-gap"], errors="coerce")
    return gap.mask(relative <= ROUNDING_RELATIVE_GAP, 0.0)


def _label_runs(runs: Sequence[RunData]) -> None:
    for run, label in zip(runs, run_labels(runs), strict=True):
        run.label = label


def continual_metrics(matrix: np.ndarray) -> tuple[float, float]:
    """ACC and FGT of an accuracy matrix.

    ACC is the mean accuracy over all tasks after the last one; FGT the mean,
    over every task but the last, of its best accuracy after any earlier task
    minus its final accuracy.

    Parameters
    ----------
    matrix : (T, T) numpy.ndarray
        Row ``t``: accuracies after training task ``t``.
    """
    final = matrix[-1]
    acc = float(np.nanmean(final))
    if matrix.shape[0] < 2:
        return acc, 0.0
    drops = [
        float(np.nanmax(matrix[j:-1, j]) - final[j]) for j in range(matrix.shape[0] - 1)
    ]
    return acc, float(np.mean(drops))


def _has(runs: Sequence[RunData], column: str, positive: bool = False) -> bool:
    for run in runs:
        values = _numbers(run, column).dropna()
        if len(values[values > 0] if positive else values):
            return True
    return False


def _line(
    ax: Any,
    run: RunData,
    column: str,
    *,
    x: XAxis = ROUND_AXIS,
    from_zero: bool = False,
    values: pd.Series | None = None,
    **kwargs: Any,
) -> None:
    """``column`` (or ``values``) against ``x``, missing values left out;
    with ``from_zero`` the initial model's value first (round 0, time 0)."""
    frame = run.results
    if values is None:
        if column not in frame:
            return
        values = pd.to_numeric(frame[column], errors="coerce")
    xs_all = pd.to_numeric(frame[x.column], errors="coerce")
    mask = values.notna() & xs_all.notna()
    xs = [float(r) for r in xs_all[mask]]
    ys = [float(v) for v in values[mask]]
    start = (run.initial or {}).get(column) if from_zero else None
    if start is not None:
        xs, ys = [0.0, *xs], [start, *ys]
    if ys:
        ax.plot(xs, ys, marker="o", ms=3, **kwargs)


_BOUNDARY = {"stage": "stage {after:g} starts", "task": "next task"}


def _boundaries(run: RunData, x: XAxis = ROUND_AXIS) -> list[tuple[float, str]]:
    """Between which rounds something changes, and what: QR-Mix's stage, a
    continual run's task (half-way between the two rows' ``x``)."""
    frame = run.results
    marks: list[tuple[float, str]] = []
    for column, text in _BOUNDARY.items():
        if column not in frame:
            continue
        values = pd.to_numeric(frame[column], errors="coerce")
        xs = pd.to_numeric(frame[x.column], errors="coerce")
        for i in range(1, len(values)):
            before, after = values.iloc[i - 1], values.iloc[i]
            if pd.notna(before) and pd.notna(after) and after != before:
                at = (float(xs.iloc[i - 1]) + float(xs.iloc[i])) / 2
                marks.append((at, text.format(after=float(after))))
    return marks


def per_round_axes(ax: Any, runs: Sequence[RunData], x: XAxis = ROUND_AXIS) -> None:
    """The x axis's label (integer ticks for rounds), the runs' boundary
    lines (QR-Mix's stage 2, a continual run's next task), a legend if
    anything is drawn."""
    ax.set_xlabel(x.label)
    if x.column == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lows, highs = [], []
    for line in ax.get_lines():
        xs = np.asarray(line.get_xdata(), dtype=float)
        x_in_data, _ = line.get_transform().contains_branch_seperately(ax.transData)
        if xs.size and x_in_data:  # not a horizontal line across the panel
            lows.append(xs.min())
            highs.append(xs.max())
    if lows:
        low, high = min(lows), max(highs)
        pad = 0.5 if high - low < 4 else 0.04 * (high - low)
        ax.set_xlim(low - pad, high + pad)
    labelled = set()
    for run in runs:
        for at, text in _boundaries(run, x):
            ax.axvline(
                at,
                color="grey",
                linestyle=":",
                linewidth=1,
                label=None if text in labelled else text,
            )
            labelled.add(text)
    if ax.get_lines():
        outside_legend(ax)


def outside_legend(ax: Any) -> None:
    """The panel's legend under it, 36 points below the axes (clear of the
    x label whatever the panel's height; ``tight_layout`` makes room); one
    column when the labels are long."""
    _, labels = ax.get_legend_handles_labels()
    if not labels:
        return
    longest = max(len(text) for text in labels)
    ax.legend(
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        bbox_transform=offset_copy(ax.transAxes, fig=ax.figure, y=-36, units="points"),
        ncol=1 if longest > 28 else min(len(labels), 3),
        frameon=False,
    )


def _rank_changes(runs: Sequence[RunData]) -> bool:
    ranks = {float(v) for run in runs for v in _numbers(run, "rank").dropna()}
    return len(ranks) > 1


def _megabytes(value: float, _: Any) -> str:
    return f"{value:g}"


def nonnegative_axis(
    ax: Any, values: Sequence[float], decades: float, axis: str = "y"
) -> None:
    """A non-negative quantity's axis (``"y"`` or ``"x"``) from 0: linear,
    or symmetric-log (linear up to the smallest positive value, plain tick
    labels) when the positive values span more than ``decades`` times."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    scale = ax.set_yscale if axis == "y" else ax.set_xscale
    target = ax.yaxis if axis == "y" else ax.xaxis
    if positive and max(positive) > decades * min(positive):
        scale("symlog", linthresh=min(positive), linscale=0.5)
        target.set_major_formatter(FuncFormatter(_megabytes))
    if axis == "y":
        ax.set_ylim(bottom=0.0)
    else:
        ax.set_xlim(left=0.0)


def figures(runs: Sequence[RunData]) -> dict[str, Figure]:
    """The figures for ``runs``, keyed by file name (not yet saved).

    Accuracy and loss always; the gap, rank, bytes, LM and accuracy-matrix
    figures only where some run has something to show in them. Per-round
    panels share one x axis (:func:`x_axis`).
    """
    _label_runs(runs)
    x = x_axis(runs)
    out = {"accuracy_loss.png": _accuracy_loss_figure(runs, x)}
    if _has(runs, "frobenius-gap", positive=True):
        out["gap.png"] = _gap_figure(runs, x)
    if _rank_changes(runs):
        out["rank.png"] = _rank_figure(runs, x)
    if _has(runs, "bytes-up", positive=True) or _has(runs, "bytes-down", positive=True):
        out["bytes.png"] = _bytes_figure(runs, x)
    if _has(runs, "perplexity"):
        out["lm.png"] = lm_figure(runs, x)
    if any(_has(runs, column) for column in EPSILON_PANELS):
        out["epsilon.png"] = epsilon_figure(runs, x)
    continual = [run for run in runs if run.matrix is not None]
    if continual:
        out["accuracy_matrix.png"] = accuracy_matrix_figure(continual)
    return out


def _evaluation_note(runs: Sequence[RunData]) -> str:
    """What the accuracy and loss panels measure: the global model on the
    server's held-out split, personalised models (each client's own, on its
    own held-out part, averaged), or both (dashed lines personalised)."""
    personal = [run.personalised for run in runs]
    if all(personal):
        return "personalised: mean over clients, each on its own held-out part"
    if any(personal):
        return (
            "solid: global model, server's held-out split;\n"
            "dashed: personalised, each client on its own part"
        )
    return "global model, server's held-out split"


def _style(run: RunData) -> dict[str, Any]:
    return {"linestyle": "--"} if run.personalised else {}


def _accuracy_loss_figure(runs: Sequence[RunData], x: XAxis) -> Figure:
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4.2))
    for run in runs:
        style = _style(run)
        for ax, column in ((ax_acc, "accuracy"), (ax_loss, "loss")):
            _line(ax, run, column, x=x, from_zero=True, label=run.label, **style)
    note = _evaluation_note(runs)
    ax_acc.set(title=f"accuracy\n({note})", ylabel="accuracy")
    ax_loss.set(title=f"loss\n({note})", ylabel="loss")
    for ax in (ax_acc, ax_loss):
        per_round_axes(ax, runs, x)
    return fig


def _gap_titles(runs: Sequence[RunData]) -> tuple[str, str]:
    """The gap panel's title and y label: the gap before the fold when every
    run folds it into the base weights (FedEx-LoRA), both kinds, or plain."""
    folded = [run for run in runs if run.folds_base]
    if folded and len(folded) == len(runs):
        return FOLDED_GAP_TITLE, "gap before the fold, ||mean(B_i A_i) - B̄Ā||_F"
    if folded:
        return (
            "Frobenius gap ||ΔW_ideal - ΔW_agg||_F\n(dashed: before the fold, "
            "which makes the model exact)",
            "gap",
        )
    return "Frobenius gap ||ΔW_ideal - ΔW_agg||_F", "gap"


def _gap_figure(runs: Sequence[RunData], x: XAxis) -> Figure:
    """The Frobenius gap from 0, rounding drawn as 0 (:func:`gap_values`);
    for methods that fold it into the base weights (FedEx-LoRA) the title
    says it is the gap before the fold, not an error; mixed with other
    methods, their lines are dashed and labelled so."""
    fig, ax = plt.subplots(figsize=(6, 4.4))
    mixed = any(run.folds_base for run in runs) and not all(
        run.folds_base for run in runs
    )
    drawn: list[float] = []
    rounding: list[float] = []  # the gaps drawn as 0
    for run in runs:
        raw = pd.to_numeric(run.results["frobenius-gap"], errors="coerce")
        gap = gap_values(run.results)
        rounding += [float(v) for v in raw[(gap == 0) & (raw > 0)]]
        drawn += [float(v) for v in gap.dropna()]
        label, linestyle = run.label, "-"
        if run.folds_base and mixed:
            label, linestyle = f"{label} (before the fold)", "--"
        _line(ax, run, "frobenius-gap", x=x, values=gap, label=label, ls=linestyle)
    title, ylabel = _gap_titles(runs)
    if rounding:
        title += (
            f"\ndrawn as 0: gaps at float32 rounding\n(relative gap ≤ "
            f"{ROUNDING_RELATIVE_GAP:.1e}; the largest {max(rounding):.1e})"
        )
    ax.set(title=title, ylabel=ylabel)
    nonnegative_axis(ax, drawn, decades=10)
    per_round_axes(ax, runs, x)
    return fig


def _budgets(runs: Sequence[RunData]) -> list[float]:
    """The DP-SGD budgets (``dp-epsilon`` in the runs' configs, 0 = none)."""
    out = set()
    for run in runs:
        value = run.config.get("dp-epsilon")
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            out.add(float(value))
    return sorted(out)


def epsilon_figure(runs: Sequence[RunData], x: XAxis | None = None) -> Figure:
    """The privacy spent per round, from 0: one panel per DP column a run
    has (``dp-epsilon``: the largest DP-SGD epsilon a node reported;
    ``client-dp-epsilon``), titled from :data:`EPSILON_PANELS`; the DP-SGD
    panel draws each run's budget (its ``dp-epsilon`` setting) as a dashed
    line labelled with it."""
    x = x or x_axis(runs)
    columns = [c for c in EPSILON_PANELS if _has(runs, c)]
    fig, axes = plt.subplots(
        1, len(columns), figsize=(5.5 * len(columns), 4.2), squeeze=False
    )
    for ax, column in zip(axes[0], columns, strict=True):
        for run in runs:
            _line(ax, run, column, x=x, label=run.label)
        budgets = _budgets(runs) if column == "dp-epsilon" else []
        for i, budget in enumerate(budgets):
            ax.axhline(
                budget,
                color="black",
                linestyle=(0, (4, 2 + 2 * i)),
                linewidth=1,
                label=f"budget epsilon = {budget:g} (dp-epsilon)",
            )
        title = EPSILON_PANELS[column]
        if any(_reproducible(run) for run in runs):
            title += "\n(REPRODUCIBLE NOISE: not a guarantee)"
        ax.set(title=title, ylabel="epsilon")
        spent = [float(v) for line in ax.get_lines() for v in line.get_ydata()]
        ax.set_ylim(0.0, 1.08 * max(spent, default=1.0))
        per_round_axes(ax, runs, x)
    return fig


def _reproducible(run: RunData) -> bool:
    return bool((_numbers(run, "noise-reproducible") == 1).any())


def _rank_figure(runs: Sequence[RunData], x: XAxis) -> Figure:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for run in runs:
        _line(ax, run, "rank", x=x, label=run.label, drawstyle="steps-post")
    ax.set(title="adapter rank", ylabel="rank")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    per_round_axes(ax, runs, x)
    return fig


def _bytes_figure(runs: Sequence[RunData], x: XAxis) -> Figure:
    """MB up and down per round, zeros drawn, from 0; a symmetric-log axis
    with plain ticks when the positive values span more than 50x."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    titles = {
        "bytes-up": "sent up (clients to server)",
        "bytes-down": "sent down (server to clients)",
    }
    drawn: list[float] = []
    for ax, column in zip(axes, ("bytes-up", "bytes-down"), strict=True):
        for i, run in enumerate(runs):
            if column not in run.results:
                continue
            mb = pd.to_numeric(run.results[column], errors="coerce") / 1e6
            _line(ax, run, column, x=x, values=mb, color=f"C{i % 10}", label=run.label)
            drawn += [float(v) for v in mb.dropna()]
        ax.set(title=f"MB {titles[column]}", ylabel="MB")
    for ax in axes:
        nonnegative_axis(ax, drawn, decades=50)
        per_round_axes(ax, runs, x)
    return fig


def lm_figure(runs: Sequence[RunData], x: XAxis | None = None) -> Figure:
    """Causal-LM runs: exact match and response perplexity per round.

    The ``exact-match`` and ``perplexity`` columns of :mod:`fedlr.tasks.lm`'s
    evaluation, one line per run (runs without them are left out).
    """
    x = x or x_axis(runs)
    fig, (ax_em, ax_ppl) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in runs:
        _line(ax_em, run, "exact-match", x=x, from_zero=True, label=run.label)
        _line(ax_ppl, run, "perplexity", x=x, from_zero=True, label=run.label)
    ax_em.set(title="exact match of greedy answers", ylabel="exact match")
    ax_em.set_ylim(bottom=0.0)
    ax_ppl.set(title="response perplexity", ylabel="perplexity")
    if ax_ppl.get_lines():
        ax_ppl.set_yscale("log")
    for ax in (ax_em, ax_ppl):
        per_round_axes(ax, runs, x)
    return fig


def accuracy_matrix_figure(runs: Sequence[RunData]) -> Figure:
    """One heatmap panel per continual run, ACC and FGT in each title."""
    fig, axes = plt.subplots(
        1, len(runs), figsize=(4.2 * len(runs), 3.8), squeeze=False
    )
    for ax, run in zip(axes[0], runs, strict=True):
        matrix = run.matrix
        if matrix is None:
            continue
        acc, fgt = continual_metrics(matrix)
        image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis")
        for (t, j), value in np.ndenumerate(matrix):
            if not math.isnan(value):
                ax.text(
                    j,
                    t,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    color="white" if value < 0.6 else "black",
                    fontsize=8,
                )
        ax.set(
            title=f"{run.label}\nACC {acc:.3f}  FGT {fgt:.3f}",
            xlabel="evaluated on task",
            ylabel="after training task",
            xticks=range(matrix.shape[1]),
            yticks=range(matrix.shape[0]),
        )
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: Sequence[Path | str], out_dir: Path | str) -> list[Path]:
    """Write the figures of ``run_dirs`` (on shared axes) as PNGs in ``out_dir``.

    Returns
    -------
    list of pathlib.Path
        The files written.
    """
    if not run_dirs:
        raise ValueError("no run directories given")
    runs = [load_run(d) for d in run_dirs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures(runs).items():
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_run_plots(run_dir: Path | str) -> list[Path]:
    """Write one run's figures into its own directory."""
    return plot_runs([run_dir], run_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedlr.runs.plots RUN_DIR ... [--out DIR]``."""
    parser = argparse.ArgumentParser(
        description="Plot fedlr runs from their CSVs (several runs share axes)."
    )
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: the run directory if one is given, "
        "else ./plots)",
    )
    args = parser.parse_args(argv)
    out = args.out or (args.run_dirs[0] if len(args.run_dirs) == 1 else Path("plots"))
    for path in plot_runs(args.run_dirs, out):
        sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
