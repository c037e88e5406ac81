"""The heterogeneous-rank family's reply step: the ranks a reply may have.

A reply is read at the rank its first ``A`` (or ``B``) declares
(:meth:`HeteroReplies.declared_rank`); that rank must be one of the
``client-ranks`` and, once the node's rank is known, that rank
(:meth:`HeteroReplies.check_rank`); a node's first reply must be at its
partition's rank (:meth:`HeteroReplies.check_partition_rank`). A valid reply
fixes the node's rank (the strategy's ``node_ranks``). HetLoRA's
self-pruning relaxes both checks (:class:`fedlr.strategies.hetlora.HetLoRAReplies`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Message

from fedlr.adapters.roles import AdapterLayout
from fedlr.errors import ReplyValidationError
from fedlr.robust.spaces import (
    FACTORS,
    RankedFactorSpace,
    RankedProductSpace,
    SumSpace,
    UpdateSpace,
)
from fedlr.strategies.lora import LoraReplies, aggregation_space
from fedlr.wire.protocol import PARTITION_ID
from fedlr.wire.updates import ClientUpdate

__all__ = ["HeteroReplies", "layout_at_rank"]


def layout_at_rank(layout: AdapterLayout, rank: int) -> AdapterLayout:
    """``layout`` with every module at ``rank`` and its ``alpha / r`` scaling
    (:meth:`AdapterLayout.at_rank`)."""
    return layout.at_rank(rank)


class HeteroReplies(LoraReplies):
    """The heterogeneous-rank family's reply step: a reply is checked at the
    rank it declares (one of ``client-ranks``, the node's once known, its
    partition's on its first reply), measured against what it was sent."""

    method: Any  # a HeteroRankLoRA

    def space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """Each layer's scaled product change against what the client was sent.

        Client ``i`` of rank ``r_i`` is measured as ``s_i (B_i A_i - B0_i
        A0_i)`` (:class:`~fedlr.robust.spaces.RankedProductSpace`), ``B0_i``,
        ``A0_i`` its start (:meth:`start_of`); the head as parameters. A
        method that combines the factors apart (``aggregation_space`` =
        ``factors``, HetLoRA's zero-padded means) measures every array's
        change against that start instead
        (:class:`~fedlr.robust.spaces.RankedFactorSpace`), and one that also
        folds the products into the base weights (``folds_base``) both.
        """
        product = RankedProductSpace(
            [(m.a_key, m.b_key) for m in self.method.layout.modules],
            start=lambda update: self.method.start_of(update, current),
            scaling=lambda update: self.method.scalings([update])[0],
        )
        if aggregation_space(self.method) != FACTORS:
            return product
        factors = RankedFactorSpace(lambda u: self.method.start_of(u, current))
        return SumSpace([factors, product]) if self.method.folds_base else factors

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        """Check a reply at the rank its first ``A`` (or ``B``) declares.

        The rank is checked (:meth:`check_rank`) before the arrays, and the
        partition's rank (:meth:`check_partition_rank`) after them; a valid
        reply fixes the node's rank (:attr:`node_ranks`).
        """
        node = int(message.metadata.src_node_id)
        rank = self.declared_rank(message)
        if rank is None:
            return super().validate_reply(message, expected)
        self.check_rank(node, rank)
        shapes = layout_at_rank(self.method.layout, rank).shapes(
            *self.method.train_roles
        )
        update = super().validate_reply(message, shapes)  # at the declared rank
        if node not in self.method.node_ranks:
            self.check_partition_rank(update, rank)
        self.method.node_ranks[node] = rank
        return update

    def check_rank(self, node: int, rank: int) -> None:
        """Refuse a reply of ``node`` at ``rank`` unless it is a client rank
        and, once the node's rank is known, that rank.

        Raises
        ------
        ReplyValidationError
            Naming the node, if ``rank`` is not one of ``client_ranks``, or
            differs from the node's rank (fixed by its first accepted reply).
        """
        if rank not in self.method.client_ranks:
            raise ReplyValidationError(
                node,
                f"rank {rank} is not one of the client ranks "
                f"{list(self.method.client_ranks)}",
            )
        known = self.method.node_ranks.get(node)
        if known is not None and rank != known:
            raise ReplyValidationError(
                node,
                f"rank {rank} differs from the node's rank {known} (fixed by its "
                "first accepted reply)",
            )

    def partition_rank(self, update: ClientUpdate) -> int | None:
        """The rank the reply's ``partition-id`` trains, if both are known."""
        if not self.method.partition_ranks or PARTITION_ID not in update.metrics:
            return None
        partition = update.partition_id
        return self.method.partition_ranks[partition % len(self.method.partition_ranks)]

    def check_partition_rank(self, update: ClientUpdate, rank: int) -> None:
        """A node's first reply must be at its partition's rank.

        Raises
        ------
        ReplyValidationError
            Naming the node, the partition and both ranks.
        """
        want = self.partition_rank(update)
        if want is not None and rank != want:
            raise ReplyValidationError(
                update.node_id,
                f"rank {rank} is not partition {update.partition_id}'s rank {want} "
                "(client-ranks, cycled over the partitions)",
            )

    def declared_rank(self, message: Message) -> int | None:
        """The rank the reply's first ``A`` (else ``B``) declares, unread.

        ``None`` (validate at the global rank, naming the shape) unless the
        declared shape is a LoRA factor of the layer at some rank
        ``1 .. min(d_out, d_in)``.
        """
        if message.has_error():
            return None
        record = message.content.array_records.get(self.method.arrayrecord_key)
        if record is None:
            return None
        m = self.method.layout.modules[0]
        widest = min(m.d_out, m.d_in)
        for key, axis, side in ((m.a_key, 0, m.d_in), (m.b_key, 1, m.d_out)):
            if key in record:
                shape = list(record[key].shape)
                if (
                    len(shape) == 2
                    and all(isinstance(n, int) for n in shape)
                    and shape[1 - axis] == side
                    and 1 <= shape[axis] <= widest
                ):
                    return int(shape[axis])
                return None
        return None
