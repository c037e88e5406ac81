"""benchmarks/drift.py's table: finished runs only, differences paired by seed."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from benchmarks import drift


def _run(root: Path, cell: str, method: str, seed: int, accs: list[float]) -> None:
    run = root / cell / f"{method}-seed{seed}"
    run.mkdir(parents=True)
    rounds = len(accs)
    pd.DataFrame(
        {
            "round": range(1, rounds + 1),
            "accuracy": accs,
            "frobenius-gap": [0.5] * rounds,
            "seconds": [2.0] * rounds,
        }
    ).to_csv(run / "results.csv", index=False)


def test_summary_pairs_seeds_and_skips_unfinished_runs(tmp_path: Path) -> None:
    n = drift.SETTINGS["num-server-rounds"]
    cell = "polarity-steps40-rank8"
    _run(tmp_path, cell, "fedavg-lora", 0, [0.5] * (n - 1) + [0.60])
    _run(tmp_path, cell, "fedavg-lora", 1, [0.5] * (n - 1) + [0.70])
    _run(tmp_path, cell, "fedex-lora", 0, [0.5] * (n - 1) + [0.65])
    _run(tmp_path, cell, "fedex-lora", 1, [0.5] * (n - 1) + [0.80])
    _run(tmp_path, cell, "fedex-lora", 2, [0.5] * (n - 2))  # unfinished: skipped
    runs = drift.collect(tmp_path)
    assert len(runs) == 4
    assert set(runs["local-steps"]) == {40} and set(runs["rank"]) == {8}
    summary = drift.summarise(runs).set_index("method")
    assert summary.loc["fedex-lora", "seeds"] == 2
    assert summary.loc["fedex-lora", "diff-mean"] == pytest.approx(0.075)
    assert summary.loc["fedex-lora", "diff-std"] == pytest.approx(0.0353553, rel=1e-5)
    assert summary.loc["fedavg-lora", "diff-mean"] == pytest.approx(0.0)
    table = drift.to_markdown(summary.reset_index())
    assert "+0.0750 ± 0.0354" in table


def test_every_cell_uses_scaling_two() -> None:
    config = drift.cell_config("bbc-news", 5, 16, "flora", 2)
    assert config["lora-alpha"] / config["lora-rank"] == 2.0
    assert config["dirichlet-alpha"] == 0.1 and config["num-partitions"] == 8
