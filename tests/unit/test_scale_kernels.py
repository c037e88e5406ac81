"""Kernels linear in the number of clients, against dense float64 references.

The streamed operator and dense sum, the streamed FedEx residual, the Hutch++
norm estimate, the randomized SVD of the mean, Global SVD's Gram paths, the
gap of an aggregate, and the cost model that picks between them; then the
strategies' flags when an estimate is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlr.strategies.fedspec as fedspec_module
import fedlr.strategies.global_svd as global_svd_module
import fedlr.strategies.lora as lora_module
from fedlr.adapters import AdapterLayout, LoraModule, Role
from fedlr.errors import ShapeMismatchError
from fedlr.linalg import (
    DENSE,
    FACTORED,
    GRAM,
    RANDOMIZED,
    CostModel,
    GapNorms,
    PathCost,
    ProductSum,
    StreamedResidual,
    aggregate_gap,
    dense_mean_of_products,
    estimate_frobenius_sq,
    gap_summary,
    randomized_svd_of_mean,
    randomized_updates_svd,
    stacked_residual,
    stacked_updates_svd,
    svd_of_mean,
    truncated_svd_of_mean,
    updates_svd,
    weighted_mean,
)
from fedlr.strategies import FedAvgLoRA, FedExLoRA, FedSpec, GlobalSVD
from fedlr.strategies.base import ClientUpdate

F64 = torch.float64
EPS = torch.finfo(F64).eps

# Force a path: tiny chunks (several per pass), nothing exact counted cheap.
TINY_CHUNKS = CostModel(chunk_bytes=2048, max_chunk_rank=7)
ESTIMATE = CostModel(cheap_flops=1.0, exact_ratio=1e-12)
EXACT_DENSE = CostModel(only=frozenset({DENSE}))


def _clients(
    seed: int, k: int, d_out: int, r: int, d_in: int, dtype: torch.dtype = F64
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d_out, r, generator=g, dtype=F64).to(dtype) for _ in range(k)]
    as_ = [torch.randn(r, d_in, generator=g, dtype=F64).to(dtype) for _ in range(k)]
    w = torch.rand(k, generator=g, dtype=F64) + 0.1
    return bs, as_, w


def _dense(
    bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor], w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, M - B_bar A_bar)`` in float64, one product per client."""
    wn = w.double() / w.double().sum()
    m = sum(wi * b.double() @ a.double() for wi, b, a in zip(wn, bs, as_, strict=True))
    b_bar = sum(wi * b.double() for wi, b in zip(wn, bs, strict=True))
    a_bar = sum(wi * a.double() for wi, a in zip(wn, as_, strict=True))
    assert isinstance(m, torch.Tensor)
    return m, m - b_bar @ a_bar


def _gapped(
    seed: int, k: int, d: int, r: int, signal: int, noise: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Clients sharing a rank-``signal`` update plus small private noise."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(d, signal, generator=g, dtype=F64)).Q
    v = torch.linalg.qr(torch.randn(d, signal, generator=g, dtype=F64)).Q
    scale = torch.linspace(10.0, 5.0, signal, dtype=F64)
    bs, as_ = [], []
    for _ in range(k):
        b = torch.randn(d, r, generator=g, dtype=F64) * noise
        a = torch.randn(r, d, generator=g, dtype=F64) * noise
        b[:, :signal] += u * scale.sqrt()
        a[:signal] += scale.sqrt()[:, None] * v.T
        bs.append(b)
        as_.append(a)
    return bs, as_, torch.rand(k, generator=g, dtype=F64) + 0.5


shapes = st.tuples(
    st.integers(1, 9),  # clients
    st.integers(1, 20),  # d_out
    st.integers(1, 5),  # rank
    st.integers(1, 20),  # d_in
    st.integers(0, 2**16),  # seed
)


# --------------------------------------------------------------- ProductSum
@settings(max_examples=25, deadline=None)
@given(shapes, st.booleans())
def test_product_sum_applies_the_dense_sum_in_chunks(case, shifted):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    coef = w - 0.6  # some negative: coefficients are used as given
    b_shift = bs[0] * 0.5 if shifted else None
    a_shift = as_[-1] * 0.3 if shifted else None
    op = ProductSum(bs, as_, coef, b_shift=b_shift, a_shift=a_shift, cost=TINY_CHUNKS)
    ref = sum(
        c * (b - (b_shift if shifted else 0)) @ (a - (a_shift if shifted else 0))
        for c, b, a in zip(coef, bs, as_, strict=True)
    )
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(d_in, 3, generator=g, dtype=F64)
    y = torch.randn(d_out, 2, generator=g, dtype=F64)
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.dense(), ref, **tol)
    torch.testing.assert_close(op.matmul(z), ref @ z, **tol)
    torch.testing.assert_close(op.rmatmul(y), ref.T @ y, **tol)
    out = torch.ones(d_out, d_in, dtype=F64)
    torch.testing.assert_close(op.accumulate(out, alpha=-2.0), 1.0 - 2.0 * ref, **tol)


def test_product_sum_takes_mixed_ranks_and_names_bad_shapes():
    g = torch.Generator().manual_seed(0)
    bs = [torch.randn(6, r, generator=g, dtype=F64) for r in (1, 3, 2)]
    as_ = [torch.randn(r, 5, generator=g, dtype=F64) for r in (1, 3, 2)]
    op = ProductSum(bs, as_, [1.0, -1.0, 0.5], cost=TINY_CHUNKS)
    ref = bs[0] @ as_[0] - bs[1] @ as_[1] + 0.5 * bs[2] @ as_[2]
    torch.testing.assert_close(op.dense(), ref, rtol=1e-12, atol=1e-12)
    assert op.width == 6 and op.num_clients == 3
    with pytest.raises(ShapeMismatchError, match=r"\(6, 3\)"):
        ProductSum(bs[:2], [as_[0], as_[0]], [1.0, 1.0])
    with pytest.raises(ShapeMismatchError, match="b_shift"):
        ProductSum(bs, as_, [1.0] * 3, b_shift=bs[1])
    with pytest.raises(ShapeMismatchError, match="block"):
        op.matmul(torch.zeros(4, 2, dtype=F64))


@settings(max_examples=20, deadline=None)
@given(shapes, st.sampled_from([torch.float32, torch.float64]))
def test_dense_mean_of_products_in_place(case, dtype):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in, dtype)
    m, _ = _dense(bs, as_, w)
    got = dense_mean_of_products(bs, as_, w, cost=TINY_CHUNKS)
    assert got.dtype == dtype
    scale = 1.0 + float(m.abs().max())
    tol = 50 * torch.finfo(dtype).eps * max(d_out, d_in, k * r) * scale
    assert float((got.double() - m).abs().max()) <= tol
    buffer = torch.full((d_out, d_in), 3.0, dtype=F64)
    out = dense_mean_of_products(bs, as_, w, out=buffer, alpha=0.5)
    assert out is buffer
    assert float((buffer - (3.0 + 0.5 * m)).abs().max()) <= tol + 1e-12


@settings(max_examples=20, deadline=None)
@given(shapes, st.sampled_from([torch.float32, torch.float64]))
def test_weighted_mean_accumulates_in_place(case, dtype):
    k, d_out, r, _, seed = case
    bs, _, w = _clients(seed, k, d_out, r, 1, dtype)
    ref = torch.einsum("k,kij->ij", w / w.sum(), torch.stack([b.double() for b in bs]))
    got = weighted_mean(bs, w)
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.double(),
        ref,
        rtol=0,
        atol=4 * torch.finfo(dtype).eps * (1 + float(ref.abs().max())),
    )


# ------------------------------------------------------- streamed residual
@settings(max_examples=20, deadline=None)
@given(shapes, st.sampled_from([torch.float32, torch.float64]))
def test_streamed_residual_folds_and_measures_like_the_stacked_one(case, dtype):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in, dtype)
    m, x = _dense(bs, as_, w)
    base = torch.randn(
        d_out, d_in, generator=torch.Generator().manual_seed(seed), dtype=F64
    ).to(dtype)
    streamed = StreamedResidual(bs, as_, w, cost=TINY_CHUNKS)
    folded = streamed.fold(base, 1.5)
    assert folded.dtype == dtype and streamed.rank == r
    ref = base.double() + 1.5 * x
    eps = torch.finfo(dtype).eps
    scale = 1.0 + float(ref.abs().max())
    assert (
        float((folded.double() - ref).abs().max()) <= 50 * eps * (k * r + d_in) * scale
    )
    norms = streamed.gap_norms()
    assert not norms.estimated and norms.gap_sq_error == 0.0
    exact_gap, exact_ref = stacked_residual(bs, as_, w).norms()
    tol = 1e3 * eps * (1.0 + float(m.norm()))
    assert abs(norms.gap - float(x.norm())) <= tol and abs(exact_gap - norms.gap) <= tol
    assert abs(norms.reference - float(m.norm())) <= tol
    assert abs(exact_ref - norms.reference) <= tol


def test_streamed_residual_without_fold_is_exact_when_cheap_estimated_when_not():
    bs, as_, w = _clients(4, 40, 30, 3, 26)
    m, x = _dense(bs, as_, w)
    exact = StreamedResidual(bs, as_, w, cost=TINY_CHUNKS)
    assert exact.norms_path().path == DENSE
    gap, ref = exact.norms()
    assert gap == pytest.approx(float(x.norm()), rel=1e-10)
    assert ref == pytest.approx(float(m.norm()), rel=1e-10)
    estimated = StreamedResidual(bs, as_, w, cost=ESTIMATE, seed=3)
    assert estimated.norms_path().path == RANDOMIZED
    norms = estimated.gap_norms()
    assert norms.estimated and norms.gap_sq_error > 0
    assert abs(norms.gap**2 - float(x.norm()) ** 2) <= norms.gap_sq_error
    # ||M||^2 = ||X||^2 + exact terms: the same absolute error
    assert abs(norms.reference**2 - float(m.norm()) ** 2) <= norms.gap_sq_error
    # after a fold the numbers are exact again
    estimated.fold(torch.zeros(30, 26, dtype=F64), 1.0)
    assert not estimated.gap_norms().estimated


# ------------------------------------------------------------- Hutch++
def test_frobenius_estimate_is_exact_when_deflation_spans_the_range():
    bs, as_, w = _clients(1, 3, 25, 2, 30)  # rank <= 6 < deflation 16
    m, _ = _dense(bs, as_, w)
    est, extra = estimate_frobenius_sq(
        ProductSum(bs, as_, w / w.sum()),
        cost=CostModel(),
        extra=torch.eye(30, 2, dtype=F64),
    )
    assert est.value == pytest.approx(float(m.norm()) ** 2, rel=1e-9)
    assert est.error <= 1e-9 * est.value
    torch.testing.assert_close(extra, m[:, :2], rtol=1e-10, atol=1e-10)


def test_frobenius_estimate_stays_within_its_bound():
    inside = 0
    trials = 12
    for seed in range(trials):
        bs, as_, w = _clients(100 + seed, 30, 40, 3, 35)
        m, _ = _dense(bs, as_, w)
        est, _ = estimate_frobenius_sq(ProductSum(bs, as_, w / w.sum()), seed=seed)
        truth = float(m.norm()) ** 2
        assert est.exact_part <= truth * (1 + 1e-12)
        inside += abs(est.value - truth) <= est.error
        assert abs(est.value - truth) <= 0.2 * truth  # never far off
    assert inside >= trials - 1  # three standard errors: ~99.7 % nominal


# ------------------------------------------------------- randomized SVD
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_svd_matches_exact_on_a_gapped_spectrum(seed):
    bs, as_, w = _gapped(seed, k=25, d=60, r=6, signal=4, noise=0.05)
    exact = truncated_svd_of_mean(bs, as_, w)
    approx = randomized_svd_of_mean(bs, as_, w, 4, seed=seed)
    assert approx.randomized and approx.energy_estimated and approx.rank == 4
    torch.testing.assert_close(approx.s, exact.s[:4], rtol=1e-6, atol=0)
    # the same rank-4 subspace (signs fixed the same way)
    torch.testing.assert_close(
        approx.dense(), truncate_dense(exact, 4), rtol=0, atol=1e-5 * float(exact.s[0])
    )
    assert abs(approx.total_energy - exact.total_energy) <= approx.energy_error + 1e-9
    assert (
        abs(approx.tail_energy - exact.energy_beyond(4)) <= approx.energy_error + 1e-9
    )
    torch.testing.assert_close(
        approx.u.T @ approx.u, torch.eye(4, dtype=F64), atol=1e-10, rtol=0
    )


def truncate_dense(svd, rank):
    return (svd.u[:, :rank] * svd.s[:rank]) @ svd.vh[:rank]


@settings(max_examples=10, deadline=None)
@given(shapes, st.integers(1, 6))
def test_randomized_svd_never_beats_eckart_young_and_reports_its_error(case, rank):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    m, _ = _dense(bs, as_, w)
    sigma = torch.linalg.svdvals(m)
    approx = randomized_svd_of_mean(bs, as_, w, rank, seed=seed)
    err = float(torch.linalg.matrix_norm(m - approx.dense())) ** 2
    optimal = float((sigma[approx.rank :] ** 2).sum())
    scale = float((sigma**2).sum()) + 1e-30
    assert err >= optimal - 1e-9 * scale
    # the cut is a projection of M: its squared error is ||M||^2 - sum s^2 exactly,
    # and the computed values are lower bounds of the true ones (interlacing)
    kept = float((approx.s**2).sum())
    assert abs(err - (scale - kept)) <= 1e-9 * scale
    assert bool((approx.s <= sigma[: approx.rank] * (1 + 1e-9) + 1e-12).all())
    # what the sketch saw is exact; only the rest is estimated (non-negative)
    seen = approx.total_energy - approx.residual_energy
    assert seen <= scale * (1 + 1e-9) and approx.residual_energy >= 0.0
    assert approx.energy_error >= 0.0


@settings(max_examples=15, deadline=None)
@given(shapes, st.integers(1, 6))
def test_svd_of_mean_paths_agree_with_the_dense_svd(case, rank):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    m, _ = _dense(bs, as_, w)
    sigma = torch.linalg.svdvals(m)
    for cost, path in ((TINY_CHUNKS, FACTORED), (EXACT_DENSE, DENSE)):
        assert cost.svd_of_mean(k, r, d_out, d_in, rank).path == path
        svd = svd_of_mean(bs, as_, w, rank, cost=cost)
        keep = min(rank, d_out, d_in, k * r)
        assert svd.rank == keep and not svd.randomized
        tol = 1e-9 * (1.0 + float(sigma[0]))
        q = min(d_out, d_in, k * r)
        torch.testing.assert_close(svd.singular_values, sigma[:q], rtol=0, atol=tol)
        best = float((sigma[keep:] ** 2).sum())
        assert abs(float(torch.linalg.matrix_norm(m - svd.dense())) ** 2 - best) <= tol
        assert abs(svd.tail_energy - best) <= tol


# ------------------------------------------------------------- Global SVD
def test_stacked_updates_svd_builds_no_block_diagonal(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("block_diag called")

    monkeypatch.setattr(torch, "block_diag", refuse)
    bs, as_, w = _clients(5, 12, 7, 3, 9)
    a, b_list, _ = stacked_updates_svd(bs, as_, w, 4)
    assert a.shape == (4, 9) and len(b_list) == 12


@settings(max_examples=10, deadline=None)
@given(shapes, st.integers(1, 6))
def test_gram_and_randomized_global_svd_match_the_factored_one(case, rank):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    wn = w / w.sum()
    _, _, svd_ref = stacked_updates_svd(bs, as_, w, rank)
    scale = 1.0 + svd_ref.total_energy
    gram = CostModel(only=frozenset({GRAM}))
    randomized = CostModel(only=frozenset({RANDOMIZED}))
    assert gram.updates_svd(k, r, d_out, d_in, rank).path == GRAM
    for cost in (gram, randomized):
        a, b_list, svd = updates_svd(bs, as_, w, rank, cost=cost, seed=seed)
        # the reported tail is the exact weighted gap of the factors returned
        gap_sq = sum(
            float(wi) * float(torch.linalg.matrix_norm(b @ x - bn @ a) ** 2)
            for wi, b, x, bn in zip(wn, bs, as_, b_list, strict=True)
        )
        assert abs(gap_sq - svd.tail_energy) <= 1e-8 * scale
        # never better than Eckart-Young; exact paths reach it
        assert gap_sq >= svd_ref.tail_energy - 1e-8 * scale
        if not svd.randomized:
            assert abs(gap_sq - svd_ref.tail_energy) <= 1e-8 * scale
            assert abs(svd.total_energy - svd_ref.total_energy) <= 1e-8 * scale


def test_randomized_global_svd_on_a_gapped_spectrum():
    bs, as_, w = _gapped(7, k=30, d=50, r=5, signal=3, noise=0.05)
    a_ref, b_ref, exact = stacked_updates_svd(bs, as_, w, 3)
    a, b_list, approx = randomized_updates_svd(bs, as_, w, 3, seed=1)
    assert approx.randomized and not approx.energy_estimated
    torch.testing.assert_close(approx.s, exact.s, rtol=1e-8, atol=0)
    assert approx.tail_energy == pytest.approx(exact.tail_energy, rel=1e-6)
    scale = float(exact.s[0])
    for b, br in zip(b_list, b_ref, strict=True):
        torch.testing.assert_close(b @ a, br @ a_ref, rtol=0, atol=1e-7 * scale)


# ------------------------------------------------------- gap of an aggregate
@settings(max_examples=15, deadline=None)
@given(shapes, st.integers(1, 4))
def test_aggregate_gap_paths_match_dense(case, r_agg):
    k, d_out, r, d_in, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    g = torch.Generator().manual_seed(seed + 7)
    b_agg = torch.randn(d_out, r_agg, generator=g, dtype=F64)
    a_agg = torch.randn(r_agg, d_in, generator=g, dtype=F64)
    m, _ = _dense(bs, as_, w)
    gap, ref = float(torch.linalg.matrix_norm(m - b_agg @ a_agg)), float(m.norm())
    tol = 1e-9 * (1.0 + ref + gap)
    for cost in (CostModel(), EXACT_DENSE):
        n = aggregate_gap(bs, as_, w, b_agg, a_agg, cost=cost)
        assert not n.estimated
        assert abs(n.gap - gap) <= tol and abs(n.reference - ref) <= tol
    # every client sharing A (FedSVD, FFA-LoRA): exact whatever the cost model
    shared = aggregate_gap(bs, [as_[0]] * k, w, b_agg, a_agg, cost=ESTIMATE)
    m_shared, _ = _dense(bs, [as_[0]] * k, w)
    assert not shared.estimated
    assert shared.gap == pytest.approx(
        float((m_shared - b_agg @ a_agg).norm()), rel=1e-9, abs=1e-12
    )


def test_aggregate_gap_estimate_is_flagged_and_bounded():
    bs, as_, w = _clients(9, 40, 30, 3, 28)
    m, _ = _dense(bs, as_, w)
    svd = truncated_svd_of_mean(bs, as_, w, rank=3)
    b_agg, a_agg = svd.u * svd.s, svd.vh
    n = aggregate_gap(bs, as_, w, b_agg, a_agg, cost=ESTIMATE, seed=2)
    truth = float((m - b_agg @ a_agg).norm()) ** 2
    assert n.estimated and abs(n.gap**2 - truth) <= n.gap_sq_error
    with pytest.raises(ShapeMismatchError, match="aggregate"):
        aggregate_gap(bs, as_, w, b_agg.T, a_agg)


def test_gap_summary_flags_and_bounds_the_total():
    exact = [GapNorms(3.0, 5.0), GapNorms(4.0, 5.0)]
    assert gap_summary(exact) == {"gap-estimated": 0.0, "gap-error-bound": 0.0}
    mixed = [GapNorms(3.0, 5.0), GapNorms(4.0, 5.0, estimated=True, gap_sq_error=5.0)]
    summary = gap_summary(mixed)
    assert summary["gap-estimated"] == 1.0
    # G^2 = 25, E = 5: the gap is within 1 - sqrt(1 - 5/25) of 5
    assert summary["gap-error-bound"] == pytest.approx(1 - math.sqrt(0.8))
    worst = gap_summary([GapNorms(1.0, 1.0, estimated=True, gap_sq_error=2.0)])
    assert worst["gap-error-bound"] == 1.0


# ------------------------------------------------------------- cost model
def test_cost_model_picks_exact_paths_when_cheap_and_linear_ones_at_scale():
    from fedlr.linalg import DEFAULT_COST_MODEL as cost

    # the sizes: k = 10 stays on today's exact factored kernels
    assert cost.svd_of_mean(10, 16, 4096, 4096, 18).path == FACTORED
    assert cost.residual(10, 16, 4096, 4096).path == FACTORED
    assert cost.updates_svd(10, 16, 768, 768, 16).path == FACTORED
    # k = 1000: the randomized range finder and the streamed residual
    assert cost.svd_of_mean(1000, 16, 4096, 4096, 18).path == RANDOMIZED
    assert cost.residual(1000, 16, 4096, 4096).path == DENSE
    assert cost.frobenius_norms(1000, 16, 4096, 4096).path == RANDOMIZED
    choice = cost.updates_svd(1000, 16, 768, 768, 16)
    assert choice.path != FACTORED and choice.costs[choice.path].nbytes < 2**31
    # exact where exact is cheap: small layers, many clients
    assert cost.frobenius_norms(100, 16, 768, 768).path == DENSE
    assert cost.svd_of_mean(2000, 16, 32, 32, 18).path in (FACTORED, DENSE)
    # no kr x kr intermediate beyond the memory budget
    tight = CostModel(memory_budget=2**20)
    assert tight.svd_of_mean(200, 4, 64, 64, 4).path != FACTORED


def test_cost_model_rule_and_validation():
    model = CostModel(cheap_flops=10.0, exact_ratio=2.0, memory_budget=100)
    exact = PathCost(flops=50.0, nbytes=10, exact=True)
    big = PathCost(flops=1.0, nbytes=1000, exact=True)
    approx = PathCost(flops=30.0, nbytes=1, exact=False)
    assert model.choose({"a": exact, "r": approx}).path == "a"  # 50 <= 2 * 30
    assert model.choose({"a": exact, "r": PathCost(20.0, 1, False)}).path == "r"
    assert model.choose({"b": big, "r": approx}).path == "r"  # over budget
    assert model.choose({"b": big}).path == "b"  # nothing else
    cheap_first = {"f": PathCost(9.0, 1, True), "g": PathCost(1.0, 1, True)}
    assert model.choose(cheap_first).path == "f"  # reference path while cheap
    assert model.choose({"a": exact, "r": approx}).exact
    with pytest.raises(ValueError, match="no candidate"):
        model.choose({})
    with pytest.raises(ValueError, match="probes"):
        CostModel(probes=1)
    with pytest.raises(ValueError, match="cheap_flops"):
        CostModel(cheap_flops=0.0)


# ------------------------------------------------------------ strategies
LAYOUT = AdapterLayout(
    modules=(
        LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=24, d_in=20, rank=2),
        LoraModule("l1", "l1.A", "l1.B", "l1.W", 0.5, d_out=16, d_in=28, rank=2),
    ),
    head_shapes={"head.w": (2, 20), "head.b": (2,)},
)


def _updates(k: int, seed: int = 11) -> list[ClientUpdate]:
    g = torch.Generator().manual_seed(seed)
    shapes = LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD)
    return [
        ClientUpdate(
            node_id=i,
            arrays={key: torch.randn(*s, generator=g) for key, s in shapes.items()},
            num_examples=i + 1,
            metrics={},
            content=None,  # type: ignore[arg-type]
            nbytes=0,
        )
        for i in range(k)
    ]


def test_lora_gap_report_says_when_it_is_estimated(monkeypatch):
    updates = _updates(30)
    exact = FedAvgLoRA(layout=LAYOUT).gap_report(updates)
    assert exact.metrics["gap-estimated"] == 0.0
    assert exact.metrics["gap-error-bound"] == 0.0
    monkeypatch.setattr(lora_module, "DEFAULT_COST_MODEL", ESTIMATE)
    residuals = FedAvgLoRA(layout=LAYOUT).layer_residuals(updates)
    assert all(isinstance(r, StreamedResidual) for r in residuals.values())
    estimated = FedAvgLoRA(layout=LAYOUT).gap_report(updates, residuals)
    assert estimated.metrics["gap-estimated"] == 1.0
    bound = estimated.metrics["gap-error-bound"]
    assert 0.0 < bound < 0.5
    true_gap, reported = (
        exact.metrics["frobenius-gap"],
        estimated.metrics["frobenius-gap"],
    )
    assert abs(reported - true_gap) <= bound * reported
    # FedEx folds with the streamed residual: exact gap, exact fold
    g = torch.Generator().manual_seed(3)
    current = {k: torch.randn(*s, generator=g) for k, s in LAYOUT.shapes(*Role).items()}
    state, report = FedExLoRA(layout=LAYOUT).aggregate_updates(1, updates, current)
    assert report.metrics["gap-estimated"] == 0.0
    assert report.metrics["frobenius-gap"] == pytest.approx(true_gap, rel=1e-4)
    w = torch.tensor([u.weight for u in updates], dtype=F64)
    for m in LAYOUT.modules:
        bs = [u.arrays[m.b_key] for u in updates]
        as_ = [u.arrays[m.a_key] for u in updates]
        ideal, _ = _dense(bs, as_, w)
        lhs = state[m.base_key].double() + m.scaling * (
            state[m.b_key].double() @ state[m.a_key].double()
        )
        rhs = current[m.base_key].double() + m.scaling * ideal
        assert float((lhs - rhs).norm() / rhs.norm()) < 1e-5


def test_fedspec_flags_a_randomized_round(monkeypatch):
    layout = AdapterLayout(
        modules=(
            LoraModule("l0", "l0.A", "l0.B", "l0.W", 1.0, d_out=40, d_in=36, rank=3),
        ),
        head_shapes={},
    )
    bs, as_, w = _gapped(2, k=20, d=40, r=3, signal=2, noise=0.02)
    as_ = [a[:, :36] for a in as_]
    updates = [
        ClientUpdate(
            node_id=i,
            arrays={"l0.B": b.float(), "l0.A": a.float()},
            num_examples=int(10 * wi),
            metrics={},
            content=None,  # type: ignore[arg-type]
            nbytes=0,
        )
        for i, (b, a, wi) in enumerate(zip(bs, as_, w, strict=True))
    ]
    current = {"l0.B": bs[0].float(), "l0.A": as_[0].float()}
    exact_state, exact = FedSpec(layout=layout, fedspec_max_rank=6).aggregate_updates(
        1, updates, current
    )
    assert exact.metrics["svd-randomized"] == 0.0
    assert exact.metrics["gap-estimated"] == 0.0
    monkeypatch.setattr(fedspec_module, "DEFAULT_COST_MODEL", ESTIMATE)
    state, report = FedSpec(layout=layout, fedspec_max_rank=6).aggregate_updates(
        1, updates, current
    )
    assert report.metrics["svd-randomized"] == 1.0
    assert report.metrics["gap-estimated"] == 1.0
    assert report.metrics["rank"] == exact.metrics["rank"]
    assert report.metrics["tail-energy"] == pytest.approx(
        exact.metrics["tail-energy"], rel=0.05
    )
    gap, reported = exact.metrics["frobenius-gap"], report.metrics["frobenius-gap"]
    bound = report.metrics["gap-error-bound"]
    assert abs(reported - gap) <= bound * reported + 1e-6
    for key in state:
        prod = state[key]
        assert prod.shape == exact_state[key].shape
    new_b, new_a = state["l0.B"].double(), state["l0.A"].double()
    ref = exact_state["l0.B"].double() @ exact_state["l0.A"].double()
    assert float((new_b @ new_a - ref).norm() / ref.norm()) < 1e-3
    assert set(FedSpec.extra_columns) >= {"gap-estimated", "svd-randomized"}


def test_global_svd_flags_a_randomized_round(monkeypatch):
    updates = _updates(12)
    g = torch.Generator().manual_seed(5)
    current = {k: torch.randn(*s, generator=g) for k, s in LAYOUT.shapes(*Role).items()}
    _, exact = GlobalSVD(layout=LAYOUT).aggregate_updates(1, updates, current)
    assert exact.metrics["svd-randomized"] == 0.0
    monkeypatch.setattr(global_svd_module, "DEFAULT_COST_MODEL", ESTIMATE)
    _, report = GlobalSVD(layout=LAYOUT).aggregate_updates(1, updates, current)
    assert report.metrics["svd-randomized"] == 1.0
    # randomized subspace: never a smaller gap than the exact SVD's, and close
    gap, best = report.metrics["frobenius-gap"], exact.metrics["frobenius-gap"]
    assert best * (1 - 1e-9) <= gap <= best * 1.05
    assert "svd-randomized" in GlobalSVD.extra_columns
