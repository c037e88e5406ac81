"""benchmarks/frontier.py: the newer methods' paired differences to FedIT."""

from __future__ import annotations

import pandas as pd
import pytest
from scipy import stats

from benchmarks.frontier import paired_table, to_markdown


def _runs(accuracies: dict[str, list[float]], personalised=(), finished=True):
    return pd.DataFrame(
        [
            {
                "run": f"{m}-{s}",
                "method": m,
                "seed": s,
                "final-accuracy": a,
                "finished": finished,
                "personalised": m in personalised,
                "asynchronous": False,
                "total-bytes": 1e6,
            }
            for m, accs in accuracies.items()
            for s, a in enumerate(accs)
        ]
    )


def test_the_difference_is_paired_by_seed_with_its_t_interval():
    base = [0.70, 0.75, 0.72, 0.74, 0.71]
    ahead = [a + d for a, d in zip(base, [0.02, 0.03, 0.01, 0.02, 0.02], strict=True)]
    noisy = [a + d for a, d in zip(base, [0.05, -0.04, 0.03, -0.05, 0.01], strict=True)]
    runs = _runs(
        {"fedavg-lora": base, "a": ahead, "b": noisy, "p": ahead, "q": base},
        personalised={"p", "q"},
    )
    table = paired_table(runs).set_index("method")
    diffs = [2.0, 3.0, 1.0, 2.0, 2.0]
    half = stats.t.ppf(0.975, 4) * pd.Series(diffs).std(ddof=1) / 5**0.5
    assert table.loc["a", "diff-points"] == pytest.approx(2.0)
    assert table.loc["a", "diff-ci95"] == pytest.approx(half)
    assert table.loc["a", "separated"] and not table.loc["b", "separated"]
    # a personalised row is never called separated: not the same test
    assert not table.loc["p", "separated"]
    text = to_markdown(table.reset_index())
    assert "**+2.00 ±" in text and "p (personalised)" in text
    assert "(not the same test)" in text
    # personalised rows last, then paired among themselves (the same test)
    assert table.reset_index()["method"].iloc[-2:].tolist() == ["p", "q"]
    assert f"| p − q | 5 | **+2.00 ± {half:.2f}** |" in text


def test_unfinished_runs_and_a_missing_fedit_are_refused():
    with pytest.raises(ValueError, match="unfinished"):
        paired_table(_runs({"fedavg-lora": [0.7]}, finished=False))
    with pytest.raises(ValueError, match="no fedavg-lora"):
        paired_table(_runs({"a": [0.7, 0.8]}))
