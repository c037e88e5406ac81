"""RoLoRA: which factor each round trains, and the exact mean of products.

Float64 global arrays stay float64 (replies are cast to the global dtype), so
the property ``B_{t+1} A_{t+1} = sum_i w_i B_i A_i`` is checked to float64
rounding, round after round, with the factor a round does not train equal to
the global one bit for bit.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.clientapp import ClientApp

from fedlr.adapters import AdapterLayout, LoraModule, Role
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.strategies.rolora import RoLoRA, trained_factor
from tests.strategies.conftest import reply

F64 = torch.float64
LAYOUT = AdapterLayout(
    modules=(
        LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=6, d_in=5, rank=2),
        LoraModule("l1", "l1.A", "l1.B", "l1.W", 0.5, d_out=4, d_in=7, rank=3),
    ),
    head_shapes={"head.w": (2, 5), "head.b": (2,)},
)
EXAMPLES = (10, 30, 60)
SHARES = torch.tensor(EXAMPLES, dtype=F64) / sum(EXAMPLES)


def _random(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}


def _configure(strategy: RoLoRA, server_round: int, state: dict) -> list:
    grid = InProcessGrid(ClientApp(), num_nodes=len(EXAMPLES), run_config={})
    return list(
        strategy.configure_train(
            server_round, ArrayRecord(dict(state)), ConfigRecord(), grid
        )
    )


def test_odd_rounds_train_b_even_rounds_a():
    assert [trained_factor(t) for t in (1, 2, 3, 4)] == [
        Role.LORA_B,
        Role.LORA_A,
        Role.LORA_B,
        Role.LORA_A,
    ]


def test_the_published_product_is_the_mean_of_the_clients_products():
    strategy = RoLoRA(layout=LAYOUT)
    state = _random(0, LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
    for server_round in range(1, 5):
        messages = _configure(strategy, server_round, state)
        factor = trained_factor(server_round)
        roles = messages[0].content["config"]["train-roles"]
        assert roles == f"{factor.value},head"
        assert set(strategy.reply_shapes()) == set(LAYOUT.keys(factor, Role.HEAD))
        sent = [
            {
                k: state[k] + 0.3 * v
                for k, v in _random(
                    100 * server_round + i, strategy.reply_shapes()
                ).items()
            }
            for i in range(len(EXAMPLES))
        ]
        replies = [
            reply(1000 + i, arrays, {"num-examples": n})
            for i, (arrays, n) in enumerate(zip(sent, EXAMPLES, strict=True))
        ]
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        assert arrays is not None and metrics is not None
        assert metrics["dropped"] == 0, strategy.round.dropped
        new = record_to_state(arrays)
        assert all(v.dtype == F64 for v in new.values())
        frozen = Role.LORA_A if factor is Role.LORA_B else Role.LORA_B
        for key in LAYOUT.keys(frozen):  # the frozen factor, bit for bit
            assert torch.equal(new[key], state[key]), key
        for m in LAYOUT.modules:
            products = torch.stack(
                [{**state, **s}[m.b_key] @ {**state, **s}[m.a_key] for s in sent]
            )
            mean = torch.tensordot(SHARES, products, dims=1)
            err = float((new[m.b_key] @ new[m.a_key] - mean).abs().max())
            assert err <= 1e-13 * float(mean.abs().max()), (server_round, m.name, err)
        # the reported gap is that error too: float64 zero
        assert metrics["relative-gap"] < 1e-12
        assert metrics["trained-factor"] == (0.0 if factor is Role.LORA_B else 1.0)
        for key in LAYOUT.keys(factor):  # not vacuous: the trained factor moved
            assert float((new[key] - state[key]).abs().max()) > 0.01, key
        state = new


def test_fedavg_of_both_factors_would_not_be_exact():
    """The property is RoLoRA's, not the data's: on the same replies, the
    product of the means of both trained factors misses the mean product."""
    state = _random(1, LAYOUT.shapes(Role.LORA_A, Role.LORA_B))
    m = LAYOUT.modules[0]
    clients = [
        _random(10 + i, LAYOUT.shapes(Role.LORA_A, Role.LORA_B)) for i in range(3)
    ]
    mean = torch.tensordot(
        SHARES, torch.stack([c[m.b_key] @ c[m.a_key] for c in clients]), dims=1
    )
    b_bar = torch.tensordot(SHARES, torch.stack([c[m.b_key] for c in clients]), dims=1)
    a_bar = torch.tensordot(SHARES, torch.stack([c[m.a_key] for c in clients]), dims=1)
    assert float((b_bar @ a_bar - mean).abs().max()) > 0.1
    # one factor trained: exact
    b_mean = torch.tensordot(SHARES, torch.stack([c[m.b_key] for c in clients]), dims=1)
    one = torch.tensordot(
        SHARES, torch.stack([c[m.b_key] @ state[m.a_key] for c in clients]), dims=1
    )
    assert float((b_mean @ state[m.a_key] - one).abs().max()) < 1e-13


def test_a_reply_with_the_other_factor_is_dropped_naming_this_rounds_roles():
    strategy = RoLoRA(layout=LAYOUT)
    state = _random(2, LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
    _configure(strategy, 2, state)  # an A round
    good = {k: state[k] for k in LAYOUT.keys(Role.LORA_A, Role.HEAD)}
    wrong = {k: state[k] for k in LAYOUT.keys(Role.LORA_B, Role.HEAD)}
    replies = [
        reply(1000, good, {"num-examples": 5}),
        reply(1001, wrong, {"num-examples": 5}),
        reply(1002, good, {"num-examples": 5}),
    ]
    arrays, metrics = strategy.aggregate_train(2, replies)
    assert arrays is not None and metrics is not None
    assert metrics["dropped"] == 1 and metrics["clients"] == 2
    (reason,) = strategy.round.dropped
    assert "node 1001" in reason and "train-roles=lora_A,head" in reason


def test_state_dict_keeps_the_instructed_round():
    strategy = RoLoRA(layout=LAYOUT)
    state = _random(3, LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
    _configure(strategy, 2, state)
    resumed = RoLoRA(layout=LAYOUT)
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.reply_shapes() == LAYOUT.shapes(Role.LORA_A, Role.HEAD)
    assert RoLoRA(layout=LAYOUT).reply_shapes() == LAYOUT.shapes(Role.LORA_B, Role.HEAD)
