"""Scale: the server kernels of one adapted layer at k = 10, 100, 1000 clients.

Every client sends LoRA factors ``B_i`` (d, r) and ``A_i`` (r, d) in float32
(r = 16, d = 768 and 4096). For each (d, k) the table times, in the path the
cost model picks (:class:`fedlr.linalg.CostModel`):

``floor``
    The in-place dense sum of the k products, ``M = sum_i w_i B_i A_i`` in one
    float32 ``d x d`` buffer, a chunk of clients per GEMM
    (:func:`fedlr.linalg.dense_mean_of_products`): the cheapest exact way to
    touch every client's product, and the unit of the ``x floor`` column.
``fedspec``
    FedSpec's per-layer aggregation: the truncated SVD of ``M`` at the rank
    the rule can reach (18), the rank rule's tail fraction, the rank-16 cut
    and its balanced factors (:func:`fedlr.linalg.svd_of_mean`).
``gap``
    The Frobenius gap every LoRA method logs each round,
    ``||M - B_bar A_bar||_F`` and ``||M||_F``
    (:meth:`fedlr.strategies.lora.LoraStrategy.gap_report`'s per-layer work,
    with no fold to reuse).
``fedex``
    FedEx-LoRA's fold ``W0 + s (M - B_bar A_bar)`` and its (exact) gap.
``global-svd``
    Global SVD's shared factor and k client factors
    (:func:`fedlr.linalg.updates_svd`).

``seconds`` is the best of three timed calls (two at k = 1000) after a small
warm-up in the same process; ``x floor`` divides by the floor measured in the
same run. ``extra MiB`` is the peak resident-set size of the process above
its size with the inputs built (outputs included), from a 1 ms sampling
thread and ``getrusage``'s high-water mark: the OS's count, which sees
torch's allocations (``tracemalloc`` does not). Every case runs in a fresh
subprocess so one case's freed memory does not hide the next one's.
``factors MiB`` is the size of the clients' float32 factors;
``est.`` is the relative error bound of an estimated gap (``-``: exact).

Run: ``python -m benchmarks.bench_scale`` (or ``make bench``). The full table
takes several minutes on 2 cores; ``--quick`` (or ``FEDLR_BENCH_QUICK=1``)
stops at k = 100. ``--threads N`` (or ``FEDLR_BENCH_THREADS``) sets torch's
thread count in every case: on a machine shared with other jobs one thread
gives repeatable times, two threads' times then vary by up to 10x between
identical calls (OpenMP workers waiting for a descheduled sibling).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from fedlr.linalg import (
    DEFAULT_COST_MODEL,
    FACTORED,
    GapNorms,
    StreamedResidual,
    dense_mean_of_products,
    gap_summary,
    stacked_residual,
    svd_of_mean,
    truncate,
    updates_svd,
)

RANK = 16
DIMS = (768, 4096)
CLIENTS = (10, 100, 1000)
QUICK_CLIENTS = (10, 100)
KERNELS = ("floor", "fedspec", "gap", "fedex", "global-svd")
SCALING = 2.0


def _inputs(
    d: int, k: int, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(d, RANK, generator=g) * 0.1 for _ in range(k)]
    as_ = [torch.randn(RANK, d, generator=g) * 0.1 for _ in range(k)]
    w = torch.rand(k, generator=g, dtype=torch.float64) + 0.5
    return bs, as_, w


def _residual(bs: list[torch.Tensor], as_: list[torch.Tensor], w: torch.Tensor) -> Any:
    """The residual the LoRA strategies build (``layer_residuals``'s rule)."""
    d = int(bs[0].shape[0])
    if DEFAULT_COST_MODEL.residual(len(bs), RANK, d, d).path == FACTORED:
        return stacked_residual(bs, as_, w)
    return StreamedResidual(bs, as_, w)


def _kernel(name: str, d: int, k: int) -> Callable[[], dict[str, Any]]:
    bs, as_, w = _inputs(d, k)
    base = torch.randn(d, d, generator=torch.Generator().manual_seed(1)) * 0.02

    def floor() -> dict[str, Any]:
        dense_mean_of_products(bs, as_, w)
        return {"path": "dense"}

    def fedspec() -> dict[str, Any]:
        svd = svd_of_mean(bs, as_, w, RANK + 2, seed=k)
        svd.tail_fraction_at(RANK)
        b, a = truncate(svd, RANK).split_sqrt()
        b.float(), a.float()
        path = DEFAULT_COST_MODEL.svd_of_mean(k, RANK, d, d, RANK + 2).path
        norms = GapNorms(
            math.sqrt(svd.energy_beyond(RANK)),
            math.sqrt(svd.total_energy),
            estimated=svd.energy_estimated,
            gap_sq_error=svd.energy_error,
        )
        return {"path": path, "bound": gap_summary([norms])["gap-error-bound"]}

    def gap() -> dict[str, Any]:
        residual = _residual(bs, as_, w)
        norms = residual.gap_norms()
        path = (
            "factored"
            if not isinstance(residual, StreamedResidual)
            else residual.norms_path().path
        )
        return {"path": path, "bound": gap_summary([norms])["gap-error-bound"]}

    def fedex() -> dict[str, Any]:
        residual = _residual(bs, as_, w)
        residual.fold(base, SCALING)
        norms = residual.gap_norms()
        path = "factored" if not isinstance(residual, StreamedResidual) else "dense"
        return {"path": path, "bound": gap_summary([norms])["gap-error-bound"]}

    def global_svd() -> dict[str, Any]:
        updates_svd(bs, as_, w, RANK, seed=k)
        return {"path": DEFAULT_COST_MODEL.updates_svd(k, RANK, d, d, RANK).path}

    kernels: dict[str, Callable[[], dict[str, Any]]] = {
        "floor": floor,
        "fedspec": fedspec,
        "gap": gap,
        "fedex": fedex,
        "global-svd": global_svd,
    }
    return kernels[name]


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def run_case(name: str, d: int, k: int) -> dict[str, Any]:
    """Time one kernel at one size in this process; peak RSS above the inputs."""
    _kernel(name, 64, 3)()  # warm-up: first-call costs of LAPACK and friends
    fn = _kernel(name, d, k)
    baseline = _rss()
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    info = fn()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grown = after - baseline if after > high_water else 0
    extra = max(peak[0] - baseline, grown, 0)
    for _ in range(2 if k <= 100 else 1):  # best of three (two at k = 1000)
        start = time.perf_counter()
        fn()
        seconds = min(seconds, time.perf_counter() - start)
    return {
        "kernel": name,
        "d": d,
        "k": k,
        "seconds": seconds,
        "extra_bytes": extra,
        "factor_bytes": 2 * k * RANK * d * 4,
        **info,
    }


def _subprocess_case(name: str, d: int, k: int, threads: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.bench_scale", "--case", name]
    out = subprocess.run(
        [*command, str(d), str(k), "--threads", str(threads)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def table(clients: tuple[int, ...], threads: int) -> list[dict[str, Any]]:
    """Every kernel at every size, each in its own subprocess."""
    rows: list[dict[str, Any]] = []
    for d in DIMS:
        for k in clients:
            floor = _subprocess_case("floor", d, k, threads)
            rows.append({**floor, "ratio": 1.0})
            for name in KERNELS[1:]:
                row = _subprocess_case(name, d, k, threads)
                rows.append({**row, "ratio": row["seconds"] / floor["seconds"]})
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def print_table(rows: list[dict[str, Any]], threads: int) -> None:
    """Markdown table (pasted into docs/results.md)."""
    print(
        f"Scale: one adapted layer, r = {RANK}, float32 factors, "
        f"{threads} torch thread(s), torch {torch.__version__}"
    )
    print()
    print(
        "| kernel | d | k | path | seconds | x floor | extra MiB | factors MiB "
        "| extra / factors | est. |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        bound = row.get("bound", 0.0)
        est = f"{bound:.1e}" if bound > 0 else "-"
        print(
            f"| {row['kernel']} | {row['d']} | {row['k']} | {row['path']} "
            f"| {row['seconds']:.3f} | {row['ratio']:.2f} "
            f"| {_mib(row['extra_bytes'])} | {_mib(row['factor_bytes'])} "
            f"| {row['extra_bytes'] / row['factor_bytes']:.2f} | {est} |"
        )


def main(argv: list[str] | None = None) -> None:
    """Print the table (``--quick``: k <= 100) or run one ``--case``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="k up to 100 only")
    parser.add_argument("--case", nargs=3, metavar=("KERNEL", "D", "K"))
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("FEDLR_BENCH_THREADS", torch.get_num_threads())),
        help="torch threads of every case (default FEDLR_BENCH_THREADS or torch's)",
    )
    args = parser.parse_args([] if argv is None else argv)
    torch.set_num_threads(args.threads)
    if args.case is not None:
        name, d, k = args.case
        if name not in KERNELS:
            raise SystemExit(f"unknown kernel {name!r}; one of {KERNELS}")
        print(json.dumps(run_case(name, int(d), int(k))))
        return
    quick = args.quick or os.environ.get("FEDLR_BENCH_QUICK", "") not in ("", "0")
    print_table(table(QUICK_CLIENTS if quick else CLIENTS, args.threads), args.threads)


if __name__ == "__main__":
    main(sys.argv[1:])
