"""docs/results/robustness.md's drawn-partition tables are the committed runs'.

Each table is :func:`benchmarks.robustness.per_seed` of the rows under
docs/results/robustness/drawn-*/ (the study's own ``runs-*.jsonl``), pasted
verbatim; the prose's lowest share of clean accuracy is those rows' lowest.
"""

from __future__ import annotations

import pandas as pd
import pytest

from benchmarks.robustness import CEILING, _with_setting, per_seed
from benchmarks.robustness import _rows as study_rows
from tests.conftest import ROOT

RESULTS = ROOT / "docs" / "results" / "robustness"
PAGE = (ROOT / "docs" / "results" / "robustness.md").read_text(encoding="utf-8")


def _rows(folder: str) -> pd.DataFrame:
    lines = study_rows(RESULTS / folder)
    assert lines, folder
    return _with_setting(pd.DataFrame(lines))


def _lowest(rows: pd.DataFrame, attackers: int, clients: int) -> float:
    """The lowest share of the same seed's clean accuracy over the attacked
    runs (``absent`` is the ceiling, not an attack)."""
    mine = rows[rows["clients"] == clients]
    clean = mine[mine["attack"] == "none"].set_index("seed")["final-accuracy"]
    hit = mine[(mine["attackers"] == attackers) & (mine["attack"] != CEILING)]
    hit = hit[hit["attack"] != "none"]
    return min(r["final-accuracy"] / clean[r["seed"]] for _, r in hit.iterrows())


@pytest.mark.parametrize(
    ("folder", "attackers", "clients"), [("drawn-5", 1, 5), ("drawn-10", 2, 10)]
)
def test_the_page_pastes_the_committed_runs_table(folder, attackers, clients):
    rows = _rows(folder)
    assert set(rows["placement"]) == {"drawn"}
    assert set(rows["defence"]) == {"default"} and set(rows["robust"]) == {"auto"}
    table = per_seed(rows, "default", attackers, clients)
    assert table in PAGE, f"{folder}: the page's table is not\n{table}"
    lowest = _lowest(rows, attackers, clients)
    assert f"at least {lowest:.1%}" in PAGE, lowest


def test_a_missing_run_is_shown_as_not_run():
    rows = _rows("drawn-5")
    gone = rows[~((rows["seed"] == 3) & (rows["attack"] == "alie"))]
    table = per_seed(gone, "default", 1, 5)
    (alie,) = [line for line in table.splitlines() if line.startswith("| alie |")]
    assert alie.split(" | ")[4] == "not run"
    assert alie.endswith("| 98.3% (4 seeds) |")
