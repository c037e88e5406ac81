"""The factored FedEx downlink in whole runs (in process, tiny BERT).

Nodes that miss rounds receive the chain of changes they missed, a node
whose kept base weights drifted or were lost is resynchronised with dense
weights, and the run's numbers are the dense downlink's.
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict

import pandas as pd
import pytest
import torch
from flwr.app import Context, Message, RecordDict

from fedlr.flower import InProcessGrid
from fedlr.launch.client_app import app as client_app
from fedlr.server_apps.runner import run_server
from fedlr.wire import protocol
from tests.conftest import tiny_run_config

pytestmark = pytest.mark.usefixtures("assets")


class Recorder:
    """Reply hook: records each instruction's base-weight form, and runs
    ``actions[(round, partition)](context)`` after that node's reply."""

    def __init__(self, actions=None, replies=None) -> None:
        self.grid: InProcessGrid | None = None
        self.sent: dict[int, list[tuple[int, str, list[int]]]] = defaultdict(list)
        self.actions = actions or {}
        self.replies = replies or {}

    def __call__(self, partition: int, instruction: Message, reply: Message):
        content = instruction.content
        config = content.config_records["config"]
        server_round = int(config[protocol.SERVER_ROUND])
        arrays = content.array_records["arrays"]
        if any(key.endswith("base_layer.weight") for key in arrays):
            form, versions = "dense", []
        elif protocol.BASE_DELTA in content.array_records:
            keys = content.array_records[protocol.BASE_DELTA]
            form, versions = "changes", sorted({int(k.split(":")[0]) for k in keys})
        else:
            form, versions = "current", []
        self.sent[partition].append((server_round, form, versions))
        action = self.actions.get((server_round, partition))
        if action is not None and self.grid is not None:
            node = instruction.metadata.dst_node_id
            action(self.grid.contexts[node])
        edit = self.replies.get((server_round, partition))
        if edit is not None and not reply.has_error():
            edit(reply)
        return reply


def _run(tmp_path, recorder: Recorder, **overrides):
    config = tiny_run_config(tmp_path, **{"local-steps": 2, **overrides})
    grid = InProcessGrid(
        client_app,
        num_nodes=config["num-partitions"],
        run_config=config,
        reply_hook=recorder,
    )
    recorder.grid = grid
    context = Context(
        run_id=3, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    run_dir = run_server(grid, context)
    return pd.read_csv(run_dir / "results.csv"), torch.load(run_dir / "final_arrays.pt")


def test_nodes_that_miss_rounds_get_the_changes_they_missed(tmp_path):
    overrides = {"num-partitions": 4, "fraction-train": 0.5, "num-server-rounds": 6}
    dense_log = Recorder()
    dense, dense_arrays = _run(
        tmp_path / "dense", dense_log, **{"fedex-downlink": "dense"}, **overrides
    )
    log = Recorder()
    factored, arrays = _run(tmp_path / "factored", log, **overrides)
    # Same sampled nodes (the runner seeds Flower's sampling).
    for p in range(4):
        assert [r for r, _, _ in log.sent[p]] == [r for r, _, _ in dense_log.sent[p]]
    # Every node's first instruction is dense; later ones carry changes only.
    # A node that missed rounds gets the whole chain it missed.
    chains = []
    for sent in log.sent.values():
        assert sent[0][1] == "dense"
        for (prev, _, _), (now, form, versions) in itertools.pairwise(sent):
            assert form == "changes"
            # Round t carries version t - 1: the node holds prev - 1.
            assert versions == list(range(prev, now))
            chains.append(len(versions))
    assert max(chains) >= 2, f"no node missed a round: {dict(log.sent)}"
    assert (factored["dropped"] == 0).all()
    # Bytes down: the changes are far smaller than the dense base weights.
    later = factored["round"] > 1
    assert (factored.loc[later, "bytes-down"] < dense.loc[later, "bytes-down"]).all()
    assert factored.loc[later, "dense-base-sends"].sum() == sum(
        1
        for sent in log.sent.values()
        for r, form, _ in sent
        if form == "dense" and r > 1
    )
    # The same model as the dense downlink.
    assert (factored["accuracy"].round(3) == dense["accuracy"].round(3)).all()
    for key, tensor in dense_arrays.items():
        torch.testing.assert_close(arrays[key], tensor, rtol=1e-4, atol=1e-5)


def _corrupt(context: Context) -> None:
    record = context.state.array_records[protocol.BASE_STATE]
    state = record.to_torch_state_dict()
    key = next(iter(state))
    state[key] = state[key] + 0.5
    context.state[protocol.BASE_STATE] = type(record)(state)


def _wipe(context: Context) -> None:
    for name in list(context.state.keys()):
        del context.state[name]


def test_drifted_and_lost_nodes_are_resynchronised(tmp_path, caplog):
    recorder = Recorder(actions={(1, 0): _corrupt, (2, 1): _wipe})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        frame, _ = _run(tmp_path, recorder, **{"num-server-rounds": 5})
    forms = {p: [form for _, form, _ in sent] for p, sent in recorder.sent.items()}
    # Node 0 drifted after round 1: its round-2 reply is dropped (checksum),
    # round 3 resends dense. Node 1 lost its state after round 2: dropped in
    # round 3, dense in round 4.
    assert forms[0] == ["dense", "changes", "dense", "changes", "changes"]
    assert forms[1] == ["dense", "changes", "changes", "dense", "changes"]
    assert forms[2] == ["dense", "changes", "changes", "changes", "changes"]
    assert frame["dropped"].tolist() == [0, 1, 1, 0, 0]
    assert frame["dense-base-sends"].tolist() == [3, 0, 1, 1, 0]
    dropped = [m for m in caplog.messages if "dropped a reply" in m]
    assert any("fail the checksum" in m for m in dropped)
    assert any("keeps no base weights" in m for m in dropped)
    assert frame["accuracy"].between(0, 1).all()


@pytest.mark.parametrize("claim", [99, 1.5, -1])
def test_a_false_base_held_is_dropped(tmp_path, caplog, claim):
    def lie(reply: Message) -> None:
        reply.content["metrics"][protocol.BASE_HELD] = claim

    recorder = Recorder(replies={(1, 2): lie})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        frame, _ = _run(tmp_path, recorder, **{"local-steps": 1})
    assert frame["dropped"].tolist() == [1, 0]
    assert any("'base-held' must be a published version" in m for m in caplog.messages)
    # The liar is sent dense weights next round; the others only changes.
    assert [form for _, form, _ in recorder.sent[2]] == ["dense", "dense"]
    assert [form for _, form, _ in recorder.sent[0]] == ["dense", "changes"]


def test_nodes_keep_no_copy_when_changes_cannot_pay(tmp_path):
    """Rank 16 on 32 x 32 layers: a change of 3 clients has rank up to 32, as
    large as the weight itself, so nodes are told to keep no copy."""
    recorder = Recorder()
    frame, _ = _run(tmp_path, recorder, **{"lora-rank": 16, "num-server-rounds": 3})
    assert frame["dense-base-sends"].tolist() == [3, 3, 3]
    assert (frame["dropped"] == 0).all()
    assert all(
        form == "dense" for sent in recorder.sent.values() for _, form, _ in sent
    )
    assert recorder.grid is not None
    for context in recorder.grid.contexts.values():
        assert protocol.BASE_STATE not in context.state


def test_worth_keeping_follows_sampling_and_change_size():
    from fedlr.adapters.roles import AdapterLayout, LoraModule
    from fedlr.strategies import FedExLoRA

    layout = AdapterLayout(
        modules=(LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, 64, 64, 4),)
    )
    strategy = FedExLoRA(layout=layout)
    strategy.ledger.dense_nbytes = 64 * 64 * 4
    # 4 clients: rank <= 12, 12 x 128 floats against 4096: pays every round
    assert strategy.worth_keeping(4)
    # ... but not when a node is sampled one round in ten
    strategy.fraction_train = 0.1
    assert not strategy.worth_keeping(4)
    strategy.fraction_train = 1.0
    # 9 clients: rank <= 32, 32 x 128 = 4096: not smaller than the weight
    assert not strategy.worth_keeping(9)
    # after a measured change, its size decides
    strategy.ledger.last_change_nbytes = 1000.0
    assert strategy.worth_keeping(9)
