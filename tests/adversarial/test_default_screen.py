"""Safe by default: hostile numbers never reach a published model.

With the update-size screen's defaults and no robust rule (``robust =
"none"``; the default ``robust = "auto"`` is tested in
test_server_update.py), ``max-update-ratio`` 0, ``screen-ratio`` 20, node
1000 of three sends, on every registered method
in the round after its warm-up (the replies of
``tests/strategies/test_every_method.py``), its arrays replaced by a hostile
value (``HOSTILE``): huge finite float32 numbers, a float64 ``1e300``, its
honest arrays in float16 or float64, or its honest update boosted 1e4 times
with its honest example count. Each outcome is one of

``dropped``
    the attacker's reply is dropped with a reason naming node 1000 (the
    update-size screen, or the cast to the global dtype) and the new global
    arrays equal, bit for bit, those of the round in which its reply never
    arrived;
``kept``
    the reply is aggregated (the float16 and float64 replies of honest
    values): the global arrays keep their dtype, are finite and lie within
    ``BOUND`` times the honest round's movement of the honest round's result.

Never ``published``: a hostile reply aggregated into the model, nor a
``rejected`` round (the screen drops the reply before the kernel sees it).
``python -m tests.adversarial.test_default_screen [RATIO]`` prints the table
(with ``screen-ratio`` RATIO, e.g. 0: the screen off).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping

import pytest
import torch
from flwr.app import Message

from fedlr.flower.records import record_to_state
from fedlr.robust.screen import screen_sizes
from fedlr.robust.spaces import ParameterSpace
from fedlr.strategies.registry import available_methods
from fedlr.wire.updates import ClientUpdate
from tests.adversarial.payloads import _arrays_map, _scaled
from tests.strategies.test_every_method import (  # noqa: F401 (fixture)
    CASES,
    configure,
    distinct_replies,
    plans,
    warm,
)

ATTACKER = 1000
BOUND = 2.0
"""A kept reply (honest values in another dtype) moves the result at most
this many times the honest round's own movement away from it."""


def _filled(value: float, dtype: torch.dtype) -> Callable:
    return lambda m, c: _arrays_map(
        m, lambda k, x: torch.full_like(x, value, dtype=dtype)
    )


def _cast(dtype: torch.dtype) -> Callable:
    return lambda m, c: _arrays_map(m, lambda k, x: x.to(dtype))


HOSTILE: dict[str, tuple[Callable[[Message, dict], list[Message]], str]] = {
    "1e5 f32": (_filled(1e5, torch.float32), "dropped"),
    "65504 f32": (_filled(65504.0, torch.float32), "dropped"),
    "1e20 f32": (_filled(1e20, torch.float32), "dropped"),
    "1e30 f32": (_filled(1e30, torch.float32), "dropped"),
    "3e38 f32": (_filled(3e38, torch.float32), "dropped"),
    "1e300 f64": (_filled(1e300, torch.float64), "dropped"),
    "x1e4 update": (_scaled(1e4), "dropped"),
    "honest f16": (_cast(torch.float16), "kept"),
    "honest f64": (_cast(torch.float64), "kept"),
}
"""Name -> (the attacker's transform, the outcome required)."""
METHODS = available_methods()

_WARM: dict[str, tuple] = {}


def _warm(method: str, plans) -> tuple:  # noqa: F811 (fixture)
    if method not in _WARM:
        case = CASES[method]
        plan = plans(method)
        strategy, state = warm(case, plan)
        _WARM[method] = (case, plan, strategy, state, case.warm_rounds + 1)
    return _WARM[method]


def _round(method, plans, transform=None, *, lost=False):  # noqa: F811
    """The attacked round: strategy, new state (None if rejected), metrics."""
    case, plan, strategy, state, server_round = _warm(method, plans)
    strategy = copy.deepcopy(strategy)
    instructions = configure(strategy, plan, server_round, state)
    replies = distinct_replies(case, strategy, server_round, state)
    honest = [r for r in replies if int(r.metadata.src_node_id) != ATTACKER]
    (mine,) = [r for r in replies if int(r.metadata.src_node_id) == ATTACKER]
    if lost:
        sent = honest
    elif transform is None:
        sent = replies
    else:
        from tests.adversarial.payloads import _INSTRUCTIONS

        _INSTRUCTIONS[ATTACKER] = instructions[ATTACKER]
        sent = transform(mine, dict(state)) + honest
    arrays, metrics = strategy.aggregate_train(server_round, sent)
    new = record_to_state(arrays) if arrays is not None else None
    return strategy, new, metrics, state


def _distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(
        sum(
            float((a[k].double() - b[k].double()).square().sum())
            for k in a
            if k in b and a[k].shape == b[k].shape
        )
    )


def outcome(method: str, name: str, plans) -> str:  # noqa: F811
    """The round's outcome (see the module docstring), checked."""
    transform, _ = HOSTILE[name]
    strategy, new, metrics, state = _round(method, plans, transform)
    assert metrics is not None
    if new is None:
        return "rejected"
    dtypes = {k: v.dtype for k, v in state.items()}
    assert all(new[k].dtype == dtypes[k] for k in new if k in dtypes), name
    assert all(bool(torch.isfinite(v).all()) for v in new.values()), name
    if strategy.round.dropped:
        (reason,) = strategy.round.dropped
        assert f"node {ATTACKER}" in reason, reason
        _, without, _, _ = _round(method, plans, lost=True)
        assert without is not None and without.keys() == new.keys()
        for key in new:
            assert torch.equal(new[key], without[key]), (name, key)
        return "dropped"
    _, honest, _, _ = _round(method, plans)
    assert honest is not None
    moved = _distance(honest, state)
    if _distance(new, honest) <= BOUND * moved + 1e-9:
        return "kept"
    return "published"


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("method", METHODS)
def test_hostile_reply_is_dropped_or_harmless_by_default(method, name, plans):  # noqa: F811
    strategy = _warm(method, plans)[2]
    assert strategy.robust.rule == "none" and strategy.max_update_ratio == 0
    assert strategy.screen_ratio == 20.0
    assert outcome(method, name, plans) == HOSTILE[name][1]


def test_the_screen_reason_names_the_node_and_the_ratio(plans):  # noqa: F811
    strategy, _, metrics, _ = _round("fedex-lora", plans, HOSTILE["x1e4 update"][0])
    assert metrics["dropped"] == 1
    (reason,) = strategy.round.dropped
    assert reason.startswith(f"reply from node {ATTACKER} rejected: update norm")
    assert "above screen-ratio 20" in reason
    ratio = float(reason.split(" is ")[1].split(" x ")[0])
    assert ratio > 1e3, reason


def test_screen_ratio_zero_turns_the_screen_off(plans):  # noqa: F811
    case, plan, strategy, state, server_round = _warm("fedavg-lora", plans)
    strategy = copy.deepcopy(strategy)
    strategy.screen_ratio = 0.0
    _WARM["off"] = (case, plan, strategy, state, server_round)
    _, new, metrics, _ = _round("off", plans, HOSTILE["x1e4 update"][0])
    assert metrics["dropped"] == 0 and new is not None
    _, honest, _, _ = _round("fedavg-lora", plans)
    assert _distance(new, honest) > 100 * _distance(honest, state)


if __name__ == "__main__":  # python -m tests.adversarial.test_default_screen [RATIO]
    import sys
    import tempfile
    from pathlib import Path

    from fedlr.data.assets import ensure_assets
    from fedlr.server_apps.builtin_plans import build_plan
    from fedlr.strategies.registry import resolve
    from tests.strategies.test_every_method import ASSETS, run_config

    built: dict = {}

    def table_plans(method: str):
        if method not in built:
            ensure_assets(ASSETS[CASES[method].family], quiet=True)
            out = Path(tempfile.mkdtemp())
            built[method] = build_plan(resolve(run_config(CASES[method], out)))
            if len(sys.argv) > 1:  # another screen-ratio (0: off)
                built[method].strategy.screen_ratio = float(sys.argv[1])
        return built[method]

    print("| method | " + " | ".join(HOSTILE) + " |")
    print("|---" * (len(HOSTILE) + 1) + "|")
    for method in METHODS:
        cells = []
        for name in HOSTILE:
            try:
                cells.append(outcome(method, name, table_plans))
            except AssertionError:  # a published array of another dtype, NaN
                cells.append("published (bad array)")
        print(f"| {method} | " + " | ".join(cells) + " |")


# ------------------------------------------------- the rule, on vectors
def _updates(norms: list[float], current: float) -> list[ClientUpdate]:
    """Updates of the given norms along one axis, the state on the other."""
    return [
        ClientUpdate(2000 + i, {"w": torch.tensor([n, current])}, 1, {}, None, 0)  # type: ignore[arg-type]
        for i, n in enumerate(norms)
    ]


@pytest.mark.parametrize(
    ("norms", "current", "dropped"),
    [
        ([1.0, 1.5, 2.0], 1.0, []),  # honest
        ([1.0, 1.2, 25.0], 1.0, [2]),  # 25 > 20 x median 1.2
        ([1.0, 1.2, 23.0], 30.0, []),  # no larger than the current state
        ([1.0, 30.0], 1.0, [1]),  # two clients: the smaller sets the scale
        ([1.0, 19.0], 1.0, []),
        ([0.0, 0.0, 0.5], 1.0, []),  # a zero median: the current state floors
        ([0.0, 0.0, 1.5], 1.0, [2]),
        ([15.0], 1.0, []),  # one client: 20 x the current state
        ([25.0], 1.0, [0]),
        ([5.0], 0.0, []),  # nothing to compare with: kept
        ([1.0, float("inf"), 1.0], 1.0, [1]),  # not finite: always dropped
    ],
)
def test_screen_sizes_rule(norms, current, dropped):
    space = ParameterSpace({"w": torch.tensor([0.0, current])})
    outcome = screen_sizes(_updates(norms, current), space, 20.0)
    got = sorted(node - 2000 for node, _ in outcome.reasons)
    assert got == dropped, outcome.reasons
    assert len(outcome.updates) == len(norms) - len(dropped)
    assert all("screen-ratio 20" in reason for _, reason in outcome.reasons)
    off = screen_sizes(_updates(norms, current), space, 0.0)
    assert len(off.updates) == len(norms) and not off.reasons


@pytest.mark.slow  # whole in-process federations (tests/adversarial/test_runs.py)
def test_a_boosted_client_is_dropped_every_round_of_a_fedex_run(tmp_path):
    """FedEx-LoRA with default settings; partition 0 boosts its honest update
    1e4 times (honest example count) every round: dropped every round, and
    the run ends with the arrays of the run in which its replies were lost."""
    import pandas as pd

    from fedlr.data.assets import ensure_assets
    from fedlr.launch.local import run_in_process
    from tests.strategies.test_every_method import ASSETS, run_config

    ensure_assets(ASSETS["text"], quiet=True)
    config = run_config(CASES["fedex-lora"], tmp_path)
    config["num-server-rounds"] = 3
    boost = HOSTILE["x1e4 update"][0]

    def attack(partition: int, instruction: Message, reply: Message) -> Message | None:
        if partition != 0 or reply.has_error():
            return reply
        from tests.adversarial.payloads import _INSTRUCTIONS

        _INSTRUCTIONS[int(instruction.metadata.dst_node_id)] = instruction
        sent = record_to_state(instruction.content.array_records["arrays"])
        (forged,) = boost(reply, sent)
        return forged

    attacked = run_in_process(config, reply_hook=attack)
    lost = run_in_process(config, reply_hook=lambda p, i, r: None if p == 0 else r)
    frame = pd.read_csv(attacked / "results.csv")
    assert frame["dropped"].tolist() == [1, 1, 1]
    assert (frame["rejected-rounds"] == 0).all()
    assert frame["train-loss"].between(0, 5).all()
    got = torch.load(attacked / "final_arrays.pt", weights_only=True)
    want = torch.load(lost / "final_arrays.pt", weights_only=True)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
