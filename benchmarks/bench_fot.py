"""FOT server kernels: GPSE basis expansion and projected aggregation.

GPSE on the server sums the clients' sketches ``Y_i`` of shape ``(d, m)``,
takes one SVD of the sum, picks ``k`` by the energy rule and re-orthonormalises
``[U, Û_k]`` by QR. The benchmark times it at ``d = 1,152`` (3 x 3 x 128 conv
patches) with ``m = d`` and 10 clients, for an empty basis and for a basis
already holding half the dimensions. The projection of an aggregated conv
update ``g`` (256 x 1,152) off ``span(U)`` is timed as ``g - (g U) Uᵀ``
against the dense ``g (I - U Uᵀ)`` that forms the ``d x d`` projector; both
results are compared.

Run: ``python -m benchmarks.bench_fot`` (or ``make bench``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fedlr.linalg.fot import expand_basis, project_update

D = 1152
OUT = 256
CLIENTS = 10


def _best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(seed: int = 0) -> dict[str, float]:
    """Time expansion (empty and half-full basis) and projection at d = 1,152."""
    g = torch.Generator().manual_seed(seed)
    # activations of effective rank 300 spread over the clients
    mix = torch.randn(D, 300, generator=g, dtype=torch.float64)
    sketches = [
        mix @ torch.randn(300, D, generator=g, dtype=torch.float64) / D**0.5
        for _ in range(CLIENTS)
    ]
    half = torch.linalg.qr(torch.randn(D, D // 2, generator=g, dtype=torch.float64))[0]

    def expand(basis: torch.Tensor | None) -> int:
        total = torch.stack(sketches).sum(0)
        return expand_basis(basis, total, 0.9, 0.97)[1]

    k_empty = expand(None)
    k_half = expand(half)
    update = torch.randn(OUT, D, generator=g)
    basis32 = half.float()

    def dense() -> torch.Tensor:
        return update @ (torch.eye(D) - basis32 @ basis32.T)

    err = float(
        torch.linalg.norm(project_update(update, half) - dense())
        / torch.linalg.norm(dense())
    )
    return {
        "expand_empty_s": _best_of(lambda: expand(None)),
        "k_empty": float(k_empty),
        "expand_half_s": _best_of(lambda: expand(half)),
        "k_half": float(k_half),
        "project_s": _best_of(lambda: project_update(update, half), repeat=5),
        "project_dense_s": _best_of(dense, repeat=5),
        "project_rel_err": err,
    }


def main() -> None:
    """Print the GPSE expansion times and the projection ratio."""
    row = run()
    print(
        f"FOT GPSE expansion at d = {D} (3x3x128 patches), m = d, {CLIENTS} clients "
        "(float64, best of 3)"
    )
    print(f"  empty basis:     {row['expand_empty_s']:.3f}s, k = {int(row['k_empty'])}")
    print(f"  basis of {D // 2}: {row['expand_half_s']:.3f}s, k = {int(row['k_half'])}")
    ratio = row["project_dense_s"] / row["project_s"]
    print(
        f"FedProject of a {OUT} x {D} update, k = {D // 2} (float32): "
        f"g - (gU)Uᵀ {row['project_s'] * 1e3:.2f} ms vs dense g(I - UUᵀ) "
        f"{row['project_dense_s'] * 1e3:.2f} ms ({ratio:.1f}x), "
        f"rel diff {row['project_rel_err']:.1e}"
    )


if __name__ == "__main__":
    main()
