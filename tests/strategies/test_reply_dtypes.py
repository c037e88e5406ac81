"""Safe by default: a reply's dtype never becomes the global arrays' dtype.

Replies are cast to the dtype of the global arrays sent this round before
aggregation, and checked for finiteness after the cast (a float64 1e300
would be Inf in float32): with default settings, on every LoRA- and
VeRA-family method's strategy (fedavg-lora's FedIT, fedex-lora, fedsvd, ...).
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedlr.flower.records import record_to_state
from fedlr.strategies import FedAvgLoRA, FedExLoRA, FedSVD
from tests.strategies.conftest import reply
from tests.strategies.test_lora_strategies import LAYOUT, _client, _global

STRATEGIES = [FedAvgLoRA, FedExLoRA, FedSVD]


def _round(strategy, replies):
    strategy.begin_round(1, ArrayRecord(_global()), ConfigRecord({}))
    return strategy.aggregate_train(1, replies)


def _keys(strategy):
    return set(strategy.reply_shapes())


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_reply_in_another_dtype_does_not_change_the_global_dtype(cls, dtype):
    strategy = cls(layout=LAYOUT)
    keys = _keys(strategy)
    odd = {k: v.to(dtype) for k, v in _client(0).items() if k in keys}
    replies = [reply(1000, odd, {"num-examples": 4})] + [
        reply(
            1000 + i,
            {k: v for k, v in _client(i).items() if k in keys},
            {"num-examples": 4},
        )
        for i in (1, 2)
    ]
    arrays, metrics = _round(strategy, replies)
    assert metrics["dropped"] == 0
    new = record_to_state(arrays)
    assert {str(v.dtype) for v in new.values()} == {"torch.float32"}
    # the same round with the odd reply sent in float32 (rounded the same way)
    same = cls(layout=LAYOUT)
    rounded = {k: v.to(torch.float32) for k, v in odd.items()}
    replies[0] = reply(1000, rounded, {"num-examples": 4})
    want = record_to_state(_round(same, replies)[0])
    for key in new:
        torch.testing.assert_close(new[key], want[key], rtol=0, atol=0)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_a_float64_value_that_overflows_float32_is_dropped_by_name(cls, caplog):
    strategy = cls(layout=LAYOUT)
    keys = sorted(_keys(strategy))
    huge = {k: v.double() for k, v in _client(0).items() if k in keys}
    huge[keys[0]] = torch.full_like(huge[keys[0]], 1e300)
    replies = [reply(1000, huge, {"num-examples": 4})] + [
        reply(
            1000 + i,
            {k: v for k, v in _client(i).items() if k in keys},
            {"num-examples": 4},
        )
        for i in (1, 2)
    ]
    arrays, metrics = _round(strategy, replies)
    assert metrics["dropped"] == 1 and metrics["clients"] == 2
    assert any(
        "node 1000" in r.getMessage() and "overflows float32" in r.getMessage()
        for r in caplog.records
    )
    new = record_to_state(arrays)
    assert all(bool(torch.isfinite(v).all()) for v in new.values())
