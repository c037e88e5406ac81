"""Checkpoint files: atomic round trip, RNG states, refusing a different run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fedlr.checkpoint import (
    check_resumable,
    get_rng_state,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from fedlr.errors import ConfigError


def _payload(round_=3):
    return {
        "round": round_,
        "arrays": {"a": torch.arange(6.0).reshape(2, 3)},
        "strategy": {"rank": 6},
        "rng": get_rng_state(),
        "results": [{"round": 1, "accuracy": 0.5}],
        "config": {"method": "fedspec", "seed": 1},
    }


def test_round_trip_and_no_temporary_left(tmp_path):
    save_checkpoint(tmp_path, _payload(2))
    save_checkpoint(tmp_path, _payload(3))
    loaded = load_checkpoint(tmp_path)
    assert loaded["round"] == 3 and loaded["strategy"] == {"rank": 6}
    assert torch.equal(loaded["arrays"]["a"], torch.arange(6.0).reshape(2, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.json",
        "checkpoint.pt",
    ]


def test_rng_states_restore_every_generator():
    state = get_rng_state()
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(state)
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert first == again


def test_missing_or_broken_checkpoints_name_resume_from(tmp_path):
    with pytest.raises(ConfigError, match=r"resume-from.*no checkpoint\.pt"):
        load_checkpoint(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read"):
        load_checkpoint(tmp_path)
    torch.save({"round": 1}, tmp_path / "checkpoint.pt")
    with pytest.raises(ConfigError, match="has no 'arrays' entry"):
        load_checkpoint(tmp_path)


def test_resuming_a_different_run_is_refused():
    saved = {"method": "fedspec", "seed": 1, "num-server-rounds": 4}
    check_resumable(saved, {**saved, "num-server-rounds": 8, "resume-from": "/x"})
    with pytest.raises(ConfigError, match=r"'seed'.*made with 1, this run has 2"):
        check_resumable(saved, {**saved, "seed": 2})
