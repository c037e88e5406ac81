"""FOT kernels (projection, activations, sketches, energy rule) vs dense formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.fot import (
    ResidualSketch,
    conv_activations,
    dense_activations,
    energy_rank,
    expand_basis,
    orthonormal_extend,
    project_update,
    projection_residual_norm,
    residualise,
    sketch_residual,
    tightened_threshold,
    weighted_residual_fraction,
)

F64 = torch.float64


def _orthonormal(d: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=F64))
    return q


def _subspace_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spectral norm of the difference of the orthogonal projectors."""
    return float(torch.linalg.matrix_norm(a @ a.T - b @ b.T, ord=2))


# ------------------------------------------------------------------ projection
@settings(max_examples=40, deadline=None)
@given(
    out=st.integers(1, 12),
    d=st.integers(2, 20),
    k_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
)
def test_projected_update_has_no_component_in_span(out, d, k_frac, seed):
    k = round(k_frac * d)
    u = _orthonormal(d, k, seed)
    g = torch.randn(
        out, d, generator=torch.Generator().manual_seed(seed + 1), dtype=F64
    )
    p = project_update(g, u)
    assert float(torch.linalg.norm(p @ u)) < 1e-6 * max(1.0, float(g.norm()))
    # dense formula: g (I - U Uᵀ)
    dense = g @ (torch.eye(d, dtype=F64) - u @ u.T)
    torch.testing.assert_close(p, dense, rtol=1e-10, atol=1e-12)
    # idempotent: P² = P
    torch.testing.assert_close(project_update(p, u), p, rtol=1e-10, atol=1e-12)
    assert projection_residual_norm(p, u) < 1e-9 * max(1.0, float(g.norm()))


@settings(max_examples=30, deadline=None)
@given(
    out=st.integers(1, 6),
    c_in=st.integers(1, 4),
    kh=st.integers(1, 3),
    kw=st.integers(1, 3),
    k=st.integers(0, 5),
    seed=st.integers(0, 10_000),
)
def test_conv_update_projected_on_flattened_filters(out, c_in, kh, kw, k, seed):
    d = c_in * kh * kw
    k = min(k, d)
    u = _orthonormal(d, k, seed)
    g = torch.randn(
        out, c_in, kh, kw, generator=torch.Generator().manual_seed(seed), dtype=F64
    )
    p = project_update(g, u)
    assert p.shape == g.shape
    flat = p.reshape(out, d)
    assert float(torch.linalg.norm(flat @ u)) < 1e-10
    dense = g.reshape(out, d) @ (torch.eye(d, dtype=F64) - u @ u.T)
    torch.testing.assert_close(flat, dense)


def test_projection_keeps_float32_dtype_and_no_basis_is_identity():
    g = torch.randn(3, 5)
    assert torch.equal(project_update(g, None), g)
    u = _orthonormal(5, 2, 0)
    p = project_update(g, u)
    assert p.dtype == torch.float32
    assert float(torch.linalg.norm(p.double() @ u)) < 1e-5


def test_projection_rejects_wrong_basis_shape():
    with pytest.raises(ShapeMismatchError, match=r"\(6, k\)"):
        project_update(torch.randn(3, 6), torch.randn(5, 2))


# ------------------------------------------------------------------ activations
@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 3),
    c_in=st.integers(1, 3),
    hw=st.integers(4, 9),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    out=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_conv_as_matmul_identity(n, c_in, hw, k, stride, padding, dilation, out, seed):
    if hw + 2 * padding < dilation * (k - 1) + 1:
        return
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c_in, hw, hw, generator=g, dtype=F64)
    w = torch.randn(out, c_in, k, k, generator=g, dtype=F64)
    a = conv_activations(x, k, stride=stride, padding=padding, dilation=dilation)
    y = F.conv2d(x, w, stride=stride, padding=padding, dilation=dilation)
    assert a.shape == (c_in * k * k, n * y.shape[2] * y.shape[3])
    # W_2 @ A equals the conv output, columns sample-major then positions
    expect = y.reshape(n, out, -1).permute(1, 0, 2).reshape(out, -1)
    torch.testing.assert_close(w.reshape(out, -1) @ a, expect, rtol=1e-10, atol=1e-10)


def test_conv_activations_match_unfold_reference_with_rectangular_kernel():
    x = torch.randn(2, 3, 7, 6, dtype=F64)
    a = conv_activations(x, (3, 2), stride=(2, 1), padding=(1, 0))
    ref = torch.nn.Unfold((3, 2), padding=(1, 0), stride=(2, 1))(x)  # (N, d, L)
    cols = torch.cat([ref[i] for i in range(2)], dim=1)
    torch.testing.assert_close(a, cols)


def test_dense_activations_are_features_by_samples():
    x = torch.arange(12.0).reshape(4, 3)
    torch.testing.assert_close(dense_activations(x), x.T)
    with pytest.raises(ShapeMismatchError):
        dense_activations(torch.ones(3))
    with pytest.raises(ShapeMismatchError):
        conv_activations(torch.ones(3, 4, 4), 2)


# ------------------------------------------------------------ residual, sketch
@settings(max_examples=30, deadline=None)
@given(d=st.integers(2, 16), n=st.integers(1, 20), seed=st.integers(0, 1000))
def test_residual_is_orthogonal_to_basis_and_fraction_matches(d, n, seed):
    k = seed % d
    u = _orthonormal(d, k, seed)
    a = torch.randn(d, n, generator=torch.Generator().manual_seed(seed), dtype=F64)
    r = residualise(a, u)
    torch.testing.assert_close(r, (torch.eye(d, dtype=F64) - u @ u.T) @ a)
    assert float(torch.linalg.norm(u.T @ r)) < 1e-10
    acc = ResidualSketch(basis=u, num_columns=3, generator=torch.Generator())
    half = n // 2
    if half:
        acc.add(a[:, :half])
    acc.add(a[:, half:])
    expect = float(r.square().sum() / a.square().sum())
    assert math.isclose(acc.fraction, expect, rel_tol=1e-10, abs_tol=1e-12)
    assert acc.sketch is not None and acc.sketch.shape == (d, 3)


@settings(max_examples=30, deadline=None)
@given(
    d=st.integers(4, 24),
    rank=st.integers(1, 4),
    clients=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_summed_sketches_span_the_stacked_residuals(d, rank, clients, seed):
    rank = min(rank, d - 1)
    g = torch.Generator().manual_seed(seed)
    basis = _orthonormal(d, 1, seed + 7)
    mix = torch.randn(d, rank, generator=g, dtype=F64)
    residuals = []
    sketch_sum = torch.zeros(d, 2 * rank + 4, dtype=F64)
    for c in range(clients):
        a = mix @ torch.randn(rank, 10 + c, generator=g, dtype=F64)
        r = residualise(a, basis)
        residuals.append(r)
        client_g = torch.Generator().manual_seed(1000 * seed + c)
        sketch_sum += sketch_residual(r, sketch_sum.shape[1], client_g)
    stacked = torch.cat(residuals, dim=1)
    u_ref, s_ref, _ = torch.linalg.svd(stacked, full_matrices=False)
    true_rank = int((s_ref > 1e-9 * s_ref[0]).sum())
    u_sk, s_sk, _ = torch.linalg.svd(sketch_sum, full_matrices=False)
    assert int((s_sk > 1e-9 * s_sk[0]).sum()) == true_rank
    dist = _subspace_distance(u_ref[:, :true_rank], u_sk[:, :true_rank])
    assert dist < 1e-8


def test_sketch_energy_estimates_residual_energy_with_wide_sketch():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(8, 50, generator=g, dtype=F64)
    y = sketch_residual(r, 4000, torch.Generator().manual_seed(1))
    assert math.isclose(float(y.square().sum()), float(r.square().sum()), rel_tol=0.05)


# ------------------------------------------------------------------ energy rule
@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(2, 30),
    planted=st.integers(1, 29),
    threshold=st.floats(0.05, 0.999),
)
def test_energy_rank_picks_planted_k(p, planted, threshold):
    planted = min(planted, p - 1)
    # planted spectrum: the first `planted` values carry exactly `threshold`
    # of the energy, the rest the remainder
    head = torch.full((planted,), math.sqrt(threshold / planted), dtype=F64)
    tail_each = (1.0 - threshold) / (p - planted)
    tail = torch.full((p - planted,), math.sqrt(tail_each), dtype=F64)
    s = torch.cat([head, tail])
    if tail_each > threshold / planted:
        return  # not sorted; the rule assumes non-increasing values
    assert energy_rank(s, threshold) == planted
    # a slightly larger target needs at least one more direction
    if threshold + 1e-6 < 1.0:
        assert energy_rank(s, threshold + 1e-6) == planted + 1


def test_energy_rank_edge_cases():
    s = torch.tensor([3.0, 2.0, 1.0])
    assert energy_rank(s, 0.0) == 0
    assert energy_rank(s, -1.0) == 0
    assert energy_rank(s, 1.0) == 3
    assert energy_rank(torch.zeros(3), 0.5) == 0
    assert energy_rank(s, 9 / 14) == 1


def test_tightened_threshold_is_gpm_criterion():
    # ||A||² = 10, ||R||² = 4 (r = 0.4), eps = 0.9: GPM wants
    # (10 - 4 + e_k) / 10 >= 0.9  <=>  e_k >= 3, i.e. e_k / 4 >= 0.75
    assert math.isclose(tightened_threshold(0.4, 0.9), 0.75)
    assert tightened_threshold(0.05, 0.9) < 0  # span(U) already holds 95 %
    assert tightened_threshold(0.0, 0.9) == float("-inf")
    with pytest.raises(ValueError, match="energy threshold"):
        tightened_threshold(0.5, 1.5)
    assert math.isclose(weighted_residual_fraction([0.2, 0.6], [1, 3]), 0.5)
    with pytest.raises(ShapeMismatchError):
        weighted_residual_fraction([0.2], [1, 2])


# ------------------------------------------------------------------ expansion
@settings(max_examples=30, deadline=None)
@given(
    d=st.integers(3, 20),
    k_old=st.integers(0, 6),
    new=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_bases_stay_orthonormal_after_expansion(d, k_old, new, seed):
    k_old = min(k_old, d - 1)
    new = min(new, d - k_old)
    old = _orthonormal(d, k_old, seed) if k_old else None
    dirs = torch.randn(d, new, generator=torch.Generator().manual_seed(seed), dtype=F64)
    if old is not None:
        dirs = residualise(dirs, old)
    u = orthonormal_extend(old, dirs)
    assert u.shape == (d, k_old + new)
    torch.testing.assert_close(u.T @ u, torch.eye(k_old + new, dtype=F64))
    if old is not None:
        torch.testing.assert_close(u[:, :k_old], old)


def test_expand_basis_adds_planted_directions_and_respects_threshold():
    d = 12
    g = torch.Generator().manual_seed(3)
    old = _orthonormal(d, 2, 1)
    planted = residualise(torch.randn(d, 3, generator=g, dtype=F64), old)
    planted, _ = torch.linalg.qr(planted)
    # a residual of exact rank 3 with energies 9, 4, 1
    residual = planted @ torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=F64))
    residual = (
        residual @ torch.linalg.qr(torch.randn(40, 3, generator=g, dtype=F64))[0].T
    )
    y = sketch_residual(residual, 10, torch.Generator().manual_seed(0))
    # r = 1 (nothing explained before), eps = 1: every planted direction
    u, k = expand_basis(old, y, 1.0, 1.0)
    assert k == 3 and u is not None
    torch.testing.assert_close(u.T @ u, torch.eye(5, dtype=F64))
    assert _subspace_distance(u[:, 2:], planted) < 1e-8
    # ε' <= 0: nothing to add, the basis is returned unchanged
    same, k0 = expand_basis(old, y, 0.05, 0.9)
    assert k0 == 0 and same is old
    # capped by the room left in dimension d
    full, k_full = expand_basis(
        _orthonormal(d, d - 1, 2), torch.randn(d, 5, dtype=F64), 1.0, 1.0
    )
    assert k_full == 1 and full is not None and full.shape == (d, d)


def test_expand_basis_rejects_mismatched_basis():
    with pytest.raises(ShapeMismatchError):
        expand_basis(torch.zeros(5, 1), torch.zeros(6, 3), 0.5, 0.9)
