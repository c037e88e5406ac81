"""The round's first steps: decode and validate every reply, then screen sizes.

Every reply a strategy aggregates goes through its :class:`Replies` step
(``strategy.replies``, an instance of the strategy's ``replies_type``): one
reply per instructed node (:meth:`~Replies.screen_replies`), then records,
keys, shapes, dtypes, finiteness and the weight (:meth:`~Replies.validate_reply`,
the arrays by :func:`fedlr.wire.protocol.validate_arrays`). What passes becomes a
:class:`ClientUpdate`; what does not is dropped with a reason naming the node,
and nothing a client sends can raise past :meth:`~Replies.validate_replies`.
Then the update-size screen (:meth:`~Replies.screen_update_sizes`,
``screen-ratio``) drops an update far larger than the round's median one.

A method whose replies carry more than its arrays subclasses :class:`Replies`
in its own module and names it as its strategy's ``replies_type``: the extra
records it declares (:meth:`~Replies.records`, each checked like the arrays),
the space its updates are measured and moved in (:meth:`~Replies.space`), how
a clipped update's records follow it (:meth:`~Replies.clip_extras`), and any
further check (:meth:`~Replies.validate_reply`, calling ``super()``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from logging import DEBUG, WARNING
from typing import Protocol
from weakref import WeakKeyDictionary

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore import log

from fedlr.adapters.roles import Role
from fedlr.errors import NoValidRepliesError, ProtocolError, ReplyValidationError
from fedlr.flower.records import record_nbytes
from fedlr.privacy.settings import PrivacyConfig
from fedlr.robust.screen import ScreenOutcome, screen_record_sizes, screen_sizes
from fedlr.robust.server_update import SERVER_NODE
from fedlr.robust.spaces import ParameterSpace, UpdateSpace
from fedlr.round.value import Round
from fedlr.wire.protocol import (
    PARTITION_ID,
    TRAIN_ROLES,
    encode_roles,
    validate_arrays,
)
from fedlr.wire.updates import ClientUpdate

__all__ = [
    "ClientUpdate",
    "Replies",
    "ReplyMethod",
    "conform_dtypes",
    "node_of",
    "reply_step_type",
    "short",
]


def node_of(message: Message) -> int:
    """The sender's node id, or -1 for a message without metadata."""
    try:
        return int(message.metadata.src_node_id)
    except Exception:  # a message without metadata
        return -1


def short(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (for untrusted text in reasons)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_WIRE_TORCH_DTYPES = {
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""Floating dtypes an ArrayRecord carries (numpy's names), as torch's."""


def conform_dtypes(
    update: ClientUpdate, dtypes: Mapping[str, torch.dtype]
) -> ClientUpdate:
    """``update`` with each array cast to the global array's dtype.

    A float16 or float64 reply of a float32 model is aggregated as float32
    (one client never changes the global dtype, nor doubles the downlink);
    finiteness is checked after the cast, so a float64 ``1e300`` that would
    become Inf is refused here, not published. The extra records follow: an
    array keyed as a global array takes its dtype (SCAFFOLD-LoRA's control
    delta, which moves a control variate kept in that dtype); any other
    stays as the method's client sent it (FOT's float64 sketches).

    Raises
    ------
    ReplyValidationError
        If an array overflows the global dtype.
    """
    cast = _cast(update.node_id, update.arrays, dtypes, "")
    extras = {}
    for name, record in update.extras.items():
        # A record keyed as the arrays (SCAFFOLD's control delta) takes their
        # dtype; any other stays as sent (FOT's float64 sketches feed a
        # float64 basis), finite already (validate_arrays).
        moved = _cast(update.node_id, record, dtypes, f"record '{name}': ")
        if moved:
            extras[name] = {**record, **moved}
    if not cast and not extras:
        return update
    return dataclasses.replace(
        update,
        arrays={**update.arrays, **cast},
        extras={**update.extras, **extras},
    )


def joined(outcomes: list[ScreenOutcome]) -> ScreenOutcome:
    """Screen outcomes of groups of one round's updates, as one."""
    if len(outcomes) == 1:
        return outcomes[0]
    return ScreenOutcome(
        [u for o in outcomes for u in o.updates],
        [r for o in outcomes for r in o.reasons],
        [x for o in outcomes for x in o.ratios],
        max((o.bound for o in outcomes), default=math.inf),
    )


def _cast(
    node: int,
    arrays: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype],
    where: str,
) -> dict[str, torch.Tensor]:
    """The arrays whose dtype differs from ``dtypes``', cast and checked finite."""
    cast: dict[str, torch.Tensor] = {}
    for key, tensor in arrays.items():
        target = dtypes.get(key)
        if target is None or tensor.dtype == target:
            continue
        value = tensor.to(target)
        if not bool(torch.isfinite(value).all()):
            raise ReplyValidationError(
                node,
                f"{where}'{key}' ({str(tensor.dtype).removeprefix('torch.')}) "
                f"overflows {str(target).removeprefix('torch.')}, the dtype the "
                "server keeps it in",
            )
        cast[key] = value
    return cast


class ReplyMethod(Protocol):
    """What the reply step reads of its strategy: settings and the reply shapes."""

    @property
    def arrayrecord_key(self) -> str: ...
    @property
    def weighted_by_key(self) -> str: ...
    @property
    def max_num_examples(self) -> int | None: ...
    @property
    def screen_ratio(self) -> float: ...
    @property
    def privacy(self) -> PrivacyConfig: ...
    @property
    def train_roles(self) -> tuple[Role, ...]: ...
    def reply_shapes(self) -> dict[str, tuple[int, ...]]: ...


class Replies:
    """The decode, validate and screen steps of a strategy's round.

    Parameters
    ----------
    method : FedLRStrategy
        The strategy whose replies this step checks; its settings
        (``arrayrecord_key``, ``weighted_by_key``, ``max_num_examples``,
        ``screen_ratio``, ``privacy``) and :meth:`reply_shapes` are read when
        a round is checked; the round (:class:`~fedlr.round.value.Round`)
        says who was sent an instruction and what.
    """

    def __init__(self, method: ReplyMethod) -> None:
        self.method = method

    @staticmethod
    def screen_replies(
        replies: list[Message], sent: tuple[int, ...] | None
    ) -> tuple[list[Message], list[str]]:
        """Keep each instructed node's first reply; name the others and the silent.

        Returns
        -------
        kept : list of Message
            One reply per node (every node when no instruction was recorded,
            ``sent`` is ``None``, e.g. under the legacy API).
        dropped : list of str
            Reasons for a node's second reply, a reply from a node that was not
            sent an instruction this round, and each instructed node without a
            reply.
        """
        instructed = None if sent is None else set(sent)  # O(1) lookups
        kept: list[Message] = []
        dropped: list[str] = []
        seen: set[int] = set()
        for message in replies:
            node = int(message.metadata.src_node_id)
            if node in seen:
                reason = "duplicate reply (the node's first reply is kept)"
            elif instructed is not None and node not in instructed:
                reason = "the node was not sent an instruction this round"
            else:
                seen.add(node)
                kept.append(message)
                continue
            dropped.append(str(ReplyValidationError(node, reason)))
        if instructed is not None:
            dropped += [
                f"node {node}: no reply (timed out or lost)"
                for node in sorted(instructed - seen)
            ]
        return kept, dropped

    @staticmethod
    def layout_dtypes(current: ArrayRecord) -> dict[str, torch.dtype]:
        """The dtype of each global array sent this round (``current``), by key.

        Replies are cast to these (:func:`conform_dtypes`): the global arrays
        keep their dtype whatever a client sends.
        """
        out: dict[str, torch.dtype] = {}
        for key in current:
            dtype = _WIRE_TORCH_DTYPES.get(str(current[key].dtype))
            if dtype is not None:
                out[key] = dtype
        return out

    def validate_replies(
        self, replies: list[Message], current: ArrayRecord
    ) -> tuple[list[ClientUpdate], list[str]]:
        """Split replies into valid updates and reasons for the dropped ones
        (each update cast to the dtypes of ``current``, the arrays sent).

        Nothing a client sends escapes this: a reply that makes any check
        fail unexpectedly (an error other than :class:`ReplyValidationError`)
        is dropped too, with the error named, and the round goes on.
        """
        expected = self.method.reply_shapes()
        dtypes = self.layout_dtypes(current)
        updates: list[ClientUpdate] = []
        dropped: list[str] = []
        for message in replies:
            try:
                update = self.validate_reply(message, expected)
                updates.append(conform_dtypes(update, dtypes))
            except ReplyValidationError as exc:
                dropped.append(str(exc))
            except Exception as exc:  # untrusted input: never crash
                error = f"{type(exc).__name__}: {short(str(exc))}"
                reason = f"reply could not be checked: {error}"
                dropped.append(str(ReplyValidationError(node_of(message), reason)))
        updates.sort(key=lambda u: (u.partition_id, u.node_id))
        return updates, dropped

    def screen_update_sizes(
        self, updates: list[ClientUpdate], current: Mapping[str, torch.Tensor]
    ) -> tuple[list[ClientUpdate], list[str], ScreenOutcome]:
        """Drop validated updates far larger than the round's median update.

        :func:`fedlr.robust.screen.screen_sizes` in the method's update space
        (:meth:`space` of ``current``) with ``screen_ratio`` (0: off).

        Under client-level DP each update is screened on its own, against
        ``screen_ratio`` times the current state's norm (what
        :func:`~fedlr.robust.screen.screen_sizes` does with one update): the round's
        median would let one client's update decide whether another's is
        dropped, an influence on the published mean beyond its own clipped
        ``C / m``. The screen only drops; the clipping that follows
        (:func:`fedlr.privacy.client_dp.privatize`) bounds what is kept.

        Returns
        -------
        kept : list of ClientUpdate
        dropped : list of str
            One reason per dropped update, naming its node, its norm, its
            ratio to the round's median and the ``screen-ratio``.
        outcome : ScreenOutcome
            The arrays' screen (every update's ratio), the round's ``screen``.
        """
        space, ratio = self.space(current), self.method.screen_ratio
        outcome = joined([screen_sizes(g, space, ratio) for g in self.apart(updates)])
        kept, reasons = outcome.updates, list(outcome.reasons)
        for name in self.records():
            floor = self.record_floor(name, current)
            screened = joined(
                [screen_record_sizes(g, name, ratio, floor) for g in self.apart(kept)]
            )
            kept = screened.updates
            reasons += screened.reasons
        dropped = [str(ReplyValidationError(node, r)) for node, r in reasons]
        return kept, dropped, outcome

    def apart(self, updates: list[ClientUpdate]) -> list[list[ClientUpdate]]:
        """The groups the size screen compares: the round's updates together,
        or under client-level DP each on its own (kept or not whatever the
        others sent)."""
        if self.method.privacy.client_dp is None:
            return [updates]
        return [[u] for u in updates]

    def reply_weight(self, node: int, content: RecordDict) -> tuple[MetricRecord, int]:
        """A reply's one MetricRecord and its weight (``weighted_by_key``).

        Raises
        ------
        ReplyValidationError
            If the reply has not exactly one MetricRecord, or the weight is
            missing or not a positive integer, or above ``max_num_examples``
            (which bounds what a client's claim buys: the server's own
            update, :data:`~fedlr.robust.server_update.SERVER_NODE`, is not
            held to it, its weight is its share; no client replies as that
            node, as :meth:`screen_replies` drops every node not instructed).
        """
        metric_records = list(content.metric_records.values())
        if len(metric_records) != 1:
            raise ReplyValidationError(
                node, f"expected one MetricRecord, got {len(metric_records)}"
            )
        metrics = metric_records[0]
        num = metrics.get(self.method.weighted_by_key)
        if num is None:
            raise ReplyValidationError(node, f"missing '{self.method.weighted_by_key}'")
        if (
            isinstance(num, (list, bool))
            or not isinstance(num, (int, float))
            or not math.isfinite(float(num))
            or float(num) < 1
            or float(num) != int(num)
        ):
            raise ReplyValidationError(
                node,
                f"'{self.method.weighted_by_key}' must be a positive integer, "
                f"got {num}",
            )
        if (
            self.method.max_num_examples is not None
            and num > self.method.max_num_examples
            and node != SERVER_NODE
        ):
            raise ReplyValidationError(
                node,
                f"'{self.method.weighted_by_key}' = {num:.6g} exceeds max-num-examples "
                f"{self.method.max_num_examples}",
            )
        return metrics, int(num)

    @staticmethod
    def extra_arrays(
        update: ClientUpdate, name: str, expected: Mapping[str, tuple[int, ...]]
    ) -> dict[str, torch.Tensor]:
        """A reply's extra ArrayRecord ``name``, checked like its ``arrays``.

        The one validator (:func:`fedlr.wire.protocol.validate_arrays`) for the
        records methods add (FedSA's ``personal-gram``, QR-Mix's ``eigen``,
        FOT's ``sketches``).

        Raises
        ------
        ReplyValidationError
            If the record is absent, has other keys or shapes, a non-floating
            dtype, NaN or Inf.
        """
        records = update.content.array_records
        if name not in records:
            raise ReplyValidationError(update.node_id, f"no ArrayRecord '{name}'")
        try:
            return validate_arrays(records[name], expected, name=name)
        except ProtocolError as exc:
            raise ReplyValidationError(update.node_id, str(exc)) from exc

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        """Check one reply: error flag, records, keys, shapes, dtype, finiteness.

        The arrays are checked by :func:`fedlr.wire.protocol.validate_arrays`; a
        wrong key set names what the client must send (:meth:`reply_hint`).

        Raises
        ------
        ReplyValidationError
            With the node id and what was wrong.
        """
        node = int(message.metadata.src_node_id)
        if message.has_error():
            raise ReplyValidationError(node, f"client error: {message.error.reason}")
        content = message.content
        if self.method.arrayrecord_key not in content.array_records:
            raise ReplyValidationError(
                node, f"no ArrayRecord '{self.method.arrayrecord_key}' in the reply"
            )
        metrics, num = self.reply_weight(node, content)
        record = content.array_records[self.method.arrayrecord_key]
        try:
            arrays = validate_arrays(
                record, expected, name=self.method.arrayrecord_key, hint=self.hint()
            )
        except ProtocolError as exc:
            raise ReplyValidationError(node, str(exc)) from None
        update = ClientUpdate(
            node_id=node,
            arrays=arrays,
            num_examples=num,
            metrics=self.scalars(node, metrics),
            content=content,
            nbytes=record_nbytes(record),
        )
        return self.with_extras(update)

    def scalars(self, node: int, metrics: MetricRecord) -> dict[str, float]:
        """A reply's scalar metrics but its weight, as floats.

        Raises
        ------
        ReplyValidationError
            If a ``partition-id`` is not a non-negative integer.
        """
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if k != self.method.weighted_by_key
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        }
        partition = scalars.get(PARTITION_ID)
        if partition is not None and not (
            math.isfinite(partition) and partition >= 0 and partition == int(partition)
        ):
            raise ReplyValidationError(
                node,
                f"'{PARTITION_ID}' must be a non-negative integer, got {partition}",
            )
        return scalars

    def with_extras(self, update: ClientUpdate) -> ClientUpdate:
        """``update`` with the extra records of :meth:`records` checked and
        decoded into its ``extras`` and counted in its bytes."""
        extra_records = self.records()
        if not extra_records:
            return update
        extras = {
            name: self.extra_arrays(update, name, shapes)
            for name, shapes in extra_records.items()
        }
        records = update.content.array_records
        nbytes = update.nbytes + sum(record_nbytes(records[name]) for name in extras)
        return dataclasses.replace(update, extras=extras, nbytes=nbytes)

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Extra ArrayRecords every valid reply carries: name -> keys and shapes.

        Each is checked like ``arrays`` (:meth:`extra_arrays`: keys, shapes,
        finite), cast like them (:func:`conform_dtypes`), screened for size
        against the round's median of that record
        (:func:`~fedlr.robust.screen.screen_record_sizes`, :meth:`record_floor`),
        clipped by a clipping robust rule where :meth:`clips_record` says so,
        decoded once into :attr:`ClientUpdate.extras` and counted in the
        reply's bytes; a reply without one is dropped. Declaring a record here
        is all a method does for all of that. Default: none.
        """
        return {}

    def record_floor(self, name: str, current: Mapping[str, torch.Tensor]) -> float:
        """The floor of record ``name``'s size screen: a record no larger than
        this is never dropped for its size, whatever the round's median (see
        :func:`fedlr.robust.screen.screen_record_sizes`). Default 0: the
        round's median alone sets the bound."""
        return 0.0

    def clips_record(self, name: str) -> bool:
        """Whether a clipping robust rule clips record ``name`` by its own norm.

        A record that is an update (SCAFFOLD-LoRA's control delta) is clipped
        like the arrays, at the rule's bound relative to the round's median
        norm of that record (the factor is kept in
        :attr:`ClientUpdate.record_factors`); a record that describes the
        client (a gram, eigenpairs, sketches) is screened, never rescaled.
        Default: False.
        """
        return False

    def space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """The space in which the screen and the robust rules measure and move
        client updates.

        The default is the change of the reply's arrays against the round's
        global state (:class:`~fedlr.robust.spaces.ParameterSpace`); the LoRA family
        measures products, FOT projected updates, QR-Mix the head's change.
        """
        return ParameterSpace(current)

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """Move a clipped update's extra records as its arrays were moved.

        Robust norm clipping moves the arrays to ``ref + f (x - ref)``
        (``update.clip_factor`` = f); the extra records of :meth:`records`
        follow here. Default: each scales by ``f`` (a record linear in the
        update). A method whose records depend on the update otherwise
        overrides this (SCAFFOLD-LoRA's control delta).
        """
        f = update.clip_factor
        if f == 1.0 or not update.extras:
            return update
        extras = {
            name: {k: v * f for k, v in record.items()}
            for name, record in update.extras.items()
        }
        return dataclasses.replace(update, extras=extras)

    def hint(self) -> str:
        """What a client must send back, appended to a wrong-keys drop reason."""
        if self.method.train_roles:
            roles = encode_roles(self.method.train_roles)
            return f"the client must send exactly the arrays of {TRAIN_ROLES}={roles}"
        keys = sorted(self.method.reply_shapes())
        return (
            f"the client must send exactly the {len(keys)} arrays it was sent "
            f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
        )

    def accept(
        self,
        sent: Round,
        replies: Iterable[Message],
        current: Mapping[str, torch.Tensor],
        min_replies: int,
    ) -> tuple[list[ClientUpdate], Round]:
        """The round's valid updates, and the round with why the others were
        dropped (``dropped``) and the size screen (``screen``).

        In order: who may answer (:meth:`screen_replies`), what the reply holds
        (:meth:`validate_replies`), how large its update is
        (:meth:`screen_update_sizes`); each drop is logged.

        Raises
        ------
        NoValidRepliesError
            With fewer than ``min_replies`` valid updates.
        """
        server_round = sent.number
        fresh, dropped = self.screen_replies(list(replies), sent.sent)
        updates, invalid = self.validate_replies(fresh, sent.arrays)
        updates, oversized, screen = self.screen_update_sizes(updates, current)
        dropped = invalid + oversized + dropped
        said = _REFUSALS_SAID.setdefault(self.method, set())
        for reason in dropped:
            # a node's refusal repeated word for word in a later round: DEBUG
            level = DEBUG if reason in said else WARNING
            if "client error: " in reason:
                said.add(reason)
            log(level, "round %d: dropped a reply: %s", server_round, reason)
        if len(updates) < min_replies:
            raise NoValidRepliesError(server_round, len(updates), min_replies, dropped)
        return updates, dataclasses.replace(sent, dropped=dropped, screen=screen)


_REFUSALS_SAID: WeakKeyDictionary[ReplyMethod, set[str]] = WeakKeyDictionary()
"""Per strategy (one run), the nodes' refusals already logged at WARNING."""


@functools.cache
def reply_step_type(strategy_type: type) -> type[Replies]:
    """The reply step of a strategy class: the ``replies_type`` its classes
    declare, combined in the order of its MRO.

    A strategy that inherits from two families (``HeteroFoldLoRA`` from the
    heterogeneous-rank family and the factored downlink) gets a reply step
    that inherits from both families' steps, so each family's checks run in
    the order its strategy methods did (cooperative ``super()``).
    """
    declared: list[type[Replies]] = []
    for klass in strategy_type.__mro__:
        step = vars(klass).get("replies_type")
        if step is not None and step not in declared:
            declared.append(step)
    leaves = [
        step
        for step in declared
        if not any(other is not step and issubclass(other, step) for other in declared)
    ]
    if not leaves:
        return Replies
    if len(leaves) == 1:
        return leaves[0]
    return type(f"{strategy_type.__name__}Replies", tuple(leaves), {})
