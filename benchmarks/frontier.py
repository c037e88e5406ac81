"""The newer LoRA methods against FedIT, seeds paired (docs/results.md).

Reads the runs of ``bash benchmarks/results.sh frontier`` (FedIT's among
them) and writes ``paired.md`` and ``paired.csv``: each
method's final accuracy per seed, its mean ± std, and its difference to
FedIT (``fedavg-lora``) over the seeds both ran, with the 95% t-interval.
A difference whose interval excludes 0 is *separated*. Personalised methods
are marked: their accuracy is each client's own model on its own held-out
part, so their difference to FedIT's global model is not a comparison of the
same test (it is shown, marked, never called separated).

    python -m benchmarks.frontier outputs/results/frontier*/runs/*/*/ \
        --out outputs/results/frontier
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from benchmarks.drift import t_interval
from fedlr.runs.table import collect

BASELINE = "fedavg-lora"


def separates(mean: float, half: float) -> bool:
    """The 95% interval ``mean ± half`` excludes 0."""
    return math.isfinite(half) and abs(mean) > half


def paired_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per method: per-seed accuracies, mean, std and the paired
    difference to :data:`BASELINE` (points), best shared-model method first.

    Raises
    ------
    ValueError
        If ``runs`` has no finished run of :data:`BASELINE`, or a run did
        not finish (its accuracy would not be the final one).
    """
    unfinished = runs[~runs["finished"]]
    if len(unfinished):
        raise ValueError(f"unfinished runs: {sorted(unfinished['run'])}")
    by_method = {
        m: g.set_index("seed")["final-accuracy"] for m, g in runs.groupby("method")
    }
    if BASELINE not in by_method:
        raise ValueError(f"no {BASELINE} runs to pair with")
    base = by_method[BASELINE]
    rows = []
    for method, acc in by_method.items():
        mine = runs[runs["method"] == method]
        traits = mine.iloc[0]
        seeds = sorted(set(acc.index) & set(base.index))
        mean, half = t_interval(100 * (acc[seeds] - base[seeds]).to_numpy())
        compared = method != BASELINE
        rows.append(
            {
                "method": method,
                "personalised": bool(traits["personalised"]),
                "asynchronous": bool(traits["asynchronous"]),
                "seeds": len(acc),
                **{f"seed-{s}": float(acc[s]) for s in sorted(acc.index)},
                "accuracy-mean": float(acc.mean()),
                "accuracy-std": float(acc.std(ddof=1)) if len(acc) > 1 else math.nan,
                "diff-points": mean if compared else math.nan,
                "diff-ci95": half if compared else math.nan,
                "separated": compared
                and not traits["personalised"]
                and separates(mean, half),
                "total-bytes": float(mine["total-bytes"].mean()),
            }
        )
    table = pd.DataFrame(rows)
    return table.sort_values(
        ["personalised", "accuracy-mean"], ascending=[True, False]
    ).reset_index(drop=True)


def _label(row: pd.Series) -> str:
    marks = [m for m in ("personalised", "asynchronous") if row[m]]
    return row["method"] + (f" ({', '.join(marks)})" if marks else "")


def personalised_pairs(table: pd.DataFrame) -> pd.DataFrame:
    """Each pair of personalised methods, paired by seed from the table's
    ``seed-*`` columns: ``a − b`` in points with its 95% half-width (the same
    test for both: each client's own model on its own held-out part)."""
    seeds = [c for c in table.columns if c.startswith("seed-")]
    mine = table[table["personalised"]].set_index("method")
    rows = []
    for i, a in enumerate(mine.index):
        for b in mine.index[i + 1 :]:
            diff = (mine.loc[a, seeds] - mine.loc[b, seeds]).astype(float).dropna()
            mean, half = t_interval(100 * diff.to_numpy())
            rows.append(
                {"a": a, "b": b, "seeds": len(diff), "diff": mean, "ci95": half}
            )
    return pd.DataFrame(rows, columns=["a", "b", "seeds", "diff", "ci95"])


def _interval(mean: float, half: float) -> str:
    text = f"{mean:+.2f} ± {half:.2f}"
    return f"**{text}**" if separates(mean, half) else text


def to_markdown(table: pd.DataFrame) -> str:
    """The table as markdown, then the personalised methods paired among
    themselves; separated differences in bold."""
    seeds = [c for c in table.columns if c.startswith("seed-")]
    lines = [
        "| method | "
        + " | ".join(f"seed {c.split('-')[1]}" for c in seeds)
        + " | mean ± std | − FedIT, points (paired, 95% CI) | bytes / run |",
        "|---|" + "---|" * len(seeds) + "---|---|---|",
    ]
    for _, row in table.iterrows():
        if row["method"] == BASELINE:
            diff = "—"
        elif row["personalised"]:
            diff = f"{row['diff-points']:+.2f} ± {row['diff-ci95']:.2f}"
            diff += " (not the same test)"
        else:
            diff = _interval(row["diff-points"], row["diff-ci95"])
        per_seed = " | ".join(
            "—" if pd.isna(row[c]) else f"{row[c]:.4f}" for c in seeds
        )
        lines.append(
            f"| {_label(row)} | {per_seed} "
            f"| {row['accuracy-mean']:.4f} ± {row['accuracy-std']:.4f} | {diff} "
            f"| {row['total-bytes'] / 1e6:.1f} MB |"
        )
    pairs = personalised_pairs(table)
    if len(pairs):
        lines += [
            "",
            "Personalised methods against each other (the same test: each "
            "client's own model on its own held-out part), points, paired:",
            "",
            "| a − b | seeds | difference (95% CI) |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r.a} − {r.b} | {r.seeds} | {_interval(r.diff, r.ci95)} |"
            for r in pairs.itertuples()
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    table = paired_table(collect(args.run_dirs))
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "paired.csv", index=False)
    text = to_markdown(table)
    (args.out / "paired.md").write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
