"""1,000 clients, 10 % per round: the default text task on both engines.

The configuration of ``benchmarks/scale_runs.py`` (docs/results.md,
"1,000 clients"): the default run (fedex-lora, MiniLM on polarity) with
``num-partitions=1000 fraction-train=0.1``, the ``iid`` partitioner and
``min-partition-size=3`` (3 or 4 sentences per client). To keep the tests
short each client takes one local step and the server evaluates 200 held-out
sentences (the benchmark: two steps, all 800); the in-process test runs 2
rounds (the sample is drawn afresh each round), the Ray test 1.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest
from flwr.app import Message

from benchmarks.scale_runs import scale_config
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

CLIENTS = 1000
SAMPLED = 100
SHORT = {"local-steps": 1, "max-eval-examples": 200}


def _check_results(run_dir: Path, rounds: int) -> pd.DataFrame:
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == list(range(1, rounds + 1))
    assert frame["clients"].tolist() == [SAMPLED] * rounds
    assert (frame["dropped"] == 0).all()
    for column in ("accuracy", "loss", "train-loss"):
        assert all(math.isfinite(v) for v in frame[column]), column
    assert frame["accuracy"].between(0, 1).all()
    for column in ("seconds", "train-seconds", "eval-seconds"):
        assert (frame[column] > 0).all(), column
    assert (frame["aggregate-seconds"] >= 0).all()
    return frame


def test_thousand_clients_in_process(tmp_path, assets):
    from fedlr.launch.local import run_in_process
    from fedlr.wire import protocol

    config = scale_config(tmp_path, rounds=2, extra=SHORT)
    assert config["num-partitions"] == CLIENTS and config["fraction-train"] == 0.1
    trained: dict[int, list[int]] = defaultdict(list)
    examples: list[int] = []

    def note(partition: int, message: Message, reply: Message) -> Message:
        trained[int(message.content["config"]["server-round"])].append(partition)
        metrics = reply.content.metric_records[protocol.METRICS]
        examples.append(int(metrics[protocol.NUM_EXAMPLES]))
        return reply

    run_dir = run_in_process(config, reply_hook=note)
    _check_results(run_dir, rounds=2)
    assert sorted(trained) == [1, 2]
    for partitions in trained.values():
        assert len(partitions) == len(set(partitions)) == SAMPLED
        assert all(0 <= p < CLIENTS for p in partitions)
    assert set(trained[1]) != set(trained[2])  # sampled afresh each round
    assert set(examples) <= {3, 4}  # 3,200 training sentences, 1,000 clients


@pytest.mark.early(seconds=100)
def test_thousand_clients_on_the_ray_engine(tmp_path, assets, flwr_home):
    from fedlr.launch.flwr_run import flwr_run

    output = tmp_path / "out"
    config = scale_config(output, rounds=1, extra=SHORT)
    outcome = flwr_run(
        ROOT,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": CLIENTS},
        timeout=900,
    )
    assert outcome.status == "finished:completed"
    (results,) = output.glob("*/results.csv")
    _check_results(results.parent, rounds=1)
