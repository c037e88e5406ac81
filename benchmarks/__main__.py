"""Run every benchmark: ``python -m benchmarks`` (``make bench``)."""

from __future__ import annotations

from benchmarks import bench_fot, bench_lowrank


def main() -> None:
    """Run all benchmarks and print their tables."""
    bench_lowrank.main()
    bench_fot.main()


if __name__ == "__main__":
    main()
