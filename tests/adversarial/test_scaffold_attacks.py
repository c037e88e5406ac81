"""SCAFFOLD-LoRA against a hostile client and a hostile server (issue 35).

A hostile client: every payload of ``tests/adversarial/payloads.py`` applied
to its ``scaffold-delta`` record (not its arrays), through the machinery of
``tests/adversarial/test_payloads.py`` (the seeded, disagreeing replies of
``tests/strategies/test_every_method.py``; node 1000 attacks). No case is
silent: each is dropped with a reason naming node 1000, and then the global
arrays and the control ``c`` equal, bit for bit, those of the round without
the attacker; or it is kept (a duplicate's extra message dropped; a delta
within the screen) with the global arrays of the honest round and a finite
``c`` no further from the honest round's than the attacker's own share.
Finite huge deltas (x1e3 up to 3e38, float64 1e300) are dropped by the
record screen, and a run with such an attacker goes on.

A hostile server: a control the node cannot hold (float64 1e300, Inf after
the cast; finite but beyond the node's bound; NaN; a wrong shape) is refused
with an :class:`~fedlr.errors.InstructionError` naming ``scaffold-control``,
nothing is written to the node's state, and the node's next honest reply is
identical to a fresh node's (or to its own without the hostile round).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping

import pytest
import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedlr.client.round import apply_round
from fedlr.errors import InstructionError
from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig
from fedlr.strategies.scaffold_lora import CONTROL, CONTROL_DELTA, ScaffoldLoRA
from fedlr.wire import protocol
from tests.adversarial.payloads import PAYLOADS, Payload, attack
from tests.plugin_app.client_app import train as plugin_train
from tests.plugin_app.task import build_model
from tests.strategies.test_every_method import (  # noqa: F401 (fixture)
    CASES,
    configure,
    distinct_replies,
    plans,
    warm,
)
from tests.strategies.test_plugin import _context, _instruction

METHOD = "scaffold-lora"
ATTACKER = 1000
CAP = 1000
"""``max-num-examples`` of the round, as in test_payloads.py."""


# ------------------------------------------------------------ hostile client
def _on_delta(payload: Payload) -> Payload:
    """``payload`` acting on the reply's ``scaffold-delta`` instead of its arrays.

    The two records swap names, the payload forges what it takes for
    ``arrays``, and they swap back; the reference of a scaled payload is 0
    (a delta is a change already).
    """

    def swap(message: Message) -> Message:
        if not message.has_content():  # an error reply
            return message
        records = dict(message.content)
        arrays = records.pop(protocol.ARRAYS, None)
        delta = records.pop(CONTROL_DELTA, None)
        if delta is not None:
            records[protocol.ARRAYS] = delta
        if arrays is not None:
            records[CONTROL_DELTA] = arrays
        message.content = RecordDict(records)
        return message

    def transform(message, current):
        return [swap(m) for m in payload.transform(swap(message), {})]

    return dataclasses.replace(payload, transform=transform)


def _full(value: float, dtype: torch.dtype = torch.float32) -> Payload:
    """A delta of ``value`` everywhere (in ``dtype``)."""

    def transform(message, current):
        records = dict(message.content)
        delta = record_to_state(records[CONTROL_DELTA])
        records[CONTROL_DELTA] = ArrayRecord(
            {k: torch.full_like(v, value, dtype=dtype) for k, v in delta.items()}
        )
        message.content = RecordDict(records)
        return [message]

    return Payload(f"full-{value:g}-{dtype}", "numeric", transform)


def _times(factor: float) -> Payload:
    def transform(message, current):
        records = dict(message.content)
        delta = record_to_state(records[CONTROL_DELTA])
        records[CONTROL_DELTA] = ArrayRecord(
            {k: (v.double() * factor).float() for k, v in delta.items()}
        )
        message.content = RecordDict(records)
        return [message]

    return Payload(f"times-{factor:g}", "numeric", transform)


HUGE = {
    p.name: p
    for p in (
        _times(1e3),
        _times(1e10),
        _times(1e30),
        _full(3e38),
        _full(1e30),
        _full(1e300, torch.float64),
    )
}
"""Finite huge deltas: all dropped by the record screen (or the cast)."""

_WARM: dict[str, tuple] = {}


def _warm(plans):  # noqa: F811 (fixture)
    """scaffold-lora after one round of honest, disagreeing clients (c != 0)."""
    if METHOD not in _WARM:
        case = dataclasses.replace(CASES[METHOD], warm_rounds=1)
        plan = plans(METHOD)
        strategy, state = warm(case, plan)
        assert any(bool(v.any()) for v in strategy.control.values())
        _WARM[METHOD] = (case, plan, strategy, state)
    return _WARM[METHOD]


def _round(plans, payload=None, *, lost=False, robust="none"):  # noqa: F811
    case, plan, strategy, state = _warm(plans)
    strategy = copy.deepcopy(strategy)
    strategy.robust = RobustConfig(rule=robust)
    strategy.max_num_examples = CAP
    server_round = 2
    instructions = configure(strategy, plan, server_round, state)
    replies = distinct_replies(case, strategy, server_round, state)
    honest = [r for r in replies if int(r.metadata.src_node_id) != ATTACKER]
    if lost:
        sent = honest
    elif payload is None:
        sent = replies
    else:
        (mine,) = [r for r in replies if int(r.metadata.src_node_id) == ATTACKER]
        sent = attack(payload, mine, dict(state), instructions[ATTACKER]) + honest
    arrays, metrics = strategy.aggregate_train(server_round, sent)
    new = record_to_state(arrays) if arrays is not None else None
    return strategy, new, metrics


_REFERENCE: dict[tuple[bool, str], tuple] = {}


def _reference(plans, *, lost, robust="none"):  # noqa: F811
    if (lost, robust) not in _REFERENCE:
        strategy, new, _ = _round(plans, lost=lost, robust=robust)
        assert new is not None
        _REFERENCE[(lost, robust)] = (new, dict(strategy.control))
    return _REFERENCE[(lost, robust)]


def _same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _distance(a, b) -> float:
    return math.sqrt(
        sum(float((a[k].double() - b[k].double()).square().sum()) for k in a)
    )


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_every_payload_on_the_control_delta_is_dropped_or_harmless(name, plans):  # noqa: F811
    p = PAYLOADS[name]
    strategy, new, metrics = _round(plans, _on_delta(p))
    assert metrics is not None and new is not None  # the run goes on
    assert all(bool(torch.isfinite(v).all()) for v in strategy.control.values())
    if p.outcome == "extra":  # the extra message is dropped, the honest kept
        (reason,) = strategy.round.dropped
        assert re.search(p.reason, reason), reason
        want, control = _reference(plans, lost=False)
        _same(new, want)
        _same(strategy.control, control)
        return
    if strategy.round.dropped:  # dropped: as if the attacker never replied
        (reason,) = strategy.round.dropped
        assert f"node {ATTACKER}" in reason, reason
        if p.outcome == "drop" and not re.search(p.reason, reason):
            # the fault is named in the delta record's own words
            assert CONTROL_DELTA in reason or "no reply" in reason, reason
        want, control = _reference(plans, lost=True)
        _same(new, want)
        _same(strategy.control, control)
        return
    # kept: a well-formed delta within the screen (flipped, or 50x under a
    # floor): the arrays are the honest round's; c moved by at most the
    # attacker's share of the difference
    assert p.outcome == "numeric", (name, "a malformed delta was kept")
    want, control = _reference(plans, lost=False)
    _same(new, want)
    limit = 20 * max(_distance(control, {k: 0 * v for k, v in control.items()}), 1.0)
    assert _distance(strategy.control, control) <= limit


@pytest.mark.parametrize("name", sorted(HUGE))
@pytest.mark.parametrize("robust", ["none", "norm-clip"])
def test_finite_huge_deltas_are_dropped_by_the_record_screen(name, robust, plans):  # noqa: F811
    strategy, new, metrics = _round(plans, HUGE[name], robust=robust)
    assert new is not None and metrics["dropped"] == 1
    (reason,) = strategy.round.dropped
    assert f"node {ATTACKER}" in reason and CONTROL_DELTA in reason, reason
    assert re.search(r"screen-ratio|overflows|not finite", reason), reason
    want, control = _reference(plans, lost=True, robust=robust)
    _same(new, want)
    _same(strategy.control, control)
    norm = math.sqrt(sum(float(v.double().square().sum()) for v in control.values()))
    assert math.isfinite(norm) and norm < 1e3


def test_under_norm_clip_a_flipped_delta_is_clipped_and_named(plans):  # noqa: F811
    strategy, new, _ = _round(
        plans, _on_delta(PAYLOADS["flipped-10x"]), robust="norm-clip"
    )
    assert new is not None
    named = [r for r in strategy.round.robust if f"node {ATTACKER}" in r]
    assert any(CONTROL_DELTA in r for r in named), strategy.round.robust
    _, f, g = strategy.applied[ATTACKER]
    assert f == 1.0 and 0.0 < g < 1.0  # the record clip, told to the node


# ------------------------------------------------------------ hostile server
def _hostile(kind: str, honest: Message) -> Message:
    control = record_to_state(honest.content[CONTROL])
    key = sorted(control)[0]
    if kind == "float64-1e300":  # finite in float64, Inf in float32
        control = {
            k: torch.full_like(v, 1e300, dtype=torch.float64)
            for k, v in control.items()
        }
    elif kind == "finite-1e30":  # finite in float32, beyond the node's bound
        control = {k: torch.full_like(v, 1e30) for k, v in control.items()}
    elif kind == "nan":
        control[key] = torch.full_like(control[key], math.nan)
    else:  # a wrong shape
        control[key] = torch.zeros(control[key].shape[0] + 1, *control[key].shape[1:])
    content = RecordDict(dict(honest.content))
    content[CONTROL] = ArrayRecord(control)
    return _copy_message(honest, content)


def _copy_message(message: Message, content: RecordDict) -> Message:
    out = Message(
        content=content,
        dst_node_id=int(message.metadata.dst_node_id),
        message_type=message.metadata.message_type,
    )
    out.metadata.__dict__["_message_id"] = message.metadata.message_id
    return out


def _honest(strategy: ScaffoldLoRA, model, seed: int) -> Message:
    g = torch.Generator().manual_seed(seed)
    strategy.control = {
        k: 0.05 * torch.randn(v.shape, generator=g) for k, v in strategy.control.items()
    }
    message = _instruction(strategy, model)
    arrays = message.content.array_records[protocol.ARRAYS]
    [message] = strategy.instructions(1, [message], arrays, train=True)
    return message


def _assert_identical(a: Message, b: Message) -> None:
    assert set(a.content.keys()) == set(b.content.keys())
    for name, record in a.content.array_records.items():
        _same(record_to_state(record), record_to_state(b.content.array_records[name]))
    for name, record in a.content.metric_records.items():
        assert dict(record) == dict(b.content.metric_records[name])


@pytest.mark.parametrize("kind", ["float64-1e300", "finite-1e30", "nan", "shape"])
def test_a_hostile_control_is_refused_and_the_next_reply_is_a_fresh_nodes(kind):
    model = build_model(METHOD)
    strategy = ScaffoldLoRA.for_model(model)
    honest = _honest(strategy, model, 3)
    context, fresh = _context(), _context()
    with pytest.raises(InstructionError, match=CONTROL):
        apply_round(build_model(METHOD), _hostile(kind, honest), context)
    assert "fedlr-scaffold" not in context.state  # nothing was kept
    _assert_identical(plugin_train(honest, context), plugin_train(honest, fresh))
    assert context.state.keys() == fresh.state.keys()
    _same(
        record_to_state(context.state["fedlr-scaffold"]),
        record_to_state(fresh.state["fedlr-scaffold"]),
    )


@pytest.mark.parametrize("kind", ["float64-1e300", "finite-1e30"])
def test_a_hostile_control_leaves_a_nodes_own_c_i_untouched(kind):
    model = build_model(METHOD)
    strategy = ScaffoldLoRA.for_model(model)
    context = _context()
    plugin_train(_honest(strategy, model, 3), context)  # the node has state
    strategy.applied[1000] = (1, 1.0, 1.0)  # and the server applied it
    untouched = copy.deepcopy(context)
    stored = record_to_state(context.state["fedlr-scaffold"])
    honest = _honest(strategy, model, 4)
    with pytest.raises(InstructionError, match=CONTROL):
        apply_round(build_model(METHOD), _hostile(kind, honest), context)
    _same(record_to_state(context.state["fedlr-scaffold"]), stored)
    _assert_identical(plugin_train(honest, context), plugin_train(honest, untouched))


def test_the_node_bound_is_its_own_config_not_the_message():
    """``scaffold-control-limit`` comes from the node config: a node that sets
    it tighter refuses a control an ordinary node accepts."""
    model = build_model(METHOD)
    strategy = ScaffoldLoRA.for_model(model)
    honest = _honest(strategy, model, 3)
    strict = _context()
    strict.node_config = {**strict.node_config, "scaffold-control-limit": 1e-9}
    with pytest.raises(InstructionError, match="scaffold-control-limit"):
        apply_round(build_model(METHOD), honest, strict)
    job = apply_round(build_model(METHOD), honest, _context())
    assert [type(f).__name__ for f in job.features] == ["ScaffoldCorrection"]
