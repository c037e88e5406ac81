"""Truncated SVD of a product of stacked factors, never forming the product.

The mean of products ``M = sum_i w_i B_i A_i`` is ``left @ right`` with
``left = [w_1 B_1, ..., w_k B_k]`` of shape ``(d_out, p)`` and
``right = [A_1; ...; A_k]`` of shape ``(p, d_in)``, ``p = k r`` (see
:func:`fedlr.linalg.mean_of_products_factors`). With thin QR factorisations
``left = Q_1 R_1`` and ``right^T = Q_2 R_2``,

    M = Q_1 (R_1 R_2^T) Q_2^T,

so the SVD of the small ``p x p`` core ``R_1 R_2^T = U_c S V_c^T`` gives the
SVD of ``M``: ``U = Q_1 U_c``, ``V^T = V_c^T Q_2^T``. The cost is two thin QRs
(``O((d_out + d_in) p^2)``) and one ``p x p`` SVD; no ``d_out x d_in`` matrix
is formed. Truncating to the leading ``r`` triplets gives the best rank-``r``
approximation of ``M`` (Eckart-Young), with squared error the sum of the
discarded ``sigma^2``.

Singular vectors are only defined up to sign; :func:`factored_svd` fixes it so
that the entry of largest magnitude in each column of ``U`` is positive (ties go
to the first such entry), which makes results comparable across runs and
devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedlr.errors import RankMismatchError, ShapeMismatchError
from fedlr.linalg.lowrank import (
    check_factors,
    check_rank,
    mean_of_products_factors,
    normalise_weights,
    work_dtype,
)

__all__ = [
    "TruncatedSVD",
    "adaptive_rank",
    "factored_svd",
    "fix_signs",
    "local_svd_factors",
    "pad_factors",
    "personal_change",
    "require_common_rank",
    "stacked_updates_svd",
    "tail_fraction",
    "truncate",
    "truncated_svd_of_mean",
]


@dataclass(frozen=True)
class TruncatedSVD:
    """Leading singular triplets of a matrix given in factored form.

    Attributes
    ----------
    u : (m, r) torch.Tensor
        Left singular vectors (orthonormal columns).
    s : (r,) torch.Tensor
        Leading singular values, descending.
    vh : (r, n) torch.Tensor
        Right singular vectors as rows (orthonormal rows).
    singular_values : (q,) torch.Tensor
        Every singular value the computation determined, descending;
        ``s == singular_values[:r]``. Exact paths give all
        ``q = min(m, n, p)``; a randomized one gives the leading ``l``
        (its sketch size) and puts the rest of the energy in
        ``residual_energy``.
    residual_energy : float, default 0.0
        ``||M||_F^2 - sum(singular_values^2)``: energy outside the computed
        singular values (0 for exact paths).
    energy_error : float, default 0.0
        Bound on the error of ``residual_energy`` when it is estimated
        (``energy_estimated``), in the same squared units; 0 otherwise.
    energy_estimated : bool, default False
        Whether ``residual_energy`` is a randomized estimate.
    randomized : bool, default False
        Whether the subspace came from a randomized range finder (then ``s``
        are lower bounds of the true singular values, close to them when the
        spectrum decays).
    """

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor
    singular_values: torch.Tensor
    residual_energy: float = 0.0
    energy_error: float = 0.0
    energy_estimated: bool = False
    randomized: bool = False

    @property
    def rank(self) -> int:
        """Number of kept triplets ``r``."""
        return int(self.s.numel())

    @property
    def total_energy(self) -> float:
        """``sum sigma^2`` over all singular values (``||M||_F^2``)."""
        return float((self.singular_values.double() ** 2).sum()) + self.residual_energy

    def energy_beyond(self, rank: int) -> float:
        """``sum_{j >= rank} sigma_j^2``: squared error of the rank-``rank`` cut."""
        check_rank(rank, 0)
        tail = float((self.singular_values[rank:].double() ** 2).sum())
        return tail + self.residual_energy

    def tail_fraction_at(self, rank: int) -> float:
        """``energy_beyond(rank) / total_energy`` (0 for a zero matrix)."""
        total = self.total_energy
        return self.energy_beyond(rank) / total if total > 0 else 0.0

    def sigma_fraction_at(self, rank: int) -> float:
        """``sum_{j >= rank} sigma_j / sum_j sigma_j`` (0 for a zero matrix).

        The rank rule of the FedSpec source sums singular values, not their
        squares. Energy outside the computed values (a randomized path)
        counts as ``sqrt(residual_energy)``, the least singular-value sum it
        can have.
        """
        check_rank(rank, 0)
        values = self.singular_values.double()
        unseen = math.sqrt(max(self.residual_energy, 0.0))
        total = float(values.sum()) + unseen
        tail = float(values[rank:].sum()) + unseen
        return tail / total if total > 0 else 0.0

    def tail_fraction_bounds(self, rank: int) -> tuple[float, float]:
        """Bounds ``(low, high)`` of the exact tail fraction at ``rank``.

        The exact fraction is ``sum_{j>=rank} sigma_j^2 / sum_j sigma_j^2`` of
        ``M``. An exact path gives it: ``low == high ==``
        :meth:`tail_fraction_at`. A randomized path computed ``s_j <= sigma_j``
        (interlacing) and the energy outside its sketch up to
        ``energy_error``; with ``E`` the largest total energy the error
        allows,

        * ``high = (E - sum_{j<rank} s_j^2) / E``: the squared error of the
          rank-``rank`` factors it returns (a projection of ``M``), never
          below the optimal (Eckart-Young) tail;
        * ``low = sum_{rank<=j<l} s_j^2 / E``: the tail it saw, never above
          the exact tail.

        The fraction is in ``[low, high]`` (up to the estimate's bound:
        ``energy_error`` is ``error_sigmas`` standard errors, not a
        certainty, when ``energy_estimated``).
        """
        check_rank(rank, 0)
        if not self.randomized:
            fraction = self.tail_fraction_at(rank)
            return fraction, fraction
        energy = self.singular_values.double() ** 2
        head = float(energy[:rank].sum())
        seen_tail = float(energy[rank:].sum())
        unseen = max(self.residual_energy, 0.0) + self._energy_slack
        total = head + seen_tail + unseen
        if total <= 0:
            return 0.0, 0.0
        return seen_tail / total, min((seen_tail + unseen) / total, 1.0)

    def sigma_fraction_bounds(self, rank: int) -> tuple[float, float]:
        """Bounds ``(low, high)`` of the exact ``sum_{j>=rank} sigma_j / sum sigma``.

        Exact paths: both are :meth:`sigma_fraction_at`. A randomized path:
        ``s_j <= sigma_j <= sqrt(s_j^2 + R)`` for the kept values (Weyl; ``R``
        the largest energy outside the sketch), the tail at least the seen
        ``sum_{rank<=j<l} s_j`` and at most ``sqrt((n - rank) T)`` (Cauchy-
        Schwarz; ``T`` the largest tail energy, ``n = min(m, n)``). Wide unless
        the sketch saw nearly everything: a randomized round near the
        threshold is then decided exactly (:class:`fedlr.strategies.FedSpec`).
        """
        check_rank(rank, 0)
        if not self.randomized:
            fraction = self.sigma_fraction_at(rank)
            return fraction, fraction
        values = self.singular_values.double()
        unseen = max(self.residual_energy, 0.0) + self._energy_slack
        head_low = float(values[:rank].sum())
        head_high = float((values[:rank] ** 2 + unseen).sqrt().sum())
        tail_low = float(values[rank:].sum())
        tail_energy = float((values[rank:] ** 2).sum()) + unseen
        size = min(int(self.u.shape[0]), int(self.vh.shape[1]))
        tail_high = max(math.sqrt(max(size - rank, 0) * tail_energy), tail_low)
        low = tail_low / (head_high + tail_low) if head_high + tail_low > 0 else 0.0
        high = tail_high / (head_low + tail_high) if head_low + tail_high > 0 else 0.0
        return low, min(high, 1.0)

    @property
    def _energy_slack(self) -> float:
        return max(self.energy_error, 0.0) if self.energy_estimated else 0.0

    def with_total_energy(self, total: float) -> TruncatedSVD:
        """This result with the exact ``||M||_F^2`` (a randomized one's residual
        energy becomes exact: ``total - sum(singular_values^2)``)."""
        seen = float((self.singular_values.double() ** 2).sum())
        return dataclasses.replace(
            self,
            residual_energy=max(float(total) - seen, 0.0),
            energy_error=0.0,
            energy_estimated=False,
        )

    @property
    def tail_energy(self) -> float:
        """``sum sigma^2`` of the discarded singular values (squared error)."""
        return self.energy_beyond(self.rank)

    @property
    def tail_fraction(self) -> float:
        """``tail_energy / total_energy`` (0 for a zero matrix)."""
        return self.tail_fraction_at(self.rank)

    def split_sqrt(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Balanced factors ``(U sqrt(S), sqrt(S) V^T)``, shapes (m, r), (r, n)."""
        root = self.s.sqrt()
        return self.u * root, root[:, None] * self.vh

    def dense(self) -> torch.Tensor:
        """``U diag(S) V^T`` as a dense (m, n) matrix (for tests and small cases)."""
        return (self.u * self.s) @ self.vh


def fix_signs(u: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip singular-vector pairs so each column of ``u`` has a positive peak.

    Parameters
    ----------
    u : (m, r) torch.Tensor
    vh : (r, n) torch.Tensor

    Returns
    -------
    u, vh
        ``u[:, j]`` and ``vh[j]`` both negated where the entry of ``u[:, j]``
        largest in magnitude is negative; ``u @ diag(s) @ vh`` is unchanged.
    """
    if u.shape[1] == 0:
        return u, vh
    peak = u.abs().argmax(dim=0)
    signs = torch.sign(u.gather(0, peak[None, :]).squeeze(0))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return u * signs, vh * signs[:, None]


def factored_svd(
    left: torch.Tensor, right: torch.Tensor, rank: int | None = None
) -> TruncatedSVD:
    """Truncated SVD of ``left @ right`` from QRs of the factors.

    Parameters
    ----------
    left : (m, p) torch.Tensor
    right : (p, n) torch.Tensor
    rank : int, optional
        Triplets to keep; ``None`` keeps all ``q = min(m, n, p)``. A rank above
        ``q`` keeps ``q`` (the product has no more).

    Returns
    -------
    TruncatedSVD
        In float64 if either input is float64, else float32, on the inputs'
        device. Signs fixed by :func:`fix_signs`.

    Raises
    ------
    ShapeMismatchError
        If the factors are not 2-D or their inner sizes differ.
    ValueError
        If ``rank < 1``.
    """
    if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
        raise ShapeMismatchError(
            f"cannot multiply left {tuple(left.shape)} by right {tuple(right.shape)}"
        )
    if rank is not None and rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    dtype = work_dtype(left, right)
    q1, r1 = torch.linalg.qr(left.to(dtype))
    q2, r2 = torch.linalg.qr(right.to(dtype).T)
    uc, s, vch = torch.linalg.svd(r1 @ r2.T, full_matrices=False)
    keep = s.numel() if rank is None else min(rank, s.numel())
    u = q1 @ uc[:, :keep]
    vh = vch[:keep] @ q2.T
    u, vh = fix_signs(u, vh)
    return TruncatedSVD(u=u, s=s[:keep].clone(), vh=vh, singular_values=s)


def truncated_svd_of_mean(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    rank: int | None = None,
) -> TruncatedSVD:
    """Truncated SVD of ``sum_i w_i B_i A_i`` from the stacked client factors.

    Parameters
    ----------
    bs : k tensors of shape (d_out, r_i)
    as_ : k tensors of shape (r_i, d_in)
    weights : (k,) sequence of float
        Normalised internally.
    rank : int, optional
        See :func:`factored_svd`.

    Returns
    -------
    TruncatedSVD
        In float64 (the stacked factors are formed in float64).
    """
    return factored_svd(*mean_of_products_factors(bs, as_, weights), rank=rank)


# --------------------------------------------------------------------------
# Helpers of the SVD family of LoRA aggregation methods.
# --------------------------------------------------------------------------


def tail_fraction(singular_values: torch.Tensor, rank: int) -> float:
    """Energy fraction beyond ``rank``: ``sum_{j>=rank} s_j^2 / sum_j s_j^2``.

    Parameters
    ----------
    singular_values : (q,) torch.Tensor
        Descending singular values.
    rank : int
        Number of leading values kept (``>= 0``).

    Returns
    -------
    float
        In [0, 1]; 0 for a zero matrix.
    """
    check_rank(rank, 0)
    energy = singular_values.double() ** 2
    total = float(energy.sum())
    return float(energy[rank:].sum()) / total if total > 0 else 0.0


def truncate(svd: TruncatedSVD, rank: int) -> TruncatedSVD:
    """Keep the leading ``min(rank, svd.rank)`` triplets of ``svd``."""
    check_rank(rank)
    keep = min(rank, svd.rank)
    return dataclasses.replace(
        svd, u=svd.u[:, :keep], s=svd.s[:keep].clone(), vh=svd.vh[:keep]
    )


def adaptive_rank(rank: int, tail: float, threshold: float, max_rank: int) -> int:
    """FedSpec's rank rule: grow by 2 while the tail energy is too large.

    Parameters
    ----------
    rank : int
        Current rank ``r``.
    tail : float
        ``sum_{j>r} sigma_j^2 / sum_j sigma_j^2`` at the current rank.
    threshold : float
        Growth is triggered when ``tail > threshold`` (strictly).
    max_rank : int
        Cap; the rank never exceeds ``max(rank, max_rank)`` and never decreases.

    Returns
    -------
    int
        ``min(rank + 2, max_rank)`` if ``tail > threshold``, else ``rank``
        (and never below ``rank``).
    """
    check_rank(rank)
    if not 0.0 <= tail <= 1.0 + 1e-12:
        raise ValueError(f"tail fraction must be in [0, 1], got {tail}")
    if tail > threshold:
        return max(rank, min(rank + 2, max_rank))
    return rank


def pad_factors(
    b: torch.Tensor, a: torch.Tensor, rank: int, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad LoRA factors to ``rank`` without changing their product.

    New columns of ``B`` are zero (LoRA's own initialisation of ``B``); new
    rows of ``A`` are orthonormal, orthogonal to the existing rows, scaled to
    the mean norm of the existing rows (1 if they are all zero), from a seeded
    Gaussian. ``B @ A`` is unchanged and the new directions can still train
    (a zero row of ``A`` together with a zero column of ``B`` would have zero
    gradient for ever).

    Parameters
    ----------
    b : (d_out, r) torch.Tensor
    a : (r, d_in) torch.Tensor
    rank : int
        Target rank ``r' >= r``, at most ``d_in``.
    seed : int

    Returns
    -------
    b : (d_out, r') torch.Tensor
    a : (r', d_in) torch.Tensor
        Same dtype as the inputs.
    """
    r, d_in = a.shape
    if b.shape[1] != r:
        raise ShapeMismatchError(f"B {tuple(b.shape)} and A {tuple(a.shape)} disagree")
    if rank < r:
        raise ValueError(f"cannot pad rank {r} down to {rank}")
    if rank > d_in:
        raise ValueError(f"rank {rank} exceeds the input dimension {d_in}")
    extra = rank - r
    if extra == 0:
        return b, a
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(d_in, extra, generator=gen, dtype=torch.float64)
    rows = a.double()
    if r > 0:  # project out span(rows^T), twice for numerical safety
        q, _ = torch.linalg.qr(rows.T)
        for _ in range(2):
            noise = noise - q @ (q.T @ noise)
    basis, _ = torch.linalg.qr(noise)
    norms = rows.norm(dim=1)
    scale = float(norms.mean()) if r > 0 and float(norms.max()) > 0 else 1.0
    new_a = torch.cat([rows, scale * basis.T], dim=0).to(a.dtype)
    new_b = torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1)
    return new_b, new_a


def require_common_rank(
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], layer: str
) -> int:
    """The common rank of every client's ``(B, A)``, or a named error.

    Parameters
    ----------
    factors : mapping of client name to (B (d_out, r), A (r, d_in))
    layer : str
        Named in the error.

    Raises
    ------
    RankMismatchError
        If two clients' factors disagree in shape, naming every client's shapes.
    """
    shapes = {
        name: (tuple(b.shape), tuple(a.shape)) for name, (b, a) in factors.items()
    }
    if len(set(shapes.values())) > 1:
        raise RankMismatchError(layer, shapes)
    if not shapes:
        raise ValueError("no factors given")
    (b_shape, _), *_ = shapes.values()
    return int(b_shape[1])


def stacked_updates_svd(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, list[torch.Tensor], TruncatedSVD]:
    """Global SVD: one shared input-side factor, one output-side factor per client.

    With ``nn.Linear``'s (out, in) layout a client's update is
    ``Delta_i = B_i A_i``. The input-major stack

        X = [sqrt(w_1) Delta_1^T, ..., sqrt(w_k) Delta_k^T]      (d_in, k d_out)
          = [A_1^T, ..., A_k^T] @ blockdiag(sqrt(w_i) B_i^T)

    is a product of a (d_in, k r) and a (k r, k d_out) factor. Its rank-``rank``
    truncated SVD ``U S V^T`` is exact and factored, without forming any
    (d_out, d_in) matrix or the block-diagonal factor:

    1. thin QR ``[A_1^T, ..., A_k^T] = Q_1 R_1`` (d_in, m), (m, k r),
       ``m = min(d_in, k r)``;
    2. each client's own thin QR ``B_i = Q_{B_i} R_{B_i}``, so that
       ``blockdiag(sqrt(w_i) B_i^T) = blockdiag(sqrt(w_i) R_{B_i}^T)
       blockdiag(Q_{B_i})^T`` with orthonormal ``blockdiag(Q_{B_i})``;
    3. the SVD of the core ``C = [sqrt(w_i) R_1[:, block i] R_{B_i}^T]_i``
       (m, k min(d_out, r)), ``C = U_c S V_c^T``;
    4. ``U = Q_1 U_c`` and client ``i``'s block of ``V`` is
       ``Q_{B_i} V_c[block i]``.

    Memory is ``O(d_in k r + m k r)``, not the ``O(k^2 r d_out)`` of the
    block-diagonal factor. The shared factor is ``A = sqrt(S) U^T``
    (rank, d_in); client ``i`` gets ``B_i' = V_i sqrt(S) / sqrt(w_i)``
    (d_out, rank). Then ``sum_i w_i ||Delta_i - B_i' A||_F^2`` is the
    discarded energy of ``X`` (Eckart-Young: the best such pair of factors).
    For many clients, :func:`fedlr.linalg.updates_svd` picks a cheaper path by
    a cost model.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
        Client weights, normalised internally; all must be positive.
    rank : int

    Returns
    -------
    a : (rank', d_in) torch.Tensor
        Shared factor, ``rank' = min(rank, d_in, k d_out, k r)``, float64.
    b_list : k tensors (d_out, rank')
        Client factors, float64.
    svd : TruncatedSVD
        Of ``X``; ``svd.tail_energy`` is the weighted squared gap.
    """
    w = _positive_weights(bs, as_, weights)
    check_rank(rank)
    k, d_out, r = len(bs), int(bs[0].shape[0]), int(bs[0].shape[1])
    roots = w.sqrt()
    # 1. QR of the stacked input-side factors.
    q1, r1 = torch.linalg.qr(torch.cat([a.double().T for a in as_], dim=1))
    m = int(r1.shape[0])
    # 2. Every client's QR of B_i at once (batched), 3. the core's blocks.
    qb, rb = torch.linalg.qr(torch.stack(list(bs)).double())  # (k, d_out, m_b)
    width = int(qb.shape[2])
    blocks = r1.reshape(m, k, r).transpose(0, 1) @ (
        roots[:, None, None] * rb.transpose(1, 2)
    )  # (k, m, m_b)
    core = blocks.transpose(0, 1).reshape(m, k * width)
    uc, s, vch = torch.linalg.svd(core, full_matrices=False)
    keep = min(rank, s.numel())
    # 4. Back to the full spaces.
    u = q1 @ uc[:, :keep]
    vh_blocks = vch[:keep].reshape(keep, k, width).transpose(0, 1) @ qb.transpose(
        1, 2
    )  # (k, keep, d_out)
    vh = vh_blocks.transpose(0, 1).reshape(keep, k * d_out)
    u, vh = fix_signs(u, vh)
    svd = TruncatedSVD(u=u, s=s[:keep].clone(), vh=vh, singular_values=s)
    root = svd.s.sqrt()
    a_shared = root[:, None] * svd.u.T
    blocks_t = svd.vh.reshape(keep, k, d_out).permute(1, 2, 0)  # (k, d_out, keep)
    b_list = list(((blocks_t * root) / roots[:, None, None]).unbind(0))
    return a_shared, b_list, svd


def _positive_weights(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Normalised Global-SVD client weights, checked positive, and the factors' shapes.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float

    Returns
    -------
    (k,) torch.Tensor
        float64 weights summing to one.

    Raises
    ------
    ShapeMismatchError
        If the factor lists differ in length, are empty, or disagree in shape.
    ValueError
        If a weight is not positive.
    """
    if len(bs) != len(as_) or not bs:
        raise ShapeMismatchError(f"{len(bs)} B factors but {len(as_)} A factors")
    check_factors(bs, as_)
    w = normalise_weights(weights, len(bs))
    if bool((w <= 0).any()):
        raise ValueError(f"every client weight must be positive, got {w.tolist()}")
    return w


def local_svd_factors(
    b: torch.Tensor, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local SVD: rewrite one client's ``B A`` as balanced singular factors.

    With ``Delta^T = A^T B^T = U S V^T`` (input x output, sign-fixed), returns
    ``B' = V sqrt(S)`` and ``A' = sqrt(S) U^T`` so that ``B' A' = B A`` exactly;
    ``A'`` (input side) is the factor the server averages.

    Parameters
    ----------
    b : (d_out, r) torch.Tensor
    a : (r, d_in) torch.Tensor

    Returns
    -------
    b : (d_out, r) torch.Tensor
    a : (r, d_in) torch.Tensor
        Same dtype as the inputs; rank ``r`` kept (zero singular values pad).
    """
    r = int(a.shape[0])
    svd = factored_svd(a.T, b.T, rank=r)
    root = svd.s.sqrt()
    new_b = svd.vh.T * root
    new_a = root[:, None] * svd.u.T
    if new_a.shape[0] < r:  # the product had fewer than r singular values
        new_b, new_a = pad_factors(new_b, new_a, r, seed=0)
    return new_b.to(b.dtype), new_a.to(a.dtype)


def personal_change(
    gram: torch.Tensor, a_own: torch.Tensor, a_new: torch.Tensor
) -> tuple[float, float]:
    """``||B (A_own - A_new)||_F^2`` and ``||B A_own||_F^2`` from ``G = B^T B``.

    A personalised client keeps ``B`` and replaces its trained ``A_own`` by the
    aggregate ``A_new``; the change to its update is
    ``tr(G D D^T)`` with ``D = A_own - A_new`` (r x r work, no d_out x d_in).

    Parameters
    ----------
    gram : (r, r) torch.Tensor
        ``B^T B``.
    a_own, a_new : (r, d_in) torch.Tensor

    Returns
    -------
    change_sq, own_sq : float
    """
    if gram.shape != (a_own.shape[0], a_own.shape[0]) or a_own.shape != a_new.shape:
        raise ShapeMismatchError(
            f"gram {tuple(gram.shape)}, A {tuple(a_own.shape)}, A' "
            f"{tuple(a_new.shape)} do not fit"
        )
    g = gram.double()
    d = a_own.double() - a_new.double()
    change = float(torch.einsum("ij,ij->", g, d @ d.T))
    own = float(torch.einsum("ij,ij->", g, a_own.double() @ a_own.double().T))
    return max(change, 0.0), max(own, 0.0)
