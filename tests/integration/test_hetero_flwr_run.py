"""Slow: clients of ranks {2, 4, 8, 16} through the real `flwr run` CLI."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.conftest import ROOT, tiny_run_config

pytestmark = pytest.mark.slow

RANKS = (2, 4, 8, 16)


@pytest.mark.early(seconds=72)
def test_every_heterogeneous_rank_method_runs_under_flwr_run(
    tmp_path,
    assets,
    flwr_home,
):
    """Four SuperNodes, one rank each, 2 rounds per method; one SuperLink.

    What Flower's engine adds is method-independent (each SuperNode's rank
    from its partition, the per-rank downlink, node state across rounds), so
    two methods run here: FlexLoRA (each rank sent its truncation) and
    FedEx-LoRA (every rank holds the exact mean). Every heterogeneous-rank
    method's numbers are checked in process
    (tests/strategies/test_hetero_ranks.py::test_every_rank_trains_and_reports).
    """
    from fedlr.launch.flwr_run import flwr_run

    for method in ("flexlora", "fedex-lora"):
        output = tmp_path / method
        config = tiny_run_config(
            output,
            method=method,
            **{
                "client-ranks": ",".join(map(str, RANKS)),
                "num-server-rounds": 2,
                "local-steps": 2,
                "max-eval-examples": 64,
            },
        )
        config.pop("num-partitions")  # the node config says how many (4)
        outcome = flwr_run(
            ROOT,
            flwr_home=flwr_home,
            run_config=config,
            federation_config={"num-supernodes": 4},
            timeout=600,
        )
        assert outcome.status == "finished:completed", method
        (results,) = output.glob("*/results.csv")
        frame = pd.read_csv(results)
        assert frame["clients"].tolist() == [4, 4], method
        assert (frame["dropped"] == 0).all(), method
        assert (frame["rank"] == 16).all()
        # every rank took part: its clients sent bytes up each round
        for rank in RANKS:
            assert (frame[f"bytes-up-rank-{rank}"] > 0).all(), (method, rank)
        if method == "fedex-lora":  # every node holds the exact mean
            assert (frame[[f"gap-rank-{r}" for r in RANKS]] == 0).all().all()
        else:
            assert (frame["gap-rank-2"] >= frame["gap-rank-16"]).all()
