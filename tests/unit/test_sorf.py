"""SORF-VeRA kernels against dense float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.sorf import (
    build_lambda_d_rot,
    decompose_orthogonal,
    fit_b,
    fit_d,
    fwht,
    gamma_apply,
    gamma_apply_t,
    givens_pair_indices,
    givens_plan,
    next_power_of_two,
    sorf_apply,
    sorf_apply_t,
    sorf_signs,
)

F64 = torch.float64


def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix divided by sqrt(n) (dense reference)."""
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def dense_sorf_full(signs) -> torch.Tensor:
    h = hadamard(signs.n)
    d1, d2, d3 = (torch.diag(v.to(F64)) for v in (signs.d1, signs.d2, signs.d3))
    return d1 @ h @ d2 @ h @ d3


def dense_gamma(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    m = a.numel()
    g = torch.zeros(2 * m, 2 * m, dtype=a.dtype)
    for j in range(m):
        g[2 * j, 2 * j], g[2 * j, 2 * j + 1] = a[j], -c[j]
        g[2 * j + 1, 2 * j], g[2 * j + 1, 2 * j + 1] = c[j], a[j]
    return g


def random_orthogonal(r: int, seed: int, det: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(r, r, generator=gen, dtype=F64))
    if torch.linalg.det(q) * det < 0:
        q[:, 0] = -q[:, 0]
    return q


@given(log_n=st.integers(0, 9), batch=st.integers(1, 4), seed=st.integers(0, 99))
@settings(max_examples=40, deadline=None)
def test_fwht_equals_dense_hadamard(log_n, batch, seed):
    n = 2**log_n
    x = torch.randn(batch, n, generator=torch.Generator().manual_seed(seed), dtype=F64)
    expected = x @ hadamard(n).T
    assert torch.allclose(fwht(x), expected, atol=1e-12 * n)


def test_hadamard_is_orthogonal_and_fwht_is_involution():
    n = 64
    h = fwht(torch.eye(n, dtype=F64))
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=F64), atol=1e-13)
    x = torch.randn(3, n, dtype=F64)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-13)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ShapeMismatchError, match="power-of-two"):
        fwht(torch.zeros(3, 6))


@pytest.mark.parametrize(("d", "n"), [(1, 1), (2, 2), (3, 4), (384, 512), (768, 1024)])
def test_next_power_of_two(d, n):
    assert next_power_of_two(d) == n


def test_untruncated_sorf_is_orthogonal():
    signs = sorf_signs(128, seed=5, dtype=F64)
    s = signs.dense()
    assert torch.allclose(s @ s.T, torch.eye(128, dtype=F64), atol=1e-12)
    assert torch.allclose(s, dense_sorf_full(signs), atol=1e-12)


@given(d=st.integers(1, 300), seed=st.integers(0, 999), batch=st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_truncated_sorf_apply_equals_dense_block(d, seed, batch):
    signs = sorf_signs(d, seed=seed, dtype=F64)
    full = dense_sorf_full(signs)[:d, :d]
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(seed), dtype=F64)
    assert torch.allclose(sorf_apply(signs, x), x @ full.T, atol=1e-12)
    assert torch.allclose(sorf_apply_t(signs, x), x @ full, atol=1e-12)


def test_truncated_sorf_is_singular_for_768():
    s = sorf_signs(768, seed=0, dtype=F64).dense()
    rank = int(torch.linalg.matrix_rank(s))
    assert 600 < rank < 768


def test_sorf_signs_are_seeded():
    a, b, c = sorf_signs(40, 1), sorf_signs(40, 1), sorf_signs(40, 2)
    assert torch.equal(a.d1, b.d1) and torch.equal(a.d3, b.d3)
    assert not torch.equal(a.d1, c.d1)
    assert set(a.d2.unique().tolist()) <= {-1.0, 1.0}


@given(m=st.integers(1, 40), seed=st.integers(0, 999))
@settings(max_examples=40, deadline=None)
def test_gamma_slicing_equals_block_diagonal(m, seed):
    gen = torch.Generator().manual_seed(seed)
    a, c = (
        torch.randn(m, generator=gen, dtype=F64),
        torch.randn(m, generator=gen, dtype=F64),
    )
    x = torch.randn(3, 2 * m, generator=gen, dtype=F64)
    g = dense_gamma(a, c)
    assert torch.allclose(gamma_apply(a, c, x), x @ g.T, atol=1e-13)
    assert torch.allclose(gamma_apply_t(a, c, x), x @ g, atol=1e-13)


def test_gamma_block_is_rotation_scaling():
    a, c = torch.tensor([3.0], dtype=F64), torch.tensor([4.0], dtype=F64)
    g = dense_gamma(a, c)
    assert torch.allclose(g.T @ g, 25.0 * torch.eye(2, dtype=F64))
    with pytest.raises(ShapeMismatchError):
        gamma_apply(a, c, torch.zeros(3))


@pytest.mark.parametrize("r", [1, 2, 3, 5, 12, 16])
def test_givens_plan_planes_and_stages(r):
    plan = givens_plan(r)
    p, q = givens_pair_indices(r)
    assert p.numel() == r * (r - 1) // 2
    assert bool((q == p + 1).all())
    assert plan.stages == max(2 * r - 3, 0)
    # numbered stage by stage; one stage touches each coordinate at most once
    assert bool((plan.stage[1:] >= plan.stage[:-1]).all())
    for t in range(plan.stages):
        k = plan.stage == t
        touched = torch.cat([p[k], q[k]])
        assert touched.numel() == touched.unique().numel() > 0
    # every entry below the diagonal is eliminated exactly once
    eliminated = set(zip(q.tolist(), plan.col.tolist(), strict=True))
    assert eliminated == {(i, j) for j in range(r) for i in range(j + 1, r)}


def sequential_givens(scale, angles, r):
    """``m R_1 R_2 ... R_N`` one dense rotation at a time (the reference)."""
    g = torch.eye(r, dtype=angles.dtype)
    p, q = givens_pair_indices(r)
    for k, (i, j) in enumerate(zip(p.tolist(), q.tolist(), strict=True)):
        rot = torch.eye(r, dtype=angles.dtype)
        c, s = torch.cos(angles[k]), torch.sin(angles[k])
        rot[i, i] = rot[j, j] = c
        rot[i, j], rot[j, i] = -s, s
        g = g @ rot
    return scale * g


@given(r=st.integers(1, 12), seed=st.integers(0, 999))
@settings(max_examples=30, deadline=None)
def test_batched_build_equals_sequential_product(r, seed):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.randn(r * (r - 1) // 2, generator=gen, dtype=F64) * 3
    scale = torch.tensor(1.3, dtype=F64)
    assert torch.allclose(
        build_lambda_d_rot(scale, angles, r),
        sequential_givens(scale, angles, r),
        atol=1e-12,
    )


@given(r=st.integers(1, 14), seed=st.integers(0, 999), det=st.sampled_from([1.0, -1.0]))
@settings(max_examples=50, deadline=None)
def test_givens_round_trip(r, seed, det):
    if r == 1 and det < 0:
        o = -torch.ones(1, 1, dtype=F64)
    else:
        o = random_orthogonal(r, seed, det)
    angles, signs = decompose_orthogonal(o)
    assert angles.shape == (r * (r - 1) // 2,)
    assert torch.equal(signs[:-1], torch.ones(r - 1, dtype=F64))
    assert float(signs[-1]) == pytest.approx(float(torch.linalg.det(o)))
    rebuilt = build_lambda_d_rot(torch.tensor(1.0, dtype=F64), angles, r) * signs
    assert torch.allclose(rebuilt, o, atol=1e-10)


def test_build_is_scaled_rotation_and_differentiable():
    r = 6
    angles = torch.randn(15, dtype=F64, requires_grad=True)
    scale = torch.tensor(0.7, dtype=F64, requires_grad=True)
    lam = build_lambda_d_rot(scale, angles, r)
    assert torch.allclose(lam @ lam.T, 0.49 * torch.eye(r, dtype=F64), atol=1e-12)
    assert float(torch.linalg.det(lam.detach() / 0.7)) == pytest.approx(1.0)
    lam.sum().backward()
    assert angles.grad is not None and scale.grad is not None
    assert float(angles.grad.abs().sum()) > 0
    with pytest.raises(ShapeMismatchError, match="Givens angles"):
        build_lambda_d_rot(scale, angles, 5)


def dense_fitted(signs, a, c, b):
    s = dense_sorf_full(signs)[: signs.d, : signs.d]
    return s @ dense_gamma(a, c) @ b


@pytest.mark.parametrize(("d", "r"), [(64, 8), (32, 3), (768, 16), (96, 4)])
def test_fit_b_recovers_a_planted_b(d, r):
    gen = torch.Generator().manual_seed(d + r)
    signs = sorf_signs(d, seed=11, dtype=F64)
    b = torch.randn(d, r, generator=gen, dtype=F64)
    a_true = torch.randn(d // 2, generator=gen, dtype=F64)
    c_true = torch.randn(d // 2, generator=gen, dtype=F64)
    target = dense_fitted(signs, a_true, c_true, b)
    fit = fit_b(signs, b, target)
    assert fit.residual < 1e-10
    assert torch.allclose(fit.b_real, a_true, atol=1e-9)
    assert torch.allclose(fit.b_imag, c_true, atol=1e-9)


@given(log_d=st.sampled_from([3, 4, 5]), r=st.integers(1, 6), seed=st.integers(0, 99))
@settings(max_examples=30, deadline=None)
def test_fit_b_equals_blockwise_solve_when_s_is_orthogonal(log_d, r, seed):
    """d a power of two: S is orthogonal, the fit is the per-block 2x2 LS on S^T T."""
    d = 2**log_d
    gen = torch.Generator().manual_seed(seed)
    signs = sorf_signs(d, seed=seed, dtype=F64)
    b = torch.randn(d, r, generator=gen, dtype=F64)
    target = torch.randn(d, r, generator=gen, dtype=F64)
    fit = fit_b(signs, b, target)
    t = dense_sorf_full(signs).T @ target  # S^{-1} T
    for j in range(d // 2):
        b0, b1 = b[2 * j], b[2 * j + 1]
        lhs = torch.cat([torch.stack([b0, -b1], 1), torch.stack([b1, b0], 1)], 0)
        rhs = torch.cat([t[2 * j], t[2 * j + 1]])
        sol = torch.linalg.lstsq(lhs, rhs.unsqueeze(1)).solution.squeeze(1)
        assert torch.allclose(
            torch.stack([fit.b_real[j], fit.b_imag[j]]), sol, atol=1e-8
        )


def test_fit_b_is_least_squares_optimal_when_singular():
    """Perturbing the fit never lowers the residual (d=96, singular S)."""
    d, r = 96, 5
    gen = torch.Generator().manual_seed(3)
    signs = sorf_signs(d, seed=2, dtype=F64)
    b = torch.randn(d, r, generator=gen, dtype=F64)
    target = torch.randn(d, r, generator=gen, dtype=F64)
    fit = fit_b(signs, b, target)
    best = torch.linalg.matrix_norm(
        dense_fitted(signs, fit.b_real, fit.b_imag, b) - target
    )
    assert float(best) / float(torch.linalg.matrix_norm(target)) == pytest.approx(
        fit.residual
    )
    for _ in range(5):
        da = 1e-3 * torch.randn(d // 2, generator=gen, dtype=F64)
        dc = 1e-3 * torch.randn(d // 2, generator=gen, dtype=F64)
        worse = dense_fitted(signs, fit.b_real + da, fit.b_imag + dc, b) - target
        assert float(torch.linalg.matrix_norm(worse)) >= float(best) - 1e-12


def test_fit_b_rejects_bad_shapes():
    signs = sorf_signs(10, seed=0)
    with pytest.raises(ShapeMismatchError):
        fit_b(signs, torch.zeros(10, 3), torch.zeros(10, 4))
    with pytest.raises(ShapeMismatchError, match="even"):
        fit_b(sorf_signs(9, seed=0), torch.zeros(9, 3), torch.zeros(9, 3))


@pytest.mark.parametrize(
    ("r", "d_in", "det"),
    [(4, 20, 1.0), (4, 20, -1.0), (8, 32, 1.0), (8, 32, -1.0), (1, 5, 1.0)],
)
def test_fit_d_recovers_planted_scale_and_rotation(r, d_in, det):
    gen = torch.Generator().manual_seed(r * 7 + d_in)
    # A with orthonormal rows: Lambda_target is exactly m O.
    a = torch.linalg.qr(torch.randn(d_in, r, generator=gen, dtype=F64)).Q.T
    o = random_orthogonal(r, seed=r, det=det)
    scale = 0.37
    vh = scale * o @ a
    fit = fit_d(a, vh)
    assert float(fit.scale) == pytest.approx(scale, abs=1e-12)
    rebuilt = build_lambda_d_rot(fit.scale, fit.angles, r) * fit.signs
    assert torch.allclose(rebuilt, scale * o, atol=1e-10)
    assert fit.residual < 1e-10
    assert float(fit.signs.prod()) == pytest.approx(det)


def test_fit_d_residual_matches_dense():
    gen = torch.Generator().manual_seed(0)
    r, d_in = 6, 30
    a = torch.randn(r, d_in, generator=gen, dtype=F64)
    vh = torch.linalg.qr(torch.randn(d_in, r, generator=gen, dtype=F64)).Q.T
    fit = fit_d(a, vh)
    lam = build_lambda_d_rot(fit.scale, fit.angles, r) * fit.signs
    expected = torch.linalg.matrix_norm(lam @ a - vh) / math.sqrt(r)
    assert fit.residual == pytest.approx(float(expected), rel=1e-10)
    assert 0 < fit.residual < 2
