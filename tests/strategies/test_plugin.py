"""fedlr as a plug-in: someone else's Flower app, and the legacy strategy API."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

from fedlr import FedExLoRA, LegacyStrategy, adapter_state, lora_layout
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.strategies import FedAvgLoRA
from tests.plugin_app.client_app import app as plugin_client
from tests.plugin_app.server_app import main
from tests.plugin_app.task import build_model
from tests.strategies.conftest import reply


def test_foreign_flower_app_runs_fedex_lora_in_process():
    grid = InProcessGrid(plugin_client, num_nodes=3, run_config={})
    context = Context(
        run_id=1,
        node_id=1,
        node_config={},
        state=RecordDict(),
        run_config={"num-server-rounds": 3},
    )
    result = main(grid, context)
    accuracy = {
        r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()
    }
    assert sorted(accuracy) == [0, 1, 2, 3]
    assert accuracy[3] > accuracy[0] + 0.1, accuracy
    final = record_to_state(result.arrays)
    model = build_model()
    layout = lora_layout(model)
    # FedEx sends the folded base weights down with A, B and the head.
    assert set(final) == set(layout.keys(*FedExLoRA.send_roles))
    assert grid.messages_sent == 9


def _client_states(layout, seed):
    g = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(3):
        state = {}
        for key, shape in layout.shapes(*FedExLoRA.train_roles).items():
            state[key] = torch.randn(*shape, generator=g)
        states.append(state)
    return states


class _Proxy:
    def __init__(self, cid):
        self.cid = str(cid)


@pytest.mark.parametrize("strategy_cls", [FedExLoRA, FedAvgLoRA])
def test_legacy_aggregate_fit_equals_the_message_api(strategy_cls):
    model = build_model()
    layout = lora_layout(model)
    initial = adapter_state(model, layout, strategy_cls.send_roles)
    states = _client_states(layout, seed=3)
    sizes = [10, 30, 60]

    modern = strategy_cls(layout=layout)
    modern.prepare_round(1, ArrayRecord(initial), ConfigRecord({}))
    expected, metrics = modern.aggregate_train(
        1,
        [
            reply(1 + i, state, {"num-examples": n})
            for i, (state, n) in enumerate(zip(states, sizes, strict=True))
        ],
    )

    legacy = LegacyStrategy(strategy_cls(layout=layout), initial_arrays=initial)
    params = legacy.initialize_parameters(client_manager=None)
    initial_order = list(legacy.send_keys)
    assert initial_order == list(initial)
    keys = legacy.reply_keys
    results = [
        (
            _Proxy(1 + i),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters([state[k].numpy() for k in keys]),
                n,
                {},
            ),
        )
        for i, (state, n) in enumerate(zip(states, sizes, strict=True))
    ]
    legacy.strategy.prepare_round(1, ArrayRecord(initial), ConfigRecord({}))
    got, legacy_metrics = legacy.aggregate_fit(1, results, [])
    got_arrays = parameters_to_ndarrays(got)
    want = record_to_state(expected)
    assert legacy.send_keys == list(want)
    for key, array in zip(legacy.send_keys, got_arrays, strict=True):
        np.testing.assert_array_equal(array, want[key].numpy())
    assert legacy_metrics["num-examples"] == 100
    assert legacy_metrics["frobenius-gap"] == pytest.approx(metrics["frobenius-gap"])
    for key, array in zip(initial_order, parameters_to_ndarrays(params), strict=True):
        np.testing.assert_array_equal(array, initial[key].numpy())


def test_legacy_drops_bad_fitres_and_failures_with_reasons(caplog):
    model = build_model()
    layout = lora_layout(model)
    initial = adapter_state(model, layout, FedAvgLoRA.send_roles)
    legacy = LegacyStrategy(FedAvgLoRA(layout=layout), initial_arrays=initial)
    legacy.strategy.prepare_round(1, ArrayRecord(initial), ConfigRecord({}))
    (good,) = _client_states(layout, 5)[:1]
    keys = legacy.reply_keys
    results = [
        (
            _Proxy(1),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters([good[k].numpy() for k in keys]),
                8,
                {},
            ),
        ),
        (
            _Proxy(2),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters([good[k].numpy() for k in keys[:-1]]),
                8,
                {},
            ),
        ),
    ]
    failures = [RuntimeError("connection lost")]
    with caplog.at_level("WARNING"):
        params, metrics = legacy.aggregate_fit(1, results, failures)
    assert metrics["clients"] == 1 and metrics["dropped"] == 2
    assert any(f"expected {len(keys)}" in m for m in caplog.messages)
    assert any("connection lost" in m for m in caplog.messages)
    got = dict(zip(legacy.send_keys, parameters_to_ndarrays(params), strict=True))
    for key in keys:
        np.testing.assert_array_equal(got[key], good[key].numpy())
