"""The factored FedEx downlink (fedlr.wire.downlink): kernels against float64
references, the record format, the client's receive path and the ledger."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from fedlr.errors import BaseOutOfSyncError, ShapeMismatchError
from fedlr.flower.records import state_to_record
from fedlr.linalg import stacked_residual
from fedlr.round.ledger import BaseLedger
from fedlr.wire import protocol
from fedlr.wire.downlink import (
    CHECK_TOLERANCE,
    LOWRANK,
    VERA,
    BaseDelta,
    checksum,
    decode_steps,
    encode_steps,
    lowrank_delta,
    receive_base,
    vera_delta,
)

F64 = torch.float64


def _clients(k: int, r: int, d_out: int, d_in: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d_out, r, generator=g) for _ in range(k)]
    as_ = [torch.randn(r, d_in, generator=g) for _ in range(k)]
    w = torch.rand(k, generator=g, dtype=F64) + 0.1
    return bs, as_, w


def _fedex_reference(bs, as_, w, scaling):
    """``s (sum_i w_i B_i A_i - B_bar A_bar)`` densely in float64."""
    w = w / w.sum()
    mean = sum(
        wi * b.double() @ a.double() for wi, b, a in zip(w, bs, as_, strict=True)
    )
    b_bar = sum(wi * b.double() for wi, b in zip(w, bs, strict=True))
    a_bar = sum(wi * a.double() for wi, a in zip(w, as_, strict=True))
    return scaling * (mean - b_bar @ a_bar)


@pytest.mark.parametrize(
    ("k", "r", "d_out", "d_in"),
    [(1, 2, 16, 24), (2, 4, 48, 32), (3, 4, 64, 64), (5, 2, 96, 40), (4, 8, 384, 384)],
)
def test_lowrank_delta_is_the_fedex_residual(k, r, d_out, d_in):
    bs, as_, w = _clients(k, r, d_out, d_in, seed=k * 100 + r)
    residual = stacked_residual(bs, as_, w)
    delta = lowrank_delta(residual.left, residual.right, 2.0)
    assert delta is not None and delta.kind == LOWRANK
    # The centred form has rank at most (k - 1) r.
    assert delta.rank <= (k - 1) * r
    assert delta.left.dtype == torch.float32
    base = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(1))
    got = delta.apply(base).double()
    want = base.double() + _fedex_reference(bs, as_, w, 2.0)
    err = torch.linalg.matrix_norm(got - want) / torch.linalg.matrix_norm(want)
    assert float(err) < 1e-6
    # The server's fold gives the same weights to float32 rounding.
    fold = residual.fold(base, 2.0).double()
    assert float(torch.linalg.matrix_norm(got - fold)) <= 1e-6 * float(
        torch.linalg.matrix_norm(fold)
    )


def test_lowrank_delta_refuses_when_not_smaller_than_dense():
    bs, as_, w = _clients(9, 4, 16, 16, seed=3)  # (k - 1) r = 32 > 16 / 2
    residual = stacked_residual(bs, as_, w)
    assert lowrank_delta(residual.left, residual.right, 1.0) is None


def test_identical_clients_send_an_empty_change():
    bs, as_, _ = _clients(1, 4, 32, 32, seed=5)
    residual = stacked_residual(bs * 3, as_ * 3, [1.0, 2.0, 3.0])
    delta = lowrank_delta(residual.left, residual.right, 1.0)
    assert delta is not None and delta.rank == 0
    base = torch.randn(32, 32)
    assert torch.equal(delta.apply(base), base)


@pytest.mark.parametrize(
    ("k", "r", "d_out", "d_in"), [(2, 16, 32, 24), (4, 64, 96, 80)]
)
def test_vera_delta_is_the_vera_fedex_residual(k, r, d_out, d_in):
    g = torch.Generator().manual_seed(k + r)
    a = torch.randn(r, d_in, generator=g)
    b = torch.randn(d_out, r, generator=g)
    lbs = [torch.randn(d_out, generator=g) for _ in range(k)]
    lds = [torch.randn(r, generator=g) for _ in range(k)]
    w = torch.rand(k, generator=g, dtype=F64) + 0.1
    delta = vera_delta(lbs, lds, w, 0.5, d_in)
    assert delta is not None and delta.kind == VERA
    assert delta.rank <= k - 1
    assert tuple(delta.right.shape) == (delta.rank, r)
    # Dense float64 reference: s (sum_i w_i Lb_i B Ld_i A - Lb_bar B Ld_bar A).
    bs = [torch.diag(lb.double()) @ b.double() for lb in lbs]
    as_ = [torch.diag(ld.double()) @ a.double() for ld in lds]
    base = torch.randn(d_out, d_in, generator=g)
    want = base.double() + _fedex_reference(bs, as_, w, 0.5)
    got = delta.apply(base, lambda o, i: (a[:, :i], b[:o])).double()
    err = torch.linalg.matrix_norm(got - want) / torch.linalg.matrix_norm(want)
    assert float(err) < 1e-6
    with pytest.raises(ValueError, match="projections"):
        delta.apply(base)


def test_delta_shapes_are_checked():
    delta = BaseDelta(LOWRANK, torch.zeros(8, 2), torch.zeros(2, 6))
    with pytest.raises(ShapeMismatchError, match=r"\(8, 2\)"):
        delta.apply(torch.zeros(7, 6))
    with pytest.raises(ShapeMismatchError, match=r"\(2, 6\)"):
        delta.apply(torch.zeros(8, 5))
    with pytest.raises(ShapeMismatchError, match="do not multiply"):
        BaseDelta(LOWRANK, torch.zeros(8, 2), torch.zeros(3, 6))
    with pytest.raises(ValueError, match="kind"):
        BaseDelta("sparse", torch.zeros(8, 2), torch.zeros(2, 6))


def test_steps_round_trip_through_an_array_record():
    g = torch.Generator().manual_seed(0)
    steps = [
        (
            v,
            {
                key: BaseDelta(
                    LOWRANK,
                    torch.randn(6, 2, generator=g),
                    torch.randn(2, 5, generator=g),
                )
                for key in (
                    "layer.0.q.base_layer.weight",
                    "layer.0.v.base_layer.weight",
                )
            },
        )
        for v in (3, 4)
    ]
    decoded = decode_steps(encode_steps(steps))
    assert sorted(decoded) == [3, 4]
    for v, deltas in steps:
        for key, delta in deltas.items():
            assert torch.equal(decoded[v][key].left, delta.left)
            assert torch.equal(decoded[v][key].right, delta.right)


@pytest.mark.parametrize(
    "name", ["w:lowrank:k:left", "3:sparse:k:left", "3:lowrank:k:middle", "nonsense"]
)
def test_malformed_step_keys_are_refused(name):
    record = state_to_record({name: torch.zeros(2, 2)})
    with pytest.raises(BaseOutOfSyncError, match="malformed"):
        decode_steps(record)


def test_checksum_tolerates_rounding_and_catches_drift():
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(2))
    c = checksum("k", w)
    norm = float(torch.linalg.vector_norm(w.double()))
    ulp = w * (1 + torch.finfo(torch.float32).eps)
    assert abs(checksum("k", ulp) - c) <= CHECK_TOLERANCE * norm
    drifted = w.clone()
    drifted[3, 4] += 0.01 * norm
    assert abs(checksum("k", drifted) - c) > CHECK_TOLERANCE * norm
    # The pattern depends on the key: another key gives another sum.
    assert checksum("other", w) != c


# --------------------------------------------------------------- client side
KEYS = ["l0.base_layer.weight", "l1.base_layer.weight"]


def _base(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(40, 30, generator=g) for k in KEYS}


def _delta(seed: int) -> dict[str, BaseDelta]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: BaseDelta(
            LOWRANK, torch.randn(40, 2, generator=g), torch.randn(2, 30, generator=g)
        )
        for k in KEYS
    }


def _instruction(version, checks, received=None, steps=None):
    content = RecordDict()
    if steps:
        content[protocol.BASE_DELTA] = encode_steps(steps)
    config = ConfigRecord({protocol.BASE_VERSION: version, protocol.BASE_CHECK: checks})
    return received or {}, content, config


def _checks(base):
    return [checksum(k, base[k]) for k in KEYS]


def test_receive_dense_then_changes_then_skip_held():
    state = RecordDict()
    v1 = _base(0)
    got = receive_base(*_instruction(1, _checks(v1), received=v1), state, KEYS)
    assert got is not None and got[1] == 1
    d2, d3 = _delta(2), _delta(3)
    v2 = {k: d2[k].apply(v1[k]) for k in KEYS}
    v3 = {k: d3[k].apply(v2[k]) for k in KEYS}
    # A node at version 1 gets the chain 2, 3 and reaches the server's v3.
    base, version = receive_base(
        *_instruction(3, _checks(v3), steps=[(2, d2), (3, d3)]), state, KEYS
    )
    assert version == 3 and all(torch.equal(base[k], v3[k]) for k in KEYS)
    # Sent the same chain again (the server did not hear it holds 3): skipped.
    base, version = receive_base(
        *_instruction(3, _checks(v3), steps=[(2, d2), (3, d3)]), state, KEYS
    )
    assert version == 3 and all(torch.equal(base[k], v3[k]) for k in KEYS)
    # Current and nothing changed: no steps at all.
    base, version = receive_base(*_instruction(3, _checks(v3)), state, KEYS)
    assert version == 3


def test_receive_refuses_what_it_cannot_reach():
    v1 = _base(0)
    d2, d3 = _delta(2), _delta(3)
    v3 = {k: d3[k].apply(d2[k].apply(v1[k])) for k in KEYS}
    with pytest.raises(BaseOutOfSyncError, match="keeps no base weights"):
        receive_base(*_instruction(3, _checks(v3), steps=[(3, d3)]), RecordDict(), KEYS)
    state = RecordDict()
    receive_base(*_instruction(1, _checks(v1), received=v1), state, KEYS)
    with pytest.raises(BaseOutOfSyncError, match="start at 2"):
        receive_base(*_instruction(3, _checks(v3), steps=[(3, d3)]), state, KEYS)
    with pytest.raises(BaseOutOfSyncError, match="needs 3"):
        receive_base(*_instruction(3, _checks(v3)), state, KEYS)
    # A drifted copy fails the checksum, and is not stored.
    drifted = dict(v1)
    drifted[KEYS[1]] = v1[KEYS[1]] + 0.5
    state = RecordDict()
    receive_base(*_instruction(1, _checks(drifted), received=drifted), state, KEYS)
    v2 = {k: d2[k].apply(v1[k]) for k in KEYS}
    with pytest.raises(BaseOutOfSyncError, match=r"checksum on \['l1"):
        receive_base(*_instruction(2, _checks(v2), steps=[(2, d2)]), state, KEYS)


def test_no_version_means_nothing_to_do():
    assert receive_base({}, RecordDict(), ConfigRecord(), RecordDict(), KEYS) is None


# --------------------------------------------------------------- ledger
def test_ledger_plans_dense_chain_or_nothing():
    ledger = BaseLedger(list(KEYS))
    v = _base(0)
    ledger.sync(v)
    assert ledger.version == 0 and ledger.plan(7) is None  # unknown node
    ledger.confirm(7, 0)
    assert ledger.plan(7) == []  # current
    for step in (1, 2, 3):
        d = _delta(step)
        v = {k: d[k].apply(v[k]) for k in KEYS}
        ledger.publish(d, v)
        ledger.sync(v)  # the same arrays come back next round: same version
    assert ledger.version == 3
    plan = ledger.plan(7)
    assert plan is not None and [s for s, _ in plan] == [1, 2, 3]
    ledger.confirm(8, 2)
    assert [s for s, _ in ledger.plan(8)] == [3]
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        ledger.confirm(9, 4)
    with pytest.raises(ValueError):
        ledger.confirm(9, 1.5)
    # A dense-only step breaks every chain through it.
    ledger.publish(None, v)
    assert ledger.plan(8) is None and ledger.plan(7) is None
    ledger.confirm(8, 4)
    assert ledger.plan(8) == []


def test_ledger_keeps_only_changes_cheaper_than_dense():
    ledger = BaseLedger(list(KEYS))
    v = _base(0)
    # Dense: 2 x 40 x 30 x 4 = 9600 bytes; a step: 2 x 2 x 70 x 4 = 1120.
    ledger.sync(v)
    ledger.confirm(1, 0)
    for step in range(1, 10):
        ledger.publish(_delta(step), v)
    assert [s.version for s in ledger.steps] == list(range(2, 10))
    assert ledger.plan(1) is None  # missed more than the dense weights weigh


def test_ledger_starts_a_new_version_for_arrays_it_did_not_publish():
    ledger = BaseLedger(list(KEYS))
    ledger.sync(_base(0))
    ledger.confirm(1, 0)
    ledger.sync(_base(1))  # e.g. resumed from other arrays
    assert ledger.version == 1 and ledger.plan(1) is None and not ledger.steps


def test_ledger_skips_the_checksums_for_the_same_source_objects(monkeypatch):
    """configure_evaluate after configure_train hands the same Arrays: no
    second pass over the weights; new objects, a publish or a restored state
    always check again (a rejected round can bring old arrays back)."""
    import fedlr.round.ledger as ledger_module
    from fedlr.flower.records import record_views

    calls: list[str] = []
    real = ledger_module.checksum
    monkeypatch.setattr(
        ledger_module, "checksum", lambda k, w: calls.append(k) or real(k, w)
    )
    ledger = BaseLedger(list(KEYS))
    record = state_to_record(_base(0))
    sources = [record[k] for k in KEYS]
    ledger.sync(record_views(record, KEYS), source=sources)
    assert len(calls) == len(KEYS) and ledger.version == 0
    ledger.sync(record_views(record, KEYS), source=sources)
    assert len(calls) == len(KEYS)  # same objects: skipped
    # the same values in new objects are checked (and keep the version)
    again = state_to_record(_base(0))
    ledger.sync(record_views(again, KEYS), source=[again[k] for k in KEYS])
    assert len(calls) == 2 * len(KEYS) and ledger.version == 0
    # other weights under the remembered objects' successors: a new version
    other = state_to_record(_base(1))
    ledger.sync(record_views(other, KEYS), source=[other[k] for k in KEYS])
    assert ledger.version == 1
    # a restored state forgets the source: the old arrays are checked again
    state = ledger.state_dict()
    ledger.sync(record_views(other, KEYS), source=[other[k] for k in KEYS])
    ledger.load_state_dict(state)
    calls.clear()
    ledger.sync(record_views(again, KEYS), source=[again[k] for k in KEYS])
    assert len(calls) == len(KEYS) and ledger.version == 2
    # publish forgets it too
    ledger.publish(_delta(1), _base(0))
    calls.clear()
    ledger.sync(record_views(again, KEYS), source=[again[k] for k in KEYS])
    assert len(calls) == len(KEYS)


def test_record_views_equal_the_decoded_arrays_without_a_copy():
    from fedlr.flower.records import record_to_state, record_views

    state = {
        "w": torch.randn(5, 3),
        "t": torch.randn(4, 6).t(),  # non-contiguous source
        "d": torch.randn(7, dtype=F64),
        "h": torch.randn(2, 2).half(),
        "s": torch.tensor(3.0),
    }
    record = state_to_record(state)
    views = record_views(record, state)
    decoded = record_to_state(record)
    for key, want in decoded.items():
        assert views[key].dtype == want.dtype and torch.equal(views[key], want)
        assert views[key].data_ptr() != want.data_ptr()
    # a view points into the Array's payload bytes (CPython: a bytes object's
    # data follows its header at id()), i.e. nothing was copied
    payload = record["w"].data
    start = id(payload)
    assert start < views["w"].data_ptr() < start + len(payload) + 64


def test_ledger_state_round_trip():
    ledger = BaseLedger(list(KEYS))
    v = _base(0)
    ledger.sync(v)
    ledger.confirm(5, 0)
    ledger.publish(_delta(1), v)
    copy = BaseLedger(list(KEYS))
    copy.load_state_dict(ledger.state_dict())
    assert copy.version == 1 and copy.checks == ledger.checks
    assert copy.last_change_nbytes == ledger.last_change_nbytes
    # Who keeps what is not saved: after a resume every node gets dense once.
    assert copy.held == {} and copy.plan(5) is None
    copy.confirm(5, 0)
    (step,) = copy.plan(5)
    assert torch.equal(step[1][KEYS[0]].left, _delta(1)[KEYS[0]].left)
    # A rejected round restores the state and keeps the round's confirmations.
    ledger.confirm(6, 1)
    ledger.load_state_dict(ledger.state_dict())
    assert ledger.held == {5: 0, 6: 1}
