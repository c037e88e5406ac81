"""Low-rank kernels against their dense float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.errors import ShapeMismatchError
from fedlr.linalg import (
    factored_frobenius_norm,
    fold_residual,
    mean_of_products_factors,
    normalise_weights,
    residual_factors,
    weighted_mean,
)


def _clients(seed: int, k: int, d_out: int, r: int, d_in: int):
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d_out, r, generator=g, dtype=torch.float64) for _ in range(k)]
    as_ = [torch.randn(r, d_in, generator=g, dtype=torch.float64) for _ in range(k)]
    w = (torch.rand(k, generator=g, dtype=torch.float64) + 0.1).tolist()
    return bs, as_, w


def _dense(bs, as_, w):
    w = torch.tensor(w, dtype=torch.float64)
    w = w / w.sum()
    mean_prod = sum(wi * b @ a for wi, b, a in zip(w, bs, as_, strict=True))
    b_bar = sum(wi * b for wi, b in zip(w, bs, strict=True))
    a_bar = sum(wi * a for wi, a in zip(w, as_, strict=True))
    return mean_prod, b_bar, a_bar


shapes = st.tuples(
    st.integers(1, 8),  # clients
    st.integers(1, 24),  # d_out
    st.integers(1, 6),  # rank
    st.integers(1, 24),  # d_in
    st.integers(0, 2**16),  # seed
)


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_stacked_factors_give_weighted_mean_of_products(case):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    left, right = mean_of_products_factors(bs, as_, w)
    assert left.shape == (d_out, k * r) and right.shape == (k * r, d_in)
    dense, _, _ = _dense(bs, as_, w)
    torch.testing.assert_close(left @ right, dense, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_residual_factors_and_norm_match_dense(case):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    dense, b_bar, a_bar = _dense(bs, as_, w)
    left, right = residual_factors(bs, as_, w)
    residual = dense - b_bar @ a_bar
    torch.testing.assert_close(left @ right, residual, rtol=1e-12, atol=1e-12)
    expected = float(torch.linalg.matrix_norm(residual))
    got = factored_frobenius_norm(left, right)
    scale = float(torch.linalg.matrix_norm(dense)) + 1.0
    assert abs(got - expected) <= 1e-10 * scale


@settings(max_examples=40, deadline=None)
@given(shapes, st.floats(0.01, 10.0))
def test_fold_residual_is_exact(case, scaling):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    w0 = torch.randn(d_out, d_in, dtype=torch.float64)
    dense, b_bar, a_bar = _dense(bs, as_, w)
    new = fold_residual(w0, bs, as_, w, scaling)
    torch.testing.assert_close(
        new + scaling * b_bar @ a_bar, w0 + scaling * dense, rtol=1e-12, atol=1e-12
    )
    assert torch.equal(w0, w0.clone())  # input untouched (no in-place fold)


def test_fold_residual_float32_keeps_dtype_and_accuracy():
    bs, as_, w = _clients(3, 5, 64, 4, 48)
    bs32 = [b.float() for b in bs]
    as32 = [a.float() for a in as_]
    w0 = torch.randn(64, 48)
    new = fold_residual(w0, bs32, as32, w, 2.0)
    assert new.dtype == torch.float32
    dense, b_bar, a_bar = _dense(bs, as_, w)
    lhs = new.double() + 2.0 * b_bar @ a_bar
    rhs = w0.double() + 2.0 * dense
    rel = torch.linalg.matrix_norm(lhs - rhs) / torch.linalg.matrix_norm(rhs)
    assert rel < 1e-6


def test_identical_clients_have_zero_gap():
    bs, as_, _ = _clients(1, 1, 30, 4, 20)
    k = 6
    left, right = residual_factors(bs * k, as_ * k, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    ideal = factored_frobenius_norm(*mean_of_products_factors(bs * k, as_ * k, [1] * k))
    assert factored_frobenius_norm(left, right) <= 1e-13 * ideal


def test_differing_clients_have_positive_gap():
    bs, as_, w = _clients(2, 3, 16, 2, 16)
    left, right = residual_factors(bs, as_, w)
    assert factored_frobenius_norm(left, right) > 1e-3


def test_single_client_reduces_to_its_product():
    bs, as_, _ = _clients(5, 1, 10, 3, 7)
    left, right = residual_factors(bs, as_, [5.0])
    assert factored_frobenius_norm(left, right) <= 1e-12


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_weighted_mean_matches_dense(case):
    k, d_out, r, _, seed = case
    bs, _, w = _clients(seed, k, d_out, r, 1)
    _, b_bar, _ = _dense(bs, [torch.zeros(r, 1, dtype=torch.float64)] * k, w)
    torch.testing.assert_close(weighted_mean(bs, w), b_bar, rtol=1e-12, atol=1e-12)


def test_weights_are_normalised_and_validated():
    w = normalise_weights([1, 3], 2)
    assert w.tolist() == [0.25, 0.75]
    with pytest.raises(ShapeMismatchError, match="expected 3 weights, got 2"):
        normalise_weights([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative"):
        normalise_weights([1, -1], 2)
    with pytest.raises(ValueError, match="non-negative"):
        normalise_weights([1, math.nan], 2)
    with pytest.raises(ValueError, match="sum to zero"):
        normalise_weights([0, 0], 2)


def test_shape_errors_name_the_shapes():
    b = torch.zeros(4, 2)
    a = torch.zeros(3, 5)
    with pytest.raises(ShapeMismatchError, match=r"\(4, 2\).*\(3, 5\)"):
        mean_of_products_factors([b], [a], [1.0])
    with pytest.raises(ShapeMismatchError, match=r"B\[1\] has shape \(5, 2\)"):
        mean_of_products_factors([b, torch.zeros(5, 2)], [a.T[:2], a.T[:2]], [1, 1])
    with pytest.raises(ShapeMismatchError, match="base weight has shape"):
        fold_residual(torch.zeros(3, 3), [b], [torch.zeros(2, 5)], [1.0], 1.0)
    with pytest.raises(ShapeMismatchError, match="2 B factors but 1 A"):
        residual_factors([b, b], [torch.zeros(2, 5)], [1, 1])
