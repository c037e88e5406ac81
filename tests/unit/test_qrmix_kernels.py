"""QR-Mix kernels against dense float64 references and invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.qrmix import (
    ClientEigen,
    fc_flatten,
    fc_hessian_eigenpairs,
    fc_hessian_matvec,
    fc_unflatten,
    qrmix_update,
    subspace_iteration,
)

F64 = torch.float64


def _problem(n: int, f: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g, dtype=F64)
    w = torch.randn(k, f, generator=g, dtype=F64) * 0.5
    b = torch.randn(k, generator=g, dtype=F64) * 0.5
    y = torch.randint(0, k, (n,), generator=g)
    return x, w, b, y


def _loss(
    theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, k: int
) -> torch.Tensor:
    w, b = fc_unflatten(theta, k, x.shape[1])
    return torch.nn.functional.cross_entropy(x @ w.T + b, y)


def _autograd_hvp(x, w, b, y, v):
    theta = fc_flatten(w, b).clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(
        _loss(theta, x, y, w.shape[0]), theta, create_graph=True
    )
    cols = [
        torch.autograd.grad(grad @ v[:, j], theta, retain_graph=True)[0]
        for j in range(v.shape[1])
    ]
    return torch.stack(cols, dim=1)


def _dense_hessian(x, w, b, y):
    theta = fc_flatten(w, b)
    return torch.autograd.functional.hessian(
        lambda t: _loss(t, x, y, w.shape[0]), theta
    )


def test_flatten_roundtrip_bias_first() -> None:
    w = torch.arange(6.0).reshape(2, 3)
    b = torch.tensor([10.0, 20.0])
    flat = fc_flatten(w, b)
    assert flat.tolist() == [10, 20, 0, 1, 2, 3, 4, 5]
    w2, b2 = fc_unflatten(flat, 2, 3)
    assert torch.equal(w2, w) and torch.equal(b2, b)
    with pytest.raises(ShapeMismatchError, match="K=2, F=4"):
        fc_unflatten(flat, 2, 4)
    with pytest.raises(ShapeMismatchError, match="bias"):
        fc_flatten(w, torch.zeros(3))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    f=st.integers(1, 8),
    k=st.integers(2, 6),
    m=st.integers(1, 4),
    block=st.integers(1, 50),
    seed=st.integers(0, 10_000),
)
def test_hvp_matches_autograd(n, f, k, m, block, seed) -> None:
    x, w, b, y = _problem(n, f, k, seed)
    v = torch.randn(
        k * (f + 1), m, generator=torch.Generator().manual_seed(seed + 1), dtype=F64
    )
    closed = fc_hessian_matvec(x, w, b, v, block_size=block)
    reference = _autograd_hvp(x, w, b, y, v)
    torch.testing.assert_close(closed, reference, rtol=0, atol=1e-8)
    single = fc_hessian_matvec(x, w, b, v[:, 0])
    torch.testing.assert_close(single, reference[:, 0], rtol=0, atol=1e-8)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 30),
    f=st.integers(1, 6),
    k=st.integers(2, 5),
    seed=st.integers(0, 10_000),
)
def test_hessian_symmetric_psd_on_probes(n, f, k, seed) -> None:
    x, w, b, _ = _problem(n, f, k, seed)
    p = k * (f + 1)
    probes = torch.randn(p, 6, generator=torch.Generator().manual_seed(seed), dtype=F64)
    gram = probes.T @ fc_hessian_matvec(x, w, b, probes)  # Uᵀ H U
    torch.testing.assert_close(gram, gram.T, rtol=0, atol=1e-12)
    assert float(torch.linalg.eigvalsh(0.5 * (gram + gram.T)).min()) > -1e-12
    # the full operator too: its matrix equals the dense Hessian
    full = fc_hessian_matvec(x, w, b, torch.eye(p, dtype=F64))
    torch.testing.assert_close(full, full.T, rtol=0, atol=1e-12)


def test_hvp_independent_of_labels_and_checks_shapes() -> None:
    x, w, b, y = _problem(20, 4, 3, 0)
    dense = _dense_hessian(x, w, b, y)
    dense_other = _dense_hessian(x, w, b, (y + 1) % 3)
    torch.testing.assert_close(dense, dense_other, rtol=0, atol=1e-12)
    full = fc_hessian_matvec(x, w, b, torch.eye(15, dtype=F64))
    torch.testing.assert_close(full, dense, rtol=0, atol=1e-10)
    with pytest.raises(ShapeMismatchError, match="features"):
        fc_hessian_matvec(x[:, :3], w, b, torch.zeros(15, dtype=F64))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(5, 40),
    f=st.integers(1, 5),
    k=st.integers(2, 5),
    rank=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_eigenpairs_match_eigh_with_full_probe_width(n, f, k, rank, seed) -> None:
    x, w, b, y = _problem(n, f, k, seed)
    p = k * (f + 1)
    rank = min(rank, p)
    values, vectors = fc_hessian_eigenpairs(
        x, w, b, rank, oversample=p, power_iters=1, seed=seed
    )
    exact = torch.linalg.eigvalsh(_dense_hessian(x, w, b, y)).flip(0)[:rank]
    torch.testing.assert_close(values, exact.clamp_min(0), rtol=0, atol=1e-10)
    assert torch.all(values[:-1] >= values[1:])
    torch.testing.assert_close(
        vectors.T @ vectors, torch.eye(rank, dtype=F64), rtol=0, atol=1e-10
    )
    # eigen-equation H v = λ v
    hv = fc_hessian_matvec(x, w, b, vectors)
    torch.testing.assert_close(hv, vectors * values, rtol=0, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(dim=st.integers(8, 40), k=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_subspace_iteration_planted_spectrum(dim, k, seed) -> None:
    # planted: k large eigenvalues, the rest at most 1 (gap >= 100)
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=F64))
    spectrum = torch.cat(
        [
            100.0 * torch.arange(k, 0, -1, dtype=F64) + 100.0,
            torch.rand(dim - k, generator=g, dtype=F64),
        ]
    )
    h = (basis * spectrum) @ basis.T
    values, vectors = subspace_iteration(
        lambda v: h @ v, dim, k, oversample=2, power_iters=4, seed=seed
    )
    torch.testing.assert_close(values, spectrum[:k], rtol=1e-9, atol=0)
    top = basis[:, :k]
    # same subspace: projector difference vanishes
    torch.testing.assert_close(vectors @ vectors.T, top @ top.T, rtol=0, atol=1e-8)


def test_subspace_iteration_rejects_bad_k() -> None:
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        subspace_iteration(lambda v: v, 4, 5)


def _random_clients(c: int, dim: int, k: int, seed: int) -> list[ClientEigen]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(c):
        v, _ = torch.linalg.qr(torch.randn(dim, k, generator=g, dtype=F64))
        lam = torch.rand(k, generator=g, dtype=F64) * 3
        out.append(ClientEigen(v, lam, torch.randn(dim, generator=g, dtype=F64)))
    return out


@settings(max_examples=50, deadline=None)
@given(
    c=st.integers(1, 5),
    dim=st.integers(3, 30),
    k=st.integers(1, 6),
    tau=st.floats(1e-3, 10.0),
    gamma=st.floats(0.1, 2.0),
    seed=st.integers(0, 9999),
)
def test_server_solve_matches_dense_formula(c, dim, k, tau, gamma, seed) -> None:
    k = min(k, dim)
    clients = _random_clients(c, dim, k, seed)
    weights = (
        torch.rand(c, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
    )
    w = weights / weights.sum()
    h = sum(
        wi * (cl.vectors * cl.values) @ cl.vectors.T
        for wi, cl in zip(w, clients, strict=True)
    )
    b = sum(
        wi * (cl.vectors * cl.values) @ (cl.vectors.T @ cl.delta)
        for wi, cl in zip(w, clients, strict=True)
    )
    fisher_dense = gamma * torch.linalg.solve(h + tau * torch.eye(dim, dtype=F64), b)
    fisher = qrmix_update(clients, weights, tau=tau, gamma=gamma, form="fisher")
    literal = qrmix_update(clients, weights, tau=tau, gamma=gamma, form="literal")
    scale = 1.0 + float(fisher_dense.abs().max())
    torch.testing.assert_close(fisher, fisher_dense, rtol=0, atol=1e-9 * scale)
    torch.testing.assert_close(literal, tau * fisher_dense, rtol=0, atol=1e-9 * scale)
    # the source's expression, evaluated densely as written
    q, r = torch.linalg.qr(torch.cat([cl.vectors for cl in clients], dim=1))
    sig = torch.cat([wi * cl.values for wi, cl in zip(w, clients, strict=True)])
    kern = r @ torch.diag(sig) @ r.T
    z = torch.linalg.solve(kern + tau * torch.eye(kern.shape[0], dtype=F64), q.T @ b)
    written = gamma * (tau * q @ z + (b - q @ (q.T @ b)))
    torch.testing.assert_close(literal, written, rtol=0, atol=1e-9 * scale)


@settings(max_examples=30, deadline=None)
@given(
    c=st.integers(1, 4),
    dim=st.integers(2, 20),
    lam=st.floats(0.01, 5.0),
    tau=st.floats(1e-3, 5.0),
    gamma=st.floats(0.1, 2.0),
    seed=st.integers(0, 9999),
)
def test_isotropic_hessian_scales_fedavg(c, dim, lam, tau, gamma, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    clients = []
    for _ in range(c):  # each client its own full orthonormal basis
        v, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=F64))
        clients.append(
            ClientEigen(
                v,
                torch.full((dim,), lam, dtype=F64),
                torch.randn(dim, generator=g, dtype=F64),
            )
        )
    weights = torch.randint(1, 100, (c,), generator=g).to(F64)
    fedavg = sum(
        wi * cl.delta for wi, cl in zip(weights / weights.sum(), clients, strict=True)
    )
    literal = qrmix_update(clients, weights, tau=tau, gamma=gamma, form="literal")
    fisher = qrmix_update(clients, weights, tau=tau, gamma=gamma, form="fisher")
    torch.testing.assert_close(
        literal, gamma * tau * lam / (lam + tau) * fedavg, rtol=1e-9, atol=1e-12
    )
    torch.testing.assert_close(
        fisher, gamma * lam / (lam + tau) * fedavg, rtol=1e-9, atol=1e-12
    )


def test_server_solve_rejects_bad_payloads() -> None:
    clients = _random_clients(2, 6, 2, 0)
    bad = ClientEigen(clients[1].vectors[:5], clients[1].values, clients[1].delta)
    with pytest.raises(ShapeMismatchError, match="client 1"):
        qrmix_update([clients[0], bad], [1, 1], tau=0.1)
    with pytest.raises(ValueError, match="tau"):
        qrmix_update(clients, [1, 1], tau=0.0)
    with pytest.raises(ValueError, match="form"):
        qrmix_update(clients, [1, 1], tau=0.1, form="dense")
