"""SecAgg+ against a hostile server (and garbling peers), as an attacker writes it.

A :class:`HostileGrid` rewrites the server's stage messages in flight; a
reply hook garbles nodes' replies and records every unmask exchange with
the secrets the nodes really held, so each test counts the nodes the server
could unmask (it holds both the mask seed and the key of one node). The
nodes run fedlr's ClientApp mod (:func:`~fedlr.client_apps.secagg.secagg_mod`,
with its guard) around the seeded test handler of ``tests/unit/test_secagg``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message
from flwr.common import bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

from fedlr.errors import NoValidRepliesError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.privacy.secagg import SecAggSettings
from fedlr.round.pipeline import run_round
from fedlr.server_apps.secagg import SecAggPlusExchange
from fedlr.strategies.fot import FedAvgContinual
from tests.unit.test_secagg import EXAMPLES, SEED, SHAPES, app, max_gap

VICTIM = 1001
Tamper = Callable[[str, Message], None]


class HostileGrid(InProcessGrid):
    """An in-process grid whose server rewrites stage messages (``tamper``)."""

    def __init__(self, tamper: Tamper | None = None, **kwargs: Any) -> None:
        super().__init__(app, num_nodes=4, run_config={"seed": SEED}, **kwargs)
        self.tamper = tamper

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        sent = list(messages)
        for message in sent:
            records = message.content.config_records
            if self.tamper is not None and RECORD_KEY_CONFIGS in records:
                self.tamper(str(records[RECORD_KEY_CONFIGS][Key.STAGE]), message)
        return super().send_and_receive(sent, timeout=timeout)


def stage_of(configs: Any) -> str:
    """A stage message's stage (Flower's mod pops ``Key.STAGE`` when it runs)."""
    if Key.STAGE in configs:
        return str(configs[Key.STAGE])
    if Key.ACTIVE_NODE_ID_LIST in configs:
        return Stage.UNMASK
    if Key.SOURCE_LIST in configs:
        return Stage.COLLECT_MASKED_VECTORS
    if Key.SHARE_NUMBER in configs:
        return Stage.SETUP
    return Stage.SHARE_KEYS


class Spy:
    """Reply hook: garbles replies (``garble``), keeps errors and unmask shares."""

    def __init__(self, garble: Callable[[int, str, Message], None] | None = None):
        self.garble = garble
        self.errors: list[str] = []
        self.seeds: dict[int, list[bytes]] = {}
        self.keys: dict[int, list[bytes]] = {}
        self.truth: dict[int, tuple[bytes, bytes]] = {}
        self.grid: InProcessGrid | None = None

    def __call__(self, partition: int, instruction: Message, reply: Message) -> Message:
        if reply.has_error():
            self.errors.append(reply.error.reason)
            return reply
        configs = instruction.content.config_records.get(RECORD_KEY_CONFIGS, {})
        stage = stage_of(configs)
        if Key.MASKED_PARAMETERS in reply.content.config_records.get(
            RECORD_KEY_CONFIGS, {}
        ):  # fedlr's mod replaced the instruction's records
            stage = Stage.COLLECT_MASKED_VECTORS
        if stage == Stage.UNMASK:
            out = reply.content.config_records[RECORD_KEY_CONFIGS]
            seeds = len(configs[Key.ACTIVE_NODE_ID_LIST])  # then the keys
            pairs = zip(out[Key.NODE_ID_LIST], out[Key.SHARE_LIST], strict=True)
            for i, (owner, share) in enumerate(pairs):
                book = self.seeds if i < seeds else self.keys
                book.setdefault(int(owner), []).append(share)
        if stage in (Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK):
            assert self.grid is not None
            nid = int(instruction.metadata.dst_node_id)
            state = self.grid.contexts[nid].state.config_records[RECORD_KEY_STATE]
            self.truth[nid] = (state["rd_seed"], state["sk1"])
        if self.garble is not None:
            self.garble(partition, stage, reply)
        return reply

    def unmasked(self) -> list[int]:
        """Nodes whose mask seed AND key the server could rebuild."""
        out = []
        for nid, (seed, key) in self.truth.items():
            try:
                if (
                    combine_shares(self.seeds.get(nid, [b""])) == seed
                    and combine_shares(self.keys.get(nid, [b""])) == key
                ):
                    out.append(nid)
            except Exception:
                continue
        return out


def secure_round(
    tamper: Tamper | None = None,
    garble: Callable[[int, str, Message], None] | None = None,
    *,
    grid: HostileGrid | None = None,
    spy: Spy | None = None,
    number: int = 1,
) -> tuple[dict[str, torch.Tensor] | NoValidRepliesError, float, Spy, HostileGrid]:
    spy = spy or Spy(garble)
    grid = grid or HostileGrid(tamper, reply_hook=spy)
    grid.tamper = tamper
    spy.grid = grid
    strategy = FedAvgContinual(
        shapes=SHAPES, lr=0.1, max_num_examples=max(EXAMPLES), fraction_evaluate=0.0
    )
    exchange = SecAggPlusExchange(SecAggSettings(), strategy, seed=SEED)
    current = state_to_record({k: torch.zeros(s) for k, s in SHAPES.items()})
    started = time.perf_counter()
    try:
        new = run_round(
            strategy, grid, number, current, ConfigRecord({}), exchange=exchange
        )
        result: dict[str, torch.Tensor] | NoValidRepliesError = record_to_state(new)
    except NoValidRepliesError as exc:
        result = exc
    return result, time.perf_counter() - started, spy, grid


def at(stage: str, change: Callable[[ConfigRecord], None]) -> Tamper:
    def tamper(now: str, message: Message) -> None:
        if now == stage:
            change(message.content.config_records[RECORD_KEY_CONFIGS])

    return tamper


def kept(result: dict[str, torch.Tensor] | NoValidRepliesError) -> bool:
    """The round was rejected: the global arrays are the round's (zeros)."""
    return isinstance(result, dict) and all(
        float(v.abs().max()) == 0.0 for v in result.values()
    )


def refused(spy: Spy, check: str) -> int:
    return sum(f"secagg-guard:{check}" in reason for reason in spy.errors)


def honest_after(grid: HostileGrid, spy: Spy) -> None:
    """The node's next honest round equals a fresh federation's round."""
    spy.garble = None
    after, _, _, _ = secure_round(grid=grid, spy=spy, number=2)
    fresh, _, _, _ = secure_round(number=2)
    assert isinstance(after, dict) and isinstance(fresh, dict)
    assert max_gap(after, fresh) == 0.0


# --------------------------------------------------------------------- unmask
def both_lists(configs: ConfigRecord) -> None:
    configs[Key.DEAD_NODE_ID_LIST] = [*configs[Key.DEAD_NODE_ID_LIST], VICTIM]


def test_alive_and_dead_request_is_refused():
    result, _, spy, grid = secure_round(at(Stage.UNMASK, both_lists))
    assert kept(result)  # the round is rejected, the run goes on
    assert refused(spy, "alive-and-dead") == 4
    assert spy.unmasked() == []
    honest_after(grid, spy)


def test_without_the_guard_the_same_attack_unmasks_the_victim(monkeypatch):
    """Control: the attack above works on Flower's mod alone (the guard's
    unmask checks off; it still answers the consistency round)."""
    from fedlr.client_apps.secagg_guard import _Book

    monkeypatch.setattr(_Book, "check_unmask", lambda self, configs: None)
    monkeypatch.setattr(_Book, "check_consistent", lambda self, *args: None)
    _, _, spy, _ = secure_round(at(Stage.UNMASK, both_lists))
    assert spy.unmasked() == [VICTIM]


def test_node_outside_the_neighbourhood_is_refused():
    def outsider(configs: ConfigRecord) -> None:
        configs[Key.DEAD_NODE_ID_LIST] = [4242]

    result, _, spy, grid = secure_round(at(Stage.UNMASK, outsider))
    assert kept(result)  # the round is rejected, the run goes on
    assert refused(spy, "neighbourhood") == 4
    assert spy.unmasked() == []
    honest_after(grid, spy)


def test_same_round_cannot_ask_for_the_other_secret():
    spy = Spy()
    first, _, spy, grid = secure_round(spy=spy)
    assert isinstance(first, dict)

    def swap(configs: ConfigRecord) -> None:
        configs[Key.ACTIVE_NODE_ID_LIST] = [
            n for n in configs[Key.ACTIVE_NODE_ID_LIST] if n != VICTIM
        ]
        configs[Key.DEAD_NODE_ID_LIST] = [VICTIM]

    again, _, spy, _ = secure_round(at(Stage.UNMASK, swap), grid=grid, spy=spy)
    assert kept(again)
    assert refused(spy, "both-secrets") == 3  # the victim: alive-and-dead
    assert refused(spy, "alive-and-dead") == 1
    assert VICTIM not in spy.keys


# -------------------------------------------------------------------- setup
@pytest.mark.parametrize("shares", [10_000, 100_000])
def test_oversized_share_num_is_refused_fast(shares):
    clean, clean_s, _, _ = secure_round()
    assert isinstance(clean, dict)

    def inflate(configs: ConfigRecord) -> None:
        configs[Key.SHARE_NUMBER] = shares
        configs[Key.SAMPLE_NUMBER] = shares

    result, seconds, spy, grid = secure_round(at(Stage.SETUP, inflate))
    assert isinstance(result, NoValidRepliesError)
    assert refused(spy, "share-num") == 4
    assert seconds < 2 * clean_s
    assert spy.unmasked() == []
    honest_after(grid, spy)


@pytest.mark.parametrize("threshold", [0, 1, 2])
def test_threshold_at_or_below_half_is_refused(threshold):
    def lower(configs: ConfigRecord) -> None:
        configs[Key.THRESHOLD] = threshold

    result, _, spy, grid = secure_round(at(Stage.SETUP, lower))
    assert isinstance(result, NoValidRepliesError)
    assert refused(spy, "threshold") == 4
    assert spy.unmasked() == []
    honest_after(grid, spy)


def test_settings_changed_between_stages_are_refused():
    def change(now: str, message: Message) -> None:
        if now == Stage.COLLECT_MASKED_VECTORS:
            message.content.config_records["fedlr-secagg"]["clipping-range"] = 0.01

    result, _, spy, grid = secure_round(change)
    assert isinstance(result, NoValidRepliesError)
    assert refused(spy, "settings-changed") == 4
    assert spy.unmasked() == []
    honest_after(grid, spy)


def test_a_distributed_dp_threshold_above_the_rounds_is_refused():
    """Each node sizes its share of distributed DP's noise by the threshold
    the server states at the masked-vector stage; a larger one than the
    round's set-up would shrink every node's noise."""

    def inflate(now: str, message: Message) -> None:
        if now == Stage.COLLECT_MASKED_VECTORS:
            message.content.config_records["fedlr-secagg"]["dp-threshold"] = 4

    result, _, spy, grid = secure_round(inflate)
    assert isinstance(result, NoValidRepliesError)
    assert refused(spy, "settings-changed") == 4
    assert spy.unmasked() == []
    honest_after(grid, spy)


# ------------------------------------------------------------ garbled peers
def test_garbled_share_names_its_holder_and_is_left_out(caplog):
    def garble(partition: int, stage: str, reply: Message) -> None:
        if partition == 2 and stage == Stage.UNMASK:
            out = reply.content.config_records[RECORD_KEY_CONFIGS]
            out[Key.SHARE_LIST] = [os.urandom(len(s)) for s in out[Key.SHARE_LIST]]

    clean, _, _, _ = secure_round()
    with caplog.at_level(logging.WARNING):
        result, _, spy, _ = secure_round(garble=garble)
    assert isinstance(result, dict) and isinstance(clean, dict)
    assert max_gap(result, clean) == 0.0
    assert "node 1002 sent a garbled share" in caplog.text
    assert "Failed to combine" not in caplog.text
    assert spy.unmasked() == []


def test_garbled_ciphertext_names_its_sender(caplog):
    def garble(partition: int, stage: str, reply: Message) -> None:
        out = reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if partition == 1 and Key.CIPHERTEXT_LIST in out:
            out[Key.CIPHERTEXT_LIST] = [b"x" + c[1:] for c in out[Key.CIPHERTEXT_LIST]]

    with caplog.at_level(logging.WARNING):
        result, _, spy, grid = secure_round(garble=garble)
    assert isinstance(result, NoValidRepliesError)  # 3 of 4 nodes cannot mask
    assert refused(spy, "ciphertext") == 3
    assert "node 1001's ciphertexts do not decrypt" in caplog.text
    assert spy.unmasked() == []
    honest_after(grid, spy)


def test_wrong_weight_in_a_masked_vector_rejects_the_round_named(caplog):
    def garble(partition: int, stage: str, reply: Message) -> None:
        if partition == 3 and stage == Stage.COLLECT_MASKED_VECTORS:
            out = reply.content.config_records[RECORD_KEY_CONFIGS]
            vector = list(out[Key.MASKED_PARAMETERS])
            vector[0] = ndarray_to_bytes(bytes_to_ndarray(vector[0]) + 7)
            out[Key.MASKED_PARAMETERS] = vector

    with caplog.at_level(logging.WARNING):
        result, _, spy, grid = secure_round(garble=garble)
    assert kept(result)
    assert "weight sum" in caplog.text and "cannot unmask" in caplog.text
    assert "round 1 rejected: secure aggregation cannot unmask" in caplog.text
    assert spy.unmasked() == []
    honest_after(grid, spy)


# --------------------------------------------------------------- what leaks
def test_masked_replies_carry_nothing_in_the_clear():
    plain: list[dict[str, Any]] = []

    def look(partition: int, stage: str, reply: Message) -> None:
        if stage == Stage.COLLECT_MASKED_VECTORS:
            plain.append({name: dict(r) for name, r in reply.content.items()})

    result, _, _, _ = secure_round(garble=look)
    assert isinstance(result, dict)
    assert len(plain) == 4
    for content in plain:
        assert list(content) == [RECORD_KEY_CONFIGS]  # no metrics, no manifest
        assert list(content[RECORD_KEY_CONFIGS]) == [Key.MASKED_PARAMETERS]


def test_round_metrics_come_from_the_secure_sums():
    strategy_loss: list[float] = []
    spy = Spy()
    grid = HostileGrid(reply_hook=spy)
    spy.grid = grid
    strategy = FedAvgContinual(
        shapes=SHAPES, lr=0.1, max_num_examples=max(EXAMPLES), fraction_evaluate=0.0
    )
    exchange = SecAggPlusExchange(SecAggSettings(), strategy, seed=SEED)
    current = state_to_record({k: torch.zeros(s) for k, s in SHAPES.items()})
    run_round(strategy, grid, 1, current, ConfigRecord({}), exchange=exchange)
    metrics = strategy.last_report.metrics
    want = sum(n * 0.1 * p for p, n in enumerate(EXAMPLES)) / sum(EXAMPLES)
    strategy_loss.append(float(metrics.get("train-loss", np.nan)))
    assert strategy_loss[0] == pytest.approx(want, abs=1e-6)
    assert exchange.last_stats["secagg-clipped"] == 0


# ----------------------------------------------------------- mask expansion
def test_flower_mask_expansion_uses_32_bits_of_the_seed():
    """pseudo_rand_gen XOR-folds the seed to 32 bits: different keys, same mask."""
    key = bytearray(os.urandom(32))
    other = bytearray(key)
    flip = os.urandom(4)
    for word in (0, 1):  # the same change in two words cancels in the fold
        for i in range(4):
            other[4 * word + i] ^= flip[i]
    assert bytes(key) != bytes(other)
    shapes = [(1000,)]
    first = pseudo_rand_gen(bytes(key), 2**32, shapes)[0]
    second = pseudo_rand_gen(bytes(other), 2**32, shapes)[0]
    assert np.array_equal(first, second)
