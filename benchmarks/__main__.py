"""Run every benchmark: ``python -m benchmarks`` (``make bench``)."""

from __future__ import annotations

from benchmarks import (
    bench_fot,
    bench_lowrank,
    bench_qrmix,
    bench_svd,
    bench_svd_family,
)


def main() -> None:
    """Run all benchmarks and print their tables."""
    for bench in (bench_lowrank, bench_svd, bench_svd_family, bench_qrmix, bench_fot):
        bench.main()
        print()


if __name__ == "__main__":
    main()
