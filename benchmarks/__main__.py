"""Run every benchmark: ``python -m benchmarks`` (``make bench``)."""

from __future__ import annotations

from benchmarks import (
    bench_fot,
    bench_lowrank,
    bench_qrmix,
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
)


def main() -> None:
    """Run all benchmarks and print their tables."""
    for bench in BENCHMARKS:
        bench.main()
        print()


if __name__ == "__main__":
    main()
