"""Kernels of the SVD family against dense float64 formulas; the FedSpec demo."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.errors import ConfigError, RankMismatchError
from fedlr.linalg import (
    adaptive_rank,
    local_svd_factors,
    pad_factors,
    personal_change,
    require_common_rank,
    stacked_updates_svd,
    tail_fraction,
    truncate,
    truncated_svd_of_mean,
)
from fedlr.strategies.fedspec import FedSpecOptions
from fedlr.strategies.registry import resolve
from tests.unit.test_lowrank import _clients, _dense

cases = st.tuples(
    st.integers(1, 6),  # clients
    st.integers(2, 20),  # d_out
    st.integers(1, 5),  # client rank
    st.integers(2, 20),  # d_in
    st.integers(1, 8),  # target rank
    st.integers(0, 2**16),  # seed
)


# ------------------------------------------------------------------ rank rule
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 64),
    st.floats(0, 1),
    st.floats(0, 0.99),
    st.integers(1, 80),
)
def test_rank_rule_monotone_capped_step_two(rank, tail, threshold, max_rank):
    new = adaptive_rank(rank, tail, threshold, max_rank)
    assert new >= rank  # never decreases
    assert new - rank in (0, 1, 2)
    assert new <= max(rank, max_rank)  # capped
    if tail > threshold and rank + 2 <= max_rank:
        assert new == rank + 2
    if tail <= threshold:
        assert new == rank


def test_rank_rule_threshold_boundary_is_strict():
    assert adaptive_rank(8, 0.05, 0.05, 16) == 8  # equal: no growth
    assert adaptive_rank(8, math.nextafter(0.05, 1.0), 0.05, 16) == 10
    assert adaptive_rank(8, math.nextafter(0.05, 0.0), 0.05, 16) == 8
    assert adaptive_rank(15, 0.9, 0.05, 16) == 16  # capped step
    assert adaptive_rank(16, 0.9, 0.05, 16) == 16
    # repeated application is monotone and stops at the cap
    ranks = [4]
    for _ in range(10):
        ranks.append(adaptive_rank(ranks[-1], 0.5, 0.05, 11))
    assert ranks == [4, 6, 8, 10, 11, 11, 11, 11, 11, 11, 11]
    with pytest.raises(ValueError, match="tail fraction"):
        adaptive_rank(4, 1.5, 0.05, 16)


@settings(max_examples=40, deadline=None)
@given(cases)
def test_tail_fraction_and_truncate_match_dense(case):
    k, d_out, r, d_in, keep, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    dense, _, _ = _dense(bs, as_, w)
    sigma = torch.linalg.svdvals(dense)
    full = truncated_svd_of_mean(bs, as_, w)
    expected = float((sigma[keep:] ** 2).sum() / (sigma**2).sum())
    assert abs(tail_fraction(full.singular_values, keep) - expected) < 1e-10
    cut = truncate(full, keep)
    assert cut.rank == min(keep, full.rank)
    err = float(torch.linalg.matrix_norm(dense - cut.dense()))
    assert abs(err - math.sqrt(cut.tail_energy)) <= 1e-9 * float(sigma[0])


# -------------------------------------------------------------------- padding
@settings(max_examples=40, deadline=None)
@given(cases)
def test_padding_keeps_the_product_and_adds_orthogonal_rows(case):
    _k, d_out, r, d_in, extra, seed = case
    r = min(r, d_in)
    target = min(d_in, r + extra)
    bs, as_, _ = _clients(seed, 1, d_out, r, d_in)
    b, a = pad_factors(bs[0], as_[0], target, seed=seed)
    assert b.shape == (d_out, target) and a.shape == (target, d_in)
    torch.testing.assert_close(b @ a, bs[0] @ as_[0], rtol=1e-12, atol=1e-12)
    new_rows = a[r:]
    assert bool((b[:, r:] == 0).all())
    if target > r:
        cross = as_[0] @ new_rows.T
        assert float(cross.abs().max()) < 1e-9 * float(as_[0].abs().max() + 1)
        assert float(new_rows.norm(dim=1).min()) > 0


def test_padding_refuses_to_shrink_or_exceed_the_input_side():
    b, a = torch.zeros(5, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_factors(b, a, 2, seed=0)
    with pytest.raises(ValueError, match="exceeds the input dimension"):
        pad_factors(b, a, 5, seed=0)


# ---------------------------------------------------------------- rank check
def test_rank_mismatch_names_clients_and_shapes():
    factors = {
        "node 7": (torch.zeros(6, 2), torch.zeros(2, 5)),
        "node 9": (torch.zeros(6, 3), torch.zeros(3, 5)),
    }
    with pytest.raises(RankMismatchError) as info:
        require_common_rank(factors, "l0")
    text = str(info.value)
    assert "node 7" in text and "node 9" in text
    assert "(6, 2)" in text and "(3, 5)" in text and "'l0'" in text
    assert require_common_rank({"a": factors["node 7"]}, "l0") == 2


# ----------------------------------------------------------------- global SVD
@settings(max_examples=40, deadline=None)
@given(cases)
def test_global_svd_is_the_best_shared_input_factor(case):
    k, d_out, r, d_in, rank, seed = case
    bs, as_, w = _clients(seed, k, d_out, r, d_in)
    wn = torch.tensor(w, dtype=torch.float64) / sum(w)
    a, b_list, svd = stacked_updates_svd(bs, as_, w, rank)
    # Dense reference: input-major stack of the weighted transposed updates.
    stack = torch.cat(
        [wi.sqrt() * (b @ x).T for wi, b, x in zip(wn, bs, as_, strict=True)], dim=1
    )
    sigma = torch.linalg.svdvals(stack)
    kept = min(rank, d_in, k * d_out, k * r)
    assert a.shape == (kept, d_in) and all(b.shape == (d_out, kept) for b in b_list)
    discarded = float((sigma[kept:] ** 2).sum())
    gap_sq = sum(
        float(wi) * float(torch.linalg.matrix_norm(b @ x - bn @ a) ** 2)
        for wi, b, x, bn in zip(wn, bs, as_, b_list, strict=True)
    )
    scale = float((sigma**2).sum()) + 1.0
    assert abs(gap_sq - discarded) <= 1e-9 * scale
    assert abs(svd.tail_energy - discarded) <= 1e-9 * scale
    # the shared factor has orthogonal rows (sqrt(S) U^T)
    gram = a @ a.T
    torch.testing.assert_close(
        gram, torch.diag(torch.diagonal(gram)), atol=1e-9, rtol=0
    )


def test_global_svd_is_exact_for_one_client_at_its_rank():
    bs, as_, _ = _clients(3, 1, 9, 3, 7)
    a, (b,), svd = stacked_updates_svd(bs, as_, [5.0], 3)
    torch.testing.assert_close(b @ a, bs[0] @ as_[0], rtol=1e-10, atol=1e-10)
    assert svd.tail_energy < 1e-20


# ------------------------------------------------------------------ local SVD
@settings(max_examples=40, deadline=None)
@given(cases)
def test_local_svd_keeps_the_update_and_balances_the_factors(case):
    _, d_out, r, d_in, _, seed = case
    r = min(r, d_out, d_in)
    bs, as_, _ = _clients(seed, 1, d_out, r, d_in)
    b, a = local_svd_factors(bs[0], as_[0])
    assert b.shape == (d_out, r) and a.shape == (r, d_in)
    torch.testing.assert_close(b @ a, bs[0] @ as_[0], rtol=1e-10, atol=1e-10)
    # B^T B = A A^T = S (diagonal, equal): balanced singular factors
    torch.testing.assert_close(b.T @ b, a @ a.T, rtol=1e-9, atol=1e-9)
    gram = a @ a.T
    torch.testing.assert_close(
        gram, torch.diag(torch.diagonal(gram)), atol=1e-9, rtol=0
    )
    # the input-side factor's rows span the update's row space
    sigma = torch.linalg.svdvals(bs[0] @ as_[0])
    torch.testing.assert_close(
        torch.diagonal(gram).sort(descending=True).values,
        sigma[:r],
        rtol=1e-9,
        atol=1e-9,
    )


def test_local_svd_of_a_zero_update_keeps_the_rank():
    b, a = local_svd_factors(torch.zeros(6, 3), torch.randn(3, 5))
    assert b.shape == (6, 3) and a.shape == (3, 5)
    assert float((b @ a).abs().max()) == 0.0


# ------------------------------------------------------------ personal change
@settings(max_examples=40, deadline=None)
@given(cases)
def test_personal_change_matches_dense(case):
    _, d_out, r, d_in, _, seed = case
    bs, as_, _ = _clients(seed, 2, d_out, r, d_in)
    b, a_own, a_new = bs[0], as_[0], as_[1]
    change, own = personal_change(b.T @ b, a_own, a_new)
    dense_change = float(torch.linalg.matrix_norm(b @ a_own - b @ a_new) ** 2)
    dense_own = float(torch.linalg.matrix_norm(b @ a_own) ** 2)
    assert abs(change - dense_change) <= 1e-9 * (dense_change + 1)
    assert abs(own - dense_own) <= 1e-9 * (dense_own + 1)


# -------------------------------------------------------------- FedSpec demo
def test_fedspec_demo_three_synthetic_clients(capsys):
    """3 synthetic clients, one round: FedSpec's gap is below FedAvg's."""
    d, r, k = 64, 8, 3
    g = torch.Generator().manual_seed(0)
    bs = [torch.randn(d, r, generator=g, dtype=torch.float64) for _ in range(k)]
    as_ = [torch.randn(r, d, generator=g, dtype=torch.float64) for _ in range(k)]
    w = [1.0] * k
    ideal, b_bar, a_bar = _dense(bs, as_, w)
    fedavg_gap = float(torch.linalg.matrix_norm(ideal - b_bar @ a_bar))
    b, a = truncated_svd_of_mean(bs, as_, w, rank=r).split_sqrt()
    fedspec_gap = float(torch.linalg.matrix_norm(ideal - b @ a))
    reduction = 100.0 * (1.0 - fedspec_gap / fedavg_gap)
    with capsys.disabled():
        print(
            f"\nFedSpec demo: FedAvg gap {fedavg_gap:.4f}, FedSpec gap "
            f"{fedspec_gap:.4f}, reduction {reduction:.1f} %"
        )
    assert fedspec_gap < fedavg_gap
    # Eckart-Young: no rank-r factors do better than FedSpec's
    sigma = torch.linalg.svdvals(ideal)
    assert abs(fedspec_gap - float(sigma[r:].norm())) < 1e-9 * float(sigma[0])


# ------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("fedspec-threshold", 1.0, r"must be in \[0, 1\)"),
        ("fedspec-threshold", -0.1, r"must be in \[0, 1\)"),
        ("fedspec-max-rank", 0, "must be >= 1"),
        ("fedspec-max-rank", 2.5, "expected an integer"),
    ],
)
def test_svd_family_config_keys_are_validated(key, value, match):
    with pytest.raises(ConfigError, match=match) as info:
        resolve({"method": "fedspec", key: value})
    assert info.value.key == key


def test_svd_family_config_defaults():
    options = resolve({"method": "fedspec"}).options
    assert isinstance(options, FedSpecOptions)
    assert (options.fedspec_threshold, options.fedspec_max_rank) == (0.05, 16)
