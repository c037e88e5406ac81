"""Robust aggregation (fedlr.robust.rules) against dense float64 references.

Every update space is checked against the update written out densely
(``u_i = B_i A_i - B A`` as a d_out x d_in matrix, or the flattened change of
the arrays), the geometric median against ``scipy.optimize.minimize`` of
``sum_i w_i ||x_i - z||``, and the weight cap against the water-filling
formula ``s_i = min(cap, t w_i)``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq, minimize

import fedlr.robust.rules as robust
import fedlr.robust.spaces as spaces
from fedlr.errors import ConfigError
from fedlr.robust.estimators import cap_shares, geometric_median_weights
from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.robust.spaces import ParameterSpace, ProductSpace
from fedlr.strategies.base import ClientUpdate

F64 = torch.float64
EPS = float(torch.finfo(F64).eps)
HEAD = "head.weight"

MODES = ("both", "a-from-ref", "b-from-ref", "ref-lacks-pair", "a-nowhere")
"""How a layer's pair is sent: both factors; only B (FFA-LoRA, A is the
reference's); only A (FedSA, B is the reference's); both, with a reference
that lacks the pair (zero reference product); only B with A in neither reply
nor reference (B measured as parameters)."""


def _update(node_id: int, arrays: dict[str, torch.Tensor], n: int = 1) -> ClientUpdate:
    return ClientUpdate.of_arrays(arrays, n, node_id=node_id)


# --------------------------------------------------------------- references
def _dense_product_vector(
    arrays: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    pairs: list[tuple[str, str]],
) -> torch.Tensor:
    """The update written out densely: each pair's ``B_i A_i - B A``, the rest
    as parameter differences (from zero where the reference lacks the key)."""
    parts, paired = [], set()
    for a_key, b_key in pairs:
        a = arrays[a_key] if a_key in arrays else reference.get(a_key)
        b = arrays[b_key] if b_key in arrays else reference.get(b_key)
        if a is None or b is None:
            continue
        paired |= {a_key, b_key}
        product = b.to(F64) @ a.to(F64)
        if a_key in reference and b_key in reference:
            product = product - reference[b_key].to(F64) @ reference[a_key].to(F64)
        parts.append(product.reshape(-1))
    for key in sorted(arrays):
        if key in paired:
            continue
        x = arrays[key].to(F64)
        if key in reference:
            x = x - reference[key].to(F64)
        parts.append(x.reshape(-1))
    return torch.cat(parts)


def _product_scale(
    arrays: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    pairs: list[tuple[str, str]],
) -> float:
    """Size of the terms the factored inner products add up (for tolerances)."""
    total = 0.0
    for key in set(arrays) | set(reference):
        total += (
            float(torch.linalg.vector_norm(arrays.get(key, reference.get(key)).to(F64)))
            ** 2
        )
    sq = 0.0
    for a_key, b_key in pairs:
        for src in (arrays, reference):
            a = src.get(a_key, reference.get(a_key))
            b = src.get(b_key, reference.get(b_key))
            if a is not None and b is not None:
                sq += (
                    float(torch.linalg.matrix_norm(a.to(F64)))
                    * float(torch.linalg.matrix_norm(b.to(F64)))
                ) ** 2
    return math.sqrt(total + sq) + 1.0


def _gm_objective(z: np.ndarray, points: np.ndarray, w: np.ndarray) -> float:
    return float(w @ np.linalg.norm(points - z, axis=1))


def _scipy_median_value(
    points: np.ndarray, w: np.ndarray, pull: np.ndarray | None = None
) -> float:
    """``min_z sum_i w_i ||x_i - z|| - <pull, z>`` by BFGS from the mean, or at
    a data point (where the objective is not differentiable)."""
    pull = np.zeros(points.shape[1]) if pull is None else pull

    def fun(z: np.ndarray) -> tuple[float, np.ndarray]:
        diff = z - points
        dist = np.linalg.norm(diff, axis=1)
        safe = np.where(dist > 0, dist, 1.0)
        grad = ((w / safe)[:, None] * diff * (dist > 0)[:, None]).sum(axis=0)
        return float(w @ dist - pull @ z), grad - pull

    start = (w[:, None] * points).sum(axis=0) / w.sum()
    best = minimize(fun, start, jac=True, method="BFGS", options={"gtol": 1e-13})
    return min(float(best.fun), *(fun(x)[0] for x in points))


def _vertex_pulls(points: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Kuhn's ratio at each data point: the others' pull over the weight there
    (``<= 1``: that point is the median)."""
    ratios = []
    for x in points:
        dist = np.linalg.norm(points - x, axis=1)
        away = dist > 0
        pull = (w[away, None] * (points[away] - x) / dist[away, None]).sum(axis=0)
        ratios.append(np.linalg.norm(pull) / w[~away].sum())
    return np.asarray(ratios)


def _near_vertex(points: np.ndarray, w: np.ndarray) -> bool:
    """The median lies just off a data point (Kuhn's ratio in (1, 1.15)),
    where Weiszfeld's 500 iterations fall short of a 1e-8 comparison (about
    6% of random rounds; the xfail test below)."""
    ratios = _vertex_pulls(points, w)
    return bool(((ratios > 1 + 1e-6) & (ratios < 1.15)).any())


def _water_filling(weights: list[float], cap: float) -> np.ndarray:
    """``s_i = min(cap, t w_i)`` with ``sum s_i = 1``, t found by root finding."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    if w.max() <= cap:
        return w

    def excess(t: float) -> float:
        return float(np.minimum(cap, t * w).sum() - 1.0)

    if excess(cap / w.min()) <= 0:  # cap * k == 1: everybody at the cap
        return np.full(len(w), cap)
    t = brentq(excess, 1.0, cap / w.min(), xtol=1e-15, rtol=4 * EPS)
    return np.minimum(cap, t * w)


# ------------------------------------------------------------- test rounds
@st.composite
def product_rounds(draw, equal_ranks: bool = False):
    """(reference, pairs, per-client arrays) of a LoRA round over 1-2 layers.

    ``equal_ranks``: every factor sent has the reference's rank (so that
    moving it towards the reference is defined).
    """
    k = draw(st.integers(1, 5))
    n_layers = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from([torch.float32, F64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    reference: dict[str, torch.Tensor] = {}
    pairs = []
    clients: list[dict[str, torch.Tensor]] = [{} for _ in range(k)]
    for layer in range(n_layers):
        a_key, b_key = f"l{layer}.lora_A", f"l{layer}.lora_B"
        pairs.append((a_key, b_key))
        d_out, d_in, r0 = (
            draw(st.integers(1, 7)),
            draw(st.integers(1, 7)),
            draw(st.integers(1, 3)),
        )
        mode = draw(st.sampled_from(MODES))
        if mode != "ref-lacks-pair" and mode != "a-nowhere":
            reference[a_key] = rnd(r0, d_in)
        if mode != "ref-lacks-pair":
            reference[b_key] = rnd(d_out, r0)
        for arrays in clients:
            r = r0 if equal_ranks else draw(st.integers(1, 4))
            if mode in ("both", "ref-lacks-pair"):
                arrays[a_key], arrays[b_key] = rnd(r, d_in), rnd(d_out, r)
            elif mode == "b-from-ref":
                arrays[a_key] = rnd(r0, d_in)
            else:  # "a-from-ref", "a-nowhere": only B is sent
                arrays[b_key] = rnd(d_out, r0)
    h = draw(st.integers(1, 4))
    reference[HEAD] = rnd(h)
    for arrays in clients:
        arrays[HEAD] = rnd(h)
    if draw(st.booleans()):  # a sent key the reference lacks counts from zero
        for arrays in clients:
            arrays["extra.bias"] = rnd(2)
    return reference, pairs, clients


@st.composite
def parameter_rounds(draw):
    """(reference, per-client arrays): a matrix, a vector and a new key."""
    k = draw(st.integers(1, 6))
    d1, d2 = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    reference = {
        "w": torch.randn(d1, d2, generator=g, dtype=F64),
        "b": torch.randn(d2, generator=g, dtype=F64),
    }
    clients = [
        {
            "w": torch.randn(d1, d2, generator=g, dtype=F64),
            "b": torch.randn(d2, generator=g, dtype=F64),
            "new": torch.randn(3, generator=g, dtype=F64),
        }
        for _ in range(k)
    ]
    return reference, clients


# ------------------------------------------------------- 1. ProductSpace
@settings(max_examples=50, deadline=None)
@given(product_rounds())
def test_product_space_gram_and_norm_match_dense_products(case):
    reference, pairs, clients = case
    updates = [_update(i, arrays) for i, arrays in enumerate(clients)]
    space = ProductSpace(reference, pairs)
    vectors = torch.stack([_dense_product_vector(c, reference, pairs) for c in clients])
    expected = vectors @ vectors.T
    scales = torch.tensor([_product_scale(c, reference, pairs) for c in clients])
    dim = max(max(t.shape) for c in clients for t in c.values())
    tol = 64 * EPS * dim * torch.outer(scales, scales)
    got = space.gram(updates)
    assert got.shape == (len(updates), len(updates)) and got.dtype == F64
    assert bool(((got - expected).abs() <= tol).all()), (got - expected).abs().max()
    for i, update in enumerate(updates):
        sq = float(vectors[i] @ vectors[i])
        assert abs(space.norm(update) ** 2 - sq) <= float(tol[i, i])


def _dense_gram(bs, as_):
    products = torch.stack([(b @ a).reshape(-1) for b, a in zip(bs, as_, strict=True)])
    return products @ products.T


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),  # pairs
    st.integers(1, 6),  # d_out
    st.integers(1, 6),  # d_in
    st.integers(0, 2**16),  # seed
    st.integers(1, 12),  # rows of the stacked factors per chunk
)
def test_chunked_product_gram_matches_dense(n, d_out, d_in, seed, rows):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(1, 5, (n,), generator=g).tolist()
    bs = [torch.randn(d_out, r, generator=g, dtype=F64) for r in ranks]
    as_ = [torch.randn(r, d_in, generator=g, dtype=F64) for r in ranks]
    whole = spaces._product_gram(bs, as_)
    with pytest.MonkeyPatch.context() as mp:
        # A few rows of the (sum r) x (sum r) blocks per chunk, down to one pair.
        mp.setattr(spaces, "_GRAM_CHUNK_BYTES", rows * 16 * sum(ranks))
        chunked = spaces._product_gram(bs, as_)
    expected = _dense_gram(bs, as_)
    scale = (
        max(
            float(torch.linalg.matrix_norm(b) * torch.linalg.matrix_norm(a))
            for b, a in zip(bs, as_, strict=True)
        )
        ** 2
    )
    tol = 64 * EPS * max(d_out, d_in, *ranks) * scale
    torch.testing.assert_close(whole, expected, rtol=0, atol=tol)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=tol)


@settings(max_examples=25, deadline=None)
@given(product_rounds())
def test_product_space_gram_is_the_same_in_tiny_chunks(case):
    reference, pairs, clients = case
    updates = [_update(i, arrays) for i, arrays in enumerate(clients)]
    space = ProductSpace(reference, pairs)
    whole = space.gram(updates)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spaces, "_GRAM_CHUNK_BYTES", 1)
        chunked = space.gram(updates)
    scales = torch.tensor([_product_scale(c, reference, pairs) for c in clients])
    tol = 64 * EPS * 8 * torch.outer(scales, scales)
    assert bool(((chunked - whole).abs() <= tol).all())


def test_product_space_measures_an_unpaired_factor_as_parameters():
    """FedSA-like: B sent, A in neither reply nor reference."""
    g = torch.Generator().manual_seed(3)
    b_ref = torch.randn(4, 2, generator=g, dtype=F64)
    b1 = torch.randn(4, 2, generator=g, dtype=F64)
    space = ProductSpace({"B": b_ref}, [("A", "B")])
    update = _update(1, {"B": b1})
    assert space.norm(update) == pytest.approx(
        float(torch.linalg.matrix_norm(b1 - b_ref)), rel=1e-14
    )


def test_product_space_reference_lacking_the_pair_is_a_zero_product():
    g = torch.Generator().manual_seed(4)
    a, b = (
        torch.randn(2, 5, generator=g, dtype=F64),
        torch.randn(3, 2, generator=g, dtype=F64),
    )
    space = ProductSpace({}, [("A", "B")])
    assert space.norm(_update(1, {"A": a, "B": b})) == pytest.approx(
        float(torch.linalg.matrix_norm(b @ a)), rel=1e-13
    )


# ----------------------------------------------------- 2. ParameterSpace
def _projection(seed: int, d: int, m: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, max(1, min(m, d)), generator=g, dtype=F64))
    return q @ q.T


@settings(max_examples=50, deadline=None)
@given(
    parameter_rounds(),
    st.sampled_from([None, ("new", "w")]),
    st.booleans(),
    st.integers(1, 6),
)
def test_parameter_space_gram_and_norm_match_flattened_vectors(case, keys, hook, m):
    reference, clients = case
    d2 = reference["w"].shape[1]
    proj = _projection(m, d2, m)
    mask = torch.arange(d2, dtype=F64) % 2  # a coordinate projection of "b"

    def transform(key: str, delta: torch.Tensor) -> torch.Tensor:
        if key == "w":
            return delta @ proj
        if key == "b":
            return delta * mask
        return 2.0 * delta

    def dense_transform(key: str, delta: np.ndarray) -> np.ndarray:
        if key == "w":
            return np.einsum("ij,jk->ik", delta, proj.numpy())
        if key == "b":
            return delta * mask.numpy()
        return 2.0 * delta

    space = ParameterSpace(reference, keys, transform if hook else None)
    rows = []
    for arrays in clients:
        parts = []
        for key in sorted(keys or arrays):
            x = arrays[key].numpy()
            delta = x - reference[key].numpy() if key in reference else x
            if hook:
                delta = dense_transform(key, delta)
            parts.append(delta.reshape(-1))
        rows.append(np.concatenate(parts))
    vectors = np.stack(rows)
    expected = vectors @ vectors.T
    updates = [_update(i, arrays) for i, arrays in enumerate(clients)]
    scale = float(np.abs(vectors).max() + 1.0) ** 2
    tol = 16 * EPS * vectors.shape[1] * scale
    np.testing.assert_allclose(space.gram(updates).numpy(), expected, rtol=0, atol=tol)
    for update, v in zip(updates, vectors, strict=True):
        assert space.norm(update) == pytest.approx(
            np.linalg.norm(v), rel=1e-13, abs=tol
        )


# ------------------------------------------------------------- 3. shrink
@settings(max_examples=40, deadline=None)
@given(parameter_rounds(), st.floats(0.0, 1.0), st.sampled_from([None, ("w", "new")]))
def test_parameter_space_shrink_is_linear(case, factor, keys):
    reference, clients = case
    space = ParameterSpace(reference, keys)
    assert space.linear
    for i, arrays in enumerate(clients):
        update = _update(i, arrays)
        moved = space.shrink(update, factor)
        assert set(moved.arrays) == set(arrays) and moved.node_id == i
        for key, x in arrays.items():
            if keys is not None and key not in keys:
                assert moved.arrays[key] is x  # not measured: left alone
                continue
            ref = reference.get(key, torch.zeros_like(x))
            torch.testing.assert_close(
                moved.arrays[key], ref + factor * (x - ref), rtol=1e-15, atol=1e-15
            )
        norm = space.norm(update)
        assert space.norm(moved) == pytest.approx(factor * norm, rel=1e-13, abs=1e-14)


@settings(max_examples=40, deadline=None)
@given(product_rounds(equal_ranks=True), st.floats(0.0, 1.0))
def test_product_space_shrink_interpolates_factors(case, factor):
    reference, pairs, clients = case
    space = ProductSpace(reference, pairs)
    assert not space.linear
    for i, arrays in enumerate(clients):
        moved = space.shrink(_update(i, arrays), factor)
        assert set(moved.arrays) == set(arrays)
        for key, x in arrays.items():
            ref = reference.get(key, torch.zeros_like(x)).to(F64)
            assert moved.arrays[key].dtype == x.dtype
            expected = (ref + factor * (x.to(F64) - ref)).to(x.dtype)
            torch.testing.assert_close(moved.arrays[key], expected)
        # The moved update's norm is the dense one of the interpolated factors.
        dense = _dense_product_vector(moved.arrays, reference, pairs)
        scale = _product_scale(moved.arrays, reference, pairs)
        assert (
            abs(space.norm(moved) ** 2 - float(dense @ dense)) <= 512 * EPS * scale**2
        )
    # The ends: factor 1 is the update, factor 0 the reference (norm 0).
    update = _update(0, clients[0])
    assert space.norm(space.shrink(update, 1.0)) == pytest.approx(
        space.norm(update), rel=1e-12
    )
    assert space.norm(space.shrink(update, 0.0)) <= 1e-6 * _product_scale(
        clients[0], reference, pairs
    )


# ----------------------------------------------- 4. geometric median weights
@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 7),  # points
    st.integers(1, 5),  # dimension
    st.integers(0, 2**16),  # seed
    st.booleans(),  # weighted
)
def test_geometric_median_weights_give_the_geometric_median(k, dim, seed, weighted):
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((k, dim))
    w = rng.uniform(0.1, 2.0, k) if weighted else np.ones(k)
    assume(not _near_vertex(points, w))  # see the xfail test below
    alpha = geometric_median_weights(torch.from_numpy(points @ points.T), w.tolist())
    assert alpha.dtype == F64 and alpha.shape == (k,)
    assert bool((alpha >= 0).all())
    assert float(alpha.sum()) == pytest.approx(1.0, abs=1e-12)
    z = alpha.numpy() @ points
    got = _gm_objective(z, points, w)
    best = _scipy_median_value(points, w)
    assert got <= best * (1 + 1e-8) + 1e-12


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dim", [1, 3, 8])
def test_geometric_median_ignores_a_huge_outlier(seed, dim):
    """An update 1e30 times the others: its weight is ~1e-30 and ``z`` is the
    honest points' median pulled by a unit force towards the outlier (the
    limit of ``||x_out - z|| = ||x_out|| - <d, z> + O(1e-30)``)."""
    rng = np.random.default_rng(seed)
    honest = rng.standard_normal((6, dim))
    d = rng.standard_normal(dim)
    d /= np.linalg.norm(d)
    points = np.vstack([honest[:3], 1e30 * d, honest[3:]])
    alpha = geometric_median_weights(torch.from_numpy(points @ points.T), [1.0] * 7)
    assert bool((alpha >= 0).all()) and float(alpha.sum()) == pytest.approx(1.0)
    assert float(alpha[3]) < 1e-20
    z = alpha.numpy() @ points
    assert np.linalg.norm(z) <= np.linalg.norm(honest, axis=1).max() + 1.0

    def limit(v: np.ndarray) -> float:
        return float(np.linalg.norm(honest - v, axis=1).sum() - d @ v)

    ref = _scipy_median_value(honest, np.ones(6), pull=d)
    scale = np.linalg.norm(honest, axis=1).sum()
    assert limit(z) <= ref + 1e-8 * scale


def test_geometric_median_at_a_data_point_is_exact():
    """Kuhn's criterion: a point whose weight beats the others' pull is the
    median, and its weight is 1 (Weiszfeld alone only creeps towards it)."""
    points = np.array([[2.04], [-2.56], [0.42]])  # 1-D, weight 0.5009 at 2.04
    w = [1.2061, 0.2788, 0.9229]
    assert _vertex_pulls(points, np.asarray(w))[0] < 1
    alpha = geometric_median_weights(torch.from_numpy(points @ points.T), w)
    assert alpha.tolist() == [1.0, 0.0, 0.0]
    # Fermat point of a triangle with an angle of 150 degrees: that vertex.
    angle = math.radians(150)
    tri = np.array([[0.0, 0.0], [1.0, 0.0], [math.cos(angle), math.sin(angle)]])
    alpha = geometric_median_weights(torch.from_numpy(tri @ tri.T), [1.0] * 3)
    assert alpha.tolist() == [1.0, 0.0, 0.0]
    # Clients sharing the median point share its weight.
    dup = np.array([[1.0, 1.0], [1.0, 1.0], [3.0, -1.0], [0.0, 4.0]])
    alpha = geometric_median_weights(torch.from_numpy(dup @ dup.T), [1.0, 3.0, 1, 1])
    assert alpha.tolist() == [0.25, 0.75, 0.0, 0.0]
    # Two clients (a segment of medians) keep both: no vertex is singled out.
    two = np.array([[0.0, 1.0], [2.0, 0.0]])
    alpha = geometric_median_weights(torch.from_numpy(two @ two.T), [1.0, 1.0])
    torch.testing.assert_close(alpha, torch.tensor([0.5, 0.5], dtype=F64))


@pytest.mark.xfail(
    strict=True,
    reason="Weiszfeld converges sublinearly when the median lies just off a "
    "data point: 500 iterations leave a 2e-6 relative objective gap here",
)
def test_geometric_median_just_off_a_data_point():
    points = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    w = np.array([1.414, 1.0, 1.0])  # Kuhn's ratio at the origin: 1.00015
    alpha = geometric_median_weights(torch.from_numpy(points @ points.T), w.tolist())
    got = _gm_objective(alpha.numpy() @ points, points, w)
    assert got <= _scipy_median_value(points, w) * (1 + 1e-8)


def test_geometric_median_of_one_or_equal_points():
    x = torch.tensor([[1.0, 2.0]], dtype=F64)
    assert geometric_median_weights(x @ x.T, [3.0]).tolist() == [1.0]
    same = torch.ones(4, 3, dtype=F64)
    alpha = geometric_median_weights(same @ same.T, [1.0, 2.0, 3.0, 4.0])
    assert float(alpha.sum()) == pytest.approx(1.0) and bool((alpha >= 0).all())
    zero = torch.zeros(3, 3, dtype=F64)
    assert float(geometric_median_weights(zero, [1.0] * 3).sum()) == pytest.approx(1.0)


# ---------------------------------------------------------- 5. cap_shares
@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=8),
    st.floats(0.01, 1.0),
)
def test_cap_shares_is_water_filling(weights, cap):
    shares = cap_shares(weights, cap)
    k = len(weights)
    assert shares.dtype == F64 and shares.shape == (k,)
    assert float(shares.sum()) == pytest.approx(1.0, abs=1e-12)
    plain = np.asarray(weights) / sum(weights)
    if cap * k < 1:
        np.testing.assert_allclose(shares.numpy(), np.full(k, 1.0 / k), rtol=1e-15)
        return
    assert float(shares.max()) <= cap + 1e-12
    if plain.max() <= cap:
        np.testing.assert_allclose(shares.numpy(), plain, rtol=1e-12)
    np.testing.assert_allclose(
        shares.numpy(), _water_filling(weights, cap), rtol=1e-9, atol=1e-12
    )
    free = shares.numpy() < cap - 1e-12
    if free.sum() > 1:  # proportional among the uncapped
        ratio = shares.numpy()[free] / np.asarray(weights)[free]
        np.testing.assert_allclose(ratio, ratio[0], rtol=1e-12)
    # Nobody uncapped outweighs anybody capped; uncapped shares only grow.
    if free.any() and (~free).any():
        assert np.asarray(weights)[~free].min() >= np.asarray(weights)[free].max()
    assert bool((shares.numpy()[free] >= plain[free] * (1 - 1e-12)).all())


def test_cap_shares_examples():
    torch.testing.assert_close(
        cap_shares([8.0, 1.0, 1.0], 0.5), torch.tensor([0.5, 0.25, 0.25], dtype=F64)
    )
    torch.testing.assert_close(
        cap_shares([1.0, 1.0, 1.0], 0.2), torch.full((3,), 1 / 3, dtype=F64)
    )
    torch.testing.assert_close(
        cap_shares([1.0, 3.0], 1.0), torch.tensor([0.25, 0.75], dtype=F64)
    )


# ----------------------------------------------------- 6. robust_aggregate
def _parameter_updates(seed: int, k: int, dim: int, boost: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    reference = {"x": torch.randn(dim, generator=g, dtype=F64)}
    ns = torch.randint(1, 50, (k,), generator=g).tolist()
    updates = [
        _update(
            10 + i,
            {"x": reference["x"] + torch.randn(dim, generator=g, dtype=F64)},
            ns[i],
        )
        for i in range(k)
    ]
    if boost != 1.0:
        last = updates[-1]
        updates[-1] = _update(
            last.node_id,
            {"x": reference["x"] + boost * (last.arrays["x"] - reference["x"])},
            last.num_examples,
        )
    return reference, updates


def _points(updates, reference) -> np.ndarray:
    return np.stack([(u.arrays["x"] - reference["x"]).numpy() for u in updates])


def test_robust_none_keeps_updates_and_weights():
    reference, updates = _parameter_updates(0, 5, 4, boost=100.0)
    out = robust_aggregate(updates, ParameterSpace(reference), RobustConfig())
    assert [u.node_id for u in out.updates] == [u.node_id for u in updates]
    for before, after in zip(updates, out.updates, strict=True):
        assert after.arrays is before.arrays
        assert after.weight == pytest.approx(before.num_examples, rel=1e-15)
    assert out.reasons == []
    total = sum(u.num_examples for u in updates)
    assert out.metrics == {
        "robust-clipped": 0.0,
        "robust-trimmed": 0.0,
        "robust-capped": 0.0,
        "robust-max-share": pytest.approx(max(u.num_examples for u in updates) / total),
    }


def test_robust_aggregate_of_no_updates():
    for rule in ("none", "norm-clip", "trimmed-mean", "median"):
        out = robust_aggregate([], ParameterSpace({}), RobustConfig(rule=rule))
        assert out.updates == [] and out.reasons == []


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 7),
    st.integers(1, 5),
    st.integers(0, 2**16),
    st.floats(1.0, 1e4),
    st.floats(0.1, 5.0),
)
def test_norm_clip_bounds_parameter_updates(k, dim, seed, boost, bound):
    reference, updates = _parameter_updates(seed, k, dim, boost)
    space = ParameterSpace(reference)
    norms = [space.norm(u) for u in updates]
    out = robust_aggregate(updates, space, RobustConfig("norm-clip", clip_norm=bound))
    clipped = [
        u.node_id for u, n in zip(updates, norms, strict=True) if n > bound * (1 + 1e-9)
    ]
    assert out.metrics["robust-clipped"] == len(clipped)
    assert [r.split(":")[0] for r in out.reasons] == [f"node {i}" for i in clipped]
    for before, after, norm in zip(updates, out.updates, norms, strict=True):
        assert after.weight == pytest.approx(before.num_examples, rel=1e-14)
        got = space.norm(after)
        assert got <= bound * (1 + 1e-9)
        if before.node_id in clipped:  # linear: moved exactly onto the bound
            assert got == pytest.approx(bound, rel=1e-9)
            direction = after.arrays["x"] - reference["x"]
            torch.testing.assert_close(
                direction, (before.arrays["x"] - reference["x"]) * (bound / norm)
            )
        else:
            assert after.arrays is before.arrays


@settings(max_examples=40, deadline=None)
@given(product_rounds(equal_ranks=True), st.floats(0.05, 1.0), st.floats(1.0, 100.0))
def test_norm_clip_bounds_product_updates_by_bisection(case, fraction, boost):
    reference, pairs, clients = case
    updates = []
    for i, arrays in enumerate(clients):  # boost the factors' change
        moved = {}
        for key, x in arrays.items():
            ref = reference.get(key, torch.zeros_like(x))
            moved[key] = ref + (boost if i == 0 else 1.0) * (x - ref)
        updates.append(_update(i, moved))
    space = ProductSpace(reference, pairs)
    norms = [space.norm(u) for u in updates]
    bound = fraction * max(norms)
    out = robust_aggregate(updates, space, RobustConfig("norm-clip", clip_norm=bound))
    clipped = {
        u.node_id for u, n in zip(updates, norms, strict=True) if n > bound * (1 + 1e-9)
    }
    assert out.metrics["robust-clipped"] == len(clipped)
    assert {int(r.split(":")[0].removeprefix("node ")) for r in out.reasons} == clipped
    for before, after in zip(updates, out.updates, strict=True):
        assert space.norm(after) <= bound * (1 + 1e-9)
        # The dense product of the moved factors agrees.
        dense = _dense_product_vector(after.arrays, reference, pairs)
        scale = _product_scale(after.arrays, reference, pairs)
        assert float(dense @ dense) <= (bound * (1 + 1e-9)) ** 2 + 512 * EPS * scale**2
        if before.node_id not in clipped:
            assert after.arrays is before.arrays


@pytest.mark.parametrize("seed", range(8))
def test_norm_clip_bound_holds_for_float32_arrays(seed):
    """``ref + g (x - ref)`` rounded to float32 can land past the bound when
    ``|ref| >> |x - ref|``; the clip must still hold (to float32 resolution
    below it)."""
    g = torch.Generator().manual_seed(seed)
    reference = {"x": 100 * torch.randn(1000, generator=g)}
    updates = [
        _update(
            i,
            {
                "x": reference["x"]
                + (50.0 if i == 0 else 1.0) * torch.randn(1000, generator=g)
            },
        )
        for i in range(3)
    ]
    space = ParameterSpace(reference)
    bound = 100.0  # the honest updates have norm ~32
    out = robust_aggregate(updates, space, RobustConfig("norm-clip", clip_norm=bound))
    moved = out.updates[0]
    assert moved.arrays["x"].dtype == torch.float32
    assert bound * (1 - 1e-4) <= space.norm(moved) <= bound * (1 + 1e-9)
    assert out.metrics["robust-clipped"] == 1.0


@pytest.mark.parametrize("k", [3, 4, 5, 6])
def test_norm_clip_zero_uses_the_median_norm(k):
    reference, updates = _parameter_updates(7, k, 3)
    space = ParameterSpace(reference)
    norms = sorted(space.norm(u) for u in updates)
    out = robust_aggregate(updates, space, RobustConfig("norm-clip", clip_norm=0.0))
    after = sorted(space.norm(u) for u in out.updates)
    # The bound is a median: the lower half is untouched, the rest sit on it.
    lower, upper = norms[(k - 1) // 2], norms[k // 2]
    assert lower * (1 - 1e-12) <= after[-1] <= upper * (1 + 1e-12)
    assert out.metrics["robust-clipped"] == k // 2
    assert after[: (k + 1) // 2] == pytest.approx(norms[: (k + 1) // 2], rel=1e-12)


@pytest.mark.parametrize("space_kind", ["parameters", "products"])
def test_norm_clip_of_a_non_finite_norm_is_factor_zero(space_kind):
    g = torch.Generator().manual_seed(5)
    if space_kind == "parameters":
        reference = {"x": torch.randn(4, generator=g, dtype=F64)}
        space = ParameterSpace(reference)
        honest = [{"x": torch.randn(4, generator=g, dtype=F64)} for _ in range(3)]
        attack = {"x": torch.full((4,), 1e300, dtype=F64)}
    else:
        reference = {
            "A": torch.randn(2, 3, generator=g, dtype=F64),
            "B": torch.randn(4, 2, generator=g, dtype=F64),
        }
        space = ProductSpace(reference, [("A", "B")])
        honest = [
            {
                "A": torch.randn(2, 3, generator=g, dtype=F64),
                "B": torch.randn(4, 2, generator=g, dtype=F64),
            }
            for _ in range(3)
        ]
        attack = {
            "A": torch.full((2, 3), 1e300, dtype=F64),
            "B": torch.full((4, 2), 1e300, dtype=F64),
        }
    updates = [_update(i, a) for i, a in enumerate([*honest, attack])]
    assert not math.isfinite(space.norm(updates[-1]))
    for bound in (0.0, 1.0):
        out = robust_aggregate(
            updates, space, RobustConfig("norm-clip", clip_norm=bound)
        )
        moved = out.updates[-1]
        for key, ref in reference.items():
            torch.testing.assert_close(moved.arrays[key], ref, rtol=0, atol=0)
        assert space.norm(moved) == 0.0
        assert any(r.startswith("node 3:") and "factor 0" in r for r in out.reasons)
    # median and trimmed-mean leave it out (its norm ranks nothing).
    for rule in ("median", "trimmed-mean"):
        out = robust_aggregate(updates, space, RobustConfig(rule, trim_fraction=0.0))
        assert [u.node_id for u in out.updates] == [0, 1, 2]
        assert out.metrics["robust-trimmed"] == 1.0
        assert any(r.startswith("node 3:") for r in out.reasons)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(2, 4),
    st.integers(0, 2**16),
    st.integers(0, 49),  # trim fraction, per cent
    st.sampled_from([1.0, 30.0, 1e30]),
)
def test_trimmed_mean_removes_the_farthest_from_the_median(
    k, dim, seed, percent, boost
):
    reference, updates = _parameter_updates(seed, k, dim, boost)
    space = ParameterSpace(reference)
    config = RobustConfig("trimmed-mean", trim_fraction=percent / 100)
    out = robust_aggregate(updates, space, config)
    n_trim = min(math.ceil(Fraction(percent, 100) * k), (k - 1) // 2)
    kept_ids = [u.node_id for u in out.updates]
    assert len(kept_ids) == k - n_trim and out.metrics["robust-trimmed"] == n_trim
    assert kept_ids == sorted(kept_ids)  # order kept
    by_id = {u.node_id: u for u in updates}
    for u in out.updates:  # weights unchanged
        assert u.weight == pytest.approx(by_id[u.node_id].num_examples, rel=1e-14)
        assert u.arrays is by_id[u.node_id].arrays
    trimmed = [u.node_id for u in updates if u.node_id not in kept_ids]
    assert (
        sorted(int(r.split(":")[0].removeprefix("node ")) for r in out.reasons)
        == trimmed
    )
    if n_trim == 0:
        return
    # The trimmed are the farthest from the geometric median (ties aside).
    points = _points(updates, reference)
    alpha = geometric_median_weights(torch.from_numpy(points @ points.T), [1.0] * k)
    z = alpha.numpy() @ points
    ones = np.ones(k)
    if boost == 1e30:
        assert 10 + k - 1 in trimmed
    elif not _near_vertex(points, ones):  # the median itself, against scipy
        value = _scipy_median_value(points, ones)
        assert _gm_objective(z, points, ones) <= value * (1 + 1e-8)
    dist = {
        u.node_id: float(np.linalg.norm(p - z))
        for u, p in zip(updates, points, strict=True)
    }
    nearest_trimmed = min(dist[i] for i in trimmed)
    farthest_kept = max(dist[i] for i in kept_ids)
    assert nearest_trimmed >= farthest_kept * (1 - 1e-6)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 7),
    st.integers(1, 4),
    st.integers(0, 2**16),
    st.sampled_from([1.0, 20.0, 1e30]),
)
def test_median_weights_are_the_geometric_median_weights(k, dim, seed, boost):
    reference, updates = _parameter_updates(seed, k, dim, boost)
    space = ParameterSpace(reference)
    out = robust_aggregate(updates, space, RobustConfig("median"))
    alpha = geometric_median_weights(space.gram(updates), [1.0] * k)
    keep = alpha >= 1e-6
    total = sum(u.num_examples for u in updates)
    assert [u.node_id for u in out.updates] == [
        u.node_id for u, kp in zip(updates, keep, strict=True) if kp
    ]
    expected = alpha[keep] / alpha[keep].sum() * total
    got = torch.tensor([u.weight for u in out.updates], dtype=F64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    assert out.metrics["robust-trimmed"] == int((~keep).sum())
    assert out.metrics["robust-max-share"] == pytest.approx(
        float(expected.max() / total)
    )
    left_out = {u.node_id for u, kp in zip(updates, keep, strict=True) if not kp}
    assert left_out <= {int(r.split(":")[0].removeprefix("node ")) for r in out.reasons}
    points = _points(updates, reference)
    if boost == 1e30:
        if k >= 3:  # two points: any point between them is a median
            assert 10 + k - 1 in left_out
        return
    # The aggregate is the (unweighted) geometric median, whatever the counts.
    z = (
        sum(
            u.weight * p
            for u, p in zip(out.updates, _points(out.updates, reference), strict=True)
        )
        / total
    )
    ones = np.ones(k)
    if not _near_vertex(points, ones):
        value = _scipy_median_value(points, ones)
        assert _gm_objective(z, points, ones) <= value * (1 + 1e-8)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 7),
    st.integers(0, 2**16),
    st.sampled_from(["none", "norm-clip", "trimmed-mean", "median"]),
    st.integers(5, 100),  # cap, per cent
)
def test_max_client_weight_caps_shares_after_the_rule(k, seed, rule, percent):
    reference, updates = _parameter_updates(seed, k, 3, boost=10.0)
    space = ParameterSpace(reference)
    cap = percent / 100
    plain = robust_aggregate(updates, space, RobustConfig(rule, trim_fraction=0.3))
    out = robust_aggregate(
        updates, space, RobustConfig(rule, trim_fraction=0.3, max_client_weight=cap)
    )
    assert [u.node_id for u in out.updates] == [u.node_id for u in plain.updates]
    before = np.array([u.weight for u in plain.updates])
    total = before.sum()
    got = np.array([u.weight for u in out.updates])
    assert got.sum() == pytest.approx(total, rel=1e-12)
    shares = got / total
    n = len(before)
    if cap * n >= 1:
        assert shares.max() <= cap + 1e-12
        np.testing.assert_allclose(
            shares, _water_filling(before.tolist(), cap), rtol=1e-9
        )
    else:
        np.testing.assert_allclose(shares, np.full(n, 1 / n), rtol=1e-12)
    capped = int((shares < before / total - 1e-12).sum())
    assert out.metrics["robust-capped"] == capped
    assert sum("max-client-weight" in r for r in out.reasons) == capped
    assert out.metrics["robust-max-share"] == pytest.approx(shares.max(), rel=1e-12)
    for key in ("robust-clipped", "robust-trimmed"):
        assert out.metrics[key] == plain.metrics[key]


# ------------------------------------------------------------ 7. RobustConfig
@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"rule": "mean"}, "robust"),
        ({"rule": ""}, "robust"),
        ({"clip_norm": -1.0}, "clip-norm"),
        ({"clip_norm": math.nan}, "clip-norm"),
        ({"clip_norm": math.inf}, "clip-norm"),
        ({"trim_fraction": -0.1}, "trim-fraction"),
        ({"trim_fraction": 0.5}, "trim-fraction"),
        ({"trim_fraction": math.nan}, "trim-fraction"),
        ({"max_client_weight": 0.0}, "max-client-weight"),
        ({"max_client_weight": -0.5}, "max-client-weight"),
        ({"max_client_weight": 1.5}, "max-client-weight"),
        ({"max_client_weight": math.nan}, "max-client-weight"),
    ],
)
def test_robust_config_names_the_bad_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        RobustConfig(**kwargs)
    assert err.value.key == key
    assert key in str(err.value)


def test_robust_config_accepts_the_edges_and_knows_when_it_is_active():
    assert not RobustConfig().active
    RobustConfig(clip_norm=0.0, trim_fraction=0.0, max_client_weight=1.0)
    assert RobustConfig(trim_fraction=0.49, max_client_weight=1e-3).active
    for rule in robust.registered_rules():
        assert RobustConfig(rule.name).active == (rule.name != "none")
