"""StackedResidual: one construction for FedEx's gap and fold, against dense float64."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.errors import ShapeMismatchError
from fedlr.linalg import (
    StackedResidual,
    fold_residual,
    mean_of_products_factors,
    residual_factors,
    stacked_residual,
)

F64 = torch.float64
EPS = torch.finfo(F64).eps


def _clients(
    seed: int, k: int, d_out: int, r: int, d_in: int, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d_out, r, generator=g, dtype=F64).to(dtype) for _ in range(k)]
    as_ = [torch.randn(r, d_in, generator=g, dtype=F64).to(dtype) for _ in range(k)]
    w = (torch.rand(k, generator=g, dtype=F64) + 0.1).tolist()
    return bs, as_, w


def _dense(
    bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor], w: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, M - B_bar A_bar)`` as dense float64 matrices."""
    wt = torch.tensor(w, dtype=F64)
    wt = wt / wt.sum()
    bs64, as64 = [b.double() for b in bs], [a.double() for a in as_]
    mean_prod = torch.stack(
        [wi * b @ a for wi, b, a in zip(wt, bs64, as64, strict=True)]
    ).sum(0)
    b_bar = torch.einsum("k,kij->ij", wt, torch.stack(bs64))
    a_bar = torch.einsum("k,kij->ij", wt, torch.stack(as64))
    return mean_prod, mean_prod - b_bar @ a_bar


SHAPES = st.tuples(
    st.integers(1, 6),  # clients
    st.integers(1, 20),  # d_out
    st.integers(1, 5),  # rank
    st.integers(1, 20),  # d_in
    st.integers(0, 2**16),  # seed
)


@settings(max_examples=40, deadline=None)
@given(shape=SHAPES, dtype=st.sampled_from([torch.float32, torch.float64]))
def test_stacked_residual_products_and_norms_match_dense(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype
) -> None:
    k, d_out, r, d_in, seed = shape
    bs, as_, w = _clients(seed, k, d_out, r, d_in, dtype)
    res = stacked_residual(bs, as_, w)
    mean_prod, residual = _dense(bs, as_, w)
    assert isinstance(res, StackedResidual)
    assert res.left.shape == (d_out, (k + 1) * r) and res.right.shape[0] == (k + 1) * r
    assert res.left.dtype == F64 and res.rank == r and res.work_dtype == dtype
    scale = max(float(mean_prod.abs().max()), 1.0)
    tol = 20 * EPS * max(d_out, d_in, k * r) * scale
    torch.testing.assert_close(res.left @ res.right, residual, rtol=0, atol=tol)
    left_m, right_m = res.mean_of_products
    torch.testing.assert_close(left_m @ right_m, mean_prod, rtol=0, atol=tol)
    gap, norm = res.norms()
    assert gap == pytest.approx(
        float(torch.linalg.matrix_norm(residual)), abs=tol * d_in
    )
    assert norm == pytest.approx(
        float(torch.linalg.matrix_norm(mean_prod)), abs=tol * d_in
    )


@settings(max_examples=30, deadline=None)
@given(shape=SHAPES)
def test_stacked_residual_is_the_old_pair_of_factors_bit_for_bit(
    shape: tuple[int, int, int, int, int],
) -> None:
    """residual_factors, mean_of_products_factors and fold_residual share it."""
    k, d_out, r, d_in, seed = shape
    bs, as_, w = _clients(seed, k, d_out, r, d_in, torch.float32)
    res = stacked_residual(bs, as_, w)
    left, right = residual_factors(bs, as_, w)
    assert torch.equal(res.left, left) and torch.equal(res.right, right)
    left_m, right_m = mean_of_products_factors(bs, as_, w)
    assert torch.equal(res.mean_of_products[0], left_m)
    assert torch.equal(res.mean_of_products[1], right_m)
    base = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(res.fold(base, 0.5), fold_residual(base, bs, as_, w, 0.5))


@settings(max_examples=30, deadline=None)
@given(
    shape=SHAPES,
    base_dtype=st.sampled_from([torch.float32, torch.float64]),
    factor_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_fold_is_exact_and_keeps_the_base_dtype(
    shape: tuple[int, int, int, int, int],
    base_dtype: torch.dtype,
    factor_dtype: torch.dtype,
) -> None:
    k, d_out, r, d_in, seed = shape
    bs, as_, w = _clients(seed, k, d_out, r, d_in, factor_dtype)
    base = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(seed + 1))
    base = base.to(base_dtype)
    folded = stacked_residual(bs, as_, w).fold(base, 2.0)
    _, residual = _dense(bs, as_, w)
    assert folded.dtype == base_dtype
    # the GEMM's dtype (float64 if any input is), then the cast back to the base's
    work = F64 if F64 in (base_dtype, factor_dtype) else torch.float32
    eps = max(torch.finfo(work).eps, torch.finfo(base_dtype).eps)
    scale = max(float(residual.abs().max()) * 2, float(base.abs().max()), 1.0)
    tol = 20 * eps * max(d_out, d_in, (k + 1) * r) * scale
    want = base.double() + 2.0 * residual
    torch.testing.assert_close(folded.double(), want, rtol=0, atol=tol)


def test_agreeing_clients_have_no_residual() -> None:
    bs, as_, _ = _clients(3, 1, 7, 2, 5, F64)
    res = stacked_residual(bs * 3, as_ * 3, [1.0, 2.0, 3.0])
    gap, norm = res.norms()
    assert gap <= 20 * EPS * 7 * norm
    assert norm == pytest.approx(float(torch.linalg.matrix_norm(bs[0] @ as_[0])))


def test_fold_rejects_a_base_of_another_shape() -> None:
    bs, as_, w = _clients(0, 2, 4, 2, 3, F64)
    with pytest.raises(ShapeMismatchError, match=r"factors give \(4, 3\)"):
        stacked_residual(bs, as_, w).fold(torch.zeros(3, 4), 1.0)
