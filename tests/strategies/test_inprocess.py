"""Whole rounds in process: real ClientApp, real tiny model, no Ray."""

from __future__ import annotations

import json
import logging

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from fedlr.adapters import Role, adapter_state
from fedlr.config.run import RunConfig
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.launch.client_app import app as client_app
from fedlr.launch.local import run_in_process
from fedlr.runs.checkpoint import load_checkpoint
from fedlr.runs.results import COLUMNS
from fedlr.server_apps.runner import run_server
from fedlr.strategies import FedExLoRA
from fedlr.tasks.text import TextTask
from tests.conftest import tiny_run_config


def _run(tmp_path, **overrides):
    config = tiny_run_config(tmp_path, **overrides)
    grid = InProcessGrid(
        client_app, num_nodes=config["num-partitions"], run_config=config
    )
    context = Context(
        run_id=3, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    return run_server(grid, context)


@pytest.mark.parametrize("method", ["fedavg-lora", "fedex-lora"])
def test_in_process_run_writes_one_row_per_round(tmp_path, assets, method, caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_dir = _run(tmp_path, method=method, **{"num-server-rounds": 3})
    progress = [m for m in caplog.messages if m.startswith("fedlr [round ")]
    assert [m.split("]")[0] for m in progress] == [
        "fedlr [round 1/3",
        "fedlr [round 2/3",
        "fedlr [round 3/3",
    ]
    assert all("accuracy" in m and "gap" in m for m in progress)
    frame = pd.read_csv(run_dir / "results.csv")
    extra = ["dense-base-sends"] if method == "fedex-lora" else []
    assert list(frame.columns) == list(COLUMNS) + extra
    assert frame["round"].tolist() == [1, 2, 3]
    assert (frame["method"] == method).all()
    assert frame["accuracy"].between(0, 1).all()
    assert (frame["loss"] > 0).all()
    assert (frame["clients"] == 3).all() and (frame["dropped"] == 0).all()
    assert (frame["frobenius-gap"] > 0).all()  # Dirichlet clients differ
    assert (frame["rank"] == 4).all()
    assert (frame["bytes-up"] > 0).all() and (frame["seconds"] > 0).all()
    layers = pd.read_csv(run_dir / "layers.csv")
    assert len(layers) == 3 * 4  # rounds x adapted layers
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3
    assert 0 <= summary["initial-accuracy"] <= 1
    assert summary["final-accuracy"] == frame["accuracy"].iloc[-1]
    final = torch.load(run_dir / "final_arrays.pt")
    has_base = any(k.endswith("base_layer.weight") for k in final)
    assert has_base == (method == "fedex-lora")


def test_eval_every_skips_server_evaluation_but_not_the_last_round(
    tmp_path, assets, caplog
):
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_dir = _run(
            tmp_path, **{"num-server-rounds": 3, "eval-every": 2, "eval-batch-size": 0}
        )
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["accuracy"].isna().tolist() == [True, False, False]
    # the round not evaluated says so on its line, with no "accuracy nan"
    lines = [m for m in caplog.messages if m.startswith("fedlr [round ")]
    assert lines[0].startswith("fedlr [round 1/3] not evaluated gap ")
    assert all("nan" not in line for line in lines)
    assert lines[1].startswith("fedlr [round 2/3] accuracy 0.")
    assert frame["eval-seconds"].iloc[0] < frame["eval-seconds"].iloc[1]
    parts = frame[["train-seconds", "aggregate-seconds", "eval-seconds"]]
    assert (parts > 0).all().all()
    # the three parts are the round's time, up to logging and the CSV write
    assert (parts.sum(axis=1) <= frame["seconds"] + 1e-6).all()
    assert (parts.sum(axis=1) >= 0.8 * frame["seconds"]).all()


def test_fedex_sends_base_weights_down(tmp_path, assets):
    avg = pd.read_csv(_run(tmp_path / "a", method="fedavg-lora") / "results.csv")
    dense = pd.read_csv(
        _run(tmp_path / "b", method="fedex-lora", **{"fedex-downlink": "dense"})
        / "results.csv"
    )
    factored = pd.read_csv(_run(tmp_path / "c", method="fedex-lora") / "results.csv")
    # 4 adapted 32x32 layers of float32 per client, 3 clients (each array
    # also carries its .npy header).
    base = 3 * 4 * 32 * 32 * 4
    assert (dense["bytes-down"] - avg["bytes-down"]).between(base, base * 1.05).all()
    assert (dense["bytes-up"] == avg["bytes-up"]).all()
    # Factored: round 1 is dense (no node keeps base weights yet); round 2
    # sends each node round 1's residual, of rank <= (3 - 1) x 4 = 8:
    # 8 x (32 + 32) floats per layer, in two arrays with .npy headers.
    assert factored["bytes-down"][0] == dense["bytes-down"][0]
    assert factored["dense-base-sends"].tolist() == [3, 0]
    extra = factored["bytes-down"][1] - avg["bytes-down"][1]
    assert 0 < extra <= 3 * 4 * (8 * 64 * 4 + 2 * 128) < base


def test_same_config_gives_bitwise_same_weights(tmp_path, assets):
    a = torch.load(_run(tmp_path / "a") / "final_arrays.pt")
    b = torch.load(_run(tmp_path / "b") / "final_arrays.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = torch.load(_run(tmp_path / "c", seed=8) / "final_arrays.pt")
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_fedex_exactness_on_tiny_model(tmp_path, assets):
    """W0_new + s B_bar A_bar == W0_old + s sum_i w_i B_i A_i per target module."""
    config = tiny_run_config(tmp_path)
    cfg = RunConfig.from_mapping(config)
    lm = TextTask(cfg).build_lora_model()
    strategy = FedExLoRA(layout=lm.layout)
    initial = adapter_state(lm.model, lm.layout, strategy.send_roles)
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
    for m in lm.layout.modules:
        ideal = sum(
            (n / total) * state[m.b_key] @ state[m.a_key] for state, n in clients
        )
        lhs = new[m.base_key] + m.scaling * new[m.b_key] @ new[m.a_key]
        rhs = initial[m.base_key] + m.scaling * ideal
        rel = torch.linalg.matrix_norm(lhs - rhs) / torch.linalg.matrix_norm(rhs)
        assert rel < 1e-5, (m.name, float(rel))
        # and the base weight really moved (clients differ)
        assert not torch.equal(new[m.base_key], initial[m.base_key])
    assert metrics["frobenius-gap"] > 0
    assert new[lm.layout.modules[0].base_key].dtype == torch.float32


def test_client_failure_is_dropped_and_run_continues(tmp_path, assets):
    """A node whose ClientApp raises is dropped; the round aggregates the rest."""
    from flwr.app import Error, Message

    def break_node_1(pid, instruction, reply):
        if pid == 1:
            return Message(
                Error(code=0, reason="simulated crash"), reply_to=instruction
            )
        return reply

    config = tiny_run_config(tmp_path)
    grid = InProcessGrid(
        client_app, num_nodes=3, run_config=config, reply_hook=break_node_1
    )
    context = Context(
        run_id=4, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    frame = pd.read_csv(run_server(grid, context) / "results.csv")
    assert frame["clients"].tolist() == [2, 2]
    assert frame["dropped"].tolist() == [1, 1]


def test_a_round_hook_sees_every_reply_of_the_round_before_the_server(tmp_path, assets):
    """The round hook gets one round's replies together, and may lose some."""
    seen: list[list[int]] = []

    def lose_partition_2(round_):
        seen.append(sorted(p for p, _, _ in round_))
        for _p, instruction, reply in round_:
            assert reply.metadata.reply_to_message_id == instruction.metadata.message_id
        return [None if p == 2 else reply for p, _, reply in round_]

    config = tiny_run_config(tmp_path)
    frame = pd.read_csv(
        run_in_process(config, round_hook=lose_partition_2) / "results.csv"
    )
    assert seen == [[0, 1, 2], [0, 1, 2]]  # the two train rounds, whole
    assert frame["clients"].tolist() == [2, 2]


def test_train_roles_are_what_the_client_sends(tmp_path, assets):
    config = tiny_run_config(tmp_path)
    cfg = RunConfig.from_mapping(config)
    lm = TextTask(cfg).build_lora_model()
    strategy = FedExLoRA(layout=lm.layout, min_train_nodes=1, min_available_nodes=1)
    grid = InProcessGrid(client_app, num_nodes=1, run_config=config)
    initial = adapter_state(lm.model, lm.layout, strategy.send_roles)
    (reply,) = grid.send_and_receive(
        strategy.configure_train(1, ArrayRecord(initial), ConfigRecord(), grid)
    )
    sent = set(reply.content["arrays"].keys())
    assert sent == set(lm.layout.keys(Role.LORA_A, Role.LORA_B, Role.HEAD))
    assert reply.content["metrics"]["partition-id"] == 0


def test_run_in_process_keeps_the_method_options(tmp_path, assets):
    """A method's own keys reach the strategy (not only the common keys).

    Also: after the rank grows, the one model of the process serves every node
    at the new rank (round 2 dropped no reply).
    """
    from fedlr.launch.local import run_in_process

    config = tiny_run_config(
        tmp_path,
        method="fedspec",
        **{"fedspec-threshold": 0.0, "fedspec-max-rank": 8, "num-server-rounds": 2},
    )
    run_dir = run_in_process(config)
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["fedspec-threshold"] == 0.0 and saved["fedspec-max-rank"] == 8
    frame = pd.read_csv(run_dir / "results.csv")
    assert list(frame["rank"]) == [6, 8]  # threshold 0: the rank grows every round
    assert list(frame["dropped"]) == [0, 0] and list(frame["clients"]) == [3, 3]


def test_resumed_run_appends_to_the_csvs_and_matches_an_uninterrupted_one(
    tmp_path, assets
):
    """Checkpoints hold no row history; the resumed run reads the CSVs."""
    straight = run_in_process(
        tiny_run_config(tmp_path / "a", **{"num-server-rounds": 3}), num_nodes=3
    )
    first = run_in_process(
        tiny_run_config(tmp_path / "b", **{"num-server-rounds": 2}), num_nodes=3
    )
    assert "results" not in load_checkpoint(first)
    resumed = run_in_process(
        tiny_run_config(
            tmp_path / "b",
            **{"num-server-rounds": 3, "resume-from": str(first)},
        ),
        num_nodes=3,
    )
    assert resumed == first
    a, b = pd.read_csv(straight / "results.csv"), pd.read_csv(resumed / "results.csv")
    assert b["round"].tolist() == [1, 2, 3]
    for column in ("accuracy", "loss", "frobenius-gap", "train-loss"):
        assert a[column].tolist() == b[column].tolist(), column
    layers = pd.read_csv(resumed / "layers.csv")
    assert sorted(set(layers["round"])) == [1, 2, 3]
    final_a = torch.load(straight / "final_arrays.pt")
    final_b = torch.load(resumed / "final_arrays.pt")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_fedex_with_fold_scale_zero_runs_as_fedavg_lora(tmp_path, assets):
    """The fold is the only difference: without it FedEx-LoRA is FedIT."""
    runs = {
        name: pd.read_csv(
            run_in_process(tiny_run_config(tmp_path / name, **config)) / "results.csv"
        )
        for name, config in {
            "fedit": {"method": "fedavg-lora"},
            "unfolded": {"method": "fedex-lora", "fedex-fold-scale": 0.0},
            "fedex": {"method": "fedex-lora"},
        }.items()
    }
    for column in ("accuracy", "loss", "train-loss", "frobenius-gap"):
        assert runs["unfolded"][column].tolist() == pytest.approx(
            runs["fedit"][column].tolist(), rel=1e-6, abs=1e-7
        ), column
    # ... and the fold changes the run (else the comparison would be empty).
    assert runs["fedex"]["loss"].iloc[-1] != pytest.approx(
        runs["fedit"]["loss"].iloc[-1], rel=1e-6
    )
