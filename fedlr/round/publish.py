"""The round's last step: check the new global state, then report it.

What a round publishes besides the arrays (:class:`RoundReport`), the check
that refuses a new global state (:func:`check_new_state`: NaN, Inf, and the
opt-in ``max-update-ratio``), and the round's metrics: fedlr's own
(:func:`round_metrics`) merged over the clients' aggregated ones
(:func:`merge_metrics`), with the clients a robust rule left out aggregated
apart (``trimmed-``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from weakref import WeakKeyDictionary

import torch
from flwr.app import MetricRecord, MetricRecordValues, RecordDict
from flwr.supercore import log

from fedlr.wire.protocol import (
    HELPER_METRICS,
    NUM_EXAMPLES,
    TRAIN_LOSS,
    TRAIN_LOSS_ALIASES,
    train_loss_of,
)
from fedlr.wire.updates import ClientUpdate

__all__ = [
    "RoundReport",
    "check_new_state",
    "client_metrics",
    "mean_train_loss",
    "merged_metrics",
    "round_metrics",
    "without_helper_metrics",
]

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord | None]
"""Flower's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``."""


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

    @classmethod
    def from_layers(
        cls, layers: Mapping[str, tuple[float, float]], **metrics: float
    ) -> RoundReport:
        """Totals from per-layer ``(gap, reference norm)`` pairs.

        ``frobenius-gap = sqrt(sum gap^2)`` and ``relative-gap =
        frobenius-gap / sqrt(sum norm^2)`` (0 when every norm is 0); each
        layer's relative gap is ``gap / norm`` (0 when ``norm`` is 0).

        Parameters
        ----------
        layers : mapping of str to (float, float)
            Layer name to ``(||Delta_agg - Delta_ref||_F, ||Delta_ref||_F)``.
        **metrics : float
            Further metrics (``rank`` ...), after the two gaps.

        Returns
        -------
        RoundReport

        Raises
        ------
        ValueError
            If ``metrics`` names one of the two computed gaps.
        """
        clash = sorted({"frobenius-gap", "relative-gap"} & metrics.keys())
        if clash:
            raise ValueError(f"from_layers computes {clash}; do not pass them")
        gap_sq = sum(gap * gap for gap, _ in layers.values())
        norm_sq = sum(norm * norm for _, norm in layers.values())
        total = math.sqrt(gap_sq)
        return cls(
            metrics={
                "frobenius-gap": total,
                "relative-gap": total / math.sqrt(norm_sq) if norm_sq > 0 else 0.0,
                **metrics,
            },
            layers={
                name: (gap, gap / norm if norm > 0 else 0.0)
                for name, (gap, norm) in layers.items()
            },
        )


def check_new_state(
    state: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
    max_update_ratio: float,
) -> str | None:
    """Why the aggregated global state must not be published, or ``None``.

    Refused: any NaN or Inf, and, with ``max_update_ratio`` > 0, a change
    ``||new - current||_F`` above ``max_update_ratio * ||current||_F``
    (over the keys whose shape did not change).
    """
    for key, tensor in state.items():
        if not bool(torch.isfinite(tensor).all()):
            return f"the new global array '{key}' contains NaN or Inf"
    if max_update_ratio <= 0:
        return None
    change_sq = 0.0
    norm_sq = 0.0
    for key, tensor in state.items():
        old = current.get(key)
        if old is None or old.shape != tensor.shape:
            continue
        change_sq += float((tensor.double() - old.double()).square().sum())
        norm_sq += float(old.double().square().sum())
    change, norm = math.sqrt(change_sq), math.sqrt(norm_sq)
    if change > max_update_ratio * norm:
        return (
            f"the global update norm {change:.4g} exceeds max-update-ratio "
            f"{max_update_ratio} x the current norm {norm:.4g}"
        )
    return None


def mean_train_loss(updates: list[ClientUpdate]) -> float:
    """Weighted mean training loss of the updates that report one, else NaN.

    Either spelling counts (:data:`~fedlr.wire.protocol.TRAIN_LOSS_ALIASES`); a
    reported NaN or Inf is kept (a diverged client shows in the mean).
    """
    reported = [
        (train_loss_of(u.metrics), u.num_examples)
        for u in updates
        if any(key in u.metrics for key in TRAIN_LOSS_ALIASES)
    ]
    if not reported:
        return math.nan
    return sum(loss * n for loss, n in reported) / sum(n for _, n in reported)


def round_metrics(
    updates: list[ClientUpdate],
    *,
    valid: int,
    dropped: int,
    bytes_down: int,
    rejected: bool,
    protection: Mapping[str, float],
) -> dict[str, float]:
    """fedlr's own metrics of a round, before the method's report.

    ``num-examples`` (the sum), ``clients`` (valid replies), ``dropped``,
    ``bytes-up`` (the aggregated updates' bytes), ``bytes-down``,
    ``rejected``, the robust rule's and privacy's metrics (``protection``)
    and, when a client reports one, ``train-loss`` (:func:`mean_train_loss`).
    """
    metrics: dict[str, float] = {
        NUM_EXAMPLES: float(sum(u.num_examples for u in updates)),
        "clients": float(valid),
        "dropped": float(dropped),
        "bytes-up": float(sum(u.nbytes for u in updates)),
        "bytes-down": float(bytes_down),
        "rejected": 1.0 if rejected else 0.0,
        **protection,
    }
    if any(key in u.metrics for u in updates for key in TRAIN_LOSS_ALIASES):
        metrics[TRAIN_LOSS] = mean_train_loss(updates)
    return metrics


def client_metrics(
    aggregate: MetricsAggregation,
    weighted_by_key: str,
    updates: list[ClientUpdate],
    left_out: list[ClientUpdate],
) -> MetricRecord | None:
    """The clients' own metrics by ``aggregate`` (Flower's
    ``train_metrics_aggr_fn``); those of the clients the robust rule left out
    are aggregated apart (``trimmed-``). The helpers' ids and flags are not
    averaged."""
    clients = aggregate(
        [without_helper_metrics(u.content) for u in updates], weighted_by_key
    )
    if not left_out:
        return clients
    trimmed = aggregate(
        [without_helper_metrics(u.content) for u in left_out], weighted_by_key
    )
    values: dict[str, MetricRecordValues] = dict(clients or {})
    for key, value in (trimmed or {}).items():
        values[f"trimmed-{key}"] = value
    return MetricRecord(values)


def merged_metrics(
    owner: object,
    clients: MetricRecord | None,
    own: Mapping[str, float],
    weighted_by_key: str,
    *,
    quiet: Iterable[str] = (),
) -> MetricRecord:
    """The clients' aggregated metrics with fedlr's own on top.

    A key of the clients' that fedlr also reports is replaced by fedlr's
    value; a clash is logged once per key and ``owner`` (a strategy: one
    run), except for ``num-examples``, the training loss, the weight key and
    the keys of ``quiet``, replaced silently.
    """
    values: dict[str, MetricRecordValues] = dict(clients or {})
    silent = {NUM_EXAMPLES, weighted_by_key, *TRAIN_LOSS_ALIASES, *quiet}
    warned = _CLASHES_WARNED.setdefault(owner, set())
    clashes = sorted((set(values) & set(own)) - silent - warned)
    if clashes:
        warned.update(clashes)
        log(
            WARNING,
            "the clients' aggregated metrics %s clash with fedlr's own; "
            "fedlr's values are reported (rename them in the ClientApp or "
            "the metrics aggregation fn)",
            clashes,
        )
    values.update(own)
    return MetricRecord(values)


_CLASHES_WARNED: WeakKeyDictionary[object, set[str]] = WeakKeyDictionary()
"""Per strategy (one run), the clients' metric keys already warned of."""


def without_helper_metrics(content: RecordDict) -> RecordDict:
    """``content`` with :data:`fedlr.wire.protocol.HELPER_METRICS` left out of its
    MetricRecords (a copy; the same object when it has none of them)."""
    if not any(
        key in record
        for record in content.metric_records.values()
        for key in HELPER_METRICS
    ):
        return content
    out = RecordDict()
    for name, record in content.items():
        if isinstance(record, MetricRecord):
            record = MetricRecord(
                {k: v for k, v in record.items() if k not in HELPER_METRICS}
            )
        out[name] = record
    return out
