"""SVD-family strategies: mocked replies against dense float64, in-process rounds."""

from __future__ import annotations

import json
import logging
import math

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedlr.adapters import AdapterLayout, LoraModule, Role, adapter_state
from fedlr.client.round import apply_round
from fedlr.client_apps import lora as lora_client
from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError, RankMismatchError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.client_app import app as client_app
from fedlr.options import NoOptions
from fedlr.runs.results import COLUMNS
from fedlr.server_apps.lora import lora_plan
from fedlr.server_apps.runner import run_server
from fedlr.strategies import (
    FedSALoRA,
    FedSpec,
    FedSVD,
    FFALoRA,
    GlobalSVD,
    LocalSVD,
    get_method,
)
from fedlr.strategies.base import ClientUpdate
from fedlr.strategies.registry import resolve
from fedlr.tasks.text import TextTask
from tests.conftest import tiny_run_config
from tests.strategies.conftest import reply

SVD_METHODS = ["ffa-lora", "fedsvd", "fedspec", "fedsa-lora", "global-svd", "local-svd"]

LAYOUT = AdapterLayout(
    modules=(
        LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=6, d_in=5, rank=2),
        LoraModule("l1", "l1.A", "l1.B", "l1.W", 0.5, d_out=4, d_in=7, rank=2),
    ),
    head_shapes={"head.w": (2, 5), "head.b": (2,)},
)
WEIGHTS = [10, 30, 60]
W = [0.1, 0.3, 0.6]


def _tensors(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def _configured(strategy, state, num_nodes: int = 3) -> list[Message]:
    grid = InProcessGrid(ClientApp(), num_nodes=num_nodes, run_config={})
    keys = strategy.send_keys()
    return list(
        strategy.configure_train(
            1, ArrayRecord({k: state[k] for k in keys}), ConfigRecord(), grid
        )
    )


def _replies(strategy, clients, grams=None):
    out = []
    for i, (c, n) in enumerate(zip(clients, WEIGHTS, strict=True)):
        keys = strategy.layout.keys(*strategy.train_roles)
        msg = reply(1000 + i, {k: c[k] for k in keys}, {"num-examples": n})
        if grams is not None:
            msg.content["personal-gram"] = ArrayRecord(grams[i])
        out.append(msg)
    return out


def _dense_mean_of_products(clients, module):
    return sum(
        w * c[module.b_key].double() @ c[module.a_key].double()
        for w, c in zip(W, clients, strict=True)
    )


def test_every_svd_method_is_registered_for_the_lora_client():
    for name in SVD_METHODS:
        assert get_method(name).payload.name == "lora"


# ----------------------------------------------------------------- FFA-LoRA
def test_ffa_lora_never_sends_a_and_averages_b_exactly():
    strategy = FFALoRA(layout=LAYOUT)
    initial = _tensors(0, LAYOUT.shapes(*Role))
    strategy.bind_initial(initial)
    messages = _configured(strategy, initial)
    assert not any(k.endswith(".A") for k in messages[0].content["arrays"])
    assert messages[0].content["config"]["train-roles"] == "lora_B,head"
    clients = [
        _tensors(10 + i, LAYOUT.shapes(Role.LORA_B, Role.HEAD)) for i in range(3)
    ]
    arrays, metrics = strategy.aggregate_train(1, _replies(strategy, clients))
    new = record_to_state(arrays)
    assert not any(m.a_key in new for m in LAYOUT.modules)
    for m in LAYOUT.modules:
        b_bar = sum(w * c[m.b_key].double() for w, c in zip(W, clients, strict=True))
        torch.testing.assert_close(new[m.b_key].double(), b_bar, rtol=1e-6, atol=1e-6)
    assert metrics["frobenius-gap"] < 1e-5  # shared A: the average is exact
    assert metrics["relative-gap"] < 1e-6


# ------------------------------------------------------------------- FedSVD
def test_fedsvd_refactorises_b_bar_a_with_orthonormal_a():
    strategy = FedSVD(layout=LAYOUT)
    current = _tensors(0, LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
    messages = _configured(strategy, current)
    assert messages[0].content["config"]["train-roles"] == "lora_B,head"
    clients = [
        _tensors(10 + i, LAYOUT.shapes(Role.LORA_B, Role.HEAD)) for i in range(3)
    ]
    arrays, metrics = strategy.aggregate_train(1, _replies(strategy, clients))
    new = record_to_state(arrays)
    for m in LAYOUT.modules:
        b_bar = sum(w * c[m.b_key].double() for w, c in zip(W, clients, strict=True))
        ideal = b_bar @ current[m.a_key].double()
        got = new[m.b_key].double() @ new[m.a_key].double()
        torch.testing.assert_close(got, ideal, rtol=1e-5, atol=1e-5)
        a = new[m.a_key].double()
        torch.testing.assert_close(
            a @ a.T, torch.eye(m.rank, dtype=a.dtype), atol=1e-6, rtol=0
        )
        # B = U S: its columns are orthogonal with descending norms
        b = new[m.b_key].double()
        gram = b.T @ b
        assert abs(float(gram[0, 1])) < 1e-4 * float(gram[0, 0])
        assert float(gram[0, 0]) >= float(gram[1, 1])
    assert metrics["frobenius-gap"] < 1e-4


# ------------------------------------------------------------------ FedSpec
def test_fedspec_best_rank_r_factors_and_rank_growth():
    layout = AdapterLayout(
        modules=(
            LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=9, d_in=8, rank=2),
        ),
        head_shapes={"head.w": (2, 8)},
    )
    strategy = FedSpec(layout=layout, fedspec_threshold=0.05, fedspec_max_rank=6)
    current = _tensors(0, layout.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
    messages = _configured(strategy, current)
    assert messages[0].content["config"]["lora-rank"] == 2
    clients = [
        _tensors(10 + i, layout.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
        for i in range(3)
    ]
    replies = _replies(strategy, clients)
    arrays, metrics = strategy.aggregate_train(1, replies)
    new = record_to_state(arrays)
    m = layout.modules[0]
    ideal = _dense_mean_of_products(clients, m)
    sigma = torch.linalg.svdvals(ideal)
    tail_at_2 = float((sigma[2:] ** 2).sum() / (sigma**2).sum())
    assert tail_at_2 > 0.05  # random clients: the rule must fire
    assert metrics["tail-energy"] == pytest.approx(tail_at_2, rel=1e-9)
    assert strategy.rank == 4 and metrics["rank"] == 4
    assert new[m.b_key].shape == (9, 4) and new[m.a_key].shape == (4, 8)
    # model update: (alpha/4) B' A' == (alpha/2) * best rank-4 approx of ideal
    new_m = strategy.layout.modules[0]
    assert new_m.scaling == pytest.approx(1.0)  # alpha/r: 2.0 * 2 / 4
    applied = new_m.scaling * new[m.b_key].double() @ new[m.a_key].double()
    u, s, vh = torch.linalg.svd(ideal)
    best4 = (u[:, :4] * s[:4]) @ vh[:4]
    torch.testing.assert_close(applied, m.scaling * best4, rtol=1e-5, atol=1e-5)
    # the gap is that of what was produced, in the units of B_i A_i
    produced = applied / m.scaling
    gap = float(torch.linalg.matrix_norm(ideal - produced))
    assert metrics["frobenius-gap"] == pytest.approx(gap, rel=1e-4, abs=1e-6)
    assert metrics["frobenius-gap"] == pytest.approx(float(sigma[4:].norm()), rel=1e-6)
    # balanced factors: B'^T B' == A' A'^T
    b, a = new[m.b_key].double(), new[m.a_key].double()
    torch.testing.assert_close(b.T @ b, a @ a.T, rtol=1e-4, atol=1e-5)
    # next round: clients are told the new rank; replies at rank 4 are valid
    assert strategy.round_config(2)["lora-rank"] == 4
    assert strategy.reply_shapes()["l0.A"] == (4, 8)


def test_fedspec_pads_when_the_mean_has_fewer_singular_values(monkeypatch):
    layout = AdapterLayout(
        modules=(
            LoraModule("l0", "l0.A", "l0.B", "l0.W", 1.0, d_out=9, d_in=8, rank=1),
        )
    )
    strategy = FedSpec(
        layout=layout,
        fedspec_threshold=0.0,
        fedspec_max_rank=4,
        min_train_nodes=1,
        min_available_nodes=1,
    )
    current = _tensors(0, layout.shapes(Role.LORA_A, Role.LORA_B))
    _configured(strategy, current, num_nodes=1)
    client = _tensors(5, layout.shapes(Role.LORA_A, Role.LORA_B))
    msg = reply(1000, client, {"num-examples": 4})
    arrays, _metrics = strategy.aggregate_train(1, [msg])
    new = record_to_state(arrays)
    # one rank-1 client: rank 1 would be exact, the tail is 0 -> no growth
    assert strategy.rank == 1
    # force growth past k r = 1 with a second round at threshold -1 < 0 (a
    # value the fedspec-threshold option refuses)
    monkeypatch.setattr(FedSpec, "threshold", -1.0)
    _configured(strategy, new, num_nodes=1)
    arrays, _ = strategy.aggregate_train(2, [reply(1000, new, {"num-examples": 4})])
    grown = record_to_state(arrays)
    assert grown["l0.B"].shape == (9, 3) and grown["l0.A"].shape == (3, 8)
    before = 1.0 * new["l0.B"].double() @ new["l0.A"].double()
    after = (1.0 / 3.0) * grown["l0.B"].double() @ grown["l0.A"].double()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    assert float(grown["l0.A"][1:].norm()) > 0  # padded rows can still train


def test_fedspec_max_rank_is_checked_against_the_layers():
    with pytest.raises(ConfigError, match="fedspec-max-rank"):
        FedSpec(layout=LAYOUT, fedspec_max_rank=6)  # l0 is 6 x 5
    with pytest.raises(ConfigError, match="below the initial rank"):
        FedSpec(layout=LAYOUT, fedspec_max_rank=1)


def test_rank_mismatch_raises_a_named_error_and_drops_live_replies(caplog):
    strategy = FedSpec(layout=LAYOUT, fedspec_max_rank=4)
    shapes = LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD)
    other = {
        **shapes,
        "l0.A": (3, 5),
        "l0.B": (6, 3),
    }
    updates = [
        ClientUpdate(7, _tensors(1, shapes), 5, {}, RecordDict(), 0),
        ClientUpdate(9, _tensors(2, other), 5, {}, RecordDict(), 0),
    ]
    with pytest.raises(RankMismatchError) as info:
        strategy.aggregate_updates(1, updates, _tensors(0, shapes))
    assert "node 7" in str(info.value) and "node 9" in str(info.value)
    assert "(6, 3)" in str(info.value) and "(2, 5)" in str(info.value)
    # in a live round the reply of the other rank is dropped with that reason
    _configured(strategy, _tensors(0, shapes), num_nodes=2)
    replies = [
        reply(1000, _tensors(1, shapes), {"num-examples": 5}),
        reply(1001, _tensors(2, other), {"num-examples": 5}),
    ]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["dropped"] == 1 and metrics["clients"] == 1
    assert any("rank mismatch in layer 'l0'" in r for r in strategy.round.dropped)


# --------------------------------------------------------------- FedSA-LoRA
def _grams(clients):
    return [
        {m.b_key: c[m.b_key].T @ c[m.b_key] for m in LAYOUT.modules} for c in clients
    ]


@pytest.mark.parametrize("cls", [FedSALoRA, LocalSVD])
def test_personal_methods_average_a_and_measure_the_personal_change(cls):
    strategy = cls(layout=LAYOUT)
    current = _tensors(0, LAYOUT.shapes(Role.LORA_A, Role.HEAD))
    messages = _configured(strategy, current)
    config = messages[0].content["config"]
    assert config["train-roles"] == "lora_A,head" and config["keep-roles"] == "lora_B"
    assert config["personal-split"] is True
    assert ("client-svd" in config) == (cls is LocalSVD)
    assert not any(k.endswith(".B") for k in messages[0].content["arrays"])
    clients = [
        _tensors(10 + i, LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
        for i in range(3)
    ]
    arrays, metrics = strategy.aggregate_train(
        1, _replies(strategy, clients, _grams(clients))
    )
    new = record_to_state(arrays)
    change_sq = own_sq = 0.0
    for m in LAYOUT.modules:
        a_bar = sum(w * c[m.a_key].double() for w, c in zip(W, clients, strict=True))
        torch.testing.assert_close(new[m.a_key].double(), a_bar, rtol=1e-6, atol=1e-6)
        for w, c in zip(W, clients, strict=True):
            b = c[m.b_key].double()
            change_sq += w * float(
                torch.linalg.matrix_norm(b @ c[m.a_key].double() - b @ a_bar) ** 2
            )
            own_sq += w * float(torch.linalg.matrix_norm(b @ c[m.a_key].double()) ** 2)
    assert metrics["frobenius-gap"] == pytest.approx(math.sqrt(change_sq), rel=1e-5)
    assert metrics["relative-gap"] == pytest.approx(
        math.sqrt(change_sq / own_sq), rel=1e-5
    )
    # a reply without the Gram record is dropped
    _configured(strategy, current)
    replies = _replies(strategy, clients, _grams(clients))
    del replies[0].content["personal-gram"]
    _, metrics = strategy.aggregate_train(2, replies)
    assert metrics["dropped"] == 1


def test_personal_evaluation_reports_mean_and_spread():
    strategy = FedSALoRA(layout=LAYOUT)
    replies = [
        reply(
            1000 + i, {}, {"num-examples": 10 * (i + 1), "accuracy": acc, "loss": 1.0}
        )
        for i, acc in enumerate([0.5, 0.7, 0.9])
    ]
    strategy.begin_round(1, ArrayRecord())  # the round the evaluation is of
    strategy.aggregate_evaluate(1, replies)
    ev = strategy.last_evaluation
    assert ev["accuracy"] == pytest.approx(0.7)
    assert ev["accuracy-std"] == pytest.approx(math.sqrt(((0.2**2) * 2) / 3))
    assert (ev["accuracy-min"], ev["accuracy-max"]) == (0.5, 0.9)


# --------------------------------------------------------------- Global SVD
def test_global_svd_shares_lora_a_and_sends_each_node_its_own_b():
    strategy = GlobalSVD(layout=LAYOUT)
    current = _tensors(0, LAYOUT.shapes(Role.LORA_A, Role.HEAD))
    messages = _configured(strategy, current)
    assert "personal" not in messages[0].content.array_records  # nothing yet
    clients = [
        _tensors(10 + i, LAYOUT.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD))
        for i in range(3)
    ]
    arrays, metrics = strategy.aggregate_train(1, _replies(strategy, clients))
    new = record_to_state(arrays)
    gap_sq = ref_sq = 0.0
    for m in LAYOUT.modules:
        a = new[m.a_key].double()
        stack = torch.cat(
            [
                math.sqrt(w) * (c[m.b_key].double() @ c[m.a_key].double()).T
                for w, c in zip(W, clients, strict=True)
            ],
            dim=1,
        )
        sigma = torch.linalg.svdvals(stack)
        for i, (w, c) in enumerate(zip(W, clients, strict=True)):
            b_i = strategy.personal[1000 + i][m.b_key].double()
            delta = c[m.b_key].double() @ c[m.a_key].double()
            gap_sq += w * float(torch.linalg.matrix_norm(delta - b_i @ a) ** 2)
            ref_sq += w * float(torch.linalg.matrix_norm(delta) ** 2)
        # optimal: the discarded energy of the stack at rank r
        layer_gap = strategy.last_report.layers[m.name][0]
        assert layer_gap == pytest.approx(float(sigma[m.rank :].norm()), rel=1e-5)
    assert metrics["frobenius-gap"] == pytest.approx(math.sqrt(gap_sq), rel=1e-4)
    assert metrics["relative-gap"] == pytest.approx(
        math.sqrt(gap_sq / ref_sq), rel=1e-4
    )
    # next round: each node gets its own block
    messages = _configured(strategy, new)
    for msg in messages:
        node = msg.metadata.dst_node_id
        personal = record_to_state(msg.content["personal"])
        assert set(personal) == set(LAYOUT.keys(Role.LORA_B))
        assert torch.equal(personal["l0.B"], strategy.personal[node]["l0.B"])
    assert not torch.equal(
        strategy.personal[1000]["l0.B"], strategy.personal[1001]["l0.B"]
    )


# ------------------------------------------------------ plan: configuration
def test_lora_rank_larger_than_a_layer_is_refused_at_plan_build(tmp_path, assets):
    method = resolve(tiny_run_config(tmp_path, method="fedspec", **{"lora-rank": 64}))
    with pytest.raises(ConfigError, match="lora-rank") as info:
        lora_plan(method)
    assert "32 x 32" in str(info.value)


# ------------------------------------------------------------ in-process runs
def _run(tmp_path, grid_out=None, **overrides):
    config = tiny_run_config(tmp_path, **overrides)
    grid = InProcessGrid(
        client_app, num_nodes=config["num-partitions"], run_config=config
    )
    context = Context(
        run_id=5, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    run_dir = run_server(grid, context)
    if grid_out is not None:
        grid_out.append(grid)
    return run_dir


@pytest.mark.slow  # whole in-process runs: the integration stage
@pytest.mark.parametrize("method", SVD_METHODS)
def test_in_process_rounds_for_every_svd_method(tmp_path, assets, method):
    run_dir = _run(tmp_path, method=method)
    frame = pd.read_csv(run_dir / "results.csv")
    extra = get_method(method).strategy.extra_columns
    assert list(frame.columns) == list(COLUMNS) + list(extra)
    assert frame["round"].tolist() == [1, 2]
    assert frame["accuracy"].between(0, 1).all() and (frame["loss"] > 0).all()
    assert (frame["clients"] == 3).all() and (frame["dropped"] == 0).all()
    gap = frame["frobenius-gap"]
    assert gap.notna().all() and (gap >= 0).all()
    if method in ("ffa-lora", "fedsvd"):
        assert (frame["relative-gap"] < 1e-5).all()  # exact by construction
    else:
        assert (gap > 0).all()
    if "accuracy-std" in extra:
        # round 1 starts from the initial adapter, round 2 from kept factors
        assert frame["personal-clients"].tolist() == [0, 3]
        assert (frame["accuracy-min"] <= frame["accuracy"]).all()
        assert (frame["accuracy"] <= frame["accuracy-max"]).all()
    layers = pd.read_csv(run_dir / "layers.csv")
    assert len(layers) == 2 * 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"


@pytest.mark.slow  # whole in-process runs: the integration stage
def test_fedspec_rank_changes_mid_run_and_clients_follow(tmp_path, assets):
    grids: list[InProcessGrid] = []
    run_dir = _run(
        tmp_path,
        grids,
        method="fedspec",
        **{
            "num-server-rounds": 3,
            "lora-rank": 2,
            "fedspec-threshold": 0.0001,
            "fedspec-max-rank": 6,
        },
    )
    frame = pd.read_csv(run_dir / "results.csv")
    ranks = frame["rank"].tolist()  # rank after each round's aggregation
    assert ranks == sorted(ranks) and ranks[-1] <= 6
    assert ranks[0] == 4  # round 1 grew 2 -> 4 (tail above the threshold)
    assert ranks[-1] > ranks[0]  # and it grew again later in the run
    assert (frame["tail-energy"] > 0.0001).sum() >= 2
    # clients rebuilt their adapters: round t's replies are at rank ranks[t-1]
    up = frame["bytes-up"].tolist()
    assert up[1] > up[0]
    sent_ranks = [2, *ranks[:-1]]
    head = up[0] - 2 * (up[1] - up[0]) / (sent_ranks[1] - sent_ranks[0])
    for u, r in zip(up, sent_ranks, strict=True):  # bytes are affine in the rank
        assert u == pytest.approx(head + r * (up[1] - up[0]) / (sent_ranks[1] - 2))
    final = torch.load(run_dir / "final_arrays.pt")
    a_keys = [k for k in final if "lora_A" in k]
    assert all(final[k].shape[0] == ranks[-1] for k in a_keys)


@pytest.mark.slow  # whole in-process runs: the integration stage
def test_ffa_lora_a_is_identical_on_every_client(tmp_path, assets):
    config = tiny_run_config(tmp_path, method="ffa-lora")
    cfg = RunConfig.from_mapping(config)
    server = TextTask(cfg).build_lora_model()
    server_a = adapter_state(server.model, server.layout, (Role.LORA_A,))
    strategy = FFALoRA(layout=server.layout)
    initial = adapter_state(server.model, server.layout, strategy.send_roles)
    grid = InProcessGrid(client_app, num_nodes=3, run_config=config)
    messages = list(
        strategy.configure_train(1, ArrayRecord(initial), ConfigRecord(), grid)
    )
    replies = list(grid.send_and_receive(messages))
    assert all(not any("lora_A" in k for k in r.content["arrays"]) for r in replies)
    # whatever the process's cached model last held, a client loads the seeded A
    for nid, context in grid.contexts.items():
        lm = lora_client.CLIENT.model(cfg, NoOptions())
        with torch.no_grad():
            for p in lm.model.parameters():
                p.add_(0.1)  # contaminate the cached model
        msg = Message(
            RecordDict({"arrays": ArrayRecord(initial), "config": ConfigRecord()}),
            dst_node_id=nid,
            message_type="train",
        )
        job = apply_round(lm, msg, context)
        lm, loaded = job.adapted, job.personal_loaded
        assert not loaded  # FFA keeps nothing personal
        client_a = adapter_state(lm.model, lm.layout, (Role.LORA_A,))
        assert all(torch.equal(client_a[k], server_a[k]) for k in server_a)


@pytest.mark.slow  # whole in-process runs: the integration stage
def test_fedsa_clients_share_a_and_keep_their_own_b(tmp_path, assets):
    grids: list[InProcessGrid] = []
    run_dir = _run(tmp_path, grids, method="fedsa-lora")
    (grid,) = grids
    config = RunConfig.from_mapping(tiny_run_config(tmp_path, method="fedsa-lora"))
    final = torch.load(run_dir / "final_arrays.pt")
    assert not any("lora_B" in k for k in final)  # the server holds no B
    held: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    for nid, context in grid.contexts.items():
        personal = record_to_state(context.state.array_records["personal"])
        assert personal and all("lora_B" in k for k in personal)
        msg = Message(
            RecordDict({"arrays": state_to_record(final), "config": ConfigRecord()}),
            dst_node_id=nid,
            message_type="evaluate",
        )
        job = apply_round(lora_client.CLIENT.model(config, NoOptions()), msg, context)
        lm, loaded = job.adapted, job.personal_loaded
        assert loaded
        a = adapter_state(lm.model, lm.layout, (Role.LORA_A,))
        b = adapter_state(lm.model, lm.layout, (Role.LORA_B,))
        assert all(torch.equal(b[k], personal[k]) for k in b)
        held.append((a, b))
    (a0, b0), *rest = held
    for a, b in rest:
        assert all(torch.equal(a[k], a0[k]) for k in a0)  # same A everywhere
        assert all(not torch.equal(b[k], b0[k]) for k in b0)  # own B each
    assert all(float(t.abs().max()) > 0 for t in b0.values())  # B was trained
