"""The published tables mark what their rows measure.

Every sweep's ``table.md`` under docs/results is its ``table.csv`` rendered
by :func:`fedlr.runs.table.to_markdown`, and a personalised method's row
(each client's own model on its own held-out part) says so, as does an
asynchronous one's: the registry's traits decide, not the table's author.
"""

from __future__ import annotations

import pandas as pd
import pytest

from benchmarks.redraw import RESULTS, TABLES
from fedlr.runs.table import to_markdown
from fedlr.strategies.registry import get_method


@pytest.mark.parametrize("name", sorted(TABLES))
def test_published_table_is_its_csv_with_the_rows_marked(name: str) -> None:
    table = pd.read_csv(RESULTS / name / "table.csv")
    assert {"personalised", "asynchronous"} <= set(table.columns)
    specs = [get_method(m) for m in table["method"]]
    assert table["personalised"].tolist() == [s.traits.personalised for s in specs]
    assert table["asynchronous"].tolist() == [
        bool(s.strategy.asynchronous) for s in specs
    ]
    text = (RESULTS / name / "table.md").read_text()
    assert text == to_markdown(table, TABLES[name])
    for method in table["method"]:
        personalised = get_method(method).traits.personalised
        rows = [line for line in text.splitlines() if line.startswith(f"| {method} ")]
        assert rows
        assert all(("(personalised)" in row) == personalised for row in rows)


def test_the_frontier_marks_its_three_personalised_methods() -> None:
    text = (RESULTS / "frontier" / "table.md").read_text()
    marked_rows = sorted(
        line.split(" | ")[0].removeprefix("| ")
        for line in text.splitlines()
        if "(personalised)" in line
    )
    assert marked_rows == [
        "feddpa (personalised)",
        "fedlease (personalised)",
        "hilora (personalised)",
    ]
    assert (RESULTS / "frontier" / "summary.png").stat().st_size > 20_000


def test_the_frontier_pairs_each_method_with_fedit_on_five_seeds() -> None:
    from benchmarks.frontier import to_markdown as paired_markdown

    paired = pd.read_csv(RESULTS / "frontier" / "paired.csv")
    assert (RESULTS / "frontier" / "paired.md").read_text() == paired_markdown(paired)
    assert (paired["seeds"] == 5).all()
    assert paired["personalised"].tolist() == [
        get_method(m).traits.personalised for m in paired["method"]
    ]
    # a personalised row's accuracy is not the global model's: never separated
    assert not paired[paired["personalised"]]["separated"].any()
