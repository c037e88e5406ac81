"""``trimmed-mean``: the ``trim-fraction`` of clients farthest from the
geometric median (at least one when ``k >= 3``, never half) are left out and
the others keep their weights: a client-level trimmed mean, which, unlike a
coordinate-wise one, is defined for factor pairs whose coordinates are only
meaningful together. A record is set to its reference when it is among the
``trim-fraction`` farthest from the record's geometric median.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from fedlr.robust.estimators import distances, geometric_median_weights
from fedlr.robust.registration import (
    RobustConfig,
    RuleResult,
    gram_records,
    gram_rule,
    register_rule,
)

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate


def _farthest(
    gram: torch.Tensor, fraction: float
) -> tuple[set[int], int, torch.Tensor]:
    """The ``fraction`` of the points farthest from their (unweighted)
    geometric median, at most ``(k - 1) // 2`` of them: the indices, their
    count and every point's distance to the median."""
    k = len(gram)
    dist = distances(gram, geometric_median_weights(gram, [1.0] * k))
    n_trim = min(math.ceil(fraction * k - 1e-9), (k - 1) // 2)
    order = sorted(range(k), key=lambda i: (-float(dist[i]), i))
    return set(order[:n_trim]), n_trim, dist


def _choose(
    kept: list[ClientUpdate],
    weights: torch.Tensor,
    gram: torch.Tensor,
    config: RobustConfig,
) -> RuleResult:
    # Unweighted: a client's claimed example count must not move the median
    # (cap weights with max-client-weight).
    trimmed, n_trim, dist = _farthest(gram, config.trim_fraction)
    reasons = [
        f"node {kept[i].node_id}: trimmed (distance {float(dist[i]):.4g} from "
        f"the geometric median, among the {n_trim} farthest)"
        for i in sorted(trimmed)
    ]
    keep_idx = [i for i in range(len(kept)) if i not in trimmed]
    return RuleResult(
        [kept[i] for i in keep_idx], weights[keep_idx], reasons, trimmed=len(reasons)
    )


def _records(gram: torch.Tensor, config: RobustConfig) -> tuple[list[float], str]:
    trimmed, n_trim, _ = _farthest(gram, config.trim_fraction)
    factors = [0.0 if i in trimmed else 1.0 for i in range(len(gram))]
    return factors, f"among the {n_trim} farthest from the record's median"


def _settings(config: RobustConfig) -> dict[str, Any]:
    return {"trim_fraction": config.trim_fraction}


register_rule(
    "trimmed-mean",
    summary="the `trim-fraction` of clients farthest from the geometric median "
    "(at least one from three clients on, never half) are left out; the others "
    "keep their weights",
    defends="a minority of outliers of any size; costs the trimmed honest "
    "clients' data every round",
    startup=lambda config: (
        f"trimmed-mean leaving out {config.trim_fraction:g} of the clients"
    ),
    apply=gram_rule(_choose),
    records=gram_records(_records),
    settings=_settings,
)
