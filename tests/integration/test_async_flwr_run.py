"""Slow: the asynchronous ServerApp loop through the real `flwr run` CLI.

Under `flwr run` the loop pushes instructions and polls the SuperLink's
grid (no virtual clock): every version is applied, replies arrive while
other nodes still train, so some are stale, and every reply is a row of
``updates.csv``.
"""

from __future__ import annotations

import pandas as pd
import pytest

from tests.conftest import ROOT, tiny_run_config

pytestmark = pytest.mark.slow

NODES = 3


@pytest.mark.parametrize(
    ("method", "versions", "extra"),
    [("fedbuff-lora", 2, {"buffer-size": 2}), ("fedasync-lora", 4, {})],
)
def test_an_asynchronous_method_runs_under_flwr_run(
    method, versions, extra, tmp_path, assets, flwr_home
):
    from fedlr.launch.flwr_run import flwr_run

    output = tmp_path / method
    config = tiny_run_config(
        output,
        method=method,
        **{
            "num-server-rounds": versions,
            "local-steps": 1,
            "max-eval-examples": 64,
            **extra,
        },
    )
    config.pop("num-partitions")  # the node config says how many
    outcome = flwr_run(
        ROOT,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": NODES},
        timeout=600,
    )
    assert outcome.status == "finished:completed", outcome.output[-2000:]
    (run_dir,) = [p for p in output.iterdir() if p.is_dir()]
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == list(range(1, versions + 1))
    assert frame["virtual-time"].is_monotonic_increasing
    updates = pd.read_csv(run_dir / "updates.csv")
    applied = updates[updates["event"] == "applied"]
    per_version = int(extra.get("buffer-size", 1))
    assert len(applied) == versions * per_version
    assert sorted(applied["applied-version"].unique()) == list(range(1, versions + 1))
    if method == "fedasync-lora":  # 3 jobs from version 0, 1 applied fresh:
        # another one of them is applied later, stale (unless one node ran
        # 4 jobs before either other node finished one)
        assert (applied["staleness"] > 0).any()
    assert (
        applied["staleness"] == applied["applied-version"] - 1 - applied["base-version"]
    ).all()
