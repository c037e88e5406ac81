"""The attacker's payloads: what a malicious client sends instead of its reply.

Each :class:`Payload` turns the client's honest reply (a real Flower
``Message``) into what the attacker sends: a list of messages (none: the
reply is lost; two: a duplicate). ``outcome`` says what the server must do:

``drop``
    the reply is dropped with a reason matching ``reason`` (a regex), and the
    round's result equals the round without the attacker;
``extra``
    the attacker's honest reply is kept and the extra message is dropped with
    ``reason`` (a duplicate, a reply from a node that was not asked): the
    result equals the honest round;
``numeric``
    the reply is well-formed but its numbers are hostile (scaled, huge,
    flipped): validation cannot know, so what happens depends on the robust
    option (see ``tests/adversarial/test_payloads.py``).

Bytes are forged at the level of Flower's ``Array`` (``dtype``, ``shape``,
``stype``, ``data``), exactly what arrives from the network.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict

from fedlr.flower.records import record_to_state, state_to_record
from fedlr.wire import protocol

__all__ = ["PAYLOADS", "Payload", "attack"]

Transform = Callable[[Message, dict[str, torch.Tensor]], list[Message]]
"""``transform(honest_reply, current_global_state) -> messages sent``."""


@dataclass(frozen=True)
class Payload:
    name: str
    outcome: str  # "drop" | "extra" | "numeric"
    transform: Transform
    reason: str = ""


# ------------------------------------------------------------------ helpers
_INSTRUCTIONS: dict[int, Message] = {}
"""The round's instruction to each node (set by :func:`attack`), so forged
replies are routed exactly as the honest one."""


def _copy(message: Message, content: RecordDict) -> Message:
    """A reply to the same instruction as ``message``, with a new content."""
    return Message(content, reply_to=_INSTRUCTIONS[int(message.metadata.src_node_id)])


def _records(message: Message) -> dict[str, object]:
    return dict(message.content)


def _arrays(message: Message) -> ArrayRecord:
    return message.content.array_records[protocol.ARRAYS]


def _first_key(message: Message) -> str:
    """The attacked array: the reply's largest (first by name among equals)."""
    record = _arrays(message)
    return min(record, key=lambda k: (-math.prod(record[k].shape), k))


def _with_array(message: Message, key: str, array: Array) -> list[Message]:
    """The reply with ``arrays[key]`` replaced by a forged ``Array``."""
    records = _records(message)
    arrays = ArrayRecord()
    for name in _arrays(message):
        arrays[name] = array if name == key else _arrays(message)[name]
    records[protocol.ARRAYS] = arrays
    return [_copy(message, RecordDict(records))]


def _forge(message: Message, **fields: object) -> list[Message]:
    """The first array with ``dtype``, ``shape``, ``stype`` or ``data`` forged."""
    key = _first_key(message)
    honest = _arrays(message)[key]
    values = {
        "dtype": honest.dtype,
        "shape": tuple(honest.shape),
        "stype": honest.stype,
        "data": honest.data,
    }
    values.update(fields)
    forged = Array(
        dtype=str(values["dtype"]),
        shape=tuple(values["shape"]),  # type: ignore[arg-type]
        stype=str(values["stype"]),
        data=values["data"],  # type: ignore[arg-type]
    )
    return _with_array(message, key, forged)


def _npy(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def _honest_numpy(message: Message) -> np.ndarray:
    return _arrays(message)[_first_key(message)].numpy()


def _header_claiming(shape: tuple[int, ...], body: bytes) -> bytes:
    """A .npy header claiming ``shape`` (float32) followed by ``body``."""
    buffer = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + body


def _values(message: Message, fn: Callable[[np.ndarray], np.ndarray]) -> list[Message]:
    """The first array's values replaced by ``fn(values)``, dtype declared."""
    honest = _honest_numpy(message)
    new = fn(honest)
    return _forge(message, dtype=str(new.dtype), shape=new.shape, data=_npy(new))


def _with_metrics(message: Message, **changes: object) -> list[Message]:
    records = _records(message)
    metrics = dict(message.content.metric_records[protocol.METRICS])
    for key, value in changes.items():
        if value is _DELETE:
            metrics.pop(key.replace("_", "-"), None)
        else:
            metrics[key.replace("_", "-")] = value  # type: ignore[assignment]
    records[protocol.METRICS] = MetricRecord(metrics)  # type: ignore[arg-type]
    return [_copy(message, RecordDict(records))]


_DELETE = object()


def _without(message: Message, name: str) -> list[Message]:
    records = {k: v for k, v in _records(message).items() if k != name}
    return [_copy(message, RecordDict(records))]


def _arrays_map(
    message: Message, fn: Callable[[str, torch.Tensor], torch.Tensor]
) -> list[Message]:
    state = record_to_state(_arrays(message))
    records = _records(message)
    records[protocol.ARRAYS] = state_to_record({k: fn(k, v) for k, v in state.items()})
    return [_copy(message, RecordDict(records))]


def _scaled(factor: float) -> Transform:
    """``x_ref + factor * (x - x_ref)``: a boosted (or flipped) honest update."""

    def transform(message: Message, current: dict[str, torch.Tensor]) -> list[Message]:
        def move(key: str, x: torch.Tensor) -> torch.Tensor:
            ref = current.get(key)
            base = ref.to(x.dtype) if ref is not None and ref.shape == x.shape else 0
            return base + factor * (x - base)

        return _arrays_map(message, move)

    return transform


def _boosted_claim(message: Message, current: dict[str, torch.Tensor]) -> list[Message]:
    """The attack of issue 14: the update boosted 50x, claiming 1e15 examples."""
    (boosted,) = _scaled(50.0)(message, current)
    return _with_metrics(boosted, num_examples=10**15)


def _error(message: Message, current: dict[str, torch.Tensor]) -> list[Message]:
    instruction = _INSTRUCTIONS[int(message.metadata.src_node_id)]
    return [Message(Error(code=0, reason="attacker"), reply_to=instruction)]


def _duplicate(message: Message, current: dict[str, torch.Tensor]) -> list[Message]:
    (forged,) = _scaled(50.0)(message, current)
    return [message, forged]


def _stranger(message: Message, current: dict[str, torch.Tensor]) -> list[Message]:
    from tests.strategies.conftest import instruction

    (forged,) = _scaled(50.0)(message, current)
    stranger = Message(forged.content, reply_to=instruction(4242))
    return [message, stranger]


def _two_metric_records(message: Message, current: object) -> list[Message]:
    records = _records(message)
    records["more-metrics"] = MetricRecord({protocol.NUM_EXAMPLES: 10**9})
    return [_copy(message, RecordDict(records))]


def _renamed_arrays(message: Message, current: object) -> list[Message]:
    records = _records(message)
    records["weights"] = records.pop(protocol.ARRAYS)
    return [_copy(message, RecordDict(records))]


def _missing_key(message: Message, current: object) -> list[Message]:
    state = record_to_state(_arrays(message))
    state.pop(sorted(state)[0])
    records = _records(message)
    records[protocol.ARRAYS] = state_to_record(state)
    return [_copy(message, RecordDict(records))]


def _extra_key(message: Message, current: object) -> list[Message]:
    state = record_to_state(_arrays(message))
    state["attacker.weight"] = torch.zeros(3)
    records = _records(message)
    records[protocol.ARRAYS] = state_to_record(state)
    return [_copy(message, RecordDict(records))]


def _empty_arrays(message: Message, current: object) -> list[Message]:
    records = _records(message)
    records[protocol.ARRAYS] = ArrayRecord()
    return [_copy(message, RecordDict(records))]


def _structured(message: Message, current: object) -> list[Message]:
    honest = _honest_numpy(message)
    data = np.zeros(honest.shape, dtype=[("x", "<f4")])
    return _forge(message, data=_npy(data))


def _object_array(message: Message, current: object) -> list[Message]:
    honest = _honest_numpy(message)
    data = np.empty(honest.shape, dtype=object)
    data.fill(0.0)
    return _forge(message, data=_npy(data, allow_pickle=True))


def _pickle_bomb(message: Message, current: object) -> list[Message]:
    """A pickle that would run code if it were ever unpickled."""
    import pickle

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("PWNED: a reply was unpickled",))

    return _forge(message, data=pickle.dumps(Boom()))


def _fortran_huge(message: Message, current: object) -> list[Message]:
    honest = _honest_numpy(message)
    return _forge(
        message, data=_header_claiming((10**6, 10**6), b"\0" * (honest.nbytes))
    )


def _body(message: Message) -> bytes:
    return _npy(_honest_numpy(message))


PAYLOADS: dict[str, Payload] = {
    p.name: p
    for p in [
        # ---------------------------------------------- bytes and declarations
        Payload(
            "garbage-bytes",
            "drop",
            lambda m, c: _forge(m, data=bytes(range(256)) * (len(_body(m)) // 256 + 1)),
            r"carries \d+ bytes|does not decode",
        ),
        Payload(
            "garbage-right-length",
            "drop",
            lambda m, c: _forge(m, data=np.random.default_rng(0).bytes(len(_body(m)))),
            "does not decode",
        ),
        Payload(
            "truncated",
            "drop",
            lambda m, c: _forge(m, data=_body(m)[: len(_body(m)) // 2]),
            r"carries \d+ bytes",
        ),
        Payload("empty-bytes", "drop", lambda m, c: _forge(m, data=b""), "carries 0"),
        Payload(
            "padded-10MB",
            "drop",
            lambda m, c: _forge(m, data=_body(m) + b"\0" * 10_000_000),
            r"carries \d+ bytes",
        ),
        Payload(
            "declared-40GB",
            "drop",
            lambda m, c: _forge(m, shape=(100_000, 100_000)),
            r"has shape \(100000, 100000\)",
        ),
        Payload(
            "header-claims-40GB",
            "drop",
            lambda m, c: _forge(
                m,
                data=_header_claiming(
                    (100_000, 100_000), b"\0" * _honest_numpy(m).nbytes
                ),
            ),
            "payload holds",
        ),
        Payload("header-claims-1e12", "drop", _fortran_huge, "payload holds"),
        Payload(
            "header-other-shape",
            "drop",
            lambda m, c: _forge(m, data=_npy(_honest_numpy(m).reshape(-1))),
            "payload holds|does not decode",
        ),
        Payload(
            "big-endian-payload",
            "drop",
            lambda m, c: _forge(m, data=_npy(_honest_numpy(m).astype(">f4"))),
            "payload holds >f4",
        ),
        Payload(
            "big-endian-declared",
            "drop",
            lambda m, c: _forge(
                m, dtype=">f4", data=_npy(_honest_numpy(m).astype(">f4"))
            ),
            "has dtype '>f4'",
        ),
        Payload("structured-dtype", "drop", _structured, "payload holds"),
        Payload("object-dtype-pickle", "drop", _object_array, "payload holds|carries"),
        Payload("pickle-bomb", "drop", _pickle_bomb, r"carries \d+ bytes|decode"),
        Payload(
            "int-dtype",
            "drop",
            lambda m, c: _values(m, lambda v: v.astype(np.int32)),
            "has dtype 'int32'",
        ),
        Payload(
            "complex-dtype",
            "drop",
            lambda m, c: _values(m, lambda v: v.astype(np.complex64)),
            "has dtype 'complex64'",
        ),
        Payload(
            "bfloat16-declared",
            "drop",
            lambda m, c: _forge(m, dtype="bfloat16"),
            "has dtype 'bfloat16'",
        ),
        Payload(
            "torch-stype",
            "drop",
            lambda m, c: _forge(m, stype="torch.Tensor"),
            "has serialisation 'torch.Tensor'",
        ),
        Payload(
            "transposed-shape",
            "drop",
            lambda m, c: _values(
                m, lambda v: np.ascontiguousarray(v.T).reshape(v.shape[::-1])
            ),
            "has shape",
        ),
        Payload(
            "extra-dimension",
            "drop",
            lambda m, c: _values(m, lambda v: v[..., None]),
            "has shape",
        ),
        Payload(
            "scalar",
            "drop",
            lambda m, c: _values(m, lambda v: np.float32(1.0).reshape(())),
            r"has shape \(\)",
        ),
        Payload(
            "nan",
            "drop",
            lambda m, c: _values(m, lambda v: np.full_like(v, np.nan)),
            "NaN or Inf",
        ),
        Payload(
            "one-nan",
            "drop",
            lambda m, c: _values(
                m,
                lambda v: np.where(
                    np.arange(v.size).reshape(v.shape) == 0, np.nan, v
                ).astype(v.dtype),
            ),
            "NaN or Inf",
        ),
        Payload(
            "inf",
            "drop",
            lambda m, c: _values(m, lambda v: np.full_like(v, np.inf)),
            "NaN or Inf",
        ),
        Payload(
            "minus-inf",
            "drop",
            lambda m, c: _values(m, lambda v: np.full_like(v, -np.inf)),
            "NaN or Inf",
        ),
        # ----------------------------------------------------- record structure
        Payload("missing-key", "drop", _missing_key, "wrong keys: 1 missing"),
        Payload("extra-key", "drop", _extra_key, "1 unexpected"),
        Payload("empty-arrays", "drop", _empty_arrays, "wrong keys"),
        Payload(
            "no-arrays",
            "drop",
            lambda m, c: _without(m, protocol.ARRAYS),
            "no ArrayRecord 'arrays'",
        ),
        Payload("renamed-arrays", "drop", _renamed_arrays, "no ArrayRecord 'arrays'"),
        Payload(
            "no-metrics",
            "drop",
            lambda m, c: _without(m, protocol.METRICS),
            "expected one MetricRecord, got 0",
        ),
        Payload(
            "two-metric-records",
            "drop",
            _two_metric_records,
            "expected one MetricRecord, got 2",
        ),
        Payload("client-error", "drop", _error, "client error: attacker"),
        # --------------------------------------------------------------- weight
        Payload(
            "num-examples-missing",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=_DELETE),
            "missing 'num-examples'",
        ),
        Payload(
            "num-examples-zero",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=0),
            "positive integer",
        ),
        Payload(
            "num-examples-negative",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=-5),
            "positive integer",
        ),
        Payload(
            "num-examples-fraction",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=1.5),
            "positive integer",
        ),
        Payload(
            "num-examples-nan",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=math.nan),
            "positive integer",
        ),
        Payload(
            "num-examples-inf",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=math.inf),
            "positive integer",
        ),
        Payload(
            "num-examples-1e15",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=10**15),
            "exceeds max-num-examples",
        ),
        Payload(
            "boosted-50x-claiming-1e15",
            "drop",
            _boosted_claim,
            "exceeds max-num-examples",
        ),
        Payload(
            "num-examples-1e300",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=1e300),
            "exceeds max-num-examples",
        ),
        Payload(
            "num-examples-list",
            "drop",
            lambda m, c: _with_metrics(m, num_examples=[1, 2]),
            "positive integer",
        ),
        Payload(
            "partition-id-nan",
            "drop",
            lambda m, c: _with_metrics(m, partition_id=math.nan),
            "'partition-id' must be a non-negative integer",
        ),
        Payload(
            "partition-id-negative",
            "drop",
            lambda m, c: _with_metrics(m, partition_id=-3),
            "'partition-id' must be a non-negative integer",
        ),
        Payload(
            "partition-id-fraction",
            "drop",
            lambda m, c: _with_metrics(m, partition_id=2.5),
            "'partition-id' must be a non-negative integer",
        ),
        # ---------------------------------------------------------- routing
        Payload("duplicate", "extra", _duplicate, "duplicate reply"),
        Payload("stranger", "extra", _stranger, "not sent an instruction"),
        Payload("lost", "drop", lambda m, c: [], "no reply"),
        # ------------------------------------------ plausible but hostile numbers
        Payload("scaled-50x", "numeric", _scaled(50.0)),
        Payload("flipped-10x", "numeric", _scaled(-10.0)),
        Payload(
            "huge-float32",
            "numeric",
            lambda m, c: _arrays_map(m, lambda k, x: torch.full_like(x, 1e30)),
        ),
        Payload(
            "huge-float64",
            "numeric",
            lambda m, c: _arrays_map(
                m, lambda k, x: torch.full_like(x, 1e300, dtype=torch.float64)
            ),
        ),
    ]
}
"""Every payload, by name."""


def attack(
    payload: Payload,
    reply: Message,
    current: dict[str, torch.Tensor],
    instruction: Message,
) -> list[Message]:
    """The messages the attacker sends instead of ``reply`` to ``instruction``."""
    _INSTRUCTIONS[int(instruction.metadata.dst_node_id)] = instruction
    return payload.transform(reply, current)
