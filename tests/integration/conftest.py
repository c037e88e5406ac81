"""Fixtures of the integration tests: a fresh FLWR_HOME per `flwr run` test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def superlink_pids() -> list[int]:
    """PIDs of every running ``flower-superlink`` on this machine."""
    import psutil

    return [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if any("flower-superlink" in part for part in p.info.get("cmdline") or [])
    ]


@contextmanager
def local_superlink_home(home: Path) -> Iterator[Path]:
    """``home`` as FLWR_HOME; the SuperLink `flwr run` starts is stopped by PID.

    `flwr run` uses any SuperLink already listening, so this waits (up to a
    minute) for another test's SuperLink to go away first, and fails if one
    is still running.
    """
    from fedlr.flower.launch import stop_local_superlinks

    deadline = time.monotonic() + 60
    while superlink_pids() and time.monotonic() < deadline:
        time.sleep(2)
    others = superlink_pids()
    if others:
        pytest.fail(
            f"a flower-superlink is already running (PIDs {others}); `flwr run` "
            "would use it instead of starting one for this test. Stop it first."
        )
    try:
        yield home
    finally:
        stop_local_superlinks(home)


@pytest.fixture()
def flwr_home(tmp_path: Path) -> Iterator[Path]:
    """A fresh FLWR_HOME for one test (see :func:`local_superlink_home`)."""
    with local_superlink_home(tmp_path / "flwr-home") as home:
        yield home
