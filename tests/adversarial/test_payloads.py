"""Every attacker payload against every method family's strategy, in process.

Three nodes reply each round (the seeded, disagreeing replies of
``tests/strategies/test_every_method.py``, with each method's valid extra
records); node 1000 is the attacker and sends a payload of
``tests/adversarial/payloads.py`` instead of its reply. Each method runs the
round after its warm-up rounds (QR-Mix's stage 2 with ``eigen`` records,
FOT's task boundary with sketches).

For every payload the round must complete (no exception out of
``aggregate_train``), and:

* ``drop`` payloads: exactly the attacker's reply is dropped, with a reason
  naming node 1000 and the fault; the new global arrays equal, bit for bit,
  those of the same round in which the attacker's reply never arrived;
* ``extra`` payloads (a duplicate, a reply from a node never asked): the extra
  message is dropped with its reason, and the result equals the honest round;
* ``numeric`` payloads (well-formed, hostile numbers): with ``robust="none"``
  the server publishes a finite model or rejects the round (never NaN/Inf);
  with ``trimmed-mean`` the attacker is trimmed and the result equals the
  round without it (relative 1e-6); with ``median``, ``norm-clip`` and
  ``centred-clip`` the attacker is named in the robust reasons and the
  result is at most twice as far from the round without it as that round
  moved the model (5x for the median of methods not linear in the client's
  arrays, ``NONLINEAR_PULL``).

Which cases run
---------------
The fast suite runs a deterministic *covering design*, derived from the
registry and ``PAYLOADS`` (no list of methods: a new method joins it by being
registered). A *family* is a payload kind (``get_method(name).payload.name``:
``lora``, ``vera``, ``sorf-vera``, ``qrmix``, ``gpse``); its methods are
taken in name order.

* ``drop``/``extra`` payloads (``COVER_DROP``): payload ``i`` (in name order)
  runs on method ``i mod n`` of every family of ``n`` methods. So every
  payload runs on one method of every family, and since there are more
  payloads than methods in any family, every registered method receives
  some payloads.
* ``numeric`` payloads (``COVER_NUMERIC``): the methods of each family that
  accept robust aggregation (not the heterogeneous-rank strategies,
  :class:`~fedlr.strategies.hetero.HeteroRankLoRA`, which refuse it) run a
  cyclic Latin design: family ``f``'s case ``t``, for ``t < max(P, R, n)``
  (``P`` numeric payloads, ``R`` rules, ``n`` such methods), is payload
  ``t mod P`` under rule ``(t + f) mod R`` on method ``t mod n``. So every
  numeric payload and every robust rule run on every family, and every
  method that accepts robust rules runs some; the shift by ``f`` spreads the
  (payload, rule) pairs over the families, and a pair no family got is added
  to a family (round-robin), so each (payload, rule) pair also runs
  somewhere.

``test_the_fast_cases_cover_every_family_payload_and_rule`` asserts these
properties of the chosen cases. The full product of ``PRODUCT_METHODS`` (one
method per strategy family and the variants whose replies differ), every
payload and every rule runs in the slow suite (``-m slow``).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping

import pytest
import torch

from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig
from fedlr.strategies.hetero import HeteroRankLoRA
from fedlr.strategies.registry import available_methods, get_method
from tests.adversarial.payloads import PAYLOADS, attack
from tests.strategies.test_every_method import (  # noqa: F401 (fixture)
    CASES,
    configure,
    distinct_replies,
    plans,
    warm,
)

ATTACKER = 1000
HETERO_RANKS = ("flexlora", "flora")
"""Heterogeneous-rank methods of the full product: replies validated at the
rank they declare (robust aggregation is refused for them, so only the drop
path applies)."""
PRODUCT_METHODS = (
    "fedex-lora",
    "fedavg-lora",
    "ffa-lora",
    "fedspec",
    "fedsvd",
    "global-svd",
    "fedsa-lora",
    "vera-fedex",
    "sorf-vera",
    "fedavg",
    "qrmix",
    "fot",
)
"""The full product's methods: one per strategy family (and the variants
whose replies differ)."""
NONLINEAR_PULL = {"global-svd": 5.0, "vera-fedex": 5.0}
"""The geometric median bounds an attacker's pull in the space it is computed
in (the products, the lambdas); Global SVD's re-factorisation and VeRA-FedEx's
residual (a product of two lambda vectors) are not linear in what a client
sends, so the pull on their published arrays is larger (measured up to 4.5x
the honest movement here; docs/reliability.md advises trimmed-mean there)."""
CAP = 1000
"""``max-num-examples`` of the round (the replies claim 5, 17 and 40)."""
DROP = sorted(n for n, p in PAYLOADS.items() if p.outcome in ("drop", "extra"))
NUMERIC = sorted(n for n, p in PAYLOADS.items() if p.outcome == "numeric")
RULES = ("none", "norm-clip", "trimmed-mean", "median", "centred-clip")


# ------------------------------------------------------------ covering design
def refuses_robust(method: str) -> bool:
    """Whether the method's strategy refuses robust aggregation (the
    asynchronous ones refuse it at construction; a case here sets the rule
    after construction, so it must not pick them)."""
    strategy = get_method(method).strategy
    return issubclass(strategy, HeteroRankLoRA) or getattr(
        strategy, "asynchronous", False
    )


def families() -> dict[str, tuple[str, ...]]:
    """Every registered method by family (payload kind), both in name order."""
    out: dict[str, list[str]] = {}
    for method in sorted(available_methods()):
        out.setdefault(get_method(method).payload.name, []).append(method)
    return {kind: tuple(out[kind]) for kind in sorted(out)}


def cover_drop() -> list[tuple[str, str]]:
    """``(method, payload)``: payload ``i`` on method ``i mod n`` of each family."""
    return [
        (methods[i % len(methods)], payload)
        for methods in families().values()
        for i, payload in enumerate(DROP)
    ]


def cover_numeric() -> list[tuple[str, str, str]]:
    """``(method, payload, rule)``: a cyclic Latin design per family."""
    cases: list[tuple[str, str, str]] = []
    robust = {
        kind: tuple(m for m in methods if not refuses_robust(m))
        for kind, methods in families().items()
    }
    robust = {kind: methods for kind, methods in robust.items() if methods}
    for f, methods in enumerate(robust.values()):
        for t in range(max(len(NUMERIC), len(RULES), len(methods))):
            cases.append(
                (
                    methods[t % len(methods)],
                    NUMERIC[t % len(NUMERIC)],
                    RULES[(t + f) % len(RULES)],
                )
            )
    covered = {(payload, rule) for _, payload, rule in cases}
    missing = [(p, r) for p in NUMERIC for r in RULES if (p, r) not in covered]
    kinds = list(robust.values())
    for j, (payload, rule) in enumerate(missing):
        methods = kinds[j % len(kinds)]
        cases.append((methods[j % len(methods)], payload, rule))
    return cases


COVER_DROP = cover_drop()
COVER_NUMERIC = cover_numeric()


def test_the_fast_cases_cover_every_family_payload_and_rule():
    kinds = families()
    assert sorted(m for ms in kinds.values() for m in ms) == sorted(available_methods())
    family = {m: kind for kind, ms in kinds.items() for m in ms}
    # drop/extra: every payload on at least one method of every family, and
    # every registered method receives some payload
    assert len(COVER_DROP) == len(set(COVER_DROP))
    assert {p for _, p in COVER_DROP} <= set(DROP)
    drop = {(family[m], p) for m, p in COVER_DROP}
    assert drop == {(k, p) for k in kinds for p in DROP}
    assert {m for m, _ in COVER_DROP} == set(available_methods())
    # numeric: every payload on every family, every family under every rule,
    # every (payload, rule) pair somewhere, every method accepting robust rules
    # and never one refusing them
    assert len(COVER_NUMERIC) == len(set(COVER_NUMERIC))
    assert not [m for m, _, _ in COVER_NUMERIC if refuses_robust(m)]
    assert {m for m, _, _ in COVER_NUMERIC} == {
        m for m in available_methods() if not refuses_robust(m)
    }
    assert {(family[m], p) for m, p, _ in COVER_NUMERIC} == {
        (k, p) for k in kinds for p in NUMERIC
    }
    assert {(family[m], r) for m, _, r in COVER_NUMERIC} == {
        (k, r) for k in kinds for r in RULES
    }
    assert {(p, r) for _, p, r in COVER_NUMERIC} == {
        (p, r) for p in NUMERIC for r in RULES
    }
    # far fewer than the full product
    full = len(DROP) * (len(PRODUCT_METHODS) + len(HETERO_RANKS))
    full += len(NUMERIC) * len(RULES) * len(PRODUCT_METHODS)
    assert len(COVER_DROP) + len(COVER_NUMERIC) < full / 2


# -------------------------------------------------------------------- rounds
_ROUNDS: dict[str, tuple] = {}


def _warm_round(method: str, plans) -> tuple:  # noqa: F811 (fixture)
    """The method's strategy and global state after its warm-up rounds (cached)."""
    if method not in _ROUNDS:
        case = CASES[method]
        plan = plans(method)
        strategy, state = warm(case, plan)
        _ROUNDS[method] = (case, plan, strategy, state, case.warm_rounds + 1)
    return _ROUNDS[method]


def _round(method, plans, payload=None, *, attacker_lost=False, robust="none"):  # noqa: F811
    case, plan, strategy, state, server_round = _warm_round(method, plans)
    strategy = copy.deepcopy(strategy)
    strategy.max_num_examples = CAP
    strategy.robust = RobustConfig(rule=robust)
    instructions = configure(strategy, plan, server_round, state)
    replies = distinct_replies(case, strategy, server_round, state)
    honest = [r for r in replies if int(r.metadata.src_node_id) != ATTACKER]
    if attacker_lost:
        sent = honest
    elif payload is None:
        sent = replies
    else:
        (mine,) = [r for r in replies if int(r.metadata.src_node_id) == ATTACKER]
        sent = attack(payload, mine, dict(state), instructions[ATTACKER]) + honest
    arrays, metrics = strategy.aggregate_train(server_round, sent)
    new = record_to_state(arrays) if arrays is not None else None
    return strategy, new, metrics, state


_REFERENCES: dict[tuple[str, bool, str], Mapping[str, torch.Tensor]] = {}


def _reference(method, plans, *, attacker_lost=False, robust="none"):  # noqa: F811
    """The new global arrays of the honest round or of the one without the attacker.

    Cached: the same for every payload of the method (callers only read them).
    """
    key = (method, attacker_lost, robust)
    if key not in _REFERENCES:
        _, want, _, _ = _round(
            method, plans, attacker_lost=attacker_lost, robust=robust
        )
        assert want is not None
        _REFERENCES[key] = want
    return _REFERENCES[key]


def _assert_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Frobenius distance over the keys both hold with the same shape."""
    return math.sqrt(
        sum(
            float((a[k].double() - b[k].double()).square().sum())
            for k in a
            if k in b and a[k].shape == b[k].shape
        )
    )


def _check_dropped(method, payload, plans):  # noqa: F811
    p = PAYLOADS[payload]
    strategy, new, metrics, _ = _round(method, plans, p)
    assert new is not None and metrics is not None
    assert metrics["dropped"] == 1, strategy.round.dropped
    (reason,) = strategy.round.dropped
    node = 4242 if payload == "stranger" else ATTACKER
    assert f"node {node}" in reason, reason
    assert re.search(p.reason, reason), reason
    if p.outcome == "extra":
        want = _reference(method, plans)
    else:
        want = _reference(method, plans, attacker_lost=True)
    _assert_equal(new, want)


def _check_numbers(method, payload, rule, plans):  # noqa: F811
    strategy, new, metrics, state = _round(
        method, plans, PAYLOADS[payload], robust=rule
    )
    assert metrics is not None
    if strategy.round.dropped:  # caught by a method's own consistency checks
        (reason,) = strategy.round.dropped
        assert f"node {ATTACKER}" in reason
        want = _reference(method, plans, attacker_lost=True, robust=rule)
        assert new is not None
        _assert_equal(new, want)
        return
    if new is None:
        assert metrics["rejected"] == 1.0 and strategy.last_rejection
        assert strategy.rejected_rounds == 1
        assert rule == "none" or payload.startswith("huge"), strategy.last_rejection
        return
    assert all(bool(torch.isfinite(t).all()) for t in new.values())
    if rule == "none":
        return
    assert any(f"node {ATTACKER}" in r for r in strategy.round.robust), (
        strategy.round.robust
    )
    want = _reference(method, plans, attacker_lost=True)
    # A record (FOT's sketches, FedLEASE's router, SCAFFOLD's delta) is
    # trimmed in its own space over every reply: when the attacker's record
    # is honest, trimmed mean trims an honest node's record, and the round
    # differs from the one without the attacker by that record.
    honest_record_trimmed = any(
        "record '" in r and f"node {ATTACKER}:" not in r for r in strategy.round.robust
    )
    if rule == "trimmed-mean" and not honest_record_trimmed:
        zero = {k: torch.zeros_like(v) for k, v in want.items()}
        assert _distance(new, want) <= 1e-6 * max(_distance(want, zero), 1.0)
        return
    # median, norm-clip and centred-clip: within PULL times as far from the
    # honest round's result as the honest round moved the model
    moved = _distance(want, state)
    pull = NONLINEAR_PULL.get(method, 2.0) if rule == "median" else 2.0
    assert _distance(new, want) <= pull * moved + 1e-9, (moved, _distance(new, want))


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize(("method", "payload"), COVER_DROP)
def test_malformed_reply_is_dropped_and_the_round_goes_on(method, payload, plans):  # noqa: F811
    _check_dropped(method, payload, plans)


@pytest.mark.parametrize(("method", "payload", "rule"), COVER_NUMERIC)
def test_hostile_numbers_never_publish_a_bad_model(method, payload, rule, plans):  # noqa: F811
    _check_numbers(method, payload, rule, plans)


@pytest.mark.slow
@pytest.mark.parametrize("payload", DROP)
@pytest.mark.parametrize("method", (*PRODUCT_METHODS, *HETERO_RANKS))
def test_every_malformed_reply_on_every_method(method, payload, plans):  # noqa: F811
    _check_dropped(method, payload, plans)


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("payload", NUMERIC)
@pytest.mark.parametrize("method", PRODUCT_METHODS)
def test_every_hostile_number_on_every_method_and_rule(method, payload, rule, plans):  # noqa: F811
    _check_numbers(method, payload, rule, plans)
