"""tiny-llama's warm-up: lazy, cached, one process trains while others wait.

A tiny recipe (2 steps, hidden 16) in a temporary folder stands for the real
one (2,000 steps, about 4 minutes): the same code trains, caches and locks.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock

from fedlr.models import causal
from fedlr.models.causal import WarmUp, warm_up

TINY = WarmUp(hidden=16, layers=1, heads=2, intermediate=32, steps=2, batch_size=4)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "tiny-llama-test"
    monkeypatch.setattr(causal, "warm_up_path", lambda spec=None: path)
    return path


def test_first_use_trains_once_then_reads_the_cache(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fedlr"):
        assert warm_up(TINY) == cache
    assert "not in the cache yet: warming it up once" in caplog.text
    info = json.loads((cache / "fedlr-warm-up.json").read_text())
    assert info["settings"]["steps"] == 2 and math.isfinite(info["final-loss"])
    stamp = (cache / "config.json").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedlr"):
        assert warm_up(TINY) == cache
    assert caplog.text == ""  # cached: no training, no line
    assert (cache / "config.json").stat().st_mtime_ns == stamp
    free = FileLock(str(cache.parent / f"{cache.name}.lock"))
    free.acquire(timeout=0)  # released: a Timeout here would fail the test
    free.release()


def test_a_second_process_waits_for_the_one_warming_up(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the lock is held, warm_up says it waits; when the holder has
    written the model and released the lock, it uses those files (no
    training of its own)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    holder = FileLock(str(cache.parent / f"{cache.name}.lock"))
    holder.acquire()
    result: list[Path] = []
    waiter = threading.Thread(target=lambda: result.append(warm_up(TINY)))
    with caplog.at_level(logging.INFO, logger="fedlr"):
        waiter.start()
        deadline = time.monotonic() + 30
        while "waiting for it" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "another process is warming it up" in caplog.text
        assert waiter.is_alive() and not result
        cache.mkdir()
        (cache / "config.json").write_text("{}")  # the other process's files
        holder.release()
        waiter.join(timeout=30)
    assert result == [cache]
    assert "warming it up once" not in caplog.text
    assert not (cache / "fedlr-warm-up.json").exists()  # it did not train
