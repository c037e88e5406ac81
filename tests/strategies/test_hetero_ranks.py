"""Federations whose clients train ranks {2, 4, 8, 16} (in process, tiny BERT)."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
from flwr.app import Message

from fedlr.errors import ConfigError
from fedlr.server_apps.local import run_in_process
from tests.conftest import tiny_run_config

pytestmark = pytest.mark.usefixtures("assets")

RANKS = (2, 4, 8, 16)
HETERO = {"client-ranks": "2,4,8,16", "num-partitions": 4, "local-steps": 2}


def _run(tmp_path, method, reply_hook=None, **overrides):
    config = tiny_run_config(tmp_path, method=method, **{**HETERO, **overrides})
    run_dir = run_in_process(config, reply_hook=reply_hook)
    return pd.read_csv(run_dir / "results.csv")


@pytest.mark.parametrize("method", ["flexlora", "hetlora", "flora"])
def test_every_rank_trains_and_reports(tmp_path, method):
    frame = _run(tmp_path, method)
    assert frame["round"].tolist() == [1, 2]
    assert (frame["clients"] == 4).all() and (frame["dropped"] == 0).all()
    assert frame["accuracy"].between(0, 1).all()
    assert (frame["rank"] == 16).all()
    gaps = frame[[f"gap-rank-{r}" for r in RANKS]]
    up = frame[[f"bytes-up-rank-{r}" for r in RANKS]]
    # A client of rank r sends r (d_in + d_out) floats per layer (+ head).
    assert (up.diff(axis=1).iloc[:, 1:] > 0).all().all()
    if method == "flora":
        assert (gaps == 0).all().all() and (frame["frobenius-gap"] == 0).all()
        assert "dense-base-sends" in frame
    else:
        # Round 2: each node is sent only its own rank's components.
        down = frame.loc[1, [f"bytes-down-rank-{r}" for r in RANKS]].to_numpy()
        assert (down[1:] > down[:-1]).all(), down
        assert (gaps.to_numpy() >= 0).all()
    if method == "flexlora":
        # The best rank-r approximation: larger ranks receive less error, and
        # rank 16 holds the whole mean of products (4 clients, rank <= 30,
        # but 32 x 32 layers: not exact, yet the smallest gap).
        for _, row in gaps.iterrows():
            assert list(row) == sorted(row, reverse=True)


def test_a_reply_at_another_rank_is_dropped(tmp_path, caplog):
    def wrong_rank(partition: int, instruction: Message, reply: Message) -> Message:
        if partition == 3 and not reply.has_error():
            arrays = reply.content.array_records["arrays"]
            for key in list(arrays):
                if key.endswith("lora_A.weight"):
                    arrays[key] = type(arrays[key])(arrays[key].numpy()[:3])
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        frame = _run(tmp_path, "flexlora", reply_hook=wrong_rank)
    assert (frame["dropped"] == 1).all() and (frame["clients"] == 3).all()
    assert any("rank 3 is not one of the client ranks" in m for m in caplog.messages)


def test_a_one_rank_method_refuses_client_ranks(tmp_path):
    with pytest.raises(ConfigError, match="client-ranks"):
        _run(tmp_path, "fedavg-lora")


def test_a_reply_whose_layers_disagree_on_the_rank_is_dropped(tmp_path, caplog):
    """Layer 0 declares the node's rank 16; the last layer is cut to rank 2."""

    def mixed(partition: int, instruction: Message, reply: Message) -> Message:
        if partition == 3 and not reply.has_error():
            arrays = reply.content.array_records["arrays"]
            a_key = [k for k in arrays if k.endswith("lora_A.weight")][-1]
            b_key = a_key.replace("lora_A", "lora_B")
            arrays[a_key] = type(arrays[a_key])(arrays[a_key].numpy()[:2])
            arrays[b_key] = type(arrays[b_key])(arrays[b_key].numpy()[:, :2])
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        frame = _run(tmp_path, "hetlora", reply_hook=mixed)
    assert (frame["dropped"] == 1).all()
    dropped = [m for m in caplog.messages if "dropped a reply" in m]
    assert len(dropped) == 2
    for message in dropped:
        assert "node 1003" in message and a_key_of(message).endswith("lora_A.weight")
        assert "has shape (2, 32), expected (16, 32)" in message


def a_key_of(message: str) -> str:
    """The array key a drop reason names (the second quoted string)."""
    return message.split("'")[3]
