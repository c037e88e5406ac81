"""Robust options, the update-size screen and fixed ranks for clients of
different LoRA ranks (FlexLoRA, HetLoRA, FLoRA, FedSpec and FedEx-LoRA with
``client-ranks``), on mocked float64 replies.

Five nodes at ranks 2, 4, 8, 2, 4 start from what the server sends them (the
leading components of the global factors, rescaled; FLoRA: a fresh adapter
with ``B = 0``) and move by a seeded step; node 1004 boosts its step 1e4
times. Every model is compared by its effective weights (``W0 + (alpha / R)
B A`` per layer and the head), since SVD factors are defined up to signs.
"""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.clientapp import ClientApp

from fedlr.adapters import Role
from fedlr.adapters.ranks import leading_rank
from fedlr.errors import ReplyValidationError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig
from fedlr.robust.spaces import RankedProductSpace
from fedlr.strategies.fedex_lora import HeteroFedExLoRA
from fedlr.strategies.fedspec import HeteroFedSpec, layout_at_rank
from fedlr.strategies.flexlora import FlexLoRA
from fedlr.strategies.flora import FLoRA
from fedlr.strategies.hetero import HeteroRankLoRA
from fedlr.strategies.hetlora import HetLoRA
from fedlr.wire.updates import ClientUpdate
from tests.strategies.conftest import reply
from tests.strategies.test_hetero_ranks import ALPHA, _fedex_layout

F64 = torch.float64
RANKS = (2, 4, 8, 2, 4)
WEIGHTS = (10, 30, 60, 20, 25)
NODES = tuple(range(1000, 1000 + len(RANKS)))
ATTACKER = NODES[-1]
BOOST = 1e4
STRATEGIES = {
    "flexlora": lambda **kw: FlexLoRA(**kw),
    "hetlora": lambda **kw: HetLoRA(**kw),
    "flora": lambda **kw: FLoRA(fedex_downlink="dense", **kw),
    "fedspec": lambda **kw: HeteroFedSpec(fedspec_max_rank=8, **kw),
    "fedex-lora": lambda **kw: HeteroFedExLoRA(fedex_downlink="dense", **kw),
}
RULES = ("norm-clip", "trimmed-mean", "median")
MEDIAN_PULL = 5.0
"""The geometric median is computed on the products; the published factors
are re-factorised (an SVD), so its pull on them is allowed to be larger than
norm clipping's (as for Global SVD in tests/adversarial/test_payloads.py)."""


def _strategy(method: str, **kwargs) -> HeteroRankLoRA:
    return STRATEGIES[method](layout=_fedex_layout(), client_ranks=(2, 4, 8), **kwargs)


def _current(seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = _fedex_layout().shapes(Role.LORA_A, Role.LORA_B, Role.HEAD, Role.BASE)
    return {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}


def _start(strategy, current, rank: int, g: torch.Generator) -> dict:
    """What a node of ``rank`` trains from."""
    layout = layout_at_rank(strategy.layout, rank)
    if isinstance(strategy, FLoRA):  # a fresh adapter: seeded A, B = 0
        out = {k: current[k] for k in layout.keys(Role.HEAD)}
        for m in layout.modules:
            out[m.a_key] = torch.randn(rank, m.d_in, generator=g, dtype=F64)
            out[m.b_key] = torch.zeros(m.d_out, rank, dtype=F64)
        return out
    cut = leading_rank(layout, current)
    return {k: cut[k] for k in layout.keys(Role.LORA_A, Role.LORA_B, Role.HEAD)}


def _clients(strategy, current, boost: float = BOOST, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for node, rank in zip(NODES, RANKS, strict=True):
        start = _start(strategy, current, rank, g)
        step = 1.0 if node != ATTACKER else boost
        out.append(
            {
                k: v + step * 0.1 * torch.randn(v.shape, generator=g, dtype=F64)
                for k, v in start.items()
            }
        )
    return out


def _round(strategy, current, clients, *, without=(), server_round=1, extra=None):
    grid = InProcessGrid(ClientApp(), num_nodes=len(NODES), run_config={})
    keys = strategy.send_keys()
    list(
        strategy.configure_train(
            server_round,
            ArrayRecord({k: current[k] for k in keys}),
            ConfigRecord(),
            grid,
        )
    )
    replies = [
        reply(node, c, {"num-examples": n, **(extra or {}).get(node, {})})
        for node, c, n in zip(NODES, clients, WEIGHTS, strict=True)
        if node not in without
    ]
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    return (record_to_state(arrays) if arrays is not None else None), metrics


def _effective(strategy, state) -> dict[str, torch.Tensor]:
    """Per layer ``W0 + (alpha / R) B A`` (as far as sent), and the head."""
    out = {}
    for m in strategy.layout.modules:
        w = torch.zeros(m.d_out, m.d_in, dtype=F64)
        if m.base_key in state:
            base = state[m.base_key].to(F64)
            w = w + (base.T if m.fan_in_fan_out else base)
        if m.a_key in state:
            a, b = state[m.a_key].to(F64), state[m.b_key].to(F64)
            w = w + (ALPHA / a.shape[0]) * b @ a
        out[m.name] = w
    for k in strategy.layout.keys(Role.HEAD):
        out[k] = state[k].to(F64)
    return out


def _distance(a, b) -> float:
    return math.sqrt(sum(float((a[k] - b[k]).square().sum()) for k in a))


# ------------------------------------------------------------ the space
def test_ranked_product_space_matches_dense_scaled_products():
    strategy = _strategy("flexlora")
    current = _current()
    clients = _clients(strategy, current, boost=3.0)
    updates = [
        ClientUpdate(node, c, n, {}, None, 0)  # type: ignore[arg-type]
        for node, c, n in zip(NODES, clients, WEIGHTS, strict=True)
    ]
    space = strategy.replies.space(current)
    assert isinstance(space, RankedProductSpace)

    def dense(c) -> torch.Tensor:
        r = c["l0.A"].shape[0]
        start = leading_rank(layout_at_rank(strategy.layout, r), current)
        parts = [
            ((ALPHA / r) * (c[m.b_key] @ c[m.a_key] - start[m.b_key] @ start[m.a_key]))
            for m in strategy.layout.modules
        ]
        parts.append(c["head.w"] - current["head.w"])
        return torch.cat([p.reshape(-1) for p in parts])

    vectors = torch.stack([dense(c) for c in clients])
    want = vectors @ vectors.T
    got = space.gram(updates)
    assert float((got - want).abs().max()) <= 1e-10 * float(want.abs().max())
    for u, v in zip(updates, vectors, strict=True):
        assert space.norm(u) == pytest.approx(float(v.norm()), rel=1e-10)
    # moving to the start (factor 0) leaves no update; factor 1 changes nothing
    assert space.norm(space.shrink(updates[0], 0.0)) <= 1e-12 * space.norm(updates[0])
    assert space.norm(space.shrink(updates[0], 1.0)) == pytest.approx(
        space.norm(updates[0]), rel=1e-12
    )


# ------------------------------------------------- robust rules and screen
@pytest.mark.parametrize("method", list(STRATEGIES))
def test_default_screen_drops_a_boosted_client_of_another_rank(method):
    current = _current()
    attacked = _strategy(method)
    assert attacked.screen_ratio == 20.0 and not attacked.robust.active
    clients = _clients(attacked, current)
    new, metrics = _round(attacked, current, clients)
    assert metrics["dropped"] == 1 and metrics["clients"] == len(NODES) - 1
    (reason,) = attacked.round.dropped
    assert f"node {ATTACKER}" in reason and "screen-ratio 20" in reason
    ratio = float(reason.split(" is ")[1].split(" x ")[0])
    assert ratio > 1e3
    honest = attacked.round.screen
    assert honest is not None and max(honest.ratios[:-1]) < 4.0, honest.ratios
    without, _ = _round(
        _strategy(method), current, _clients(attacked, current), without=(ATTACKER,)
    )
    assert new is not None and without is not None
    for key in without:
        assert torch.equal(new[key], without[key]), key


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("method", list(STRATEGIES))
def test_robust_rules_contain_a_boosted_client_of_another_rank(method, rule):
    current = _current()
    robust = RobustConfig(rule=rule)
    attacked = _strategy(method, robust=robust, screen_ratio=0.0)
    clients = _clients(attacked, current)
    new, metrics = _round(attacked, current, clients)
    assert new is not None and metrics["dropped"] == 0
    assert any(f"node {ATTACKER}" in r for r in attacked.round.robust), (
        attacked.round.robust
    )
    # the plain round without the attacker (trimmed-mean trims one of 5)
    reference = _strategy(method, screen_ratio=0.0)
    without, _ = _round(reference, current, clients, without=(ATTACKER,))
    assert without is not None
    got, want = _effective(attacked, new), _effective(attacked, without)
    sent = {k: current[k] for k in attacked.send_keys()}
    moved = _distance(want, _effective(attacked, sent))
    if rule == "trimmed-mean":
        scale = math.sqrt(sum(float(v.square().sum()) for v in want.values()))
        assert _distance(got, want) <= 1e-9 * scale
        return
    pull = MEDIAN_PULL if rule == "median" else 2.0
    assert _distance(got, want) <= pull * moved, (_distance(got, want), moved)
    # without the rule the attacker would have dominated the round
    plain = _strategy(method, screen_ratio=0.0)
    boosted, _ = _round(plain, current, clients)
    if boosted is not None:
        assert _distance(_effective(plain, boosted), want) > 50 * moved


# ------------------------------------------------------------ fixed ranks
def test_a_node_that_changes_its_rank_is_dropped_and_keeps_its_rank():
    strategy = _strategy("flexlora")
    current = _current()
    clients = _clients(strategy, current, boost=1.0)
    new, metrics = _round(strategy, current, clients)
    assert metrics["dropped"] == 0 and strategy.node_ranks[NODES[0]] == 2
    # round 2: node 1000 (rank 2) replies at rank 4, a client rank
    again = _clients(strategy, new, boost=1.0, seed=2)
    again[0] = _clients(strategy, new, boost=1.0, seed=3)[1]  # a rank-4 reply
    _, metrics = _round(strategy, new, again, server_round=2)
    assert metrics["dropped"] == 1
    (reason,) = strategy.round.dropped
    assert f"node {NODES[0]}" in reason
    assert "rank 4 differs from the node's rank 2" in reason
    assert strategy.node_ranks[NODES[0]] == 2
    # the server still sends it rank 2
    grid = InProcessGrid(ClientApp(), num_nodes=len(NODES), run_config={})
    messages = strategy.configure_train(
        3, ArrayRecord({k: new[k] for k in strategy.send_keys()}), ConfigRecord(), grid
    )
    sent = {
        int(m.metadata.dst_node_id): record_to_state(m.content["arrays"])
        for m in messages
    }
    assert sent[NODES[0]]["l0.A"].shape[0] == 2


def test_a_first_reply_must_be_at_its_partitions_rank():
    strategy = _strategy("flexlora", partition_ranks=(2, 4, 8))
    current = _current()
    clients = _clients(strategy, current, boost=1.0)
    # partition ids 0..4 train ranks 2, 4, 8, 2, 4; node 1001 claims partition 0
    extra = {node: {"partition-id": p} for p, node in enumerate(NODES)}
    extra[NODES[1]] = {"partition-id": 0}
    _, metrics = _round(strategy, current, clients, extra=extra)
    assert metrics["dropped"] == 1
    (reason,) = strategy.round.dropped
    assert f"node {NODES[1]}" in reason
    assert "rank 4 is not partition 0's rank 2" in reason
    assert NODES[1] not in strategy.node_ranks


def test_hetlora_allows_only_pruning_to_a_smaller_rank():
    strategy = _strategy("hetlora", hetlora_prune_gamma=0.5, partition_ranks=(2, 4, 8))
    node = NODES[2]
    strategy.node_ranks[node] = 4
    strategy.replies.check_rank(node, 4)
    strategy.replies.check_rank(node, 1)  # pruned (a smaller rank)
    with pytest.raises(ReplyValidationError, match="rank 8 grew from 4"):
        strategy.replies.check_rank(node, 8)
    # a first reply: its partition's rank or a smaller one
    update = ClientUpdate(node, {}, 1, {"partition-id": 1.0}, None, 0)  # type: ignore[arg-type]
    strategy.replies.check_partition_rank(update, 4)
    strategy.replies.check_partition_rank(update, 2)
    with pytest.raises(
        ReplyValidationError, match="rank 8 exceeds partition 1's rank 4"
    ):
        strategy.replies.check_partition_rank(update, 8)
    # without pruning a known node's rank is fixed
    fixed = _strategy("hetlora")
    fixed.node_ranks[node] = 8
    with pytest.raises(ReplyValidationError, match="differs from the node's rank 8"):
        fixed.replies.check_rank(node, 4)
