"""Under SecAgg+, nothing one client sends ends the run, as the attacker
writes it.

One node of the 4-node secure federation of ``test_secagg_poison`` (its
masked vector rewritten past fedlr's mod, as a malicious node runs its own
code) sends, in round 2: a bad weight entry, a bad scalar summand, a replay
of its own masked vector of round 1, a replay of another node's vector of
this round, or a vector of the wrong length. The sum cannot say which client
did it, so the round is rejected with a named reason (the wrong length, which
the server sees, drops that node instead); the global arrays are kept, and
round 3 runs as an honest round.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Message
from flwr.common import bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
)

from fedlr.privacy.secagg import SecAggSettings
from tests.adversarial.test_secagg_poison import ATTACKER, Federation, gap

Vector = list[np.ndarray[Any, Any]]


def bad_weight(vector: Vector, _: dict[str, Any]) -> None:
    vector[0] = vector[0] + 7


def bad_scalars(vector: Vector, _: dict[str, Any]) -> None:
    vector[-1] = vector[-1] + 16  # half a digit of the scalars


def own_replay(vector: Vector, memory: dict[str, Any]) -> None:
    vector[:] = [a.copy() for a in memory["own"]]  # its vector of round 1


def peer_replay(vector: Vector, memory: dict[str, Any]) -> None:
    vector[:] = [a.copy() for a in memory["peer"]]  # node 0's of this round


def wrong_length(vector: Vector, _: dict[str, Any]) -> None:
    vector[1] = vector[1].reshape(-1)[:-1]


CASES = {
    "bad weight": (bad_weight, "the weight sum"),
    "bad scalar summand": (bad_scalars, "not whole digits"),
    "replays its round-1 vector": (own_replay, "cannot unmask"),
    "replays node 0's vector": (peer_replay, "cannot unmask"),
}


class Attacked(Federation):
    """The federation whose attacker node rewrites its masked vector in round
    ``at``; it remembers its own vectors and node 0's."""

    def __init__(self, garble: Any, at: int) -> None:
        super().__init__()
        self.attack, self.at = garble, at
        self.memory: dict[str, Any] = {}

    def hook(self, partition: int, instruction: Message, reply: Message) -> Message:
        out = (
            reply.content.config_records.get(RECORD_KEY_CONFIGS)
            if reply.has_content()
            else None
        )
        if out is None or Key.MASKED_PARAMETERS not in out:
            return reply
        vector = [bytes_to_ndarray(b) for b in out[Key.MASKED_PARAMETERS]]
        if partition == 0:
            self.memory["peer"] = [a.copy() for a in vector]
        if partition == ATTACKER:
            if self.number == self.at:
                self.attack(vector, self.memory)
                out[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in vector]
            else:
                self.memory["own"] = [a.copy() for a in vector]
        return reply


def rounds(fed: Attacked) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(3):
        out.append(fed.round())
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_clients_vector_rejects_the_round_and_the_run_goes_on(name, caplog):
    garble, reason = CASES[name]
    fed = Attacked(garble, at=2)
    with caplog.at_level(logging.WARNING):
        first, second, third = rounds(fed)
    assert gap(second, first) == 0.0  # round 2 rejected: the arrays kept
    assert fed.strategy.rejected_rounds == 1
    assert "round 2 rejected: secure aggregation cannot unmask" in caplog.text
    assert reason in caplog.text
    assert 0 < gap(third, second) < 0.02  # round 3: an honest step
    assert fed.strategy.last_rejection is None
    assert fed.exchange.last_stats["clients"] == 4.0


def test_a_vector_of_the_wrong_length_drops_that_node(caplog):
    """The server sees the shapes: the sender is named and left out as a
    dropout (its masks removed with its key's shares), the round goes on."""
    fed = Attacked(wrong_length, at=2)
    with caplog.at_level(logging.WARNING):
        first, second, third = rounds(fed)
    named = f"node {1000 + ATTACKER} rejected: its masked vector is not the round's"
    assert named in caplog.text
    assert fed.strategy.rejected_rounds == 0
    assert 0 < gap(second, first) < 0.02 and 0 < gap(third, second) < 0.02


# ------------------------------------------- the limit: a persistent offset
def offset(delta: float) -> Any:
    """+``delta`` per entry of the attacker's array summands (in value units:
    its share of the mean moves by ``delta / W`` per entry)."""

    def garble(vector: Vector) -> None:
        settings = SecAggSettings()
        levels = round(
            delta * settings.quantization_range / (2 * settings.clipping_range)
        )
        for array in vector[1:-1]:
            array += levels

    return garble


def largest(arrays: dict[str, torch.Tensor]) -> float:
    return max(float(v.abs().max()) for v in arrays.values())


@pytest.mark.parametrize(("delta", "rejected"), [(0.02, 0), (0.05, 6)])
def test_the_detection_limit_of_a_persistent_offset(delta, rejected):
    """The attacker adds ``delta`` per entry from round 3 to round 8. At 0.05
    every attacked round is rejected (its shift of the mean is above 4 x the
    clean rounds' median update norm); at 0.02 none is, and the offset
    accumulates: the documented limit of a check on the aggregate."""
    fed, clean = Federation(), Federation()
    published = []
    for number in range(1, 9):
        published.append(fed.round(offset(delta) if number >= 3 else None))
        honest = clean.round()
    arrays = published[-1]
    assert fed.strategy.rejected_rounds == rejected
    if rejected:
        assert gap(arrays, published[1]) == 0.0  # round 2's arrays kept
    else:
        assert largest(arrays) > largest(honest) + 0.04  # 0.180 vs 0.126
