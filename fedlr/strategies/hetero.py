"""The heterogeneous-rank family's base: clients with different LoRA ranks.

The methods are their own modules (:mod:`fedlr.strategies.flexlora`,
:mod:`fedlr.strategies.hetlora`, :mod:`fedlr.strategies.flora`); this one
holds what they share.

Client ``i`` trains rank ``r_i`` (``client-ranks``, cycled over the
partitions) with scaling ``s_i = alpha / r_i``; the server's adapters have
the largest rank ``R``. The ideal aggregate is ``M = sum_i w_i s_i B_i A_i``
(:mod:`fedlr.linalg.hetero`). The strategies differ in what each client gets
back:

* ``flexlora`` (Bai et al., NeurIPS 2024): the truncated SVD of ``M``; a
  client of rank ``r`` receives its best rank-``r`` approximation;
* ``hetlora`` (Cho et al., 2024): the weighted mean of the zero-padded
  factors; a client of rank ``r`` receives the leading ``r`` components;
  optionally, clients prune their own rank (``hetlora-prune-gamma``,
  :class:`HetLoRA`);
* ``flora`` (Wang et al., NeurIPS 2024): ``M`` exactly, folded into the
  base weights (through the factored downlink of
  :mod:`fedlr.strategies.fedex_downlink`); every client starts a fresh
  adapter at its own rank each round;
* ``fedspec`` with ``client-ranks`` (:class:`fedlr.strategies.fedspec.HeteroFedSpec`,
  built on :class:`HeteroRankLoRA`): FlexLoRA's factors
  at FedSpec's adaptive global rank ``R`` (never below the largest client
  rank); ``frobenius-gap`` is FedSpec's, ``||M - M_R||_F``.

The protocol: the global ``A``, ``B`` are at rank ``R``; the ConfigRecord
says ``leading-rank``, so a node of rank ``r`` keeps their leading ``r``
components, scaled by ``sqrt(r / R)`` (then ``(alpha / r) B A`` is the
leading part of ``(alpha / R) B_R A_R``; :func:`fedlr.client.round.apply_round`).
Once a node has replied, the server knows its rank and sends it only those
``r`` components. Replies are validated at the rank their ``A`` declares
(:meth:`~fedlr.strategies.hetero_replies.HeteroReplies.check_rank`): one of
the ``client-ranks``, the rank its partition trains when the reply reports
its ``partition-id`` (fedlr's own clients: ``client-ranks`` cycled over the
partitions), and, once a reply of the node was accepted, that rank for good
(with HetLoRA's pruning, any rank up to the node's previous one); any other
rank is dropped naming the node and both ranks. A reply whose layers
disagree on the rank is dropped naming the key.

Robust options and the update-size screen measure client ``i``'s update as
the change of each layer's scaled product against what it was sent,
``s_i (B_i A_i - B0_i A0_i)`` (:class:`~fedlr.robust.spaces.RankedProductSpace`,
from ``2 r x 2 r`` Gram blocks, never a dense matrix per client), so clients
of different ranks are compared in one space.

Each round reports, per rank, the Frobenius gap of what a client of that rank
receives against ``M`` (``gap-rank-<r>``), and the mean bytes down and up per
client of that rank; ``frobenius-gap`` is the weighted root mean square over
the round's clients of their received gaps (per layer in ``layers.csv``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from logging import getLogger
from typing import Any, ClassVar, NamedTuple

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedlr.adapters.ranks import leading_rank
from fedlr.adapters.roles import AdapterLayout, LoraModule, Role
from fedlr.config.run import RunConfig
from fedlr.flower.records import record_nbytes, record_to_state, state_to_record
from fedlr.linalg import factors_for_rank
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.fedex_downlink import FactoredDownlink
from fedlr.strategies.hetero_replies import HeteroReplies, layout_at_rank
from fedlr.strategies.lora import LoraStrategy
from fedlr.wire import protocol

_LOG = getLogger("fedlr")

__all__ = [
    "HeteroFoldLoRA",
    "HeteroRankLoRA",
    "LayerResult",
    "LayerUpdates",
    "layout_at_rank",
]


class LayerResult(NamedTuple):
    """One adapted layer's aggregation, as :meth:`HeteroRankLoRA.aggregate_layer`
    returns it."""

    gaps: dict[int, float]
    """The gap of what a client of each rank receives against ``M``."""
    norm: float
    """``||M||_F``."""
    gap: float | None = None
    """The layer's ``frobenius-gap`` when it is not the clients' received gaps
    (FedEx-LoRA: the part of ``M`` folded into ``W0``)."""


class LayerUpdates(NamedTuple):
    """One adapted layer's client factors, as the kernels take them."""

    module: LoraModule
    bs: list[torch.Tensor]
    as_: list[torch.Tensor]
    scalings: list[float]
    weights: list[float]

    @property
    def factors(
        self,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float], list[float]]:
        """``(bs, as_, scalings, weights)``: the kernels' first arguments."""
        return self.bs, self.as_, self.scalings, self.weights


class HeteroRankLoRA(LoraStrategy):
    """Base of the LoRA methods whose clients train different ranks.

    Parameters
    ----------
    layout : AdapterLayout
        At the largest client rank.
    client_ranks : sequence of int, optional
        The ranks clients may train; default: the layout's rank only.
    partition_ranks : sequence of int, optional
        The rank each partition trains, cycled: a reply reporting
        ``partition-id`` ``p`` must be at ``partition_ranks[p % len]``
        (fedlr's own clients: ``client-ranks`` in order). Default: not checked.
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    replies_type: ClassVar[type[Replies]] = HeteroReplies

    heterogeneous_ranks: ClassVar[bool] = True

    trims_downlink: ClassVar[bool] = True
    """Send a node of known rank ``r`` only the leading ``r`` components."""

    def __init__(
        self,
        *,
        layout: AdapterLayout,
        client_ranks: Sequence[int] = (),
        partition_ranks: Sequence[int] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(layout=layout, **kwargs)
        if len({m.rank for m in layout.modules}) != 1:
            raise ValueError(f"{type(self).__name__} needs one rank for every layer")
        ranks = tuple(sorted({int(r) for r in client_ranks})) or (self.rank,)
        if ranks[0] < 1 or ranks[-1] != self.rank:
            raise ValueError(
                f"client ranks {list(ranks)} must be >= 1 with the largest equal "
                f"to the layout's rank {self.rank}"
            )
        cycle = tuple(int(r) for r in partition_ranks)
        if not set(cycle) <= set(ranks):
            raise ValueError(
                f"partition ranks {list(cycle)} must be client ranks {list(ranks)}"
            )
        self.client_ranks = ranks
        self.extra_settings = {"client_ranks": list(ranks)}
        self.partition_ranks = cycle
        self.node_ranks: dict[int, int] = {}
        self.extra_columns: tuple[str, ...] = (
            *type(self).extra_columns,
            *(f"gap-rank-{r}" for r in ranks),
            *(f"bytes-down-rank-{r}" for r in ranks),
            *(f"bytes-up-rank-{r}" for r in ranks),
        )
        self._down_by_node: dict[int, tuple[int, int]] = {}
        """This round's train instruction to each node: the rank it was sent
        at and its bytes."""

    @classmethod
    def strategy_kwargs(cls, config: RunConfig) -> dict[str, Any]:
        """``client-ranks`` (default: ``lora-rank`` alone)."""
        ranks = config.rank_list or (config.lora_rank,)
        return {
            **super().strategy_kwargs(config),
            "client_ranks": ranks,
            "partition_ranks": ranks,
        }

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        config[protocol.LEADING_RANK] = True
        return config

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "node-ranks": dict(self.node_ranks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rest = dict(state)
        self.node_ranks = {
            int(n): int(r) for n, r in rest.pop("node-ranks", {}).items()
        }
        super().load_state_dict(rest)

    # ------------------------------------------------------------ helpers
    def alpha(self) -> float:
        """The LoRA alpha every client's scaling ``alpha / r`` uses."""
        m = self.layout.modules[0]
        return m.scaling * m.rank

    def scalings(self, updates: Sequence[ClientUpdate]) -> list[float]:
        """Each update's scaling ``alpha / r_i``."""
        key = self.layout.modules[0].a_key
        return [self.alpha() / int(u.arrays[key].shape[0]) for u in updates]

    def start_of(
        self, update: ClientUpdate, current: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The arrays a client of the update's rank started the round from.

        The leading ``r`` components of the global factors, rescaled
        (:func:`fedlr.adapters.ranks.leading_rank`, what the node applies),
        and the global head.
        """
        rank = int(update.arrays[self.layout.modules[0].a_key].shape[0])
        return leading_rank(layout_at_rank(self.layout, rank), current)

    def layer_updates(self, updates: Sequence[ClientUpdate]) -> list[LayerUpdates]:
        """Every adapted layer's client factors, scalings and weights."""
        weights = [u.weight for u in updates]
        scalings = self.scalings(updates)
        return [
            LayerUpdates(
                m,
                [u.arrays[m.b_key] for u in updates],
                [u.arrays[m.a_key] for u in updates],
                scalings,
                weights,
            )
            for m in self.layout.modules
        ]

    def rank_report(
        self,
        updates: Sequence[ClientUpdate],
        layers: Mapping[str, tuple[dict[int, float], float]],
        layer_gaps: Mapping[str, tuple[float, float]] | None = None,
        **metrics: float,
    ) -> RoundReport:
        """The round's report from each layer's ``({rank: gap}, ||M||_F)``.

        ``frobenius-gap`` (per layer in ``layers.csv``) is from ``layer_gaps``,
        each layer's ``(gap, ||M||_F)``, when given; else the weighted root mean
        square over the round's clients of the gaps of what they receive.
        """
        key = self.layout.modules[0].a_key
        ranks = [int(u.arrays[key].shape[0]) for u in updates]
        total = sum(u.weight for u in updates)
        w = [u.weight / total for u in updates]
        pairs = (
            dict(layer_gaps)
            if layer_gaps is not None
            else {
                name: (
                    math.sqrt(
                        sum(wi * gaps[r] ** 2 for wi, r in zip(w, ranks, strict=True))
                    ),
                    norm,
                )
                for name, (gaps, norm) in layers.items()
            }
        )
        report = RoundReport.from_layers(pairs, rank=float(self.rank), **metrics)
        for r in self.client_ranks:
            report.metrics[f"gap-rank-{r}"] = math.sqrt(
                sum(gaps[r] ** 2 for gaps, _ in layers.values())
            )
            # by the node's rank as its reply declared it (round 1: every node
            # is sent rank R, the rank-r ones too), else the rank it was sent
            sent = [
                nbytes
                for node, (at, nbytes) in self._down_by_node.items()
                if self.node_ranks.get(node, at) == r
            ]
            report.metrics[f"bytes-down-rank-{r}"] = (
                float(sum(sent)) / len(sent) if sent else 0.0
            )
            up = [u.nbytes for u, ri in zip(updates, ranks, strict=True) if ri == r]
            report.metrics[f"bytes-up-rank-{r}"] = (
                float(sum(up)) / len(up) if up else 0.0
            )
        return report

    # ------------------------------------------------------------ aggregation
    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        """Head averaged; each layer by :meth:`aggregate_layer`."""
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(Role.HEAD)))
        results = {
            layer.module.name: self.aggregate_layer(layer, current, state)
            for layer in self.layer_updates(updates)
        }
        layers = {name: (r.gaps, r.norm) for name, r in results.items()}
        own = {n: (r.gap, r.norm) for n, r in results.items() if r.gap is not None}
        report = self.rank_report(updates, layers, layer_gaps=own or None)
        return state, self.finish_report(state, report)

    def aggregate_layer(
        self,
        layer: LayerUpdates,
        current: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> LayerResult:
        """Write one layer's new global arrays into ``state``.

        Returns the gap of what a client of each rank receives against
        ``M = sum_i w_i s_i B_i A_i``, and ``||M||_F``.
        """
        raise NotImplementedError

    def finish_report(
        self, state: Mapping[str, torch.Tensor], report: RoundReport
    ) -> RoundReport:
        """The round's report, after every layer (FLoRA publishes W0 here)."""
        return report

    def set_factors(
        self,
        module: LoraModule,
        b: torch.Tensor,
        a: torch.Tensor,
        current: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        """Global rank-R ``B``, ``A`` from update-space factors ``B~``, ``A~``."""
        b, a = factors_for_rank(b, a, self.rank, module.scaling)
        state[module.b_key] = b.to(current[module.b_key].dtype)
        state[module.a_key] = a.to(current[module.a_key].dtype)

    # ------------------------------------------------------------ Flower hooks
    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """A node of known rank ``r`` is sent only ``r`` components to train."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        if not train:
            return messages
        self._down_by_node = {}
        out: list[Message] = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            rank = self.node_ranks.get(node, self.rank)
            key = self.arrayrecord_key
            if (
                self.trims_downlink
                and rank != self.rank
                and key in message.content.array_records
            ):
                content = RecordDict(dict(message.content.items()))
                full = content.array_records[key]
                record = self._at_rank(full, rank)
                content[key] = record
                message = Message(
                    content=content,
                    message_type=message.metadata.message_type,
                    dst_node_id=node,
                )
            nbytes = sum(
                record_nbytes(r) for r in message.content.array_records.values()
            )
            self._down_by_node[node] = (rank, nbytes)
            out.append(message)
        return out

    def _at_rank(self, record: ArrayRecord, rank: int) -> ArrayRecord:
        """The leading ``rank`` components of the global A, B, rescaled
        (:func:`fedlr.adapters.ranks.leading_rank`, the rule nodes apply)."""
        cut = leading_rank(layout_at_rank(self.layout, rank), record_to_state(record))
        return state_to_record(cut)

    def check_reply_rank(self, message: Message) -> None:
        """No one-rank check: :meth:`validate_reply` checks the declared rank.

        (A mixin's override of ``SeededLoraStrategy.check_reply_rank``, e.g. in
        :class:`~fedlr.strategies.fedspec.HeteroFedSpec`.)
        """


class HeteroFoldLoRA(HeteroRankLoRA, FactoredDownlink):
    """Heterogeneous ranks with a fold into the base weights (FLoRA,
    FedEx-LoRA's :class:`~fedlr.strategies.fedex_lora.HeteroFedExLoRA`):
    ``fedex-downlink`` from the run config, W0 published after every layer.

    Parameters: see :class:`HeteroRankLoRA` and ``fedex_downlink``
    (:class:`~fedlr.strategies.fedex_downlink.FactoredDownlink`).
    """

    def finish_report(
        self, state: Mapping[str, torch.Tensor], report: RoundReport
    ) -> RoundReport:
        return self.publish_base(state, report)
