"""fedavg and qrmix strategies: mocked replies, validation, in-process runs."""

from __future__ import annotations

import json
import logging

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.clientapp import ClientApp

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.client_app import app as client_app
from fedlr.linalg.qrmix import ClientEigen, fc_flatten, fc_unflatten, qrmix_update
from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.server_apps.runner import run_server
from fedlr.strategies import QRMix, VisionFedAvg, get_method
from fedlr.strategies.qrmix import QRMixOptions
from fedlr.strategies.registry import resolve
from tests.strategies.conftest import reply

SHAPES = {"body.weight": (5, 4), "classifier.weight": (3, 4), "classifier.bias": (3,)}
P = 3 * (4 + 1)
K = 4


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def _configure(
    strategy: VisionFedAvg, server_round: int, state, num_nodes: int = 3
) -> list:
    grid = InProcessGrid(ClientApp(), num_nodes=num_nodes, run_config={})
    return list(
        strategy.configure_train(
            server_round, ArrayRecord(dict(state)), ConfigRecord(), grid
        )
    )


def _eigen(local, global_, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vectors, _ = torch.linalg.qr(torch.randn(P, K, generator=g, dtype=torch.float64))
    delta = fc_flatten(local["classifier.weight"], local["classifier.bias"]) - (
        fc_flatten(global_["classifier.weight"], global_["classifier.bias"])
    )
    return {
        "vectors": vectors.float(),
        "values": torch.rand(K, generator=g).sort(descending=True).values * 2,
        "delta": delta,
    }


def _reply(node: int, local, n: int, eigen=None):
    message = reply(node, local, {"num-examples": n, "train-loss": 1.0})
    if eigen is not None:
        message.content["eigen"] = state_to_record(eigen)
    return message


def _qrmix(**kw) -> QRMix:
    args = {
        "shapes": SHAPES,
        "head": "classifier",
        "warmup_rounds": 1,
        "qrmix_tau": 0.1,
    }
    args.update(kw)
    return QRMix(qrmix_k=K, **args)


def test_registry_entries():
    assert get_method("fedavg").strategy is VisionFedAvg
    assert get_method("qrmix").strategy is QRMix
    assert (
        get_method("qrmix").payload.name == get_method("fedavg").payload.name == "qrmix"
    )


def test_fedavg_weighted_mean_of_every_parameter():
    strategy = VisionFedAvg(shapes=SHAPES, head="classifier")
    current = _state(0)
    messages = _configure(strategy, 1, current)
    assert messages[0].content["config"]["qrmix-stage"] == 1
    clients = [_state(i + 1) for i in range(3)]
    replies = [
        _reply(1000 + i, c, n)
        for i, (c, n) in enumerate(zip(clients, [1, 1, 2], strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    new = record_to_state(arrays)
    for key in SHAPES:
        expected = (
            0.25 * clients[0][key] + 0.25 * clients[1][key] + 0.5 * clients[2][key]
        )
        torch.testing.assert_close(new[key], expected, rtol=1e-6, atol=1e-6)
    assert metrics["stage"] == 1.0


def test_qrmix_stage_schedule_and_stage_one_is_fedavg():
    strategy = _qrmix(warmup_rounds=2)
    assert [strategy.stage(r) for r in (1, 2, 3, 4)] == [1, 1, 2, 2]
    current = _state(0)
    msgs = _configure(strategy, 2, current)
    assert msgs[0].content["config"]["qrmix-stage"] == 1
    clients = [_state(i + 1) for i in range(2)]
    arrays, metrics = strategy.aggregate_train(
        2, [_reply(1000 + i, c, 5) for i, c in enumerate(clients)]
    )
    new = record_to_state(arrays)
    torch.testing.assert_close(
        new["classifier.weight"],
        0.5 * (clients[0]["classifier.weight"] + clients[1]["classifier.weight"]),
    )
    assert metrics["stage"] == 1.0


@pytest.mark.parametrize("form", ["fisher", "literal"])
def test_qrmix_stage_two_head_update_matches_kernel(form):
    strategy = _qrmix(qrmix_form=form, qrmix_gamma=0.7)
    current = _state(0)
    msgs = _configure(strategy, 2, current)
    assert msgs[0].content["config"]["qrmix-stage"] == 2
    clients = [_state(i + 1) for i in range(3)]
    eigens = [_eigen(c, current, 50 + i) for i, c in enumerate(clients)]
    weights = [10, 20, 30]
    replies = [
        _reply(1000 + i, c, n, e)
        for i, (c, n, e) in enumerate(zip(clients, weights, eigens, strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(2, replies)
    new = record_to_state(arrays)
    step = qrmix_update(
        [
            ClientEigen(
                e["vectors"].double(), e["values"].double(), e["delta"].double()
            )
            for e in eigens
        ],
        weights,
        tau=0.1,
        gamma=0.7,
        form=form,
    )
    d_w, d_b = fc_unflatten(step, 3, 4)
    torch.testing.assert_close(
        new["classifier.weight"].double(),
        current["classifier.weight"].double() + d_w,
        rtol=0,
        atol=1e-5,
    )
    torch.testing.assert_close(
        new["classifier.bias"].double(),
        current["classifier.bias"].double() + d_b,
        rtol=0,
        atol=1e-5,
    )
    # the body is plain FedAvg
    expected = sum(
        w / 60 * c["body.weight"] for w, c in zip(weights, clients, strict=True)
    )
    torch.testing.assert_close(new["body.weight"], expected, rtol=1e-6, atol=1e-6)
    assert metrics["stage"] == 2.0
    assert metrics["head-step"] == pytest.approx(float(step.norm()), rel=1e-5)
    assert metrics["top-eigenvalue"] == pytest.approx(
        max(float(e["values"].max()) for e in eigens)
    )
    # eigen records count in the bytes sent up
    assert metrics["bytes-up"] > 3 * (20 + 15) * 4 + 3 * (P * K + K + P) * 4 - 1


def test_clipped_stage_two_reply_moves_its_eigen_delta_with_its_head():
    """Norm clipping moves a reply to ``x + f (y - x)``; its ``eigen`` delta
    (the head's change) follows as ``f delta`` and the curvature stays, so the
    head step is the kernel's on the clipped deltas."""
    strategy = _qrmix(robust=RobustConfig(rule="norm-clip"))
    current = _state(0)
    _configure(strategy, 2, current, num_nodes=4)
    g = torch.Generator().manual_seed(9)
    clients = [
        {k: v + s * torch.randn(v.shape, generator=g) for k, v in current.items()}
        for s in (0.01, 0.01, 0.01, 0.05)  # the fourth is clipped
    ]
    eigens = [_eigen(c, current, 70 + i) for i, c in enumerate(clients)]
    replies = [
        _reply(1000 + i, c, 5, e)
        for i, (c, e) in enumerate(zip(clients, eigens, strict=True))
    ]
    updates, _ = strategy.replies.validate_replies(replies, strategy.round.arrays)
    outcome = robust_aggregate(
        updates, strategy.replies.space(current), strategy.robust
    )
    factors = [u.clip_factor for u in outcome.updates]
    assert min(factors[:3]) > 0.9 and 0.0 < factors[3] < 0.5
    moved = strategy.replies.clip_extras(outcome.updates[3])
    torch.testing.assert_close(
        moved.extras["eigen"]["delta"].double(),
        factors[3] * eigens[3]["delta"].double(),
    )
    for key in ("vectors", "values"):
        assert torch.equal(moved.extras["eigen"][key], eigens[3][key])
    arrays, metrics = strategy.aggregate_train(2, replies)
    assert metrics["clients"] == 4 and metrics["rejected"] == 0.0
    step = qrmix_update(
        [
            ClientEigen(
                e["vectors"].double(), e["values"].double(), f * e["delta"].double()
            )
            for e, f in zip(eigens, factors, strict=True)
        ],
        [5, 5, 5, 5],
        tau=0.1,
        gamma=1.0,
        form="fisher",
    )
    d_w, _ = fc_unflatten(step, 3, 4)
    torch.testing.assert_close(
        record_to_state(arrays)["classifier.weight"].double(),
        current["classifier.weight"].double() + d_w,
        rtol=0,
        atol=1e-5,
    )


def _corrupt(eigen, how):
    e = {k: v.clone() for k, v in eigen.items()}
    if how == "negative":
        e["values"][1] = -0.5
    elif how == "nan":
        e["values"][0] = float("nan")
    elif how == "shape":
        e["vectors"] = e["vectors"][:, :-1]
    elif how == "not-orthonormal":
        e["vectors"][:, 0] *= 2
    elif how == "delta":
        e["delta"] = e["delta"] + 1.0
    elif how == "missing-key":
        del e["values"]
    elif how == "no-record":
        return None
    return e


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("negative", "negative eigenvalue"),
        ("nan", "NaN or Inf"),
        ("shape", "'eigen' 'vectors' has shape"),
        ("not-orthonormal", "not orthonormal"),
        ("delta", "'delta' differs"),
        ("missing-key", "'eigen' has wrong keys"),
        ("no-record", "no ArrayRecord 'eigen'"),
    ],
)
def test_bad_eigen_reply_is_dropped_with_reason(how, reason, caplog):
    strategy = _qrmix()
    current = _state(0)
    _configure(strategy, 2, current)
    clients = [_state(i + 1) for i in range(3)]
    eigens = [_eigen(c, current, 50 + i) for i, c in enumerate(clients)]
    eigens[1] = _corrupt(eigens[1], how)
    replies = [
        _reply(1000 + i, c, 5, e)
        for i, (c, e) in enumerate(zip(clients, eigens, strict=True))
    ]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(2, replies)
    assert metrics["dropped"] == 1.0 and metrics["clients"] == 2.0
    assert len(strategy.round.dropped) == 1
    assert "node 1001" in strategy.round.dropped[0]
    assert reason in strategy.round.dropped[0]
    assert any(reason in m for m in caplog.messages)
    good = [eigens[0], eigens[2]]
    step = qrmix_update(
        [
            ClientEigen(
                e["vectors"].double(), e["values"].double(), e["delta"].double()
            )
            for e in good
        ],
        [5, 5],
        tau=0.1,
    )
    d_w, _ = fc_unflatten(step, 3, 4)
    new = record_to_state(arrays)
    torch.testing.assert_close(
        new["classifier.weight"].double(),
        current["classifier.weight"].double() + d_w,
        rtol=0,
        atol=1e-5,
    )


def test_stage_one_ignores_absent_eigen_and_checkpoint_skips_warmup(tmp_path):
    config = RunConfig(method="qrmix")
    options = QRMixOptions(warmup_rounds=3)
    strategy = QRMix.from_run_config(
        config, shapes=SHAPES, head="classifier", options=options
    )
    assert strategy.stage(1) == 1
    ckpt = options.replace(qrmix_warmup_checkpoint=str(tmp_path / "w.pt"))
    strategy = QRMix.from_run_config(
        config, shapes=SHAPES, head="classifier", options=ckpt
    )
    assert strategy.stage(1) == 2


# ------------------------------------------------------------------ in process


def _config(tmp_path, **overrides):
    config = {
        "method": "qrmix",
        "model": "cnn",
        "dataset": "digits",
        "num-server-rounds": 4,
        "warmup-rounds": 2,
        "local-steps": 10,
        "batch-size": 32,
        "lr": 0.05,
        "num-partitions": 3,
        "dirichlet-alpha": 0.5,
        "qrmix-k": 4,
        "qrmix-oversample": 4,
        "seed": 3,
        "device": "cpu",
        "output-dir": str(tmp_path),
    }
    config.update(overrides)
    return config


def _run(config):
    grid = InProcessGrid(
        client_app, num_nodes=config["num-partitions"], run_config=config
    )
    context = Context(
        run_id=5, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    return run_server(grid, context)


def test_in_process_qrmix_runs_both_stages(tmp_path):
    run_dir = _run(_config(tmp_path / "q"))
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2, 3, 4]
    assert frame["stage"].tolist() == [1, 1, 2, 2]
    assert (frame["clients"] == 3).all() and (frame["dropped"] == 0).all()
    assert frame["top-eigenvalue"].iloc[:2].isna().all()
    assert (frame["top-eigenvalue"].iloc[2:] > 0).all()
    # in stage 2 the head step is QR-Mix's, not FedAvg's
    stage2 = frame.iloc[2:]
    assert ((stage2["head-step"] - stage2["fedavg-head-step"]).abs() > 1e-6).all()
    stage1 = frame.iloc[:2]
    assert (stage1["head-step"] == stage1["fedavg-head-step"]).all()
    # it learns: digits is easy, 4 rounds of 10 steps beat chance by far
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final-accuracy"] > 0.4 > summary["initial-accuracy"]

    # starting from the warm-up (stage 1) weights goes straight to stage 2
    final = run_dir / "final_arrays.pt"
    again = _run(
        _config(
            tmp_path / "c",
            **{"qrmix-warmup-checkpoint": str(final), "num-server-rounds": 1},
        )
    )
    resumed = pd.read_csv(again / "results.csv")
    assert resumed["stage"].tolist() == [2]
    start = json.loads((again / "summary.json").read_text())["initial-accuracy"]
    assert start == pytest.approx(summary["final-accuracy"])


def test_in_process_fedavg_same_seed_same_weights(tmp_path):
    a = _run(_config(tmp_path / "a", method="fedavg", **{"num-server-rounds": 2}))
    b = _run(_config(tmp_path / "b", method="fedavg", **{"num-server-rounds": 2}))
    frame = pd.read_csv(a / "results.csv")
    assert frame["stage"].tolist() == [1, 1]
    wa, wb = torch.load(a / "final_arrays.pt"), torch.load(b / "final_arrays.pt")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_checkpoint_and_text_dataset_are_config_errors(tmp_path):
    torch.save({"x": torch.zeros(2)}, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="qrmix-warmup-checkpoint"):
        _run(_config(tmp_path, **{"qrmix-warmup-checkpoint": str(tmp_path / "bad.pt")}))
    with pytest.raises(ConfigError, match="not an image data set"):
        _run(_config(tmp_path, dataset="polarity"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("qrmix-form", "dense", "not one of fisher, literal"),
        ("qrmix-tau", 0.0, "must be finite and > 0"),
        ("qrmix-gamma", -1.0, "must be finite and > 0"),
        ("qrmix-k", 0, "must be >= 1"),
        ("qrmix-power-iters", -1, "must be >= 0"),
        ("warmup-rounds", -2, "must be >= 0"),
        ("momentum", 1.0, "must be in [0, 1)"),
        ("qrmix-warmup-checkpoint", "relative/w.pt", "absolute path"),
    ],
)
def test_qrmix_config_keys_are_validated(key, value, message):
    with pytest.raises(ConfigError, match=key) as info:
        resolve({"method": "qrmix", key: value})
    assert message in str(info.value)
