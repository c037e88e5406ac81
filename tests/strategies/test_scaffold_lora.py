"""SCAFFOLD-LoRA's lost-reply protocol and its local solver.

docs/methods/scaffold-lora.md: the server remembers, per node, the last round
whose control delta it applied and the factors it applied it with; the next
train instruction tells the node, which commits its pending ``c_i`` or rolls
it back. So ``c = (1/N) sum_i c_i`` over the committed ``c_i`` whatever
replies are lost, dropped, screened or rejected. The local solver is plain
SGD (``local-optimizer = auto``), AdamW an option.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedlr.client.checks import NodeLimits
from fedlr.client.train import TrainSettings, train_steps
from fedlr.client_apps.common import train_settings
from fedlr.config.run import RunConfig
from fedlr.errors import InstructionError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.round.pipeline import run_round
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.scaffold_lora import (
    APPLIED_CLIP,
    APPLIED_ROUND,
    APPLIED_SCALE,
    CONTROL_DELTA,
    ScaffoldLoRA,
    ScaffoldOptions,
    applied_change,
)
from fedlr.wire import protocol
from tests.plugin_app.client_app import app as plugin_client
from tests.plugin_app.task import build_model
from tests.strategies.conftest import instruction, reply
from tests.strategies.test_plugin import _config

F64 = torch.float64


def _settle(node: dict, config) -> None:
    """What a node commits when an instruction with ``config`` arrives:
    its pending change as applied, or nothing (float64)."""
    pending = node.pop("pending", None)
    if pending is None:
        return
    round_, delta, sent = pending
    if int(config[APPLIED_ROUND]) != round_:
        return  # rolled back
    change = applied_change(
        delta, sent, float(config[APPLIED_CLIP]), float(config[APPLIED_SCALE])
    )
    node["c_i"] = {k: node["c_i"][k] + change[k] for k in node["c_i"]}


def test_c_is_the_mean_of_the_committed_c_i_through_lost_dropped_rejected_rounds():
    """Four nodes in float64: a lost reply (round 1), a reply dropped by the
    record screen (round 2), a rejected round (round 3), then a clean one; at
    every instruction ``c`` equals the mean of the nodes' committed ``c_i``
    to 1e-12."""
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model)
    strategy.control = {k: v.double() for k, v in strategy.control.items()}
    current = record_to_state(strategy.initial_arrays(model))
    keys = sorted(strategy.control)
    nodes = {
        1000 + i: {"c_i": {k: torch.zeros_like(strategy.control[k]) for k in keys}}
        for i in range(4)
    }
    g = torch.Generator().manual_seed(7)
    checked = 0
    for server_round in (1, 2, 3, 4, 5):
        strategy.begin_round(
            server_round, ArrayRecord(current), ConfigRecord({}), population=4
        )
        sent = [instruction(n) for n in nodes]
        messages = strategy.instructions(
            server_round, sent, ArrayRecord(current), train=True
        )
        control = {k: v.clone() for k, v in strategy.control.items()}
        for message in messages:
            node = nodes[int(message.metadata.dst_node_id)]
            _settle(node, message.content.config_records[protocol.CONFIG])
        for k in keys:  # c = (1/N) sum_i c_i before every round
            mean = torch.stack([n["c_i"][k] for n in nodes.values()]).mean(0)
            torch.testing.assert_close(control[k], mean, rtol=1e-12, atol=1e-12)
            checked += 1
        replies = []
        for node_id, node in nodes.items():
            # float32-representable values: the server casts replies to the
            # global dtype, exactly here
            delta = {
                k: torch.randn(current[k].shape, generator=g).double() for k in keys
            }
            if server_round == 2 and node_id == 1001:
                delta = {k: 1e6 * v for k, v in delta.items()}  # screened
            node["pending"] = (server_round, delta, control)
            moved = {
                k: v + 0.01 * torch.randn(v.shape, generator=g)
                for k, v in current.items()
            }
            message = reply(node_id, moved, {"num-examples": 3})
            message.content[CONTROL_DELTA] = ArrayRecord(
                {k: v.float() for k, v in delta.items()}
            )
            replies.append(message)
        if server_round == 1:
            replies = replies[1:]  # node 1000's reply is lost
        strategy.max_update_ratio = 1e-30 if server_round == 3 else 0.0
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        if server_round == 2:
            assert metrics["dropped"] == 1
            assert any(
                "node 1001" in r and CONTROL_DELTA in r for r in strategy.round.dropped
            )
        if server_round == 3:  # rejected: the map is round 2's again
            assert arrays is None and metrics["rejected"] == 1.0
            last = {n: a[0] for n, a in strategy.applied.items()}
            assert last == {1000: 2, 1001: 1, 1002: 2, 1003: 2}
        assert all(bool(torch.isfinite(v).all()) for v in strategy.control.values())
    assert checked == 5 * len(keys)
    assert {n: a[0] for n, a in strategy.applied.items()} == dict.fromkeys(nodes, 5)


def test_a_clipped_delta_is_committed_as_the_server_applied_it():
    """Under norm-clip the server applies ``g (f (delta + c) - c)``; the node,
    told ``f`` and ``g``, commits the same change (float32 arithmetic)."""
    model = build_model("scaffold-lora")
    from fedlr.robust.rules import RobustConfig

    strategy = ScaffoldLoRA.for_model(model, robust=RobustConfig(rule="norm-clip"))
    current = record_to_state(strategy.initial_arrays(model))
    keys = sorted(strategy.control)
    g = torch.Generator().manual_seed(3)
    strategy.control = {
        k: 0.1 * torch.randn(v.shape, generator=g) for k, v in strategy.control.items()
    }
    before = {k: v.clone() for k, v in strategy.control.items()}
    strategy.begin_round(1, ArrayRecord(current), ConfigRecord({}), population=3)
    deltas, replies = [], []
    for node, scale in enumerate((0.01, 0.01, 0.1)):
        arrays = {
            k: v + scale * torch.randn(v.shape, generator=g) if k in keys else v
            for k, v in current.items()
        }
        size = 3.0 if node == 0 else 1.0  # node 0's record is clipped
        delta = {k: size * torch.randn(current[k].shape, generator=g) for k in keys}
        deltas.append(delta)
        message = reply(1000 + node, arrays, {"num-examples": 4})
        message.content[CONTROL_DELTA] = ArrayRecord(delta)
        replies.append(message)
    strategy.aggregate_train(1, replies)
    factors = [strategy.applied[1000 + n] for n in range(3)]
    assert factors[2][1] < 1.0 and factors[0][2] < 1.0  # both clips acted
    [config] = [
        m.content.config_records[protocol.CONFIG]
        for m in strategy.instructions(
            2, [instruction(1002)], ArrayRecord(current), train=True
        )
    ]
    assert (
        config[APPLIED_ROUND],
        config[APPLIED_CLIP],
        config[APPLIED_SCALE],
    ) == factors[2]
    committed = [
        applied_change(d, before, f, s)
        for d, (_, f, s) in zip(deltas, factors, strict=True)
    ]
    for k in keys:
        mean = torch.stack([c[k] for c in committed]).mean(0)
        torch.testing.assert_close(
            strategy.control[k].double(),
            before[k].double() + mean,
            rtol=1e-5,
            atol=1e-6,
        )


def test_nodes_commit_or_roll_back_in_process_so_c_is_their_mean():
    """The plug-in app's nodes (float32) through three rounds, node 1's reply
    lost in round 1 and node 2's screened in round 2: after each round, ``c``
    is the mean of the ``c_i`` the nodes commit at the next instruction."""
    config = _config("scaffold-lora", **{"scaffold-lr": 0.1})

    def hook(pid, sent, answer):
        round_ = int(
            sent.content.config_records[protocol.CONFIG][protocol.SERVER_ROUND]
        )
        if round_ == 1 and pid == 1:
            return None  # lost
        if round_ == 2 and pid == 2 and CONTROL_DELTA in answer.content:
            delta = record_to_state(answer.content[CONTROL_DELTA])
            answer.content[CONTROL_DELTA] = ArrayRecord(
                {k: v * 1e4 for k, v in delta.items()}
            )
        return answer

    grid = InProcessGrid(plugin_client, num_nodes=3, run_config=config, reply_hook=hook)
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model, options=ScaffoldOptions(scaffold_lr=0.1))
    arrays = strategy.initial_arrays(model)
    controls = []
    for server_round in (1, 2, 3):
        controls.append({k: v.clone() for k, v in strategy.control.items()})
        arrays = run_round(strategy, grid, server_round, arrays, ConfigRecord({}))
        dropped = strategy.last_report.metrics["dropped"]
        assert dropped == (1 if server_round < 3 else 0)
    assert any(CONTROL_DELTA in r for r in strategy.round.dropped) is False
    # round 3's instruction carried c after round 2; each node committed what
    # the server applied before training round 3
    for k in controls[2]:
        mean = torch.stack(
            [
                record_to_state(ctx.state["fedlr-scaffold"])[f"c_i:{k}"].double()
                for ctx in grid.contexts.values()
            ]
        ).mean(0)
        scale = max(float(controls[2][k].abs().max()), 1e-6)
        torch.testing.assert_close(
            controls[2][k].double(), mean, rtol=1e-5, atol=1e-6 * scale
        )
    assert math.sqrt(sum(float(v.square().sum()) for v in controls[2].values())) > 0


def test_state_dict_round_trips_the_applied_map_and_refuses_a_bad_one():
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model)
    strategy.applied = {1000: (3, 0.5, 1.0), 2**63 + 5: (2, 1.0, 0.25)}
    strategy.control = {k: torch.ones_like(v) for k, v in strategy.control.items()}
    saved = copy.deepcopy(strategy.state_dict())
    other = ScaffoldLoRA.for_model(model)
    other.load_state_dict(saved)
    assert other.applied == strategy.applied
    assert all(torch.equal(other.control[k], v) for k, v in strategy.control.items())
    old = {"control": saved["control"]}  # a checkpoint from before the map
    other.load_state_dict(old)
    assert other.applied == {}
    with pytest.raises(ValueError, match="applied map"):
        other.load_state_dict({**saved, "applied": {1000: (3, 2.0, 1.0)}})
    with pytest.raises(ValueError, match="unknown state keys"):
        other.load_state_dict({**saved, "momentum": {}})


# ------------------------------------------------------------- local solver
def test_scaffold_sends_sgd_at_its_own_lr_and_other_methods_send_nothing_new():
    model = build_model("scaffold-lora")
    scaffold = ScaffoldLoRA.from_run_config(
        RunConfig(lr_decay=0.5),
        strategy_layout(model),
        ScaffoldOptions(scaffold_lr=0.2),
    )
    assert scaffold.local_optimizer == "sgd"
    config = scaffold.round_config(3)
    assert config["local-optimizer"] == "sgd"
    assert config[protocol.LR] == pytest.approx(0.2 * 0.5**2)
    adam = ScaffoldLoRA.from_run_config(
        RunConfig(local_optimizer="adamw"), strategy_layout(model), None
    )
    assert adam.round_config(1)["local-optimizer"] == "adamw"
    assert protocol.LR not in adam.round_config(1)
    plain = FedAvgLoRA.for_model(build_model("fedavg-lora"))
    assert "local-optimizer" not in plain.round_config(1)


def strategy_layout(model):
    from fedlr.adapters import lora_layout

    return lora_layout(model)


class _Data:
    def __init__(self, n: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, indices):
        return {"x": self.x[list(indices)], "labels": self.y[list(indices)]}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = torch.nn.Linear(6, 2)

    def forward(self, x, labels):
        logits = self.layer(x)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        return type("Out", (), {"loss": loss, "logits": logits})()


@pytest.mark.parametrize("solver", ["sgd", "adamw"])
def test_train_steps_takes_the_named_solver_step_for_step(solver):
    settings = TrainSettings(local_steps=4, lr=0.05, batch_size=4, optimizer=solver)
    model, reference = _Model(), _Model()
    train_steps(model, _Data(), settings, seed=3, device=torch.device("cpu"))
    # the same batches (4 of one permutation, then the next), by hand
    make = torch.optim.SGD if solver == "sgd" else torch.optim.AdamW
    optimizer = make(reference.parameters(), lr=0.05, weight_decay=0.0)
    generator = torch.Generator().manual_seed(3)
    first = torch.randperm(12, generator=generator).tolist()
    second = torch.randperm(12, generator=generator).tolist()
    data = _Data()
    for chunk in (first[0:4], first[4:8], first[8:12], second[0:4]):
        optimizer.zero_grad()
        reference(**data.batch(chunk)).loss.backward()
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
        optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_default_solver_is_adamw_and_a_bad_one_is_refused_by_name():
    limits = NodeLimits()
    config = RunConfig()
    assert (
        train_settings(
            ConfigRecord({}), config, default_lr=0.1, limits=limits
        ).optimizer
        == "adamw"
    )
    sgd = train_settings(
        ConfigRecord({"local-optimizer": "sgd"}), config, default_lr=0.1, limits=limits
    )
    assert sgd.optimizer == "sgd"
    for bad in ("adam", 3):
        with pytest.raises(InstructionError, match="local-optimizer"):
            train_settings(
                ConfigRecord({"local-optimizer": bad}),
                config,
                default_lr=0.1,
                limits=limits,
            )
