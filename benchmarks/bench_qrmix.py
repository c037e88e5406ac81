"""QR-Mix Hessian-vector products: closed form vs autograd double backward.

The FC layer is 512 -> 10 (``P = 10 * 513 = 5,130`` parameters) on 5,000
samples. The autograd reference builds the gradient of the mean softmax
cross-entropy with ``create_graph=True`` once and back-propagates each probe
direction through it (double backward); the closed form
(:func:`fedlr.linalg.fc_hessian_matvec`) evaluates all directions in one
batched pass. Times are best of 3; the error column is the largest absolute
difference between the two results (float32 inputs, and float64 as a check
that the formulas agree to round-off).

Run: ``python -m benchmarks.bench_qrmix`` (or ``make bench``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fedlr.linalg.qrmix import fc_flatten, fc_hessian_matvec, fc_unflatten

FEATURES, CLASSES, SAMPLES = 512, 10, 5_000
PROBES = (1, 20)  # one direction; k + s = 20 directions (QR-Mix defaults)


def _best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def autograd_hvp(
    features: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    vectors: torch.Tensor,
) -> torch.Tensor:
    """``H @ vectors`` (P, m) by double backward, one direction at a time."""
    theta = fc_flatten(weight, bias).detach().requires_grad_(True)
    w, b = fc_unflatten(theta, weight.shape[0], weight.shape[1])
    loss = torch.nn.functional.cross_entropy(features @ w.T + b, labels)
    (grad,) = torch.autograd.grad(loss, theta, create_graph=True)
    columns = [
        torch.autograd.grad(grad, theta, grad_outputs=vectors[:, j], retain_graph=True)[
            0
        ]
        for j in range(vectors.shape[1])
    ]
    return torch.stack(columns, dim=1)


def run_case(probes: int, dtype: torch.dtype, seed: int = 0) -> dict[str, float]:
    """Time both HVPs for ``probes`` directions; return times, ratio, error."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=dtype)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    w = torch.randn(CLASSES, FEATURES, generator=g, dtype=dtype) * 0.05
    b = torch.randn(CLASSES, generator=g, dtype=dtype) * 0.05
    v = torch.randn(CLASSES * (FEATURES + 1), probes, generator=g, dtype=dtype)
    closed = fc_hessian_matvec(x, w, b, v)
    reference = autograd_hvp(x, y, w, b, v)
    t_closed = _best_of(lambda: fc_hessian_matvec(x, w, b, v))
    t_autograd = _best_of(lambda: autograd_hvp(x, y, w, b, v))
    return {
        "closed_s": t_closed,
        "autograd_s": t_autograd,
        "ratio": t_autograd / t_closed,
        "max_abs_diff": float((closed - reference).abs().max()),
        "max_abs": float(reference.abs().max()),
    }


def main() -> None:
    """Print one row per (probe count, dtype)."""
    print(
        f"QR-Mix FC Hessian-vector product, FC {FEATURES} x {CLASSES}, "
        f"{SAMPLES} samples (best of 3)"
    )
    header = (
        f"{'probes':>6} {'dtype':>7} | {'autograd':>9} {'closed':>9} {'ratio':>7} "
        f"| {'max |diff|':>10} {'max |Hv|':>9}"
    )
    print(header)
    print("-" * len(header))
    for probes in PROBES:
        for dtype in (torch.float32, torch.float64):
            row = run_case(probes, dtype)
            print(
                f"{probes:>6} {str(dtype).split('.')[-1]:>7} | "
                f"{row['autograd_s']:>8.4f}s {row['closed_s']:>8.4f}s "
                f"{row['ratio']:>6.1f}x | {row['max_abs_diff']:>10.2e} "
                f"{row['max_abs']:>9.2e}"
            )


if __name__ == "__main__":
    main()
