"""Method comparisons: run methods x seeds through ``flwr run``, tabulate, plot.

Two sub-commands::

    # run every (method, seed) of a config through `flwr run`, then tabulate
    python -m fedlr.runs.compare run --conf benchmarks/conf/lora-family.toml \\
        --methods fedavg-lora,fedex-lora --seeds 0,1,2 --out docs/results/lora

    # tabulate and plot finished runs
    python -m fedlr.runs.compare table RUN_DIR [RUN_DIR ...] --out DIR

``run`` reads the TOML run config (the same file ``flwr run . --run-config
FILE`` takes), sets ``method``, ``seed`` and ``output-dir`` per cell, runs it
with :func:`fedlr.flower.launch.flwr_run` and keeps going when one cell fails
(the failure is listed in the table). Every cell's run config is resolved
before the first cell starts (a typo is one line, in seconds). A cell whose
directory already holds a finished run (``summary.json``) is skipped, and an
unfinished one (interrupted: rows and a checkpoint, no ``summary.json``)
continues from its checkpoint (``resume-from``): rerunning the same command
resumes the sweep. Ctrl-C stops the running cell (its run and every process
it started) and the sweep. ``table`` writes:

``table.md``
    One row per method (and per setting, when the runs differ in ``--by``
    keys): final accuracy mean ± std over seeds, mean Frobenius gap over rounds
    and seeds, total bytes (up + down) per run, wall time per run, and ACC/FGT
    for continual runs; the seeds counted. Only finished runs (with a
    ``summary.json``) count; unfinished ones are counted apart (``2 (+1
    unfinished)``), and a row with none finished reads ``unfinished``.
``table.csv``
    The same numbers, unformatted.
``comparison.png``
    Accuracy and Frobenius gap per round: the mean over seeds with a ±1 std
    band, one line per row of the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import tomllib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from transformers.utils import logging as hf_logging

from fedlr.errors import ConfigError, FedLRError
from fedlr.flower.launch import RunInterrupted, cli_logging, flwr_run
from fedlr.flower.output import is_noise
from fedlr.flower.run_config import check_run_config
from fedlr.flower.superlink import FlwrRunError
from fedlr.privacy.node_policy import STATE_DIR_ENV
from fedlr.runs.plots import (
    FOLDED_GAP_TITLE,
    RunData,
    load_run,
    per_round_axes,
    run_labels,
)
from fedlr.server_apps.local import run_in_process
from fedlr.strategies.registry import resolve

__all__ = [
    "ENGINES",
    "SweepInterrupted",
    "cell_state",
    "collect",
    "comparison_figure",
    "main",
    "parse_overrides",
    "read_conf",
    "run_sweep",
    "summarise",
    "to_markdown",
    "write_table",
]

_LOG = logging.getLogger("fedlr")

#: How :func:`run_sweep` runs a cell: the real ``flwr run`` or in this process.
ENGINES = ("flwr", "inprocess")

#: What a cell's or a table row's numbers read when no run of it finished.
UNFINISHED = "unfinished"


class SweepInterrupted(FedLRError):
    """Ctrl-C stopped a sweep; the message says where and how to resume."""


def cell_state(cell_dir: Path | str) -> tuple[Path | None, Path | None]:
    """A sweep cell's finished run and its newest unfinished one, if any.

    A run directory is finished when it holds ``summary.json`` (written last,
    after the final round); an unfinished one that holds a checkpoint
    manifest (``checkpoint.json``) can continue with ``resume-from``.

    Returns
    -------
    (finished, resumable) : (Path or None, Path or None)
    """
    runs = sorted(
        (p for p in Path(cell_dir).glob("*/") if p.is_dir()),
        key=lambda p: p.stat().st_mtime,
    )
    finished = [p for p in runs if (p / "summary.json").is_file()]
    resumable = [
        p
        for p in runs
        if not (p / "summary.json").is_file() and (p / "checkpoint.json").is_file()
    ]
    return (
        finished[-1] if finished else None,
        resumable[-1] if resumable else None,
    )


def read_conf(path: Path | str) -> dict[str, Any]:
    """Read a TOML run config and validate it with its method's options.

    Raises
    ------
    fedlr.errors.ConfigError
        On an unknown key or a bad value (with the key named).
    """
    with open(path, "rb") as fh:
        values = tomllib.load(fh)
    resolve(values)
    return values


_PAIR = re.compile(r'([A-Za-z0-9_.-]+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """Run-config overrides from ``--set`` arguments, parsed as ``flwr run`` does.

    Each item holds one or more ``key=value`` pairs separated by spaces, values in
    TOML (``'lora-rank=4 partitioner="iid"'``).

    Raises
    ------
    fedlr.errors.ConfigError
        When an item is not ``key=value`` TOML.
    """
    out: dict[str, Any] = {}
    for item in items:
        rest = item.strip()
        while rest:
            match = _PAIR.match(rest)
            if match is None:
                raise ConfigError(
                    "--set",
                    f"{rest!r} is not key=value (e.g. 'lora-rank=4 "
                    'partitioner="iid"\', strings in double quotes)',
                )
            key, raw = match.group(1), match.group(2)
            try:
                out[key] = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(
                    key, f"{raw!r} is not a TOML value (strings need double quotes)"
                ) from exc
            rest = rest[match.end() :].lstrip()
    return out


def collect(run_dirs: Sequence[Path | str], by: Sequence[str] = ()) -> pd.DataFrame:
    """One row per run: method, seed, the ``by`` settings and its totals.

    Columns: ``run``, ``method``, ``finished`` (the run wrote ``summary.json``),
    ``seed``, the ``by`` keys, ``final-accuracy``,
    ``mean-gap`` (mean over rounds of ``frobenius-gap``), ``total-bytes``
    (bytes up + down over all rounds), ``seconds`` (sum of round times),
    ``rounds``, and ``acc``/``fgt`` when the run's summary has them.
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
        cells = [str(row["method"]), *(str(row[k]) for k in by), seeds]
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
    SVD: each client's own model on its own held-out part) get a panel of
    their own next to the global models' accuracy, never a shared axis. The
    gap panel says when a method's gap is the one it folds into the base
    weights (FedEx-LoRA: the factor gap before the fold, not an error).
    When no run logs a Frobenius gap (vision methods), the second panel shows
    the evaluation loss instead; causal-LM runs show exact match and response
    perplexity (log scale) in place of accuracy (:func:`_panels`). A group of
    one run is drawn without a band (one seed has no spread); every panel
    carries the legend, under it, outside the data; rounds are whole numbers
    from round 0 (the initial model) where the runs recorded it, and QR-Mix's
    stage switch and continual task boundaries are marked.
    """
    runs = [load_run(run_dir) for run_dir in run_dirs]
    labels = run_labels(runs, skip=[k for k in ("seed",) if k not in by])
    groups: dict[str, list[pd.DataFrame]] = {}
    kinds: dict[str, RunData] = {}
    for run, label in zip(runs, labels, strict=True):
        label = " ".join(
            [label, *(f"{k}={run.config.get(k)}" for k in by if f"{k}=" not in label)]
        )
        frame = run.results
        if run.initial:
            start = {"round": 0, **run.initial}
            frame = pd.concat([pd.DataFrame([start]), frame], ignore_index=True)
        groups.setdefault(label, []).append(frame)
        kinds.setdefault(label, run)
    panels = _panels(
        [f for frames in groups.values() for f in frames],
        personal=[run.personalised for run in kinds.values()],
        folded=[run.folds_base for run in kinds.values()],
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6))
    axes = np.atleast_1d(axes)
    for i, (label, frames) in enumerate(groups.items()):
        color = f"C{i % 10}"
        kind = kinds[label]
        for ax, panel in zip(axes, panels, strict=True):
            if panel.personal is not None and panel.personal != kind.personalised:
                continue
            stacked = pd.concat(
                [f.set_index("round")[panel.column] for f in frames], axis=1
            ).apply(pd.to_numeric, errors="coerce")
            if panel.from_round_one:
                stacked = stacked[stacked.index >= 1]
            mean = stacked.mean(axis=1)
            if mean.notna().sum() == 0:
                continue
            mean = mean.dropna()
            folded_gap = panel.column == "frobenius-gap" and kind.folds_base
            ax.plot(
                mean.index,
                mean,
                color=color,
                marker="o",
                ms=3,
                linestyle="--" if folded_gap and panel.mixed_folds else "-",
                label=f"{label} (n={len(frames)})",
            )
            if len(frames) > 1:
                std = stacked.std(axis=1, ddof=1).reindex(mean.index).fillna(0.0)
                ax.fill_between(
                    mean.index, mean - std, mean + std, color=color, alpha=0.2
                )
    several = any(len(frames) > 1 for frames in groups.values())
    spread = "\n(mean ± std over seeds)" if several else ""
    for ax, panel in zip(axes, panels, strict=True):
        ax.set(title=f"{panel.title}{spread}", xlabel="round", ylabel=panel.ylabel)
        if panel.log and _spans_decade(ax):
            ax.set_yscale("log")
    for ax in axes:
        per_round_axes(ax, runs)
    fig.tight_layout()
    return fig


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


GLOBAL_ACCURACY = "accuracy of the global model\n(server's held-out split)"
PERSONAL_ACCURACY = (
    "personalised accuracy\n(mean over clients, each on its own held-out part)"
)
GAP = "Frobenius gap ||ΔW_ideal - ΔW_agg||_F"
MIXED_GAP = f"{GAP}\n(dashed: before the fold, which makes the model exact)"


def _panels(
    frames: Sequence[pd.DataFrame],
    personal: Sequence[bool] = (),
    folded: Sequence[bool] = (),
) -> list[_Panel]:
    """The comparison's panels.

    The headline metric (``exact-match`` and ``perplexity`` for a causal LM,
    whose ``accuracy`` column repeats the exact match; else ``accuracy``:
    the global models' and, on a panel of its own, the personalised runs'),
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
        head = [
            _Panel("exact-match", "exact match", "exact match"),
            _Panel("perplexity", title, "perplexity", log=True, from_round_one=True),
        ]
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


def write_table(
    run_dirs: Sequence[Path | str],
    out_dir: Path | str,
    by: Sequence[str] = (),
    failures: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Write ``table.md``, ``table.csv`` and ``comparison.png``; return the table."""
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
    return table


def run_sweep(
    conf: Path | str,
    methods: Sequence[str],
    seeds: Sequence[int],
    out_dir: Path | str,
    *,
    overrides: Mapping[str, Any] | None = None,
    num_supernodes: int | None = None,
    flwr_home: Path | None = None,
    app_dir: Path = Path("."),
    engine: str = "flwr",
    client_gpus: float = 0.0,
    verbose: bool = False,
) -> tuple[list[Path], dict[str, str]]:
    """Run every (method, seed); return the run directories and the failures.

    Every cell's run config is resolved first (a bad one raises before any
    cell runs). A cell with a finished run in ``OUT/runs/<method>-seed<seed>/``
    is not run again; an unfinished one with a checkpoint continues from it
    (``resume-from``).

    Parameters
    ----------
    engine : {"flwr", "inprocess"}
        ``flwr``: each cell through the real ``flwr run`` (a local SuperLink of
        its own, Ray simulation engine, ``num_supernodes`` nodes,
        ``client_gpus`` of a GPU per client). ``inprocess``: each cell through
        :func:`fedlr.server_apps.local.run_in_process` (same ServerApp and
        ClientApp, same numbers, no SuperLink or Ray start-up per cell).
    client_gpus : float
        ``client-resources-num-gpus`` (federation config) for the ``flwr``
        engine, e.g. 0.25 for four clients per GPU; the ``device`` key
        (``auto``) then picks CUDA, MPS or the CPU on each client.
    verbose : bool
        Show Flower's, Ray's and transformers' noise (``flwr`` engine).

    Raises
    ------
    fedlr.errors.ConfigError, fedlr.errors.UnknownMethodError
        On a bad cell config, before any cell runs.
    SweepInterrupted
        On Ctrl-C: the running cell was stopped; rerunning resumes.
    """
    if engine not in ENGINES:
        raise ConfigError("--engine", f"'{engine}' is not one of {', '.join(ENGINES)}")
    if client_gpus < 0:
        raise ConfigError("--client-gpus", f"must be >= 0, got {client_gpus}")
    base = {**read_conf(conf), **(overrides or {})}
    nodes = num_supernodes or int(base.get("num-partitions", 4))
    federation: dict[str, Any] = {"num-supernodes": nodes}
    if client_gpus:
        federation["client-resources-num-gpus"] = client_gpus
    cells = _cells(base, methods, seeds, Path(out_dir).resolve(), engine, app_dir)

    def launch(config: dict[str, Any]) -> None:
        with _cell_nodes(Path(str(config["output-dir"]))):
            _launch_cell(config)

    def _launch_cell(config: dict[str, Any]) -> None:
        if engine == "flwr":
            flwr_run(
                app_dir,
                flwr_home=(flwr_home or Path(".flwr")).resolve(),
                run_config=config,
                federation_config=federation,
                echo=True,
                verbose=verbose,
                keep_superlink=False,
            )
        else:
            run_in_process(config, num_nodes=nodes)

    run_dirs: list[Path] = []
    failures: dict[str, str] = {}
    for n, (cell, config) in enumerate(cells, start=1):
        progress = f"[{n}/{len(cells)}] {cell}"
        try:
            done = _run_cell(progress, config, engine, launch)
        except (RunInterrupted, KeyboardInterrupt) as exc:
            how = str(exc) if isinstance(exc, RunInterrupted) else "interrupted"
            raise SweepInterrupted(
                f"{cell}: {how}; {len(run_dirs)} of {len(cells)} cells finished; "
                "run the same command again to resume"
            ) from None
        except (FlwrRunError, FedLRError) as exc:
            failures[cell] = str(exc).splitlines()[0]
            _LOG.error("%s failed: %s", cell, failures[cell])
            continue
        if done is None:
            failures[cell] = "the run ended without a summary.json"
            continue
        run_dirs.append(done)
    return run_dirs, failures


@contextmanager
def _cell_nodes(cell_dir: Path) -> Iterator[None]:
    """Each cell's simulated nodes keep their privacy ledgers in the cell's
    ``node-state/`` (a cell is its own experiment: its DP-SGD epsilon is its
    own, and a resumed cell keeps counting), unless ``FEDLR_NODE_STATE_DIR``
    names one directory for every run."""
    if os.environ.get(STATE_DIR_ENV):
        yield
        return
    os.environ[STATE_DIR_ENV] = str(cell_dir / "node-state")
    try:
        yield
    finally:
        os.environ.pop(STATE_DIR_ENV, None)


def _cells(
    base: Mapping[str, Any],
    methods: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    engine: str,
    app_dir: Path,
) -> list[tuple[str, dict[str, Any]]]:
    """``(cell name, run config)`` of every (method, seed), each checked."""
    cells: list[tuple[str, dict[str, Any]]] = []
    for method, seed in ((m, s) for m in methods for s in seeds):
        cell = f"{method}-seed{seed}"
        config = {
            **base,
            "method": method,
            "seed": seed,
            "output-dir": str(out / "runs" / cell),
        }
        if engine == "flwr":  # the keys `flwr run` accepts: the app's table
            check_run_config(app_dir, config)
        else:
            resolve(config)
        cells.append((cell, config))
    return cells


def _run_cell(
    progress: str,
    config: dict[str, Any],
    engine: str,
    launch: Callable[[dict[str, Any]], None],
) -> Path | None:
    """Run (or resume, or skip) one cell; its finished run directory or None."""
    finished, resumable = cell_state(Path(config["output-dir"]))
    if finished is not None:
        _LOG.info("%s: finished earlier (%s), skipped", progress, finished.name)
        return finished
    if resumable is not None:
        config = {**config, "resume-from": str(resumable)}
        _LOG.info("%s: resuming %s", progress, resumable.name)
    else:
        _LOG.info("%s (%s engine)", progress, engine)
    started = time.perf_counter()
    launch(config)
    _LOG.info("%s done in %.0f s", progress, time.perf_counter() - started)
    return cell_state(Path(config["output-dir"]))[0]


@contextmanager
def _flower_lines_once(verbose: bool = False) -> Iterator[None]:
    """Flower's log lines through Flower's own handler only (not also the root's).

    In-process runs log through the ``flwr`` logger; when the root logger has
    a handler too, every line would be printed twice. Unless ``verbose``,
    Flower's hints and its per-round INFO lines
    (:func:`fedlr.flower.output.is_noise`, the same filter as under ``flwr
    run``) are left out, and Flower's level colours are written only to a
    terminal (a log file gets no ANSI codes).
    """
    flower = logging.getLogger("flwr")
    saved = flower.propagate
    flower.propagate = False
    quiet = _NoiseFilter()
    if not verbose:
        flower.addFilter(quiet)
    coloured = {
        handler: handler.colored  # Flower's ConsoleHandler
        for handler in flower.handlers
        if isinstance(handler, logging.StreamHandler) and hasattr(handler, "colored")
    }
    for handler in coloured:
        handler.colored = _is_terminal(handler.stream)
    try:
        yield
    finally:
        flower.propagate = saved
        flower.removeFilter(quiet)
        for handler, colour in coloured.items():
            handler.colored = colour


def _is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


class _NoiseFilter(logging.Filter):
    """Flower's noise, as :func:`~fedlr.flower.output.is_noise` sees a CLI line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_noise(f"{record.levelname} : {record.getMessage()}")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``run`` or ``table`` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run methods x seeds, then tabulate")
    run.add_argument("--conf", required=True, type=Path, help="TOML run config")
    run.add_argument("--methods", required=True, help="comma-separated")
    run.add_argument("--seeds", default="0", help="comma-separated integers")
    run.add_argument("--out", required=True, type=Path)
    run.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config overrides as for `flwr run --run-config`: "
        "'key=value key2=\"text\"' (TOML values; one or several arguments)",
    )
    run.add_argument("--num-supernodes", type=int, default=None)
    run.add_argument(
        "--engine",
        choices=ENGINES,
        default="flwr",
        help="flwr: each cell through `flwr run` (default); inprocess: the same "
        "ServerApp and ClientApp in this process, same numbers, no Ray start-up",
    )
    run.add_argument(
        "--client-gpus",
        type=float,
        default=0.0,
        help="GPU share per simulated client with the flwr engine (e.g. 0.25)",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="show Flower's, Ray's and transformers' hints, warnings and "
        "progress bars too",
    )
    run.add_argument("--by", default="", help="config keys that split rows")
    table = sub.add_parser("table", help="tabulate finished runs")
    table.add_argument("run_dirs", nargs="+", type=Path)
    table.add_argument("--out", required=True, type=Path)
    table.add_argument("--by", default="", help="config keys that split rows")
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", False)
    with cli_logging(), quiet_in_process(verbose):
        return _main(args, verbose)


@contextmanager
def quiet_in_process(verbose: bool = False) -> Iterator[None]:
    """In-process runs print fedlr's lines once and without the libraries' noise.

    Flower's lines go through Flower's own handler only (never twice), and
    unless ``verbose`` Flower's hints, transformers' warnings, progress bars
    and deprecation ``FutureWarning`` s (PEFT probes a deprecated attribute
    of every model it wraps) are left out. ``benchmarks/`` drivers that run
    in process use it too.
    """
    with _flower_lines_once(verbose), _quiet_libraries(verbose):
        yield


@contextmanager
def _quiet_libraries(verbose: bool) -> Iterator[None]:
    """transformers' warnings and progress bars off in this process (not ``verbose``).

    The in-process engine builds models here; the ``flwr`` engine's processes
    get the same through their environment (:func:`fedlr.flower.superlink.flwr_env`).
    """
    if verbose:
        yield
        return
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", category=FutureWarning, module=r"transformers\."
            )
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(
            "--seeds", f"'{text}' is not comma-separated integers"
        ) from None


def _main(args: argparse.Namespace, verbose: bool) -> int:
    by = [k for k in args.by.split(",") if k]
    failures: dict[str, str] = {}
    try:
        if args.command == "run":
            run_dirs, failures = run_sweep(
                args.conf,
                [m.strip() for m in args.methods.split(",") if m.strip()],
                _seeds(args.seeds),
                args.out,
                overrides=parse_overrides(args.set),
                num_supernodes=args.num_supernodes,
                engine=args.engine,
                client_gpus=args.client_gpus,
                verbose=verbose,
            )
        else:
            run_dirs = list(args.run_dirs)
    except SweepInterrupted as exc:
        _LOG.error("fedlr: %s", exc)
        return 130
    except (FedLRError, OSError) as exc:
        _LOG.error("error: %s", str(exc).splitlines()[0])
        return 2
    if not run_dirs:
        _LOG.error("no run finished")
        for cell, reason in failures.items():
            _LOG.error("  %s: %s", cell, reason)
        return 1
    result = write_table(run_dirs, args.out, by, failures)
    sys.stdout.write(to_markdown(result, by))  # the command's output
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
