"""Randomized against exact SVD of the mean of products, and FedSpec's rank rule.

At ``d = 1024``, ``k = 20`` clients of rank ``r = 16`` (rank 18 kept, the
size from which ``svd-solver = "auto"`` takes the randomized range finder for
FedSpec), the clients' factors are built so that their weighted mean of
products has a chosen spectrum (:func:`clients_with_spectrum`). Printed:

1. per spectrum, over 5 seeds, the sine of the largest principal angle
   between the randomized and the exact leading 16-dimensional left singular
   subspaces, and how much less of ``||M||_F^2`` the randomized rank-16
   factors capture than the best rank-16 ones (relative to ``||M||_F^2``);
2. FedSpec's rank rule on a spectrum whose exact tail fraction at rank 16 is
   0.0496 (threshold 0.05) and on one at 0.0504, over 20 seeds: how often
   the rank grew with the point estimate of the randomized tail (the rule
   before ``svd-solver``), and with the rule on bounds under
   ``svd-solver = "auto"`` (and in how many rounds it needed the exact SVD),
   ``"randomized"`` and ``"exact"``.

Run: ``python -m benchmarks.svd_solver`` (about a minute on 2 cores).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedlr.adapters.roles import AdapterLayout, LoraModule
from fedlr.linalg import randomized_svd_of_mean, truncated_svd_of_mean
from fedlr.strategies.base import ClientUpdate
from fedlr.strategies.fedspec import FedSpec

D, K, R = 1024, 20, 16
THRESHOLD = 0.05

__all__ = [
    "clients_with_spectrum",
    "fedspec_round",
    "geometric_spectrum",
    "largest_angle_sine",
]


def clients_with_spectrum(
    spectrum: torch.Tensor, seed: int, *, d: int = D, k: int = K, r: int = R
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """``k`` clients whose weighted mean of products has singular values ``spectrum``.

    ``M = U diag(spectrum) V^T`` with random orthonormal ``U``, ``V``
    (d, k r); client ``i`` holds a random set of ``r`` triplets, mixed by a
    random invertible ``r x r`` matrix: ``B_i = U_i S_i T_i / w_i``,
    ``A_i = T_i^{-1} V_i^T``, so that ``sum_i w_i B_i A_i = M``. Factors in
    float32 (as clients send them); weights ``n_i / sum n`` with integer
    ``n_i`` in [50, 150] (so ``num-examples = n_i`` gives exactly ``w``).
    """
    g = torch.Generator().manual_seed(seed)
    q = k * r
    u, _ = torch.linalg.qr(torch.randn(d, q, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, q, generator=g, dtype=torch.float64))
    examples = torch.randint(50, 151, (k,), generator=g).to(torch.float64)
    w = examples / examples.sum()
    order = torch.randperm(q, generator=g)
    bs, as_ = [], []
    for i in range(k):
        idx = order[i * r : (i + 1) * r]
        mix = torch.randn(r, r, generator=g, dtype=torch.float64)
        mix = mix + 3.0 * torch.eye(r, dtype=torch.float64)
        bs.append(((u[:, idx] * spectrum[idx]) / w[i] @ mix).float())
        as_.append(torch.linalg.solve(mix, v[:, idx].T).float())
    return bs, as_, [int(n) for n in examples]


def geometric_spectrum(tail: float, *, r: int = R, q: int = K * R) -> torch.Tensor:
    """``rho^j`` (``j < q``) whose tail fraction ``sum_{j>=r} / sum`` of the
    squares is ``tail`` (``rho`` by bisection)."""
    low, high = 0.5, 1.0 - 1e-9
    j = torch.arange(q, dtype=torch.float64)
    for _ in range(100):
        rho = (low + high) / 2
        energy = rho ** (2 * j)
        if float(energy[r:].sum() / energy.sum()) < tail:
            low = rho
        else:
            high = rho
    return ((low + high) / 2) ** j


def largest_angle_sine(u1: torch.Tensor, u2: torch.Tensor) -> float:
    """``sin`` of the largest principal angle between ``span(u1)`` and
    ``span(u2)`` (orthonormal columns): ``||(I - u1 u1^T) u2||_2``."""
    u1, u2 = u1.double(), u2.double()
    return float(torch.linalg.matrix_norm(u2 - u1 @ (u1.T @ u2), ord=2))


def fedspec_round(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    examples: Sequence[int],
    *,
    solver: str,
    seed: int,
    threshold: float = THRESHOLD,
) -> dict[str, float]:
    """One FedSpec aggregation of the clients' factors (``examples``: each
    one's ``num-examples``) on a one-layer layout at rank ``R``; returns the
    round's metrics (``rank``, ``tail-energy``,
    ``svd-randomized``...)."""
    d_out, d_in = int(bs[0].shape[0]), int(as_[0].shape[1])
    layout = AdapterLayout(
        modules=(
            LoraModule(
                "l0", "l0.A", "l0.B", "l0.W", 1.0, d_out=d_out, d_in=d_in, rank=R
            ),
        ),
        head_shapes={},
    )
    strategy = FedSpec(
        layout=layout,
        seed=seed,
        fedspec_threshold=threshold,
        fedspec_max_rank=R + 2,
        svd_solver=solver,
    )
    updates = [
        ClientUpdate.of_arrays({"l0.B": b, "l0.A": a}, n, node_id=i)
        for i, (b, a, n) in enumerate(zip(bs, as_, examples, strict=True))
    ]
    current = {"l0.B": bs[0], "l0.A": as_[0]}
    _, report = strategy.aggregate_updates(1, updates, current)
    return dict(report.metrics)


def main() -> None:
    torch.set_num_threads(1)
    j = torch.arange(K * R, dtype=torch.float64)
    spectra = {
        "0.91^j (tail 0.0496)": geometric_spectrum(0.0496),
        "1/j": 1.0 / (1.0 + j),
        "1/sqrt(j)": 1.0 / (1.0 + j).sqrt(),
        "flat 1 - j/2000": 1.0 - j / 2000.0,
    }
    print(f"d = {D}, k = {K}, r = {R}, rank 18 kept; 5 seeds per spectrum")
    print(f"{'spectrum':24s} {'sin(largest angle)':>20s} {'energy deficit':>18s}")
    for name, spectrum in spectra.items():
        sines, deficits = [], []
        for seed in range(5):
            bs, as_, w = clients_with_spectrum(spectrum, seed)
            exact = truncated_svd_of_mean(bs, as_, w)
            approx = randomized_svd_of_mean(bs, as_, w, R + 2, seed=seed + 1)
            sines.append(largest_angle_sine(exact.u[:, :R], approx.u[:, :R]))
            best = float((exact.singular_values[:R].double() ** 2).sum())
            got = float((approx.s[:R] ** 2).sum())
            deficits.append(max(best - got, 0.0) / exact.total_energy)
        print(
            f"{name:24s} {min(sines):9.3f} - {max(sines):6.3f} "
            f"{min(deficits):9.1e} - {max(deficits):7.1e}"
        )
    print()
    print(f"rank growth over 20 seeds, threshold {THRESHOLD}")
    for tail in (0.0496, 0.0504):
        spectrum = geometric_spectrum(tail)
        point = auto = forced = exact_grew = rechecked = 0
        for seed in range(20):
            bs, as_, w = clients_with_spectrum(spectrum, seed)
            approx = randomized_svd_of_mean(bs, as_, w, R + 2, seed=seed + 1)
            point += approx.tail_fraction_at(R) > THRESHOLD
            metrics = fedspec_round(bs, as_, w, solver="auto", seed=seed)
            auto += metrics["rank"] > R
            rechecked += metrics["svd-randomized"] == 0.0
            forced += (
                fedspec_round(bs, as_, w, solver="randomized", seed=seed)["rank"] > R
            )
            exact_grew += (
                fedspec_round(bs, as_, w, solver="exact", seed=seed)["rank"] > R
            )
        print(
            f"exact tail {tail}: point estimate (before) grew {point}/20, "
            f"auto {auto}/20 ({rechecked} decided by the exact SVD), "
            f"randomized {forced}/20, exact {exact_grew}/20"
        )


if __name__ == "__main__":
    main()
