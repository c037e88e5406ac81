"""Global SVD's stacked-update SVD: factored kernel vs the dense stack.

The dense reference forms every client's update ``Delta_i = B_i A_i``
(d x d), the weighted input-major stack
``X = [sqrt(w_1) Delta_1^T, ..., sqrt(w_k) Delta_k^T]`` (d x k d) and its SVD,
then the rank-``r`` shared factor and client blocks. The factored kernel
(:func:`fedlr.linalg.stacked_updates_svd`) takes thin QRs of
``[A_1^T ... A_k^T]`` (d x k r) and of the block-diagonal
``blockdiag(sqrt(w_i) B_i^T)`` (k r x k d) and an SVD of the ``k r`` core.
The table prints the time ratio (dense / factored) and the relative
difference of the reconstructed client updates ``B_i' A'`` from one run.

Run: ``python -m benchmarks.bench_svd_family`` (or ``make bench``).
"""

from __future__ import annotations

import time

import torch

from fedlr.linalg import stacked_updates_svd

CASES = ((256, 8, 10), (768, 8, 10))  # (d, r, clients)


def _dense(
    bs: list[torch.Tensor], as_: list[torch.Tensor], w: torch.Tensor, r: int
) -> list[torch.Tensor]:
    d = bs[0].shape[0]
    stack = torch.cat(
        [float(wi) ** 0.5 * (b @ a).T for wi, b, a in zip(w, bs, as_, strict=True)],
        dim=1,
    )
    u, s, vh = torch.linalg.svd(stack, full_matrices=False)
    approx = (u[:, :r] * s[:r]) @ vh[:r]
    return [
        approx[:, i * d : (i + 1) * d].T / float(wi) ** 0.5 for i, wi in enumerate(w)
    ]


def run_case(d: int, r: int, k: int, seed: int = 0) -> dict[str, float]:
    """Time both paths at one size (float64) and compare the client updates."""
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d, r, generator=g, dtype=torch.float64) for _ in range(k)]
    as_ = [torch.randn(r, d, generator=g, dtype=torch.float64) for _ in range(k)]
    weights = torch.rand(k, generator=g, dtype=torch.float64) + 0.5
    w = weights / weights.sum()
    stacked_updates_svd(bs[:2], as_[:2], w[:2], r)  # warm-up (first-call costs)
    start = time.perf_counter()
    dense = _dense(bs, as_, w, r)
    t_dense = time.perf_counter() - start
    start = time.perf_counter()
    a, b_list, _ = stacked_updates_svd(bs, as_, w, r)
    t_factored = time.perf_counter() - start
    err = max(
        float(torch.linalg.matrix_norm(b @ a - ref) / torch.linalg.matrix_norm(ref))
        for b, ref in zip(b_list, dense, strict=True)
    )
    return {
        "d": d,
        "r": r,
        "k": k,
        "dense_s": t_dense,
        "factored_s": t_factored,
        "speedup": t_dense / t_factored,
        "rel_err": err,
    }


def main() -> None:
    """Print one line per case."""
    print("global-svd: SVD of the stacked client updates (float64): dense vs factored")
    print(
        f"{'d':>5} {'r':>3} {'k':>3} {'dense s':>9} {'factored s':>11} "
        f"{'speedup':>8} {'max rel err':>12}"
    )
    for d, r, k in CASES:
        row = run_case(d, r, k)
        print(
            f"{d:>5} {r:>3} {k:>3} {row['dense_s']:>9.4f} "
            f"{row['factored_s']:>11.5f} {row['speedup']:>7.1f}x "
            f"{row['rel_err']:>12.2e}"
        )


if __name__ == "__main__":
    main()
