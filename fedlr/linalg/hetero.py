"""Kernels for clients with different LoRA ranks (FlexLoRA, HetLoRA, FLoRA).

Client ``i`` trains ``B_i`` (d_out, r_i) and ``A_i`` (r_i, d_in) with its own
scaling ``s_i = alpha / r_i``; its model update is ``s_i B_i A_i``. The ideal
aggregate is the weighted mean of the updates,

    M = sum_i w_i s_i B_i A_i,

a product of stacked factors ``[w_1 s_1 B_1, ..., w_k s_k B_k]`` (d_out x
sum r_i) and ``[A_1; ...; A_k]``: stacking needs equal ``d_out`` and
``d_in``, not equal ranks. The kernels return *update-space* factors
``(B~, A~)`` whose leading ``r`` columns / rows a client of rank ``r`` takes
(:func:`factors_for_rank` turns them into its own ``B``, ``A`` for its
scaling), and the gap of what each rank receives (:func:`received_gap`), all
from QRs of stacked factors: no ``d_out x d_in`` matrix per client.

* FlexLoRA: ``B~ = U sqrt(S)``, ``A~ = sqrt(S) V^T`` of the truncated SVD of
  ``M`` (:func:`flexlora_factors`); rank ``r`` gets the best rank-``r``
  approximation of ``M`` (Eckart-Young).
* HetLoRA: the weighted mean of the clients' balanced factors
  ``sqrt(s_i) B_i``, ``sqrt(s_i) A_i`` zero-padded to the largest rank
  (:func:`hetlora_factors`); rank ``r`` gets the leading ``r`` components.
* FLoRA: ``M`` itself, folded into the base weight (:func:`stacked_update`);
  every client starts a fresh adapter at its own rank.
* FedSpec with ``client-ranks``: FlexLoRA's factors at its adaptive rank
  ``R >= max r_i`` (``factored_svd`` of :func:`stacked_update`, then
  ``truncate`` and ``pad_factors``); rank ``r`` gets the best rank-``r``
  approximation of ``M``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.lowrank import (
    _stacked_factors,
    factored_frobenius_norm,
    normalise_weights,
)
from fedlr.linalg.svd import TruncatedSVD, factored_svd

__all__ = [
    "check_hetero_factors",
    "factors_for_rank",
    "flexlora_factors",
    "hetlora_factors",
    "received_gap",
    "stacked_update",
]

_F64 = torch.float64


def check_hetero_factors(
    bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor]
) -> tuple[int, int, list[int]]:
    """``(d_out, d_in, ranks)`` of client factors that may differ in rank.

    Raises
    ------
    ShapeMismatchError
        If the lists differ in length or are empty, a factor is not 2-D,
        ``B_i`` and ``A_i`` disagree on ``r_i``, or the clients disagree on
        ``d_out`` or ``d_in`` (naming the client).
    """
    if len(bs) != len(as_) or not bs:
        raise ShapeMismatchError(
            f"need as many B as A factors, at least one: got {len(bs)} and {len(as_)}"
        )
    d_out, d_in = int(bs[0].shape[0]), int(as_[0].shape[1])
    ranks: list[int] = []
    for i, (b, a) in enumerate(zip(bs, as_, strict=True)):
        if b.ndim != 2 or a.ndim != 2 or b.shape[1] != a.shape[0]:
            raise ShapeMismatchError(
                f"client {i}: B {tuple(b.shape)} and A {tuple(a.shape)} are not "
                "a (d_out, r) and (r, d_in) pair"
            )
        if b.shape[0] != d_out or a.shape[1] != d_in:
            raise ShapeMismatchError(
                f"client {i}: B {tuple(b.shape)}, A {tuple(a.shape)} do not match "
                f"client 0's d_out {d_out}, d_in {d_in}"
            )
        ranks.append(int(b.shape[1]))
    return d_out, d_in, ranks


def stacked_update(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    scalings: Sequence[float],
    weights: Sequence[float] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked float64 factors of ``M = sum_i w_i s_i B_i A_i``.

    Returns
    -------
    left : (d_out, sum r_i) torch.Tensor
        ``[w_1 s_1 B_1, ..., w_k s_k B_k]``.
    right : (sum r_i, d_in) torch.Tensor
        ``[A_1; ...; A_k]``.
    """
    check_hetero_factors(bs, as_)
    if len(scalings) != len(bs):
        raise ShapeMismatchError(f"{len(scalings)} scalings for {len(bs)} clients")
    w = normalise_weights(weights, len(bs))
    coefficients = [float(wi) * float(s) for wi, s in zip(w, scalings, strict=True)]
    return _stacked_factors(bs, as_, coefficients)


def flexlora_factors(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    scalings: Sequence[float],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor, TruncatedSVD]:
    """FlexLoRA: balanced factors of the rank-``rank`` truncated SVD of ``M``.

    Returns
    -------
    b, a : (d_out, rank), (rank, d_in) torch.Tensor, float64
        ``U sqrt(S)`` and ``sqrt(S) V^T``, zero-padded when ``M`` has fewer
        than ``rank`` singular values; their leading ``r`` components are the
        best rank-``r`` approximation of ``M`` for every ``r <= rank``.
    svd : TruncatedSVD
        Every singular value of ``M`` (for the gaps).
    """
    left, right = stacked_update(bs, as_, scalings, weights)
    svd = factored_svd(left, right)
    keep = min(rank, svd.rank)
    root = svd.s[:keep].sqrt()
    b = torch.zeros(left.shape[0], rank, dtype=_F64)
    a = torch.zeros(rank, right.shape[1], dtype=_F64)
    b[:, :keep] = svd.u[:, :keep] * root
    a[:keep] = root[:, None] * svd.vh[:keep]
    return b, a, svd


def hetlora_factors(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    scalings: Sequence[float],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HetLoRA: weighted mean of the zero-padded balanced factors.

    Client ``i``'s ``sqrt(s_i) B_i`` and ``sqrt(s_i) A_i`` (whose product is
    its update) are padded with zero columns / rows to ``rank`` and averaged
    with the weights.

    Raises
    ------
    ShapeMismatchError
        If a client's rank exceeds ``rank``.
    """
    d_out, d_in, ranks = check_hetero_factors(bs, as_)
    if max(ranks) > rank:
        raise ShapeMismatchError(
            f"a client has rank {max(ranks)}, above the global rank {rank}"
        )
    w = normalise_weights(weights, len(bs))
    b = torch.zeros(d_out, rank, dtype=_F64)
    a = torch.zeros(rank, d_in, dtype=_F64)
    for wi, s, bi, ai, r in zip(w, scalings, bs, as_, ranks, strict=True):
        root = math.sqrt(float(s))
        b[:, :r] += float(wi) * root * bi.to(_F64)
        a[:r] += float(wi) * root * ai.to(_F64)
    return b, a


def factors_for_rank(
    b: torch.Tensor, a: torch.Tensor, rank: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's own ``(B, A)`` at ``rank``: ``s B A`` is the leading part.

    ``B = B~[:, :rank] / sqrt(s)``, ``A = A~[:rank] / sqrt(s)`` with the
    client's scaling ``s = alpha / rank``, so that ``s B A = B~_r A~_r``.
    """
    if not 1 <= rank <= b.shape[1]:
        raise ShapeMismatchError(
            f"rank {rank} is outside the global factors' 1 .. {b.shape[1]}"
        )
    root = math.sqrt(float(scaling))
    return b[:, :rank] / root, a[:rank] / root


def received_gap(
    left: torch.Tensor,
    right: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    rank: int,
) -> float:
    """``||M - B~_r A~_r||_F`` with ``M = left @ right`` (stacked factors)."""
    return factored_frobenius_norm(
        torch.cat([left, -b[:, :rank].to(_F64)], dim=1),
        torch.cat([right, a[:rank].to(_F64)], dim=0),
    )
