"""Distributed client-level DP under SecAgg+ (:mod:`fedlr.privacy.distributed_dp`).

The nodes clip their updates and add Skellam noise on SecAgg+'s integer ring;
the server unmasks only the noised sum. In process, over an
:class:`~fedlr.flower.grid.InProcessGrid` of 4 nodes with a synthetic
ClientApp whose replies are known, so the clipped fixed-denominator mean can
be computed exactly.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
)

from fedlr.client_apps.secagg import secagg_mod
from fedlr.errors import ConfigError, SecureAggregationError
from fedlr.flower.grid import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.privacy import distributed_dp as ddp
from fedlr.privacy.client_dp import ClientDpLedger
from fedlr.privacy.secagg import SecAggSettings
from fedlr.privacy.settings import ClientDpSettings
from fedlr.round.describe import app_arguments
from fedlr.server_apps.secagg import SecAggPlusExchange, secure_exchange
from fedlr.strategies.fot import FedAvgContinual
from fedlr.strategies.registry import resolve
from fedlr.wire import protocol

SHAPES = {"w": (100, 100), "b": (100,)}
CLIP, Z, RANGE, SEED = 1.0, 2.0, 16.0, 5
BASE = 0.25
"""Every entry of the global arrays the nodes receive."""


def client_arrays(partition: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + partition)
    return {k: BASE + torch.randn(s, generator=gen) for k, s in SHAPES.items()}


app = ClientApp()


@app.train(mods=[secagg_mod])
def train(message: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    content = RecordDict(
        {
            "arrays": state_to_record(client_arrays(partition)),
            "metrics": MetricRecord({protocol.NUM_EXAMPLES: 10 + partition}),
        }
    )
    return Message(content, reply_to=message)


def dp_round(*, reproducible: bool = False, lose: int | None = 0):
    """One secure round with distributed DP; node ``lose`` drops after its
    keys. Returns (published arrays, exchange, what the server received)."""
    received: list[tuple[bool, int, int]] = []  # (masked?, arrays, metrics)

    def hook(partition: int, instruction: Message, reply: Message) -> Message | None:
        records = reply.content.config_records if reply.has_content() else {}
        masked = RECORD_KEY_CONFIGS in records and (
            Key.MASKED_PARAMETERS in records[RECORD_KEY_CONFIGS]
        )
        if partition == lose and masked:
            return None
        content = reply.content if reply.has_content() else RecordDict()
        received.append(
            (masked, len(content.array_records), len(content.metric_records))
        )
        return reply

    run_config: dict[str, bool | float | int | str] = {
        "seed": SEED,
        "client-dp-clip": CLIP,
        "client-dp-noise-multiplier": Z,
        "secagg-clipping-range": RANGE,
        "reproducible-noise": reproducible,
    }
    grid = InProcessGrid(
        app,
        num_nodes=4,
        run_config=run_config,
        reply_hook=hook,
        node_config={"dp-allow-reproducible-noise": reproducible},
    )
    strategy = FedAvgContinual(
        shapes=SHAPES, lr=1.0, max_num_examples=20, fraction_evaluate=0.0
    )
    strategy.client_dp_ledger = ClientDpLedger()
    settings = ClientDpSettings(
        clip=CLIP, noise_multiplier=Z, reproducible=reproducible
    )
    exchange = SecAggPlusExchange(
        SecAggSettings(clipping_range=RANGE), strategy, seed=SEED, dp=settings
    )
    current = {k: torch.full(s, BASE) for k, s in SHAPES.items()}
    sent = strategy.configure_train(1, state_to_record(current), ConfigRecord({}), grid)
    replies = exchange(grid, list(sent), None)
    published = record_to_state(replies[0].content.array_records["arrays"])
    return published, exchange, received, replies


def clipped_mean(partitions: list[int], sent: int) -> dict[str, np.ndarray]:
    """``x + sum_i clip(u_i) / m`` in float64."""
    total = {k: np.zeros(s) for k, s in SHAPES.items()}
    for p in partitions:
        update = {k: v.double().numpy() - BASE for k, v in client_arrays(p).items()}
        norm = math.sqrt(sum(float((u**2).sum()) for u in update.values()))
        for k in SHAPES:
            total[k] += update[k] * min(1.0, CLIP / norm)
    return {k: BASE + total[k] / sent for k in SHAPES}


# ------------------------------------------------------------------- kernel
@pytest.mark.parametrize("mu", [3.0, 2.5e4])
def test_skellam_mean_and_variance(mu):
    n = 100_000
    draws = ddp.skellam((n,), mu, np.random.default_rng(1)).astype(np.float64)
    var = 2 * mu
    assert draws.dtype == np.float64 and set(np.unique(draws % 1)) == {0.0}
    assert abs(draws.mean()) < 4 * math.sqrt(var / n)
    # sample variance: Var(s^2) ~ (2 var^2 + kappa4) / n, kappa4 = 2 mu
    assert abs(draws.var(ddof=1) - var) < 4 * math.sqrt((2 * var**2 + 2 * mu) / n)


def test_rdp_matches_the_formula_and_falls_with_the_noise():
    l2, l1 = ddp.sensitivities(0.5, 1e-3, 400)
    assert l2 == pytest.approx(500 + 20) and l1 == pytest.approx(min(20 * l2, l2**2))
    variance, alpha = 4e6, 8
    direct = alpha * l2**2 / (2 * variance) + min(
        ((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * variance**2), 3 * l1 / (2 * variance)
    )
    assert ddp.skellam_rdp(alpha, variance, l2, l1) == pytest.approx(direct, rel=1e-12)
    delta = 1e-5
    rounds = [(variance, l2, l1)] * 3
    expected = min(
        3 * ddp.skellam_rdp(a, variance, l2, l1) + math.log(1 / delta) / (a - 1)
        for a in ddp.ORDERS
    )
    assert ddp.skellam_epsilon(rounds, delta) == pytest.approx(expected, rel=1e-12)
    eps = [ddp.skellam_epsilon([(v, l2, l1)], delta) for v in (1e5, 1e6, 1e7, 1e8)]
    assert all(a > b for a, b in itertools.pairwise(eps))
    one = ddp.skellam_epsilon([(variance, l2, l1)], delta)
    assert ddp.skellam_epsilon([(variance, l2, l1)] * 2, delta) > one


def test_client_mu_gives_the_central_noise_over_t_clients():
    step = 2 * RANGE / 2**22
    mu = ddp.client_mu(Z, CLIP, step, 3)
    assert math.sqrt(2 * 3 * mu) * step == pytest.approx(Z * CLIP, rel=1e-12)


# -------------------------------------------------------------- a full round
def test_published_mean_is_the_clipped_mean_plus_noise_of_z_c_over_m():
    published, exchange, received, replies = dp_round()
    expected = clipped_mean([1, 2, 3], sent=4)  # node of partition 0 dropped
    noise = np.concatenate(
        [(published[k].double().numpy() - expected[k]).ravel() for k in SHAPES]
    )
    target = Z * CLIP / 4  # k = t = 3 survivors: the central noise std
    assert abs(noise.std() / target - 1) < 0.10
    assert abs(noise.mean()) < 4 * target / math.sqrt(noise.size)
    stats = exchange.last_stats
    assert stats["client-dp-noise-std"] == pytest.approx(target, rel=1e-9)
    assert stats["client-dp-sent"] == 4.0 and stats["secagg-clipped"] == 0.0
    assert 0 < stats["client-dp-epsilon"] < math.inf
    assert exchange.row()["client-dp-epsilon"] == stats["client-dp-epsilon"]
    metrics = replies[0].content.metric_records["metrics"]
    assert metrics["client-dp-clipped"] == 3.0  # every update had norm > C
    # the server never received an array: only keys, shares, masked vectors
    assert sum(m for m, _, _ in received) == 3  # the 3 masked vectors arrived
    assert len(received) > 3 and all(a == n == 0 for _, a, n in received)
    # the unmasked sum was already noised: its gap to the clean sum is noise
    assert noise.std() > 1e3 * stats["secagg-bound"]


def test_two_runs_differ_unless_reproducible():
    first, *_ = dp_round(lose=None)
    second, *_ = dp_round(lose=None)
    gap = max(float((first[k] - second[k]).abs().max()) for k in SHAPES)
    assert gap > Z * CLIP / 4  # independent noise: several stds apart somewhere
    same_a, *_ = dp_round(reproducible=True, lose=None)
    same_b, *_ = dp_round(reproducible=True, lose=None)
    assert max(float((same_a[k] - same_b[k]).abs().max()) for k in SHAPES) == 0.0


# ---------------------------------------------------------- configuration
def test_the_run_accepts_client_dp_for_sum_only_and_refuses_the_rest():
    keys = {"client-dp-clip": CLIP, "client-dp-noise-multiplier": Z}
    on = {"method": "fedavg-lora", "secure-aggregation": True, **keys}
    method = resolve({**on, "secagg-clipping-range": RANGE})
    # the app builds the strategy so that the server adds no second noise,
    # and keeps the ledger the exchange accounts in
    built = app_arguments(FedAvgContinual, method.run)
    assert built["client_dp_on_nodes"] is True
    strategy = FedAvgContinual(
        shapes=SHAPES,
        lr=1.0,
        max_num_examples=20,
        privacy=method.run.privacy,
        client_dp_on_nodes=True,
    )
    assert strategy.privacy.client_dp is None
    assert strategy.client_dp_ledger is not None
    with pytest.raises(ConfigError, match="secagg-clipping-range"):
        secure_exchange(resolve(on), strategy, 4)  # default range 8 < 1 + 12 z C/√3
    exchange = secure_exchange(method, strategy, 4)
    assert exchange is not None and exchange.dp is not None
    with pytest.raises(SecureAggregationError, match="robust=none"):
        secure_exchange(resolve({**on, "robust": "median"}), strategy, 4)
    noising = FedAvgContinual(
        shapes=SHAPES, lr=1.0, privacy=method.run.privacy, max_num_examples=20
    )
    with pytest.raises(SecureAggregationError, match="client_dp_on_nodes"):
        secure_exchange(method, noising, 4)  # the server would noise again


def test_nothing_un_noised_of_the_data_travels_under_distributed_dp(monkeypatch):
    """The secure sum carries only the clipping counts under distributed DP
    (not ``num-examples`` nor the loss, which the noise does not cover); a
    server that asks for them anyway gets sums of 0."""
    from fedlr.privacy.secagg import SecureScalars

    seen: list[dict[str, int]] = []
    real = SecureScalars.decode

    def spy(self: SecureScalars, total: np.ndarray) -> dict[str, int]:
        seen.append(real(self, total))
        return seen[-1]

    monkeypatch.setattr(SecureScalars, "decode", spy)
    _, _, _, replies = dp_round(lose=None)
    assert set(seen[-1]) == {"secagg-clipped", "client-dp-clipped"}
    assert replies[0].content.metric_records["metrics"]["num-examples"] == 1
    asked = {
        protocol.NUM_EXAMPLES: "",
        "train-loss-examples": "",
        "secagg-clipped": "",
        "client-dp-clipped": "",
    }
    monkeypatch.setattr(SecAggPlusExchange, "scalar_weights", lambda self: asked)
    dp_round(lose=None)
    assert seen[-1][protocol.NUM_EXAMPLES] == 0  # 4 nodes hold 10..13
    assert seen[-1]["train-loss-examples"] == 0
    assert seen[-1]["client-dp-clipped"] == 4
