"""Base of every fedlr strategy: one validation path, weighting, metrics.

A subclass declares which arrays a valid reply carries (:meth:`reply_shapes`)
and implements :meth:`aggregate_updates`, a pure function of the validated
updates and the current global state. Everything Flower-specific (reading
records, dropping bad replies with a logged reason, byte counts, the
``MetricRecord``) lives here once.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, cast

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedlr.config import RunConfig
from fedlr.errors import NoValidRepliesError, ReplyValidationError
from fedlr.flower.records import record_nbytes, record_to_state, state_to_record
from fedlr.linalg import weighted_mean

__all__ = ["ClientUpdate", "FedLRStrategy", "RoundReport"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class ClientUpdate:
    """A validated client reply.

    Attributes
    ----------
    node_id : int
    arrays : dict of str to torch.Tensor
        Exactly the keys of :meth:`FedLRStrategy.reply_shapes`.
    num_examples : int
        The client's weight.
    metrics : dict of str to float
        Other scalar metrics of the reply (e.g. ``train-loss``).
    content : flwr.app.RecordDict
        The whole reply, for methods that send extra named records.
    nbytes : int
        Bytes of the reply's arrays.
    """

    node_id: int
    arrays: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float]
    content: RecordDict
    nbytes: int

    @property
    def partition_id(self) -> int:
        """The client's partition id if it reported one, else -1."""
        return int(self.metrics.get("partition-id", -1))


@dataclass
class RoundReport:
    """What a round's aggregation produced besides the arrays.

    Attributes
    ----------
    metrics : dict of str to float
        Scalar metrics (``frobenius-gap``, ``relative-gap``, ``rank`` ...).
    layers : dict of str to (float, float)
        Per-layer (gap, relative gap), when the method measures them.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    layers: dict[str, tuple[float, float]] = field(default_factory=dict)


class FedLRStrategy(FedAvg):
    """Message-API strategy with validated replies and a pure aggregation hook.

    Parameters
    ----------
    min_replies : int, default 1
        Valid replies needed to aggregate a round; fewer raise
        :class:`~fedlr.errors.NoValidRepliesError`.
    fraction_evaluate : float, default 0.0
        Federated evaluation is off by default: fedlr evaluates the global
        model on the server's held-out split.
    lr_decay : float, default 1.0
        If the train config carries ``lr``, round ``t`` sends
        ``lr * lr_decay ** (t - 1)`` (a server-side step-size schedule).
    **kwargs
        Other parameters: see ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        min_replies: int = 1,
        fraction_evaluate: float = 0.0,
        lr_decay: float = 1.0,
        **kwargs: Any,
    ) -> None:
        if min_replies < 1:
            raise ValueError(f"min_replies must be >= 1, got {min_replies}")
        if not 0.0 < lr_decay <= 1.0:
            raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay}")
        self.lr_decay = lr_decay
        kwargs.setdefault("min_train_nodes", 1)
        kwargs.setdefault("min_evaluate_nodes", 1)
        kwargs.setdefault("min_available_nodes", 1)
        super().__init__(fraction_evaluate=fraction_evaluate, **kwargs)
        self.min_replies = min_replies
        self._current: ArrayRecord | None = None
        self._bytes_down = 0
        self._missing: list[int] = []
        self.last_report: RoundReport = RoundReport()
        self.last_dropped: list[str] = []

    # ------------------------------------------------------------ subclass API
    @abstractmethod
    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        """Keys and shapes every valid reply's ArrayRecord carries."""

    @abstractmethod
    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        """Combine validated updates into the next global state.

        Parameters
        ----------
        server_round : int
        updates : list of ClientUpdate
            Validated, sorted by partition id then node id.
        current : dict of str to torch.Tensor
            The global state sent this round.

        Returns
        -------
        state : dict of str to torch.Tensor
            The next global state (every key to send next round).
        report : RoundReport
        """

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Extra per-round values for the clients' ConfigRecord."""
        return {}

    @staticmethod
    def base_options(config: RunConfig) -> dict[str, Any]:
        """Constructor arguments every fedlr strategy reads from the run config."""
        return {
            "min_replies": config.min_replies,
            "fraction_train": config.fraction_train,
            "lr_decay": config.lr_decay,
        }

    @staticmethod
    def weighted_means(
        updates: list[ClientUpdate],
        keys: Iterable[str],
        like: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-key weighted mean of the updates, weights = num-examples.

        With ``like``, each mean is cast to ``like[key]``'s dtype.
        """
        weights = [u.num_examples for u in updates]
        means = {
            key: weighted_mean([u.arrays[key] for u in updates], weights)
            for key in keys
        }
        if like is not None:
            means = {k: v.to(like[k].dtype) for k, v in means.items()}
        return means

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a resumed run needs besides the global arrays.

        Tensors and JSON-like values (saved with ``torch.save``). Stateless
        strategies return ``{}``; stateful ones (FedSpec's rank, FOT's bases...)
        override this and :meth:`load_state_dict`.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises
        ------
        ValueError
            If ``state`` has keys this strategy does not know.
        """
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no state, got keys {sorted(state)}"
            )

    # ---------------------------------------------------------- round driver
    def run_round(
        self,
        grid: Grid,
        server_round: int,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord | None = None,
        timeout: float | None = 3600.0,
    ) -> ArrayRecord:
        """One round as ``Strategy.start`` runs it: train, then federated eval.

        The ServerApp drives rounds itself with this (so a run can start at
        any round when it resumes from a checkpoint); Flower's ``start`` works
        too. Nodes that were sent an instruction but did not reply within
        ``timeout`` are reported as dropped (``no reply``).

        Returns
        -------
        ArrayRecord
            The next global arrays.
        """
        sent = list(self.configure_train(server_round, arrays, train_config, grid))
        replies = list(grid.send_and_receive(messages=sent, timeout=timeout))
        answered = {int(m.metadata.src_node_id) for m in replies}
        # Nodes that never answered count as dropped in aggregate_train.
        self._missing = sorted({int(m.metadata.dst_node_id) for m in sent} - answered)
        new_arrays, _ = self.aggregate_train(server_round, replies)
        if new_arrays is not None:
            arrays = new_arrays
        messages = list(
            self.configure_evaluate(
                server_round, arrays, evaluate_config or ConfigRecord(), grid
            )
        )
        if messages:
            evaluations = grid.send_and_receive(messages=messages, timeout=timeout)
            self.aggregate_evaluate(server_round, evaluations)
        return arrays

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global arrays, add per-round values, sample nodes."""
        round_config = self.prepare_round(server_round, arrays, config)
        messages = list(
            super().configure_train(server_round, arrays, round_config, grid)
        )
        self.note_sent(arrays, len(messages))
        return messages

    def prepare_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> ConfigRecord:
        """Remember the round's global arrays; return the round's ConfigRecord.

        The ConfigRecord is ``config`` with ``lr`` decayed for the round and
        :meth:`round_config`'s values added. :meth:`configure_train` calls it;
        so does the legacy-API adapter (:mod:`fedlr.strategies.legacy`).
        """
        self._current = arrays
        round_config = ConfigRecord(dict(config))
        if "lr" in round_config:
            lr = float(cast(float, round_config["lr"]))
            round_config["lr"] = lr * self.lr_decay ** (server_round - 1)
        for key, value in self.round_config(server_round).items():
            round_config[key] = value
        return round_config

    def note_sent(self, arrays: ArrayRecord, count: int) -> None:
        """Record that ``arrays`` went to ``count`` clients (``bytes-down``)."""
        self._bytes_down = record_nbytes(arrays) * count

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply, aggregate the valid ones, report metrics."""
        if self._current is None:
            raise RuntimeError(
                "aggregate_train called before configure_train: the strategy does "
                "not know the current global arrays"
            )
        replies = list(replies)
        updates, dropped = self.validate_replies(replies)
        dropped += [
            f"node {node}: no reply (timed out or lost)" for node in self._missing
        ]
        self._missing = []
        self.last_dropped = dropped
        for reason in dropped:
            log(WARNING, "round %d: dropped a reply: %s", server_round, reason)
        if len(updates) < self.min_replies:
            raise NoValidRepliesError(
                server_round, len(updates), self.min_replies, dropped
            )
        current = record_to_state(self._current)
        state, report = self.aggregate_updates(server_round, updates, current)
        weights = [u.num_examples for u in updates]
        total = float(sum(weights))
        metrics: dict[str, float] = {
            "num-examples": total,
            "clients": float(len(updates)),
            "dropped": float(len(dropped)),
            "bytes-up": float(sum(u.nbytes for u in updates)),
            "bytes-down": float(self._bytes_down),
        }
        losses = [
            (u.metrics.get("train-loss", math.nan), u.num_examples) for u in updates
        ]
        metrics["train-loss"] = sum(loss * n for loss, n in losses) / total
        metrics.update(report.metrics)
        self.last_report = RoundReport(metrics=dict(metrics), layers=report.layers)
        log(
            INFO,
            "round %d: aggregated %d replies (%d dropped)",
            server_round,
            len(updates),
            len(dropped),
        )
        values: dict[str, MetricRecordValues] = dict(metrics)
        return state_to_record(state), MetricRecord(values)

    # -------------------------------------------------------------- validation
    def validate_replies(
        self, replies: list[Message]
    ) -> tuple[list[ClientUpdate], list[str]]:
        """Split replies into valid updates and reasons for the dropped ones."""
        expected = self.reply_shapes()
        updates: list[ClientUpdate] = []
        dropped: list[str] = []
        for message in replies:
            try:
                updates.append(self.validate_reply(message, expected))
            except ReplyValidationError as exc:
                dropped.append(str(exc))
        updates.sort(key=lambda u: (u.partition_id, u.node_id))
        return updates, dropped

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        """Check one reply: error flag, records, keys, shapes, dtype, finiteness.

        Raises
        ------
        ReplyValidationError
            With the node id and what was wrong.
        """
        node = int(message.metadata.src_node_id)
        if message.has_error():
            raise ReplyValidationError(node, f"client error: {message.error.reason}")
        content = message.content
        if self.arrayrecord_key not in content.array_records:
            raise ReplyValidationError(
                node, f"no ArrayRecord '{self.arrayrecord_key}' in the reply"
            )
        metric_records = list(content.metric_records.values())
        if len(metric_records) != 1:
            raise ReplyValidationError(
                node, f"expected one MetricRecord, got {len(metric_records)}"
            )
        metrics = metric_records[0]
        num = metrics.get(self.weighted_by_key)
        if num is None:
            raise ReplyValidationError(node, f"missing '{self.weighted_by_key}'")
        if (
            isinstance(num, list)
            or not math.isfinite(float(num))
            or float(num) < 1
            or float(num) != int(num)
        ):
            raise ReplyValidationError(
                node, f"'{self.weighted_by_key}' must be a positive integer, got {num}"
            )
        record = content.array_records[self.arrayrecord_key]
        keys = set(record.keys())
        if keys != set(expected):
            missing = sorted(set(expected) - keys)[:3]
            extra = sorted(keys - set(expected))[:3]
            raise ReplyValidationError(
                node, f"wrong keys: missing {missing}, unexpected {extra}"
            )
        arrays = record_to_state(record)
        for key, tensor in arrays.items():
            if tuple(tensor.shape) != tuple(expected[key]):
                raise ReplyValidationError(
                    node,
                    f"'{key}' has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(expected[key])}",
                )
            if tensor.dtype not in _FLOAT_DTYPES:
                raise ReplyValidationError(
                    node, f"'{key}' has dtype {tensor.dtype}, expected floating point"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise ReplyValidationError(node, f"'{key}' contains NaN or Inf")
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if k != self.weighted_by_key and isinstance(v, (int, float))
        }
        return ClientUpdate(
            node_id=node,
            arrays=arrays,
            num_examples=int(num),
            metrics=scalars,
            content=content,
            nbytes=record_nbytes(record),
        )
