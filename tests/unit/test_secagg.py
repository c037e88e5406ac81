"""Secure aggregation (SecAgg+): settings, refusal, weighting, bound, dropouts.

The protocol tests run Flower's own ``secaggplus_mod`` on every node of an
in-process grid (fedlr's :func:`~fedlr.client_apps.secagg.secagg_mod` around
a ClientApp that replies with seeded arrays) and fedlr's server stages
(:class:`~fedlr.server_apps.secagg.SecAggPlusExchange`) under a real
strategy (``fedavg-continual``'s :class:`~fedlr.strategies.fot.FedAvgContinual`):
the aggregate must equal the exact example-weighted mean within the stated
bound, with and without a node that drops out after sharing its keys.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
)

from fedlr.client_apps.secagg import secagg_mod
from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError, SecureAggregationError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.privacy.secagg import (
    SecAggSettings,
    check_eligible,
    flatten_summands,
    mean_error_bound,
    unflatten_sums,
)
from fedlr.round.pipeline import run_round
from fedlr.server_apps.secagg import SecAggPlusExchange
from fedlr.strategies.async_lora import AsyncLoraStrategy
from fedlr.strategies.fot import FedAvgContinual
from fedlr.strategies.registry import available_methods, get_method
from fedlr.wire import protocol

SHAPES = {"layer.weight": (6, 5), "layer.bias": (6,), "head.weight": (3, 6)}
EXAMPLES = (10, 25, 40, 60)
"""num-examples of partitions 0..3; the weight scale is the largest."""
SEED = 11
SUM_ONLY = sorted(m for m in available_methods() if get_method(m).traits.sum_only)


def listed_sum_only(message: str) -> list[str]:
    """The method names a refusal lists after "sum-only methods: ", in order."""
    _, sep, names = message.partition("sum-only methods: ")
    assert sep, f"the refusal lists no sum-only methods: {message!r}"
    return names.split(", ")


def client_arrays(partition: int) -> dict[str, torch.Tensor]:
    """The arrays partition ``partition`` replies with (seeded, entries ~ 1)."""
    gen = torch.Generator().manual_seed(1000 + partition)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def exact_mean(partitions: list[int]) -> dict[str, torch.Tensor]:
    """The example-weighted mean of the partitions' arrays, in float64."""
    total = sum(EXAMPLES[p] for p in partitions)
    return {
        k: sum(EXAMPLES[p] * client_arrays(p)[k].double() for p in partitions) / total
        for k in SHAPES
    }


app = ClientApp()


@app.train(mods=[secagg_mod])
def train(message: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    arrays = client_arrays(partition)
    if context.run_config.get("test-scale"):
        arrays = {
            k: v * float(context.run_config["test-scale"]) for k, v in arrays.items()
        }
    content = RecordDict(
        {
            "arrays": state_to_record(arrays),
            "metrics": MetricRecord(
                {
                    protocol.NUM_EXAMPLES: EXAMPLES[partition],
                    protocol.PARTITION_ID: partition,
                    protocol.TRAIN_LOSS: 0.1 * partition,
                }
            ),
        }
    )
    return Message(content, reply_to=message)


def is_masked_vector(reply: Message) -> bool:
    """A stage-2 reply (it carries the masked vector)."""
    records = reply.content.config_records if reply.has_content() else {}
    return (
        RECORD_KEY_CONFIGS in records
        and Key.MASKED_PARAMETERS in records[RECORD_KEY_CONFIGS]
    )


def secure_round(
    settings: SecAggSettings | None = None,
    *,
    lose: tuple[int, str] | None = None,
    scale: float = 0.0,
    seen: list[tuple[bool, int]] | None = None,
    nodes: int = 4,
) -> tuple[dict[str, torch.Tensor], FedAvgContinual, SecAggPlusExchange]:
    """One secure round over 4 nodes; the new global arrays.

    ``lose=(partition, stage)`` loses that node's reply at ``stage``
    (``"setup"`` or ``"masked"``: after it shared its keys).
    """

    def hook(partition: int, instruction: Message, reply: Message) -> Message | None:
        if seen is not None and reply.has_content():  # (masked?, array entries)
            arrays = sum(len(r) for r in reply.content.array_records.values())
            seen.append((is_masked_vector(reply), arrays))
        if lose is not None and partition == lose[0]:
            masked = is_masked_vector(reply)
            if (lose[1] == "masked") == masked and (
                masked or "pk1" in reply.content.config_records[RECORD_KEY_CONFIGS]
            ):
                return None
        return reply

    run_config: dict[str, bool | float | int | str] = {"seed": SEED}
    if scale:
        run_config["test-scale"] = scale
    grid = InProcessGrid(app, num_nodes=nodes, run_config=run_config, reply_hook=hook)
    strategy = FedAvgContinual(
        shapes=SHAPES, lr=0.1, max_num_examples=max(EXAMPLES), fraction_evaluate=0.0
    )
    exchange = SecAggPlusExchange(settings or SecAggSettings(), strategy, seed=SEED)
    current = {k: torch.zeros(s) for k, s in SHAPES.items()}
    new = run_round(
        strategy, grid, 1, state_to_record(current), ConfigRecord({}), exchange=exchange
    )
    return record_to_state(new), strategy, exchange


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in SHAPES)


# ------------------------------------------------------------------- settings
def test_settings_from_run_config_and_bad_values():
    config = RunConfig.from_mapping(
        {"secure-aggregation": True, "secagg-clipping-range": 2.0}
    )
    assert config.secure_aggregation
    assert config.secagg.clipping_range == 2.0
    assert config.secagg.quantization_range == 2**22
    for key, value, message in [
        ("secagg-num-shares", 2.5, "whole number >= 3"),
        ("secagg-reconstruction-threshold", -1.0, "must be > 0"),
        ("secagg-clipping-range", math.inf, "finite and > 0"),
        ("secagg-quantization-range", 2**32, r"\[2, 2\*\*32\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RunConfig.from_mapping({key: value})
    with pytest.raises(ConfigError, match="below secagg-num-shares"):
        SecAggSettings(num_shares=5.0, reconstruction_threshold=5.0)


def test_shares_and_threshold_follow_flower_rules():
    settings = SecAggSettings(num_shares=1.0, reconstruction_threshold=0.6)
    assert settings.shares_and_threshold(4) == (4, 3)  # t > n / 2: 2.4 -> 3
    assert settings.shares_and_threshold(10) == (10, 6)
    half = SecAggSettings(num_shares=0.5, reconstruction_threshold=0.5)
    assert half.shares_and_threshold(10) == (5, 3)  # round(5) is odd; 3 > 5 / 2
    assert half.shares_and_threshold(12) == (7, 4)  # 6 -> 7, odd
    with pytest.raises(SecureAggregationError, match="above half"):
        SecAggSettings(reconstruction_threshold=2.0).shares_and_threshold(4)
    with pytest.raises(ConfigError, match="above half"):
        SecAggSettings(num_shares=6.0, reconstruction_threshold=3.0)
    with pytest.raises(SecureAggregationError, match="at least 2 clients"):
        settings.shares_and_threshold(1)
    assert SecAggSettings(quantization_range=2**30).max_clients == 3
    with pytest.raises(SecureAggregationError, match="overflow"):
        SecAggSettings(quantization_range=2**30).shares_and_threshold(4)


# -------------------------------------------------------------------- refusal
@pytest.mark.parametrize("method", available_methods())
def test_only_sum_only_methods_are_served(method):
    sum_only = get_method(method).traits.sum_only
    if sum_only:
        check_eligible(method, sum_only, SUM_ONLY)
        return
    with pytest.raises(SecureAggregationError) as info:
        check_eligible(method, sum_only, SUM_ONLY)
    message = str(info.value)
    assert message.startswith(f"{method} needs each client's arrays")
    assert "\n" not in message
    assert listed_sum_only(message) == SUM_ONLY


@pytest.mark.parametrize(
    "method",
    [
        m
        for m in available_methods()
        if issubclass(get_method(m).strategy, AsyncLoraStrategy)
    ],
)
def test_asynchronous_methods_are_refused_for_the_loop_not_their_step(method):
    """FedBuff's step needs only the buffer's sum (docs/methods/fedbuff-lora.md);
    the refusal says what is true: the asynchronous loop has no SecAgg+."""
    from fedlr.server_apps.secagg_checks import check_secure_method
    from fedlr.strategies.registry import resolve

    config = resolve({"method": method, "secure-aggregation": True, "robust": "none"})
    with pytest.raises(SecureAggregationError) as info:
        check_secure_method(config)  # the launcher's and the ServerApp's check
    message = str(info.value)
    assert message.startswith(f"{method} runs asynchronously")
    assert "needs each client's arrays" not in message
    assert listed_sum_only(message) == SUM_ONLY


def test_robust_rules_are_refused():
    with pytest.raises(SecureAggregationError, match="robust=none"):
        check_eligible("fedavg-lora", True, SUM_ONLY, robust="norm-clip")
    with pytest.raises(SecureAggregationError, match="max-client-weight"):
        check_eligible("fedavg-lora", True, SUM_ONLY, max_client_weight=0.5)


def test_the_brief_methods_are_sum_only():
    expected = {
        "fedavg-lora", "fedprox-lora", "fedavgm-lora", "scaffold-lora", "ffa-lora",
        "fedsvd", "fedavg-vera", "fedavg", "fedavg-continual", "fot",
    }  # fmt: skip
    assert expected <= set(SUM_ONLY)
    assert "fedex-lora" not in SUM_ONLY


# ------------------------------------------------------------------ weighting
def test_summands_weighted_mean_and_unweighted_extras():
    rng = np.random.default_rng(0)
    scale = 50.0
    examples = [5, 20, 50]
    replies = [
        {
            "arrays": {"b": rng.normal(size=(3, 2)), "a": rng.normal(size=(2,))},
            "delta": {"c": rng.normal(size=(4,))},
        }
        for _ in examples
    ]
    flat = [
        flatten_summands(r, weighted="arrays", weight=n / scale)
        for r, n in zip(replies, examples, strict=True)
    ]
    manifest = flat[0][0]
    assert [s.name for s in manifest] == ["arrays/a", "arrays/b", "delta/c"]
    sums = [sum(f[1][i] for f in flat) for i in range(len(manifest))]
    means = unflatten_sums(
        manifest,
        sums,
        weighted="arrays",
        total_weight=sum(n / scale for n in examples),
        clients=len(examples),
    )
    total = sum(examples)
    for key in ("a", "b"):
        want = sum(n * r["arrays"][key] for n, r in zip(examples, replies, strict=True))
        np.testing.assert_allclose(means["arrays"][key], want / total, rtol=1e-12)
    want = sum(r["delta"]["c"] for r in replies) / len(replies)
    np.testing.assert_allclose(means["delta"]["c"], want, rtol=1e-12)
    with pytest.raises(ValueError, match="expected"):
        unflatten_sums(manifest, [sums[1], *sums[1:]], weighted="arrays",
                       total_weight=1.0, clients=3)  # fmt: skip


def test_error_bound_formula():
    settings = SecAggSettings(clipping_range=8.0, quantization_range=2**22)
    assert mean_error_bound(settings, [1.0] * 4) == pytest.approx(16 / 2**22)
    assert mean_error_bound(settings, [0.5, 0.5]) == pytest.approx(2 * 16 / 2**22)
    published = [np.array([0.5, -3.0], dtype=np.float32)]
    cast = 3.0 * 2.0**-24 / (1 - 2.0**-24)  # float32's cast of |p| = 3
    assert mean_error_bound(settings, [1.0] * 4, published) == pytest.approx(
        16 / 2**22 + cast
    )
    assert mean_error_bound(
        settings, [1.0] * 4, [published[0].astype(np.float64)]
    ) == pytest.approx(16 / 2**22)
    with pytest.raises(ValueError):
        mean_error_bound(settings, [])


def entry_bounds(
    settings: SecAggSettings, weights: list[float], new: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each entry's bound: the quantiser's and float64's term plus float32's
    cast of that entry, ``u / (1 - u) |p_j|``."""
    base = mean_error_bound(settings, weights)
    u = 2.0**-24
    return {k: base + u / (1 - u) * v.double().abs() for k, v in new.items()}


@pytest.mark.parametrize(
    ("clipping", "levels", "nodes", "scale"),
    [(8.0, 2**30, 3, 2.0), (1000.0, 2**28, 4, 200.0)],
    ids=["c=8,T=2**30", "fot:c=1000,T=2**28"],
)
def test_the_measured_error_stays_within_the_stated_bound(
    clipping, levels, nodes, scale
):
    """The bound with float32's rounding of the mean, at ``c = 8, T = 2**30``
    and at the settings privacy.md recommends for FOT: every entry within
    its own bound, the worst within ``secagg-bound``. At ``T = 2**30`` the
    quantiser's term alone (the bound before) is exceeded."""
    settings = SecAggSettings(clipping_range=clipping, quantization_range=levels)
    new, _, exchange = secure_round(settings, scale=scale, nodes=nodes)
    want = {k: v * scale for k, v in exact_mean(list(range(nodes))).items()}
    weights = [n / max(EXAMPLES) for n in EXAMPLES[:nodes]]
    bounds = entry_bounds(settings, weights, new)
    gaps = {k: (new[k].double() - want[k]).abs() for k in SHAPES}
    assert all(bool((gaps[k] <= bounds[k]).all()) for k in SHAPES)
    worst = max(float(g.max()) for g in gaps.values())
    stated = exchange.last_stats["secagg-bound"]
    assert stated == pytest.approx(
        mean_error_bound(settings, weights, [v.numpy() for v in new.values()])
    )
    assert worst <= stated
    assert exchange.last_stats["secagg-clipped"] == 0
    before = settings.step() * nodes / sum(weights)  # 2ck / (TW): no rounding
    if levels == 2**30:
        assert worst > 2 * before


# ------------------------------------------------------------------- protocol
def test_secure_round_equals_weighted_mean_within_the_bound():
    seen: list[tuple[bool, int]] = []
    new, strategy, exchange = secure_round(seen=seen)
    want = exact_mean([0, 1, 2, 3])
    bound = exchange.last_stats["secagg-bound"]
    weights = [n / max(EXAMPLES) for n in EXAMPLES]
    published = [v.numpy() for v in new.values()]
    assert bound == pytest.approx(
        mean_error_bound(SecAggSettings(), weights, published)
    )
    gap = max_gap(new, want)
    assert gap <= bound
    assert gap > 0  # quantised, not the plain mean
    assert strategy.last_report.metrics["clients"] == 4
    assert exchange.last_stats["secagg-clipped"] == 0
    # the server never saw a client's arrays: the masked-vector replies
    # carry no array data, only the masked integers
    assert [arrays for masked, arrays in seen if masked] == [0, 0, 0, 0]
    assert all(arrays == 0 for _, arrays in seen)
    assert exchange.last_stats["bytes-up"] > 4 * sum(
        4 * math.prod(s) for s in SHAPES.values()
    )


def test_secure_round_is_reproducible():
    first, _, _ = secure_round()
    second, _, _ = secure_round()
    assert max_gap(first, second) == 0.0


@pytest.mark.parametrize("stage", ["masked", "setup"])
def test_a_node_that_drops_out_is_tolerated(stage):
    """Partition 0 fails after sharing its keys (or before): the others' mean."""
    new, strategy, exchange = secure_round(lose=(0, stage))
    want = exact_mean([1, 2, 3])
    bound = exchange.last_stats["secagg-bound"]
    weights = [n / max(EXAMPLES) for n in EXAMPLES[1:]]
    published = [v.numpy() for v in new.values()]
    assert bound == pytest.approx(
        mean_error_bound(SecAggSettings(), weights, published)
    )
    assert max_gap(new, want) <= bound
    assert max_gap(new, exact_mean([0, 1, 2, 3])) > 10 * bound
    assert strategy.last_report.metrics["clients"] == 3


def test_too_many_dropouts_leave_the_round_without_replies():
    settings = SecAggSettings(num_shares=1.0, reconstruction_threshold=4.0)
    from fedlr.errors import NoValidRepliesError

    with pytest.raises(NoValidRepliesError, match="0 valid replies"):
        secure_round(settings, lose=(0, "masked"))


def test_clipped_entries_are_counted():
    _, _, exchange = secure_round(SecAggSettings(clipping_range=0.5))
    assert exchange.last_stats["secagg-clipped"] > 0


def test_plain_train_messages_pass_through_the_mod():
    grid = InProcessGrid(app, num_nodes=2, run_config={"seed": SEED})
    message = Message(
        RecordDict({"config": ConfigRecord({})}),
        dst_node_id=1000,
        message_type="train",
    )
    (reply,) = grid.send_and_receive([message])
    assert not reply.has_error()
    assert sorted(reply.content.array_records) == ["arrays"]
    got = record_to_state(reply.content.array_records["arrays"])
    assert max_gap(got, client_arrays(0)) == 0.0


# ------------------------------------------------------------- the run's hook
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"method": "fedex-lora"}, "fedex-lora needs each client's arrays"),
        ({"robust": "median"}, "robust=none"),
        ({"fraction-train": 0.2}, "at least 2 clients"),
    ],
)
def test_the_run_refuses_what_secure_aggregation_cannot_serve(overrides, message):
    from fedlr.server_apps.secagg import secure_exchange
    from fedlr.strategies.registry import resolve

    method = resolve({"method": "fedavg-lora", "secure-aggregation": True, **overrides})
    with pytest.raises(SecureAggregationError, match=message):
        secure_exchange(method, None, 4)  # type: ignore[arg-type]
    assert secure_exchange(resolve({"method": "fedex-lora"}), None, 4) is None  # type: ignore[arg-type]


def test_run_in_process_refuses_a_method_that_is_not_sum_only(tmp_path):
    from fedlr.launch.local import run_in_process
    from tests.conftest import tiny_run_config

    config = tiny_run_config(
        tmp_path, method="fedex-lora", **{"secure-aggregation": True}
    )
    with pytest.raises(SecureAggregationError) as info:
        run_in_process(config)
    registered = sorted(m for m in available_methods() if get_method(m).traits.sum_only)
    assert "fedex-lora" not in registered
    assert listed_sum_only(str(info.value)) == registered


@pytest.mark.slow  # three secure runs of the tiny model
def test_a_resumed_secure_run_keeps_the_aggregate_checks_history(tmp_path, assets):
    """The check's median travels in the checkpoint: round 3 of a resumed run
    is held to the same reference as round 3 of the uninterrupted one (with
    no history it would be compared with the global norm instead)."""
    from fedlr.launch.local import run_in_process
    from fedlr.privacy.secagg import CHECK_HISTORY
    from fedlr.runs.checkpoint import load_checkpoint
    from tests.conftest import tiny_run_config

    def config(out: str, rounds: int, **extra: object) -> dict[str, object]:
        return tiny_run_config(
            tmp_path / out,
            method="fedavg-lora",
            **{"secure-aggregation": True, "num-server-rounds": rounds, **extra},
        )

    straight = run_in_process(config("a", 3))
    first = run_in_process(config("b", 2))
    history = load_checkpoint(first)["extra"][CHECK_HISTORY]
    assert len(history) == 2 and all(v > 0 for v in history)
    resumed = run_in_process(config("b", 3, **{"resume-from": str(first)}))
    a = pd.read_csv(straight / "results.csv")["secagg-check"].tolist()
    b = pd.read_csv(resumed / "results.csv")["secagg-check"].tolist()
    assert b == pytest.approx(a, rel=1e-6) and len(b) == 3
    assert 0 < b[2] < 4  # to the median of rounds 1-2: accepted
