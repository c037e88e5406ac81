"""SVDs of many clients' updates, linear in ``k``: randomized and streamed paths.

Two SVDs of the LoRA family grow with the number of clients ``k``:

* FedSpec's truncated SVD of the mean of products ``M = sum_i w_i B_i A_i``
  (d_out, d_in). :func:`svd_of_mean` takes the factored QR path
  (:func:`fedlr.linalg.truncated_svd_of_mean`) while ``k r`` is small, a dense
  float64 ``M`` accumulated in place and its SVD when ``d`` is small, and
  otherwise :func:`randomized_svd_of_mean`: the randomized range finder of
  Halko, Martinsson and Tropp on the streamed operator ``M`` (never stacked,
  never dense).
* Global SVD's SVD of ``X = [sqrt(w_i) (B_i A_i)^T]_i`` (d_in, k d_out).
  :func:`updates_svd` takes the exact per-client-block factored path
  (:func:`fedlr.linalg.stacked_updates_svd`), the exact Gram path (the
  ``d_in x d_in`` matrix ``X X^T = sum_i A_i^T (w_i B_i^T B_i) A_i`` accumulated
  client by client, then ``eigh``), or a randomized subspace iteration on that
  Gram operator, which only needs each client's ``r x r`` Gram ``B_i^T B_i``.

By default (``solver="auto"``) the choice is :class:`fedlr.linalg.CostModel`'s;
``solver="exact"`` restricts it to the exact paths (the cheapest that fits,
whatever the size) and ``solver="randomized"`` to the randomized one (at any
size). The run-config key ``svd-solver`` passes it through the strategies. A
randomized result says so (``TruncatedSVD.randomized``) and, where its
energies are estimated, by how much they may be off
(``TruncatedSVD.energy_error``).

How far the randomized factors are from the exact ones depends on the
spectrum, not only on the sketch. Measured at ``d = 1024``, ``k = 20``
clients of rank 16, rank 18 kept (the size from which FedSpec's ``auto``
switches; ``python -m benchmarks.svd_solver``, 5 seeds): the sine of the
largest principal angle between the randomized and the exact leading
16-dimensional subspaces is 0.001-0.004 for singular values decaying as
``0.91^j``, 0.05-0.09 for ``1/j``, 0.28-0.41 for ``1/sqrt(j)``, and 1.0 on a
flat spectrum (``sigma_j = 1 - j/2000``), where the leading subspace is
ill-defined and the randomized one captures 0.5 % of ``||M||_F^2`` less than
the best rank-16 subspace (1e-3 for ``1/sqrt(j)``, below 2e-5 for the
others). Its singular values are lower bounds of the true ones, so its point
estimate of the tail energy is biased upward; FedSpec's rank rule therefore
decides on bounds (:meth:`TruncatedSVD.tail_fraction_bounds`) and
recomputes a round near the threshold exactly.

References
----------
.. [1] Halko, Martinsson, Tropp, "Finding structure with randomness:
   probabilistic algorithms for constructing approximate matrix
   decompositions", SIAM Review 53(2), 2011 (Algorithms 4.4 and 5.1).
.. [2] Meyer, Musco, Musco, Woodruff, "Hutch++: optimal stochastic trace
   estimation", SOSA 2021.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from fedlr.linalg.cost import (
    DEFAULT_COST_MODEL,
    DENSE,
    FACTORED,
    GRAM,
    RANDOMIZED,
    CostModel,
)
from fedlr.linalg.lowrank import check_factors, normalise_weights, work_dtype
from fedlr.linalg.streaming import ProductSum
from fedlr.linalg.svd import (
    TruncatedSVD,
    _positive_weights,
    fix_signs,
    stacked_updates_svd,
    truncate,
    truncated_svd_of_mean,
)

__all__ = [
    "SVD_SOLVERS",
    "frobenius_sq_of_mean",
    "randomized_svd_of_mean",
    "randomized_updates_svd",
    "solver_cost_model",
    "svd_of_mean",
    "updates_svd",
]

SVD_SOLVERS = ("auto", "exact", "randomized")
"""``solver`` values of :func:`svd_of_mean` and :func:`updates_svd`: the cost
model's choice, the exact paths only, the randomized path only."""


def solver_cost_model(
    cost: CostModel, solver: str, exact_paths: frozenset[str]
) -> CostModel:
    """``cost`` restricted to the paths ``solver`` allows.

    Parameters
    ----------
    cost : CostModel
    solver : {"auto", "exact", "randomized"}
        ``auto`` keeps ``cost``; ``exact`` allows ``exact_paths``;
        ``randomized`` allows the randomized path.
    exact_paths : frozenset of str
        The kernel's exact paths (``factored`` and ``dense`` or ``gram``).

    Raises
    ------
    ValueError
        If ``solver`` is not one of :data:`SVD_SOLVERS`.
    """
    if solver not in SVD_SOLVERS:
        raise ValueError(f"solver must be one of {list(SVD_SOLVERS)}, got {solver!r}")
    if solver == "auto":
        return cost
    allowed = exact_paths if solver == "exact" else frozenset({RANDOMIZED})
    return dataclasses.replace(cost, only=allowed)


def frobenius_sq_of_mean(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    *,
    cost: CostModel | None = None,
) -> float:
    """``||M||_F^2`` of ``M = sum_i w_i B_i A_i``, exactly, linear memory in ``k``.

    The cheaper of two exact forms, in float64:

    * the trace of Gram products, ``sum_{I,J} <L_I^T L_J, R_I R_J^T>`` over
      blocks ``I``, ``J`` of clients (``L_I = [w_i B_i]_{i in I}``,
      ``R_I = [A_i]_{i in I}``): ``O((d_out + d_in) p^2)`` flops, ``p = k r``,
      a block pair at a time (no ``d_out x d_in`` matrix at all);
    * ``M`` accumulated in place into one ``d_out x d_in`` buffer, then its
      norm: ``O(d_out d_in p)`` flops, taken when ``p`` exceeds
      ``d_out d_in / (d_out + d_in)`` and the buffer fits the memory budget.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
        Normalised internally.
    cost : CostModel, optional
        ``memory_budget`` and ``max_chunk_rank`` (block width).

    Returns
    -------
    float
    """
    d_out, r, d_in = check_factors(bs, as_)
    cost = cost if cost is not None else DEFAULT_COST_MODEL
    w = normalise_weights(weights, len(bs))
    p = len(bs) * r
    if p * (d_out + d_in) > d_out * d_in and 8 * d_out * d_in <= cost.memory_budget:
        m = ProductSum(bs, as_, w, dtype=torch.float64, cost=cost).dense()
        return float(torch.linalg.matrix_norm(m)) ** 2
    step = max(1, cost.max_chunk_rank // max(r, 1))
    blocks = [range(i, min(i + step, len(bs))) for i in range(0, len(bs), step)]
    device = bs[0].device

    def stacks(block: range) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w[block.start : block.stop].to(device, torch.float64)
        left = torch.stack([bs[i] for i in block], dim=1).double() * scale[:, None]
        right = torch.cat([as_[i] for i in block], dim=0).double()
        return left.reshape(d_out, -1), right

    total = 0.0
    for n, block in enumerate(blocks):
        left, right = stacks(block)
        total += float(((left.T @ left) * (right @ right.T)).sum())
        for other in blocks[:n]:
            left_o, right_o = stacks(other)
            total += 2.0 * float(((left.T @ left_o) * (right @ right_o.T)).sum())
    return max(total, 0.0)


def _orth(y: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the columns of ``y`` (thin QR)."""
    return torch.linalg.qr(y).Q


def randomized_svd_of_mean(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
    *,
    cost: CostModel | None = None,
    seed: int = 0,
) -> TruncatedSVD:
    """Randomized truncated SVD of ``M = sum_i w_i B_i A_i``, client by client.

    1. Draw Gaussian ``Omega`` (d_in, l), ``l = rank + oversample``, and probes
       ``G`` (d_in, s); one streamed pass gives ``Y = M Omega`` and ``M G``,
       with ``M Z = sum_i w_i B_i (A_i Z)``.
    2. ``q`` power iterations: ``Q = orth(Y)``, ``Q = orth(M orth(M^T Q))``,
       ``M^T`` applied the same way (``sum_i A_i^T (w_i B_i^T Y)``).
    3. One more pass gives the small ``Q^T M = sum_i w_i (Q^T B_i) A_i``
       (l, d_in) and its SVD ``U_s S V^T`` (float64); ``U = Q U_s``.
    4. Energy: ``||M||_F^2 = ||Q^T M||_F^2 + ||(I - Q Q^T) M||_F^2``; the first
       is exact (``sum S^2``), the second is estimated from the probes,
       ``(I - Q Q^T) M G`` (Hutch++), with a standard-error bound.

    Cost ``O(k r (d_out + d_in) (l (2 q + 2) + s))`` flops, memory
    ``O((d_out + d_in)(l + s))`` plus one chunk of stacked factors; linear in
    ``k``. The kept triplets give the rank-``rank`` approximation
    ``P M`` (``P`` the projector on ``U``), whose squared error
    ``||M||_F^2 - sum_{j<rank} S_j^2`` is ``tail_energy`` exactly up to the
    estimated residual energy.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
        Normalised internally.
    rank : int
        Triplets to keep (``>= 1``).
    cost : CostModel, optional
        ``oversample``, ``power_iterations``, ``probes``, ``error_sigmas``,
        chunk sizes.
    seed : int, default 0

    Returns
    -------
    TruncatedSVD
        float64; ``singular_values`` the ``l`` computed values,
        ``residual_energy`` the estimate of the rest, ``energy_error`` its
        bound, ``energy_estimated`` and ``randomized`` True. Signs fixed by
        :func:`fedlr.linalg.fix_signs`.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    d_out, _, d_in = check_factors(bs, as_)
    cost = cost if cost is not None else DEFAULT_COST_MODEL
    w = normalise_weights(weights, len(bs))
    op = ProductSum(bs, as_, w, cost=cost)
    ell = cost.sketch_rank(rank, d_out, d_in, op.width)
    s = cost.probes
    gen = torch.Generator().manual_seed(seed)
    draw = torch.randn(d_in, ell + s, generator=gen, dtype=torch.float64)
    draw = draw.to(op.device, op.dtype)
    # 1. Range sketch and probes in one pass.
    y = op.matmul(draw)
    probes, g = y[:, ell:], draw[:, ell:]
    q = _orth(y[:, :ell])
    # 2. Power iterations, re-orthonormalised each half step.
    for _ in range(cost.power_iterations):
        q = _orth(op.matmul(_orth(op.rmatmul(q))))
    # 3. The small matrix Q^T M and its SVD.
    qtm_t = op.rmatmul(q)  # (d_in, l)
    us, sv, vh = torch.linalg.svd(qtm_t.T.double(), full_matrices=False)
    # 4. Residual energy from the probes.
    residual = probes - q @ (qtm_t.T @ g)
    samples = (residual.double() ** 2).sum(dim=0)
    spread = float(samples.std()) if s > 1 else 0.0
    keep = min(rank, sv.numel())
    u, vh = fix_signs(q.double() @ us[:, :keep], vh[:keep])
    return TruncatedSVD(
        u=u,
        s=sv[:keep].clone(),
        vh=vh,
        singular_values=sv,
        residual_energy=float(samples.mean()),
        energy_error=cost.error_sigmas * spread / math.sqrt(s),
        energy_estimated=True,
        randomized=True,
    )


def svd_of_mean(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
    *,
    cost: CostModel | None = None,
    seed: int = 0,
    solver: str = "auto",
) -> TruncatedSVD:
    """Rank-``rank`` truncated SVD of ``sum_i w_i B_i A_i``, cheapest adequate path.

    :meth:`CostModel.svd_of_mean` picks ``factored`` (QR of the stacked
    factors, :func:`fedlr.linalg.truncated_svd_of_mean`), ``dense`` (``M``
    accumulated in place in float64, then its SVD) or ``randomized``
    (:func:`randomized_svd_of_mean`), among the paths ``solver`` allows. The
    exact paths return every singular value (so the tail energy beyond any
    rank is exact); the randomized one says it is randomized and estimated.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
    rank : int
        Triplets to keep (``>= 1``); the largest rank the caller may cut to.
    cost : CostModel, optional
    seed : int, default 0
        Of the randomized path.
    solver : {"auto", "exact", "randomized"}, default "auto"
        ``auto``: the cost model's choice; ``exact``: ``factored`` or
        ``dense`` at any size; ``randomized``: the range finder at any size
        (:func:`solver_cost_model`).

    Returns
    -------
    TruncatedSVD
        float64.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    d_out, r, d_in = check_factors(bs, as_)
    cost = cost if cost is not None else DEFAULT_COST_MODEL
    cost = solver_cost_model(cost, solver, frozenset({FACTORED, DENSE}))
    path = cost.svd_of_mean(len(bs), r, d_out, d_in, rank).path
    if path == FACTORED:
        return truncate(truncated_svd_of_mean(bs, as_, weights), rank)
    if path == DENSE:
        w = normalise_weights(weights, len(bs))
        m = ProductSum(bs, as_, w, dtype=torch.float64, cost=cost).dense()
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        s = s[: min(d_out, d_in, len(bs) * r)]
        keep = min(rank, s.numel())
        u, vh = fix_signs(u[:, :keep], vh[:keep])
        return TruncatedSVD(u=u, s=s[:keep].clone(), vh=vh, singular_values=s)
    return randomized_svd_of_mean(bs, as_, weights, rank, cost=cost, seed=seed)


# --------------------------------------------------------------------------
# Global SVD on the Gram operator X X^T = sum_i A_i^T (w_i B_i^T B_i) A_i.
# --------------------------------------------------------------------------


def _client_chunks(k: int, per_client_bytes: int, cost: CostModel) -> list[range]:
    """Client index ranges whose per-client tensors fit ``cost.chunk_bytes``."""
    step = max(1, cost.chunk_bytes // max(1, per_client_bytes))
    return [range(i, min(i + step, k)) for i in range(0, k, step)]


class _GramOperator:
    """``H = sum_i A_i^T G_i A_i`` with ``G_i = w_i B_i^T B_i`` (r, r), streamed.

    Clients are taken a chunk at a time, each chunk one batched product, so
    the number of torch calls does not grow with ``k`` per client.
    """

    def __init__(
        self,
        bs: Sequence[torch.Tensor],
        as_: Sequence[torch.Tensor],
        w: torch.Tensor,
        dtype: torch.dtype,
        cost: CostModel,
    ) -> None:
        self.as_ = list(as_)
        self.dtype = dtype
        self.device = as_[0].device
        self.r = int(as_[0].shape[0])
        self.d_in = int(as_[0].shape[1])
        d_out = int(bs[0].shape[0])
        grams = []
        for chunk in _client_chunks(len(bs), 8 * d_out * self.r, cost):
            stacked = torch.stack([bs[i] for i in chunk]).double()  # (c, d_out, r)
            grams.append(stacked.transpose(1, 2) @ stacked)
        weights = w.to(self.device, torch.float64)[:, None, None]
        self.grams = torch.cat(grams) * weights  # (k, r, r), float64
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.chunks = _client_chunks(len(as_), 2 * self.r * self.d_in * itemsize, cost)

    def trace(self) -> float:
        """``tr(H) = sum_i <G_i, A_i A_i^T>`` (= ``sum_i w_i ||B_i A_i||_F^2``)."""
        total = 0.0
        for chunk in self.chunks:
            stacked = torch.stack([self.as_[i] for i in chunk]).double()
            outer = stacked @ stacked.transpose(1, 2)  # (c, r, r)
            total += float((self.grams[chunk.start : chunk.stop] * outer).sum())
        return total

    def _right(
        self, chunk: range, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        right = torch.cat([self.as_[i] for i in chunk], dim=0).to(dtype)
        return right, self.grams[chunk.start : chunk.stop].to(dtype)

    def matmul(self, z: torch.Tensor) -> torch.Tensor:
        """``H @ z`` for ``z`` (d_in, l)."""
        z = z.to(self.device, self.dtype)
        out = z.new_zeros(self.d_in, z.shape[1])
        for chunk in self.chunks:
            right, grams = self._right(chunk, self.dtype)
            c = grams.shape[0]
            t = torch.bmm(grams, (right @ z).view(c, self.r, -1))
            out.addmm_(right.T, t.view(c * self.r, -1))
        return out

    def dense(self) -> torch.Tensor:
        """``H`` (d_in, d_in) in float64, accumulated in place."""
        out = torch.zeros(self.d_in, self.d_in, dtype=torch.float64, device=self.device)
        for chunk in self.chunks:
            right, grams = self._right(chunk, torch.float64)
            c = grams.shape[0]
            t = torch.bmm(grams, right.view(c, self.r, self.d_in))
            out.addmm_(right.T, t.view(c * self.r, self.d_in))
        return out


def _client_factors(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    w: torch.Tensor,
    u: torch.Tensor,
    s: torch.Tensor,
    cost: CostModel,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Shared ``A = sqrt(S) U^T`` and each ``B_i' = B_i (A_i U) S^{-1/2}``.

    ``B_i' = V_i sqrt(S) / sqrt(w_i)`` with ``V = X^T U S^{-1}`` (block ``i`` of
    ``X^T`` is ``sqrt(w_i) B_i A_i``); columns with ``S = 0`` are zero.
    Returns ``(a_shared, b_list, vh)`` with ``vh`` (rank, k d_out) = ``V^T``.
    """
    root = s.sqrt()
    inv_root = torch.where(root > 0, 1.0 / torch.where(root > 0, root, 1.0), 0.0)
    a_shared = root[:, None] * u.T
    d_out, r = int(bs[0].shape[0]), int(bs[0].shape[1])
    d_in, rank = int(as_[0].shape[1]), int(u.shape[1])
    roots = w.to(u.device, torch.float64).sqrt()
    b_list: list[torch.Tensor] = []
    vh = torch.empty(rank, len(bs), d_out, dtype=torch.float64, device=u.device)
    for chunk in _client_chunks(len(bs), 8 * r * (d_out + d_in), cost):
        b = torch.stack([bs[i] for i in chunk]).double()  # (c, d_out, r)
        a = torch.stack([as_[i] for i in chunk]).double()  # (c, r, d_in)
        factors = (b @ (a @ u)).mul_(inv_root)  # (c, d_out, rank): Delta_i U S^-1/2
        b_list.extend(factors.unbind(0))
        # V_i = sqrt(w_i) Delta_i U S^{-1}, stored transposed
        scale = roots[chunk.start : chunk.stop, None, None] * inv_root
        vh[:, chunk.start : chunk.stop] = (factors * scale).permute(2, 0, 1)
    return a_shared, b_list, vh.view(rank, -1)


def _gram_updates_svd(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    w: torch.Tensor,
    rank: int,
    cost: CostModel,
) -> tuple[torch.Tensor, list[torch.Tensor], TruncatedSVD]:
    """Exact Global SVD from the dense ``d_in x d_in`` Gram matrix, float64 ``eigh``."""
    d_out, r, d_in = check_factors(bs, as_)
    gram = _GramOperator(bs, as_, w, torch.float64, cost)
    evals, evecs = torch.linalg.eigh(gram.dense())
    evals, evecs = evals.flip(0).clamp_min(0.0), evecs.flip(1)
    sv = evals.sqrt()[: min(d_in, len(bs) * r, len(bs) * d_out)]
    keep = min(rank, sv.numel())
    u, _ = fix_signs(evecs[:, :keep], evecs.new_zeros(keep, 0))
    s = sv[:keep].clone()
    a_shared, b_list, vh = _client_factors(bs, as_, w, u, s, cost)
    return a_shared, b_list, TruncatedSVD(u=u, s=s, vh=vh, singular_values=sv)


def randomized_updates_svd(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
    *,
    cost: CostModel | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor], TruncatedSVD]:
    """Global SVD by randomized subspace iteration on ``H = X X^T``, linear in ``k``.

    ``X = [sqrt(w_i) (B_i A_i)^T]_i`` (d_in, k d_out) and
    ``H = X X^T = sum_i A_i^T (w_i B_i^T B_i) A_i`` (d_in, d_in) is applied to a
    block ``Z`` (d_in, l) as ``sum_i A_i^T (G_i (A_i Z))``: each client enters
    only through its ``r x r`` Gram ``G_i = w_i B_i^T B_i``. Subspace iteration
    (``Q = orth(H Omega)``, then ``power_iterations`` times
    ``Q = orth(H Q)``) and Rayleigh-Ritz (``eigh(Q^T H Q)``) give ``U`` and
    ``S^2``; the client factors are ``B_i' = B_i (A_i U) S^{-1/2}`` and the
    shared one ``A = sqrt(S) U^T``.

    The weighted squared gap of these factors,
    ``sum_i w_i ||Delta_i - B_i' A||_F^2 = tr(H) - sum_{j<rank} S_j^2``, is
    exact (``tr(H) = sum_i <G_i, A_i A_i^T>``); only the subspace is
    approximate (``randomized``), never worse than the exact path's error by
    more than the unresolved part of the spectrum.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
        All positive; normalised internally.
    rank : int
    cost : CostModel, optional
    seed : int, default 0

    Returns
    -------
    a : (rank', d_in) torch.Tensor
    b_list : k tensors (d_out, rank')
    svd : TruncatedSVD
        float64; ``singular_values`` the ``l`` Ritz values' square roots,
        ``residual_energy = tr(H) - sum`` of them (exact), ``randomized`` True.
    """
    w = _positive_weights(bs, as_, weights)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    cost = cost if cost is not None else DEFAULT_COST_MODEL
    _, r, d_in = check_factors(bs, as_)
    gram = _GramOperator(bs, as_, w, work_dtype(*bs, *as_), cost)
    ell = cost.sketch_rank(rank, d_in, d_in, len(bs) * r)
    gen = torch.Generator().manual_seed(seed)
    q = _orth(gram.matmul(torch.randn(d_in, ell, generator=gen, dtype=torch.float64)))
    for _ in range(cost.power_iterations):
        q = _orth(gram.matmul(q))
    q = q.double()
    small = q.T @ gram.matmul(q).double()
    evals, evecs = torch.linalg.eigh((small + small.T) / 2)
    evals, evecs = evals.flip(0).clamp_min(0.0), evecs.flip(1)
    keep = min(rank, evals.numel())
    u, _ = fix_signs(q @ evecs[:, :keep], evecs.new_zeros(keep, 0))
    sv = evals.sqrt()
    s = sv[:keep].clone()
    a_shared, b_list, vh = _client_factors(bs, as_, w, u, s, cost)
    residual = max(gram.trace() - float(evals.sum()), 0.0)
    svd = TruncatedSVD(
        u=u, s=s, vh=vh, singular_values=sv, residual_energy=residual, randomized=True
    )
    return a_shared, b_list, svd


def updates_svd(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
    *,
    cost: CostModel | None = None,
    seed: int = 0,
    solver: str = "auto",
) -> tuple[torch.Tensor, list[torch.Tensor], TruncatedSVD]:
    """Global SVD's shared factor and client factors by the cheapest adequate path.

    :meth:`CostModel.updates_svd` picks ``factored``
    (:func:`fedlr.linalg.stacked_updates_svd`: exact, per-client blocks),
    ``gram`` (exact: the dense ``d_in x d_in`` Gram matrix accumulated client
    by client in float64, then ``eigh``) or ``randomized``
    (:func:`randomized_updates_svd`), among the paths ``solver`` allows
    (``auto``, ``exact``: ``factored`` or ``gram``, ``randomized``; see
    :func:`solver_cost_model`). Parameters and returns as
    :func:`fedlr.linalg.stacked_updates_svd` (plus ``cost``, ``seed`` and
    ``solver``); the returned ``TruncatedSVD.randomized`` says which kind of
    path ran.
    """
    w = _positive_weights(bs, as_, weights)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    cost = cost if cost is not None else DEFAULT_COST_MODEL
    cost = solver_cost_model(cost, solver, frozenset({FACTORED, GRAM}))
    d_out, r, d_in = check_factors(bs, as_)
    path = cost.updates_svd(len(bs), r, d_out, d_in, rank).path
    if path == FACTORED:
        return stacked_updates_svd(bs, as_, w, rank)
    if path == GRAM:
        return _gram_updates_svd(bs, as_, w, rank, cost)
    return randomized_updates_svd(bs, as_, w, rank, cost=cost, seed=seed)
