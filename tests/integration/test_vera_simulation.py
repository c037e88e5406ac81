"""Slow: one Ray simulation per VeRA-family method on the tiny model."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.conftest import tiny_run_config
from tests.integration.simulate import simulate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", ["fedavg-vera", "vera-fedex", "sorf-vera"])
def test_ray_simulation(tmp_path, assets, method):
    """Flower's Ray engine runs the VeRA-family ServerApp and ClientApps."""
    config = tiny_run_config(
        tmp_path,
        method=method,
        **{"num-server-rounds": 2, "vera-rank": 8, "sorf-rank": 4, "vera-lr": 0.02},
    )
    run_dir = simulate(config, num_supernodes=3)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2]
    assert frame["clients"].tolist() == [3, 3]
    assert (frame["dropped"] == 0).all()
    assert (frame["frobenius-gap"] > 0).all()
    assert frame["accuracy"].between(0, 1).all()
    if method == "sorf-vera":
        assert frame["b-residual"].notna().all() and frame["d-residual"].notna().all()
        assert (frame["b-residual"] > 0).all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["method"] == method
