"""Redraw the published figures and tables from the raw rows in docs/results.

No training: every figure here is drawn from the rows committed beside it.

``python -m benchmarks.redraw`` rewrites:

- the robustness studies' ``robustness.png`` from their ``robustness.csv``
  (:func:`benchmarks.robustness.figure`), titles in :data:`ROBUSTNESS`;
- each sweep's ``table.md`` from its ``table.csv``
  (:func:`fedlr.runs.table.to_markdown`), the personalised and
  asynchronous rows marked from the registry (a ``table.csv`` written
  before those columns existed gets them here), and ``summary.png``
  (:func:`fedlr.runs.table.summary_figure`: every row's final numbers,
  personalised rows apart) for the sweeps in :data:`SUMMARIES`;
- ``llm/methods.md`` from ``llm/methods.csv``
  (:func:`benchmarks.llm_methods.to_markdown`).

The per-round ``comparison.png`` of a sweep needs its runs' per-round rows,
which are not committed: ``bash benchmarks/results.sh NAME`` reruns them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from benchmarks import llm_methods, robustness
from fedlr.runs.table import summary_figure, to_markdown
from fedlr.strategies.registry import get_method

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"

ROBUSTNESS = {
    "robustness": "",
    "robustness/default-3": (
        "default task, 3 rounds, one attacker of five, 5 seeds (H100)"
    ),
    "robustness/default-15": (
        "default task, 15 rounds, one attacker of five, 5 seeds (H100)"
    ),
    "robustness/heldout-cpu": (
        "default task, 15 rounds, CPU, seeds 0-4 (ALIE: seeds 0-1)"
    ),
    "robustness/centred-clip-cpu": (
        "centred clipping, default task, 15 rounds, CPU, seeds 0-4"
    ),
    "robustness/server-update-cpu": (
        'robust = "auto" (the default), default task, 15 rounds, CPU, seeds 0-4'
    ),
    "robustness/drawn-5": (
        'robust = "auto", one attacker of five at a drawn partition, 15 rounds, '
        "CPU, seeds 0-4"
    ),
    "robustness/drawn-10": (
        'robust = "auto", two attackers of ten at drawn partitions, 15 rounds, '
        "CPU, seeds 0-2"
    ),
}
"""Study folder under docs/results: the figure's title."""

TABLES = {
    "lora-dirichlet": (),
    "lora-iid": (),
    "vera": (),
    "llm": (),
    "qrmix": (),
    "fot": (),
    "svd": ("lora-rank",),
    "frontier": (),
}
"""Sweep folder: its ``by`` keys (the settings that split its rows)."""

SUMMARIES = {
    "frontier": (
        "Newer LoRA methods on the LoRA-family task (MiniLM, polarity, "
        "4 clients, Dirichlet 0.5, 6 rounds, 5 seeds)",
        "fedavg-lora",
    ),
    "llm": (
        "Causal LM: tiny-llama on arith-instruct (4 clients, 5 rounds, 3 seeds)",
        None,
    ),
}
"""Sweep folder: the summary figure's title and its reference method."""


def marked(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with ``personalised`` and ``asynchronous`` columns from the
    registry's traits of each row's method, where the table has none."""
    table = table.copy()
    specs = {m: get_method(m) for m in table["method"].unique()}
    if "personalised" not in table:
        table["personalised"] = [specs[m].traits.personalised for m in table["method"]]
    if "asynchronous" not in table:
        table["asynchronous"] = [
            bool(specs[m].strategy.asynchronous) for m in table["method"]
        ]
    return table


def _sorted_columns(table: pd.DataFrame) -> pd.DataFrame:
    """The trait columns after ``method`` and the ``by`` keys' block."""
    traits = ["personalised", "asynchronous"]
    rest = [c for c in table.columns if c not in traits]
    at = rest.index("seeds")
    return table[[*rest[:at], *traits, *rest[at:]]]


def redraw_table(name: str, by: tuple[str, ...]) -> list[Path]:
    """``table.md`` (and ``table.csv``'s trait columns) of one sweep; its
    ``summary.png`` where :data:`SUMMARIES` names it."""
    folder = RESULTS / name
    table = _sorted_columns(marked(pd.read_csv(folder / "table.csv")))
    table.to_csv(folder / "table.csv", index=False)
    (folder / "table.md").write_text(to_markdown(table, by))
    written = [folder / "table.csv", folder / "table.md"]
    if name in SUMMARIES:
        title, reference = SUMMARIES[name]
        fig = summary_figure(table, title=title, reference=reference)
        fig.savefig(folder / "summary.png", dpi=110)
        plt.close(fig)
        written.append(folder / "summary.png")
    return written


def redraw_robustness(name: str, title: str) -> Path:
    folder = RESULTS / name
    rows = pd.read_csv(folder / "robustness.csv")
    fig = robustness.figure(rows, title)
    path = folder / "robustness.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "only", nargs="*", help="folders under docs/results (default: all)"
    )
    args = parser.parse_args(argv)
    chosen = set(args.only)
    for name, title in ROBUSTNESS.items():
        if not chosen or name in chosen:
            print(redraw_robustness(name, title))
    for name, by in TABLES.items():
        if not chosen or name in chosen:
            print(*redraw_table(name, by), sep="\n")
    if not chosen or "llm" in chosen:
        methods = pd.read_csv(RESULTS / "llm" / "methods.csv")
        (RESULTS / "llm" / "methods.md").write_text(llm_methods.to_markdown(methods))
        print(RESULTS / "llm" / "methods.md")


if __name__ == "__main__":
    main()
