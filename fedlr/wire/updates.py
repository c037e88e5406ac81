"""A validated client reply, as the aggregation reads it.

:class:`ClientUpdate` is what every strategy's kernel and the robust step
(:mod:`fedlr.robust.rules`) receive: the reply's arrays, its weight and its scalar
metrics, after the server's checks (:class:`~fedlr.round.replies.Replies`).
It lives below both, so the robust step does not import the strategies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import RecordDict

from fedlr.wire.protocol import PARTITION_ID

__all__ = ["ClientUpdate"]


@dataclass(frozen=True)
class ClientUpdate:
    """A validated client reply.

    Attributes
    ----------
    node_id : int
    arrays : dict of str to torch.Tensor
        Exactly the keys of :meth:`~fedlr.strategies.base.FedLRStrategy.reply_shapes`.
    num_examples : int
        The client's weight.
    metrics : dict of str to float
        Other scalar metrics of the reply (e.g. ``train-loss``).
    content : flwr.app.RecordDict
        The whole reply, for methods that send extra named records.
    nbytes : int
        Bytes of the reply's arrays.
    weight : float
        The client's aggregation weight: ``num_examples`` unless a robust
        option (:mod:`fedlr.robust.rules`) capped or re-weighted it. Kernels weight
        by this, never by ``num_examples`` directly.
    extras : dict of str to dict of str to torch.Tensor
        The extra ArrayRecords the strategy declares a reply carries
        (:meth:`~fedlr.round.replies.Replies.reply_records`),
        decoded and checked once, by name.
    clip_factor : float
        The factor robust norm clipping moved the arrays by (``ref + f (x -
        ref)``); 1 when unclipped. The strategy moves the extras to match
        (:meth:`~fedlr.round.replies.Replies.clip_extras`).
    record_factors : dict of str to float
        For an extra record that a clipping robust rule clipped by its own
        norm (:meth:`~fedlr.round.replies.Replies.clips_record`), the factor
        ``g`` it was scaled by, after :meth:`clip_extras`; a record not named
        here was not rescaled (``g = 1``).
    """

    node_id: int
    arrays: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float]
    content: RecordDict
    nbytes: int
    weight: float = -1.0
    extras: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    clip_factor: float = 1.0
    record_factors: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.weight < 0:
            object.__setattr__(self, "weight", float(self.num_examples))

    @classmethod
    def of_arrays(
        cls,
        arrays: dict[str, torch.Tensor],
        num_examples: int = 1,
        node_id: int = 0,
        **fields: Any,
    ) -> ClientUpdate:
        """An update of ``arrays`` alone: no metrics, an empty reply, no
        bytes counted (to measure arrays in an update space, and in tests);
        ``fields`` sets any other attribute (``extras``...)."""
        return cls(
            node_id=node_id,
            arrays=arrays,
            num_examples=num_examples,
            metrics={},
            content=RecordDict(),
            nbytes=0,
            **fields,
        )

    @property
    def partition_id(self) -> int:
        """The client's partition id if it reported one, else -1."""
        return int(self.metrics.get(PARTITION_ID, -1))
