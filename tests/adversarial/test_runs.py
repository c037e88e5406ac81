"""Whole in-process federations with one malicious node (fedlr's own client).

Each run uses :mod:`tests.adversarial.malicious_app`: every node trains with
fedlr's real ClientApp, and partition 0 replaces its train reply by a
payload. The reference is the same run in which partition 0's reply is lost
(the grid drops it): a run whose attacker's replies are all dropped must end
with exactly the reference's global arrays.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from fedlr.launch.local import run_in_process
from tests.adversarial.malicious_app import malicious_app
from tests.strategies.test_every_method import ASSETS, CASES, run_config

pytestmark = pytest.mark.slow  # whole federations: the integration set

FAMILIES = ("fedex-lora", "vera-fedex", "qrmix", "fot")


def _config(method: str, out, **overrides):
    from fedlr.data.assets import ensure_assets

    case = CASES[method]
    ensure_assets(ASSETS[case.family], quiet=True)
    config = run_config(case, out)
    if "num-server-rounds" not in case.overrides:
        config["num-server-rounds"] = 2
    config.update(overrides)
    return config


def _lose_partition_0(partition, instruction, reply):
    return None if partition == 0 else reply


def _final(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_arrays.pt", weights_only=True)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each family's run with partition 0's replies lost (cached)."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def reference(method: str) -> dict[str, torch.Tensor]:
        if method not in cache:
            out = tmp_path_factory.mktemp(f"ref-{method}")
            run_dir = run_in_process(_config(method, out), reply_hook=_lose_partition_0)
            cache[method] = _final(run_dir)
        return cache[method]

    return reference


@pytest.mark.parametrize("method", FAMILIES)
def test_undecodable_replies_are_dropped_every_round(method, tmp_path, references):
    run_dir = run_in_process(
        _config(method, tmp_path), client_app=malicious_app("garbage-bytes")
    )
    frame = pd.read_csv(run_dir / "results.csv")
    assert (frame["dropped"] == 1).all()
    assert (frame["rejected-rounds"] == 0).all()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    _assert_same(_final(run_dir), references(method))


def test_boosted_update_claiming_1e15_examples_is_capped_out(tmp_path, references):
    run_dir = run_in_process(
        _config("fedex-lora", tmp_path),
        client_app=malicious_app("boosted-50x-claiming-1e15"),
    )
    frame = pd.read_csv(run_dir / "results.csv")
    assert (frame["dropped"] == 1).all()
    _assert_same(_final(run_dir), references("fedex-lora"))


def test_poisoned_rounds_are_rejected_and_never_checkpointed(tmp_path, caplog):
    """1e30 in float32 (finite) makes FedEx's base weights Inf: with the
    update-size screen off, every round is rejected, the initial model stays
    published, only round 0 is checkpointed, and the run finishes."""
    run_dir = run_in_process(
        _config("fedex-lora", tmp_path, **{"screen-ratio": 0.0}),
        client_app=malicious_app("huge-float32"),
    )
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["rejected-rounds"].tolist() == [1, 2]
    assert frame["dropped"].tolist() == [0, 0]
    manifest = json.loads((run_dir / "checkpoint.json").read_text())
    assert [c["round"] for c in manifest["checkpoints"]] == [0]
    final = _final(run_dir)
    assert all(bool(torch.isfinite(t).all()) for t in final.values())
    (entry,) = manifest["checkpoints"]
    initial = torch.load(run_dir / entry["file"], weights_only=True)["arrays"]
    _assert_same(final, initial)


def test_trimmed_mean_removes_the_poisoner(tmp_path, references):
    """The same attacker under robust = trimmed-mean (the update-size screen
    off): trimmed every round; the result is the run without it (up to the
    re-normalised weights' rounding)."""
    run_dir = run_in_process(
        _config("fedex-lora", tmp_path, robust="trimmed-mean", **{"screen-ratio": 0.0}),
        client_app=malicious_app("huge-float32"),
    )
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["robust-trimmed"].tolist() == [1, 1]
    assert frame["rejected-rounds"].tolist() == [0, 0]
    want = references("fedex-lora")
    got = _final(run_dir)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-6), key


def test_checkpoint_arrays_that_do_not_fit_the_layout_are_refused(tmp_path):
    """A checkpoint re-saved (valid hash) with an array of another shape is
    refused when resuming, naming the layout, before any round runs."""
    from fedlr.errors import CheckpointError
    from fedlr.runs.checkpoint import load_checkpoint, save_checkpoint

    config = _config("fedex-lora", tmp_path, **{"num-server-rounds": 1})
    run_dir = run_in_process(config)
    payload = load_checkpoint(run_dir)
    key = sorted(payload["arrays"])[0]
    payload["arrays"][key] = torch.zeros(3, 3)
    save_checkpoint(run_dir, payload, keep=2)
    resumed = {**config, "num-server-rounds": 2, "resume-from": str(run_dir)}
    with pytest.raises(CheckpointError, match="do not fit this run's layout"):
        run_in_process(resumed)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1]
