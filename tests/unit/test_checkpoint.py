"""Checkpoint files: atomic, hashed, code-free, the last K kept, fallback."""

from __future__ import annotations

import json
import logging
import pickle
import random

import numpy as np
import pytest
import torch

from fedlr.errors import CheckpointError, ConfigError
from fedlr.runs.checkpoint import (
    MANIFEST,
    check_resumable,
    checkpoint_name,
    get_rng_state,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from fedlr.strategies.registry import resolve


def _payload(round_=3):
    return {
        "round": round_,
        "arrays": {"a": torch.arange(6.0).reshape(2, 3) + round_},
        "strategy": {"rank": 6, "personal": {7: {"b": torch.ones(2)}}},
        "rng": get_rng_state(),
        "results": [{"round": 1, "accuracy": np.float64(0.5), "method": "x"}],
        "config": {"method": "fedspec", "seed": 1},
    }


def test_round_trip_keeps_the_last_k_and_no_temporary(tmp_path):
    for r in range(4):
        save_checkpoint(tmp_path, _payload(r), keep=2)
    loaded = load_checkpoint(tmp_path)
    assert loaded["round"] == 3 and loaded["strategy"]["rank"] == 6
    assert torch.equal(loaded["arrays"]["a"], torch.arange(6.0).reshape(2, 3) + 3)
    assert loaded["results"][0]["accuracy"] == 0.5
    assert {p.name for p in tmp_path.iterdir()} == {
        MANIFEST,
        checkpoint_name(2),
        checkpoint_name(3),
    }
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["round"] == 3
    assert [e["round"] for e in manifest["checkpoints"]] == [2, 3]
    assert all(len(e["sha256"]) == 64 for e in manifest["checkpoints"])


def test_rng_states_restore_every_generator_through_a_file(tmp_path):
    save_checkpoint(tmp_path, _payload(1))
    state = load_checkpoint(tmp_path)["rng"]
    set_rng_state(state)
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(state)
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert first == again


def test_flipped_bytes_are_refused_and_the_previous_checkpoint_used(tmp_path, caplog):
    save_checkpoint(tmp_path, _payload(1))
    save_checkpoint(tmp_path, _payload(2))
    newest = tmp_path / checkpoint_name(2)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        entry = json.loads((tmp_path / MANIFEST).read_text())["checkpoints"][-1]
        read_checkpoint(newest, entry["sha256"])
    with caplog.at_level(logging.WARNING, logger="fedlr"):
        loaded = load_checkpoint(tmp_path)
    assert loaded["round"] == 1
    assert any("SHA-256" in m for m in caplog.messages)
    assert any("round 1 instead" in m for m in caplog.messages)


class _Planted:
    """A pickle that would create a file if it were ever unpickled."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_planted_pickle_runs_no_code(tmp_path):
    target = tmp_path / "pwned"
    save_checkpoint(tmp_path, _payload(1))
    planted = tmp_path / checkpoint_name(1)
    with planted.open("wb") as handle:
        pickle.dump({"round": 1, "arrays": _Planted(target)}, handle)
    # Even with the manifest rewritten to the planted file's hash, nothing runs.
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    import hashlib

    manifest["checkpoints"][0]["sha256"] = hashlib.sha256(
        planted.read_bytes()
    ).hexdigest()
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"resume-from.*cannot read .* safely"):
        load_checkpoint(tmp_path)
    assert not target.exists()


def test_missing_or_broken_checkpoints_name_resume_from(tmp_path):
    with pytest.raises(ConfigError, match=r"resume-from.*no checkpoint\.json"):
        load_checkpoint(tmp_path)
    (tmp_path / MANIFEST).write_text("not json")
    with pytest.raises(ConfigError, match="not a checkpoint manifest"):
        load_checkpoint(tmp_path)
    (tmp_path / MANIFEST).write_text(
        json.dumps({"checkpoints": [{"round": 1, "file": "../x.pt", "sha256": "0"}]})
    )
    with pytest.raises(ConfigError, match="outside the run directory"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, {"round": 1})  # a manifest-listed file without arrays
    with pytest.raises(ConfigError, match="has no 'arrays' entry"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save_checkpoint(tmp_path, _payload(2), keep=0)


def test_resuming_a_different_run_is_refused():
    saved = {"method": "fedspec", "seed": 1, "num-server-rounds": 4}
    check_resumable(saved, {**saved, "num-server-rounds": 8, "resume-from": "/x"})
    check_resumable(saved, {**saved, "keep-checkpoints": 5})
    with pytest.raises(ConfigError, match=r"'seed'.*made with 1, this run has 2"):
        check_resumable(saved, {**saved, "seed": 2})


def test_a_key_newer_than_the_checkpoint_passes_only_at_its_default():
    saved = {"method": "fedspec", "seed": 1}
    defaults = {"method": "fedex-lora", "seed": 0, "heldout-check": False}
    check_resumable(saved, {**saved, "heldout-check": False}, defaults)
    newer = r"'heldout-check'.*predates.*default False.*has True"
    with pytest.raises(ConfigError, match=newer):
        check_resumable(saved, {**saved, "heldout-check": True}, defaults)
    with pytest.raises(ConfigError, match=r"'heldout-check'.*predates"):
        check_resumable(saved, {**saved, "heldout-check": False})  # no defaults known
    with pytest.raises(ConfigError, match=r"'old-key'.*does not have"):
        check_resumable({**saved, "old-key": 3}, saved, defaults)


def test_every_key_of_a_resolved_method_has_its_declared_default():
    method = resolve({"method": "fedspec", "robust": "none"})
    assert method.defaults().keys() == method.to_mapping().keys()
    assert method.defaults() == {
        **method.to_mapping(),
        "method": "fedex-lora",
        "robust": "auto",
    }
    auto = resolve({"method": "fedspec"})  # robust = auto, resolved: 3 keys
    differ = {k for k, v in auto.to_mapping().items() if auto.defaults()[k] != v}
    assert differ == {"method", "robust", "clip-reference", "server-update-share"}
    changed = resolve({"method": "fedspec", "seed": 7})
    assert changed.defaults()["seed"] == method.to_mapping()["seed"] != 7
