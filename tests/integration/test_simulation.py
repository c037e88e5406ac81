"""Slow integration tests: the Ray simulation engine and the real `flwr run` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import ROOT, tiny_run_config
from tests.integration.simulate import simulate

pytestmark = pytest.mark.slow


def _run_dirs(output: Path) -> list[Path]:
    return sorted(p.parent for p in output.glob("*/results.csv"))


def test_ray_simulation_two_rounds_three_clients(tmp_path, assets):
    """Flower's Ray engine runs our ServerApp and ClientApp code, 2 rounds x 3."""
    config = tiny_run_config(tmp_path, **{"num-server-rounds": 2})
    run_dir = simulate(config, num_supernodes=3)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2]
    assert frame["clients"].tolist() == [3, 3]
    assert (frame["dropped"] == 0).all()
    assert (frame["frobenius-gap"] > 0).all()
    assert frame["accuracy"].between(0, 1).all()
    # The in-process engine (fedlr.launch.compare --engine inprocess) runs the same
    # ServerApp and ClientApp: the same numbers as the Ray engine.
    from fedlr.launch.local import run_in_process

    local = pd.read_csv(run_in_process(config, num_nodes=3) / "results.csv")
    for column in ("accuracy", "loss", "frobenius-gap", "train-loss", "bytes-up"):
        assert local[column].tolist() == pytest.approx(
            frame[column].tolist(), rel=1e-6
        ), column


def test_flwr_run_smoke(tmp_path, assets, flwr_home):
    """`flwr run` through the real CLI: completed status, one CSV row per round."""
    import psutil

    from fedlr.launch.flwr_run import flwr_run, stop_local_superlinks

    output = tmp_path / "out"
    config = tiny_run_config(output, **{"num-server-rounds": 2})
    config.pop("num-partitions")  # the node config says how many (3)
    outcome = flwr_run(
        ROOT,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": 3},
        timeout=600,
    )
    assert outcome.status == "finished:completed"
    (run_dir,) = _run_dirs(output)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2]
    assert frame["clients"].tolist() == [3, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert f"run{outcome.run_id}" in run_dir.name
    # The detached SuperLink is ours to stop, by PID.
    pids = stop_local_superlinks(flwr_home)
    assert pids, "expected a local SuperLink started under our FLWR_HOME"
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids
    )


def test_flwr_run_failure_is_reported_not_hidden(tmp_path, assets, flwr_home):
    """A failing ServerApp makes `flwr run --stream` exit 0; we read the status."""
    from fedlr.launch.flwr_run import FlwrRunError, flwr_run

    config = tiny_run_config(tmp_path, method="no-such-method")
    with pytest.raises(FlwrRunError, match="finished:failed"):
        flwr_run(
            ROOT,
            flwr_home=flwr_home,
            run_config=config,
            federation_config={"num-supernodes": 2},
            timeout=600,
        )
