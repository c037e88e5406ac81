"""FedProx-LoRA: FedAvg on the server, the proximal term on the clients."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedlr.errors import ConfigError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.launch.client_app import app as client_app
from fedlr.server_apps.builtin_plans import build_plan
from fedlr.strategies import FedAvgLoRA
from fedlr.strategies.fedprox_lora import (
    PROXIMAL_MU,
    FedProxLoRA,
    ProximalOptions,
    ProximalTerm,
)
from fedlr.strategies.registry import get_method, resolve
from fedlr.wire import protocol
from tests.conftest import tiny_run_config
from tests.strategies.conftest import reply
from tests.strategies.test_lora_strategies import LAYOUT, _client, _global


def test_registered_with_its_option_and_the_lora_payload():
    spec = get_method("fedprox-lora")
    assert spec.strategy is FedProxLoRA and spec.payload.name == "lora"
    assert spec.options is ProximalOptions
    options = resolve({"method": "fedprox-lora", "proximal-mu": 0.5}).options
    assert options == ProximalOptions(proximal_mu=0.5)
    with pytest.raises(ConfigError, match="proximal-mu") as info:
        resolve({"method": "fedprox-lora", "proximal-mu": -1.0})
    assert info.value.key == "proximal-mu"


def test_round_config_carries_mu_and_aggregation_is_fedavg():
    prox = FedProxLoRA(layout=LAYOUT, proximal_mu=0.3)
    plain = FedAvgLoRA(layout=LAYOUT)
    assert prox.round_config(1)[PROXIMAL_MU] == 0.3
    assert PROXIMAL_MU not in plain.round_config(1)
    replies = [reply(1000 + i, _client(i), {"num-examples": 2 + i}) for i in range(3)]
    results = []
    for strategy in (prox, plain):
        strategy.begin_round(1, ArrayRecord(_global()), ConfigRecord({}))
        arrays, _ = strategy.aggregate_train(1, replies)
        results.append(record_to_state(arrays))
    assert results[0].keys() == results[1].keys()
    for key in results[0]:
        torch.testing.assert_close(results[0][key], results[1][key], rtol=0, atol=0)


def test_proximal_term_value_and_gradient():
    """The client feature the nodes run (ProximalTerm.loss), on the trained
    parameters only (the frozen bias has no term)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3)
    layer.bias.requires_grad_(False)
    start = layer.weight.detach().clone()
    job = SimpleNamespace(
        parameters=lambda: [p for p in layer.parameters() if p.requires_grad]
    )
    term = ProximalTerm(0.7).loss(job)  # type: ignore[arg-type]
    assert float(term().detach()) == 0.0
    with torch.no_grad():
        layer.weight.add_(torch.randn(3, 5))
    value = term()
    diff = layer.weight.detach() - start
    want = 0.35 * float(diff.pow(2).sum())
    assert float(value.detach()) == pytest.approx(want, rel=1e-6)
    value.backward()
    torch.testing.assert_close(layer.weight.grad, 0.7 * diff)


def _client_drift(tmp_path, mu: float) -> float:
    """Mean distance of the round-1 replies from the global arrays they got."""
    config = tiny_run_config(
        tmp_path, method="fedprox-lora", **{"proximal-mu": mu, "local-steps": 8}
    )
    method = resolve(config)
    plan = build_plan(method)
    grid = InProcessGrid(client_app, num_nodes=3, run_config=config)
    initial = ArrayRecord(plan.initial_arrays)
    messages = plan.strategy.configure_train(
        1, initial, ConfigRecord(plan.train_config), grid
    )
    replies = list(grid.send_and_receive(messages))
    start = record_to_state(initial)
    drift = []
    for message in replies:
        arrays = record_to_state(message.content[protocol.ARRAYS])
        sq = sum(float((arrays[k] - start[k]).pow(2).sum()) for k in arrays)
        drift.append(sq**0.5)
    return sum(drift) / len(drift)


def test_clients_stay_closer_to_the_global_model_with_a_large_mu(tmp_path, assets):
    free = _client_drift(tmp_path / "free", 0.0)
    held = _client_drift(tmp_path / "held", 50.0)
    assert free > 0
    assert held < 0.8 * free, (held, free)
