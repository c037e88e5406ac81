"""fedlr strategies under Flower's own ``strategy.start()`` keep Flower's conventions.

A user plugs a fedlr strategy into their own ServerApp and drives it with the
unmodified ``Strategy.start``; fedlr's own app drives the same hooks through
``run_round``. Each test names the convention it pins down.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common import Code, EvaluateRes, Status
from flwr.serverapp.strategy import FedAvg
from peft import LoraConfig, get_peft_model

from fedlr import LegacyStrategy, adapter_state, lora_layout
from fedlr.config.run import RunConfig
from fedlr.errors import InitialArraysError
from fedlr.flower import InProcessGrid
from fedlr.round.instructions import check_arrays, expected_arrays
from fedlr.round.pipeline import run_round
from fedlr.strategies import FedAvgLoRA, FedSALoRA, FedSVD
from fedlr.strategies.qrmix import VisionFedAvg
from fedlr.wire.protocol import (
    ARRAYS,
    CONFIG,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    TRAIN_LOSS,
    TRAIN_ROLES,
    decode_roles,
)
from tests.conftest import tiny_run_config
from tests.strategies.conftest import reply


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _model():
    torch.manual_seed(0)
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules=["fc1", "fc2"], modules_to_save=["head"]
    )
    return get_peft_model(_MLP(), config)


MODEL = _model()
LAYOUT = lora_layout(MODEL)
SIZES = [10, 30, 60]  # num-examples of partitions 0, 1, 2
ACCURACY = [0.5, 0.6, 0.9]  # each partition's own metric


def _weighted(values):
    return sum(v * n for v, n in zip(values, SIZES, strict=True)) / sum(SIZES)


def _initial(strategy) -> ArrayRecord:
    return ArrayRecord(adapter_state(MODEL, LAYOUT, strategy.send_roles))


def _trained(config: ConfigRecord, arrays: ArrayRecord, pid: int):
    """What a client sends back: the train-roles arrays, shifted by its id."""
    roles = decode_roles(config)
    sent = arrays.to_torch_state_dict()
    start = adapter_state(MODEL, LAYOUT, roles)
    return {k: sent.get(k, v) + 0.01 * (pid + 1) for k, v in start.items()}


def _client_app(train_metrics=None) -> ClientApp:
    """A user's ClientApp: Flower's ``train_loss`` spelling and metrics of its own."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        pid = int(context.node_config[PARTITION_ID])
        config = message.content[CONFIG]
        metrics = {
            NUM_EXAMPLES: SIZES[pid],
            "train_loss": float(pid + 1),
            "accuracy": ACCURACY[pid],
            **(train_metrics or {}),
        }
        content = RecordDict(
            {
                ARRAYS: ArrayRecord(_trained(config, message.content[ARRAYS], pid)),
                METRICS: MetricRecord(metrics),
            }
        )
        return Message(content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        pid = int(context.node_config[PARTITION_ID])
        assert message.content[CONFIG][TRAIN_ROLES]  # the round's roles travel too
        metrics = {NUM_EXAMPLES: SIZES[pid], "accuracy": ACCURACY[pid]}
        content = RecordDict({METRICS: MetricRecord(metrics)})  # no arrays
        return Message(content, reply_to=message)

    return app


def _start(strategy, app=None, num_rounds=2, **grid_kwargs):
    grid = InProcessGrid(
        app or _client_app(), num_nodes=3, run_config={}, **grid_kwargs
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=_initial(strategy),
        num_rounds=num_rounds,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    return result, grid


# ------------------------------------------------------ 1. the user's metrics
@pytest.mark.parametrize("cls", [FedAvgLoRA, FedSVD])
def test_user_metrics_are_weighted_averages_beside_fedlrs(cls):
    result, _ = _start(cls(layout=LAYOUT))
    for server_round in (1, 2):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["accuracy"] == pytest.approx(_weighted(ACCURACY))
        assert metrics["clients"] == 3 and metrics["dropped"] == 0
        assert metrics["num-examples"] == sum(SIZES)
        assert metrics["bytes-up"] > 0 and metrics["bytes-down"] > 0
        assert math.isfinite(metrics["frobenius-gap"])
        assert metrics["rank"] == 2


def test_train_and_evaluate_metrics_aggr_fn_are_called():
    calls = {"train": [], "evaluate": []}

    def aggregate(kind):
        def fn(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
            calls[kind].append((len(records), weighted_by_key))
            best = max(float(r[METRICS]["accuracy"]) for r in records)
            return MetricRecord({f"{kind}-best-accuracy": best})

        return fn

    strategy = FedAvgLoRA(
        layout=LAYOUT,
        train_metrics_aggr_fn=aggregate("train"),
        evaluate_metrics_aggr_fn=aggregate("evaluate"),
    )
    result, _ = _start(strategy)
    assert calls == {
        "train": [(3, "num-examples")] * 2,
        "evaluate": [(3, "num-examples")] * 2,
    }
    train = result.train_metrics_clientapp[2]
    assert train["train-best-accuracy"] == max(ACCURACY)
    assert "accuracy" not in train  # the user's fn replaces Flower's default
    assert train["clients"] == 3 and "frobenius-gap" in train
    evaluate = result.evaluate_metrics_clientapp[2]
    assert dict(evaluate) == {"evaluate-best-accuracy": max(ACCURACY)}


def test_fedlr_keys_win_a_clash_with_one_warning(caplog):
    app = _client_app(train_metrics={"clients": 99.0, "rank": 7.0})
    with caplog.at_level(logging.WARNING):
        result, _ = _start(FedAvgLoRA(layout=LAYOUT), app=app, num_rounds=3)
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["clients"] == 3 and metrics["rank"] == 2
    clashes = [m for m in caplog.messages if "clash with fedlr's own" in m]
    assert len(clashes) == 1
    assert "['clients', 'rank']" in clashes[0]


# -------------------------------------------------------- 2. train_loss
def test_flower_train_loss_spelling_is_accepted():
    result, _ = _start(FedAvgLoRA(layout=LAYOUT))
    metrics = result.train_metrics_clientapp[1]
    assert metrics[TRAIN_LOSS] == pytest.approx(_weighted([1.0, 2.0, 3.0]))
    assert metrics["train_loss"] == pytest.approx(metrics[TRAIN_LOSS])


def test_train_loss_is_the_mean_over_the_clients_that_report_one():
    strategy = FedAvgLoRA(layout=LAYOUT)
    strategy.begin_round(1, _initial(strategy), ConfigRecord())
    arrays = adapter_state(MODEL, LAYOUT, strategy.train_roles)
    _, metrics = strategy.aggregate_train(
        1,
        [
            reply(1, arrays, {NUM_EXAMPLES: 1, "train_loss": 2.0}),
            reply(2, arrays, {NUM_EXAMPLES: 3, TRAIN_LOSS: 6.0}),
            reply(3, arrays, {NUM_EXAMPLES: 4}),
        ],
    )
    assert metrics[TRAIN_LOSS] == pytest.approx((2.0 + 18.0) / 4)


# ----------------------------------------- 3. defaults and federated evaluation
def test_flower_defaults_hold_for_a_plugin_strategy():
    flower = FedAvg()
    for strategy in (FedAvgLoRA(layout=LAYOUT), FedSALoRA(layout=LAYOUT)):
        assert strategy.fraction_evaluate == flower.fraction_evaluate == 1.0
        assert strategy.min_train_nodes == flower.min_train_nodes
        assert strategy.min_evaluate_nodes == flower.min_evaluate_nodes
        assert strategy.min_available_nodes == flower.min_available_nodes


def test_fedlr_app_options_set_its_own_choices(tmp_path):
    config = RunConfig.from_mapping(tiny_run_config(tmp_path))
    server_evaluated = FedAvgLoRA.from_run_config(config, LAYOUT)
    assert server_evaluated.fraction_evaluate == 0.0
    assert server_evaluated.min_train_nodes == 1
    assert server_evaluated.min_available_nodes == 1
    personal = FedSALoRA.from_run_config(config, LAYOUT)
    assert personal.fraction_evaluate == 1.0  # clients evaluate their own model
    assert personal.min_evaluate_nodes == 1


@pytest.mark.parametrize("cls", [FedAvgLoRA, FedSVD])
def test_federated_evaluation_of_metric_only_replies_under_start(cls):
    result, grid = _start(cls(layout=LAYOUT))
    assert grid.messages_sent == 2 * (3 + 3)
    for server_round in (1, 2):
        metrics = result.evaluate_metrics_clientapp[server_round]
        assert metrics["accuracy"] == pytest.approx(_weighted(ACCURACY))


def test_bad_evaluate_replies_are_dropped_not_fatal(caplog):
    def corrupt(partition, message, answer):
        if message.metadata.message_type != "evaluate":
            return answer
        if partition == 0:
            return Message(Error(code=0, reason="eval crashed"), reply_to=message)
        if partition == 1:  # a different key set would make FedAvg raise
            content = RecordDict({METRICS: MetricRecord({"accuracy": 0.0})})
            return Message(content, reply_to=message)
        return answer

    with caplog.at_level(logging.WARNING):
        result, _ = _start(FedAvgLoRA(layout=LAYOUT), reply_hook=corrupt)
    assert dict(result.evaluate_metrics_clientapp[1]) == {"accuracy": ACCURACY[2]}
    assert any("eval crashed" in m for m in caplog.messages)
    assert any("missing 'num-examples'" in m for m in caplog.messages)


# ---------------------------------------------------- 4. lost, duplicate, stray
def test_a_lost_reply_is_dropped_under_start():
    def lose(partition, message, answer):
        return (
            None
            if partition == 1 and message.metadata.message_type == "train"
            else answer
        )

    strategy = FedAvgLoRA(layout=LAYOUT)
    result, _ = _start(strategy, reply_hook=lose)
    for server_round in (1, 2):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["dropped"] == 1 and metrics["clients"] == 2
    assert strategy.round.dropped == ["node 1001: no reply (timed out or lost)"]


def test_duplicate_and_uninstructed_replies_are_dropped_with_reasons():
    strategy = FedAvgLoRA(layout=LAYOUT)
    grid = InProcessGrid(ClientApp(), num_nodes=3, run_config={})
    sent = list(strategy.configure_train(1, _initial(strategy), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in sent) == [1000, 1001, 1002]
    first = adapter_state(MODEL, LAYOUT, strategy.train_roles)
    second = {k: v + 1.0 for k, v in first.items()}
    _, metrics = strategy.aggregate_train(
        1,
        [
            reply(1000, first, {NUM_EXAMPLES: 5}),
            reply(1000, second, {NUM_EXAMPLES: 5}),
            reply(1001, first, {NUM_EXAMPLES: 5}),
            reply(7, second, {NUM_EXAMPLES: 5}),
        ],
    )
    assert metrics["clients"] == 2 and metrics["dropped"] == 3
    assert strategy.round.dropped == [
        "reply from node 1000 rejected: duplicate reply (the node's first reply "
        "is kept)",
        "reply from node 7 rejected: the node was not sent an instruction this round",
        "node 1002: no reply (timed out or lost)",
    ]
    assert metrics["frobenius-gap"] == pytest.approx(0.0, abs=1e-6)  # two `first`


def test_run_round_counts_lost_replies_through_aggregate_train():
    def lose(partition, message, answer):
        return None if partition == 2 else answer

    strategy = FedAvgLoRA(layout=LAYOUT)
    grid = InProcessGrid(_client_app(), num_nodes=3, run_config={}, reply_hook=lose)
    run_round(strategy, grid, 1, _initial(strategy), ConfigRecord(), timeout=5.0)
    assert strategy.last_report.metrics["dropped"] == 1
    assert strategy.round.dropped == ["node 1002: no reply (timed out or lost)"]
    assert not hasattr(strategy, "_missing")


# ------------------------------------------------------------ 5. initial arrays
def test_a_whole_state_dict_fails_before_round_one():
    strategy = FedAvgLoRA(layout=LAYOUT)
    grid = InProcessGrid(_client_app(), num_nodes=3, run_config={})
    with pytest.raises(InitialArraysError) as info:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(MODEL.state_dict()))
    assert grid.messages_sent == 0  # no client trained
    message = str(info.value)
    assert "initial arrays do not match FedAvgLoRA" in message
    assert "unexpected" in message and "missing" in message
    assert "strategy.send_roles" in message and "lora_A,lora_B,head" in message
    assert set(info.value.missing) == set(LAYOUT.keys(*FedAvgLoRA.send_roles))


def test_wrong_shapes_and_missing_keys_are_named():
    strategy = FedSVD(layout=LAYOUT)
    arrays = adapter_state(MODEL, LAYOUT, strategy.send_roles)
    a_key = LAYOUT.modules[0].a_key
    arrays[a_key] = torch.zeros(3, 6)
    del arrays[LAYOUT.modules[1].b_key]
    with pytest.raises(InitialArraysError, match=r"1 missing") as info:
        check_arrays(strategy, ArrayRecord(arrays))
    assert info.value.shapes == {a_key: ((3, 6), (2, 6))}
    assert info.value.unexpected == []


def test_strategies_without_a_fixed_send_set_are_not_checked():
    shapes = {"fc.weight": (2, 4), "fc.bias": (2,)}
    strategy = VisionFedAvg(shapes=shapes, head="fc")
    assert expected_arrays(strategy) is None
    grid = InProcessGrid(ClientApp(), num_nodes=2, run_config={})
    odd = ArrayRecord({"anything": torch.zeros(3)})
    assert len(list(strategy.configure_train(1, odd, ConfigRecord(), grid))) == 2


def test_legacy_adapter_checks_its_initial_arrays():
    with pytest.raises(InitialArraysError):
        LegacyStrategy(FedAvgLoRA(layout=LAYOUT), initial_arrays=MODEL.state_dict())


# ----------------------------------------------------- 6. wrong-keys reason
def test_wrong_keys_reason_names_train_roles():
    strategy = FedSVD(layout=LAYOUT)  # clients train B and the head only
    strategy.begin_round(1, _initial(strategy), ConfigRecord())
    good = adapter_state(MODEL, LAYOUT, strategy.train_roles)
    everything = adapter_state(MODEL, LAYOUT, FedAvgLoRA.train_roles)
    _, metrics = strategy.aggregate_train(
        1,
        [reply(1, good, {NUM_EXAMPLES: 2}), reply(2, everything, {NUM_EXAMPLES: 2})],
    )
    assert metrics["dropped"] == 1
    (reason,) = strategy.round.dropped
    assert reason.startswith("reply from node 2 rejected: 'arrays' has wrong keys")
    assert "2 unexpected" in reason
    assert "the client must send exactly the arrays of train-roles=lora_B,head" in (
        reason
    )


# ------------------------------------------------------------------ 7. summary
def test_summary_lists_every_fedlr_option(caplog):
    class Tuned(FedAvgLoRA):
        def __init__(self, *, layout, boost: float = 1.5, **kwargs) -> None:
            super().__init__(layout=layout, **kwargs)
            self.boost = boost
            self.extra_settings = {"boost": boost}

    with caplog.at_level(logging.INFO):
        Tuned(layout=LAYOUT, min_replies=2, lr_decay=0.9).summary()
    text = "\n".join(caplog.messages)
    assert "fedlr options (Tuned)" in text
    for line in ("min_replies: 2", "lr_decay: 0.9", "boost: 1.5"):
        assert line in text, text
    assert "Fraction: train (1.00) | evaluate ( 1.00)" in text  # FedAvg's part


# ------------------------------------------------ legacy API, same conventions
class _Proxy:
    def __init__(self, cid: int) -> None:
        self.cid = str(cid)


class _Clients:
    def __init__(self, n: int) -> None:
        self.proxies = [_Proxy(i) for i in range(n)]

    def num_available(self) -> int:
        return len(self.proxies)

    def sample(self, num_clients: int, min_num_clients: int):
        return self.proxies[:num_clients]


def test_legacy_evaluation_follows_fraction_evaluate():
    def best(records: list[RecordDict], key: str) -> MetricRecord:
        return MetricRecord(
            {"best": max(float(r[METRICS]["accuracy"]) for r in records)}
        )

    strategy = FedAvgLoRA(layout=LAYOUT, evaluate_metrics_aggr_fn=best)
    legacy = LegacyStrategy(
        strategy, initial_arrays=_initial(strategy).to_torch_state_dict()
    )
    params = legacy.initialize_parameters(client_manager=None)
    instructions = legacy.configure_evaluate(1, params, _Clients(3))
    assert len(instructions) == 3
    assert instructions[0][1].config["train-roles"] == "lora_A,lora_B,head"
    results = [
        (proxy, EvaluateRes(Status(Code.OK, ""), 1.0 + i, n, {"accuracy": acc}))
        for i, (proxy, n, acc) in enumerate(
            zip(_Clients(3).proxies, SIZES, ACCURACY, strict=True)
        )
    ]
    loss, metrics = legacy.aggregate_evaluate(1, results, [])
    assert loss == pytest.approx(_weighted([1.0, 2.0, 3.0]))
    assert metrics == {"best": max(ACCURACY)}
    off = LegacyStrategy(
        FedAvgLoRA(layout=LAYOUT, fraction_evaluate=0.0),
        initial_arrays=_initial(strategy).to_torch_state_dict(),
    )
    assert off.configure_evaluate(1, params, _Clients(3)) == []
