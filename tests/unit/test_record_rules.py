"""Records bounded by the robust rules in their own space; the ranked factor space."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.robust.spaces import ParameterSpace, RankedFactorSpace, RecordSpace
from fedlr.wire.updates import ClientUpdate

NAME = "rec"


def _round(attacker: torch.Tensor, k: int = 5) -> list[ClientUpdate]:
    """``k`` updates with equal arrays and a record each: honest records near
    a common one, node 0's record ``attacker``."""
    g = torch.Generator().manual_seed(0)
    common = torch.randn(6, generator=g, dtype=torch.float64)
    out = []
    for node in range(k):
        record = common + 0.1 * torch.randn(6, generator=g, dtype=torch.float64)
        if node == 0:
            record = attacker
        # node 0's arrays are the most central: the arrays' rule keeps it
        arrays = {"w": torch.ones(3) * (1 + 0.01 * (node - 1) ** 2)}
        update = ClientUpdate.of_arrays(arrays, 10, node_id=node)
        out.append(dataclasses.replace(update, extras={NAME: {"r": record}}))
    return out


def _space(reference: torch.Tensor | None = None) -> ParameterSpace:
    space = ParameterSpace({"w": torch.ones(3)})
    ref = None if reference is None else (lambda u: {"r": reference})
    space.records = (RecordSpace(NAME, ref),)
    return space


@pytest.mark.parametrize(
    "rule", ["norm-clip", "median", "trimmed-mean", "centred-clip"]
)
def test_every_rule_bounds_a_hostile_record_and_names_its_node(rule):
    hostile = _round(torch.full((6,), 50.0))
    honest_norms = sorted(float(u.extras[NAME]["r"].norm()) for u in hostile[1:])
    outcome = robust_aggregate(hostile, _space(), RobustConfig(rule=rule))
    (moved,) = [u for u in outcome.updates if u.node_id == 0]
    assert any("node 0: record 'rec'" in r for r in outcome.reasons), outcome.reasons
    assert float(moved.extras[NAME]["r"].norm()) <= 1.01 * honest_norms[-1]
    assert moved.record_factors[NAME] < 0.1
    assert outcome.metrics["robust-records-moved"] >= 1
    # the arrays are the rule's business, untouched here
    assert torch.equal(moved.arrays["w"], hostile[0].arrays["w"])


def test_a_record_moves_towards_its_reference():
    reference = torch.full((6,), 3.0)
    updates = _round(reference + 100.0)
    updates = [
        dataclasses.replace(u, extras={NAME: {"r": u.extras[NAME]["r"] + reference}})
        if u.node_id
        else u
        for u in updates
    ]
    outcome = robust_aggregate(
        updates, _space(reference), RobustConfig(rule="trimmed-mean")
    )
    (moved,) = [u for u in outcome.updates if u.node_id == 0]
    assert torch.allclose(moved.extras[NAME]["r"], reference)


def test_honest_records_are_untouched_by_norm_clip_below_the_median_and_none():
    updates = _round(torch.zeros(6))
    out = robust_aggregate(updates, _space(), RobustConfig(rule="none"))
    assert [u.extras for u in out.updates] == [u.extras for u in updates]
    clipped = robust_aggregate(updates, _space(), RobustConfig(rule="norm-clip"))
    norms = sorted(float(u.extras[NAME]["r"].norm()) for u in updates)
    median = norms[len(norms) // 2]
    for before, after in zip(updates, clipped.updates, strict=True):
        n = float(before.extras[NAME]["r"].norm())
        if n <= median:
            assert torch.equal(after.extras[NAME]["r"], before.extras[NAME]["r"])
        else:
            assert math.isclose(
                float(after.extras[NAME]["r"].norm()), median, rel_tol=1e-6
            )


def test_ranked_factor_space_is_the_zero_padded_change():
    g = torch.Generator().manual_seed(1)
    start = {
        2: {"a": torch.randn(2, 5, generator=g)},
        4: {"a": torch.randn(4, 5, generator=g)},
    }
    updates = [
        ClientUpdate.of_arrays(
            {"a": start[r]["a"] + torch.randn(r, 5, generator=g)}, 1, node_id=r
        )
        for r in (2, 4)
    ]
    space = RankedFactorSpace(lambda u: start[u.node_id])

    def padded(u: ClientUpdate) -> torch.Tensor:
        delta = (u.arrays["a"] - start[u.node_id]["a"]).double()
        return torch.cat(
            [delta, torch.zeros(4 - delta.shape[0], 5, dtype=torch.float64)]
        )

    dense = torch.stack([padded(u).reshape(-1) for u in updates])
    assert torch.allclose(space.gram(updates), dense @ dense.T)
    assert math.isclose(space.norm(updates[1]), float(dense[1].norm()), rel_tol=1e-6)
    half = space.shrink(updates[1], 0.5)
    assert math.isclose(space.norm(half), 0.5 * space.norm(updates[1]), rel_tol=1e-6)
