"""Centred clipping (``robust = "centred-clip"``) against dense float64 references.

The rule's weights come from the updates' Gram matrix; the references are the
dense vectors: the fixed point's defining equation of Karimireddy, He and
Jaggi's centred clipping, ``sum_i s_i clip_tau(x_i - v) = 0``, and the Huber
objective it minimises, against ``scipy.optimize.minimize``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

import fedlr.robust.builtin_rules.centred_clip as centred_clip
from fedlr.errors import ConfigError
from fedlr.robust.estimators import (
    bucket_matrix,
    centred_clip_weights,
    geometric_median_weights,
)
from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.robust.spaces import ParameterSpace, ProductSpace
from fedlr.strategies.base import ClientUpdate
from fedlr.strategies.registry import resolve

F64 = torch.float64


def _update(node_id: int, arrays: dict[str, torch.Tensor], n: int) -> ClientUpdate:
    return ClientUpdate.of_arrays(arrays, n, node_id=node_id)


def _points(seed: int, k: int, dim: int, boost: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((k, dim))
    points[-1] *= boost
    weights = rng.integers(1, 50, k).astype(float)
    return points, weights


def _clip(x: np.ndarray, tau: float) -> np.ndarray:
    norm = np.linalg.norm(x)
    return x if norm <= tau else x * (tau / norm)


def _huber_objective(v, points, s, tau):
    """``sum_i s_i huber_tau(||x_i - v||)``: centred clipping's fixed points
    are this convex function's minimisers."""
    d = np.linalg.norm(points - v, axis=1)
    return float(np.sum(s * np.where(d <= tau, d * d / 2, tau * d - tau * tau / 2)))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 8),
    st.integers(1, 6),
    st.integers(0, 2**16),
    st.sampled_from([1.0, 5.0, 1e6]),
    st.sampled_from([0.5, 1.0, 2.0]),
)
def test_weights_are_the_centred_clipping_fixed_point(k, dim, seed, boost, ratio):
    points, weights = _points(seed, k, dim, boost)
    gram = torch.as_tensor(points @ points.T, dtype=F64)
    alpha, tau, factors = centred_clip_weights(gram, weights.tolist(), ratio=ratio)
    a = alpha.numpy()
    assert a.min() > 0 and a.sum() == pytest.approx(1.0, abs=1e-12)
    v = a @ points
    # tau: ratio x the lower median of the distances to the geometric median.
    gm = geometric_median_weights(gram, [1.0] * k).numpy() @ points
    dist = np.sort(np.linalg.norm(points - gm, axis=1))
    assert tau == pytest.approx(ratio * dist[(k - 1) // 2], rel=1e-9)
    s = weights / weights.sum()
    scale = max(1.0, float(np.abs(points).max()))
    residual = sum(si * _clip(x - v, tau) for si, x in zip(s, points, strict=True))
    assert np.linalg.norm(residual) <= 1e-9 * scale
    best = minimize(
        _huber_objective,
        gm,
        args=(points, s, tau),
        method="Nelder-Mead",
        options={"xatol": 1e-12, "fatol": 1e-15, "maxiter": 20_000},
    )
    assert _huber_objective(v, points, s, tau) <= best.fun * (1 + 1e-9) + 1e-12
    expected_factors = np.minimum(1.0, tau / np.linalg.norm(points - v, axis=1))
    np.testing.assert_allclose(factors.numpy(), expected_factors, rtol=1e-6)


def test_nobody_beyond_tau_is_the_plain_weighted_mean():
    points, weights = _points(3, 6, 4, 1.0)
    gram = torch.as_tensor(points @ points.T, dtype=F64)
    alpha, _, factors = centred_clip_weights(gram, weights.tolist(), bound=1e9)
    np.testing.assert_allclose(alpha.numpy(), weights / weights.sum(), rtol=1e-12)
    assert bool((factors == 1).all())


def test_a_far_attacker_moves_the_aggregate_by_at_most_its_clipped_share():
    """Sending the same direction 1e3 or 1e9 times farther changes (almost)
    nothing: the attacker's pull is its share times tau, however far it is."""
    points, weights = _points(7, 5, 3, 1.0)
    honest = points[:-1]
    outs = []
    for scale in (1e3, 1e9):
        pts = np.vstack([honest, scale * np.ones(3)])
        gram = torch.as_tensor(pts @ pts.T, dtype=F64)
        alpha, tau, factors = centred_clip_weights(gram, weights.tolist(), ratio=4.0)
        outs.append(alpha.numpy() @ pts)
        assert factors[-1] < 1 and bool((factors[:-1] == 1).all())
        s = weights / weights.sum()
        mean_honest = s[:-1] @ honest / s[:-1].sum()
        # v - mean_honest = s_a tau e / sum(s c): within the attacker's share of tau
        bound = s[-1] * tau / s[:-1].sum()
        assert np.linalg.norm(outs[-1] - mean_honest) <= bound * (1 + 1e-9)
    # only the attacker's direction seen from v moves (by O(|v| / 1e3))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-3)


@pytest.mark.parametrize("k", [1, 2, 5, 9])
@pytest.mark.parametrize("size", [1, 2, 3, 10])
def test_bucket_matrix_puts_each_client_in_one_bucket(k, size):
    weights = torch.arange(1, k + 1, dtype=F64)
    mix = bucket_matrix(weights, size, torch.Generator().manual_seed(k * 31 + size))
    assert mix.shape == (-(-k // size), k)
    torch.testing.assert_close(mix.sum(1), torch.ones(len(mix), dtype=F64))
    members = mix > 0
    assert members.sum(0).tolist() == [1] * k
    assert members.sum(1).max() <= size
    for row in mix:  # each row is its members' weighted mean
        m = row > 0
        torch.testing.assert_close(row[m], weights[m] / weights[m].sum())


def test_buckets_are_drawn_from_the_secure_source(monkeypatch):
    """The bucket of a client must not be known to it in advance: the rule
    draws every round's permutation from secure_generator."""
    drawn = []

    def spy(device=None):
        generator = torch.Generator().manual_seed(len(drawn))
        drawn.append(generator)
        return generator

    monkeypatch.setattr(centred_clip, "secure_generator", spy)
    points, _ = _points(1, 6, 3, 1.0)
    updates = [
        _update(i, {"x": torch.as_tensor(p, dtype=F64)}, 10)
        for i, p in enumerate(points)
    ]
    space = ParameterSpace({"x": torch.zeros(3, dtype=F64)})
    for _ in range(3):
        robust_aggregate(updates, space, RobustConfig("centred-clip", bucket_size=2))
    assert len(drawn) == 3
    robust_aggregate(updates, space, RobustConfig("centred-clip"))
    assert len(drawn) == 3  # no buckets, no draw


@pytest.mark.parametrize("seed", range(6))
def test_bucketed_weights_are_the_buckets_clipped(seed, monkeypatch):
    points, weights = _points(seed, 7, 4, 30.0)
    generator_seed = 100 + seed
    monkeypatch.setattr(
        centred_clip,
        "secure_generator",
        lambda device=None: torch.Generator().manual_seed(generator_seed),
    )
    updates = [
        _update(i, {"x": torch.as_tensor(p, dtype=F64)}, int(n))
        for i, (p, n) in enumerate(zip(points, weights, strict=True))
    ]
    space = ParameterSpace({"x": torch.zeros(4, dtype=F64)})
    out = robust_aggregate(updates, space, RobustConfig("centred-clip", bucket_size=3))
    w = torch.as_tensor(weights, dtype=F64)
    mix = bucket_matrix(w, 3, torch.Generator().manual_seed(generator_seed)).numpy()
    buckets = mix @ points
    bucket_w = np.array([weights[row > 0].sum() for row in mix])
    gram = torch.as_tensor(buckets @ buckets.T, dtype=F64)
    beta, _, _ = centred_clip_weights(gram, bucket_w.tolist())
    expected = (mix.T @ beta.numpy()) * weights.sum()
    np.testing.assert_allclose([u.weight for u in out.updates], expected, rtol=1e-10)


@settings(max_examples=25, deadline=None)
@given(st.integers(3, 6), st.integers(0, 2**16), st.sampled_from([1.0, 50.0]))
def test_product_updates_get_the_weights_of_their_dense_products(k, seed, boost):
    """LoRA factor pairs: the weights are those of the dense products
    ``B_i A_i - B A`` (and the head as parameters), total weight kept, the
    far client named."""
    g = torch.Generator().manual_seed(seed)
    d_out, d_in, r = 5, 4, 2
    ref = {
        "a": torch.randn(r, d_in, generator=g, dtype=F64),
        "b": torch.randn(d_out, r, generator=g, dtype=F64),
        "head": torch.randn(3, generator=g, dtype=F64),
    }
    updates, dense = [], []
    for i in range(k):
        grow = boost if i == k - 1 else 1.0
        arrays = {
            key: v + grow * 0.3 * torch.randn(v.shape, generator=g, dtype=F64)
            for key, v in ref.items()
        }
        updates.append(_update(i, arrays, 5 + 3 * i))
        dense.append(
            torch.cat(
                [
                    (arrays["b"] @ arrays["a"] - ref["b"] @ ref["a"]).reshape(-1),
                    arrays["head"] - ref["head"],
                ]
            ).numpy()
        )
    points = np.stack(dense)
    space = ProductSpace(ref, [("a", "b")])
    out = robust_aggregate(updates, space, RobustConfig("centred-clip"))
    weights = [u.num_examples for u in updates]
    alpha, _, factors = centred_clip_weights(
        torch.as_tensor(points @ points.T, dtype=F64), weights
    )
    got = np.array([u.weight for u in out.updates])
    np.testing.assert_allclose(got, alpha.numpy() * sum(weights), rtol=1e-8)
    assert out.metrics["robust-clipped"] == int((factors < 1).sum())
    named = {int(r.split(":")[0].removeprefix("node ")) for r in out.reasons}
    assert named == {i for i in range(k) if bool(factors[i] < 1)}
    if boost > 1:
        assert k - 1 in named


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bucket_size_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError) as err:
        RobustConfig("centred-clip", bucket_size=bad)
    assert err.value.key == "bucket-size"


def test_run_config_keys_reach_the_rule(tmp_path):
    config = resolve(
        {
            "robust": "centred-clip",
            "bucket-size": 2,
            "clip-ratio": 1.5,
            "output-dir": str(tmp_path),
        }
    ).run.robust_config
    assert (config.rule, config.bucket_size, config.clip_ratio) == (
        "centred-clip",
        2,
        1.5,
    )
    assert config.active
    with pytest.raises(ConfigError) as err:
        resolve({"bucket-size": 0, "output-dir": str(tmp_path)})
    assert err.value.key == "bucket-size"
