"""Shared base of the LoRA strategies whose nodes share the seeded initial adapter.

:class:`SeededLoraStrategy` adds to :class:`~fedlr.strategies.lora.LoraStrategy`:

* a rank check: a reply whose ``A`` or ``B`` has another rank than this
  round's is dropped with a ``rank mismatch`` reason, and
  :meth:`SeededLoraStrategy.check_ranks` raises
  :class:`~fedlr.errors.RankMismatchError` naming every client's shapes when
  updates of different ranks reach the aggregation directly;
* the adapter's seeded initial state (:meth:`SeededLoraStrategy.bind_initial`),
  for methods whose frozen factors are not sent;
* the Frobenius gap of an aggregate given as factors,
  ``||sum_i w_i B_i A_i - B_agg A_agg||_F``, without a dense product.

:class:`RoundRoles` is the base of methods whose replies carry other roles
from round to round (RoLoRA, SLoRA, HiLoRA).

:class:`PersonalLoraStrategy` is the base of personalised methods (FedSA-LoRA,
Global SVD, Local SVD): some factors stay with each client (``keep-roles`` in
the ConfigRecord, or a per-node ArrayRecord ``personal`` the server sends), the
client trains and evaluates on its own train and held-out parts, and the
round's accuracy is the mean (and spread) of the clients' federated
evaluations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from logging import WARNING, getLogger
from typing import Any, ClassVar, Self

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedlr.adapters.plugin import adapted
from fedlr.adapters.roles import AdaptedModel, AdapterLayout, Role
from fedlr.adapters.sorf_vera import SorfVeraLayout
from fedlr.adapters.vera import VeraLayout
from fedlr.client.checks import role_groups
from fedlr.client.features import ClientFeature, Expected, Incoming, Record, RoundJob
from fedlr.config.run import RunConfig
from fedlr.errors import ReplyValidationError
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.linalg import (
    DEFAULT_COST_MODEL,
    aggregate_gap,
    gap_summary,
    normalise_weights,
    personal_change,
    require_common_rank,
)
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora import LoraReplies, LoraStrategy
from fedlr.wire import protocol

__all__ = [
    "PERSONAL_GRAM",
    "PersonalArrays",
    "PersonalLoraStrategy",
    "SeededLoraStrategy",
]

PERSONAL_GRAM = "personal-gram"
"""Reply ArrayRecord of ``B^T B`` (r x r) per layer, keyed by the ``B`` key:
what the server's gap report needs of factors kept on the node (FedSA-LoRA)."""

_LOG = getLogger("fedlr")


def _personal_expected(incoming: Incoming) -> Expected | None:
    """``personal``: arrays of the model's layout at the round's rank, each
    role's sent whole or not at all."""
    if protocol.PERSONAL not in incoming.content.array_records:
        return None
    shapes = {key: shape for _, key, shape in incoming.layout.entries()}
    return Expected(shapes, tuple(tuple(g) for g in role_groups(incoming.layout)))


class PersonalArrays(ClientFeature):
    """The personalised methods' client side: arrays that stay on the node.

    On when the instruction names ``keep-roles`` or ``personal-split``, sends
    an ArrayRecord ``personal`` (Global SVD's per-node factor), or the node
    keeps personal arrays in ``context.state``. Received ones are kept; kept
    ones that fit the model are loaded over the global arrays (a rank change
    since they were kept leaves them out, with a warning). The reply stores
    the trained ``keep-roles`` in ``context.state``, reports
    ``personal-loaded`` and, when ``B`` stays on the node (FedSA-LoRA), adds
    ``personal-gram``: ``B^T B`` per layer, what the server's gap report
    needs of the kept factors.
    """

    # keep-roles and personal-split are the common round's keys (it trains
    # the kept roles and picks the data by them): read here, not declared
    receives = (
        Record(
            protocol.PERSONAL,
            "the node's own factors (Global SVD's `lora_B`)",
            _personal_expected,
        ),
    )
    sends = (
        Record(
            PERSONAL_GRAM,
            "`B^T B` (r x r) per layer when `B` stays on the node (FedSA-LoRA)",
        ),
    )
    node_state = (
        Record(
            protocol.PERSONAL,
            "the node's personal arrays: received ones, or its trained `keep-roles`",
        ),
    )
    metrics = (
        Record(
            protocol.PERSONAL_LOADED,
            "1 if personal arrays were loaded over the global ones this round",
        ),
    )
    order = 30

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        on = (
            bool(job.keep_roles)
            or job.personal_split
            or protocol.PERSONAL in job.message.content.array_records
            or protocol.PERSONAL in job.context.state.array_records
        )
        return cls() if on else None

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        content, kept = job.message.content, job.context.state
        if protocol.PERSONAL in content.array_records:
            kept[protocol.PERSONAL] = content.array_records[protocol.PERSONAL]
        if protocol.PERSONAL not in kept.array_records:
            return
        personal = record_to_state(kept.array_records[protocol.PERSONAL])
        shapes = {key: shape for _, key, shape in job.adapted.layout.entries()}
        if all(tuple(v.shape) == shapes.get(k) for k, v in personal.items()):
            state.update(personal)
            job.personal_loaded = True
        else:
            _LOG.log(
                WARNING,
                "node %s: personal arrays in context.state do not fit the model "
                "(the rank changed since they were kept); not loaded",
                job.context.node_id,
            )

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, Any],
        content: RecordDict,
    ) -> None:
        layout = job.adapted.layout
        if not isinstance(layout, (VeraLayout, SorfVeraLayout)):
            metrics[protocol.PERSONAL_LOADED] = int(job.personal_loaded)
        if not job.keep_roles:
            return
        job.context.state[protocol.PERSONAL] = state_to_record(
            trained, layout.keys(*job.keep_roles)
        )
        if Role.LORA_B in job.keep_roles and isinstance(layout, AdapterLayout):
            content[PERSONAL_GRAM] = ArrayRecord(
                {
                    m.b_key: (trained[m.b_key].T @ trained[m.b_key]).contiguous()
                    for m in layout.modules
                }
            )


class SeededReplies(LoraReplies):
    """SeededLoraStrategy's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: SeededLoraStrategy

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        """Drop a reply whose factors have another rank, then the base checks."""
        if not message.has_error():
            self.method.check_reply_rank(message)
        return super().validate_reply(message, expected)


class SeededLoraStrategy(LoraStrategy):
    """A LoRA strategy whose server and clients share the seeded initial adapter.

    The base of the methods that rely on every node building the same
    adapter from a fixed seed: FFA-LoRA (A frozen at it, never sent), FedSVD
    and FedSpec (server SVDs, padding of grown ranks seeded here) and the
    personalised methods (:class:`PersonalLoraStrategy`). The server plan
    binds the initial A, B and head (:meth:`bind_initial`); a reply is
    checked to have this round's rank before its shapes.

    Class attributes: ``extra_columns`` are the ``results.csv`` columns the
    method adds (declared to the server plan); ``keep_roles`` are roles the
    clients train but keep (never sent).

    Parameters
    ----------
    layout : AdapterLayout
    seed : int, default 0
        Seed of any server-side randomness (padding of grown ranks).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    replies_type: ClassVar[type[Replies]] = SeededReplies

    extra_columns: tuple[str, ...] = ()
    keep_roles: ClassVar[tuple[Role, ...]] = ()

    def __init__(self, *, layout: AdapterLayout, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(layout=layout, **kwargs)
        self.seed = seed
        self.initial_state: dict[str, torch.Tensor] = {}

    @classmethod
    def strategy_kwargs(cls, config: RunConfig) -> dict[str, Any]:
        """The run's seed (padding of grown ranks is seeded)."""
        return {"seed": config.seed}

    def bind_initial(self, state: Mapping[str, torch.Tensor]) -> None:
        """Remember the adapter's seeded initial A, B and head (same on clients)."""
        self.initial_state = {k: v.detach().clone() for k, v in state.items()}

    # -------------------------------------------------------------- validation

    def check_reply_rank(self, message: Message) -> None:
        """Every factor of the reply has this round's rank.

        Named before the shape checks, so a client of another rank is told
        so rather than shown a shape. Heterogeneous-rank strategies
        (:class:`~fedlr.strategies.hetero.HeteroRankLoRA`) check the rank a
        reply declares instead, and make this a no-op.

        Raises
        ------
        ReplyValidationError
            Naming the node, the layer, the key and both ranks.
        """
        records = message.content.array_records
        if self.arrayrecord_key not in records:
            return
        record = records[self.arrayrecord_key]
        node = int(message.metadata.src_node_id)
        for module in self.layout.modules:
            for key, axis in ((module.a_key, 0), (module.b_key, 1)):
                if key not in record:
                    continue
                shape = tuple(record[key].shape)
                if len(shape) == 2 and shape[axis] != module.rank:
                    raise ReplyValidationError(
                        node,
                        f"rank mismatch in layer '{module.name}': '{key}' "
                        f"has shape {shape} (rank {shape[axis]}), this "
                        f"round's rank is {module.rank}",
                    )

    def check_ranks(self, updates: Sequence[ClientUpdate]) -> None:
        """Every update carrying both factors of a layer has one rank.

        Raises
        ------
        RankMismatchError
            Naming every client (node id) and its ``B`` and ``A`` shapes.
        """
        for module in self.layout.modules:
            factors = {
                f"node {u.node_id}": (u.arrays[module.b_key], u.arrays[module.a_key])
                for u in updates
                if module.b_key in u.arrays and module.a_key in u.arrays
            }
            if factors:
                require_common_rank(factors, module.name)

    # --------------------------------------------------------------------- gap
    def factored_gap_report(
        self,
        updates: Sequence[ClientUpdate],
        client_factors: Mapping[str, tuple[list[torch.Tensor], list[torch.Tensor]]],
        aggregate: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> RoundReport:
        """``||sum_i w_i B_i A_i - B_agg A_agg||_F`` per layer and in total.

        Parameters
        ----------
        updates : sequence of ClientUpdate
            For the weights (``weight``).
        client_factors : mapping of layer name to (k B_i (d_out, r), k A_i (r, d_in))
        aggregate : mapping of layer name to (B_agg (d_out, r'), A_agg (r', d_in))
            The aggregate's update in the same units as ``B_i A_i``.

        Returns
        -------
        RoundReport
            ``frobenius-gap``, ``relative-gap`` (over ``||sum_i w_i B_i A_i||``),
            ``rank``, ``gap-estimated`` and ``gap-error-bound``; per-layer
            gaps. No dense product per client: when every client shares ``A``
            (FedSVD, FFA-LoRA) the mean is ``B_bar A`` exactly, whatever ``k``;
            otherwise :func:`fedlr.linalg.aggregate_gap` picks the stacked
            factors' QR norms, an in-place dense sum, or a flagged estimate.
        """
        weights = [u.weight for u in updates]
        norms = {
            name: aggregate_gap(
                bs,
                as_,
                weights,
                *aggregate[name],
                cost=DEFAULT_COST_MODEL,
                seed=self.seed,
            )
            for name, (bs, as_) in client_factors.items()
        }
        return self._report(
            {name: n.pair for name, n in norms.items()}, **gap_summary(norms.values())
        )

    def _report(
        self, layers: Mapping[str, tuple[float, float]], **metrics: float
    ) -> RoundReport:
        """Totals from per-layer (gap, reference norm) pairs, ``rank``, ``metrics``."""
        return RoundReport.from_layers(layers, rank=float(self.rank), **metrics)

    def averaged(
        self, updates: Sequence[ClientUpdate], current: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``current`` with every sent-and-trained key replaced by its weighted mean."""
        state = dict(current)
        keys = [k for k in self.layout.keys(*self.train_roles) if k in current]
        state.update(weighted_means(list(updates), keys))
        return state

    def initial_arrays(self, model: torch.nn.Module | AdaptedModel) -> ArrayRecord:
        """The base's initial arrays; also binds the model's initial A, B, head.

        :meth:`bind_initial` with the model's values: FFA-LoRA measures its
        gap against the ``A`` it never sends.
        """
        record = super().initial_arrays(model)
        self.bind_initial(adapted(model).state((Role.LORA_A, Role.LORA_B, Role.HEAD)))
        return record


class RoundRolesReplies(SeededReplies):
    """The reply step of a :class:`RoundRoles` method: the wrong-keys hint
    names the roles of the last train round."""

    method: RoundRoles

    def hint(self) -> str:
        roles = protocol.encode_roles(self.method.round_roles(self.method.last_round))
        return (
            f"the client must send exactly the arrays of {protocol.TRAIN_ROLES}={roles}"
        )


class RoundRoles(SeededLoraStrategy):
    """A seeded LoRA strategy whose replies carry other roles from round to
    round.

    A subclass gives :meth:`round_roles`; they are sent as the round's
    ``train-roles``, and replies are checked against those of the last
    train round (:attr:`last_round`, which the subclass keeps in its
    ``state_dict`` as ``_round``).
    """

    replies_type: ClassVar[type[Replies]] = RoundRolesReplies

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._round = 0

    def round_roles(self, server_round: int) -> tuple[Role, ...]:
        """The roles round ``server_round`` trains and its replies carry."""
        raise NotImplementedError

    @property
    def last_round(self) -> int:
        """The round of the last train instructions (1 before any)."""
        return max(self._round, 1)

    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.layout.shapes(*self.round_roles(self.last_round))

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        config[protocol.TRAIN_ROLES] = protocol.encode_roles(
            self.round_roles(server_round)
        )
        return config

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """A train round's number decides the replies' keys."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        if train:
            self._round = server_round
        return messages


class PersonalReplies(SeededReplies):
    """PersonalLoraStrategy's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: PersonalLoraStrategy

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """The ``personal-gram`` record (``B^T B``, r x r per layer) when B is kept."""
        if Role.LORA_B not in self.method.keep_roles:
            return {}
        return {
            PERSONAL_GRAM: {
                m.b_key: (m.rank, m.rank) for m in self.method.layout.modules
            }
        }

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """The gram is of the node's own ``B``, which clipping does not move."""
        return update


class PersonalLoraStrategy(SeededLoraStrategy):
    """Base of personalised LoRA methods: personal factors stay with clients.

    Federated evaluation is on (``fraction_evaluate`` 1): every client
    evaluates its own personalised model on its own held-out part; the round's
    ``accuracy`` and ``loss`` are the means over clients, ``accuracy-std``,
    ``accuracy-min`` and ``accuracy-max`` their spread (population standard
    deviation, unweighted: each client counts once). ``personal-clients``
    counts the round's clients that started from their own kept (or
    received) personal factors.

    Parameters: see :class:`SeededLoraStrategy`.
    """

    replies_type: ClassVar[type[Replies]] = PersonalReplies

    extra_columns: tuple[str, ...] = (
        "accuracy-std",
        "accuracy-min",
        "accuracy-max",
        "personal-clients",
    )
    keep_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_B,)
    federated_evaluation: ClassVar[bool] = True
    personalised: ClassVar[bool] = True

    def __init__(self, *, layout: AdapterLayout, **kwargs: Any) -> None:
        kwargs.setdefault("fraction_evaluate", 1.0)
        super().__init__(layout=layout, **kwargs)
        self.personal: dict[int, dict[str, torch.Tensor]] = {}

    def state_dict(self) -> dict[str, Any]:
        """The personal factors the server still has to deliver, by node."""
        return {
            "personal": {
                node: {k: v.clone() for k, v in arrays.items()}
                for node, arrays in self.personal.items()
            }
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"personal"})
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown state keys {unknown}")
        saved = state.get("personal", {})
        self.personal = {int(node): dict(arrays) for node, arrays in saved.items()}

    def with_personal_count(
        self, updates: Sequence[ClientUpdate], report: RoundReport
    ) -> RoundReport:
        """Add ``personal-clients`` to a round's report."""
        report.metrics["personal-clients"] = float(
            sum(u.metrics.get(protocol.PERSONAL_LOADED, 0.0) > 0 for u in updates)
        )
        return report

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        config[protocol.KEEP_ROLES] = protocol.encode_roles(self.keep_roles)
        config[protocol.PERSONAL_SPLIT] = True
        return config

    # ------------------------------------------------------------ Flower hooks
    def _with_personal(
        self, messages: Iterable[Message], *, count: bool
    ) -> list[Message]:
        """Add each node's ``personal`` ArrayRecord where the server holds one.

        ``count`` adds the extra bytes to the round's ``bytes-down``.
        """
        out: list[Message] = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            arrays = self.personal.get(node)
            if arrays is None:
                out.append(message)
                continue
            content = RecordDict(dict(message.content.items()))
            record = ArrayRecord(arrays)
            content[protocol.PERSONAL] = record
            out.append(
                Message(
                    content=content,
                    message_type=message.metadata.message_type,
                    dst_node_id=node,
                )
            )
        return out

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """Each node's personal factors (if the server has any), to train with
        and to evaluate its personalised model on its held-out part."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        return self._with_personal(messages, count=train)

    # -------------------------------------------------------------- validation

    # --------------------------------------------------------------------- gap
    def personal_gap_report(
        self, updates: Sequence[ClientUpdate], new_state: Mapping[str, torch.Tensor]
    ) -> RoundReport:
        """Gap of a personalised method whose clients keep ``B`` and share ``A``.

        Client ``i`` trained ``B_i A_i`` and continues with ``B_i A_bar``, so per
        layer ``gap^2 = sum_i w_i ||B_i (A_i - A_bar)||_F^2`` and the relative
        gap divides by ``sqrt(sum_i w_i ||B_i A_i||_F^2)``; both come from the
        clients' ``B_i^T B_i`` (r x r), the server never sees ``B_i``.
        """
        w = normalise_weights([u.weight for u in updates], len(updates))
        layers: dict[str, tuple[float, float]] = {}
        for module in self.layout.modules:
            change_sq = 0.0
            own_sq = 0.0
            for weight, u in zip(w.tolist(), updates, strict=True):
                gram = u.extras[PERSONAL_GRAM]
                change, own = personal_change(
                    gram[module.b_key], u.arrays[module.a_key], new_state[module.a_key]
                )
                change_sq += weight * change
                own_sq += weight * own
            layers[module.name] = (math.sqrt(change_sq), math.sqrt(own_sq))
        return self.with_personal_count(updates, self._report(layers))
