"""The comparison table and figure of finished runs.

:func:`write_table` writes, for run directories (a sweep's or any):

``table.md``
    One row per method (and per setting, when the runs differ in ``by``
    keys): final accuracy mean ± std over seeds, mean Frobenius gap over rounds
    and seeds, total bytes (up + down) per run, wall time per run, and ACC/FGT
    for continual runs; the seeds counted. Only finished runs (with a
    ``summary.json``) count; unfinished ones are counted apart (``2 (+1
    unfinished)``), and a row with none finished reads ``unfinished``. A
    personalised method's row says so (``feddpa (personalised)``), an
    asynchronous one's too (``fedbuff-lora (asynchronous)``).
``table.csv``
    The same numbers, unformatted (with ``personalised`` and
    ``asynchronous`` columns).
``comparison.png``
    Accuracy and Frobenius gap per round: the mean over seeds with a ±1 std
    band, one line per row of the table.
``summary.png``
    The final numbers of every row, readable for many methods: final
    accuracy (or exact match and perplexity) as a dot with a ±1 std bar over
    seeds, the personalised methods on panels of their own, and the bytes
    per run (:func:`summary_figure`).

:func:`collect`, :func:`summarise`, :func:`to_markdown`,
:func:`comparison_figure` and :func:`summary_figure` are its steps.
``python -m fedlr.launch.compare table`` is its command line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from fedlr.runs.plots import (
    FOLDED_GAP_TITLE,
    ROUND_AXIS,
    TIME_AXIS,
    RunData,
    XAxis,
    gap_values,
    load_run,
    nonnegative_axis,
    outside_legend,
    per_round_axes,
    run_labels,
    x_axis,
)

__all__ = [
    "UNFINISHED",
    "collect",
    "comparison_figure",
    "summarise",
    "summary_figure",
    "to_markdown",
    "write_table",
]

#: What a cell's or a table row's numbers read when no run of it finished.
UNFINISHED = "unfinished"


#: Panel titles of :func:`comparison_figure`.
GLOBAL_ACCURACY = "accuracy of the global model\n(server's held-out split)"
PERSONAL_ACCURACY = (
    "personalised accuracy\n(mean over clients, each on its own held-out part)"
)
GAP = "Frobenius gap ||ΔW_ideal - ΔW_agg||_F"
MIXED_GAP = f"{GAP}\n(dashed: before the fold, which makes the model exact)"


def collect(run_dirs: Sequence[Path | str], by: Sequence[str] = ()) -> pd.DataFrame:
    """One row per run: method, seed, the ``by`` settings and its totals.

    Columns: ``run``, ``method``, ``finished`` (the run wrote ``summary.json``),
    ``seed``, the ``by`` keys, ``final-accuracy``,
    ``mean-gap`` (mean over rounds of ``frobenius-gap``), ``total-bytes``
    (bytes up + down over all rounds), ``seconds`` (sum of round times),
    ``rounds``, ``personalised`` (each client's own model evaluated on its
    own part), ``asynchronous`` (the run wrote the virtual clock's time),
    and ``acc``/``fgt`` when the run's summary has them.
    """
    rows = []
    for run_dir in run_dirs:
        run = load_run(run_dir)
        frame = run.results
        summary_path = Path(run_dir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        gap = pd.to_numeric(frame["frobenius-gap"], errors="coerce")
        row: dict[str, Any] = {
            "run": Path(run_dir).name,
            "method": str(frame["method"].iloc[0])
            if len(frame)
            else str(run.config.get("method", "")),
            "finished": summary_path.is_file(),
            "seed": run.config.get("seed"),
            **{key: run.config.get(key) for key in by},
            "final-accuracy": float(frame["accuracy"].iloc[-1])
            if len(frame)
            else np.nan,
            "mean-gap": float(gap.mean()) if gap.notna().any() else np.nan,
            "total-bytes": float(frame["bytes-up"].sum() + frame["bytes-down"].sum()),
            "seconds": float(frame["seconds"].sum()),
            "rounds": len(frame),
            "personalised": run.personalised,
            "asynchronous": x_axis([run]) == TIME_AXIS,
        }
        for key in ("acc", "fgt"):
            for name in (key, key.upper()):
                if name in summary:
                    row[key] = float(summary[name])
        if "perplexity" in frame and len(frame):  # the causal-LM task
            row["perplexity"] = float(frame["perplexity"].iloc[-1])
        rows.append(row)
    return pd.DataFrame(rows)


def summarise(runs: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """Mean and std over seeds per method (and ``by`` settings), in run order.

    Only finished runs count (``runs["finished"]`` when present); the others
    are counted in ``unfinished``, and a group with no finished run has NaN
    numbers (:func:`to_markdown` writes ``unfinished``).
    """
    keys = ["method", *by]
    order = list(dict.fromkeys(tuple(r) for r in runs[keys].itertuples(index=False)))
    out = []
    for key in order:
        mask = np.ones(len(runs), dtype=bool)
        for name, value in zip(keys, key, strict=True):
            mask &= (runs[name] == value).to_numpy()
        group = runs[mask]
        if "finished" in group:
            done = group["finished"].astype(bool)
            unfinished, group = int((~done).sum()), group[done]
        else:
            unfinished = 0
        row: dict[str, Any] = dict(zip(keys, key, strict=True))
        for trait in ("personalised", "asynchronous"):
            if trait in runs:
                row[trait] = bool(runs[mask][trait].astype(bool).any())
        row["seeds"] = len(group)
        row["unfinished"] = unfinished
        acc = group["final-accuracy"]
        row["accuracy-mean"] = float(acc.mean())
        row["accuracy-std"] = (
            float(acc.std(ddof=1)) if len(group) > 1 else 0.0 if len(group) else np.nan
        )
        if "perplexity" in group and group["perplexity"].notna().any():
            ppl = group["perplexity"]
            row["perplexity-mean"] = float(ppl.mean())
            row["perplexity-std"] = float(ppl.std(ddof=1)) if len(group) > 1 else 0.0
        for column in ("mean-gap", "total-bytes", "seconds", "acc", "fgt"):
            if column in group and group[column].notna().any():
                row[column] = float(group[column].mean())
        out.append(row)
    return pd.DataFrame(out)


def _fmt_bytes(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f} MB"
    return f"{value / 1e3:.1f} kB"


def to_markdown(table: pd.DataFrame, by: Sequence[str] = ()) -> str:
    """Render :func:`summarise`'s table as a markdown table."""
    has_cl = "acc" in table and table["acc"].notna().any()
    has_lm = "perplexity-mean" in table and table["perplexity-mean"].notna().any()
    headers = ["method", *by, "seeds", "final accuracy", "mean Frobenius gap"]
    if has_lm:
        headers[headers.index("final accuracy")] = "final exact match"
        headers.insert(headers.index("mean Frobenius gap"), "final perplexity")
    headers += ["total bytes / run", "wall time / run"]
    if has_cl:
        headers += ["ACC", "FGT"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in table.to_dict("records"):
        gap = row.get("mean-gap", np.nan)
        seeds = str(row["seeds"])
        if row.get("unfinished", 0):
            seeds += f" (+{int(row['unfinished'])} {UNFINISHED})"
        cells = [method_cell(row), *(str(row[k]) for k in by), seeds]
        if not row["seeds"]:  # no run of this row finished: no numbers
            cells += [UNFINISHED] * (len(headers) - len(cells))
            lines.append("| " + " | ".join(cells) + " |")
            continue
        one = row["seeds"] == 1  # one seed has no spread: no "± 0"
        cells.append(_mean_std(row["accuracy-mean"], row["accuracy-std"], 4, one))
        if has_lm:
            cells.append(
                _mean_std(row["perplexity-mean"], row["perplexity-std"], 3, one)
            )
        cells.append("—" if pd.isna(gap) else f"{gap:.3e}")
        cells.append(_fmt_bytes(row["total-bytes"]))
        cells.append(f"{row['seconds']:.0f} s")
        if has_cl:
            for key in ("acc", "fgt"):
                value = row.get(key, np.nan)
                cells.append("—" if pd.isna(value) else f"{value:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def method_cell(row: Mapping[str, Any]) -> str:
    """The method's name, marked ``(personalised)`` / ``(asynchronous)``
    where the row's ``personalised`` / ``asynchronous`` column is true."""
    marks = [k for k in ("personalised", "asynchronous") if _true(row.get(k))]
    return " ".join([str(row["method"]), *(f"({k})" for k in marks)])


def _true(value: Any) -> bool:
    """A table cell's truth: ``True`` / ``"True"`` (read back from CSV)."""
    return str(value).strip().lower() in ("true", "1", "1.0")


def _mean_std(mean: float, std: float, digits: int, one_seed: bool) -> str:
    """``mean ± std``, or the mean alone for one seed."""
    if one_seed:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def comparison_figure(run_dirs: Sequence[Path | str], by: Sequence[str] = ()) -> Figure:
    """Accuracy and gap per round: mean over seeds ±1 std, one line per group.

    Runs are grouped, and labelled, by method and every config key whose
    value differs between them other than the seed (``fedex-lora lr=0.003``;
    the ``by`` keys always). Personalised runs (FedSA-LoRA, Global / Local
    SVD: each client's own model on its own held-out part) get panels of
    their own next to the global models' (accuracy, or exact match and
    perplexity), never a shared axis. The gap panel starts at 0 and draws a
    gap at float32 rounding as 0 (:func:`fedlr.runs.plots.gap_values`); it
    says when a method's gap is the one it folds into the base weights
    (FedEx-LoRA: the factor gap before the fold, not an error).
    When no run logs a Frobenius gap (vision methods), the second panel shows
    the evaluation loss instead; causal-LM runs show exact match and response
    perplexity (log scale) in place of accuracy (:func:`_panels`). A group of
    one run is drawn without a band (one seed has no spread); every panel
    carries the legend, under it, outside the data; rounds are whole numbers
    from round 0 (the initial model) where the runs recorded it, and QR-Mix's
    stage switch and continual task boundaries are marked. When every run is
    asynchronous the x axis is the virtual clock (each version's time, mean
    over the seeds).
    """
    runs = [load_run(run_dir) for run_dir in run_dirs]
    groups, kinds = _groups(runs, by)
    panels = _panels(
        [f for frames in groups.values() for f in frames],
        personal=[run.personalised for run in kinds.values()],
        folded=[run.folds_base for run in kinds.values()],
    )
    x = x_axis(runs)
    nrows = 1 if len(panels) <= 3 else 2
    ncols = -(-len(panels) // nrows)
    fig, grid = plt.subplots(
        nrows, ncols, figsize=(5.5 * ncols, 4.8 * nrows), squeeze=False
    )
    axes = list(grid.flat)
    for spare in axes[len(panels) :]:
        spare.remove()
    axes = axes[: len(panels)]
    for i, (label, frames) in enumerate(groups.items()):
        for ax, panel in zip(axes, panels, strict=True):
            _draw_group(ax, panel, label, frames, kinds[label], f"C{i % 10}", x)
    several = any(len(frames) > 1 for frames in groups.values())
    spread = "\n(mean ± std over seeds)" if several else ""
    rounding = any(_rounding(run) for run in runs)
    for ax, panel in zip(axes, panels, strict=True):
        title = f"{panel.title}{spread}"
        if panel.column == "frobenius-gap" and rounding:
            title += "\n(drawn as 0: gaps at float32 rounding)"
        ax.set(title=title, ylabel=panel.ylabel)
        if panel.column == "frobenius-gap":
            ys = [float(v) for line in ax.get_lines() for v in line.get_ydata()]
            nonnegative_axis(ax, ys, decades=10)
        elif panel.log and _spans_decade(ax):
            ax.set_yscale("log")
        per_round_axes(ax, runs, x)
    fig.tight_layout()
    return fig


def _rounding(run: RunData) -> bool:
    """Some logged gap of ``run`` is float32 rounding (drawn as 0)."""
    if "frobenius-gap" not in run.results:
        return False
    raw = pd.to_numeric(run.results["frobenius-gap"], errors="coerce")
    return bool(((gap_values(run.results) == 0) & (raw > 0)).any())


def _groups(
    runs: Sequence[RunData], by: Sequence[str]
) -> tuple[dict[str, list[pd.DataFrame]], dict[str, RunData]]:
    """The runs' frames by label (seeds pooled), round 0 first where
    recorded; and a run of each group."""
    labels = run_labels(runs, skip=[k for k in ("seed",) if k not in by])
    groups: dict[str, list[pd.DataFrame]] = {}
    kinds: dict[str, RunData] = {}
    for run, label in zip(runs, labels, strict=True):
        label = " ".join(
            [label, *(f"{k}={run.config.get(k)}" for k in by if f"{k}=" not in label)]
        )
        frame = run.results.assign(**{"frobenius-gap": gap_values(run.results)})
        if run.initial:
            start = {"round": 0, **run.initial}
            frame = pd.concat([pd.DataFrame([start]), frame], ignore_index=True)
        groups.setdefault(label, []).append(frame)
        kinds.setdefault(label, run)
    return groups, kinds


def _by_round(frames: Sequence[pd.DataFrame], column: str) -> pd.DataFrame:
    """``column`` of each frame (one per column), indexed by round."""
    return pd.concat(
        [f.set_index("round")[column] for f in frames if column in f], axis=1
    ).apply(pd.to_numeric, errors="coerce")


def _draw_group(
    ax: Any,
    panel: _Panel,
    label: str,
    frames: Sequence[pd.DataFrame],
    kind: RunData,
    color: str,
    x: XAxis,
) -> None:
    """One group's mean over seeds on ``panel`` (and its ±1 std band)."""
    if panel.personal is not None and panel.personal != kind.personalised:
        return
    if not any(panel.column in f for f in frames):
        return
    stacked = _by_round(frames, panel.column)
    if panel.from_round_one:
        stacked = stacked[stacked.index >= 1]
    mean = stacked.mean(axis=1).dropna()
    if mean.empty:
        return
    xs = mean.index.to_numpy(dtype=float)
    if x.column != ROUND_AXIS.column:  # the versions' virtual time, seeds' mean
        times = _by_round(frames, x.column).mean(axis=1).reindex(mean.index)
        xs = times.fillna(0.0).where(mean.index > 0, 0.0).to_numpy(dtype=float)
    folded_gap = panel.column == "frobenius-gap" and kind.folds_base
    ax.plot(
        xs,
        mean.to_numpy(dtype=float),
        color=color,
        marker="o",
        ms=3,
        linestyle="--" if folded_gap and panel.mixed_folds else "-",
        label=f"{label} (n={len(frames)})",
    )
    if len(frames) > 1:
        std = stacked.std(axis=1, ddof=1).reindex(mean.index).fillna(0.0)
        ax.fill_between(xs, mean - std, mean + std, color=color, alpha=0.2)


def _spans_decade(ax: Any) -> bool:
    """Whether the panel's positive values span a factor of 10 (then log scale)."""
    values = [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()]
    ys = np.concatenate(values) if values else np.array([])
    ys = ys[np.isfinite(ys) & (ys > 0)]
    return bool(ys.size) and float(ys.max()) > 10 * float(ys.min())


class _Panel(NamedTuple):
    """One panel of the comparison figure."""

    column: str
    title: str
    ylabel: str
    log: bool = False  # log scale, where the values span a decade
    from_round_one: bool = False  # leave out round 0 (the initial model)
    personal: bool | None = None  # only personalised (True) / global (False) runs
    mixed_folds: bool = False  # gap panel: folded and unfolded gaps together


PERSONAL_NOTE = "personalised: mean over clients,\neach on its own held-out part"
"""The second title line of a personalised runs' panel."""


def _apart(head: list[_Panel], personal: Sequence[bool]) -> list[_Panel]:
    """``head``'s panels for the global runs, then the same for the
    personalised ones, when both kinds are drawn; titled so when only
    personalised runs are."""
    if not personal or not any(personal):
        return head
    mine = [
        p._replace(title=f"{p.title}\n({PERSONAL_NOTE})", personal=True) for p in head
    ]
    if all(personal):
        return mine
    shared = [
        p._replace(title=f"{p.title}\n(global models)", personal=False) for p in head
    ]
    return shared + mine


def _panels(
    frames: Sequence[pd.DataFrame],
    personal: Sequence[bool] = (),
    folded: Sequence[bool] = (),
) -> list[_Panel]:
    """The comparison's panels.

    The headline metric (``exact-match`` and ``perplexity`` for a causal LM,
    whose ``accuracy`` column repeats the exact match; else ``accuracy``:
    the global models' and, on panels of their own, the personalised runs'),
    then the Frobenius gap, or the evaluation loss when no run logs a gap.
    Perplexity starts at round 1: the base model's (round 0, e.g. 67 against
    about 4 after round 1) would flatten every difference between methods;
    its title gives the round-0 mean instead. ``personal`` and ``folded``:
    per group, whether it is personalised / folds its gap into the base.
    """

    def logged(column: str) -> bool:
        return any(
            column in f and pd.to_numeric(f[column], errors="coerce").notna().any()
            for f in frames
        )

    if logged("exact-match"):
        initial = [
            float(v)
            for f in frames
            if "perplexity" in f
            for v in pd.to_numeric(f.loc[f["round"] == 0, "perplexity"]).dropna()
        ]
        title = "response perplexity"
        if initial:
            title += f" (round 0: {sum(initial) / len(initial):.3g})"
        head = _apart(
            [
                _Panel("exact-match", "exact match", "exact match"),
                _Panel(
                    "perplexity", title, "perplexity", log=True, from_round_one=True
                ),
            ],
            personal,
        )
    elif personal and all(personal):
        head = [_Panel("accuracy", PERSONAL_ACCURACY, "personalised accuracy")]
    elif any(personal):
        head = [
            _Panel("accuracy", GLOBAL_ACCURACY, "accuracy", personal=False),
            _Panel(
                "accuracy", PERSONAL_ACCURACY, "personalised accuracy", personal=True
            ),
        ]
    else:
        head = [_Panel("accuracy", GLOBAL_ACCURACY, "accuracy")]
    if logged("frobenius-gap"):
        if folded and all(folded):
            gap = _Panel("frobenius-gap", FOLDED_GAP_TITLE, "gap before the fold", True)
        elif any(folded):
            gap = _Panel("frobenius-gap", MIXED_GAP, "gap", True, mixed_folds=True)
        else:
            gap = _Panel("frobenius-gap", GAP, "gap", log=True)
        return [*head, gap]
    return [*head, _Panel("loss", "evaluation loss", "loss")]


def summary_figure(
    table: pd.DataFrame, title: str = "", reference: str | None = None
) -> Figure:
    """Every row's final numbers, readable for many methods: a dot per row
    (method, and setting) at the mean over seeds with a ±1 std bar, rows
    sorted best first.

    Columns: the headline (final accuracy; exact match and perplexity for a
    causal LM) and the total bytes per run (from 0, symmetric-log when they
    span more than 50x). The personalised rows (each client's own model on
    its own held-out part, averaged) are a second row of panels with their
    own headline axes, never on the global models' axis. A row's label says
    ``(asynchronous)`` where it is.

    Parameters
    ----------
    table : pandas.DataFrame
        :func:`summarise`'s table (or its ``table.csv`` read back).
    title : str
        The figure's title.
    reference : str, optional
        A method whose mean headline is drawn as a dotted vertical line
        across the global rows' headline panels (e.g. ``fedavg-lora``).
    """
    table = table[table["seeds"] > 0].reset_index(drop=True)
    personal = table.get("personalised", pd.Series(False, index=table.index))
    personal = personal.map(_true)
    parts = [p for p in (table[~personal], table[personal]) if len(p)]
    metrics = _summary_metrics(table)
    fig, grid = plt.subplots(
        len(parts),
        len(metrics) + 1,
        figsize=(4.6 * (len(metrics) + 1), 1.0 + 0.32 * len(table) + 1.4 * len(parts)),
        squeeze=False,
        gridspec_kw={"height_ratios": [len(p) for p in parts]},
    )
    for axes, part in zip(grid, parts, strict=True):
        mine = bool(personal[part.index[0]])
        part = part.sort_values(metrics[0][0], ascending=not metrics[0][3])
        for ax, metric in zip(axes, metrics, strict=False):
            _dots(ax, part, metric, mine)
            if reference is not None and not mine:
                _reference_line(ax, table, metric[0], reference)
        _bytes_dots(axes[-1], part, table)
        for ax in axes[1:]:
            ax.tick_params(labelleft=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _summary_metrics(table: pd.DataFrame) -> list[tuple[str, str, str, bool]]:
    """``(mean column, std column, name, higher is better)`` of the
    headline panels (the rows are sorted best first, on top)."""
    if "perplexity-mean" in table and table["perplexity-mean"].notna().any():
        return [
            ("accuracy-mean", "accuracy-std", "final exact match", True),
            ("perplexity-mean", "perplexity-std", "final response perplexity", False),
        ]
    return [("accuracy-mean", "accuracy-std", "final accuracy", True)]


def _row_labels(part: pd.DataFrame) -> list[str]:
    """``method (marks)``, then the settings beyond the method, ``n=`` seeds."""
    known = {"method", "seeds", "unfinished", "personalised", "asynchronous"}
    settings = [c for c in part.columns if c not in known and not _numeric_column(c)]
    return [
        " ".join(
            [
                method_cell(row),
                *(f"{k}={row[k]}" for k in settings),
                f"(n={row['seeds']})",
            ]
        )
        for row in part.to_dict("records")
    ]


def _numeric_column(column: str) -> bool:
    return column.endswith(("-mean", "-std")) or column in {
        "mean-gap", "total-bytes", "seconds", "acc", "fgt", "rounds",
    }  # fmt: skip


def _dots(
    ax: Any, part: pd.DataFrame, metric: tuple[str, str, str, bool], mine: bool
) -> None:
    """``part``'s means as dots with ±1 std bars, one row each."""
    mean, std, name, _ = metric
    rows = np.arange(len(part))
    kind = "personalised models" if mine else "global model"
    ax.errorbar(
        part[mean],
        rows,
        xerr=part[std].fillna(0.0),
        fmt="o",
        color="C1" if mine else "C0",
        capsize=3,
        label=f"{kind}: mean ± std over seeds",
    )
    ax.set_yticks(rows, _row_labels(part), fontsize=8)
    ax.set_ylim(len(part) - 0.5, -0.5)
    note = PERSONAL_NOTE if mine else "global model, server's held-out split"
    ax.set(title=f"{name}\n({note})", xlabel=name)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.grid(axis="x", alpha=0.3)
    outside_legend(ax)


def _reference_line(ax: Any, table: pd.DataFrame, column: str, method: str) -> None:
    at = table[table["method"] == method][column]
    if len(at):
        ax.axvline(
            float(at.iloc[0]),
            color="grey",
            linestyle=":",
            linewidth=1,
            label=f"{method}'s mean",
        )
        outside_legend(ax)


def _bytes_dots(ax: Any, part: pd.DataFrame, table: pd.DataFrame) -> None:
    """Total MB per run (mean over seeds), one row each, on a log axis (the
    rows span 50x and more) shared by every part of ``table``."""
    rows = np.arange(len(part))
    megabytes = part["total-bytes"].to_numpy(dtype=float) / 1e6
    ax.plot(megabytes, rows, "s", color="C2", label="MB per run, mean over seeds")
    ax.set_yticks(rows, _row_labels(part), fontsize=8)
    ax.set_ylim(len(part) - 0.5, -0.5)
    ax.set(title="total bytes per run\n(up + down, log scale)", xlabel="MB per run")
    every = table["total-bytes"].to_numpy(dtype=float) / 1e6
    every = every[np.isfinite(every) & (every > 0)]
    if every.size:
        ax.set_xscale("log")
        ax.set_xlim(float(every.min()) / 1.6, float(every.max()) * 1.6)
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="x", alpha=0.3)
    outside_legend(ax)


def write_table(
    run_dirs: Sequence[Path | str],
    out_dir: Path | str,
    by: Sequence[str] = (),
    failures: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Write ``table.md``, ``table.csv``, ``comparison.png`` and
    ``summary.png``; return the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = collect(run_dirs, by)
    table = summarise(runs, by)
    text = to_markdown(table, by)
    if failures:
        text += "\nFailed runs:\n\n" + "".join(
            f"- {cell}: {reason}\n" for cell, reason in failures.items()
        )
    (out / "table.md").write_text(text)
    table.to_csv(out / "table.csv", index=False)
    fig = comparison_figure(run_dirs, by)
    fig.savefig(out / "comparison.png", dpi=100)
    plt.close(fig)
    fig = summary_figure(table)
    fig.savefig(out / "summary.png", dpi=100)
    plt.close(fig)
    return table
