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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.lowrank import mean_of_products_factors

__all__ = ["TruncatedSVD", "factored_svd", "fix_signs", "truncated_svd_of_mean"]


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
        Every singular value the factored form determines (``q = min(m, n, p)``),
        descending; ``s == singular_values[:r]``.
    """

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor
    singular_values: torch.Tensor

    @property
    def rank(self) -> int:
        """Number of kept triplets ``r``."""
        return int(self.s.numel())

    @property
    def total_energy(self) -> float:
        """``sum sigma^2`` over all singular values (``||M||_F^2``)."""
        return float((self.singular_values.double() ** 2).sum())

    @property
    def tail_energy(self) -> float:
        """``sum sigma^2`` of the discarded singular values (squared error)."""
        return float((self.singular_values[self.rank :].double() ** 2).sum())

    @property
    def tail_fraction(self) -> float:
        """``tail_energy / total_energy`` (0 for a zero matrix)."""
        total = self.total_energy
        return self.tail_energy / total if total > 0 else 0.0

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


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


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
    dtype = _compute_dtype(left, right)
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
