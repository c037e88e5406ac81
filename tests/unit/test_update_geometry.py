"""benchmarks/update_geometry.py's statistics against dense cosines."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from benchmarks.update_geometry import median_cosines, round_geometry, summary


def _cos(x: np.ndarray, y: np.ndarray) -> float:
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


@pytest.mark.parametrize("seed", range(5))
def test_round_geometry_matches_dense_cosines(seed):
    rng = np.random.default_rng(seed)
    honest = rng.standard_normal((4, 6))
    counts = rng.integers(1, 100, 4)
    mean = counts @ honest / counts.sum()
    reference = rng.standard_normal(6)
    vectors = np.vstack([honest, -mean, reference, mean])
    gram = torch.as_tensor(vectors @ vectors.T, dtype=torch.float64)
    got = round_geometry(gram, [0, 1, 2, 3], 4, 5, 6)
    attacked = [*honest, -mean]
    med = [
        statistics.median(_cos(a, b) for j, b in enumerate(attacked) if j != i)
        for i, a in enumerate(attacked)
    ]
    np.testing.assert_allclose(got["honest-median-cos"], med[:4], atol=1e-4)
    assert got["attacker-median-cos"] == pytest.approx(med[4], abs=1e-4)
    assert got["lowest-honest-below-attacker"] == (min(med[:4]) < med[4])
    np.testing.assert_allclose(
        got["reference-cos"], [_cos(h, reference) for h in honest], atol=1e-4
    )
    assert got["mean-reference-cos"] == pytest.approx(_cos(mean, reference), abs=1e-4)
    clean = [
        statistics.median(_cos(a, b) for j, b in enumerate(honest) if j != i)
        for i, a in enumerate(honest)
    ]
    np.testing.assert_allclose(got["clean-median-cos"], clean, atol=1e-4)


def test_the_negated_mean_opposes_every_update_that_leans_with_the_mean():
    """Nearly orthogonal updates: the attack is the most opposed, and the
    summary says no honest client looked worse."""
    honest = np.eye(4) + 0.05
    mean = honest.mean(0)
    vectors = np.vstack([honest, -mean, mean, mean])
    gram = torch.as_tensor(vectors @ vectors.T, dtype=torch.float64)
    row = round_geometry(gram, [0, 1, 2, 3], 4, 5, 6)
    assert row["attacker-median-cos"] < min(row["honest-median-cos"])
    assert not row["lowest-honest-below-attacker"]
    text = summary([{"seed": 3, **row}])
    assert text.startswith("seed 3: 0 of 1 rounds")
    assert median_cosines(torch.eye(2, dtype=torch.float64), [0, 1]) == [0.0, 0.0]
