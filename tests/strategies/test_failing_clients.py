"""Half the clients fail at random (seeded): the run goes on, or stops clearly."""

from __future__ import annotations

import json
import logging
import random

import pandas as pd
import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict

from fedlr.errors import NoValidRepliesError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.client_app import app as client_app
from fedlr.server_apps.runner import run_server
from tests.conftest import tiny_run_config

MODES = ("raise", "timeout", "nan", "inf", "shape")


def _corrupt(reply: Message, mode: str) -> Message:
    content = reply.content
    state = record_to_state(content["arrays"])
    key = sorted(state)[0]
    if mode == "nan":
        state[key] = torch.full_like(state[key], float("nan"))
    elif mode == "inf":
        state[key] = state[key].clone()
        state[key].view(-1)[0] = float("inf")
    elif mode == "shape":
        state[key] = state[key][..., :-1].contiguous()
    content["arrays"] = state_to_record(state)
    return reply


class FailingClients:
    """Each round, ``failing`` of the clients fail in a random mode (seeded)."""

    def __init__(self, num_nodes: int, failing: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.num_nodes = num_nodes
        self.failing = failing
        self.plan: dict[int, dict[int, str]] = {}
        self.seen: list[tuple[int, int, str]] = []

    def __call__(self, partition: int, message: Message, reply: Message):
        server_round = int(message.content["config"]["server-round"])
        if server_round not in self.plan:
            chosen = self.rng.sample(range(self.num_nodes), self.failing)
            self.plan[server_round] = {p: self.rng.choice(MODES) for p in chosen}
        mode = self.plan[server_round].get(partition)
        if mode is None:
            return reply
        self.seen.append((server_round, partition, mode))
        if mode == "timeout":
            return None
        if mode == "raise":
            return Message(Error(code=0, reason="ClientApp raised"), reply_to=message)
        return _corrupt(reply, mode)


def _run(tmp_path, hook, **overrides):
    config = tiny_run_config(tmp_path, **overrides)
    grid = InProcessGrid(
        client_app,
        num_nodes=config["num-partitions"],
        run_config=config,
        reply_hook=hook,
    )
    context = Context(
        run_id=9, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    return run_server(grid, context)


# fot: 5 tasks of one round each, so rounds 2-5 are task boundaries whose
# replies also carry GPSE sketches.
SETTINGS: dict[str, dict[str, object]] = {
    "fedex-lora": {},
    "fot": {
        "model": "mlp",
        "dataset": "permuted-mnist",
        "num-tasks": 5,
        "rounds-per-task": 1,
        "task-examples": 400,
        "fot-activation-examples": 20,
        "local-steps": 5,
        "batch-size": 32,
        "lr": 0.05,
        "momentum": 0.0,
        "max-eval-examples": 100,
    },
}


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_half_the_clients_fail_every_round_and_the_run_completes(
    tmp_path, assets, method, caplog
):
    hook = FailingClients(num_nodes=4, failing=2, seed=11)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_dir = _run(
            tmp_path,
            hook,
            method=method,
            **{"num-partitions": 4, "num-server-rounds": 5, "min-replies": 2},
            **SETTINGS[method],
        )
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2, 3, 4, 5]
    assert (frame["dropped"] == 2).all() and (frame["clients"] == 2).all()
    modes = {mode for _, _, mode in hook.seen}
    assert len(hook.seen) == 10 and len(modes) >= 4, hook.seen
    dropped = [m for m in caplog.messages if "dropped a reply" in m]
    assert len(dropped) == 10
    reasons = " ".join(dropped)
    expected = {
        "raise": "ClientApp raised",
        "timeout": "no reply",
        "nan": "NaN or Inf",
        "inf": "NaN or Inf",
        "shape": "has shape",
    }
    for mode in modes:
        assert expected[mode] in reasons, (mode, reasons)
    assert all(frame["accuracy"].between(0, 1))


def test_too_few_clients_left_ends_the_run_with_a_clear_error(tmp_path, assets):
    hook = FailingClients(num_nodes=4, failing=2, seed=3)
    with pytest.raises(NoValidRepliesError, match="round 1: 2 valid replies, 3"):
        _run(
            tmp_path,
            hook,
            **{"num-partitions": 4, "num-server-rounds": 3, "min-replies": 3},
        )
    # Round 0 was checkpointed, so the failure loses nothing already done.
    (info,) = tmp_path.glob("*/checkpoint.json")
    manifest = json.loads(info.read_text())
    assert manifest["round"] == 0
    assert [e["round"] for e in manifest["checkpoints"]] == [0]
