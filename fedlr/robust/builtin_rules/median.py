"""``median``: the weights become those of the (unweighted) geometric median
of the updates (Weiszfeld's algorithm on the updates' Gram matrix,
:func:`~fedlr.robust.estimators.geometric_median_weights`): the method
aggregates a convex combination of the clients that *is* the geometric median
of their updates, whatever example counts they claim. Breakdown point 1/2.
A record whose geometric-median share ``alpha_i`` is below half a plain share
(``1 / 2k``: far from the median) is moved towards its reference by
``k alpha_i``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedlr.robust.estimators import geometric_median_weights
from fedlr.robust.registration import (
    RobustConfig,
    RuleResult,
    gram_records,
    gram_rule,
    register_rule,
)

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate

NEGLIGIBLE_SHARE = 1e-6
"""A client whose geometric-median weight is below this share is left out
rather than kept at a tiny weight (a method whose aggregate is not linear in
the client's arrays, e.g. a product of two of them, would still feel a huge
update through a tiny weight)."""


def _choose(
    kept: list[ClientUpdate],
    weights: torch.Tensor,
    gram: torch.Tensor,
    config: RobustConfig,
) -> RuleResult:
    """The geometric median's weights ``alpha`` applied: updates with a
    negligible share left out, the rest weighted by ``alpha`` at the round's
    total weight."""
    # Unweighted: a client's claimed example count must not move the median
    # (cap weights with max-client-weight).
    alpha = geometric_median_weights(gram, [1.0] * len(kept))
    plain = weights / weights.sum()
    negligible = alpha < NEGLIGIBLE_SHARE
    reasons = []
    for update, before, after, out in zip(kept, plain, alpha, negligible, strict=True):
        if bool(out):
            reasons.append(
                f"node {update.node_id}: left out (weight share "
                f"{float(after):.3g} at the geometric median)"
            )
        elif float(after) < 0.5 / len(kept):
            reasons.append(
                f"node {update.node_id}: weight share {float(before):.4g} "
                f"-> {float(after):.4g} (far from the geometric median)"
            )
    total_before = weights.sum()
    keep_idx = [i for i in range(len(kept)) if not bool(negligible[i])]
    alpha = alpha[keep_idx]
    return RuleResult(
        [kept[i] for i in keep_idx],
        alpha / alpha.sum() * total_before,
        reasons,
        trimmed=int(negligible.sum()),
    )


def _records(gram: torch.Tensor, config: RobustConfig) -> tuple[list[float], str]:
    k = len(gram)
    alpha = geometric_median_weights(gram, [1.0] * k)
    factors = [float(k * a) if float(k * a) < 0.5 else 1.0 for a in alpha]
    return factors, "far from the record's geometric median"


register_rule(
    "median",
    summary="weights become those of the unweighted geometric median of the "
    "updates (Weiszfeld on the updates' Gram matrix); clients with a share "
    "below 1e-6 are left out",
    defends="up to half the clients, whatever they claim; the result is not a "
    "mean, so it costs accuracy without an attack",
    startup=lambda config: "geometric median",
    apply=gram_rule(_choose),
    records=gram_records(_records),
)
