"""Run every benchmark: ``python -m benchmarks`` (``make bench``)."""

from __future__ import annotations

from benchmarks import bench_lowrank, bench_sorf, bench_svd


def main() -> None:
    """Run all benchmarks and print their tables."""
    bench_lowrank.main()
    print()
    bench_svd.main()
    print()
    bench_sorf.main()


if __name__ == "__main__":
    main()
