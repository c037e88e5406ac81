"""Kernels on low-rank factors: means of products, residuals, their norms.

A LoRA client ``i`` holds ``B_i`` of shape ``(d_out, r)`` and ``A_i`` of shape
``(r, d_in)`` (``nn.Linear``'s ``(out, in)`` layout, so ``B_i @ A_i`` has the
weight's shape and needs no transpose; GPT-2's ``Conv1D`` stores the weight
``(in, out)``, and the folds take ``transposed=True`` for it). With client
weights ``w_i`` summing to one, the ideal aggregate is the mean of products

    M = sum_i w_i B_i A_i = [w_1 B_1, ..., w_k B_k] @ [A_1; ...; A_k],

the product of two *stacked factors* of inner size ``k r``. Nothing here ever
forms a ``d_out x d_in`` matrix per client: the residual of FedEx-LoRA,
``M - B_bar A_bar``, is again a product of stacked factors (one more block),
applied to the base weight as a single GEMM, and its Frobenius norm comes from
two thin QR factorisations and a ``(k+1) r``-sized core.

References
----------
.. [1] Singhal, Ponkshe, Vepakomma, "FedEx-LoRA: Exact Aggregation for
   Federated and Efficient Fine-Tuning of Foundation Models", ACL 2025.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fedlr.errors import ShapeMismatchError

__all__ = [
    "GapNorms",
    "StackedResidual",
    "check_factors",
    "check_rank",
    "factored_frobenius_norm",
    "fold_residual",
    "gap_summary",
    "mean_of_products_factors",
    "normalise_weights",
    "residual_factors",
    "stacked_residual",
    "weighted_mean",
    "work_dtype",
]

_COMPUTE_DTYPE = torch.float64

MEAN_CHUNK_BYTES = 64 * 2**20
"""Largest float64 group :func:`weighted_mean` stacks at once (bytes)."""


def work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half types are promoted)."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _fold_dtype(
    base_weight: torch.Tensor,
    product_shape: tuple[int, int],
    factor_dtype: torch.dtype,
    transposed: bool,
) -> torch.dtype:
    """The dtype a fold of a ``product_shape`` residual into ``base_weight`` runs in.

    float64 if the base weight or the factors (``factor_dtype``) are float64,
    else float32.

    Raises
    ------
    ShapeMismatchError
        If ``base_weight`` is not ``product_shape`` (its transpose with
        ``transposed``).
    """
    shape = product_shape[::-1] if transposed else product_shape
    if tuple(base_weight.shape) != shape:
        raise ShapeMismatchError(
            f"base weight has shape {tuple(base_weight.shape)}, factors give "
            f"{shape}" + (" (transposed)" if transposed else "")
        )
    dtypes = (base_weight.dtype, factor_dtype)
    return torch.float64 if torch.float64 in dtypes else torch.float32


def check_rank(rank: int, least: int = 1) -> None:
    """Raise ValueError naming ``rank`` unless it is at least ``least``."""
    if rank < least:
        raise ValueError(f"rank must be >= {least}, got {rank}")


def normalise_weights(
    weights: Sequence[float] | torch.Tensor, count: int
) -> torch.Tensor:
    """Return client weights as a float64 vector summing to one.

    Parameters
    ----------
    weights : (k,) sequence of float
        Non-negative weights, e.g. each client's number of examples.
    count : int
        The number of clients ``k`` the weights must match.

    Returns
    -------
    (k,) torch.Tensor
        ``weights / sum(weights)`` in float64.

    Raises
    ------
    ShapeMismatchError
        If there are not exactly ``count`` weights.
    ValueError
        If a weight is negative or not finite, or all weights are zero.
    """
    w = torch.as_tensor(weights, dtype=_COMPUTE_DTYPE).flatten()
    if w.numel() != count:
        raise ShapeMismatchError(f"expected {count} weights, got {w.numel()}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"weights must be finite and non-negative, got {w.tolist()}")
    total = float(w.sum())
    if total <= 0.0:
        raise ValueError("weights sum to zero; at least one must be positive")
    return w / total


def _check_same_shapes(tensors: Sequence[torch.Tensor], what: str) -> torch.Size:
    if len(tensors) == 0:
        raise ValueError(f"no {what} given")
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != shape:
            raise ShapeMismatchError(
                f"{what}[{i}] has shape {tuple(t.shape)}, {what}[0] has {tuple(shape)}"
            )
    return shape


def check_factors(
    bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor]
) -> tuple[int, int, int]:
    """Check k LoRA factor pairs agree in shape; return ``(d_out, r, d_in)``.

    Parameters
    ----------
    bs : k tensors of shape (d_out, r)
    as_ : k tensors of shape (r, d_in)

    Raises
    ------
    ShapeMismatchError
        Naming the shapes, if the lists differ in length, a factor is not
        2-D, two clients' factors differ in shape, or ``B`` and ``A`` disagree
        on ``r``.
    ValueError
        If no factors are given.
    """
    if len(bs) != len(as_):
        raise ShapeMismatchError(f"{len(bs)} B factors but {len(as_)} A factors")
    b_shape = _check_same_shapes(bs, "B")
    a_shape = _check_same_shapes(as_, "A")
    if len(b_shape) != 2 or len(a_shape) != 2:
        raise ShapeMismatchError(
            f"factors must be 2-D, got B {tuple(b_shape)} and A {tuple(a_shape)}"
        )
    if b_shape[1] != a_shape[0]:
        raise ShapeMismatchError(
            f"B (d_out, r) = {tuple(b_shape)} and A (r, d_in) = {tuple(a_shape)} "
            "disagree on r"
        )
    return int(b_shape[0]), int(b_shape[1]), int(a_shape[1])


def weighted_mean(
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weighted mean of same-shaped tensors, accumulated in float64 in place.

    One float64 accumulator of the tensors' shape; clients are added a group
    at a time (``acc += sum_{i in group} w_i t_i``), each group's float64 copy
    at most :data:`MEAN_CHUNK_BYTES`: the extra memory does not grow with
    ``k`` (no float64 copy of every client tensor), and the number of torch
    calls grows with the number of groups, not of clients.

    Parameters
    ----------
    tensors : sequence of k tensors of one shape
    weights : (k,) sequence of float
        Normalised internally (see :func:`normalise_weights`).
    dtype : torch.dtype, optional
        Of the result; default the first tensor's.

    Returns
    -------
    torch.Tensor
        ``sum_i w_i t_i`` on the first tensor's device.
    """
    _check_same_shapes(tensors, "tensor")
    w = normalise_weights(weights, len(tensors))
    first = tensors[0]
    acc = torch.zeros(first.shape, dtype=_COMPUTE_DTYPE, device=first.device)
    per_tensor = max(1, first.numel() * 8)
    step = max(1, MEAN_CHUNK_BYTES // per_tensor)
    for start in range(0, len(tensors), step):
        group = [t.to(first.device) for t in tensors[start : start + step]]
        stacked = torch.stack(group).to(_COMPUTE_DTYPE)
        acc.add_(torch.tensordot(w[start : start + step].to(first.device), stacked, 1))
    return acc.to(first.dtype if dtype is None else dtype)


def mean_of_products_factors(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked factors whose product is ``M = sum_i w_i B_i A_i``.

    Parameters
    ----------
    bs : k tensors of shape (d_out, r)
    as_ : k tensors of shape (r, d_in)
    weights : (k,) sequence of float

    Returns
    -------
    left : (d_out, k r) torch.Tensor, float64
        ``[w_1 B_1, ..., w_k B_k]``.
    right : (k r, d_in) torch.Tensor, float64
        ``[A_1; ...; A_k]``.
    """
    check_factors(bs, as_)
    w = normalise_weights(weights, len(bs))
    return _stacked_factors(bs, as_, [float(wi) for wi in w])


def _stacked_factors(
    bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor], coefficients: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[c_i B_i]`` side by side and ``[A_i]`` stacked, in float64."""
    left = torch.cat(
        [c * b.to(_COMPUTE_DTYPE) for c, b in zip(coefficients, bs, strict=True)], dim=1
    )
    right = torch.cat([a.to(_COMPUTE_DTYPE) for a in as_], dim=0)
    return left, right


def residual_factors(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked factors of the FedEx residual ``sum_i w_i B_i A_i - B_bar A_bar``.

    ``B_bar = sum_i w_i B_i`` and ``A_bar = sum_i w_i A_i`` are the FedAvg factors.

    Parameters
    ----------
    bs : k tensors of shape (d_out, r)
    as_ : k tensors of shape (r, d_in)
    weights : (k,) sequence of float

    Returns
    -------
    left : (d_out, (k+1) r) torch.Tensor, float64
        ``[w_1 B_1, ..., w_k B_k, -B_bar]``.
    right : ((k+1) r, d_in) torch.Tensor, float64
        ``[A_1; ...; A_k; A_bar]``.
    """
    residual = stacked_residual(bs, as_, weights)
    return residual.left, residual.right


@dataclass(frozen=True)
class GapNorms:
    """One layer's Frobenius gap and the norm it is relative to.

    Attributes
    ----------
    gap : float
        ``||Delta_agg - Delta_ref||_F`` (or its estimate).
    reference : float
        ``||Delta_ref||_F`` (or its estimate).
    estimated : bool
        True when the numbers come from a randomized estimator
        (:func:`fedlr.linalg.estimate_frobenius_sq`), not an exact computation.
    gap_sq_error : float
        Bound on ``|gap^2 - true gap^2|`` (``CostModel.error_sigmas`` standard
        errors of the estimator, estimated from its probes); 0 when exact.
    """

    gap: float
    reference: float
    estimated: bool = False
    gap_sq_error: float = 0.0

    @property
    def pair(self) -> tuple[float, float]:
        """``(gap, reference)``, as :meth:`RoundReport.from_layers` takes them."""
        return self.gap, self.reference


def gap_summary(norms: Iterable[GapNorms]) -> dict[str, float]:
    """Report metrics saying whether, and how far, a round's gap is estimated.

    Parameters
    ----------
    norms : iterable of GapNorms
        Every layer's gap.

    Returns
    -------
    dict of str to float
        ``gap-estimated``: 1.0 if any layer's gap is estimated, else 0.0.
        ``gap-error-bound``: bound on ``|true - reported| / reported`` for the
        total ``frobenius-gap = sqrt(sum gap^2)``. With the reported
        ``G^2 = sum gap^2`` and ``E = sqrt(sum gap_sq_error^2)`` (layers'
        estimates are independent), the true ``G'^2`` is within ``G^2 +- E``,
        so ``|G' - G| / G <= 1 - sqrt(1 - E / G^2)`` (1.0 if ``E >= G^2``);
        0.0 when every layer is exact.
    """
    items = list(norms)
    estimated = any(n.estimated for n in items)
    gap_sq = sum(n.gap * n.gap for n in items)
    error = math.sqrt(sum(n.gap_sq_error**2 for n in items))
    if error <= 0.0:
        bound = 0.0
    elif error >= gap_sq:
        bound = 1.0
    else:
        bound = 1.0 - math.sqrt(1.0 - error / gap_sq)
    return {"gap-estimated": 1.0 if estimated else 0.0, "gap-error-bound": bound}


@dataclass(frozen=True)
class StackedResidual:
    """One layer's FedEx residual ``M - B_bar A_bar`` as stacked factors.

    ``left @ right = sum_i w_i B_i A_i - B_bar A_bar``, and the first ``k r``
    columns of ``left`` and rows of ``right`` are the mean-of-products factors
    of ``M = sum_i w_i B_i A_i`` (:func:`mean_of_products_factors`): the gap
    report and the fold share one construction.

    Attributes
    ----------
    left : (d_out, (k+1) r) torch.Tensor, float64
        ``[w_1 B_1, ..., w_k B_k, -B_bar]``.
    right : ((k+1) r, d_in) torch.Tensor, float64
        ``[A_1; ...; A_k; A_bar]``.
    rank : int
        ``r``.
    work_dtype : torch.dtype
        float64 if any client factor was float64, else float32: the dtype of
        the fold's GEMM (with the base weight's, see :meth:`fold`).
    """

    left: torch.Tensor
    right: torch.Tensor
    rank: int
    work_dtype: torch.dtype

    @property
    def mean_of_products(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors ``(d_out, k r)`` and ``(k r, d_in)`` of ``M`` (views)."""
        p = self.left.shape[1] - self.rank
        return self.left[:, :p], self.right[:p]

    def norms(self) -> tuple[float, float]:
        """``(||M - B_bar A_bar||_F, ||M||_F)`` by :func:`factored_frobenius_norm`."""
        return (
            factored_frobenius_norm(self.left, self.right),
            factored_frobenius_norm(*self.mean_of_products),
        )

    def gap_norms(self) -> GapNorms:
        """:meth:`norms` as an exact :class:`GapNorms`."""
        return GapNorms(*self.norms())

    def fold(
        self, base_weight: torch.Tensor, scaling: float, *, transposed: bool = False
    ) -> torch.Tensor:
        """``W0 + scaling * (M - B_bar A_bar)`` as one GEMM.

        Parameters
        ----------
        base_weight : (d_out, d_in) torch.Tensor
            Or (d_in, d_out) with ``transposed``.
        scaling : float
        transposed : bool, default False
            ``W0`` is stored (d_in, d_out) (GPT-2's ``Conv1D``, peft's
            ``fan_in_fan_out``): fold ``scaling * (M - B_bar A_bar)^T``, the
            GEMM ``right^T @ left^T``.

        Returns
        -------
        torch.Tensor
            ``base_weight``'s shape, dtype and device; the input is not
            modified. The GEMM runs in float64 if the base weight or any client
            factor is float64, else in float32.
        """
        product_shape = (int(self.left.shape[0]), int(self.right.shape[1]))
        dtype = _fold_dtype(base_weight, product_shape, self.work_dtype, transposed)
        left, right = self.left, self.right
        if transposed:
            left, right = right.T, left.T
        folded = torch.addmm(
            base_weight.to(dtype),
            left.to(dtype),
            right.to(dtype),
            alpha=float(scaling),
        )
        return folded.to(base_weight.dtype)


def stacked_residual(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
) -> StackedResidual:
    """The FedEx residual ``sum_i w_i B_i A_i - B_bar A_bar`` of one layer.

    Parameters
    ----------
    bs : k tensors of shape (d_out, r)
    as_ : k tensors of shape (r, d_in)
    weights : (k,) sequence of float
        Normalised internally.

    Returns
    -------
    StackedResidual
        Its factors, from which both the gap (:meth:`StackedResidual.norms`)
        and the fold (:meth:`StackedResidual.fold`) are computed.
    """
    left, right = mean_of_products_factors(bs, as_, weights)
    w = normalise_weights(weights, len(bs))
    b_bar = weighted_mean(bs, w, dtype=_COMPUTE_DTYPE)
    a_bar = weighted_mean(as_, w, dtype=_COMPUTE_DTYPE)
    return StackedResidual(
        left=torch.cat([left, -b_bar], dim=1),
        right=torch.cat([right, a_bar], dim=0),
        rank=int(bs[0].shape[1]),
        work_dtype=work_dtype(*bs, *as_),
    )


def factored_frobenius_norm(left: torch.Tensor, right: torch.Tensor) -> float:
    """Frobenius norm of ``left @ right`` without forming the product.

    With thin QR factorisations ``left = Q_1 R_1`` and ``right^T = Q_2 R_2``,
    ``||left @ right||_F = ||R_1 R_2^T||_F`` because ``Q_1`` and ``Q_2`` have
    orthonormal columns. This is exact up to rounding, and stays accurate when
    the product nearly cancels (unlike ``sqrt(trace(...))`` of Gram matrices).

    Parameters
    ----------
    left : (m, p) torch.Tensor
    right : (p, n) torch.Tensor

    Returns
    -------
    float
        ``||left @ right||_F``.
    """
    if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
        raise ShapeMismatchError(
            f"cannot multiply left {tuple(left.shape)} by right {tuple(right.shape)}"
        )
    r1 = torch.linalg.qr(left.to(_COMPUTE_DTYPE), mode="r").R
    r2 = torch.linalg.qr(right.to(_COMPUTE_DTYPE).T, mode="r").R
    return float(torch.linalg.matrix_norm(r1 @ r2.T))


def fold_residual(
    base_weight: torch.Tensor,
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    scaling: float,
    *,
    transposed: bool = False,
) -> torch.Tensor:
    """FedEx-LoRA: fold ``scaling * (sum_i w_i B_i A_i - B_bar A_bar)`` into ``W0``.

    After the fold, ``W0_new + scaling * B_bar A_bar`` equals
    ``W0 + scaling * sum_i w_i B_i A_i`` exactly (up to rounding): the global
    model is the weighted mean of the client models.

    Parameters
    ----------
    base_weight : (d_out, d_in) torch.Tensor
        The frozen base weight ``W0`` of the adapted ``nn.Linear``; (d_in,
        d_out) with ``transposed``.
    bs : k tensors of shape (d_out, r)
    as_ : k tensors of shape (r, d_in)
    weights : (k,) sequence of float
    scaling : float
        The LoRA scaling ``alpha / r``.
    transposed : bool, default False
        ``W0`` is a ``Conv1D``'s (d_in, d_out) weight (peft's
        ``fan_in_fan_out``): the residual is folded in transposed.

    Returns
    -------
    torch.Tensor
        The new base weight, in ``base_weight``'s shape, dtype and device. The
        input is not modified. The stacked factors are formed in float64; the
        single GEMM runs in float64 if any input is float64, else in float32.
    """
    return stacked_residual(bs, as_, weights).fold(
        base_weight, scaling, transposed=transposed
    )
