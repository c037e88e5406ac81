"""Truncated SVD of the mean of products: stacked factors vs the dense SVD.

The dense reference forms every client's ``B_i @ A_i`` (d x d), sums them with
the client weights and takes a full SVD of the d x d mean, then truncates to
rank ``r``. The factored kernel (:func:`fedlr.linalg.truncated_svd_of_mean`'s
core, :func:`fedlr.linalg.factored_svd`) takes thin QRs of the stacked
factors and an SVD of the ``k r x k r`` core. Both run in the same process on
the same float32 inputs; the table prints the time ratio (dense / factored)
and the relative error of the factored rank-``r`` approximation against the
dense one, and of its singular values.

Run: ``python -m benchmarks.bench_svd`` (or ``make bench``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fedlr.linalg import factored_svd

CASES = ((768, 8, 10), (4096, 16, 10))  # (d, r, clients)


def _time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _dense_truncated(
    bs: list[torch.Tensor], as_: list[torch.Tensor], w: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.zeros(bs[0].shape[0], as_[0].shape[1], dtype=bs[0].dtype)
    for wi, b, a in zip(w, bs, as_, strict=True):
        mean += float(wi) * (b @ a)
    u, s, vh = torch.linalg.svd(mean, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r], s[:r]


def run_case(d: int, r: int, k: int, seed: int = 0) -> dict[str, float]:
    """Time both paths at one size (float32) and compare their results."""
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d, r, generator=g) for _ in range(k)]
    as_ = [torch.randn(r, d, generator=g) for _ in range(k)]
    weights = torch.rand(k, generator=g) + 0.5
    w = weights / weights.sum()

    def factored() -> torch.Tensor:
        left = torch.cat([float(wi) * b for wi, b in zip(w, bs, strict=True)], 1)
        return factored_svd(left, torch.cat(as_, 0), rank=r).s

    repeat_dense = 1 if d > 2048 else 3
    t_dense = _time(lambda: _dense_truncated(bs, as_, w, r), repeat_dense)
    t_factored = _time(factored, 5)

    dense_approx, dense_s = _dense_truncated(bs, as_, w, r)
    left = torch.cat([float(wi) * b for wi, b in zip(w, bs, strict=True)], 1)
    svd = factored_svd(left, torch.cat(as_, 0), rank=r)
    approx_err = float(
        torch.linalg.matrix_norm(svd.dense() - dense_approx)
        / torch.linalg.matrix_norm(dense_approx)
    )
    sigma_err = float((svd.s - dense_s).abs().max() / dense_s[0])
    return {
        "d": d,
        "r": r,
        "k": k,
        "dense_s": t_dense,
        "factored_s": t_factored,
        "speedup": t_dense / t_factored,
        "approx_rel_err": approx_err,
        "sigma_rel_err": sigma_err,
    }


def main() -> None:
    """Print one line per case."""
    torch.manual_seed(0)
    print("truncated SVD of mean_i w_i B_i A_i (float32): dense SVD vs factored")
    print(
        f"{'d':>5} {'r':>3} {'k':>3} {'dense s':>9} {'factored s':>11} "
        f"{'speedup':>8} {'approx rel err':>15} {'sigma rel err':>14}"
    )
    for d, r, k in CASES:
        row = run_case(d, r, k)
        print(
            f"{d:>5} {r:>3} {k:>3} {row['dense_s']:>9.4f} "
            f"{row['factored_s']:>11.5f} {row['speedup']:>7.1f}x "
            f"{row['approx_rel_err']:>15.2e} {row['sigma_rel_err']:>14.2e}"
        )


if __name__ == "__main__":
    main()
