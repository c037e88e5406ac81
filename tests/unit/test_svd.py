"""Factored truncated SVD against the dense float64 SVD of the mean of products."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.errors import ShapeMismatchError
from fedlr.linalg import factored_svd, fix_signs, truncated_svd_of_mean
from tests.unit.test_lowrank import _clients, _dense

cases = st.tuples(
    st.integers(1, 8),  # clients
    st.integers(1, 24),  # d_out
    st.integers(1, 6),  # client rank
    st.integers(1, 24),  # d_in
    st.integers(1, 10),  # kept rank
    st.integers(0, 2**16),  # seed
)


@settings(max_examples=60, deadline=None)
@given(cases)
def test_eckart_young_error_equals_discarded_energy(case):
    k, d_out, r, d_in, keep, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    dense, _, _ = _dense(bs, as_, w)
    svd = truncated_svd_of_mean(bs, as_, w, rank=keep)
    sigma = torch.linalg.svdvals(dense)
    kept = min(keep, k * r, d_out, d_in)
    assert svd.rank == kept
    scale = float(sigma[0]) if sigma.numel() else 1.0
    torch.testing.assert_close(svd.s, sigma[:kept], rtol=1e-10, atol=1e-10 * scale)
    error = float(torch.linalg.matrix_norm(dense - svd.dense()))
    expected = math.sqrt(float((sigma[kept:] ** 2).sum()))
    assert abs(error - expected) <= 1e-10 * scale
    assert abs(math.sqrt(svd.tail_energy) - expected) <= 1e-10 * scale
    assert abs(svd.total_energy - float((sigma**2).sum())) <= 1e-10 * scale**2
    eye = torch.eye(kept, dtype=torch.float64)
    torch.testing.assert_close(svd.u.T @ svd.u, eye, rtol=0, atol=1e-10)
    torch.testing.assert_close(svd.vh @ svd.vh.T, eye, rtol=0, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(cases)
def test_exact_when_the_mean_has_rank_at_most_r(case):
    k, d_out, r, d_in, _, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    dense, _, _ = _dense(bs, as_, w)
    svd = truncated_svd_of_mean(bs, as_, w, rank=k * r)
    scale = float(torch.linalg.matrix_norm(dense)) + 1.0
    torch.testing.assert_close(svd.dense(), dense, rtol=0, atol=1e-10 * scale)
    assert svd.tail_energy <= 1e-20 * scale**2
    b, a = svd.split_sqrt()
    torch.testing.assert_close(b @ a, dense, rtol=0, atol=1e-10 * scale)


def test_signs_are_deterministic_and_peak_positive():
    bs, as_, w = _clients(11, 4, 40, 3, 30)
    one = truncated_svd_of_mean(bs, as_, w, rank=5)
    # Reversed client order: a different QR, the same signed singular vectors.
    two = truncated_svd_of_mean(bs[::-1], as_[::-1], w[::-1], rank=5)
    torch.testing.assert_close(one.u, two.u, rtol=0, atol=1e-10)
    torch.testing.assert_close(one.vh, two.vh, rtol=0, atol=1e-10)
    peaks = one.u.gather(0, one.u.abs().argmax(0)[None])
    assert bool((peaks > 0).all())


def test_fix_signs_keeps_the_product():
    u = torch.tensor([[1.0, -3.0], [-2.0, 1.0]], dtype=torch.float64)
    vh = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    u2, vh2 = fix_signs(u, vh)
    torch.testing.assert_close(u2 @ vh2, u @ vh)
    assert u2[:, 0].tolist() == [-1.0, 2.0] and u2[:, 1].tolist() == [3.0, -1.0]


def test_float32_inputs_give_float32_factors_accurately():
    bs, as_, w = _clients(3, 10, 256, 8, 192)
    left = torch.cat([wi * b for wi, b in zip(w, bs, strict=True)], 1) / sum(w)
    right = torch.cat(as_, 0)
    svd32 = factored_svd(left.float(), right.float(), rank=8)
    svd64 = factored_svd(left, right, rank=8)
    assert svd32.u.dtype == torch.float32
    rel = torch.linalg.matrix_norm(svd32.dense().double() - svd64.dense())
    assert float(rel / torch.linalg.matrix_norm(svd64.dense())) < 1e-5


def test_bad_shapes_and_rank_are_named():
    with pytest.raises(ShapeMismatchError, match=r"left \(4, 3\) by right \(2, 5\)"):
        factored_svd(torch.zeros(4, 3), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        factored_svd(torch.zeros(4, 3), torch.zeros(3, 5), rank=0)
    with pytest.raises(ShapeMismatchError, match="disagree on r"):
        truncated_svd_of_mean([torch.zeros(4, 2)], [torch.zeros(3, 5)], [1.0])
