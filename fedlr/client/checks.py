"""What a node checks of an instruction before it acts on it.

The server checks every reply before it decodes it
(:func:`fedlr.wire.protocol.validate_arrays`); a node gives the server's
instructions the same distrust. Before it changes anything (its model, the
rank of a cached model, ``context.state``, its base weights) it checks

* every ConfigRecord value it acts on against its :class:`Bound`: the
  type, and a range whose ends may be the node's own limits
  (:class:`NodeLimits`: its node config's ``max-local-steps`` and
  ``max-batch-size``, its model's layers, its run's number of tasks). The
  common round's keys are :data:`BOUNDS`; a client feature declares its own
  keys on its class (:attr:`fedlr.client.features.ClientFeature.keys`), which
  registers them here when the class is created (:func:`declare_bounds`), so
  a method's new key is checked without an edit of this module;
* every array against what its own model expects for that key: the key
  exists in the model, a role's arrays come all or none, the declared shape
  and dtype are those of the layout (at the round's rank), and the payload
  is decoded by :func:`fedlr.wire.protocol.decode_array`, the path the server
  decodes replies with, which proves the size of the bytes before it
  allocates anything, so no header's claim is ever allocated.

* every extra record a client feature reads, against the feature's
  declaration (:attr:`fedlr.client.features.Record.expects`, a rule giving
  the keys and shapes the record must hold this round, or ``None`` when the
  feature does not read it): :func:`check_records` refuses an absent record,
  a missing or unknown key, another shape or dtype, and NaN or Inf, with
  :class:`~fedlr.errors.FeatureRecordError` naming the record and the key.

A value or array outside these bounds raises :class:`InstructionError`
naming the key; fedlr's ClientApp answers it with an error reply
(:func:`fedlr.launch.client_app.refuse_bad_instructions`) and the node serves
the next honest round as before. docs/reliability.md ("A client that checks
the server") lists the bounds (generated: :mod:`fedlr.configdoc.features`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.plugin import adapted
from fedlr.adapters.roles import AdaptedModel, AdapterLayout, Role, RoleLayout
from fedlr.adapters.sorf_vera import SorfVeraLayout
from fedlr.adapters.vera import VeraLayout
from fedlr.client.pruning import RoundRank, received_width, round_rank
from fedlr.errors import (
    ConfigError,
    FeatureRecordError,
    InstructionError,
    ProtocolError,
)
from fedlr.flower.records import array_record
from fedlr.wire import protocol
from fedlr.wire.downlink import LOWRANK, TRANSPOSED_SUFFIX, VERA

if TYPE_CHECKING:
    from flwr.app import ArrayRecord, RecordDict

__all__ = [
    "BOUNDS",
    "MAX_BATCH_SIZE",
    "MAX_LOCAL_STEPS",
    "NODE_LIMIT_KEYS",
    "Bound",
    "CheckedInstruction",
    "DeclaredKey",
    "Expected",
    "Incoming",
    "InstructionError",
    "NodeLimits",
    "RecordRule",
    "base_delta_expected",
    "bound_of",
    "check_config",
    "check_model_instruction",
    "check_records",
    "check_value",
    "declare_bounds",
    "declared_keys",
    "decode_checked",
    "lora_round_shapes",
    "role_groups",
]

MAX_LOCAL_STEPS = 10_000
"""Default of the node-config key ``max-local-steps``."""
MAX_BATCH_SIZE = 4_096
"""Default of the node-config key ``max-batch-size``."""
NODE_LIMIT_KEYS = {"max-local-steps": MAX_LOCAL_STEPS, "max-batch-size": MAX_BATCH_SIZE}
"""Node-config keys (``--node-config``) that set a node's limits, with defaults."""

_INT32 = 2**31 - 1
_SEED = 2**63 - 1


@dataclass(frozen=True)
class NodeLimits:
    """The upper ends of :data:`BOUNDS` that depend on the node.

    Attributes
    ----------
    max_local_steps, max_batch_size : int
        From the node config (``max-local-steps``, ``max-batch-size``).
    max_rank : int or None
        ``min(d_in, d_out)`` of the narrowest adapted layer, the largest
        LoRA rank that carries information (or the model's own rank, for a
        model built wider); ``None``: no LoRA layers.
    widest_input : int or None
        The largest input dimension ``d`` of the layers FOT sketches (``None``:
        the node sketches nothing).
    last_task : int or None
        The run's last task index (``None``: not a continual run).
    base_keys : int or None
        How many base weights the model has (length of ``base-check``).
    """

    max_local_steps: int = MAX_LOCAL_STEPS
    max_batch_size: int = MAX_BATCH_SIZE
    max_rank: int | None = None
    widest_input: int | None = None
    last_task: int | None = None
    base_keys: int | None = None

    @classmethod
    def of_node(
        cls, node_config: Mapping[str, object], **model: int | None
    ) -> NodeLimits:
        """The limits of a node config (``max-local-steps``, ``max-batch-size``).

        Raises
        ------
        ConfigError
            If a limit in the node config is not a positive integer.
        """
        from_node: dict[str, int] = {}
        for key, default in NODE_LIMIT_KEYS.items():
            value = node_config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    key, f"node config must be an integer >= 1, got {value!r}"
                )
            from_node[key.replace("-", "_")] = value
        return cls(**from_node, **model)  # type: ignore[arg-type]

    @classmethod
    def of_layout(
        cls, node_config: Mapping[str, object], layout: RoleLayout
    ) -> NodeLimits:
        """The limits of a node whose model has ``layout`` (LoRA, VeRA, SORF-VeRA)."""
        most = None
        bases = len(layout.keys(Role.BASE)) or None
        if isinstance(layout, AdapterLayout) and layout.modules:
            # the largest rank a layer is sent: min(d_in, d_out), or its own
            # rank if the model was built wider
            most = min(max(min(m.d_in, m.d_out), m.rank) for m in layout.modules)
        return cls.of_node(node_config, max_rank=most, base_keys=bases)


@dataclass(frozen=True)
class Bound:
    """One ConfigRecord key a node acts on, and the values it accepts.

    Attributes
    ----------
    key : str
        The key (:mod:`fedlr.wire.protocol`).
    kind : {"int", "float", "bool", "str", "floats"}
        Its type: an integer (never a bool), a finite number, a bool, a
        string, a list of finite numbers.
    low : float or None
        The smallest value accepted (``None``: no lower end).
    high : float or str or None
        The largest value accepted: a number, or the name of a
        :class:`NodeLimits` attribute (``None`` there: the node does not act
        on the key, only its type is checked). For ``floats``: the most items.
    low_open : bool
        Whether ``low`` itself is refused (``lr`` > 0).
    note : str
        What else the node checks of the value, for the docs' table (one line
        of Markdown; e.g. ``"(then compared with the node's)"``).

    A client feature declares its keys as bounds too
    (:attr:`fedlr.client.features.ClientFeature.keys`)::

        keys = (Bound(PROXIMAL_MU, "float", 0.0),)
    """

    key: str
    kind: str
    low: float | None = None
    high: float | str | None = None
    low_open: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _TYPES:
            raise ValueError(
                f"Bound '{self.key}': kind must be one of {sorted(_TYPES)}, "
                f"got {self.kind!r}"
            )
        if isinstance(self.high, str) and self.high not in _LIMITS:
            raise ValueError(
                f"Bound '{self.key}': high names no node limit ({self.high!r}; "
                f"known: {sorted(_LIMITS)})"
            )

    def limit(self, limits: NodeLimits) -> float | None:
        """The upper end for this node."""
        if isinstance(self.high, str):
            value: float | None = getattr(limits, self.high)
            return value
        return self.high

    def check(self, value: object, limits: NodeLimits) -> None:
        """Raise :class:`InstructionError` unless ``value`` is accepted."""
        accepts, expected = _TYPES[self.kind]
        if not accepts(value):
            raise InstructionError(self.key, f"is {_shown(value)}, expected {expected}")
        if self.kind in ("bool", "str"):
            return
        high = self.limit(limits)
        if isinstance(value, list):  # floats
            if not all(math.isfinite(float(v)) for v in value):
                raise InstructionError(self.key, "holds NaN or Inf")
            if high is not None and len(value) > high:
                raise InstructionError(
                    self.key, f"has {len(value)} items, this node at most {int(high)}"
                )
            return
        number = float(cast(float, value))
        low_ok = (
            self.low is None
            or number > self.low
            or (number == self.low and not self.low_open)
        )
        if math.isfinite(number) and low_ok and (high is None or number <= high):
            return
        raise InstructionError(self.key, f"{self.accepted(limits)}, got {value!r}")

    def _range(self, low: str | None, high: str | None) -> str:
        """``in [low, high]`` (``(`` when ``low`` is refused), ``>= low``,
        ``<= high`` or ``""``, as the ends are given."""
        if low is not None and high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}]"
        if low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        return "" if high is None else f"<= {high}"

    def accepted(self, limits: NodeLimits) -> str:
        """``must be in [1, 10000] (the node's max-local-steps)``: the range."""
        high = self.limit(limits)
        low = None if self.low is None else _num(self.low)
        text = self._range(low, None if high is None else _num(high))
        if not text:
            return "must be finite"
        if self.kind == "float" and (low is None or high is None):
            text = f"finite and {text}"
        if isinstance(self.high, str) and high is not None:
            text += f" ({_LIMITS[self.high]})"
        return f"must be {text}"

    def describe(self) -> str:
        """What the key accepts, in words, for the docs' table.

        ``integer in [1, the node config's max-local-steps]``, ``finite number
        > 0``, ``bool``... followed by :attr:`note`.
        """
        if self.kind in ("bool", "str"):
            text = "bool" if self.kind == "bool" else "string"
        elif self.kind == "floats":
            text = "list of finite numbers"
            if self.high is not None:
                text += f", at most {_shown_limit(self.high, 'items')}"
        else:
            noun = "integer" if self.kind == "int" else "number"
            finite = "finite " if self.kind == "float" and self.high is None else ""
            low = None if self.low is None else _power(self.low)
            high = None if self.high is None else _shown_limit(self.high)
            text = f"{finite}{noun} {self._range(low, high)}".rstrip()
        return f"{text} {self.note}" if self.note else text


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (_is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "floats": (
        lambda v: isinstance(v, list) and all(_is_number(x) for x in v),
        "a list of numbers",
    ),
}
"""Each kind of :class:`Bound`: whether a value is of it, and its name."""

_LIMITS = {
    "max_local_steps": "the node config's max-local-steps",
    "max_batch_size": "the node config's max-batch-size",
    "max_rank": "the narrowest adapted layer's min(d_in, d_out)",
    "widest_input": "the widest projected layer's input dimension",
    "last_task": "the run's last task",
    "base_keys": "one per base weight",
}
"""What each :class:`NodeLimits` attribute a bound names is, for messages."""

_LIMIT_DOCS = {
    "max_local_steps": "the node config's `max-local-steps`",
    "max_batch_size": "the node config's `max-batch-size`",
    "max_rank": "min(d_in, d_out) of the narrowest adapted layer",
    "widest_input": "the widest projected layer's input dimension d",
    "last_task": "`num-tasks` - 1",
    "base_keys": "one per base weight",
}
"""The same, for the docs' table (Markdown)."""


def _power(value: float) -> str:
    """``2^31 - 1`` for 2147483647, ``2^62`` for 2**62, else the number."""
    number = int(value) if float(value).is_integer() else None
    if number is not None and number > 2**16:
        if number & (number + 1) == 0:
            return f"2^{(number + 1).bit_length() - 1} - 1"
        if number & (number - 1) == 0:
            return f"2^{number.bit_length() - 1}"
    return _num(value)


def _shown_limit(high: float | str, what: str = "") -> str:
    if isinstance(high, str):
        return _LIMIT_DOCS[high]
    return f"{_power(high)} {what}".strip()


BOUNDS: tuple[Bound, ...] = (
    Bound(protocol.SERVER_ROUND, "int", 0, _INT32),
    Bound(protocol.LR, "float", 0.0, None, low_open=True),
    Bound(protocol.LOCAL_OPTIMIZER, "str", note="`adamw` or `sgd`"),
    Bound(protocol.LOCAL_STEPS, "int", 1, "max_local_steps"),
    Bound(protocol.BATCH_SIZE, "int", 1, "max_batch_size"),
    Bound(
        protocol.LORA_RANK,
        "int",
        1,
        "max_rank",
        note="(a model built at a higher rank: up to its rank)",
    ),
    Bound(protocol.LORA_ALPHA, "float", 0.0, None, low_open=True),
    Bound(protocol.PROJECTION_SEED, "int", 0, _SEED),
    Bound(
        protocol.PROJECTION_RANK,
        "int",
        1,
        _INT32,
        note="(then compared with the node's)",
    ),
    Bound(protocol.TASK, "int", 0, "last_task", note="(continual runs)"),
    Bound(protocol.GPSE_TASK, "int", -1, "last_task"),
    Bound(protocol.SKETCH_DIM, "int", 0, "widest_input"),
    Bound(protocol.QRMIX_STAGE, "int", 1, 2),
    Bound(protocol.LEADING_RANK, "bool"),
    Bound(protocol.PERSONAL_SPLIT, "bool"),
    Bound(protocol.TRAIN_ROLES, "str", note="of known roles"),
    Bound(protocol.KEEP_ROLES, "str", note="of known roles"),
)
"""The common round's ConfigRecord keys (every node acts on them), and what
each accepts. A client feature's own keys are declared on its class and
collected by :func:`declare_bounds`; :func:`bound_of` finds either."""

_BY_KEY = {bound.key: bound for bound in BOUNDS}


@dataclass(frozen=True)
class DeclaredKey:
    """A ConfigRecord key a client feature declared (:func:`declare_bounds`).

    Attributes
    ----------
    key : str
    owner : str
        The declaring feature's qualified name (``module.Class``).
    bound : Bound or None
        What the node accepts; ``None``: the feature checks the value itself
        when it builds its settings (DP-SGD's keys, checked as one object).
    """

    key: str
    owner: str
    bound: Bound | None


_DECLARED: dict[str, DeclaredKey] = {}


def declare_bounds(owner: str, keys: Iterable[Bound | str]) -> None:
    """Add a client feature's ConfigRecord keys to what every node checks.

    Called when a :class:`~fedlr.client.features.ClientFeature` subclass is created
    (its ``keys``), so a method's new key and its bound live in the method's
    module; this module never imports a feature. A plain ``str`` declares a
    key the feature checks itself.

    Raises
    ------
    TypeError
        If an entry is neither a :class:`Bound` nor a ``str``.
    ValueError
        If a key is one of :data:`BOUNDS` (the common round's), or another
        feature declared it with another bound (both owners named).
    """
    for entry in keys:
        if not isinstance(entry, (Bound, str)):
            raise TypeError(
                f"{owner}: a key must be declared as a Bound or a str, got {entry!r}"
            )
        bound = entry if isinstance(entry, Bound) else None
        key = entry.key if isinstance(entry, Bound) else entry
        if key in _BY_KEY:
            raise ValueError(
                f"{owner} declares '{key}', a key of the common round "
                "(fedlr.client.checks.BOUNDS); read it, do not redeclare it"
            )
        known = _DECLARED.get(key)
        if known is not None and known.owner != owner and known.bound != bound:
            raise ValueError(
                f"{owner} declares '{key}' as {bound}, but {known.owner} "
                f"declared it as {known.bound}; a key has one bound"
            )
        if known is None or known.owner == owner:
            _DECLARED[key] = DeclaredKey(key, owner, bound)


def declared_keys() -> list[DeclaredKey]:
    """Every key the client features declared so far, by key."""
    return [_DECLARED[key] for key in sorted(_DECLARED)]


def bound_of(key: str) -> Bound | None:
    """The bound of ``key``: the common round's, else the declaring
    feature's (``None``: no bound; the key passes unchecked)."""
    declared = _DECLARED.get(key)
    return _BY_KEY.get(key) or (declared.bound if declared is not None else None)


def check_value(key: str, value: object, limits: NodeLimits) -> None:
    """Check one value against its bound (:func:`bound_of`; a key without
    one is not checked).

    Raises
    ------
    InstructionError
        Naming ``key``, if the value is of another type or out of range.
    """
    bound = bound_of(key)
    if bound is not None:
        bound.check(value, limits)


def check_config(config: Mapping[str, object], limits: NodeLimits) -> None:
    """Check every key of ``config`` that has a bound: :data:`BOUNDS` and the
    keys the client features declared (:func:`declare_bounds`).

    Keys nobody declares (a plug-in user's own) pass unchecked; the roles
    are decoded too (an unknown role is refused). The features' keys are
    those of the features defined so far: a node loads its methods' features
    before it checks (:func:`fedlr.client.round.apply_round` does).

    Raises
    ------
    InstructionError
        Naming the first key refused.
    """
    for key, value in config.items():
        check_value(key, value, limits)
    for key in (protocol.TRAIN_ROLES, protocol.KEEP_ROLES):
        try:
            protocol.decode_roles(config, key)
        except ProtocolError as exc:
            raise InstructionError(key, f"does not decode: {exc}") from None


def decode_checked(
    record: ArrayRecord,
    expected: Mapping[str, tuple[int, ...]],
    *,
    name: str = protocol.ARRAYS,
    complete: Iterable[Iterable[str]] = (),
    required: bool = False,
) -> dict[str, torch.Tensor]:
    """Decode an instruction's ArrayRecord after checking it against the model.

    Parameters
    ----------
    record : ArrayRecord
        Untrusted.
    expected : mapping of str to tuple of int
        Every key the node's model accepts in this record, and its shape.
    name : str
        The record's name, for the messages.
    complete : iterable of iterables of str
        Groups of keys sent all or none (a role's keys).
    required : bool
        Whether every key of ``expected`` must be present.

    Returns
    -------
    dict of str to torch.Tensor
        The decoded arrays (:func:`fedlr.wire.protocol.decode_array`: declared
        shape and dtype, payload size, header, finiteness; nothing is
        allocated before the payload's size is proven).

    Raises
    ------
    InstructionError
        Naming the first key refused: unknown, missing, or not decodable as
        the expected shape.
    """
    keys = list(record.keys())
    unknown = [k for k in keys if k not in expected]
    if unknown:
        raise InstructionError(
            unknown[0],
            f"(in '{name}') is not an array of this node's model "
            f"({len(unknown)} unknown keys)",
        )
    present = set(keys)
    groups = [list(expected)] if required else [list(g) for g in complete]
    for group in groups:
        missing = [k for k in group if k not in present]
        if missing and (required or len(missing) < len(group)):
            raise InstructionError(
                missing[0],
                f"(in '{name}') is missing: {len(missing)} of {len(group)} arrays "
                "of its role are absent (a role is sent whole or not at all)",
            )
    decoded: dict[str, torch.Tensor] = {}
    for key in keys:
        try:
            decoded[key] = protocol.decode_array(
                record[key], tuple(expected[key]), where=f"(in '{name}')"
            )
        except ProtocolError as exc:
            raise InstructionError(key, str(exc)) from None
    return decoded


def lora_round_shapes(
    layout: AdapterLayout, record: ArrayRecord, rank: int | None, leading: bool
) -> dict[str, tuple[int, ...]]:
    """The shape of every key a LoRA node accepts in this round's ``arrays``.

    Parameters
    ----------
    layout : AdapterLayout
        The model's layout now.
    record : ArrayRecord
        The instruction's ``arrays`` (only its declared shapes are read).
    rank : int or None
        The rank the model takes this round (``lora-rank``, else the node's);
        ``None``: each layer keeps its own.
    leading : bool
        ``leading-rank``: ``A``, ``B`` may come at another width ``R`` (the
        largest client rank), ``1 <= R <= max(d_in, d_out)``, the same for a
        layer's ``A`` and ``B``.

    Raises
    ------
    InstructionError
        If a leading-rank width is out of range or differs between ``A`` and
        ``B``.
    """
    at_rank = layout if rank is None else layout.at_rank(rank)
    shapes = {key: shape for _, key, shape in at_rank.entries()}
    if not leading:
        return shapes
    for m in at_rank.modules:
        widths = {}
        for key, axis in ((m.a_key, 0), (m.b_key, 1)):
            if key in record:
                declared = tuple(record[key].shape)
                if len(declared) != 2:
                    raise InstructionError(
                        key,
                        f"(in '{protocol.ARRAYS}') has shape {declared}, expected 2-D",
                    )
                widths[key] = int(declared[axis])
        if not widths:
            continue
        if len(set(widths.values())) > 1:
            raise InstructionError(
                m.b_key, f"has rank {widths.get(m.b_key)}, its A {widths.get(m.a_key)}"
            )
        width = next(iter(widths.values()))
        # wider than the node (the largest client rank): at most the
        # layer's longer side, so A and B stay the size of the layer's weight
        most = max(m.d_in, m.d_out, m.rank)
        if not 1 <= width <= most:
            key = next(iter(widths))
            raise InstructionError(
                key,
                f"has rank {width}, outside [1, {most}] "
                f"(the layer is {m.d_out} x {m.d_in}, its rank {m.rank})",
            )
        shapes[m.a_key] = (width, m.d_in)
        shapes[m.b_key] = (m.d_out, width)
    return shapes


@dataclass
class CheckedInstruction:
    """What :func:`check_model_instruction` proved of an instruction.

    Attributes
    ----------
    arrays : dict of str to torch.Tensor
        The decoded ``arrays``.
    layout : RoleLayout
        The model's layout at the round's rank (what the features' record
        rules read, :class:`Incoming`).
    limits : NodeLimits
        The node's limits, for the values used later (training settings).
    rank : RoundRank or None
        The rank a LoRA model takes this round
        (:func:`fedlr.client.pruning.round_rank`), the rank the arrays were
        checked at; ``None`` for VeRA-family models.
    """

    arrays: dict[str, torch.Tensor]
    layout: RoleLayout
    limits: NodeLimits = field(default_factory=NodeLimits)
    rank: RoundRank | None = None


def role_groups(layout: RoleLayout) -> list[list[str]]:
    """The keys of each role of ``layout`` (sent all or none)."""
    groups: dict[Role, list[str]] = {}
    for role, key, _ in layout.entries():
        groups.setdefault(role, []).append(key)
    return list(groups.values())


def check_model_instruction(
    model: torch.nn.Module | AdaptedModel,
    content: RecordDict,
    config: Mapping[str, object],
    node_config: Mapping[str, object],
    *,
    rank: int | None = None,
    state: RecordDict | None = None,
) -> CheckedInstruction:
    """Check an instruction for a LoRA, VeRA or SORF-VeRA model, change nothing.

    The layout is read from a fresh view of the model (a LoRA model's
    current rank).

    Parameters
    ----------
    model : torch.nn.Module or AdaptedModel
        The user's model as it is now.
    content : RecordDict
        The instruction's records.
    config : ConfigRecord
        Its ConfigRecord (empty if it has none).
    node_config : mapping
        The node config (its limits).
    rank : int or None
        The node's own LoRA rank (``None``: the model's;
        :func:`fedlr.client.round.apply_round`'s): where
        :func:`fedlr.client.pruning.round_rank` starts when the instruction has no
        ``lora-rank``.
    state : flwr.app.RecordDict, optional
        The node's ``context.state`` (a rank it pruned itself to); read only.

    Returns
    -------
    CheckedInstruction
        The decoded ``arrays``, the node's limits and the round's rank.

    Raises
    ------
    InstructionError
        Naming the first key refused (:data:`BOUNDS`, the arrays'
        keys, roles, shapes, dtypes and sizes). The client features' extra
        records are checked next (:func:`check_records`).
    RecordMissingError, RecordTypeError
        If the instruction has no ArrayRecord ``arrays``.
    """
    view = adapted(model)
    if isinstance(view, LoraModel):  # a model serving many nodes: its rank now
        view = adapted(view.model)
    layout = view.layout
    limits = NodeLimits.of_layout(node_config, layout)
    check_config(config, limits)
    arrays = array_record(content, protocol.ARRAYS)
    if not isinstance(layout, AdapterLayout):
        expected = {key: shape for _, key, shape in layout.entries()}
        decoded = decode_checked(arrays, expected, complete=role_groups(layout))
        return CheckedInstruction(decoded, layout, limits)
    rank_now = round_rank(
        config,
        state,
        own=rank,
        received=received_width(layout, content),
        model_rank=max((m.rank for m in layout.modules), default=None),
    )
    leading = bool(config.get(protocol.LEADING_RANK, False))
    expected = lora_round_shapes(layout, arrays, rank_now.rank, leading)
    decoded = decode_checked(arrays, expected, complete=role_groups(layout))
    at_rank = layout.at_rank(rank_now.rank) if rank_now.rank else layout
    return CheckedInstruction(decoded, at_rank, limits, rank_now)


@dataclass(frozen=True)
class Incoming:
    """An instruction as a node holds it before it acts on it: what a client
    feature's record rule (:attr:`fedlr.client.features.Record.expects`) reads.

    Attributes
    ----------
    layout : RoleLayout
        The model's layout at the round's rank (:class:`CheckedInstruction`).
    content : RecordDict
        The instruction's records (untrusted; ``config`` already checked).
    config : mapping
        Its ConfigRecord, checked against every bound (:func:`check_config`).
    state : RecordDict
        The node's ``context.state``; read only.
    is_train : bool
        Whether the instruction is a ``train`` one.
    train_roles : tuple of Role
        The roles the round trains (``train-roles``, else the layout's default).
    """

    layout: RoleLayout
    content: RecordDict
    config: Mapping[str, object]
    state: RecordDict
    is_train: bool
    train_roles: tuple[Role, ...]


@dataclass(frozen=True)
class Expected:
    """What a client feature's extra record must hold this round.

    Attributes
    ----------
    shapes : mapping of str to tuple of int
        Every key the record may hold, and its shape.
    groups : tuple of tuple of str, optional
        Keys sent all or none (a role's arrays); ``None``: every key of
        ``shapes`` is required.
    """

    shapes: Mapping[str, tuple[int, ...]]
    groups: tuple[tuple[str, ...], ...] | None = None


RecordRule = Callable[[Incoming], Expected | None]
"""A received record's declaration: what it must hold in this instruction
(:class:`Expected`), or ``None`` when the feature does not read it then."""


def check_records(incoming: Incoming, rules: Iterable[tuple[str, RecordRule]]) -> None:
    """Check every client feature's declared extra record before the node acts.

    For each ``(name, rule)``: the rule says what record ``name`` must hold
    this round (``None``: nothing, it is not read); the record must then be
    present, and hold exactly those keys (or whole groups of them), each of
    its shape, a float dtype and finite (:func:`decode_checked`).

    Raises
    ------
    FeatureRecordError
        Naming the record and the first array refused (or the record, when
        it is absent).
    """
    for name, rule in rules:
        try:
            expected = rule(incoming)
            if expected is None:
                continue
            record = incoming.content.array_records.get(name)
            if record is None:
                raise InstructionError(
                    name, "is missing: this instruction's settings need the record"
                )
            decode_checked(
                record,
                expected.shapes,
                name=name,
                complete=expected.groups or (),
                required=expected.groups is None,
            )
        except FeatureRecordError:
            raise
        except InstructionError as exc:
            raise FeatureRecordError(name, exc.key, exc.reason) from None


def base_delta_expected(incoming: Incoming) -> Expected | None:
    """``base-delta``'s rule: keys ``version:kind:key:side`` of the model's
    base weights, each change a pair ``left`` (d_out, q), ``right`` (q, d_in)
    (VeRA: (q, r), r the projections' rank), ``q`` at most the weight's
    widest side; ``None`` when the instruction has no such record."""
    record = incoming.content.array_records.get(protocol.BASE_DELTA)
    if record is None:
        return None
    layout = incoming.layout
    bases = layout.shapes(Role.BASE)
    # a VeRA change's right factor is (q, r), r the projections' rank
    vera = int(layout.rank) if isinstance(layout, (VeraLayout, SorfVeraLayout)) else 0
    shapes: dict[str, tuple[int, ...]] = {}
    for name in record:
        prefix, _, side = name.rpartition(":")
        version, _, rest = prefix.partition(":")
        kind, _, key = rest.partition(":")
        transposed = kind.endswith(TRANSPOSED_SUFFIX)
        kind = kind.removesuffix(TRANSPOSED_SUFFIX)
        if (
            key not in bases
            or kind not in (LOWRANK, VERA)
            or side not in ("left", "right")
            or not version.lstrip("-").isdigit()
        ):
            raise InstructionError(
                name, f"(in '{protocol.BASE_DELTA}') does not name a base weight"
            )
        d_out, d_in = bases[key][:: -1 if transposed else 1]
        widest = max(d_out, d_in, vera)
        q = _inner_width(record, prefix)
        if not 0 <= q <= widest:
            raise InstructionError(
                name,
                f"(in '{protocol.BASE_DELTA}') has rank {q}, expected at most "
                f"{widest} (the weight's widest side)",
            )
        shapes[f"{prefix}:left"] = (d_out, q)
        shapes[f"{prefix}:right"] = (q, vera if kind == VERA else d_in)
    prefixes = sorted({k.rpartition(":")[0] for k in shapes})
    groups = tuple((f"{p}:left", f"{p}:right") for p in prefixes)
    return Expected(shapes, groups)


def _inner_width(record: ArrayRecord, prefix: str) -> int:
    """A change's rank ``q``: its left factor's columns, else its right
    factor's rows, as declared (-1: neither is 2-D)."""
    for side, axis in (("left", 1), ("right", 0)):
        name = f"{prefix}:{side}"
        if name in record and len(record[name].shape) == 2:
            return int(record[name].shape[axis])
    return -1


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _shown(value: object) -> str:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{type(value).__name__} {shown}"
