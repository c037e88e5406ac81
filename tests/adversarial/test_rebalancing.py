"""The rebalancing attacker: ``(c A, B / c)`` for every factor pair, in process.

A LoRA reply's product ``B A`` is unchanged by the gauge ``A -> c A``,
``B -> B / c``, so a measure of the products sees nothing, while a method
that combines ``A`` and ``B`` apart publishes ``mean(B) mean(A)``, which the
rebalanced pair scales by about ``c / k``. Node 1000 of the seeded round of
``tests/strategies/test_every_method.py`` rebalances

* its own trained factors (``own``: the product it trained, unchanged), or
* the factors it was sent (``sent``: the round's global product, unchanged),

with ``c`` in ``{1e3, 1e10}``, on every method whose registered traits say
it aggregates factors (``aggregation_space`` = ``factors``) and whose reply
carries ``A`` (the attacker's lever; a method that never receives ``A``
cannot be rebalanced), under every robust rule the method accepts. For each:

* never silent: the attacker is dropped by the screen, or named in the
  robust rule's reasons, with its node;
* the published arrays are at most twice as far from the round without the
  attacker as that round moved the model.

The fast suite runs every method once, the rule, ``c`` and where rotating
over the methods (every rule and every ``(c, where)`` run somewhere); the
full product runs with ``-m slow``. A method declaring ``product`` is checked the
other way round: its aggregate must not feel the gauge (a rebalanced reply it
keeps moves the published arrays no more than twice the honest round), so
the declaration is true.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from fedlr.adapters.roles import Role
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.robust.spaces import FACTORS, PRODUCT
from fedlr.strategies.registry import available_methods, get_method
from fedlr.wire import protocol
from tests.adversarial import payloads
from tests.adversarial.payloads import Payload
from tests.adversarial.test_payloads import (
    ATTACKER,
    RULES,
    _distance,
    _reference,
    _round,
    _warm_round,
    refuses_robust,
)
from tests.strategies.test_every_method import (
    CASES,
    configure,
    distinct_replies,
)
from tests.strategies.test_every_method import plans as plans

GAUGES = (1e3, 1e10)
WHERE = ("own", "sent")


def _declaring(space: str) -> list[str]:
    """LoRA methods of the registry whose traits declare ``space`` and whose
    clients train ``A`` (the attacker's lever: FFA-LoRA's A is frozen and
    never sent, RaVAN's bases are seeded)."""
    return sorted(
        m
        for m in available_methods()
        if get_method(m).traits.aggregation_space == space
        and Role.LORA_A in getattr(get_method(m).strategy, "train_roles", ())
    )


NO_LEVER_IN_THE_TESTED_ROUND = {"slora"}
"""Methods whose tested round leaves the attacker nothing to rebalance:
SLoRA's sparse warm-up has all-zero factors (``c 0 = 0``). Its attacker's
reply is the honest one, and so is the result (asserted). (RoLoRA's tested
round trains ``A`` with ``B`` fixed by the server: ``c A`` is a boost, which
must be named and bounded all the same.)"""


def rebalanced(pairs: list[tuple[str, str]], c: float, where: str) -> Payload:
    """The attacker's reply: every pair ``(A, B)`` -> ``(c A, B / c)``, from
    its own trained factors or from the global ones it was sent; a factor
    the reply does not carry is the node's own, rebalanced on the node."""

    def transform(message, current):
        state = record_to_state(payloads._arrays(message))
        out = dict(state)
        for a_key, b_key in pairs:
            if a_key not in state:  # A fixed this round: no gauge to use
                continue
            for key, g in ((a_key, c), (b_key, 1.0 / c)):
                if key not in state:
                    continue
                src = current.get(key) if where == "sent" else None
                base = (
                    src
                    if src is not None and src.shape == state[key].shape
                    else state[key]
                )
                out[key] = (base.double() * g).to(state[key].dtype)
        records = payloads._records(message)
        records[protocol.ARRAYS] = state_to_record(out)
        return [payloads._copy(message, payloads.RecordDict(records))]

    return Payload(f"rebalanced-{where}-{c:g}", "numeric", transform)


def _rules(method: str) -> tuple[str, ...]:
    return ("none",) if refuses_robust(method) else RULES


FACTOR_METHODS = _declaring(FACTORS)
PRODUCT_METHODS = _declaring(PRODUCT)
FULL = [
    (m, r, c, w)
    for m in FACTOR_METHODS
    for r, c, w in itertools.product(_rules(m), GAUGES, WHERE)
]
FAST = [
    (m, _rules(m)[i % len(_rules(m))], GAUGES[i % 2], WHERE[(i // 2) % 2])
    for i, m in enumerate(FACTOR_METHODS)
]
"""One case per method: the rule, ``c`` and where rotate over the methods."""


def _check(method, rule, c, where, plans):
    _, _, strategy, _, _ = _warm_round(method, plans)
    pairs = [(m.a_key, m.b_key) for m in strategy.layout.modules]
    strategy, new, _, state = _round(
        method, plans, rebalanced(pairs, c, where), robust=rule
    )
    if method in NO_LEVER_IN_THE_TESTED_ROUND:
        assert new is not None
        honest = _reference(method, plans, robust=rule)
        assert _distance(new, honest) == 0.0
        return
    named = [
        r
        for r in strategy.round.dropped + strategy.round.robust
        if f"node {ATTACKER}" in r
    ]
    assert named, (method, rule, strategy.round.dropped, strategy.round.robust)
    assert new is not None, strategy.last_rejection
    want = _reference(method, plans, attacker_lost=True, robust=rule)
    moved = _distance(want, state)
    assert _distance(new, want) <= 2.0 * moved + 1e-9, (_distance(new, want), moved)


def test_the_cases_cover_every_factor_method_rule_and_gauge():
    assert FACTOR_METHODS and PRODUCT_METHODS
    assert {"fedavg-lora", "fedex-lora", "hetlora", "scaffold-lora"} <= set(
        FACTOR_METHODS
    )
    assert sorted(m for m, _, _, _ in FAST) == FACTOR_METHODS
    assert {(c, w) for _, _, c, w in FAST} == set(itertools.product(GAUGES, WHERE))
    assert {r for _, r, _, _ in FAST} == set(RULES)
    assert set(FAST) <= set(FULL)


@pytest.mark.parametrize(("method", "rule", "c", "where"), FAST)
def test_a_rebalanced_reply_is_never_silent_nor_amplified(
    method, rule, c, where, plans
):
    _check(method, rule, c, where, plans)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "rule", "c", "where"), FULL)
def test_a_rebalanced_reply_every_rule(method, rule, c, where, plans):
    _check(method, rule, c, where, plans)


@pytest.mark.parametrize("method", PRODUCT_METHODS)
def test_a_product_method_does_not_feel_the_gauge(method, plans):
    """What ``product`` declares: a rebalanced reply, kept or dropped, moves
    the published arrays at most twice as far as the honest round moved."""
    _, _, strategy, _, _ = _warm_round(method, plans)
    pairs = [(m.a_key, m.b_key) for m in strategy.layout.modules]
    _, new, _, state = _round(method, plans, rebalanced(pairs, 1e3, "own"))
    assert new is not None
    want = _reference(method, plans, attacker_lost=True)
    honest = _reference(method, plans)
    moved = _distance(want, state)
    assert _distance(new, honest) <= 2.0 * moved, (_distance(new, honest), moved)
    assert all(bool(torch.isfinite(v).all()) for v in new.values())


AGGREGATED_RECORDS = {
    "fot": protocol.SKETCHES,
    "fedlease": "fedlease-router",
    "scaffold-lora": "scaffold-delta",
}
"""Records a method aggregates into its published state; the robust rules
bound each in its own space (``tests/unit/test_record_rules.py``)."""


@pytest.mark.parametrize("method", sorted(AGGREGATED_RECORDS))
def test_every_aggregated_record_is_measured_by_the_rules(method, plans):
    _, plan, strategy, state, server_round = _warm_round(method, plans)
    strategy = copy.deepcopy(strategy)
    name = AGGREGATED_RECORDS[method]
    for r in range(server_round, server_round + 4):  # FedLEASE: after allocation
        configure(strategy, plan, r, state)
        if name in strategy.replies.records():
            break
        replies = distinct_replies(CASES[method], strategy, r, state)
        arrays, _ = strategy.aggregate_train(r, replies)
        state = record_to_state(arrays)
    assert name in strategy.replies.records()
    space = strategy.replies.space(state)
    assert [s.name for s in space.records] == [name]
