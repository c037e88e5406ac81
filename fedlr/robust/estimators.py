"""Robust location estimates of updates, as weights, from their Gram matrix.

Each function takes the k x k Gram matrix ``G[i, j] = <u_i, u_j>`` of a
round's updates (in the method's update space, :mod:`fedlr.robust.spaces`)
and returns convex weights ``alpha``: the estimate is ``sum_i alpha_i u_i``,
so a method aggregates it by weighting its own clients, whatever its update
space. :mod:`fedlr.robust.rules` applies them to a round's replies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "bucket_matrix",
    "cap_shares",
    "centred_clip_weights",
    "distances",
    "geometric_median_weights",
]


def geometric_median_weights(
    gram: torch.Tensor,
    weights: Sequence[float],
    *,
    iterations: int = 500,
    tol: float = 1e-9,
) -> torch.Tensor:
    """Convex weights ``alpha`` with ``sum alpha_i u_i`` the geometric median.

    Weiszfeld's algorithm for ``argmin_z sum_i w_i ||u_i - z||`` on the Gram
    matrix of the updates: ``z = sum alpha_i u_i`` stays in their span, and
    ``||u_j - z||^2 = G_jj - 2 (G alpha)_j + alpha^T G alpha``. A median
    that is a client's own point (Kuhn's criterion, :func:`_vertex_median`)
    is returned exactly; otherwise it starts at the weighted medoid and stops
    when no weight changes by more than ``tol`` relative to itself. Close to
    (not at) a client's point Weiszfeld converges slowly: ``iterations`` then
    bounds the accuracy.

    Parameters
    ----------
    gram : torch.Tensor
        (k, k) Gram matrix of the updates.
    weights : sequence of float
        Positive client weights.

    Returns
    -------
    torch.Tensor
        (k,) float64, non-negative, summing to 1.
    """
    w = torch.as_tensor(list(weights), dtype=torch.float64)
    w = w / w.sum()
    g = gram.to(torch.float64)
    diag = torch.diagonal(g)
    # Start from the weighted medoid: distances between clients need only
    # G_ii + G_jj - 2 G_ij, so an update far larger than the others cannot
    # swamp the honest ones' distances by cancellation (starting from the
    # mean would put every client at the attacker's scale).
    pair = (diag[:, None] + diag[None, :] - 2 * g).clamp_min(0.0).sqrt()
    medoid = int(torch.argmin(pair @ w))
    # ... then the weighted mean of the closer half of the clients to it: not
    # a data point (where Weiszfeld's step is undefined) and free of outliers.
    near = torch.argsort(pair[medoid])[: max(2, (len(w) + 1) // 2)]
    alpha = torch.zeros_like(w)
    alpha[near] = w[near] / w[near].sum()
    finite = diag[torch.isfinite(diag)]
    scale = math.sqrt(max(float(finite.median()), 0.0)) if finite.numel() else 1.0
    floor = 1e-12 * (scale or 1.0)
    vertex = _vertex_median(g, pair, w, floor)
    if vertex is not None:
        return vertex
    for _ in range(iterations):
        dist = distances(g, alpha).clamp_min(floor)
        new = w / dist
        new = new / new.sum()
        change = float(((new - alpha).abs() / new.clamp_min(1e-300)).max())
        alpha = new
        if change < tol:
            break
    return alpha


def _vertex_median(
    gram: torch.Tensor, pair: torch.Tensor, w: torch.Tensor, floor: float
) -> torch.Tensor | None:
    """Weights at the data point that is the geometric median, if one is.

    Kuhn's criterion: ``x_m`` is the median iff the others' pull on it,
    ``||sum_{i: x_i != x_m} w_i (x_i - x_m) / ||x_i - x_m|| ||``, is at most
    the weight at ``x_m``; Weiszfeld's iterates only approach such a point
    sublinearly. A tie (two clients, or an even count on a line: a segment
    of medians) is left to Weiszfeld, which stays inside the segment.
    """
    at = pair <= floor  # (k, k): clients at x_m, x_m itself included
    c = torch.where(at, 0.0, w[None, :] / pair.clamp_min(floor))
    beta = c - torch.diag(c.sum(dim=1))  # row m: the pull as sum beta_i x_i
    pull = ((beta @ gram) * beta).sum(dim=1).clamp_min(0.0).sqrt()
    own = (at * w[None, :]).sum(dim=1)
    wins = pull < own * (1 - 1e-9)  # NaN (a non-finite Gram) never wins
    if not bool(wins.any()):
        return None
    m = int(torch.argmax(torch.where(wins, own - pull, -math.inf)))
    return torch.where(at[m], w, 0.0) / own[m]


def distances(gram: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``||u_j - sum_i alpha_i u_i||`` for every j."""
    g_alpha = gram @ alpha
    sq = torch.diagonal(gram) - 2 * g_alpha + alpha @ g_alpha
    return sq.clamp_min(0.0).sqrt()


def centred_clip_weights(
    gram: torch.Tensor,
    weights: Sequence[float],
    *,
    ratio: float = 1.0,
    bound: float = 0.0,
    iterations: int = 500,
    tol: float = 1e-12,
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Convex weights ``alpha`` with ``v = sum alpha_i u_i`` the centred-clipping
    fixed point ``sum_i s_i clip_tau(u_i - v) = 0``.

    ``clip_tau(x) = x min(1, tau / ||x||)``, ``s`` the normalised
    ``weights``. At the fixed point ``v = sum_i s_i c_i u_i / sum_i s_i c_i``
    with ``c_i = min(1, tau / ||u_i - v||)``: iteratively reweighted from the
    unweighted geometric median (a start no single update can move far),
    distances from the Gram matrix (``||u_j - v||^2 = G_jj - 2 (G alpha)_j +
    alpha^T G alpha``). The fixed point minimises the convex
    ``sum_i s_i huber_tau(||u_i - v||)``, which each reweighting step
    decreases (the Weiszfeld-type iteration of a Huber M-estimate). When no
    client is farther than ``tau`` from it, it is the plain weighted mean.

    Parameters
    ----------
    gram : torch.Tensor
        (k, k) Gram matrix of the updates, finite.
    weights : sequence of float
        Positive client weights.
    ratio : float
        ``tau`` is this multiple of the lower median of the clients'
        distances to the geometric median (the ``ceil(k / 2)``-th smallest:
        a minority that puts itself far away cannot raise it) ...
    bound : float
        ... unless ``bound > 0``, which is ``tau``.

    Returns
    -------
    alpha : torch.Tensor
        (k,) float64, positive, summing to 1.
    tau : float
    factors : torch.Tensor
        (k,) ``c_i`` at the fixed point (1: not clipped).
    """
    s = torch.as_tensor(list(weights), dtype=torch.float64)
    s = s / s.sum()
    g = gram.to(torch.float64)
    k = len(s)
    start = geometric_median_weights(g, [1.0] * k)
    if bound > 0:
        tau = float(bound)
    else:
        spread = sorted(float(d) for d in distances(g, start))
        tau = ratio * spread[(k - 1) // 2]
    if tau <= 0:  # the updates coincide (or the median does): nothing to clip
        return s, tau, torch.ones(k, dtype=torch.float64)
    alpha = start
    factors = torch.ones(k, dtype=torch.float64)
    for _ in range(iterations):
        dist = distances(g, alpha)
        factors = torch.where(dist > tau, tau / dist.clamp_min(1e-300), 1.0)
        new = s * factors
        new = new / new.sum()
        change = float((new - alpha).abs().max())
        alpha = new
        if change < tol:
            break
    return alpha, tau, factors


def bucket_matrix(
    weights: torch.Tensor, size: int, generator: torch.Generator
) -> torch.Tensor:
    """``(b, k)`` rows: each random bucket's weighted-mean coefficients.

    The clients are permuted by ``generator`` and cut into ``ceil(k / size)``
    buckets of ``size`` (the last may be smaller); row ``j`` holds the
    weights of bucket ``j``'s members over their sum.
    """
    k = len(weights)
    order = torch.randperm(k, generator=generator).tolist()
    rows = []
    for start in range(0, k, size):
        members = order[start : start + size]
        row = torch.zeros(k, dtype=torch.float64)
        row[members] = weights[members].to(torch.float64)
        rows.append(row / row.sum())
    return torch.stack(rows)


def cap_shares(weights: Sequence[float], cap: float) -> torch.Tensor:
    """Shares of the total weight with none above ``cap`` (water-filling).

    Capped clients get exactly ``cap``; the rest of the total is shared by
    the others in proportion to their weights. When ``cap * k < 1`` no
    feasible capping exists and the shares are equal.

    Returns
    -------
    torch.Tensor
        (k,) float64 shares summing to 1.
    """
    w = torch.as_tensor(list(weights), dtype=torch.float64)
    k = len(w)
    if cap * k < 1.0:
        return torch.full((k,), 1.0 / k, dtype=torch.float64)
    shares = w / w.sum()
    capped = torch.zeros(k, dtype=torch.bool)
    for _ in range(k):
        over = (shares > cap + 1e-15) & ~capped
        if not bool(over.any()):
            break
        capped |= over
        free = ~capped
        remaining = 1.0 - cap * int(capped.sum())
        shares = torch.where(capped, torch.full_like(shares, cap), shares)
        free_total = float(w[free].sum())
        if free_total > 0:
            shares[free] = remaining * w[free] / free_total
    return shares
