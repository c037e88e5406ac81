"""VeRA-family strategies: mocked replies against dense formulas, in-process rounds."""

from __future__ import annotations

import logging
import math

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.clientapp import ClientApp

from fedlr.adapters import Role
from fedlr.adapters.sorf_vera import SorfVeraLayout, SorfVeraModule, layer_signs
from fedlr.adapters.vera import VeraLayout, VeraModule
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.launch.client_app import app as client_app
from fedlr.linalg.sorf import build_lambda_d_rot
from fedlr.runs.results import COLUMNS
from fedlr.server_apps.runner import run_server
from fedlr.strategies import FedAvgVeRA, SorfVeRA, VeraFedEx, get_method
from fedlr.strategies.registry import resolve
from fedlr.tasks.vera import build_vera_text_model
from tests.conftest import tiny_run_config
from tests.strategies.conftest import reply

F64 = torch.float64
R = 3
LAYOUT = VeraLayout(
    modules=(
        VeraModule("l0", "l0.b", "l0.d", "l0.W", d_out=6, d_in=5, rank=R),
        VeraModule("l1", "l1.b", "l1.d", "l1.W", d_out=4, d_in=7, rank=R),
    ),
    head_shapes={"head.w": (2, 5), "head.b": (2,)},
    rank=R,
    projection_seed=5,
)
GEN = torch.Generator().manual_seed(0)
PROJ_A = torch.randn(R, 7, generator=GEN)
PROJ_B = torch.randn(6, R, generator=GEN)
PROJ = {"projection-seed": 5, "projection-rank": R}


def _random(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def _configure(strategy, state, *, train_roles: str) -> None:
    grid = InProcessGrid(ClientApp(), num_nodes=3, run_config={})
    keys = strategy.send_keys()
    messages = list(
        strategy.configure_train(
            1, ArrayRecord({k: state[k] for k in keys}), ConfigRecord(), grid
        )
    )
    config = messages[0].content["config"]
    assert config["train-roles"] == train_roles
    assert config["projection-seed"] == strategy.projection_seed
    assert config["projection-rank"] == strategy.projection_rank


def _dense(lb, ld, m):
    a = PROJ_A[:, : m.d_in].double()
    b = PROJ_B[: m.d_out].double()
    return torch.diag(lb.double()) @ b @ torch.diag(ld.double()) @ a


def test_registry_entries():
    assert get_method("fedavg-vera").payload.name == "vera"
    assert get_method("vera-fedex").strategy is VeraFedEx
    assert get_method("sorf-vera").payload.name == "sorf-vera"


@pytest.mark.parametrize("cls", [FedAvgVeRA, VeraFedEx])
def test_vera_means_gap_and_fedex_exactness(cls):
    strategy = cls(layout=LAYOUT, projection_a=PROJ_A, projection_b=PROJ_B)
    state = _random(LAYOUT.shapes(*Role), 1)
    _configure(strategy, state, train_roles="vera_lambda_b,vera_lambda_d,head")
    trained = LAYOUT.shapes(Role.VERA_LAMBDA_B, Role.VERA_LAMBDA_D, Role.HEAD)
    clients = [_random(trained, 10 + i) for i in range(3)]
    weights = [10, 30, 60]
    replies = [
        reply(1000 + i, c, {"num-examples": n, **PROJ})
        for i, (c, n) in enumerate(zip(clients, weights, strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    new = record_to_state(arrays)
    w = [0.1, 0.3, 0.6]
    for key in trained:
        expected = sum(wi * c[key].double() for wi, c in zip(w, clients, strict=True))
        torch.testing.assert_close(new[key].double(), expected, rtol=1e-6, atol=1e-6)
    total_sq = 0.0
    for m in LAYOUT.modules:
        ideal = sum(
            wi * _dense(c[m.lambda_b_key], c[m.lambda_d_key], m)
            for wi, c in zip(w, clients, strict=True)
        )
        avg = _dense(new[m.lambda_b_key], new[m.lambda_d_key], m)
        gap = float(torch.linalg.matrix_norm(ideal - avg))
        assert strategy.last_report.layers[m.name][0] == pytest.approx(gap, rel=1e-5)
        total_sq += gap**2
        if cls is VeraFedEx:
            lhs = new[m.base_key].double() + avg
            rhs = state[m.base_key].double() + ideal
            rel = torch.linalg.matrix_norm(lhs - rhs) / torch.linalg.matrix_norm(rhs)
            assert rel < 1e-6
        else:
            assert m.base_key not in new
    assert metrics["frobenius-gap"] == pytest.approx(math.sqrt(total_sq), rel=1e-5)
    assert metrics["frobenius-gap"] > 0.1


def test_vera_fedex_step_scales_the_fold():
    strategy = VeraFedEx(
        layout=LAYOUT, projection_a=PROJ_A, projection_b=PROJ_B, fedex_lr=0.25
    )
    state = _random(LAYOUT.shapes(*Role), 1)
    _configure(strategy, state, train_roles="vera_lambda_b,vera_lambda_d,head")
    trained = LAYOUT.shapes(Role.VERA_LAMBDA_B, Role.VERA_LAMBDA_D, Role.HEAD)
    clients = [_random(trained, 20 + i) for i in range(2)]
    replies = [
        reply(1000 + i, c, {"num-examples": 1, **PROJ}) for i, c in enumerate(clients)
    ]
    new = record_to_state(strategy.aggregate_train(1, replies)[0])
    m = LAYOUT.modules[0]
    ideal = sum(0.5 * _dense(c[m.lambda_b_key], c[m.lambda_d_key], m) for c in clients)
    avg = _dense(new[m.lambda_b_key], new[m.lambda_d_key], m)
    expected = state[m.base_key].double() + 0.25 * (ideal - avg)
    torch.testing.assert_close(new[m.base_key].double(), expected, rtol=1e-5, atol=1e-5)


def test_reply_with_other_projection_is_dropped(caplog):
    strategy = FedAvgVeRA(layout=LAYOUT, projection_a=PROJ_A, projection_b=PROJ_B)
    state = _random(LAYOUT.shapes(*Role), 1)
    _configure(strategy, state, train_roles="vera_lambda_b,vera_lambda_d,head")
    trained = LAYOUT.shapes(Role.VERA_LAMBDA_B, Role.VERA_LAMBDA_D, Role.HEAD)
    good = reply(1000, _random(trained, 1), {"num-examples": 3, **PROJ})
    other_seed = reply(
        1001,
        _random(trained, 2),
        {"num-examples": 3, "projection-seed": 6, "projection-rank": R},
    )
    no_echo = reply(1002, _random(trained, 3), {"num-examples": 3})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = strategy.aggregate_train(1, [good, other_seed, no_echo])
    assert metrics["clients"] == 1 and metrics["dropped"] == 2
    reasons = sorted(strategy.round.dropped)
    assert all("projection mismatch" in r for r in reasons)
    assert "node 1001" in reasons[0] and "(6.0, 3.0)" in reasons[0]
    assert "node 1002" in reasons[1] and "(None, None)" in reasons[1]


# ------------------------------------------------------------------ SORF-VeRA
SR = 3
SORF_LAYOUT = SorfVeraLayout(
    modules=(
        SorfVeraModule("s0", "s0.br", "s0.bi", "s0.m", "s0.t", "s0.W", 8, 6, SR),
        SorfVeraModule("s1", "s1.br", "s1.bi", "s1.m", "s1.t", "s1.W", 6, 5, SR),
    ),
    head_shapes={"head.w": (2, 6)},
    rank=SR,
    projection_seed=4,
)
SORF_A = torch.randn(SR, 6, generator=GEN)
SORF_B = torch.randn(8, SR, generator=GEN)
SORF_PROJ = {"projection-seed": 4, "projection-rank": SR}


def _dense_gamma(a, c):
    g = torch.zeros(2 * a.numel(), 2 * a.numel(), dtype=F64)
    for j in range(a.numel()):
        g[2 * j, 2 * j], g[2 * j, 2 * j + 1] = a[j], -c[j]
        g[2 * j + 1, 2 * j], g[2 * j + 1, 2 * j + 1] = c[j], a[j]
    return g


def _sorf_dense(m, br, bi, lam):
    s = layer_signs(m.d_out, 4).to(F64).dense()
    b = SORF_B[: m.d_out].double()
    a = SORF_A[:, : m.d_in].double()
    return s @ _dense_gamma(br.double(), bi.double()) @ b @ lam @ a


def test_sorf_vera_averages_built_matrices_and_reports_dense_residuals():
    strategy = SorfVeRA(layout=SORF_LAYOUT, projection_a=SORF_A, projection_b=SORF_B)
    state = _random(SORF_LAYOUT.shapes(*Role), 3)
    _configure(strategy, state, train_roles="sorf_d_scale,sorf_d_angles,head")
    trained = SORF_LAYOUT.shapes(Role.SORF_D_SCALE, Role.SORF_D_ANGLES, Role.HEAD)
    clients = [_random(trained, 30 + i) for i in range(3)]
    weights = [1, 1, 2]
    replies = [
        reply(1000 + i, c, {"num-examples": n, **SORF_PROJ})
        for i, (c, n) in enumerate(zip(clients, weights, strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    new = record_to_state(arrays)
    w = [0.25, 0.25, 0.5]
    gap_sq = norm_sq = 0.0
    for m in SORF_LAYOUT.modules:
        lam_bar = sum(
            wi
            * build_lambda_d_rot(
                c[m.d_scale_key].double(), c[m.d_angles_key].double(), SR
            )
            for wi, c in zip(w, clients, strict=True)
        )
        # Averaging angles would give another matrix: the strategy must not.
        angle_mean = sum(
            wi * c[m.d_angles_key].double() for wi, c in zip(w, clients, strict=True)
        )
        scale_mean = sum(
            wi * c[m.d_scale_key].double() for wi, c in zip(w, clients, strict=True)
        )
        assert not torch.allclose(
            lam_bar, build_lambda_d_rot(scale_mean, angle_mean, SR), atol=1e-3
        )
        torch.testing.assert_close(
            strategy.averaged_lambda(
                m,
                [
                    u
                    for u in strategy.replies.validate_replies(
                        replies, strategy.round.arrays
                    )[0]
                ],
            ),
            lam_bar,
        )
        target = _sorf_dense(m, state[m.b_real_key], state[m.b_imag_key], lam_bar)
        refit = _sorf_dense(
            m,
            new[m.b_real_key],
            new[m.b_imag_key],
            build_lambda_d_rot(
                new[m.d_scale_key].double(), new[m.d_angles_key].double(), SR
            ),
        )
        gap = float(torch.linalg.matrix_norm(refit - target))
        assert strategy.last_report.layers[m.name][0] == pytest.approx(gap, rel=1e-4)
        gap_sq += gap**2
        norm_sq += float(torch.linalg.matrix_norm(target)) ** 2
        assert new[m.b_real_key].shape == (m.d_out // 2,)
        assert new[m.d_angles_key].shape == (SR * (SR - 1) // 2,)
    assert metrics["frobenius-gap"] == pytest.approx(math.sqrt(gap_sq), rel=1e-4)
    assert metrics["relative-gap"] == pytest.approx(
        math.sqrt(gap_sq / norm_sq), rel=1e-4
    )
    assert 0 < metrics["b-residual"] < 1.5 and 0 < metrics["d-residual"] < 1.5
    for key in SORF_LAYOUT.keys(Role.HEAD):
        expected = sum(wi * c[key] for wi, c in zip(w, clients, strict=True))
        torch.testing.assert_close(new[key], expected, rtol=1e-6, atol=1e-6)


def test_sorf_vera_refit_is_exact_when_reachable():
    """A has orthonormal rows, S Gamma(b) B has orthogonal columns, Lambda = m I.

    Then U_r Sigma_r = S Gamma(b) B times a diagonal of signs... the refit must
    reproduce the update (up to rounding) and report zero residuals.
    """
    d_out, d_in, r = 8, 6, 2
    layout = SorfVeraLayout(
        modules=(
            SorfVeraModule("x", "x.br", "x.bi", "x.m", "x.t", "x.W", d_out, d_in, r),
        ),
        rank=r,
        projection_seed=9,
    )
    g = torch.Generator().manual_seed(5)
    a = torch.linalg.qr(torch.randn(d_in, r, generator=g, dtype=F64)).Q.T.float()
    # B: two columns supported on disjoint 2x2 blocks, so S Gamma B's columns
    # are orthogonal (S is orthogonal for d_out = 8) and Gamma can rescale them.
    b = torch.zeros(d_out, r)
    b[0, 0], b[2, 1] = 1.0, 1.0
    strategy = SorfVeRA(layout=layout, projection_a=a, projection_b=b)
    state = {
        "x.br": torch.tensor([2.0, 1.0, 1.0, 1.0]),
        "x.bi": torch.tensor([0.5, 0.0, 0.0, 0.0]),
        "x.m": torch.tensor([0.7]),
        "x.t": torch.tensor([0.0]),
    }
    _configure(strategy, state, train_roles="sorf_d_scale,sorf_d_angles,head")
    client = {"x.m": torch.tensor([0.7]), "x.t": torch.tensor([0.0])}
    _, metrics = strategy.aggregate_train(
        1,
        [
            reply(
                1000,
                client,
                {"num-examples": 4, "projection-seed": 9, "projection-rank": r},
            )
        ],
    )
    assert metrics["relative-gap"] < 1e-5
    assert metrics["b-residual"] < 1e-5 and metrics["d-residual"] < 1e-5


# ------------------------------------------------------------------ in process
def _run(tmp_path, **overrides):
    config = tiny_run_config(
        tmp_path, **{"vera-rank": 8, "sorf-rank": 4, "vera-lr": 0.02, **overrides}
    )
    grid = InProcessGrid(
        client_app, num_nodes=config["num-partitions"], run_config=config
    )
    context = Context(
        run_id=3, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    return run_server(grid, context), grid


@pytest.mark.slow  # whole in-process runs: the integration stage
@pytest.mark.parametrize("method", ["fedavg-vera", "vera-fedex", "sorf-vera"])
def test_in_process_rounds(tmp_path, assets, method):
    run_dir, _ = _run(tmp_path, method=method)
    frame = pd.read_csv(run_dir / "results.csv")
    extra = {
        "sorf-vera": ["b-residual", "d-residual"],
        "vera-fedex": ["dense-base-sends"],
    }
    assert list(frame.columns) == list(COLUMNS) + extra.get(method, [])
    assert frame["round"].tolist() == [1, 2]
    assert (frame["clients"] == 3).all() and (frame["dropped"] == 0).all()
    assert frame["accuracy"].between(0, 1).all()
    assert (frame["frobenius-gap"] > 0).all()
    if method == "sorf-vera":
        assert frame["b-residual"].between(0, 1.5).all()
        assert frame["d-residual"].between(0, 1.5).all()
        assert (frame["rank"] == 4).all()
    else:
        assert (frame["rank"] == 8).all()
    final = torch.load(run_dir / "final_arrays.pt")
    assert any(k.endswith("base_layer.weight") for k in final) == (
        method == "vera-fedex"
    )


def test_vera_fedex_exactness_on_tiny_model(tmp_path, assets):
    config = tiny_run_config(tmp_path, method="vera-fedex", **{"vera-rank": 8})
    method = resolve(config)
    vm = build_vera_text_model(method.run, method.options)
    strategy = VeraFedEx.from_run_config(method.run, vm, method.options)
    initial = vm.state(strategy.send_roles)
    grid = InProcessGrid(client_app, num_nodes=3, run_config=config)
    messages = strategy.configure_train(
        1, ArrayRecord(initial), ConfigRecord({"lr": 0.05, "local-steps": 4}), grid
    )
    replies = list(grid.send_and_receive(messages))
    clients = [
        (
            record_to_state(r.content["arrays"]),
            int(r.content["metrics"]["num-examples"]),
        )
        for r in replies
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    new = record_to_state(arrays)
    total = sum(n for _, n in clients)
    for m in vm.layout.modules:
        a = vm.projection_a[:, : m.d_in].double()
        b = vm.projection_b[: m.d_out].double()

        def delta(s, m=m, a=a, b=b):
            return (
                torch.diag(s[m.lambda_b_key].double())
                @ b
                @ torch.diag(s[m.lambda_d_key].double())
                @ a
            )

        ideal = sum((n / total) * delta(s) for s, n in clients)
        lhs = new[m.base_key].double() + delta(new)
        rhs = initial[m.base_key].double() + ideal
        rel = torch.linalg.matrix_norm(lhs - rhs) / torch.linalg.matrix_norm(rhs)
        assert rel < 1e-5, (m.name, float(rel))
        assert not torch.equal(new[m.base_key], initial[m.base_key])
    assert metrics["frobenius-gap"] > 0


@pytest.mark.parametrize("method", ["fedavg-vera", "sorf-vera"])
def test_node_with_other_projection_seed_is_refused(tmp_path, assets, method):
    config = tiny_run_config(
        tmp_path, method=method, **{"vera-rank": 8, "sorf-rank": 4}
    )
    grid = InProcessGrid(client_app, num_nodes=3, run_config=config)
    # Node 1 was started with another projection seed: its ClientApp raises
    # ProjectionMismatchError, the reply is an error, the server drops it.
    grid.contexts[1001].run_config["projection-seed"] = 99
    context = Context(
        run_id=5, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    frame = pd.read_csv(run_server(grid, context) / "results.csv")
    assert frame["clients"].tolist() == [2, 2]
    assert frame["dropped"].tolist() == [1, 1]
