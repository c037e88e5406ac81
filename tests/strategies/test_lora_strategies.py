"""LoRA strategies on mocked replies: aggregation, gap, validation."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.clientapp import ClientApp

from fedlr.adapters import AdapterLayout, LoraModule, Role
from fedlr.errors import NoValidRepliesError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.round.pipeline import run_round
from fedlr.strategies import FedAvgLoRA, FedExLoRA, available_methods, get_method
from tests.strategies.conftest import reply

LAYOUT = AdapterLayout(
    modules=(
        LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=6, d_in=5, rank=2),
        LoraModule("l1", "l1.A", "l1.B", "l1.W", 0.5, d_out=4, d_in=7, rank=2),
    ),
    head_shapes={"head.w": (2, 5), "head.b": (2,)},
)


def _global(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(*shape, generator=g) for k, shape in LAYOUT.shapes(*Role).items()
    }


def _client(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {
        k: torch.randn(*shape, generator=g)
        for k, shape in LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD).items()
    }


def _configured(
    strategy: FedAvgLoRA, state: dict[str, torch.Tensor], num_nodes: int = 3
) -> None:
    grid = InProcessGrid(ClientApp(), num_nodes=num_nodes, run_config={})
    keys = strategy.send_keys()
    messages = list(
        strategy.configure_train(
            1, ArrayRecord({k: state[k] for k in keys}), ConfigRecord(), grid
        )
    )
    assert len(messages) == num_nodes
    assert messages[0].content["config"]["train-roles"] == "lora_A,lora_B,head"


def test_registry_lists_both_methods():
    assert {"fedavg-lora", "fedex-lora"} <= set(available_methods())
    assert get_method("fedex-lora").strategy is FedExLoRA
    assert get_method("fedavg-lora").payload.name == "lora"


def test_fedavg_lora_weighted_means_and_positive_gap():
    strategy = FedAvgLoRA(layout=LAYOUT)
    state = _global()
    _configured(strategy, state)
    clients = [_client(i) for i in range(3)]
    weights = [10, 30, 60]
    replies = [
        reply(1000 + i, c, {"num-examples": n, "train-loss": float(i)})
        for i, (c, n) in enumerate(zip(clients, weights, strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None
    new = record_to_state(arrays)
    for key in LAYOUT.keys(Role.LORA_A, Role.LORA_B, Role.HEAD):
        expected = sum(
            w * c[key].double() for w, c in zip([0.1, 0.3, 0.6], clients, strict=True)
        )
        torch.testing.assert_close(new[key].double(), expected, rtol=1e-6, atol=1e-6)
    # Dense reference of the gap, per layer and total.
    total_sq = 0.0
    for module in LAYOUT.modules:
        ideal = sum(
            w * c[module.b_key].double() @ c[module.a_key].double()
            for w, c in zip([0.1, 0.3, 0.6], clients, strict=True)
        )
        gap = torch.linalg.matrix_norm(
            ideal - new[module.b_key].double() @ new[module.a_key].double()
        )
        total_sq += float(gap) ** 2
        got = strategy.last_report.layers[module.name][0]
        assert got == pytest.approx(float(gap), rel=1e-5)
    assert metrics["frobenius-gap"] == pytest.approx(math.sqrt(total_sq), rel=1e-5)
    assert metrics["frobenius-gap"] > 0.1
    assert 0 < metrics["relative-gap"] < 10
    assert metrics["train-loss"] == pytest.approx(0.3 * 1 + 0.6 * 2)
    assert metrics["clients"] == 3 and metrics["dropped"] == 0
    assert metrics["rank"] == 2
    assert metrics["bytes-up"] > 0 and metrics["bytes-down"] > 0
    # FedAvg leaves base weights alone (they are not even sent).
    assert not set(LAYOUT.keys(Role.BASE)) & set(new)


def test_fedavg_gap_is_zero_when_clients_agree():
    strategy = FedAvgLoRA(layout=LAYOUT)
    _configured(strategy, _global())
    same = _client(0)
    replies = [reply(1000 + i, same, {"num-examples": 5 + i}) for i in range(3)]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None
    assert metrics["frobenius-gap"] < 1e-6
    assert metrics["relative-gap"] < 1e-6


def test_fedex_folds_exact_residual():
    strategy = FedExLoRA(layout=LAYOUT)
    state = _global()
    _configured(strategy, state, num_nodes=4)
    clients = [_client(i) for i in range(4)]
    weights = [1, 2, 3, 4]
    replies = [
        reply(1000 + i, c, {"num-examples": n})
        for i, (c, n) in enumerate(zip(clients, weights, strict=True))
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    new = record_to_state(arrays)
    w = torch.tensor(weights, dtype=torch.float64) / 10
    for m in LAYOUT.modules:
        lhs = new[m.base_key].double() + m.scaling * (
            new[m.b_key].double() @ new[m.a_key].double()
        )
        ideal = sum(
            wi * c[m.b_key].double() @ c[m.a_key].double()
            for wi, c in zip(w, clients, strict=True)
        )
        rhs = state[m.base_key].double() + m.scaling * ideal
        rel = torch.linalg.matrix_norm(lhs - rhs) / torch.linalg.matrix_norm(rhs)
        assert rel < 1e-6


@pytest.mark.parametrize("downlink", ["factored", "dense"])
@pytest.mark.parametrize("scale", [0.0, 0.25, 0.5, 1.0])
def test_fedex_fold_scale_folds_that_share_of_the_residual(scale, downlink):
    """W0' = W0 + c s (sum_i w_i B_i A_i - B_bar A_bar); factors as FedAvg's."""
    strategy = FedExLoRA(layout=LAYOUT, fedex_fold_scale=scale, fedex_downlink=downlink)
    state = _global()
    _configured(strategy, state, num_nodes=3)
    clients = [_client(i) for i in range(3)]
    replies = [
        reply(1000 + i, c, {"num-examples": n})
        for i, (c, n) in enumerate(zip(clients, [1, 3, 6], strict=True))
    ]
    new = record_to_state(strategy.aggregate_train(1, replies)[0])
    w = [0.1, 0.3, 0.6]
    for key in LAYOUT.keys(Role.LORA_A, Role.LORA_B, Role.HEAD):
        mean = sum(wi * c[key].double() for wi, c in zip(w, clients, strict=True))
        torch.testing.assert_close(new[key].double(), mean, rtol=1e-6, atol=1e-6)
    for m in LAYOUT.modules:
        b_bar = sum(wi * c[m.b_key].double() for wi, c in zip(w, clients, strict=True))
        a_bar = sum(wi * c[m.a_key].double() for wi, c in zip(w, clients, strict=True))
        ideal = sum(
            wi * c[m.b_key].double() @ c[m.a_key].double()
            for wi, c in zip(w, clients, strict=True)
        )
        want = state[m.base_key].double() + scale * m.scaling * (ideal - b_bar @ a_bar)
        torch.testing.assert_close(new[m.base_key].double(), want, rtol=1e-5, atol=1e-5)
        if scale == 0.0:  # FedIT's model: the base weights are not touched
            assert torch.equal(new[m.base_key], state[m.base_key])


def test_fedex_fold_scale_is_refused_out_of_range_and_with_client_ranks():
    from fedlr.errors import ConfigError
    from fedlr.strategies.registry import resolve

    with pytest.raises(ConfigError, match="fedex-fold-scale"):
        resolve({"method": "fedex-lora", "fedex-fold-scale": -0.1})
    with pytest.raises(ConfigError, match=r"fedex-fold-scale.*client-ranks"):
        spec = resolve(
            {"method": "fedex-lora", "fedex-fold-scale": 0.5, "client-ranks": "1,2"}
        )
        spec.spec.strategy_for((1, 2))(
            layout=LAYOUT, options=spec.options, client_ranks=(1, 2)
        )


BAD_CASES = {
    "wrong keys": lambda c: (
        {**{k: v for k, v in c.items() if k != "l0.A"}, "x": torch.zeros(2)},
        {"num-examples": 3},
        "wrong keys",
    ),
    "wrong shape": lambda c: (
        {**c, "l1.B": torch.zeros(4, 3)},
        {"num-examples": 3},
        r"'l1.B' has shape \(4, 3\), expected \(4, 2\)",
    ),
    "nan": lambda c: (
        {**c, "head.b": torch.tensor([0.0, math.nan])},
        {"num-examples": 3},
        "NaN or Inf",
    ),
    "inf": lambda c: (
        {**c, "l0.B": torch.full((6, 2), math.inf)},
        {"num-examples": 3},
        "NaN or Inf",
    ),
    "int dtype": lambda c: (
        {**c, "head.b": torch.zeros(2, dtype=torch.int64)},
        {"num-examples": 3},
        "dtype .int64., expected one of",
    ),
    "no num-examples": lambda c: (c, {"train-loss": 1.0}, "missing 'num-examples'"),
    "zero num-examples": lambda c: (c, {"num-examples": 0}, "positive integer"),
    "fractional num-examples": lambda c: (
        c,
        {"num-examples": 0.5},
        "must be a positive integer, got 0.5",
    ),
    "no metrics": lambda c: (c, None, "expected one MetricRecord, got 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("cls", [FedAvgLoRA, FedExLoRA])
def test_bad_reply_is_dropped_with_reason_and_round_goes_on(case, cls, caplog):
    strategy = cls(layout=LAYOUT)
    _configured(strategy, _global())
    good = [_client(i) for i in range(2)]
    arrays, metrics, reason = BAD_CASES[case](_client(9))
    replies = [reply(1000, good[0], {"num-examples": 4}), reply(1001, arrays, metrics)]
    replies.append(reply(1002, good[1], {"num-examples": 4}))
    with caplog.at_level(logging.WARNING):
        new, agg_metrics = strategy.aggregate_train(1, replies)
    assert agg_metrics is not None and agg_metrics["dropped"] == 1
    assert agg_metrics["clients"] == 2
    assert len(strategy.round.dropped) == 1
    import re

    assert re.search(reason, strategy.round.dropped[0]), strategy.round.dropped
    assert "node 1001" in strategy.round.dropped[0]
    assert any("node 1001" in r.getMessage() for r in caplog.records)
    # The aggregate is the mean of the two good clients only.
    state = record_to_state(new)
    expected = 0.5 * (good[0]["l0.A"] + good[1]["l0.A"])
    torch.testing.assert_close(state["l0.A"], expected)


def test_error_reply_is_dropped():
    from flwr.app import Error, Message

    from tests.strategies.conftest import instruction

    strategy = FedAvgLoRA(layout=LAYOUT)
    _configured(strategy, _global())
    failed = Message(
        Error(code=0, reason="ClientApp crashed"), reply_to=instruction(1001)
    )
    _, metrics = strategy.aggregate_train(
        1,
        [
            failed,
            reply(1000, _client(0), {"num-examples": 2}),
            reply(1002, _client(2), {"num-examples": 2}),
        ],
    )
    assert metrics["dropped"] == 1 and metrics["clients"] == 2
    assert "node 1001" in strategy.round.dropped[0]
    assert "ClientApp crashed" in strategy.round.dropped[0]


def test_a_node_that_never_replies_is_dropped_as_missing():
    from flwr.app import Message, MetricRecord, RecordDict

    def client(message, context):  # every node replies with its own arrays
        pid = int(context.node_config["partition-id"])
        content = RecordDict(
            {
                "arrays": ArrayRecord(_client(pid)),
                "metrics": MetricRecord({"num-examples": 2}),
            }
        )
        return Message(content, reply_to=message)

    def lose(partition, message, reply):  # partitions 1 and 2 time out
        return None if partition in (1, 2) else reply

    grid = InProcessGrid(client, num_nodes=3, run_config={}, reply_hook=lose)
    strategy = FedAvgLoRA(layout=LAYOUT)
    keys = strategy.send_keys()
    initial = ArrayRecord({k: _global()[k] for k in keys})
    state = run_round(strategy, grid, 1, initial, ConfigRecord(), timeout=5.0)
    metrics = strategy.last_report.metrics
    assert metrics["dropped"] == 2 and metrics["clients"] == 1
    assert strategy.round.dropped == [
        "node 1001: no reply (timed out or lost)",
        "node 1002: no reply (timed out or lost)",
    ]
    assert torch.equal(record_to_state(state)["l0.A"], _client(0)["l0.A"])


def test_all_bad_round_raises_named_error():
    strategy = FedExLoRA(layout=LAYOUT)
    _configured(strategy, _global())
    bad = {**_client(0), "l0.A": torch.full((2, 5), math.nan)}
    replies = [reply(1000 + i, bad, {"num-examples": 3}) for i in range(3)]
    with pytest.raises(
        NoValidRepliesError, match="round 1: 0 valid replies, 1 required"
    ):
        strategy.aggregate_train(1, replies)


def test_min_replies_is_enforced():
    strategy = FedAvgLoRA(layout=LAYOUT, min_replies=3)
    _configured(strategy, _global())
    replies = [reply(1000 + i, _client(i), {"num-examples": 3}) for i in range(2)]
    with pytest.raises(NoValidRepliesError, match="2 valid replies, 3 required"):
        strategy.aggregate_train(1, replies)


def test_aggregate_before_configure_is_a_clear_error():
    strategy = FedAvgLoRA(layout=LAYOUT)
    with pytest.raises(RuntimeError, match="before configure_train"):
        strategy.aggregate_train(1, [])


def test_layout_round_trips_through_dict():
    assert AdapterLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    with pytest.raises(ValueError, match="declared twice"):
        AdapterLayout(modules=(LAYOUT.modules[0], LAYOUT.modules[0]))


def test_metric_record_types():
    strategy = FedAvgLoRA(layout=LAYOUT)
    _configured(strategy, _global())
    _, metrics = strategy.aggregate_train(
        1, [reply(1000, _client(0), {"num-examples": 2})]
    )
    assert isinstance(metrics, MetricRecord)
    assert all(isinstance(v, float) for v in metrics.values())
