"""VeRA kernels: the exact FedEx residual of scaled shared projections.

A VeRA layer's update is ``Delta W = s Lambda_b B Lambda_d A`` with frozen
shared ``A`` (r, d_in), ``B`` (d_out, r), trainable vectors ``b`` (d_out,) and
``d`` (r,), ``Lambda = diag(.)``, and ``s`` the scaling (peft's VeRA has none:
``s = 1``). Because ``Lambda_b B`` and ``Lambda_d A`` are linear in ``b`` and
``d``, FedAvg of the vectors gives ``Lambda_b_bar B = sum_i w_i Lambda_b_i B``,
so the VeRA-FedEx residual

    sum_i w_i Lambda_b_i B Lambda_d_i A - Lambda_b_bar B Lambda_d_bar A

is the LoRA FedEx residual of the per-client factors ``B_i = Lambda_b_i B``
and ``A_i = Lambda_d_i A``: a product of stacked ``(d_out, (k+1) r)`` and
``((k+1) r, d_in)`` matrices (see :func:`fedlr.linalg.residual_factors`),
folded into ``W0`` as one GEMM. No ``d_out x d_in`` product per client and no
``d_out x d_out`` diagonal matrix is formed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.lowrank import fold_residual, normalise_weights, residual_factors

__all__ = [
    "fold_vera_residual",
    "lambda_stacks",
    "vera_factors",
    "vera_gap_norms",
    "vera_residual_factors",
]


def vera_factors(
    lambda_b: torch.Tensor,
    lambda_d: torch.Tensor,
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Lambda_b B, Lambda_d A)``, the VeRA update as a LoRA pair.

    Parameters
    ----------
    lambda_b : (d_out,) torch.Tensor
    lambda_d : (r,) torch.Tensor
    a_matrix : (r, d_in) torch.Tensor
        The shared ``A``, already sliced to the layer's ``d_in``.
    b_matrix : (d_out, r) torch.Tensor
        The shared ``B``, already sliced to the layer's ``d_out``.

    Returns
    -------
    left : (d_out, r) torch.Tensor
    right : (r, d_in) torch.Tensor

    Raises
    ------
    ShapeMismatchError
        If the shapes disagree.
    """
    if (
        lambda_b.ndim != 1
        or lambda_d.ndim != 1
        or a_matrix.ndim != 2
        or b_matrix.ndim != 2
        or b_matrix.shape != (lambda_b.numel(), lambda_d.numel())
        or a_matrix.shape[0] != lambda_d.numel()
    ):
        raise ShapeMismatchError(
            f"VeRA shapes disagree: lambda_b {tuple(lambda_b.shape)}, lambda_d "
            f"{tuple(lambda_d.shape)}, A {tuple(a_matrix.shape)}, B "
            f"{tuple(b_matrix.shape)}; expected (d_out,), (r,), (r, d_in), (d_out, r)"
        )
    return lambda_b.unsqueeze(1) * b_matrix, lambda_d.unsqueeze(1) * a_matrix


def _client_factors(
    lambda_bs: Sequence[torch.Tensor],
    lambda_ds: Sequence[torch.Tensor],
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if len(lambda_bs) != len(lambda_ds) or not lambda_bs:
        raise ShapeMismatchError(
            f"{len(lambda_bs)} lambda_b but {len(lambda_ds)} lambda_d vectors"
        )
    a64, b64 = a_matrix.to(torch.float64), b_matrix.to(torch.float64)
    pairs = [
        vera_factors(lb.to(torch.float64), ld.to(torch.float64), a64, b64)
        for lb, ld in zip(lambda_bs, lambda_ds, strict=True)
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def vera_residual_factors(
    lambda_bs: Sequence[torch.Tensor],
    lambda_ds: Sequence[torch.Tensor],
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked factors of ``sum_i w_i Lb_i B Ld_i A - Lb_bar B Ld_bar A``.

    Parameters
    ----------
    lambda_bs : k tensors of shape (d_out,)
    lambda_ds : k tensors of shape (r,)
    a_matrix : (r, d_in) torch.Tensor
    b_matrix : (d_out, r) torch.Tensor
    weights : (k,) sequence of float
        Normalised internally.

    Returns
    -------
    left : (d_out, (k+1) r) torch.Tensor, float64
    right : ((k+1) r, d_in) torch.Tensor, float64
    """
    bs, as_ = _client_factors(lambda_bs, lambda_ds, a_matrix, b_matrix)
    return residual_factors(bs, as_, weights)


def fold_vera_residual(
    base_weight: torch.Tensor,
    lambda_bs: Sequence[torch.Tensor],
    lambda_ds: Sequence[torch.Tensor],
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
    *,
    scaling: float = 1.0,
    step: float = 1.0,
    transposed: bool = False,
) -> torch.Tensor:
    """VeRA-FedEx: ``W0 + step * scaling * residual`` in one GEMM.

    With ``step = 1``, ``W0_new + scaling Lb_bar B Ld_bar A`` equals
    ``W0 + scaling sum_i w_i Lb_i B Ld_i A``: the global model is the weighted
    mean of the client models.

    Parameters
    ----------
    base_weight : (d_out, d_in) torch.Tensor
        Or (d_in, d_out) with ``transposed``.
    lambda_bs : k tensors of shape (d_out,)
    lambda_ds : k tensors of shape (r,)
    a_matrix : (r, d_in) torch.Tensor
    b_matrix : (d_out, r) torch.Tensor
    weights : (k,) sequence of float
    scaling : float, default 1.0
        The adapter's scaling (1 for peft's VeRA).
    step : float, default 1.0
        ``fedex-lr``: the fraction of the residual folded in.
    transposed : bool, default False
        ``W0`` is a ``Conv1D``'s (d_in, d_out) weight (peft's
        ``fan_in_fan_out``): the residual is folded in transposed.

    Returns
    -------
    torch.Tensor
        In ``base_weight``'s shape and dtype; the input is not modified.
    """
    bs, as_ = _client_factors(lambda_bs, lambda_ds, a_matrix, b_matrix)
    return fold_residual(
        base_weight, bs, as_, weights, scaling * step, transposed=transposed
    )


def lambda_stacks(
    lambda_bs: Sequence[torch.Tensor],
    lambda_ds: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked float64 factors of ``M = sum_i w_i b_i d_i^T - b_bar d_bar^T``.

    Returns
    -------
    left : (d_out, k+1) torch.Tensor
        ``[w_1 b_1, ..., w_k b_k, -b_bar]``; its first ``k`` columns with the
        first ``k`` rows of ``right`` give ``N = sum_i w_i b_i d_i^T``.
    right : (k+1, r) torch.Tensor
        ``[d_1; ...; d_k; d_bar]``.
    """
    w = normalise_weights(weights, len(lambda_bs)).to(torch.float64)
    bs = torch.stack([b.to(torch.float64) for b in lambda_bs], dim=1)
    ds = torch.stack([d.to(torch.float64) for d in lambda_ds], dim=1)
    left = torch.cat([bs * w, -(bs @ w)[:, None]], dim=1)
    right = torch.cat([ds, (ds @ w)[:, None]], dim=1).T
    return left, right


def vera_gap_norms(
    lambda_bs: Sequence[torch.Tensor],
    lambda_ds: Sequence[torch.Tensor],
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
) -> tuple[float, float]:
    """``(||residual||_F, ||mean of the updates||_F)``, linear in the clients.

    ``Lb B Ld A = (B o (b d^T)) A``, so the mean of the updates is
    ``(B o N) A`` with ``N = sum_i w_i b_i d_i^T`` (d_out x r) and the residual
    ``(B o M) A`` with ``M = N - b_bar d_bar^T``. With ``A^T = Q R`` (thin QR),
    ``||X A||_F = ||X R^T||_F``: no stack of the ``k`` clients' factors, no
    ``d_out x d_in`` matrix. Float64 throughout.

    Parameters
    ----------
    lambda_bs : k tensors of shape (d_out,)
    lambda_ds : k tensors of shape (r,)
    a_matrix : (r, d_in) torch.Tensor
    b_matrix : (d_out, r) torch.Tensor
    weights : (k,) sequence of float
        Normalised internally.
    """
    _client_factors(lambda_bs[:1], lambda_ds[:1], a_matrix, b_matrix)  # shapes
    left, right = lambda_stacks(lambda_bs, lambda_ds, weights)
    k = len(lambda_bs)
    mean = left[:, :k] @ right[:k]
    residual = left @ right
    r_factor = torch.linalg.qr(a_matrix.to(torch.float64).T, mode="r").R
    proj = b_matrix.to(torch.float64)

    def norm(x: torch.Tensor) -> float:
        return float(torch.linalg.matrix_norm((proj * x) @ r_factor.T))

    return norm(residual), norm(mean)
