"""``krum``: the one client whose update is closest to its neighbours
(Blanchard et al., 2017), Flower's ``Krum``.

Each client's score is the sum of its squared distances to its ``k - f - 2``
nearest other clients (at least one), ``f`` the ``krum-byzantine`` clients
the rule assumes; the client with the lowest score is the round's update
(:func:`krum_select`, Flower's ``select_multikrum`` on the Gram matrix of the
method's update space: ``||u_i - u_j||^2 = G_ii + G_jj - 2 G_ij``). A record
of a client that Krum does not select on the record's own Gram matrix is set
to its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlr.options import NoOptions, option
from fedlr.robust.registration import (
    RobustConfig,
    register_rule,
    selected_records,
    selection_rule,
)

__all__ = ["KrumOptions", "krum_byzantine", "krum_select"]


@dataclass(frozen=True)
class KrumOptions(NoOptions):
    """The keys of ``krum`` (and of the rules built on it)."""

    krum_byzantine: int = option(
        0,
        "`krum`, `multi-krum`, `bulyan`: the number f of Byzantine clients the "
        "rule assumes (Flower's `num_malicious_nodes`)",
        range=">= 0",
    )


def krum_select(gram: torch.Tensor, byzantine: int, keep: int) -> list[int]:
    """The ``keep`` clients of lowest Krum score, lowest first: Flower's
    ``select_multikrum`` (``flwr.serverapp.strategy.multikrum``) on the
    updates' Gram matrix.

    Parameters
    ----------
    gram : torch.Tensor
        (k, k) Gram matrix of the updates.
    byzantine : int
        ``f``: each score sums the squared distances to the
        ``max(1, k - f - 2)`` nearest others (the nearest point in each row,
        the client itself, is skipped as Flower skips it).
    keep : int
        How many clients to return (all of them when ``keep >= k``).
    """
    g = gram.to(torch.float64)
    norms = torch.diagonal(g)
    squared = norms[:, None] + norms[None, :] - 2 * g
    closest = max(1, len(g) - byzantine - 2)
    scores = torch.stack(
        [row[torch.argsort(row, stable=True)[1 : closest + 1]].sum() for row in squared]
    )
    return [int(i) for i in torch.argsort(scores, stable=True)[:keep]]


def krum_byzantine(config: RobustConfig) -> int:
    """The rule's ``f`` (``krum-byzantine``)."""
    return KrumOptions.of(config.options).krum_byzantine


def _select(gram: torch.Tensor, config: RobustConfig) -> list[int]:
    return krum_select(gram, krum_byzantine(config), 1)


register_rule(
    "krum",
    summary="the one client whose summed squared distance to its `k - f - 2` "
    "nearest others is the lowest is the round's update (Flower's `Krum`), "
    "`f` = `krum-byzantine`",
    defends="up to `f` Byzantine clients of `k > 2f + 2` (Blanchard et al., "
    "2017); one client's data per round, so it costs accuracy without an attack",
    startup=lambda config: f"Krum selecting 1 client, f = {krum_byzantine(config)}",
    apply=selection_rule(
        _select, lambda config: f"not Krum's choice, f={krum_byzantine(config)}"
    ),
    records=selected_records(_select, "not Krum's choice on the record"),
    options=KrumOptions,
)
