"""Shared fixtures: a tiny, fast run configuration on the offline assets."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make unit``'s ``-n``), each worker's torch uses
    its share of the cores: two workers with every core each would
    oversubscribe the CPU and run slower than one.

    The processes a worker starts (a ``flwr run``'s SuperLink, ServerApp and
    Ray actors) inherit the share through ``OMP_NUM_THREADS``: beside two
    busy processes, the 1,000-client test's Ray actor trained its 100 clients
    in 226 s with two threads and in 51 s with one; in a fresh-clone
    ``make test`` that test went from 403 s to 100 s.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        share = max(1, cores // int(workers))
        torch.set_num_threads(share)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, str(share))
    # --dist loadfile hands out files in the order pytest_collection_modifyitems
    # leaves them, not xdist's own order (most tests first), which put the
    # single-test runs of minutes last, where one worker ran them alone.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Longest first, so that no worker ends the stage alone on a long run.

    Files with an ``early(seconds=...)`` test come first, longest first; then
    the others by their number of tests, as pytest-xdist orders them. Items of
    one file stay together and in their order."""
    counts = Counter(_file(item) for item in items)
    seconds: dict[str, float] = {}
    for item in items:
        mark = item.get_closest_marker("early")
        if mark is not None:
            file = _file(item)
            seconds[file] = max(seconds.get(file, 0.0), float(mark.kwargs["seconds"]))
    items.sort(key=lambda item: (-seconds.get(_file(item), 0.0), -counts[_file(item)]))


def tiny_run_config(output_dir: Path, **overrides: Any) -> dict[str, Any]:
    """Run config of the tiny BERT on polarity: seconds per round on 2 cores.

    ``robust = none``: these runs check one feature's arithmetic against the
    clients' replies alone; the default (``robust = auto``, the server's own
    update with a clip at its norm) has its own tests
    (tests/adversarial/test_server_update.py) and is set back by passing
    ``robust="auto"``."""
    config: dict[str, Any] = {
        "method": "fedex-lora",
        "robust": "none",
        "model": "tiny-bert",
        "dataset": "polarity",
        "num-server-rounds": 2,
        "local-steps": 3,
        "batch-size": 8,
        "max-length": 32,
        "lora-rank": 4,
        "lora-alpha": 8.0,
        "lr": 0.01,
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5,
        "num-partitions": 3,
        "max-eval-examples": 128,
        "seed": 7,
        "device": "cpu",
        "output-dir": str(output_dir),
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="session")
def assets() -> None:
    """Make sure the offline assets are in the cache (fetches on first use)."""
    from fedlr.data.assets import ensure_assets

    ensure_assets(["polarity", "minilm"])


@pytest.fixture(autouse=True)
def node_state_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Every test's nodes keep their privacy ledgers in a directory of its own.

    A node's ledger outlives runs by design (:mod:`fedlr.privacy.budget`): without
    this, a test's DP-SGD rounds would spend from the budget of the next test that
    trains the same data.
    """
    path = tmp_path_factory.mktemp("node-state")
    monkeypatch.setenv("FEDLR_NODE_STATE_DIR", str(path))
    monkeypatch.delenv("FEDLR_NODE_CONFIG", raising=False)
    return path
