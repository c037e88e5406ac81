"""``bulyan``: Multi-Krum's ``theta = k - 2f`` clients, then the
``beta = theta - 2f`` of them closest to their geometric median (El Mhamdi,
Guerraoui and Rouhault, 2018), Flower's ``Bulyan`` at the client level.

The first step is Flower's exactly
(:func:`~fedlr.robust.builtin_rules.krum.krum_select` keeping ``theta``).
Flower's second step is coordinate-wise (each coordinate the mean of the
``beta`` values closest to the coordinate-wise median), which has no meaning
for factor pairs or in a product space measured through its Gram matrix; here
the ``beta`` selected clients closest to the selected clients' (unweighted)
geometric median are kept, at their own weights, the client-level trimming
``trimmed-mean`` also uses. Bulyan needs ``k >= 4f + 3``; where Flower skips
a round with fewer replies, this rule runs at the largest ``f`` the round
allows, ``(k - 3) // 4`` (``0`` below three clients), and says so. A record
is set to its reference unless the rule keeps it on the record's own Gram
matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedlr.robust.builtin_rules.krum import KrumOptions, krum_byzantine, krum_select
from fedlr.robust.estimators import distances, geometric_median_weights
from fedlr.robust.registration import (
    RobustConfig,
    RuleResult,
    gram_rule,
    keep_only,
    register_rule,
    selected_records,
)

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate


def bulyan_byzantine(clients: int, byzantine: int) -> int:
    """The ``f`` a round of ``clients`` runs at: ``byzantine``, or the largest
    that ``clients >= 4 f + 3`` allows (at least 0)."""
    return min(byzantine, max(0, (clients - 3) // 4))


def bulyan_select(gram: torch.Tensor, byzantine: int) -> tuple[list[int], list[int]]:
    """Krum's ``theta = k - 2f`` (Flower's first step), and the ``beta =
    theta - 2f`` of them closest to their geometric median, as indices into
    the round (``f`` from :func:`bulyan_byzantine`)."""
    f = bulyan_byzantine(len(gram), byzantine)
    theta = len(gram) - 2 * f
    chosen = krum_select(gram, f, theta)
    sub = gram.to(torch.float64)[chosen][:, chosen]
    dist = distances(sub, geometric_median_weights(sub, [1.0] * theta))
    order = sorted(range(theta), key=lambda i: (float(dist[i]), i))
    return chosen, [chosen[i] for i in order[: theta - 2 * f]]


def _choose(
    kept: list[ClientUpdate],
    weights: torch.Tensor,
    gram: torch.Tensor,
    config: RobustConfig,
) -> RuleResult:
    f = krum_byzantine(config)
    at = bulyan_byzantine(len(kept), f)
    _, final = bulyan_select(gram, f)
    why = f"not kept by Bulyan, f={at}"
    done = keep_only(kept, weights, final, why)
    if at < f:
        done.reasons.append(
            f"{len(kept)} clients are fewer than 4 f + 3 at f={f}: Bulyan ran at f={at}"
        )
    return done


register_rule(
    "bulyan",
    summary="Multi-Krum's `k - 2f` clients (`f` = `krum-byzantine`), then the "
    "`k - 4f` of them closest to their geometric median, at their own weights "
    "(Flower's `Bulyan`, its second, coordinate-wise step made client-level)",
    defends="up to `f` Byzantine clients of `k >= 4f + 3` (El Mhamdi et al., "
    "2018); fewer clients: the largest `f` they allow",
    startup=lambda config: f"Bulyan, f = {krum_byzantine(config)}",
    apply=gram_rule(_choose),
    records=selected_records(
        lambda gram, config: bulyan_select(gram, krum_byzantine(config))[1],
        "not kept by Bulyan on the record",
    ),
    options=KrumOptions,
)
