"""HiLoRA: the clustering kernels, the server's tiers and the client's fold.

In float64 against the paper's equations written out densely: the subspace
distance ``1 - ||U_i^T U_j||_F^2 / r``, the eigengap choice of ``K``, the
product-space factors, the clusters of planted subspace groups, and the
client's cluster and leaf rounds on the plug-in MLP: the model is
``W0 + s B_r A_r (+ s B_c A_c) + s B A`` and the training objective's gradient
is that of the loss plus ``gamma sum ||B_frozen^T B||_F^2``.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp

from fedlr import apply_round
from fedlr.adapters import Role, parameters_by_key
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.strategies.hilora import (
    HILORA_STAGE,
    HILORA_TIERS,
    HiLoRA,
    affinities,
    choose_cluster_count,
    product_factors,
    subspace_distances,
)
from fedlr.wire import protocol
from tests.plugin_app.task import build_model, load_data
from tests.strategies.conftest import reply
from tests.strategies.test_plugin import _context

F64 = torch.float64
GAMMA_ROOT, GAMMA_CLUSTER, LR = 0.3, 0.7, 0.05
NODES = (1000, 1001, 1002, 1003)


# ------------------------------------------------------------------ kernels
def test_subspace_distance_is_the_mean_principal_angle_distance():
    g = torch.Generator().manual_seed(0)
    nodes = [
        {k: torch.randn(12, 3, generator=g, dtype=F64) for k in ("l1", "l2")}
        for _ in range(3)
    ]
    got = subspace_distances(nodes, 3)
    for i in range(3):
        for j in range(3):
            want = 0.0
            for k in ("l1", "l2"):
                qi = torch.linalg.qr(nodes[i][k]).Q
                qj = torch.linalg.qr(nodes[j][k]).Q
                want += 1.0 - float((qi.T @ qj).square().sum()) / 3
            assert abs(float(got[i, j]) - (want / 2 if i != j else 0.0)) < 1e-12
    assert float(subspace_distances([nodes[0], nodes[0]], 3)[0, 1]) < 1e-12


def test_the_eigengap_finds_planted_blocks():
    blocks = torch.block_diag(*[torch.ones(3, 3, dtype=F64)] * 3)
    similarity = 0.98 * blocks + 0.02
    assert choose_cluster_count(similarity, 2, 10) == 3
    assert choose_cluster_count(similarity, 2, 2) == 2  # capped by k_max
    assert choose_cluster_count(similarity[:2, :2], 2, 10) == 2  # n <= k_min


def test_product_factors_are_the_best_rank_r_factors_of_the_mean_product():
    g = torch.Generator().manual_seed(1)
    bs = [torch.randn(10, 2, generator=g, dtype=F64) for _ in range(3)]
    as_ = [torch.randn(2, 7, generator=g, dtype=F64) for _ in range(3)]
    w = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    mean = sum(wi * b @ a for wi, b, a in zip(w, bs, as_, strict=True))
    b, a = product_factors(bs, as_, w, 2)
    u, s, vh = torch.linalg.svd(mean)
    torch.testing.assert_close(b @ a, u[:, :2] * s[:2] @ vh[:2], atol=1e-12, rtol=0)
    torch.testing.assert_close(b.T @ b, torch.eye(2, dtype=F64), atol=1e-12, rtol=0)
    b6, a6 = product_factors(bs, as_, w, 6)  # rank 6 holds the whole mean
    torch.testing.assert_close(b6 @ a6, mean, atol=1e-12, rtol=0)


# ------------------------------------------------------------------ rounds
def _strategy(model) -> HiLoRA:
    strategy = HiLoRA.for_model(
        model,
        hilora_root_rounds=1,
        hilora_cluster_rounds=1,
        hilora_gamma_root=GAMMA_ROOT,
        hilora_gamma_cluster=GAMMA_CLUSTER,
    )
    strategy.bind_initial(record_to_state(strategy.initial_arrays(model)))
    return strategy


def _configure(strategy: HiLoRA, server_round: int, state) -> dict[int, Message]:
    grid = InProcessGrid(ClientApp(), num_nodes=len(NODES), run_config={})
    messages = strategy.configure_train(
        server_round, ArrayRecord(dict(state)), ConfigRecord({"lr": LR}), grid
    )
    return {int(m.metadata.dst_node_id): m for m in messages}


def _root_round(strategy: HiLoRA, state):
    """Round 1: nodes 1000, 1002 share one B subspace, 1001, 1003 another."""
    _configure(strategy, 1, state)
    g = torch.Generator().manual_seed(2)
    groups = {}
    for parity in (0, 1):
        groups[parity] = {
            m.b_key: torch.randn(m.d_out, m.rank, generator=g)
            for m in strategy.layout.modules
        }
    replies = []
    for i, node in enumerate(NODES):
        arrays = {k: v.clone() for k, v in state.items()}
        for m in strategy.layout.modules:
            mix = torch.randn(m.rank, m.rank, generator=g)
            arrays[m.b_key] = groups[i % 2][m.b_key] @ mix
        replies.append(reply(node, arrays, {protocol.NUM_EXAMPLES: 10 + i}))
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None and metrics["dropped"] == 0
    return record_to_state(arrays), metrics


def test_root_round_clusters_nodes_by_their_lora_subspaces():
    strategy = _strategy(build_model("hilora"))
    state = record_to_state(strategy.initial_arrays(build_model("hilora")))
    _, metrics = _root_round(strategy, state)
    assert metrics["clusters"] == 2.0
    labels = strategy.labels
    assert labels[1000] == labels[1002] != labels[1001] == labels[1003]
    # distances within a group ~0, across ~1 - overlap of random 4-dim subspaces
    nodes = sorted(strategy.ema)
    d = subspace_distances([strategy.ema[n] for n in nodes], strategy.rank)
    assert float(d[0, 2]) < 1e-6 and float(d[0, 1]) > 0.3
    assert float(affinities(d)[0, 2]) > float(affinities(d)[0, 1])


def _dense_logits(strategy, tiers, active, head, x):
    """``W0`` from a fresh seeded model: the client's own W0 holds the fold."""
    base = build_model("hilora").base_model.model
    h = x.double()
    for m in strategy.layout.modules:
        layer = base.get_submodule(m.name.removeprefix("base_model.model."))
        w = layer.base_layer.weight.double()
        for a, b in tiers:
            w = w + m.scaling * b[m.b_key].double() @ a[m.a_key].double()
        w = w + m.scaling * active[m.b_key] @ active[m.a_key]
        h = torch.relu(h @ w.T + layer.base_layer.bias.double())
    return h @ head["weight"].T + head["bias"]


@pytest.mark.parametrize("stage", ["cluster", "leaf"])
def test_client_folds_the_frozen_tiers_and_adds_the_orthogonality_penalty(stage):
    model = build_model("hilora")
    strategy = _strategy(model)
    state = record_to_state(strategy.initial_arrays(model))
    root, _ = _root_round(strategy, state)
    # round 2: the cluster stage (every cluster starts from B = 0, A = A_r)
    sent = _configure(strategy, 2, root)
    message = sent[1000]
    config = message.content[protocol.CONFIG]
    assert (
        config[HILORA_STAGE] == 1
        and config[protocol.TRAIN_ROLES] == "lora_A,lora_B,head"
    )
    tiers = record_to_state(message.content[HILORA_TIERS])
    for m in strategy.layout.modules:
        assert f"root/{m.b_key}" not in tiers  # the root is the arrays
        assert not tiers[f"active/{m.b_key}"].any()
    cluster = None
    if stage == "leaf":  # a cluster round, then round 3 (leaf)
        g = torch.Generator().manual_seed(3)
        replies = []
        for node in NODES:
            arrays = {
                k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in root.items()
            }
            replies.append(reply(node, arrays, {protocol.NUM_EXAMPLES: 5}))
        new, _ = strategy.aggregate_train(2, replies)
        assert new is not None
        label = strategy.labels[1000]
        members = [
            r
            for r, n in zip(replies, NODES, strict=True)
            if strategy.labels[n] == label
        ]
        cluster = strategy.clusters[label]
        for m in strategy.layout.modules:  # the members' product-space factors
            r_arrays = [record_to_state(r.content["arrays"]) for r in members]
            weights = torch.ones(len(r_arrays), dtype=F64) / len(r_arrays)
            b, a = product_factors(
                [x[m.b_key] for x in r_arrays],
                [x[m.a_key] for x in r_arrays],
                weights,
                m.rank,
            )
            torch.testing.assert_close(
                cluster[m.b_key].double(), b, atol=1e-6, rtol=1e-5
            )
            torch.testing.assert_close(
                cluster[m.a_key].double(), a, atol=1e-5, rtol=1e-5
            )
        root = record_to_state(new)
        message = _configure(strategy, 3, root)[1000]
        assert message.content[protocol.CONFIG][protocol.TRAIN_ROLES] == "head"
    context = _context()
    job = apply_round(model, message, context)
    assert "HierarchicalTiers" in [type(f).__name__ for f in job.features]
    params = parameters_by_key(model, strategy.layout)
    x, y = load_data(0)
    head_module = model.base_model.model.classifier.modules_to_save["default"]
    frozen = (
        [(root, root)] if stage == "cluster" else [(root, root), (cluster, cluster)]
    )
    start = {
        k: params[k].detach().double().clone()
        for k in strategy.layout.keys(Role.LORA_A, Role.LORA_B)
    }
    if stage == "cluster":
        for m in strategy.layout.modules:
            torch.testing.assert_close(start[m.a_key], root[m.a_key].double())
    else:
        for m in strategy.layout.modules:
            torch.testing.assert_close(start[m.a_key], cluster[m.a_key].double())
            assert not start[m.b_key].any()
    # perturb B so the penalty's gradient is not zero
    with torch.no_grad():
        for m in strategy.layout.modules:
            params[m.b_key].add_(0.05 * torch.ones_like(params[m.b_key]))
    active = {
        k: params[k].detach().double().clone().requires_grad_(True) for k in start
    }
    head = {
        "weight": head_module.weight.detach().double(),
        "bias": head_module.bias.detach().double(),
    }
    loss = torch.nn.functional.cross_entropy(job.model(x), y) + job.penalty()
    loss.backward()
    dense = torch.nn.functional.cross_entropy(
        _dense_logits(strategy, frozen, active, head, x), y
    )
    gammas = [GAMMA_ROOT] if stage == "cluster" else [GAMMA_ROOT, GAMMA_CLUSTER]
    for (_, tier), gamma in zip(frozen, gammas, strict=True):
        for m in strategy.layout.modules:
            overlap = tier[m.b_key].double().T @ active[m.b_key]
            dense = dense + gamma * overlap.square().sum()
    grads = torch.autograd.grad(dense, list(active.values()))
    for key, want in zip(active, grads, strict=True):
        torch.testing.assert_close(
            params[key].grad.double(), want, rtol=1e-5, atol=1e-7
        )
    answer = job.reply(num_examples=len(y))
    sent_back = set(record_to_state(answer.content[protocol.ARRAYS]))
    if stage == "cluster":
        assert sent_back == set(
            strategy.layout.keys(Role.LORA_A, Role.LORA_B, Role.HEAD)
        )
        assert "fedlr-hilora-leaf" not in context.state.array_records
    else:  # the leaf stays on the node
        assert sent_back == set(strategy.layout.keys(Role.HEAD))
        kept = record_to_state(context.state["fedlr-hilora-leaf"])
        assert set(kept) == set(start)
