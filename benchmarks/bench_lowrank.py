"""FedEx residual fold and Frobenius gap: stacked factors vs the dense formula.

The dense reference forms every client's ``B_i @ A_i`` (d_out x d_in), sums
them, subtracts ``B_bar @ A_bar`` and (for the gap) takes the norm of the
dense residual. The factored kernels use the stacked factors of
:mod:`fedlr.linalg.lowrank`. Both run in the same process on the same
inputs; the table prints time ratios (dense / factored) and the relative
error of the factored result against a float64 dense reference.

Run: ``python -m benchmarks.bench_lowrank`` (or ``make bench``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fedlr.linalg import factored_frobenius_norm, fold_residual, residual_factors

CASES = ((768, 8, 10), (4096, 16, 10))  # (d, r, clients)


def _best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _dense_residual(
    bs: list[torch.Tensor], as_: list[torch.Tensor], w: torch.Tensor
) -> torch.Tensor:
    mean = torch.zeros(bs[0].shape[0], as_[0].shape[1], dtype=bs[0].dtype)
    for wi, b, a in zip(w, bs, as_, strict=True):
        mean += float(wi) * (b @ a)
    b_bar, a_bar = torch.zeros_like(bs[0]), torch.zeros_like(as_[0])
    for wi, b, a in zip(w, bs, as_, strict=True):
        b_bar += float(wi) * b
        a_bar += float(wi) * a
    return mean - b_bar @ a_bar


def run_case(d: int, r: int, k: int, seed: int = 0) -> dict[str, float]:
    """Time the fold and the gap at one size; float32 inputs."""
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d, r, generator=g) for _ in range(k)]
    as_ = [torch.randn(r, d, generator=g) for _ in range(k)]
    w0 = torch.randn(d, d, generator=g)
    weights = torch.rand(k, generator=g) + 0.5
    w = weights / weights.sum()
    scaling = 2.0

    reference = w0.double() + scaling * _dense_residual(
        [b.double() for b in bs], [a.double() for a in as_], w.double()
    )

    t_dense_fold = _best_of(lambda: w0 + scaling * _dense_residual(bs, as_, w))
    t_fold = _best_of(lambda: fold_residual(w0, bs, as_, weights, scaling))
    folded = fold_residual(w0, bs, as_, weights, scaling).double()
    fold_err = float(
        torch.linalg.matrix_norm(folded - reference)
        / torch.linalg.matrix_norm(reference)
    )

    dense_gap_ref = float(
        torch.linalg.matrix_norm(
            _dense_residual(
                [b.double() for b in bs], [a.double() for a in as_], w.double()
            )
        )
    )
    t_dense_gap = _best_of(
        lambda: torch.linalg.matrix_norm(_dense_residual(bs, as_, w))
    )
    t_gap = _best_of(
        lambda: factored_frobenius_norm(*residual_factors(bs, as_, weights))
    )
    gap = factored_frobenius_norm(*residual_factors(bs, as_, weights))
    return {
        "d": d,
        "r": r,
        "k": k,
        "fold_dense_s": t_dense_fold,
        "fold_factored_s": t_fold,
        "fold_ratio": t_dense_fold / t_fold,
        "fold_rel_err": fold_err,
        "gap_dense_s": t_dense_gap,
        "gap_factored_s": t_gap,
        "gap_ratio": t_dense_gap / t_gap,
        "gap_rel_err": abs(gap - dense_gap_ref) / dense_gap_ref,
    }


def main() -> None:
    """Print one table row per case."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    header = (
        f"{'d':>5} {'r':>3} {'k':>3} | {'fold dense':>10} {'factored':>9} "
        f"{'ratio':>6} {'rel err':>8} | {'gap dense':>9} {'factored':>9} "
        f"{'ratio':>6} {'rel err':>8}"
    )
    print("FedEx residual fold and Frobenius gap (float32 inputs, best of 3)")
    print(header)
    print("-" * len(header))
    for d, r, k in CASES:
        row = run_case(d, r, k)
        print(
            f"{d:>5} {r:>3} {k:>3} | {row['fold_dense_s']:>9.4f}s "
            f"{row['fold_factored_s']:>8.4f}s {row['fold_ratio']:>5.1f}x "
            f"{row['fold_rel_err']:>8.1e} | {row['gap_dense_s']:>8.4f}s "
            f"{row['gap_factored_s']:>8.4f}s {row['gap_ratio']:>5.1f}x "
            f"{row['gap_rel_err']:>8.1e}"
        )


if __name__ == "__main__":
    main()
