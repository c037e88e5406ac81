"""Slow: the fedavg and qrmix methods on Flower's Ray simulation engine."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.integration.simulate import simulate

pytestmark = pytest.mark.slow


def _config(tmp_path, method: str) -> dict[str, object]:
    return {
        "method": method,
        "model": "cnn",
        "dataset": "digits",
        "num-server-rounds": 3,
        "warmup-rounds": 1,
        "local-steps": 8,
        "batch-size": 32,
        "lr": 0.05,
        "num-partitions": 3,
        "dirichlet-alpha": 0.5,
        "qrmix-k": 4,
        "qrmix-oversample": 4,
        "seed": 11,
        "device": "cpu",
        "output-dir": str(tmp_path),
    }


@pytest.mark.parametrize(
    ("method", "stages"), [("fedavg", [1, 1, 1]), ("qrmix", [1, 2, 2])]
)
def test_ray_simulation_vision_method(tmp_path, method, stages):
    run_dir = simulate(_config(tmp_path, method), num_supernodes=3)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2, 3]
    assert frame["stage"].tolist() == stages
    assert frame["clients"].tolist() == [3, 3, 3]
    assert (frame["dropped"] == 0).all()
    # the eigen record travels up in stage 2 only
    per_round = frame["bytes-up"].tolist()
    if method == "qrmix":
        assert per_round[1] > per_round[0] and (frame["top-eigenvalue"][1:] > 0).all()
    else:
        assert per_round[0] == per_round[1] == per_round[2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["final-accuracy"] > summary["initial-accuracy"] + 0.1
