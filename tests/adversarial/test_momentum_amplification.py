"""FedAvgM-LoRA's momentum against one screened-but-hostile round (issue 35).

A reply that passes the default screen (just under its limit) moves FedAvg-LoRA's
model once. Under FedAvgM-LoRA the same reply enters the momentum buffer, which
keeps stepping in its direction: ``T`` rounds after the injection the model is
displaced by ``eta (1 - beta^(T+1)) / (1 - beta)`` times the injected step (the
heavy-ball response to a one-off impulse, docs/methods/fedavgm-lora.md). And
the momentum is fed by the screened replies only: a reply the screen drops
leaves the buffer as if it had never been sent.

Synthetic float64 rounds on the strategy directly (no training): honest replies
move every trained tensor by a fixed per-round, per-client step, so the two
runs (with and without the hostile reply) differ only by the injection.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.fedavgm_lora import FedAvgMLoRA, ServerMomentumOptions
from tests.plugin_app.task import build_model
from tests.strategies.conftest import reply

F64 = torch.float64
CLIENTS = 5
HOSTILE = 4  # the attacker's index among the clients
EXAMPLES = [30, 20, 25, 15, 10]  # the attacker claims its honest count

NO_RULE = RobustConfig(rule="none")
"""The closed form is for what passes the screen: no robust rule re-scales the
later honest rounds differently in the two runs (a clipping rule bounds the
injected step, which momentum then multiplies the same way)."""

State = dict[str, torch.Tensor]


def _start() -> tuple[State, list[str]]:
    """The plug-in model's initial global arrays (float64) and trained keys."""
    model = build_model("fedavgm-lora")
    strategy = FedAvgMLoRA.for_model(model)
    state = {
        k: v.to(F64) for k, v in record_to_state(strategy.initial_arrays(model)).items()
    }
    return state, list(strategy.layout.keys(*strategy.train_roles))


def _steps(state: State, keys: list[str], rounds: int) -> list[list[State]]:
    """Each round's honest step per client: 0.01 N(0, 1) per trained entry."""
    g = torch.Generator().manual_seed(35)
    return [
        [
            {
                k: 0.01 * torch.randn(state[k].shape, generator=g, dtype=F64)
                for k in keys
            }
            for _ in range(CLIENTS)
        ]
        for _ in range(rounds)
    ]


def _round(
    strategy: FedLRStrategy,
    server_round: int,
    x: State,
    steps: list[State],
    hostile: State | None,
) -> tuple[State, dict[str, float]]:
    """One round: every client replies ``x + its step`` (the attacker adds
    ``hostile``); the new global arrays and the round's metrics."""
    strategy.begin_round(server_round, ArrayRecord(dict(x)), ConfigRecord({}))
    replies = []
    for i, step in enumerate(steps):
        sent = {k: x[k] + step.get(k, 0.0) for k in x}
        if i == HOSTILE and hostile is not None:
            sent = {k: sent[k] + hostile.get(k, 0.0) for k in x}
        replies.append(reply(1000 + i, sent, {"num-examples": EXAMPLES[i]}))
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    assert arrays is not None and metrics is not None
    return record_to_state(arrays), dict(metrics)


def _norm(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k] - b[k]).square().sum()) for k in a))


def _hostile_direction(keys: list[str], state: State) -> State:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(state[k].shape, generator=g, dtype=F64) for k in keys}


def _dropped(strategy: FedLRStrategy, r: int, x: State, steps, hostile: State) -> bool:
    trial = copy.deepcopy(strategy)
    _, metrics = _round(trial, r, x, steps, hostile)
    return metrics["dropped"] > 0


def _at_the_limit(strategy, r, x, steps, direction: State) -> tuple[State, float]:
    """The hostile step ``s * direction`` with ``s`` just under the screen's
    limit (bisection on the real screen, to 0.1 %), and ``s``."""
    low, high = 0.0, 1.0
    while not _dropped(
        strategy, r, x, steps, {k: high * v for k, v in direction.items()}
    ):
        low, high = high, 2 * high
        assert high < 1e6, "the screen never drops the hostile reply"
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        dropped = _dropped(
            strategy, r, x, steps, {k: mid * v for k, v in direction.items()}
        )
        low, high = (low, mid) if dropped else (mid, high)
    return {k: low * v for k, v in direction.items()}, low


def _runs(make, rounds: int, inject: int, hostile_scale: float | None = None):
    """Global arrays after every round, without and with the injection."""
    x0, keys = _start()
    steps = _steps(x0, keys, rounds)
    direction = _hostile_direction(keys, x0)
    clean, attacked = make(), make()
    x, y = dict(x0), dict(x0)
    xs, ys = [], []
    hostile: State | None = None
    scale = hostile_scale
    for r in range(1, rounds + 1):
        if r == inject:
            if scale is None:
                hostile, scale = _at_the_limit(attacked, r, y, steps[r - 1], direction)
            else:
                hostile = {k: scale * v for k, v in direction.items()}
        x, mx = _round(clean, r, x, steps[r - 1], None)
        y, my = _round(attacked, r, y, steps[r - 1], hostile if r == inject else None)
        assert mx["dropped"] == 0
        if r == inject:
            injected_dropped = my["dropped"]
        xs.append(x)
        ys.append(y)
    assert scale is not None
    return xs, ys, injected_dropped, scale


ROUNDS, INJECT = 27, 3


def test_fedavg_moves_the_model_once_by_the_injected_step():
    xs, ys, dropped, _ = _runs(
        lambda: FedAvgLoRA.for_model(build_model("fedavg-lora"), robust=NO_RULE),
        ROUNDS,
        INJECT,
    )
    assert dropped == 0  # screened, and let through
    step = _norm(xs[INJECT - 1], ys[INJECT - 1])
    assert step > 0
    for t in range(INJECT, ROUNDS):
        assert _norm(xs[t], ys[t]) / step == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(("beta", "eta"), [(0.9, 1.0), (0.5, 0.8)])
def test_fedavgm_amplifies_one_screened_round_by_the_heavy_ball_closed_form(beta, eta):
    """Displacement ``T`` rounds after the injection, relative to FedAvg's
    (the injected step, ``w_h ||h||``): ``eta (1 - beta^(T+1)) / (1 - beta)``;
    24 rounds later at beta 0.9: 9.28x (the issue measured 9.3x)."""
    model = build_model("fedavgm-lora")
    options = ServerMomentumOptions(server_momentum=beta, server_lr=eta)
    xs, ys, dropped, scale = _runs(
        lambda: FedAvgMLoRA.for_model(model, options=options, robust=NO_RULE),
        ROUNDS,
        INJECT,
    )
    assert dropped == 0  # just under the screen's limit in FedAvgM's round
    # FedAvg's response to the same reply: the injected step itself
    fx, fy, dropped, _ = _runs(
        lambda: FedAvgLoRA.for_model(build_model("fedavg-lora"), robust=NO_RULE),
        ROUNDS,
        INJECT,
        scale,
    )
    assert dropped == 0
    injected = _norm(fx[INJECT - 1], fy[INJECT - 1])  # FedAvg's one step
    for t in range(0, ROUNDS - INJECT + 1):
        measured = _norm(xs[INJECT - 1 + t], ys[INJECT - 1 + t]) / injected
        closed = eta * (1 - beta ** (t + 1)) / (1 - beta)
        assert measured == pytest.approx(closed, rel=1e-9), t
    if (beta, eta) == (0.9, 1.0):
        t = 24
        assert _norm(
            xs[INJECT - 1 + t], ys[INJECT - 1 + t]
        ) / injected == pytest.approx(9.2821, abs=1e-4)


def test_a_dropped_reply_never_reaches_the_momentum():
    """Just over the screen's limit the hostile reply is dropped: the momentum
    buffer and the model are bit for bit those of a round without it."""
    model = build_model("fedavgm-lora")
    make = lambda: FedAvgMLoRA.for_model(model)  # noqa: E731
    x0, keys = _start()
    steps = _steps(x0, keys, 2)
    direction = _hostile_direction(keys, x0)
    probe = make()
    x1, _ = _round(probe, 1, x0, steps[0], None)
    _, scale = _at_the_limit(probe, 2, x1, steps[1], direction)
    over = {k: 1.01 * scale * v for k, v in direction.items()}

    results = []
    for hostile, drop_it in ((over, False), (None, True)):
        strategy = make()
        x, _ = _round(strategy, 1, x0, steps[0], None)
        if drop_it:  # the same round without the attacker's reply at all
            strategy.begin_round(2, ArrayRecord(dict(x)), ConfigRecord({}))
            replies = [
                reply(
                    1000 + i,
                    {k: x[k] + step.get(k, 0.0) for k in x},
                    {"num-examples": EXAMPLES[i]},
                )
                for i, step in enumerate(steps[1])
                if i != HOSTILE
            ]
            arrays, metrics = strategy.aggregate_train(2, replies)
            new = record_to_state(arrays)
        else:
            new, metrics = _round(strategy, 2, x, steps[1], hostile)
            assert metrics["dropped"] == 1
            assert len(strategy.round.dropped) == 1
            assert "node 1004" in strategy.round.dropped[0]
        results.append((new, {k: v.clone() for k, v in strategy.momentum.items()}))
    (a, va), (b, vb) = results
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert set(va) == set(vb) and all(torch.equal(va[k], vb[k]) for k in va)
