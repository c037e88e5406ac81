"""Benchmarks: each kernel against its dense reference, as ratios from one run."""
