"""FedSpec's rank rule on a planted spectrum: energy (σ²) against the source's σ."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from fedlr.adapters.roles import AdapterLayout, LoraModule
from fedlr.errors import ConfigError
from fedlr.linalg import factored_svd
from fedlr.strategies.base import ClientUpdate
from fedlr.strategies.fedspec import FedSpec, FedSpecOptions

LAYOUT = AdapterLayout(
    modules=(LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=32, d_in=24, rank=4),),
)


def _planted() -> list[ClientUpdate]:
    """Two equal-weight clients whose mean of products has singular values
    (1, 1, 1, 1, 0.2, 0.2, 0.2, 0.2) on orthonormal directions."""
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(32, 8, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(24, 8, generator=g, dtype=torch.float64)).Q
    updates = []
    for i, sigma in enumerate((1.0, 0.2)):
        cols = slice(4 * i, 4 * i + 4)
        # weight 1/2 each: each client carries twice its part
        b = u[:, cols] * (2 * sigma)
        a = v[:, cols].T
        arrays = {"l0.B": b.float(), "l0.A": a.float()}
        updates.append(ClientUpdate(i, arrays, 10, {}, RecordDict(), 0))
    return updates


def test_planted_spectrum_is_what_the_rule_sees():
    updates = _planted()
    left = torch.cat([0.5 * u.arrays["l0.B"].double() for u in updates], dim=1)
    right = torch.cat([u.arrays["l0.A"].double() for u in updates], dim=0)
    svd = factored_svd(left, right)
    torch.testing.assert_close(
        svd.singular_values[:8],
        torch.tensor([1.0] * 4 + [0.2] * 4, dtype=torch.float64),
        rtol=1e-6,
        atol=1e-6,
    )
    assert svd.tail_fraction_at(4) == pytest.approx(0.16 / 4.16, rel=1e-5)
    assert svd.sigma_fraction_at(4) == pytest.approx(0.8 / 4.8, rel=1e-5)


@pytest.mark.parametrize(("energy", "rank"), [("sigma2", 4), ("sigma", 6)])
def test_energy_rule_decides_the_growth(energy, rank):
    strategy = FedSpec(
        layout=LAYOUT,
        fedspec_threshold=0.05,
        fedspec_max_rank=8,
        fedspec_energy=energy,
    )
    current = {"l0.B": torch.zeros(32, 4), "l0.A": torch.zeros(4, 24)}
    _, report = strategy.aggregate_updates(1, _planted(), current)
    expected_tail = 0.16 / 4.16 if energy == "sigma2" else 0.8 / 4.8
    assert report.metrics["tail-energy"] == pytest.approx(expected_tail, rel=1e-5)
    assert strategy.rank == rank


def test_energy_option_is_checked():
    with pytest.raises(ValueError, match="energy"):
        FedSpec(layout=LAYOUT, fedspec_energy="sigma3")
    with pytest.raises(ConfigError, match="fedspec-energy"):
        FedSpecOptions(fedspec_energy="sigma3").check()


def test_sigma_fraction_counts_unseen_energy_as_its_least_sum():
    svd = factored_svd(
        torch.eye(4, dtype=torch.float64), torch.eye(4, dtype=torch.float64)
    )
    svd = type(svd)(
        u=svd.u,
        s=svd.s,
        vh=svd.vh,
        singular_values=svd.singular_values,
        residual_energy=9.0,
    )
    # values (1, 1, 1, 1) plus sqrt(9) unseen: tail at 2 = (2 + 3) / (4 + 3)
    assert svd.sigma_fraction_at(2) == pytest.approx(5 / 7)
    assert svd.tail_fraction_at(2) == pytest.approx((2 + 9) / (4 + 9))
