"""A hostile server against the node's one policy gate (fedlr.client_apps.gate).

Each test is what a server that controls the instructions would send to a
node whose operator set ``dp-required = true`` in its own node config file:

* every payload kind the registry knows, trained with and without DP-SGD
  (the DP keys put into the instruction by the server, as a server that
  bypasses the run config's check would): no kind trains without DP; a kind
  either trains with DP-SGD and charges its ledger (entries > 0, epsilon > 0)
  or is refused by name;
* the releases no mechanism covers (QR-Mix's eigenpairs, FOT's sketches) in
  a DP round: refused by name;
* message types no handler accounts for (a query, an unregistered action):
  refused by name, on any node;
* evaluate as an oracle: 21 evaluate instructions whose reported losses give
  a finite-difference estimate of the gradient of the node's loss. Without a
  policy the estimate is the gradient (correlation > 0.99); on a
  ``dp-required`` node every query is refused with nothing charged; with the
  operator's noised evaluation every answer is charged to the ledger and the
  estimate's correlation with the true gradient is below 0.5.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType

from fedlr.client_apps import qrmix
from fedlr.client_apps.gate import ACCESS, DP_SGD
from fedlr.client_apps.payloads import PAYLOADS
from fedlr.config.run import RunConfig
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.client_app import app
from fedlr.privacy.accounting import epsilon
from fedlr.privacy.budget import PrivacyLedger
from fedlr.privacy.node_policy import NODE_CONFIG_ENV
from fedlr.server_apps.builtin_plans import build_plan
from fedlr.strategies.registry import resolve
from fedlr.wire import protocol
from tests.conftest import tiny_run_config

NODE = 1000
DP = {"dp-max-grad-norm": 1.0, "dp-noise-multiplier": 1.0}


def _vision(method: str, tmp: Path) -> dict[str, Any]:
    base: dict[str, Any] = {"method": method, "seed": 3, "device": "cpu"}
    base["output-dir"] = str(tmp)
    if method in ("fedavg", "qrmix"):
        base.update(model="cnn", dataset="digits", lr=0.05)
        base.update({"num-partitions": 3, "local-steps": 2, "batch-size": 16})
    else:
        base.update(model="mlp", dataset="permuted-mnist", lr=0.1)
        base.update({"num-partitions": 3, "task-examples": 200, "num-tasks": 3})
        base.update({"rounds-per-task": 1, "num-server-rounds": 3})
        base.update({"fot-sketch-dim": 16, "local-steps": 2, "batch-size": 16})
    return base


def _text(method: str, tmp: Path) -> dict[str, Any]:
    extra = {"vera-rank": 8} if "vera" in method else {}
    return tiny_run_config(tmp, method=method, **extra)


#: One method per payload kind (the vision methods each), as a server runs it.
METHODS: dict[str, tuple[str, ...]] = {
    "lora": ("fedavg-lora",),
    "vera": ("fedavg-vera",),
    "sorf-vera": ("sorf-vera",),
    "qrmix": ("fedavg", "qrmix"),
    "gpse": ("fedavg-continual", "fot"),
}


def _config(method: str, tmp: Path) -> dict[str, Any]:
    vision = method in ("fedavg", "qrmix", "fedavg-continual", "fot")
    return _vision(method, tmp) if vision else _text(method, tmp)


@dataclass
class Node:
    """Node 1000 of a 3-node in-process federation, and its round-1 instruction."""

    context: Context
    train: Message
    arrays: ArrayRecord


def _node(config: dict[str, Any]) -> Node:
    plan = build_plan(resolve(config))
    grid = InProcessGrid(app, num_nodes=3, run_config=config)
    arrays = ArrayRecord(dict(plan.initial_arrays.items()))
    messages = plan.strategy.configure_train(
        1, arrays, ConfigRecord(plan.train_config), grid
    )
    (train,) = [m for m in messages if m.metadata.dst_node_id == NODE]
    return Node(grid.contexts[NODE], train, arrays)


def _with(message: Message, **changes: Any) -> Message:
    """The instruction with ConfigRecord keys set (kebab-case from ``_``)."""
    content = dict(message.content)
    config = dict(content[protocol.CONFIG])
    config.update({k.replace("_", "-"): v for k, v in changes.items()})
    content[protocol.CONFIG] = ConfigRecord(config)
    return Message(
        content=RecordDict(content),
        dst_node_id=message.metadata.dst_node_id,
        message_type=message.metadata.message_type,
        group_id=message.metadata.group_id,
    )


def _ledger_entries(state_dir: Path) -> list[tuple[float, float, int]]:
    return [
        entry
        for path in sorted((state_dir / "dp-ledger").glob("*.json"))
        for entry in PrivacyLedger(state_dir, path.stem).history()
    ]


@pytest.fixture
def dp_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "nodes.toml"
    path.write_text("dp-required = true\n")
    monkeypatch.setenv(NODE_CONFIG_ENV, str(path))
    return path


@pytest.fixture(scope="module")
def offline_assets() -> Iterator[None]:
    from fedlr.data.assets import ensure_assets

    ensure_assets(["polarity", "minilm", "mnist"], quiet=True)
    yield


# --------------------------------------------------------------- the table
def test_the_gate_declares_every_registered_payload_kind():
    kinds = {payload.name for payload in PAYLOADS}
    assert set(METHODS) == kinds  # the test below drives every kind
    for kind in kinds:
        for message_type in (MessageType.TRAIN, MessageType.EVALUATE):
            access = ACCESS[(message_type, kind)]
            assert access.reads and access.releases
    assert not any(t == MessageType.QUERY for t, _ in ACCESS)


# --------------------------------------------------------------- train
@pytest.mark.slow  # one honest round per method of every payload kind (~40 s)
def test_no_payload_kind_trains_without_dp_on_a_dp_required_node(
    tmp_path, offline_assets, dp_required, node_state_dir
):
    trained_without_dp: list[str] = []
    outcomes: dict[str, str] = {}
    for kind, methods in METHODS.items():
        for method in methods:
            node = _node(_config(method, tmp_path / method))
            plain = app(node.train, node.context)
            assert plain.has_error(), method
            assert "dp-max-grad-norm" in plain.error.reason
            assert "dp-required" in plain.error.reason
            before = len(_ledger_entries(node_state_dir))
            reply = app(_with(node.train, **DP), node.context)
            if reply.has_error():  # refused by name: the DP key and the kind
                assert "dp-max-grad-norm" in reply.error.reason, reply.error.reason
                assert f"'{kind}' payload has no DP-SGD" in reply.error.reason
                assert ACCESS[(MessageType.TRAIN, kind)].mechanism != DP_SGD
                assert len(_ledger_entries(node_state_dir)) == before
                outcomes[method] = "refused"
                continue
            metrics = reply.content[protocol.METRICS]
            entries = _ledger_entries(node_state_dir)
            spent = float(metrics["dp-epsilon-spent"])
            if len(entries) <= before or not spent > 0:
                trained_without_dp.append(method)
            assert epsilon(entries[before:], 1e-5, "prv") > 0
            outcomes[method] = f"DP-SGD, epsilon {spent:.3g}"
    assert trained_without_dp == []
    assert outcomes["fedavg-vera"] == outcomes["sorf-vera"] == "refused"
    for method in ("fedavg-lora", "fedavg", "qrmix", "fedavg-continual", "fot"):
        assert outcomes[method].startswith("DP-SGD"), outcomes


@pytest.mark.parametrize(
    ("method", "key", "value"),
    [("qrmix", protocol.QRMIX_STAGE, 2), ("fot", protocol.GPSE_TASK, 0)],
)
def test_a_release_no_mechanism_covers_is_refused_in_a_dp_round(
    tmp_path, offline_assets, dp_required, node_state_dir, method, key, value
):
    node = _node(_config(method, tmp_path))
    reply = app(_with(node.train, **DP, **{key: value}), node.context)
    assert reply.has_error() and f"'{key}'" in reply.error.reason
    assert "no noise" in reply.error.reason
    assert _ledger_entries(node_state_dir) == []


def test_vision_dp_sgd_refuses_batch_norm_by_name(tmp_path, offline_assets):
    from fedlr.errors import PrivacyUnsupportedError
    from fedlr.privacy.dp_sgd import PrivateLoop
    from fedlr.privacy.node_policy import NodePolicy
    from fedlr.privacy.settings import DpSgdSettings
    from fedlr.tasks.image import ImageTask, train_sgd

    config = RunConfig.from_mapping(_vision("fedavg", tmp_path))
    data = ImageTask(config).partition(0, 3)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten()
    )
    model.append(torch.nn.LazyLinear(10))
    model(data.x[:2])  # materialise the lazy layer
    loop = PrivateLoop(
        DpSgdSettings(max_grad_norm=1.0, noise_multiplier=1.0),
        RecordDict(),
        NodePolicy(state_dir=str(tmp_path)),
    )
    with pytest.raises(PrivacyUnsupportedError, match="layer '1' \\(BatchNorm2d\\)"):
        train_sgd(model, data, steps=1, lr=0.1, batch_size=8, seed=0, control=loop)
    assert not (tmp_path / "dp-ledger").exists()  # refused before the ledger


# --------------------------------------------------------------- other types
@pytest.mark.parametrize("message_type", ["query", "train.export", "evaluate.x"])
def test_a_message_type_no_handler_accounts_for_is_refused_by_name(
    tmp_path, offline_assets, message_type
):
    node = _node(_config("fedavg", tmp_path))
    message = Message(
        content=node.train.content,
        dst_node_id=NODE,
        message_type=message_type,
        group_id="1",
    )
    reply = app(message, node.context)
    assert reply.has_error()
    assert f"'message-type' '{message_type}' for a 'qrmix' payload" in (
        reply.error.reason
    )


# --------------------------------------------------------------- evaluate
H = 1e-3
COORDINATES = 20  # 1 base query + 20 perturbed ones: 21 evaluate instructions


def _evaluate(node: Node, state: dict[str, torch.Tensor], n: int) -> Message:
    message = Message(
        content=RecordDict(
            {
                protocol.ARRAYS: state_to_record(state),
                protocol.CONFIG: ConfigRecord({protocol.SERVER_ROUND: 1}),
            }
        ),
        dst_node_id=NODE,
        message_type=MessageType.EVALUATE,
        group_id="1",
    )
    message.metadata.__dict__["_message_id"] = f"oracle-{n}"
    return message


def _oracle_attack(node: Node) -> tuple[torch.Tensor, list[Message]]:
    """21 evaluate queries: the loss at w and at w + h e_j for 20 head weights;
    returns the forward-difference gradient estimate (NaN where refused)."""
    state = {k: v.clone() for k, v in record_to_state(node.arrays).items()}
    head = next(k for k in state if k.endswith("classifier.weight"))
    replies = [app(_evaluate(node, state, 0), node.context)]
    for j in range(COORDINATES):
        moved = dict(state)
        moved[head] = state[head].clone()
        moved[head].view(-1)[j] += H
        replies.append(app(_evaluate(node, moved, j + 1), node.context))
    losses = [
        float("nan") if r.has_error() else float(r.content[protocol.METRICS]["loss"])
        for r in replies
    ]
    estimate = (torch.tensor(losses[1:]) - losses[0]) / H
    return estimate, replies


def _true_gradient(node: Node, config: dict[str, Any]) -> torch.Tensor:
    run = RunConfig.from_mapping(config)
    model = qrmix._model(run)
    model.load_parameters(record_to_state(node.arrays))
    model.eval()
    data = qrmix._partition(run, 0, 3)
    head = model.head_layer().weight
    loss = torch.nn.functional.cross_entropy(model(data.x), data.y)
    (grad,) = torch.autograd.grad(loss, head)
    return grad.reshape(-1)[:COORDINATES]


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def test_evaluate_is_no_oracle_on_a_dp_required_node(
    tmp_path, offline_assets, monkeypatch, node_state_dir
):
    config = _vision("fedavg", tmp_path)
    node = _node(config)
    assert int(node.context.node_config["partition-id"]) == 0
    truth = _true_gradient(node, config)
    # a node without a policy of its own: the finite differences are the gradient
    estimate, _ = _oracle_attack(node)
    assert _correlation(estimate, truth) > 0.99
    # dp-required: all 21 refused by name, nothing charged
    nodes = tmp_path / "nodes.toml"
    nodes.write_text("dp-required = true\n")
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    estimate, replies = _oracle_attack(node)
    assert all(r.has_error() for r in replies) and len(replies) == 21
    assert all("'evaluate'" in r.error.reason for r in replies)
    assert "dp-evaluation-noise-multiplier" in replies[0].error.reason
    assert _ledger_entries(node_state_dir) == []
    # the operator allows a noised evaluation: answered, charged, no oracle
    nodes.write_text("dp-required = true\ndp-evaluation-noise-multiplier = 2.0\n")
    seeded = torch.Generator().manual_seed(0)  # the secure source, made repeatable
    monkeypatch.setattr(
        "fedlr.privacy.dp_evaluation.secure_generator", lambda *_: seeded
    )
    estimate, replies = _oracle_attack(node)
    assert not any(r.has_error() for r in replies)
    entries = _ledger_entries(node_state_dir)
    assert entries == [(2.0, 1.0, 1)] * 21
    assert epsilon(entries, 1e-5, "prv") > 1.0
    assert abs(_correlation(estimate, truth)) < 0.5


def test_a_noised_evaluation_is_refused_past_the_nodes_budget(
    tmp_path, offline_assets, monkeypatch, node_state_dir
):
    nodes = tmp_path / "nodes.toml"
    nodes.write_text(
        "dp-required = true\ndp-epsilon-budget = 3.0\n"
        "dp-evaluation-noise-multiplier = 2.0\n"
    )
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    node = _node(_vision("fedavg", tmp_path))
    _, replies = _oracle_attack(node)
    answered = sum(not r.has_error() for r in replies)
    refused = [r.error.reason for r in replies if r.has_error()]
    # one answer at sigma 2 costs epsilon 2.0 (PRV, delta 1e-5): two fit in 3
    assert answered == 2 and len(refused) == 19
    assert all(
        "dp-epsilon-budget 3 (node config) would be exceeded" in r for r in refused
    )
    entries = _ledger_entries(node_state_dir)
    assert len(entries) == answered and epsilon(entries, 1e-5, "prv") <= 3.0
