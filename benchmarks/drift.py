"""The client-drift regime study (docs/results/drift).

Does exact aggregation pay where clients drift apart? Eight clients on a
strongly non-IID split (Dirichlet 0.1) train 5 or 40 local steps per round
at LoRA rank 8 or 16; six methods (fedavg-lora = FedIT, fedex-lora, fedspec,
flexlora, hetlora, flora) run each cell with the same seeds. Every run goes
through :func:`fedlr.server_apps.local.run_in_process` (the same round path
as ``flwr run``, without the Ray start-up) and lands in
``<runs>/<dataset>-steps<S>-rank<R>/<method>-seed<K>/``; a cell whose
``results.csv`` already has every round is not run again, so the study can
be stopped and resumed.

``python -m benchmarks.drift run [--datasets polarity,bbc-news] [--ranks 8,16]
[--steps 5,40] [--seeds 0,3,4] [--methods ...] [--runs DIR]``
    run the missing cells (one CPU thread; progress on stderr; several
    processes may run at once on different methods or seeds);
``python -m benchmarks.drift table [--runs DIR] [--out DIR]``
    tabulate what has finished: ``drift.csv`` (one row per run),
    ``summary.csv`` / ``summary.md`` (mean ± std over seeds, and the
    accuracy difference to FedIT with the seeds paired), and ``drift.png``
    (accuracy difference to FedIT against the mean Frobenius gap).

The gap of a method is its own logged ``frobenius-gap`` (what the global
model holds against the mean of the client products); FedIT's is the
classic ``||mean(B_i) mean(A_i) - mean(B_i A_i)||``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedlr.server_apps.local import run_in_process

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "outputs" / "drift"
OUT = ROOT / "docs" / "results" / "drift"
METHODS = ("fedavg-lora", "fedex-lora", "fedspec", "flexlora", "hetlora", "flora")
BASELINE = "fedavg-lora"
SEEDS = (0, 3, 4)
"""The first three seeds for which Dirichlet(0.1) gives every one of the 8
polarity partitions at least ``min-partition-size`` = 10 training rows
(seeds 1, 2 and 5-11 cannot: the run stops with a ValueError before any
training). Chosen from the split alone, before any run."""

SETTINGS: dict[str, Any] = {
    "model": "minilm",
    "num-partitions": 8,
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.1,
    "num-server-rounds": 6,
    "lr": 0.003,
    "lr-decay": 0.85,
    "batch-size": 16,
    "max-eval-examples": 400,
    "eval-every": 3,
}
"""The settings every cell shares (the rest are fedlr's defaults)."""

_LOG = logging.getLogger("fedlr.drift")


def cell_config(
    dataset: str, steps: int, rank: int, method: str, seed: int
) -> dict[str, Any]:
    """The run config of one cell (LoRA alpha = 2 x rank: scaling 2 throughout)."""
    return {
        **SETTINGS,
        "dataset": dataset,
        "local-steps": steps,
        "lora-rank": rank,
        "lora-alpha": 2.0 * rank,
        "method": method,
        "seed": seed,
    }


def _cell_dir(runs: Path, dataset: str, steps: int, rank: int) -> Path:
    return runs / f"{dataset}-steps{steps}-rank{rank}"


def _finished(run_dir: Path) -> bool:
    results = run_dir / "results.csv"
    if not results.is_file():
        return False
    frame = pd.read_csv(results)
    return len(frame) >= int(SETTINGS["num-server-rounds"])


def run(args: argparse.Namespace) -> None:
    """Run every missing cell, in the order most informative first."""
    torch.set_num_threads(1)
    cells = [
        (dataset, rank, steps, seed, method)
        for dataset in args.datasets
        for rank in args.ranks
        for seed in args.seeds
        for steps in args.steps
        for method in args.methods
    ]
    for n, (dataset, rank, steps, seed, method) in enumerate(cells, 1):
        target = _cell_dir(args.runs, dataset, steps, rank) / f"{method}-seed{seed}"
        if _finished(target):
            continue
        started = time.perf_counter()
        # A scratch directory per run: several processes may share a cell.
        scratch = target.parent / f"tmp-{target.name}"
        out = run_in_process(
            {
                **cell_config(dataset, steps, rank, method, seed),
                "output-dir": str(scratch),
            }
        )
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
        shutil.rmtree(scratch, ignore_errors=True)
        print(
            f"[{n}/{len(cells)}] {target.relative_to(args.runs)}: "
            f"{time.perf_counter() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def collect(runs: Path) -> pd.DataFrame:
    """One row per finished run: the cell, method, seed, accuracy and gap."""
    rows = []
    for results in sorted(runs.glob("*-steps*-rank*/*-seed*/results.csv")):
        frame = pd.read_csv(results)
        if len(frame) < int(SETTINGS["num-server-rounds"]):
            continue
        cell = results.parent.parent.name
        dataset, rest = cell.rsplit("-steps", 1)
        steps, rank = rest.split("-rank")
        method, seed = results.parent.name.rsplit("-seed", 1)
        gap = pd.to_numeric(frame["frobenius-gap"], errors="coerce")
        rows.append(
            {
                "dataset": dataset,
                "local-steps": int(steps),
                "rank": int(rank),
                "method": method,
                "seed": int(seed),
                "final-accuracy": float(frame["accuracy"].dropna().iloc[-1]),
                "mean-gap": float(gap.mean()),
                "seconds": float(frame["seconds"].sum()),
            }
        )
    return pd.DataFrame(rows)


def summarise(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean ± std over seeds per cell and method, and the paired difference to FedIT.

    ``diff-mean``/``diff-std`` are over the seeds both the method and FedIT
    finished: accuracy(method, seed) - accuracy(fedavg-lora, seed).
    """
    keys = ["dataset", "local-steps", "rank"]
    out = []
    for cell, group in runs.groupby(keys, sort=True):
        base = group[group["method"] == BASELINE].set_index("seed")["final-accuracy"]
        for method in METHODS:
            mine = group[group["method"] == method].set_index("seed")
            if mine.empty:
                continue
            acc = mine["final-accuracy"]
            paired = sorted(set(acc.index) & set(base.index))
            diff = (acc[paired] - base[paired]).to_numpy()
            out.append(
                {
                    **dict(zip(keys, cell, strict=True)),
                    "method": method,
                    "seeds": len(acc),
                    "accuracy-mean": float(acc.mean()),
                    "accuracy-std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
                    "diff-mean": float(diff.mean()) if len(diff) else np.nan,
                    "diff-std": float(diff.std(ddof=1)) if len(diff) > 1 else np.nan,
                    "mean-gap": float(mine["mean-gap"].mean()),
                }
            )
    return pd.DataFrame(out)


def to_markdown(summary: pd.DataFrame) -> str:
    """The summary as a markdown table."""
    lines = [
        "| data set | local steps | rank | method | seeds | final accuracy "
        "| vs FedIT (paired) | mean Frobenius gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary.to_dict("records"):
        diff = (
            "—"
            if row["method"] == BASELINE or pd.isna(row["diff-mean"])
            else f"{row['diff-mean']:+.4f} ± {row['diff-std']:.4f}"
            if not pd.isna(row["diff-std"])
            else f"{row['diff-mean']:+.4f}"
        )
        lines.append(
            f"| {row['dataset']} | {row['local-steps']} | {row['rank']} "
            f"| {row['method']} | {row['seeds']} "
            f"| {row['accuracy-mean']:.4f} ± {row['accuracy-std']:.4f} | {diff} "
            f"| {row['mean-gap']:.3e} |"
        )
    return "\n".join(lines) + "\n"


def figure(summary: pd.DataFrame, path: Path) -> None:
    """Accuracy difference to FedIT against the mean gap, one point per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    others = summary[summary["method"] != BASELINE]
    markers = {5: "o", 40: "^"}
    for i, method in enumerate(m for m in METHODS if m != BASELINE):
        rows = others[others["method"] == method]
        for steps, part in rows.groupby("local-steps"):
            ax.errorbar(
                part["mean-gap"],
                part["diff-mean"],
                yerr=part["diff-std"].fillna(0.0),
                fmt=markers.get(int(steps), "s"),
                color=f"C{i}",
                label=f"{method}, {steps} steps",
                capsize=3,
            )
    ax.axhline(0.0, color="0.5", lw=0.8)
    if (others["mean-gap"] > 0).all():
        ax.set_xscale("log")
    else:  # FLoRA's gap is 0
        ax.set_xscale("symlog", linthresh=1e-6)
    ax.set_xlabel("mean Frobenius gap (method's own)")
    ax.set_ylabel("final accuracy - FedIT's (paired seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(args: argparse.Namespace) -> None:
    """Write drift.csv, summary.csv, summary.md and drift.png."""
    runs = collect(args.runs)
    if runs.empty:
        raise SystemExit(f"no finished runs under {args.runs}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs.to_csv(args.out / "drift.csv", index=False)
    summary = summarise(runs)
    summary.to_csv(args.out / "summary.csv", index=False)
    (args.out / "summary.md").write_text(to_markdown(summary))
    figure(summary, args.out / "drift.png")
    print(to_markdown(summary))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run the missing cells")
    p_run.add_argument("--datasets", type=_names, default=["polarity"])
    p_run.add_argument("--ranks", type=_ints, default=[8, 16])
    p_run.add_argument("--steps", type=_ints, default=[5, 40])
    p_run.add_argument("--seeds", type=_ints, default=list(SEEDS))
    p_run.add_argument("--methods", type=_names, default=list(METHODS))
    p_run.add_argument("--runs", type=Path, default=RUNS)
    p_table = sub.add_parser("table", help="tabulate and plot finished runs")
    p_table.add_argument("--runs", type=Path, default=RUNS)
    p_table.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    main()
