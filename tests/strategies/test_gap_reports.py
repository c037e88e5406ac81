"""RoundReport.from_layers and the LoRA gap report that FedEx shares with its fold."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fedlr.strategies.lora as lora_module
from fedlr.adapters import AdapterLayout, LoraModule, Role
from fedlr.linalg import StackedResidual
from fedlr.strategies import FedAvgLoRA, FedExLoRA
from fedlr.strategies.base import ClientUpdate, RoundReport

F64 = torch.float64

LAYOUT = AdapterLayout(
    modules=(
        LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=6, d_in=5, rank=2),
        LoraModule("l1", "l1.A", "l1.B", "l1.W", 0.5, d_out=4, d_in=7, rank=2),
    ),
    head_shapes={"head.w": (2, 5), "head.b": (2,)},
)


def test_from_layers_totals_and_per_layer_ratios() -> None:
    report = RoundReport.from_layers(
        {"a": (3.0, 4.0), "b": (0.0, 0.0), "c": (4.0, 3.0)}, rank=8.0, extra=1.5
    )
    assert list(report.metrics) == ["frobenius-gap", "relative-gap", "rank", "extra"]
    assert report.metrics["frobenius-gap"] == 5.0
    assert report.metrics["relative-gap"] == 1.0
    assert report.metrics["rank"] == 8.0 and report.metrics["extra"] == 1.5
    assert report.layers == {"a": (3.0, 0.75), "b": (0.0, 0.0), "c": (4.0, 4.0 / 3.0)}


def test_from_layers_of_nothing_and_of_zero_norms() -> None:
    assert RoundReport.from_layers({}).metrics == {
        "frobenius-gap": 0.0,
        "relative-gap": 0.0,
    }
    report = RoundReport.from_layers({"x": (0.0, 0.0)})
    assert report.metrics["relative-gap"] == 0.0 and report.layers["x"] == (0.0, 0.0)


def test_from_layers_refuses_to_be_told_the_gaps() -> None:
    with pytest.raises(ValueError, match="relative-gap"):
        RoundReport.from_layers({}, **{"relative-gap": 1.0})


def _updates(k: int) -> list[ClientUpdate]:
    g = torch.Generator().manual_seed(11)
    shapes = LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD)
    return [
        ClientUpdate(
            node_id=i,
            arrays={key: torch.randn(*s, generator=g) for key, s in shapes.items()},
            num_examples=i + 1,
            metrics={},
            content=None,  # type: ignore[arg-type]
            nbytes=0,
        )
        for i in range(k)
    ]


def test_gap_report_matches_dense_and_accepts_precomputed_residuals() -> None:
    strategy = FedAvgLoRA(layout=LAYOUT)
    updates = _updates(3)
    report = strategy.gap_report(updates)
    w = torch.tensor([1.0, 2.0, 3.0], dtype=F64) / 6
    gap_sq = ideal_sq = 0.0
    for m in LAYOUT.modules:
        bs = [u.arrays[m.b_key].double() for u in updates]
        as_ = [u.arrays[m.a_key].double() for u in updates]
        ideal = sum(wi * b @ a for wi, b, a in zip(w, bs, as_, strict=True))
        b_bar = sum(wi * b for wi, b in zip(w, bs, strict=True))
        a_bar = sum(wi * a for wi, a in zip(w, as_, strict=True))
        gap = float(torch.linalg.matrix_norm(ideal - b_bar @ a_bar))
        norm = float(torch.linalg.matrix_norm(ideal))
        assert report.layers[m.name][0] == pytest.approx(gap, rel=1e-12)
        assert report.layers[m.name][1] == pytest.approx(gap / norm, rel=1e-12)
        gap_sq, ideal_sq = gap_sq + gap**2, ideal_sq + norm**2
    assert report.metrics["frobenius-gap"] == pytest.approx(math.sqrt(gap_sq))
    assert report.metrics["relative-gap"] == pytest.approx(math.sqrt(gap_sq / ideal_sq))
    assert report.metrics["rank"] == 2.0
    shared = strategy.gap_report(updates, strategy.layer_residuals(updates))
    assert shared == report


def test_fedex_builds_each_layers_stacked_factors_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    original = lora_module.stacked_residual  # type: ignore[attr-defined]

    def counting(*args: Any, **kwargs: Any) -> StackedResidual:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(lora_module, "stacked_residual", counting)
    strategy = FedExLoRA(layout=LAYOUT)
    updates = _updates(4)
    g = torch.Generator().manual_seed(3)
    current = {k: torch.randn(*s, generator=g) for k, s in LAYOUT.shapes(*Role).items()}
    state, report = strategy.aggregate_updates(1, updates, current)
    assert len(calls) == len(LAYOUT.modules)
    # Same numbers as the gap of plain FedAvg and an exact fold.
    calls.clear()
    assert report.metrics.pop("dense-base-sends") == 0.0  # no instruction sent
    assert report == FedAvgLoRA(layout=LAYOUT).gap_report(updates)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64) / 10
    for m in LAYOUT.modules:
        ideal = sum(
            wi * u.arrays[m.b_key].double() @ u.arrays[m.a_key].double()
            for wi, u in zip(w, updates, strict=True)
        )
        lhs = state[m.base_key].double() + m.scaling * (
            state[m.b_key].double() @ state[m.a_key].double()
        )
        rhs = current[m.base_key].double() + m.scaling * ideal
        err = torch.linalg.matrix_norm(lhs - rhs) / torch.linalg.matrix_norm(rhs)
        assert float(err) < 50 * torch.finfo(torch.float32).eps * 7


def test_fedex_still_names_a_missing_base_weight() -> None:
    strategy = FedExLoRA(layout=LAYOUT)
    current = {k: torch.zeros(*s) for k, s in LAYOUT.shapes(*Role).items()}
    del current["l1.W"]
    with pytest.raises(KeyError, match=r"l1\.W"):
        strategy.aggregate_updates(1, _updates(2), current)
