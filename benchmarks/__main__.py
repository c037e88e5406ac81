"""Run every benchmark: ``python -m benchmarks`` (``make bench``).

``FEDLR_BENCH_QUICK=1`` shortens the slow ones (bench_scale stops at 100
clients).
"""

from __future__ import annotations

from benchmarks import (
    bench_fot,
    bench_lowrank,
    bench_qrmix,
    bench_scale,
    bench_sorf,
    bench_svd,
    bench_svd_family,
)

BENCHMARKS = (
    bench_lowrank,
    bench_svd,
    bench_svd_family,
    bench_sorf,
    bench_qrmix,
    bench_fot,
    bench_scale,
)


def main() -> None:
    """Run all benchmarks and print their tables."""
    for bench in BENCHMARKS:
        bench.main()
        print()


if __name__ == "__main__":
    main()
