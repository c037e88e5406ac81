"""Heterogeneous-rank kernels (fedlr.linalg.hetero) against dense float64.

Every client of rank ``r`` receives ``s_r B_r A_r``; each method states its
target: FlexLoRA the best rank-``r`` approximation of
``M = sum_i w_i s_i B_i A_i``, HetLoRA the leading ``r`` components of the
mean of the zero-padded balanced factors, FLoRA ``M`` itself in ``W0``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.adapters.ranks import leading_rank
from fedlr.adapters.roles import AdapterLayout, LoraModule
from fedlr.errors import ShapeMismatchError
from fedlr.linalg import (
    check_hetero_factors,
    factors_for_rank,
    flexlora_factors,
    hetlora_factors,
    received_gap,
    stacked_update,
)

F64 = torch.float64
ALPHA = 16.0
TOL = 1e-10


def _clients(ranks, d_out, d_in, seed):
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d_out, r, generator=g, dtype=F64) for r in ranks]
    as_ = [torch.randn(r, d_in, generator=g, dtype=F64) for r in ranks]
    w = torch.rand(len(ranks), generator=g, dtype=F64) + 0.1
    return bs, as_, w, [ALPHA / r for r in ranks]


def _dense_m(bs, as_, w, scalings):
    w = w / w.sum()
    return sum(wi * s * b @ a for wi, s, b, a in zip(w, scalings, bs, as_, strict=True))


def _rel(x, y):
    return float(torch.linalg.matrix_norm(x - y) / torch.linalg.matrix_norm(y))


CASES = [
    ((2, 4, 8, 16), 48, 40, 0),
    ((16, 2), 32, 64, 1),
    ((4,), 20, 24, 2),
    ((1, 3, 5, 7, 9), 40, 30, 3),
]


@pytest.mark.parametrize(("ranks", "d_out", "d_in", "seed"), CASES)
def test_flexlora_each_rank_receives_its_best_approximation(ranks, d_out, d_in, seed):
    bs, as_, w, s = _clients(ranks, d_out, d_in, seed)
    big = max(ranks)
    b_t, a_t, svd = flexlora_factors(bs, as_, s, w, big)
    m = _dense_m(bs, as_, w, s)
    u, sigma, vh = torch.linalg.svd(m)
    for r in sorted(set(ranks)):
        b, a = factors_for_rank(b_t, a_t, r, ALPHA / r)
        received = (ALPHA / r) * b @ a
        target = (u[:, :r] * sigma[:r]) @ vh[:r]
        assert float(torch.linalg.matrix_norm(received - target)) <= TOL * float(
            torch.linalg.matrix_norm(target)
        )
        gap = math.sqrt(float((sigma[r:] ** 2).sum()))
        assert math.sqrt(svd.energy_beyond(r)) == pytest.approx(gap, rel=1e-9, abs=TOL)
        assert received_gap(*stacked_update(bs, as_, s, w), b_t, a_t, r) == (
            pytest.approx(gap, rel=1e-8, abs=1e-9)
        )


@pytest.mark.parametrize(("ranks", "d_out", "d_in", "seed"), CASES)
def test_hetlora_each_rank_receives_the_leading_padded_mean(ranks, d_out, d_in, seed):
    bs, as_, w, s = _clients(ranks, d_out, d_in, seed)
    big = max(ranks)
    b_t, a_t = hetlora_factors(bs, as_, s, w, big)
    wn = w / w.sum()
    # Dense reference: pad sqrt(s_i) B_i, sqrt(s_i) A_i to `big`, average.
    pad_b = torch.zeros(d_out, big, dtype=F64)
    pad_a = torch.zeros(big, d_in, dtype=F64)
    for wi, si, b, a in zip(wn, s, bs, as_, strict=True):
        pad_b += wi * math.sqrt(si) * torch.nn.functional.pad(b, (0, big - b.shape[1]))
        pad_a += (
            wi * math.sqrt(si) * torch.nn.functional.pad(a, (0, 0, 0, big - a.shape[0]))
        )
    m = _dense_m(bs, as_, w, s)
    for r in sorted(set(ranks)):
        b, a = factors_for_rank(b_t, a_t, r, ALPHA / r)
        received = (ALPHA / r) * b @ a
        target = pad_b[:, :r] @ pad_a[:r]
        assert _rel(received, target) <= TOL
        gap = float(torch.linalg.matrix_norm(m - target))
        assert received_gap(*stacked_update(bs, as_, s, w), b_t, a_t, r) == (
            pytest.approx(gap, rel=1e-8)
        )


@pytest.mark.parametrize(("ranks", "d_out", "d_in", "seed"), CASES)
def test_flora_stacks_the_exact_sum(ranks, d_out, d_in, seed):
    bs, as_, w, s = _clients(ranks, d_out, d_in, seed)
    left, right = stacked_update(bs, as_, s, w)
    assert left.shape == (d_out, sum(ranks)) and right.shape == (sum(ranks), d_in)
    assert _rel(left @ right, _dense_m(bs, as_, w, s)) <= TOL


@settings(max_examples=25, deadline=None)
@given(
    ranks=st.lists(st.integers(1, 8), min_size=1, max_size=5),
    d_out=st.integers(8, 24),
    d_in=st.integers(8, 24),
    seed=st.integers(0, 2**16),
)
def test_flexlora_property_over_shapes_ranks_and_clients(ranks, d_out, d_in, seed):
    bs, as_, w, s = _clients(ranks, d_out, d_in, seed)
    b_t, a_t, _ = flexlora_factors(bs, as_, s, w, max(ranks))
    m = _dense_m(bs, as_, w, s)
    u, sigma, vh = torch.linalg.svd(m)
    scale = float(torch.linalg.matrix_norm(m))
    for r in set(ranks):
        b, a = factors_for_rank(b_t, a_t, r, ALPHA / r)
        target = (u[:, :r] * sigma[:r]) @ vh[:r]
        # Ties in the spectrum make the rank-r target ambiguous: compare the
        # error's size, which is unique.
        err = float(torch.linalg.matrix_norm(m - (ALPHA / r) * b @ a))
        assert err == pytest.approx(
            float(torch.linalg.matrix_norm(m - target)), abs=TOL * scale
        )


def test_client_side_truncation_is_the_servers():
    """``apply_round``'s cut of rank-R arrays equals ``factors_for_rank``."""
    bs, as_, w, s = _clients((2, 4, 8), 12, 10, 5)
    b_t, a_t, _ = flexlora_factors(bs, as_, s, w, 8)
    b8, a8 = factors_for_rank(b_t, a_t, 8, ALPHA / 8)
    for r in (2, 4):
        layout = AdapterLayout(
            modules=(LoraModule("l", "l.A", "l.B", "l.W", ALPHA / r, 12, 10, r),)
        )
        cut = leading_rank(layout, {"l.A": a8, "l.B": b8})
        b, a = factors_for_rank(b_t, a_t, r, ALPHA / r)
        torch.testing.assert_close(cut["l.B"], b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cut["l.A"], a, rtol=1e-12, atol=1e-12)


def test_shapes_are_checked():
    with pytest.raises(ShapeMismatchError, match="client 1"):
        check_hetero_factors(
            [torch.zeros(6, 2), torch.zeros(5, 4)],
            [torch.zeros(2, 3), torch.zeros(4, 3)],
        )
    with pytest.raises(ShapeMismatchError, match="client 0"):
        check_hetero_factors([torch.zeros(6, 2)], [torch.zeros(3, 3)])
    with pytest.raises(ShapeMismatchError, match="above the global rank 2"):
        hetlora_factors([torch.zeros(6, 4)], [torch.zeros(4, 3)], [1.0], [1.0], 2)
    with pytest.raises(ShapeMismatchError, match="outside"):
        factors_for_rank(torch.zeros(6, 4), torch.zeros(4, 3), 5, 1.0)
