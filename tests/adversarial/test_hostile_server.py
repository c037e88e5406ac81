"""A hostile server against the real client code path, in process.

Each payload kind's node (fedlr's dispatching ClientApp, ``client_apps.app``,
with its process caches and a real ``Context``) first serves an honest round;
then every row of ``CASES`` edits that node's honest instruction the way a
hostile (or broken) server would and hands it to the same node. For every
row:

* no crash: the app returns an error reply whose reason names the refused
  key (:class:`fedlr.errors.InstructionError`);
* no unbounded allocation: during the call, the traced Python/numpy peak
  (``tracemalloc``) stays under ``ALLOC_BOUND`` and the process's peak
  resident memory (``VmHWM``, reset before the call) grows by less than
  ``RSS_BOUND``; the forged ``.npy`` headers claim 40 GB;
* nothing changed: the node's ``context.state`` (every record, byte for
  byte) and its cached model (every tensor, and its rank) are as before.

After the table, the honest instruction on the same node and cache must
succeed and reply exactly (bit for bit) what a copy of the node taken before
the table replies: no bricked node. ``test_rank_32_then_honest_fedex_lora``
is the scenario of a ``lora-rank`` the node accepted (a well-formed one)
followed by honest FedEx-LoRA rounds without it.
"""

from __future__ import annotations

import copy
import io
import math
import re
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedlr.client.checks import (
    BOUNDS,
    MAX_BATCH_SIZE,
    MAX_LOCAL_STEPS,
    Bound,
    bound_of,
    declared_keys,
)
from fedlr.client_apps import gpse, lora, qrmix, vera
from fedlr.errors import ConfigError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.client_app import app
from fedlr.server_apps.builtin_plans import build_plan
from fedlr.strategies.registry import client_features, resolve
from fedlr.wire import protocol
from tests.conftest import ROOT, tiny_run_config

ALLOC_BOUND = 16 * 2**20
"""Traced peak (bytes) a refused instruction may allocate."""
RSS_BOUND = 64 * 2**20
"""Growth of the peak resident memory (bytes) a refused instruction may cause."""
HUGE = (100_000, 100_000)
"""A shape whose float32 payload is 40 GB."""
NODE = 1000


# ------------------------------------------------------------------ nodes
@dataclass
class Env:
    """One payload kind's node after an honest round, and its next instruction."""

    kind: str
    context: Context
    instruction: Message
    cache: Callable[[], list[torch.nn.Module]]


def _cached_models(kind: str) -> list[torch.nn.Module]:
    if kind == "lora":
        return [m.model for m in lora.CLIENT._models.values()]
    if kind == "vera":
        return [m.model for m in vera.CLIENT._models.values()]
    if kind == "qrmix":
        return list(qrmix._MODELS.values())
    return list(gpse._MODELS.values())


def _vision_config(method: str, tmp: Path, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"method": method, "seed": 3, "device": "cpu"}
    base["output-dir"] = str(tmp)
    if method == "qrmix":
        base.update(model="cnn", dataset="digits", lr=0.05, **{"qrmix-k": 4})
        base.update({"num-partitions": 3, "warmup-rounds": 1, "local-steps": 2})
    else:
        base.update(model="mlp", dataset="permuted-mnist", lr=0.1)
        base.update({"num-partitions": 3, "task-examples": 200, "num-tasks": 3})
        base.update({"rounds-per-task": 1, "num-server-rounds": 3})
        base.update({"fot-sketch-dim": 16, "local-steps": 2})
    base.update(overrides)
    return base


def _stamp(message: Message, n: int) -> Message:
    message.metadata.__dict__["_message_id"] = f"hostile-{n}"
    return message


def _setup(kind: str, config: dict[str, Any], rounds: int) -> Env:
    """Run ``rounds`` honest rounds; return node 1000 and its next instruction."""
    plan = build_plan(resolve(config))
    strategy = plan.strategy
    grid = InProcessGrid(app, num_nodes=3, run_config=config)
    arrays = ArrayRecord({k: v for k, v in plan.initial_arrays.items()})
    train = ConfigRecord(plan.train_config)
    for server_round in range(1, rounds + 1):
        messages = list(strategy.configure_train(server_round, arrays, train, grid))
        replies = list(grid.send_and_receive(messages))
        assert not any(r.has_error() for r in replies), [
            r.error for r in replies if r.has_error()
        ]
        new, _ = strategy.aggregate_train(server_round, replies)
        assert new is not None
        arrays = new
    messages = strategy.configure_train(rounds + 1, arrays, train, grid)
    (instruction,) = [m for m in messages if m.metadata.dst_node_id == NODE]
    return Env(
        kind, grid.contexts[NODE], _stamp(instruction, 0), lambda: _cached_models(kind)
    )


@pytest.fixture(scope="module")
def envs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Env]]:
    from fedlr.data.assets import ensure_assets

    ensure_assets(["polarity", "minilm", "mnist"], quiet=True)
    tmp = tmp_path_factory.mktemp("hostile")
    built = {
        # round 2 of FedEx-LoRA: base weights kept, changes sent factored
        "lora": _setup("lora", tiny_run_config(tmp, method="fedex-lora"), 1),
        "vera": _setup(
            "vera",
            tiny_run_config(tmp, method="fedavg-vera", **{"vera-rank": 8}),
            1,
        ),
        # round 2 of QR-Mix: stage 2 (eigenpairs in the reply)
        "qrmix": _setup("qrmix", _vision_config("qrmix", tmp), 1),
        # round 2 of FOT: a task boundary (sketches of task 0 in the reply)
        "gpse": _setup("gpse", _vision_config("fot", tmp), 1),
    }
    yield built


# ------------------------------------------------------------------ edits
def _content(message: Message) -> dict[str, Any]:
    return dict(message.content)


def _message(like: Message, content: dict[str, Any], n: int = 1) -> Message:
    out = Message(
        content=RecordDict(content),
        dst_node_id=like.metadata.dst_node_id,
        message_type=like.metadata.message_type,
        group_id=like.metadata.group_id,
    )
    return _stamp(out, n)


def _set(**changes: Any) -> Callable[[Message], tuple[Message, str]]:
    """Edit ConfigRecord keys (kebab-case from ``_``); the first one is refused."""
    items = {k.replace("_", "-"): v for k, v in changes.items()}

    def edit(message: Message) -> tuple[Message, str]:
        content = _content(message)
        config = dict(content[protocol.CONFIG])
        config.update(items)
        content[protocol.CONFIG] = ConfigRecord(config)
        return _message(message, content), next(iter(items))

    return edit


def _first(record: ArrayRecord, role: str = "") -> str:
    """The first key of ``record`` (whose name ends with ``role``, if given)."""
    return next(k for k in record if k.endswith(role)) if role else next(iter(record))


def _npy(values: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return buffer.getvalue()


def _header_claiming(shape: tuple[int, ...], body: bytes) -> bytes:
    buffer = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + body


def _forge(
    name: str = protocol.ARRAYS, role: str = "", **fields: Any
) -> Callable[[Message], tuple[Message, str]]:
    """One array of record ``name`` with its dtype, shape, stype or data forged."""

    def edit(message: Message) -> tuple[Message, str]:
        content = _content(message)
        record = content[name]
        key = _first(record, role)
        honest = record[key]
        values: dict[str, Any] = {
            "dtype": honest.dtype,
            "shape": tuple(honest.shape),
            "stype": honest.stype,
            "data": honest.data,
        }
        for field, value in fields.items():
            values[field] = value(honest) if callable(value) else value
        forged = Array(
            dtype=str(values["dtype"]),
            shape=tuple(values["shape"]),
            stype=str(values["stype"]),
            data=values["data"],
        )
        content[name] = ArrayRecord(
            {k: forged if k == key else record[k] for k in record}
        )
        return _message(message, content), key

    return edit


def _huge_header(honest: Array) -> bytes:
    """A 40 GB claim in the header, with as many bytes as the declared shape."""
    claim = _header_claiming(HUGE, b"")
    assert math.prod(HUGE) * 4 >= 40e9
    return claim + bytes(max(len(honest.data) - len(claim), 0))


def _values(fn: Callable[[np.ndarray], np.ndarray], role: str = "") -> Any:
    def edit(message: Message) -> tuple[Message, str]:
        record = message.content.array_records[protocol.ARRAYS]
        new = fn(record[_first(record, role)].numpy())
        return _forge(
            role=role, dtype=str(new.dtype), shape=tuple(new.shape), data=_npy(new)
        )(message)

    return edit


def _extra_array(message: Message) -> tuple[Message, str]:
    content = _content(message)
    record = content[protocol.ARRAYS]
    arrays = {k: record[k] for k in record}
    arrays["evil.weight"] = Array(np.zeros((4, 4), dtype=np.float32))
    content[protocol.ARRAYS] = ArrayRecord(arrays)
    return _message(message, content), "evil.weight"


def _missing_array(role: str) -> Callable[[Message], tuple[Message, str]]:
    def edit(message: Message) -> tuple[Message, str]:
        content = _content(message)
        record = content[protocol.ARRAYS]
        key = _first(record, role)
        content[protocol.ARRAYS] = ArrayRecord(
            {k: record[k] for k in record if k != key}
        )
        return _message(message, content), key

    return edit


def _record(name: str, arrays: dict[str, Array], key: str) -> Any:
    def edit(message: Message) -> tuple[Message, str]:
        content = _content(message)
        content[name] = ArrayRecord(arrays)
        return _message(message, content), key

    return edit


def _personal_wrong_shape(message: Message) -> tuple[Message, str]:
    """A ``personal`` record of every layer's ``B``, the first one transposed."""
    record = message.content.array_records[protocol.ARRAYS]
    keys = [k for k in record if k.endswith(B)]
    arrays = {
        k: Array(np.zeros(tuple(record[k].shape)[:: -1 if k == keys[0] else 1], "f4"))
        for k in keys
    }
    return _record(protocol.PERSONAL, arrays, keys[0])(message)


def _base_delta_unknown(message: Message) -> tuple[Message, str]:
    name = "1:lowrank:evil.weight:left"
    return _record(
        protocol.BASE_DELTA, {name: Array(np.zeros((2, 2), np.float32))}, name
    )(message)


def _base_delta_huge(message: Message) -> tuple[Message, str]:
    content = _content(message)
    record = content[protocol.BASE_DELTA]
    key = _first(record)
    honest = record[key]
    forged = Array(
        dtype="float32", shape=HUGE, stype="numpy.ndarray", data=_huge_header(honest)
    )
    content[protocol.BASE_DELTA] = ArrayRecord(
        {k: forged if k == key else record[k] for k in record}
    )
    return _message(message, content), key


def _bases(shape: tuple[int, ...], layer: str | None = None) -> Any:
    def edit(message: Message) -> tuple[Message, str]:
        name = layer or gpse._MODELS[next(iter(gpse._MODELS))].projected_layers()[0]
        values = np.zeros(shape, dtype=np.float32)
        content = _content(message)
        content[protocol.BASES] = ArrayRecord({name: Array(values)})
        config = dict(content[protocol.CONFIG])
        config[protocol.GPSE_TASK] = 0
        content[protocol.CONFIG] = ConfigRecord(config)
        return _message(message, content), name

    return edit


A, B = "lora_A.weight", "lora_B.weight"


def _rank_32_narrow_arrays(message: Message) -> tuple[Message, str]:
    """``lora-rank`` 32 with the honest rank-4 arrays: the first factor is refused."""
    out, _ = _set(lora_rank=32)(message)
    record = message.content.array_records[protocol.ARRAYS]
    return out, next(k for k in record if k.endswith((A, B)))


def _leading_too_wide(message: Message) -> tuple[Message, str]:
    """``leading-rank`` with a layer's ``A`` and ``B`` of rank 33 > max(32, 32)."""
    with_leading, _ = _set(leading_rank=True)(message)
    content = _content(with_leading)
    state = record_to_state(content[protocol.ARRAYS])
    key = next(k for k in state if k.endswith(A))
    layer = key.removesuffix(A)
    state[key] = torch.zeros(33, state[key].shape[1])
    state[layer + B] = torch.zeros(state[layer + B].shape[0], 33)
    content[protocol.ARRAYS] = state_to_record(state)
    first = next(k for k in state if k.endswith((A, B)) and k.startswith(layer))
    return _message(message, content), first


NAN = float("nan")

COMMON = [
    ("local-steps 1e9", _set(local_steps=10**9)),
    ("local-steps 1e9 as a float", _set(local_steps=1e9)),
    ("local-steps 0", _set(local_steps=0)),
    ("batch-size 0", _set(batch_size=0)),
    ("batch-size -8", _set(batch_size=-8)),
    ("batch-size 1e6", _set(batch_size=10**6)),
    ("lr NaN", _set(lr=NAN)),
    ("lr -0.1", _set(lr=-0.1)),
    ("lr 0", _set(lr=0.0)),
    ("lr inf", _set(lr=float("inf"))),
    ("server-round -1", _set(server_round=-1)),
    ("server-round 2^40", _set(server_round=2**40)),
    ("array: 40 GB npy header", _forge(data=_huge_header)),
    ("array: 40 GB declared shape", _forge(shape=HUGE)),
    ("array: wrong shape", _forge(shape=lambda a: (1, *a.shape))),
    ("array: int64 dtype", _values(lambda v: v.astype(np.int64))),
    (
        "array: float64 bytes declared float32",
        _forge(data=lambda a: _npy(a.numpy().astype(np.float64))),
    ),
    ("array: truncated bytes", _forge(data=lambda a: a.data[: len(a.data) // 2])),
    ("array: pickle stype", _forge(stype="pickle")),
    ("array: NaN values", _values(lambda v: np.full_like(v, np.nan))),
    ("array: unknown key", _extra_array),
]

CASES: dict[str, list[tuple[str, Any]]] = {
    "lora": [
        *COMMON,
        ("lora-rank 32, arrays at rank 4", _rank_32_narrow_arrays),
        ("lora-rank 33 (> the 32 x 32 layers)", _set(lora_rank=33)),
        ("lora-rank 0", _set(lora_rank=0)),
        ("lora-rank -4", _set(lora_rank=-4)),
        ("lora-rank 1e9", _set(lora_rank=10**9)),
        ("lora-alpha NaN", _set(lora_alpha=NAN)),
        ("lora-alpha 0", _set(lora_alpha=0.0)),
        ("prune-gamma 2", _set(prune_gamma=2.0)),
        ("prune-lambda -1", _set(prune_lambda=-1.0)),
        ("proximal-mu NaN", _set(proximal_mu=NAN)),
        ("base-version -5", _set(base_version=-5)),
        ("base-check strings", _set(base_check=["a", "b"])),
        ("base-check 100 items", _set(base_check=[0.0] * 100)),
        ("leading-rank a string", _set(leading_rank="yes")),
        ("train-roles unknown", _set(train_roles="lora_Z")),
        ("leading-rank, A of rank 33", _leading_too_wide),
        ("array: missing lora_A of one layer", _missing_array(A)),
        ("array: B transposed", _forge(role=B, shape=lambda a: tuple(a.shape)[::-1])),
        ("personal: wrong shape", _personal_wrong_shape),
        ("base-delta: unknown base weight", _base_delta_unknown),
        ("base-delta: 40 GB header", _base_delta_huge),
    ],
    "vera": [
        *COMMON,
        ("projection-seed -1", _set(projection_seed=-1)),
        ("projection-rank 0", _set(projection_rank=0)),
        ("array: missing vera_lambda_d", _missing_array("vera_lambda_d")),
    ],
    "qrmix": [
        *COMMON,
        ("qrmix-stage 3", _set(qrmix_stage=3)),
        ("array: missing parameter", _missing_array("")),
    ],
    "gpse": [
        *COMMON,
        ("sketch-dim 1e5", _set(sketch_dim=100_000, gpse_task=0)),
        ("sketch-dim -1", _set(sketch_dim=-1)),
        ("gpse-task 99", _set(gpse_task=99)),
        ("task 99", _set(task=99)),
        ("task -1", _set(task=-1)),
        ("bases: k > d", _bases((784, 785))),
        ("bases: wrong d", _bases((10, 2))),
        ("bases: unknown layer", _bases((4, 2), "evil")),
        ("array: missing weight", _missing_array("")),
    ],
}
"""Per payload kind: (case, edit) where ``edit(instruction) -> (message, key)``."""

ROWS = [(kind, name, edit) for kind, rows in CASES.items() for name, edit in rows]


# ------------------------------------------------------------------ checks
def _state_snapshot(context: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, record in context.state.items():
        if isinstance(record, ArrayRecord):
            out[name] = {k: (record[k].shape, record[k].data) for k in record}
        else:
            out[name] = dict(record)
    return out


def _model_snapshot(models: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


def _same_models(
    a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]
) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys()
        and all(x[k].shape == y[k].shape and torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def _rss_peak_reset() -> int | None:
    """Reset the peak resident memory; the current RSS in bytes (None: no /proc)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return _status("VmRSS")
    except OSError:
        return None


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"{field}:\s+(\d+) kB", text)
    assert match is not None
    return int(match.group(1)) * 1024


def _copy_context(context: Context) -> Context:
    return Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=dict(context.node_config),
        state=copy.deepcopy(context.state),
        run_config=dict(context.run_config),
    )


def _fresh(message: Message, n: int) -> Message:
    return _message(message, _content(message), n)


def _refusal_problems(env: Env, case: str, edit: Any) -> list[str]:
    """What is wrong with the node's answer to one hostile instruction."""
    hostile, key = edit(env.instruction)
    state = _state_snapshot(env.context)
    models = _model_snapshot(env.cache())
    rss = _rss_peak_reset()
    tracemalloc.start()
    try:
        try:
            reply = app(hostile, env.context)
        except Exception as exc:  # a crash: the node did not answer
            return [f"{case}: crashed with {exc!r}"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    grown = _status("VmHWM") - rss if rss is not None else 0
    problems = []
    if not reply.has_error():
        problems.append(f"{case}: accepted")
    elif not (
        "instruction refused" in reply.error.reason and f"'{key}'" in reply.error.reason
    ):
        problems.append(f"{case}: reason does not name '{key}': {reply.error.reason}")
    if peak >= ALLOC_BOUND:
        problems.append(f"{case}: traced peak {peak / 2**20:.1f} MiB")
    if grown >= RSS_BOUND:
        problems.append(f"{case}: peak RSS grew {grown / 2**20:.1f} MiB")
    if _state_snapshot(env.context) != state:
        problems.append(f"{case}: context.state changed")
    if not _same_models(_model_snapshot(env.cache()), models):
        problems.append(f"{case}: the cached model changed")
    return problems


@pytest.mark.parametrize("kind", list(CASES))
def test_hostile_instructions_are_refused_then_the_honest_round_works(envs, kind):
    env = envs[kind]
    assert env.cache(), "the node's model is cached after its honest round"
    control = _copy_context(env.context)
    want = app(_fresh(env.instruction, 90), control)
    assert not want.has_error(), want.error
    problems = []
    for case, edit in CASES[kind]:
        problems += _refusal_problems(env, case, edit)
    assert not problems, "\n".join(problems)
    # Not bricked: the same node and cache serve the honest instruction
    # exactly as a copy of the node taken before the hostile table.
    got = app(_fresh(env.instruction, 91), env.context)
    assert not got.has_error(), got.error
    a = record_to_state(want.content.array_records[protocol.ARRAYS])
    b = record_to_state(got.content.array_records[protocol.ARRAYS])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _state_snapshot(control) == _state_snapshot(env.context)


def test_rank_32_then_honest_fedex_lora(envs):
    """A well-formed lora-rank 32 (arrays at rank 32) is served at rank 32; the
    next honest FedEx-LoRA instruction (no lora-rank) is served at the node's
    own rank 4, exactly as by a node that never saw rank 32."""
    env = envs["lora"]
    control = _copy_context(env.context)
    want = app(_fresh(env.instruction, 92), control)
    content = _content(env.instruction)
    state = record_to_state(content[protocol.ARRAYS])
    wide = {}
    for key, value in state.items():
        if key.endswith(A):
            value = torch.cat([value, torch.zeros(32 - value.shape[0], value.shape[1])])
        elif key.endswith(B):
            value = torch.cat(
                [value, torch.zeros(value.shape[0], 32 - value.shape[1])], 1
            )
        wide[key] = value
    content[protocol.ARRAYS] = state_to_record(wide)
    config = dict(content[protocol.CONFIG])
    config[protocol.LORA_RANK] = 32
    content[protocol.CONFIG] = ConfigRecord(config)
    at_32 = app(_message(env.instruction, content, 93), env.context)
    assert not at_32.has_error(), at_32.error
    replied = record_to_state(at_32.content.array_records[protocol.ARRAYS])
    assert {tuple(v.shape) for k, v in replied.items() if k.endswith(A)} == {(32, 32)}
    got = app(_fresh(env.instruction, 94), env.context)
    assert not got.has_error(), got.error
    a = record_to_state(want.content.array_records[protocol.ARRAYS])
    b = record_to_state(got.content.array_records[protocol.ARRAYS])
    assert {tuple(v.shape) for k, v in b.items() if k.endswith(A)} == {(4, 32)}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ the table
def test_every_key_a_client_feature_reads_is_bounded():
    """The methods' features (fedlr.strategies) declare a bound for each key,
    which the node's check finds; a feature elsewhere (DP-SGD) checks its own
    settings when it builds them."""
    features = [f for f in client_features() if f.__module__.startswith("fedlr.strat")]
    assert len(features) >= 7
    for feature in features:
        for key in feature.keys:
            assert isinstance(key, Bound), (feature.__name__, key)
            assert bound_of(key.key) == key, (feature.__name__, key)
    common = {b.key for b in BOUNDS}
    for key in (
        protocol.LR,
        protocol.LOCAL_STEPS,
        protocol.BATCH_SIZE,
        protocol.LORA_RANK,
    ):
        assert key in common


def test_docs_list_every_bound_and_node_limit():
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("## A client that checks the server", 1)[1].split("\n## ", 1)[
        0
    ]
    declared = [  # fedlr's own features (a test module may declare its own)
        d.bound
        for d in declared_keys()
        if d.bound is not None and d.owner.startswith("fedlr.")
    ]
    for bound in [*BOUNDS, *declared]:
        assert f"`{bound.key}`" in section, bound.key
    assert f"`max-local-steps` | {MAX_LOCAL_STEPS}" in section
    assert f"`max-batch-size` | {MAX_BATCH_SIZE}" in section


def test_node_limits_come_from_the_node_config(envs):
    env = envs["lora"]
    context = _copy_context(env.context)
    context.node_config["max-local-steps"] = 2  # the honest round asks for 3
    reply = app(_fresh(env.instruction, 95), context)
    assert reply.has_error() and "'local-steps'" in reply.error.reason
    assert "must be in [1, 2] (the node config's max-local-steps)" in reply.error.reason
    context = _copy_context(env.context)
    context.node_config["max-batch-size"] = 0  # a misconfigured node fails loudly
    with pytest.raises(ConfigError, match="max-batch-size"):
        app(_fresh(env.instruction, 96), context)
