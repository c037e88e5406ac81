"""The private regime: LoRA methods under sample-level DP-SGD, table and plot.

``python -m benchmarks.privacy --out DIR RUN_DIR ...``

Reads finished runs (``bash benchmarks/results.sh privacy`` makes them: the
lora-family task under DP-SGD at each ``dp-epsilon``, and the same task's
runs without DP) and writes, into ``DIR``:

* ``runs.csv``: one row per run (method, seed, target and spent epsilon,
  final accuracy);
* ``table.md`` / ``table.csv``: final accuracy, mean ± std over seeds, per
  method and privacy level, with the epsilon each run's clients spent;
* ``claims.md``: the papers' two claims as paired differences over seeds
  (FFA-LoRA − FedIT and FedSVD − FFA-LoRA at each level);
* ``privacy.png``: final accuracy against epsilon, one line per method.

A run is private when its ``dp-max-grad-norm`` is above 0; its spent epsilon
is the largest ``dp-epsilon`` its ``results.csv`` reports.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from fedlr.runs.plots import load_run
from fedlr.runs.table import collect

NO_DP = "no DP"
CLAIMS = (("ffa-lora", "fedavg-lora"), ("fedsvd", "ffa-lora"))


def runs_frame(run_dirs: list[Path]) -> pd.DataFrame:
    """One row per finished run, with its privacy level and spent epsilon."""
    rows = collect(run_dirs, by=("dp-epsilon", "dp-max-grad-norm"))
    rows["epsilon-spent"] = [
        float(pd.to_numeric(load_run(d).results["dp-epsilon"], errors="coerce").max())
        for d in run_dirs
    ]
    rows = rows[rows["finished"]].copy()
    private = rows["dp-max-grad-norm"].astype(float) > 0
    rows["level"] = [
        f"{float(e):g}" if p else NO_DP
        for e, p in zip(rows["dp-epsilon"], private, strict=True)
    ]
    return rows


def _levels(rows: pd.DataFrame) -> list[str]:
    eps = sorted({lv for lv in rows["level"] if lv != NO_DP}, key=float)
    return [*eps, NO_DP] if (rows["level"] == NO_DP).any() else eps


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Mean and std of the final accuracy per method and level."""
    grouped = rows.groupby(["method", "level"], sort=False)
    table = grouped.agg(
        seeds=("seed", "count"),
        accuracy_mean=("final-accuracy", "mean"),
        accuracy_std=("final-accuracy", "std"),
        epsilon_spent=("epsilon-spent", "max"),
    ).reset_index()
    return table


def to_markdown(rows: pd.DataFrame) -> str:
    levels = _levels(rows)
    methods = list(dict.fromkeys(rows["method"]))
    table = summary_table(rows).set_index(["method", "level"])
    head = ["method", *(f"ε = {lv}" if lv != NO_DP else NO_DP for lv in levels)]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for method in methods:
        cells = [method]
        for level in levels:
            if (method, level) not in table.index:
                cells.append("—")
                continue
            row = table.loc[(method, level)]
            text = f"{row['accuracy_mean']:.4f} ± {row['accuracy_std']:.4f}"
            text += f" ({int(row['seeds'])})"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    spent = rows[rows["level"] != NO_DP].groupby("level")["epsilon-spent"].max()
    lines += [
        "",
        "ε spent (largest over clients and runs, δ = the run's dp-delta): "
        + ", ".join(f"target {lv}: {spent[lv]:.3f}" for lv in levels if lv in spent),
    ]
    return "\n".join(lines) + "\n"


def claims(rows: pd.DataFrame) -> str:
    """Paired differences over seeds for the papers' two claims."""
    lines = [
        "| claim | level | mean paired difference | std | seeds | seeds above 0 |",
        "|---|---|---|---|---|---|",
    ]
    for better, than in CLAIMS:
        for level in _levels(rows):
            at = rows[rows["level"] == level]
            pivot = at.pivot_table(
                index="seed", columns="method", values="final-accuracy"
            )
            if better not in pivot or than not in pivot:
                continue
            diff = (pivot[better] - pivot[than]).dropna()
            std = f"{diff.std(ddof=1):.4f}" if len(diff) > 1 else "—"
            lines.append(
                f"| {better} > {than} | {level} | {diff.mean():+.4f} | {std} | "
                f"{len(diff)} | {int((diff > 0).sum())} |"
            )
    return "\n".join(lines) + "\n"


def figure(rows: pd.DataFrame) -> Figure:
    """Final accuracy against epsilon (no DP at the right), one line per method."""
    levels = _levels(rows)
    x = {lv: i for i, lv in enumerate(levels)}
    table = summary_table(rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups = list(table.groupby("method", sort=False))
    for i, (method, part) in enumerate(groups):
        part = part.sort_values("level", key=lambda s: s.map(x))
        dodge = 0.05 * (i - (len(groups) - 1) / 2)  # error bars side by side
        ax.errorbar(
            [x[lv] + dodge for lv in part["level"]],
            part["accuracy_mean"],
            yerr=part["accuracy_std"].fillna(0.0),
            marker="o",
            capsize=3,
            label=str(method),
        )
    ax.set_xticks(range(len(levels)))
    ax.set_xticklabels([f"ε = {lv}" if lv != NO_DP else NO_DP for lv in levels])
    ax.set_xlabel("privacy budget per client (δ = 1e-5), DP-SGD")
    ax.set_ylabel("final accuracy (mean ± std over seeds)")
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":", label="chance")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    run_dirs = [d for d in args.run_dirs if (d / "results.csv").is_file()]
    if not run_dirs:
        raise SystemExit("privacy: no run directory with a results.csv given")
    rows = runs_frame(run_dirs)
    args.out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(args.out / "runs.csv", index=False)
    summary_table(rows).to_csv(args.out / "table.csv", index=False)
    text = to_markdown(rows)
    (args.out / "table.md").write_text(text)
    (args.out / "claims.md").write_text(claims(rows))
    fig = figure(rows)
    fig.savefig(args.out / "privacy.png", dpi=120)
    print(text)
    print(claims(rows))


if __name__ == "__main__":
    main()
