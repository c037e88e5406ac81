"""FOT and its FedAvg baseline: mocked replies, validation, an in-process run."""

from __future__ import annotations

import json
import logging
import math
import re

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.clientapp import ClientApp

from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.client_app import app as client_app
from fedlr.linalg.fot import expand_basis, residualise, sketch_residual
from fedlr.server_apps.runner import run_server
from fedlr.strategies import FOT, FedAvgContinual, get_method
from fedlr.wire.protocol import GPSE_EXAMPLES, SKETCHES
from fedlr.wire.protocol import gpse_fraction_key as fraction_key
from tests.strategies.conftest import reply

F64 = torch.float64
SHAPES = {
    "conv.weight": (3, 2, 2, 2),
    "conv.bias": (3,),
    "fc.weight": (4, 6),
    "fc.bias": (4,),
}
DIMS = {"conv": 8, "fc": 6}
SKETCH_DIM = 5


def _fot(**kw) -> FOT:
    args = {
        "shapes": SHAPES,
        "projected": ["conv", "fc"],
        "fot_eps": 0.9,
        "fot_eps_inc": 0.05,
        "fot_sketch_dim": SKETCH_DIM,
        "rounds_per_task": 2,
        "num_tasks": 3,
        "lr": 0.1,
        "lr_decay": 0.5,
    }
    args.update(kw)
    return FOT(**args)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g, dtype=F64) for k, s in SHAPES.items()}


def _orthonormal(d: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, k, generator=g, dtype=F64))[0]


def _configure(strategy, server_round, state, num_nodes: int = 3):
    grid = InProcessGrid(ClientApp(), num_nodes=num_nodes, run_config={})
    return list(
        strategy.configure_train(
            server_round, ArrayRecord(dict(state)), ConfigRecord({"lr": 1.0}), grid
        )
    )


def _sketch_reply(node, arrays, n, sketches, fractions, b=20):
    msg = reply(
        node,
        arrays,
        {
            "num-examples": n,
            "train-loss": 0.5,
            GPSE_EXAMPLES: b,
            **{fraction_key(k): v for k, v in fractions.items()},
        },
    )
    if sketches is not None:
        msg.content[SKETCHES] = state_to_record(sketches)
    return msg


def test_registry_and_round_schedule():
    assert get_method("fot").strategy is FOT
    assert get_method("fedavg-continual").strategy is FedAvgContinual
    assert get_method("fot").payload.name == get_method("fedavg-continual").payload.name
    s = _fot()
    configs = [s.round_config(r) for r in range(1, 7)]
    assert [c["task"] for c in configs] == [0, 0, 1, 1, 2, 2]
    assert [c["gpse-task"] for c in configs] == [-1, -1, 0, -1, 1, -1]
    assert [c["lr"] for c in configs] == [0.1, 0.05] * 3  # restarts every task
    base = FedAvgContinual(shapes=SHAPES, rounds_per_task=2, num_tasks=3, lr=0.1)
    assert "gpse-task" not in base.round_config(3)


def test_bases_travel_only_at_boundaries():
    s = _fot()
    s.bases["fc"] = _orthonormal(6, 2, 0)
    first = _configure(s, 1, _state(0))
    assert "bases" not in first[0].content.array_records
    boundary = _configure(s, 3, _state(0))
    assert all("bases" in m.content.array_records for m in boundary)
    sent = record_to_state(boundary[0].content["bases"])
    assert set(sent) == {"fc"}
    torch.testing.assert_close(sent["fc"], s.bases["fc"])
    assert boundary[0].content["config"]["gpse-task"] == 0
    assert boundary[0].content["config"]["lr"] == 0.1


def test_projected_aggregation_has_no_component_in_span():
    s = _fot()
    s.bases = {"conv": _orthonormal(8, 3, 1), "fc": _orthonormal(6, 2, 2)}
    current = _state(0)
    _configure(s, 2, current)
    clients = [_state(10 + i) for i in range(3)]
    weights = [10, 20, 70]
    replies = [
        reply(1000 + i, c, {"num-examples": n, "train-loss": 0.1})
        for i, (c, n) in enumerate(zip(clients, weights, strict=True))
    ]
    arrays, metrics = s.aggregate_train(2, replies)
    assert arrays is not None and metrics is not None
    new = record_to_state(arrays)
    w = torch.tensor(weights, dtype=F64) / 100
    for key in SHAPES:
        mean = sum(wi * c[key] for wi, c in zip(w, clients, strict=True))
        layer = key.split(".")[0]
        if key.endswith("bias"):
            torch.testing.assert_close(new[key], mean)
            continue
        u = s.bases[layer]
        g = (mean - current[key]).reshape(SHAPES[key][0], -1)
        step = (new[key] - current[key]).reshape(SHAPES[key][0], -1)
        assert float(torch.linalg.norm(step @ u)) < 1e-6
        # dense formula: g (I - U Uᵀ), and the projection is idempotent
        proj = torch.eye(DIMS[layer], dtype=F64) - u @ u.T
        torch.testing.assert_close(step, g @ proj)
        torch.testing.assert_close(step @ proj, step)
    assert 0 < metrics["projected-share"] < 1
    assert metrics["basis-dims"] == 5


def test_boundary_round_expands_bases_from_summed_sketches():
    s = _fot(fot_eps=1.0)
    s.bases = {"fc": _orthonormal(6, 1, 3)}
    current = _state(0)
    _configure(s, 3, current, num_nodes=2)
    g = torch.Generator().manual_seed(5)
    planted = {"conv": torch.randn(8, 2, generator=g, dtype=F64)}
    planted["fc"] = residualise(
        torch.randn(6, 2, generator=g, dtype=F64), s.bases["fc"]
    )
    sums = {k: torch.zeros(d, SKETCH_DIM, dtype=F64) for k, d in DIMS.items()}
    replies = []
    for i in range(2):
        sketches = {}
        for layer in DIMS:
            a = planted[layer] @ torch.randn(2, 30, generator=g, dtype=F64)
            r = residualise(a, s.bases.get(layer))
            y = sketch_residual(r, SKETCH_DIM, torch.Generator().manual_seed(i))
            sketches[layer] = y
            sums[layer] += y
        replies.append(
            _sketch_reply(
                1000 + i, _state(20 + i), 10, sketches, {"conv": 1.0, "fc": 0.7}
            )
        )
    expected = {
        layer: expand_basis(s.bases.get(layer), sums[layer], r, 1.0)
        for layer, r in (("conv", 1.0), ("fc", 0.7))
    }
    old_fc = s.bases["fc"].clone()
    arrays, metrics = s.aggregate_train(3, replies)
    assert arrays is not None and metrics is not None and metrics["dropped"] == 0
    assert math.isclose(s.eps, 1.0)  # capped
    for layer in DIMS:
        basis = s.bases[layer]
        torch.testing.assert_close(basis, expected[layer][0])
        k = basis.shape[1]
        torch.testing.assert_close(basis.T @ basis, torch.eye(k, dtype=F64))
        # the planted directions now lie in span(U)
        assert float(torch.linalg.norm(residualise(planted[layer], basis))) < 1e-8
    assert s.bases["fc"].shape[1] == 3 and s.bases["conv"].shape[1] == 2
    torch.testing.assert_close(s.bases["fc"][:, :1], old_fc)
    assert metrics["basis-added"] == 4
    # the boundary round's update is projected with the extended bases
    new = record_to_state(arrays)
    step = (new["fc.weight"] - current["fc.weight"]) @ s.bases["fc"]
    assert float(torch.linalg.norm(step)) < 1e-6


def _good_sketches():
    return {k: torch.randn(d, SKETCH_DIM, dtype=F64) for k, d in DIMS.items()}


BAD = {
    "missing": (None, {"conv": 0.5, "fc": 0.5}, "no ArrayRecord 'sketches'"),
    "shape": (
        {"conv": torch.zeros(8, 4, dtype=F64), "fc": torch.zeros(6, 5, dtype=F64)},
        {"conv": 0.5, "fc": 0.5},
        r"'sketches' 'conv' has shape \(8, 4\), expected \(8, 5\)",
    ),
    "layer": (
        {"conv": torch.zeros(8, 5, dtype=F64)},
        {"conv": 0.5, "fc": 0.5},
        r"'sketches' has wrong keys: 1 missing \['fc'\]",
    ),
    "nan": (
        {"conv": torch.full((8, 5), math.nan, dtype=F64), "fc": torch.zeros(6, 5)},
        {"conv": 0.5, "fc": 0.5},
        "'sketches' 'conv' contains NaN or Inf",
    ),
    "fraction": (None, {"conv": 1.5, "fc": 0.5}, r"gpse-fraction.conv' must be in"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sketch_reply_is_dropped_with_reason(case, caplog):
    sketches, fractions, reason = BAD[case]
    if case == "fraction":
        sketches = _good_sketches()
    s = _fot()
    _configure(s, 3, _state(0), num_nodes=2)
    replies = [
        _sketch_reply(1000, _state(1), 10, _good_sketches(), {"conv": 0.5, "fc": 0.5}),
        _sketch_reply(1001, _state(2), 10, sketches, fractions),
    ]
    with caplog.at_level(logging.WARNING):
        _, metrics = s.aggregate_train(3, replies)
    assert metrics is not None and metrics["dropped"] == 1 and metrics["clients"] == 1
    assert len(s.round.dropped) == 1 and "node 1001" in s.round.dropped[0]
    assert re.search(reason, s.round.dropped[0]), s.round.dropped
    assert any("node 1001" in r.getMessage() for r in caplog.records)


def test_sketches_outside_boundaries_are_not_required():
    s = _fot()
    _configure(s, 2, _state(0), num_nodes=2)
    _, metrics = s.aggregate_train(
        2,
        [
            reply(1000 + i, _state(1 + i), {"num-examples": 3, "train-loss": 0.2})
            for i in range(2)
        ],
    )
    assert metrics is not None and metrics["dropped"] == 0


# ---------------------------------------------------------------- in process
def _continual_run(tmp_path, method):
    config = {
        "method": method,
        "model": "mlp",
        "dataset": "permuted-mnist",
        "num-tasks": 2,
        "rounds-per-task": 3,
        "num-server-rounds": 6,
        "local-steps": 60,
        "batch-size": 32,
        "lr": 0.2,
        "lr-decay": 0.7,
        "momentum": 0.0,
        "partitioner": "dirichlet",
        "dirichlet-alpha": 1.0,
        "num-partitions": 2,
        "task-examples": 2000,
        "fot-activation-examples": 100,
        "seed": 7,
        "device": "cpu",
        "output-dir": str(tmp_path / method),
    }
    grid = InProcessGrid(client_app, num_nodes=2, run_config=config)
    context = Context(
        run_id=5, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    return run_server(grid, context)


@pytest.fixture(scope="module")
def continual_runs(tmp_path_factory):
    from fedlr.data.assets import ensure_assets

    ensure_assets(["mnist"])
    tmp = tmp_path_factory.mktemp("continual")
    return {m: _continual_run(tmp, m) for m in ("fot", "fedavg-continual")}


def test_in_process_runs_write_accuracy_matrix_and_fot_forgets_less(continual_runs):
    summaries = {}
    for method, run_dir in continual_runs.items():
        frame = pd.read_csv(run_dir / "results.csv")
        assert frame["round"].tolist() == list(range(1, 7))
        assert frame["task"].tolist() == [0, 0, 0, 1, 1, 1]
        assert (frame["dropped"] == 0).all()
        matrix = pd.read_csv(run_dir / "accuracy_matrix.csv", index_col=0)
        assert matrix.shape == (2, 2) and math.isnan(matrix.iloc[0, 1])
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = summary["accuracy-matrix"]
        assert math.isclose(summary["ACC"], sum(rows[-1]) / 2)
        assert math.isclose(summary["FGT"], rows[0][0] - rows[1][0])
        assert rows[0][0] > 0.6  # task 0 was learned before task 1 came
        summaries[method] = summary
    fot, avg = summaries["fot"], summaries["fedavg-continual"]
    print(f"FGT fot {fot['FGT']:.4f} vs fedavg {avg['FGT']:.4f}")
    assert fot["FGT"] < avg["FGT"]
    fot_frame = pd.read_csv(continual_runs["fot"] / "results.csv")
    assert (fot_frame["basis-dims"].iloc[3:] > 0).all()
    assert (fot_frame["basis-dims"].iloc[:3] == 0).all()
