"""Slow: one Ray simulation of ``fot`` on a tiny permuted-MNIST stream."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from tests.integration.simulate import simulate

pytestmark = pytest.mark.slow


def test_fot_ray_simulation_two_tasks(tmp_path):
    from fedlr.data.assets import ensure_assets

    ensure_assets(["mnist"])
    config = {
        "method": "fot",
        "model": "mlp",
        "dataset": "permuted-mnist",
        "num-tasks": 2,
        "rounds-per-task": 2,
        "num-server-rounds": 4,
        "local-steps": 10,
        "batch-size": 32,
        "lr": 0.1,
        "lr-decay": 1.0,
        "momentum": 0.0,
        "num-partitions": 2,
        "task-examples": 1000,
        "fot-activation-examples": 50,
        "seed": 3,
        "device": "cpu",
        "output-dir": str(tmp_path),
    }
    run_dir = simulate(config, num_supernodes=2)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2, 3, 4]
    assert frame["task"].tolist() == [0, 0, 1, 1]
    assert (frame["clients"] == 2).all() and (frame["dropped"] == 0).all()
    # the boundary round (3) carried sketches: more bytes up, bases built
    assert frame["bytes-up"].iloc[2] > frame["bytes-up"].iloc[1]
    assert (frame["basis-dims"].iloc[2:] > 0).all()
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = summary["accuracy-matrix"]
    assert [len(r) for r in rows] == [1, 2]
    assert math.isclose(summary["ACC"], sum(rows[1]) / 2)
    assert math.isclose(summary["FGT"], rows[0][0] - rows[1][0])
    assert (run_dir / "accuracy_matrix.csv").exists()
