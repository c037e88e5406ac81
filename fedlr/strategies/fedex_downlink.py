"""The FedEx methods' factored downlink, on the server (:mod:`fedlr.wire.downlink`).

:class:`FactoredDownlink` is mixed into FedEx-LoRA and VeRA-FedEx: it keeps a
:class:`~fedlr.round.ledger.BaseLedger`, tells every instruction the version and
checksum of the base weights it leads to, and, per node, replaces the dense
base weights with the changes the node missed when it keeps the earlier ones
and the changes are smaller. A node's ``base-held`` reply metric is checked
like every other number a client sends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedlr.adapters.roles import AdaptedModel, Role
from fedlr.adapters.vera import VeraModel
from fedlr.client.checks import base_delta_expected
from fedlr.client.features import Bound, ClientFeature, Record, RoundJob
from fedlr.errors import ReplyValidationError
from fedlr.flower.records import record_views
from fedlr.options import NoOptions, Options, option, require
from fedlr.round.ledger import BaseLedger
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from fedlr.wire import protocol
from fedlr.wire.downlink import BaseDelta, Projections, encode_steps, receive_base

__all__ = [
    "DOWNLINKS",
    "DOWNLINK_HELP",
    "BaseWeights",
    "DownlinkOptions",
    "FactoredDownlink",
    "check_downlink",
    "downlink_option",
]


class BaseWeights(ClientFeature):
    """The node's side of the versioned base weights (FedEx-LoRA, VeRA-FedEx).

    On when the instruction carries ``base-version``: dense base weights in
    ``arrays`` are taken and kept in ``context.state``; otherwise the kept
    ones are brought up to date with the ``base-delta`` changes and checked
    against ``base-check`` (:func:`fedlr.wire.downlink.receive_base`). The reply
    reports the version held (``base-held``).
    """

    # the names are fedlr.wire.protocol's: fedlr.wire.downlink (below the strategies)
    # reads them too; the bounds are this feature's
    keys = (
        Bound(protocol.BASE_VERSION, "int", -1, 2**62),
        Bound(protocol.BASE_CHECK, "floats", None, "base_keys"),
    )
    receives = (
        Record(
            protocol.BASE_DELTA,
            "the base-weight changes the node missed, as low-rank factors "
            "(instead of dense base weights in `arrays`)",
            base_delta_expected,
        ),
    )
    node_state = (
        Record(protocol.BASE_STATE, "the base weights at the version it holds"),
        Record(f"{protocol.BASE_STATE}-version", "that version (a ConfigRecord)"),
    )
    metrics = (Record(protocol.BASE_HELD, "the `base-version` the node now keeps"),)
    order = 10

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        return cls() if protocol.BASE_VERSION in job.config else None

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        view = job.adapted
        base = receive_base(
            received,
            job.message.content,
            job.config,
            job.context.state,
            view.layout.keys(Role.BASE),
            _projections(view),
        )
        if base is not None:
            state.update(base[0])
            job.base_version = base[1]

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, Any],
        content: RecordDict,
    ) -> None:
        if job.base_version is not None:
            metrics[protocol.BASE_HELD] = int(job.base_version)


def _projections(view: AdaptedModel) -> Projections | None:
    """A VeRA model's shared projections of a layer, for base-weight changes."""
    if not isinstance(view, VeraModel):
        return None
    a, b = view.projection_a, view.projection_b
    return lambda d_out, d_in: (a[:, :d_in], b[:d_out])


DOWNLINKS = ("factored", "dense")

DOWNLINK_HELP = (
    "how the new base weights reach the nodes. `factored`: a node that keeps "
    "earlier base weights is sent only the changes it missed, as low-rank "
    "factors, or the dense weights when those are smaller or the node keeps "
    "none; `dense`: the base weights every round "
    "([reliability.md](reliability.md#factored-fedex-downlink))"
)


def downlink_option() -> Any:
    """The ``fedex-downlink`` key, declared once for every method reading it."""
    return option(
        "factored", DOWNLINK_HELP, bad=[("sparse", r"one of \['factored', 'dense'\]")]
    )


def check_downlink(value: str) -> None:
    """Raise :class:`~fedlr.errors.ConfigError` unless ``value`` is a downlink."""
    require(
        value in DOWNLINKS,
        "fedex-downlink",
        f"must be one of {list(DOWNLINKS)}, got {value!r}",
    )


@dataclass(frozen=True)
class DownlinkOptions(NoOptions):
    """FedEx-LoRA's run-config key."""

    fedex_downlink: str = downlink_option()

    def check(self) -> None:
        check_downlink(self.fedex_downlink)


class DownlinkReplies(Replies):
    """FactoredDownlink's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: FactoredDownlink

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        """Base checks, then the node's ``base-held`` (a published version).

        A node whose reply fails, or that does not say which base weights it
        keeps, is sent the dense ones next time.
        """
        node = int(message.metadata.src_node_id)
        try:
            update = super().validate_reply(message, expected)
        except Exception:
            self.method.ledger.forget(node)
            raise
        held = update.metrics.get(protocol.BASE_HELD)
        if held is None or not self.method.factored:
            self.method.ledger.forget(node)
            return update
        try:
            self.method.ledger.confirm(node, held)
        except ValueError as exc:
            self.method.ledger.forget(node)
            raise ReplyValidationError(node, str(exc)) from None
        return update


class FactoredDownlink(FedLRStrategy):
    """Send the base weights' changes, not the base weights, where it pays.

    Every such strategy folds updates into the base weights (``folds_base``):
    a quantised base is refused for it (:func:`fedlr.strategies.registry.resolve`).

    A subclass folds a change into each base weight with :meth:`fold_base`
    (which also records the change in factored form when there is one) and
    calls :meth:`publish_base` at the end of ``aggregate_updates``.

    Its options (:attr:`options_type`, :class:`DownlinkOptions` or a method's
    that declares the same ``fedex_downlink`` key) give ``fedex_downlink``:
    ``"factored"`` (default) or ``"dense"``.

    Parameters
    ----------
    **kwargs
        See :class:`~fedlr.strategies.base.FedLRStrategy`.
    """

    method_options: DownlinkOptions

    replies_type: ClassVar[type[Replies]] = DownlinkReplies

    folds_base: ClassVar[bool] = True
    folds_gap: ClassVar[bool] = True
    """Whether each round's fold absorbs the round's gap (FedEx-LoRA's
    residual), so that ``frobenius-gap`` is the gap before the fold, not an
    error of the model; ``False`` for a method whose fold is its
    initialisation only (ILoRA)."""
    options_type: ClassVar[type[Options]] = DownlinkOptions

    extra_columns: tuple[str, ...] = ("dense-base-sends",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ledger: BaseLedger | None = None
        self._deltas: dict[str, BaseDelta] | None = {}
        self._dense_sends = 0
        self._keep = True

    @property
    def fedex_downlink(self) -> str:
        """``"factored"`` or ``"dense"`` (the ``fedex-downlink`` option)."""
        # DownlinkOptions, or a method's options declaring the same key
        return self.method_options.fedex_downlink

    @property
    def ledger(self) -> BaseLedger:
        """The versions of the base weights and who keeps which."""
        if self._ledger is None:  # the layout is set after this __init__ runs
            self._ledger = BaseLedger(list(self.base_keys()))
        return self._ledger

    # ------------------------------------------------------------ subclass API
    def base_keys(self) -> list[str]:
        """The base-weight keys, in layout order."""
        return list(self.layout.keys(Role.BASE))  # type: ignore[attr-defined]

    @property
    def factored(self) -> bool:
        """Whether changes are sent factored (``fedex-downlink = factored``)."""
        return self.fedex_downlink == "factored"

    def fold_base(
        self,
        key: str,
        base: torch.Tensor,
        delta: BaseDelta | None,
        dense: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """The new base weight: ``delta`` applied, or ``dense()`` without one.

        With a factored downlink and a ``delta``, the server's new weight is
        :meth:`BaseDelta.apply` of it, the function every node applies, so the
        nodes' copies are the server's. Without one the round's change reaches
        the nodes only as dense weights.
        """
        if self.factored and delta is not None:
            if self._deltas is not None:
                self._deltas[key] = delta
            return delta.apply(base, self.delta_projections())
        self._deltas = None
        return dense()

    def step_bytes_bound(self, sampled: int) -> float:
        """An upper bound of one round's change in bytes with ``sampled`` clients.

        ``inf`` when some layer's change would not be smaller than its dense
        weight (a dense-only round); the default knows nothing (0: assume it
        pays until a round has measured it).
        """
        return 0.0

    def factored_bound(self, widths: Mapping[str, tuple[int, int, int]]) -> float:
        """Bytes of a change whose layers have ``(rank, d_left, d_right)``.

        A layer's change weighs ``rank (d_left + d_right)`` items; ``inf``
        when one is not smaller than its dense ``d_out x d_in`` weight. The
        item size is the base weights' (from the ledger, float32 before it
        has seen them).
        """
        items = 0.0
        dense = 0.0
        for m in self.layout.modules:  # type: ignore[attr-defined]
            rank, left, right = widths[m.name]
            if rank * (left + right) >= m.d_out * m.d_in:
                return math.inf
            items += rank * (left + right)
            dense += m.d_out * m.d_in
        nbytes = self.ledger.dense_nbytes
        itemsize = nbytes / dense if nbytes and dense else 4.0
        return items * itemsize

    def worth_keeping(self, sampled: int) -> bool:
        """Whether nodes should keep the base weights to receive changes.

        A node sampled with probability ``fraction_train`` waits about
        ``1 / fraction_train`` rounds between rounds; the changes it then
        needs weigh about that many times one change (the last one measured,
        else :meth:`step_bytes_bound`). When that is not below the dense
        weights, keeping a copy on every node (in a simulation, all in one
        process) costs memory for nothing: the instructions say
        ``base-version = -1`` and nodes drop their copies.
        """
        ledger = self.ledger
        step = ledger.last_change_nbytes
        if step is None:
            step = self.step_bytes_bound(sampled)
        fraction = min(1.0, max(float(getattr(self, "fraction_train", 1.0)), 1e-9))
        return step / fraction < ledger.dense_nbytes

    def delta_projections(self) -> Any:
        """``projections(d_out, d_in)`` for VeRA changes; ``None`` for LoRA."""
        return None

    def publish_base(
        self, state: Mapping[str, torch.Tensor], report: RoundReport
    ) -> RoundReport:
        """Record this round's new base weights as the next version."""
        if self.factored:
            self.ledger.publish(self._deltas, state)
        self._deltas = {}
        report.metrics["dense-base-sends"] = float(self._dense_sends)
        return report

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "downlink": self.ledger.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rest = dict(state)
        ledger = rest.pop("downlink", None)
        super().load_state_dict(rest)
        if ledger is not None:
            self.ledger.load_state_dict(ledger)

    # ------------------------------------------------------------ Flower hooks
    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """Each node's base weights, as dense or as changes."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        if train:
            self._deltas = {}
        return self._per_node(messages, arrays, count=train)

    def _per_node(
        self, messages: Iterable[Message], arrays: ArrayRecord, *, count: bool
    ) -> list[Message]:
        messages = list(messages)
        if count:
            self._dense_sends = len(messages)
        if not self.factored or not messages:
            return messages
        keys = self.base_keys()
        self.ledger.sync(record_views(arrays, keys), source=[arrays[k] for k in keys])
        if count:
            self._keep = self.worth_keeping(len(messages))
        if not self._keep:
            return [
                _with_config(m, self.configrecord_key, {protocol.BASE_VERSION: -1})
                for m in messages
            ]
        light = ArrayRecord({k: arrays[k] for k in arrays if k not in set(keys)})
        versioned = {
            protocol.BASE_VERSION: self.ledger.version,
            protocol.BASE_CHECK: list(self.ledger.checks or []),
        }
        out: list[Message] = []
        dense = 0
        for message in messages:
            node = int(message.metadata.dst_node_id)
            message = _with_config(message, self.configrecord_key, versioned)
            content = message.content
            plan = self.ledger.plan(node)
            if plan is None:
                dense += 1
            else:
                content[self.arrayrecord_key] = light
                if plan:
                    content[protocol.BASE_DELTA] = encode_steps(plan)
            out.append(message)  # _with_config gave it its own content
        if count:
            self._dense_sends = dense
        return out


def _with_config(message: Message, name: str, values: Mapping[str, Any]) -> Message:
    """``message`` with ``values`` added to its ConfigRecord ``name``."""
    content = RecordDict(dict(message.content.items()))
    config = ConfigRecord(dict(content.config_records.get(name) or {}))
    for key, value in values.items():
        config[key] = value
    content[name] = config
    return Message(
        content=content,
        message_type=message.metadata.message_type,
        dst_node_id=int(message.metadata.dst_node_id),
    )
