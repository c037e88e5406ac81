"""Slow: one Ray simulation per SVD-family method on the tiny model."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fedlr.strategies import get_method
from tests.conftest import tiny_run_config
from tests.integration.simulate import simulate

pytestmark = pytest.mark.slow

OVERRIDES = {
    "ffa-lora": {},
    "fedsvd": {},
    "fedspec": {"lora-rank": 2, "fedspec-threshold": 0.0001, "fedspec-max-rank": 6},
    "fedsa-lora": {},
    "global-svd": {},
    "local-svd": {},
}


@pytest.mark.parametrize("method", sorted(OVERRIDES))
def test_ray_simulation_per_svd_method(tmp_path, assets, method):
    """Flower's Ray engine: 2 rounds x 3 clients, node state kept across rounds."""
    config = tiny_run_config(
        tmp_path,
        method=method,
        **{"num-server-rounds": 2, "max-eval-examples": 64},
        **OVERRIDES[method],
    )
    run_dir = simulate(config, num_supernodes=3)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2]
    assert frame["clients"].tolist() == [3, 3]
    assert (frame["dropped"] == 0).all()
    assert frame["accuracy"].between(0, 1).all()
    assert frame["frobenius-gap"].notna().all()
    for column in get_method(method).strategy.extra_columns:
        assert frame[column].notna().all(), column
    if method == "fedspec":
        assert frame["rank"].iloc[0] == 4 and frame["rank"].iloc[-1] >= 4
        assert frame["bytes-up"].iloc[1] > frame["bytes-up"].iloc[0]
    if "personal-clients" in frame:
        # Flower keeps each node's context.state across rounds: in round 2
        # every client starts from the personal factors it kept (or received)
        assert frame["personal-clients"].tolist() == [0, 3]
        assert (frame["frobenius-gap"] > 0).all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
