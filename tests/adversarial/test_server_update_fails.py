"""The server's own update fails as the server and belongs to the server
(fedlr.robust.server_update, fedlr.round.protect.OwnUpdate,
fedlr.server_apps.lora.server_update).

A server update that cannot be used (its training raised, its reply is an
error or not finite, its loss is not finite) leaves the round to run
without it: one warning names the server, no line names a node, the round
is the one a clip at the round's median would publish. The server trains
in a context of its own: with a nodes' file that requires DP-SGD and a
small budget, its examples spend no node's budget and write nothing into
the nodes' state directory.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedlr.adapters import AdapterLayout, LoraModule, Role
from fedlr.errors import PrivacyBudgetError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.privacy.dp_sgd import DpSgd
from fedlr.privacy.node_policy import NODE_CONFIG_ENV, NodePolicy, node_policy
from fedlr.robust.rules import RobustConfig
from fedlr.robust.server_update import SERVER_NODE, ServerUpdate, server_instruction
from fedlr.strategies import FedExLoRA
from fedlr.wire import protocol
from tests.conftest import tiny_run_config
from tests.strategies.conftest import reply

LAYOUT = AdapterLayout(
    modules=(
        LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=6, d_in=5, rank=2),
        LoraModule("l1", "l1.A", "l1.B", "l1.W", 0.5, d_out=4, d_in=7, rank=2),
    ),
    head_shapes={"head.w": (2, 5), "head.b": (2,)},
)
TRAINED = (Role.LORA_A, Role.LORA_B, Role.HEAD)
LEFT_OUT = "the server's own update is left out"


def _arrays(seed: int, roles: tuple[Role, ...] = TRAINED) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) for k, s in LAYOUT.shapes(*roles).items()}


def _answer(
    arrays: dict[str, torch.Tensor], loss: float = 0.5, examples: int = 128
) -> Callable[[Message], Message]:
    """A server's ``train`` that answers as the server with ``arrays``."""

    def train(instruction: Message) -> Message:
        content = RecordDict(
            {
                protocol.ARRAYS: state_to_record(arrays),
                protocol.METRICS: MetricRecord(
                    {protocol.NUM_EXAMPLES: examples, protocol.TRAIN_LOSS: loss}
                ),
            }
        )
        return Message(content, reply_to=server_instruction(instruction))

    return train


def _raises(instruction: Message) -> Message:
    raise PrivacyBudgetError("dp-epsilon-budget 1.5 (node config) would be exceeded")


def _error(instruction: Message) -> Message:
    return Message(
        Error(code=0, reason="boom"), reply_to=server_instruction(instruction)
    )


def _nan_arrays() -> Callable[[Message], Message]:
    arrays = _arrays(7)
    arrays["l0.A"][0, 0] = math.nan
    return _answer(arrays)


FAULTS: dict[str, tuple[Callable[[], Callable[[Message], Message]], str]] = {
    "training raises a budget error": (
        lambda: _raises,
        "its training raised PrivacyBudgetError: dp-epsilon-budget 1.5",
    ),
    "an error reply": (lambda: _error, "its reply is not valid: client error: boom"),
    "a NaN array": (_nan_arrays, "its reply is not valid"),
    "a NaN loss": (lambda: _answer(_arrays(7), loss=math.nan), "training loss is nan"),
}


def _round(
    robust: RobustConfig,
    train: Callable[[Message], Message] | None,
    *,
    cap: int | None = None,
    claims: tuple[int, ...] = (10, 30, 60),
) -> tuple[FedExLoRA, dict[str, torch.Tensor] | None, MetricRecord]:
    """One FedEx-LoRA round of three clients, with the server's update
    ``train`` at share 0.5 (``None``: without one)."""
    strategy = FedExLoRA(layout=LAYOUT, robust=robust, max_num_examples=cap)
    if train is not None:
        strategy.server_update = ServerUpdate(train, 0.5, 128)
    state = _arrays(0, tuple(Role))
    grid = InProcessGrid(ClientApp(), num_nodes=3, run_config={})
    record = ArrayRecord({k: state[k] for k in strategy.send_keys()})
    sent = list(strategy.configure_train(1, record, ConfigRecord(), grid))
    assert sorted(int(m.metadata.dst_node_id) for m in sent) == [1000, 1001, 1002]
    replies = [
        reply(1000 + i, _arrays(100 + i), {"num-examples": n, "train-loss": 0.7})
        for i, n in enumerate(claims)
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None
    return strategy, None if arrays is None else record_to_state(arrays), metrics


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_server_update_leaves_the_round_to_run_without_it(fault, caplog):
    """The round completes; it publishes exactly what the clip at the
    round's median publishes without a server update; one warning names
    the server and the reason, and no warning names a node."""
    make, reason = FAULTS[fault]
    server_clip = RobustConfig(rule="norm-clip", clip_reference="server")
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        _, got, metrics = _round(server_clip, make())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    _, want, _ = _round(RobustConfig(rule="norm-clip"), None)
    assert got is not None and want is not None
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert metrics["server-update-weight"] == 0.0
    assert math.isnan(metrics["server-update-loss"])
    assert metrics["clients"] == 3 and metrics["dropped"] == 0
    assert len(warnings) == 1, warnings
    (line,) = warnings
    assert LEFT_OUT in line and reason in line, line
    assert re.search(r"node \d", line) is None and "100" not in line
    # the fallback clip is the round's median: the clients are clipped
    assert metrics["robust-clipped"] >= 1


def test_a_valid_server_update_is_the_servers_and_not_held_to_the_cap(caplog):
    """Control: a valid server update joins the round at share 0.5, claiming
    more examples (128) than the clients' cap (50) allows, without the
    strategy's cap changing; a client claiming 60 is dropped by the cap."""
    server_clip = RobustConfig(rule="norm-clip", clip_reference="server")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy, got, metrics = _round(
            server_clip, _answer(_arrays(7)), cap=50, claims=(10, 30, 60)
        )
    assert got is not None
    assert metrics["server-update-weight"] == 0.5
    assert metrics["server-update-loss"] == 0.5
    assert strategy.max_num_examples == 50
    assert metrics["clients"] == 2 and metrics["dropped"] == 1
    assert "node 1002" in caplog.text and "exceeds max-num-examples 50" in caplog.text
    assert LEFT_OUT not in caplog.text
    _, without, _ = _round(RobustConfig(rule="norm-clip"), None, cap=50)
    assert without is not None
    assert any(not torch.equal(got[k], without[k]) for k in got)


def test_the_server_trains_an_instruction_addressed_to_itself():
    """The server's copy of an instruction (the reply to which names the
    server) is addressed to SERVER_NODE and drops the keys asked (DP-SGD's),
    keeping the rest; the instruction sent to the node is unchanged."""
    strategy = FedExLoRA(layout=LAYOUT)
    state = _arrays(0, tuple(Role))
    grid = InProcessGrid(ClientApp(), num_nodes=2, run_config={})
    record = ArrayRecord({k: state[k] for k in strategy.send_keys()})
    round_config = ConfigRecord({"dp-max-grad-norm": 1.0, "dp-noise-multiplier": 2.0})
    (first, _) = strategy.configure_train(1, record, round_config, grid)
    sent = dict(first.content.config_records[protocol.CONFIG])
    own = server_instruction(first, DpSgd.keys)
    assert (
        int(own.metadata.dst_node_id) == SERVER_NODE != int(first.metadata.dst_node_id)
    )
    assert own.metadata.message_type == first.metadata.message_type
    kept = dict(own.content.config_records[protocol.CONFIG])
    assert {"dp-max-grad-norm", "dp-noise-multiplier"} <= set(sent)
    assert kept == {k: v for k, v in sent.items() if k not in DpSgd.keys}
    assert dict(first.content.config_records[protocol.CONFIG]) == sent
    answer = Message(RecordDict(), reply_to=own)
    assert int(answer.metadata.src_node_id) == SERVER_NODE


def test_the_servers_context_is_not_a_nodes_policy(tmp_path, monkeypatch):
    """A nodes' file (dp-required, a budget, a state directory) applies to
    every node of the process, never to the server's own context."""
    from fedlr.server_apps.lora import server_context

    nodes = tmp_path / "nodes.toml"
    nodes.write_text(
        'dp-required = true\ndp-epsilon-budget = 1.5\nstate-dir = "/nodes"\n'
    )
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    assert node_policy({"partition-id": 0}).dp_required
    context = server_context()
    assert int(context.node_id) == SERVER_NODE
    assert node_policy(context.node_config) == NodePolicy()


# ------------------------------------------------------------ whole runs
@pytest.mark.slow  # one small in-process federation
@pytest.mark.usefixtures("assets")
def test_a_run_whose_server_training_fails_completes(tmp_path, monkeypatch, caplog):
    """The default (FedEx-LoRA, robust = auto), two rounds: the server's
    training raises a budget error in round 1 and returns NaN arrays in
    round 2; the run completes with every client in both rounds and the
    server at share 0, with one warning a round naming the server."""
    from fedlr.launch.local import run_in_process
    from fedlr.server_apps import lora

    real = lora.train_reply

    def failing(job: Any, *args: Any, **kwargs: Any) -> Message:
        if job.server_round == 1:
            raise PrivacyBudgetError("dp-epsilon-budget 1.5 would be exceeded")
        answer = real(job, *args, **kwargs)
        nan = {
            k: torch.full_like(v, math.nan)
            for k, v in record_to_state(answer.content[protocol.ARRAYS]).items()
        }
        content = RecordDict(
            {
                protocol.ARRAYS: state_to_record(nan),
                protocol.METRICS: answer.content[protocol.METRICS],
            }
        )
        return Message(content, reply_to=job.message)

    monkeypatch.setattr(lora, "train_reply", failing)
    config = tiny_run_config(
        tmp_path, robust="auto", **{"num-server-rounds": 2, "local-steps": 1}
    )
    with caplog.at_level(logging.WARNING, logger="flwr"):
        frame = pd.read_csv(run_in_process(config) / "results.csv")
    trained = frame.dropna(subset=["server-update-weight"])
    assert trained["round"].tolist() == [1, 2]
    assert trained["server-update-weight"].tolist() == [0.0, 0.0]
    assert trained["clients"].tolist() == [3, 3]
    assert trained["dropped"].tolist() == [0, 0]
    lines = [m for m in caplog.messages if LEFT_OUT in m]
    assert len(lines) == 2, lines
    assert "round 1" in lines[0] and "PrivacyBudgetError" in lines[0]
    assert "round 2" in lines[1] and "not valid" in lines[1]
    assert not any(re.search(r"node \d", m) for m in lines)
    assert math.isfinite(frame["loss"].dropna().iloc[-1])


def _ledgers(state_dir: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        p.stem: json.loads(p.read_text())["entries"]
        for p in sorted((state_dir / "dp-ledger").glob("*.json"))
    }


@pytest.mark.slow  # one small in-process federation under DP-SGD
@pytest.mark.usefixtures("assets")
def test_dp_sgd_with_auto_and_a_nodes_file_leaves_the_nodes_ledgers_theirs(
    tmp_path, monkeypatch, node_state_dir
):
    """DP-SGD, robust = auto, a nodes' file with dp-required and budget 1.5:
    the server's 128 examples (q = 8 / 128, the nodes' q is at most 0.031)
    once spent that budget in round 2 and ended the run. Now the server
    trains its own examples without DP in its own context: the run
    completes with the server's update at share 0.5 in both rounds, the
    nodes spend their own budget only (ε < 1.5), and the nodes' state
    directory holds the three nodes' ledgers, each of this run's rounds 1
    and 2 (run id 1), and nothing else."""
    from fedlr.launch.local import run_in_process

    nodes = tmp_path / "nodes.toml"
    nodes.write_text("dp-required = true\ndp-epsilon-budget = 1.5\n")
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    config = tiny_run_config(
        tmp_path / "out",
        method="fedavg-lora",
        robust="auto",
        **{
            "num-server-rounds": 2,
            "local-steps": 2,
            "dp-max-grad-norm": 1.0,
            "dp-noise-multiplier": 1.0,
        },
    )
    frame = pd.read_csv(run_in_process(config) / "results.csv")
    trained = frame.dropna(subset=["server-update-weight"])
    assert trained["round"].tolist() == [1, 2]
    assert trained["server-update-weight"].tolist() == [0.5, 0.5]
    assert trained["clients"].tolist() == [3, 3]
    assert all(0 < e < 1.5 for e in trained["dp-epsilon"])
    ledgers = _ledgers(node_state_dir)
    assert len(ledgers) == 3
    for entries in ledgers.values():
        assert [(e["run-id"], e["round"]) for e in entries] == [(1, 1), (1, 2)]
        assert all(e["sample-rate"] < 8 / 128 for e in entries)
    written = {p.relative_to(node_state_dir) for p in node_state_dir.rglob("*")}
    expected = {Path("dp-ledger")} | {
        Path("dp-ledger") / f"{stem}{suffix}"
        for stem in ledgers
        for suffix in (".json", ".lock")
    }
    assert written == expected
