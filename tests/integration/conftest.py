"""Fixtures of the integration tests: a fresh FLWR_HOME per `flwr run` test.

Each `flwr run` of these tests goes through :func:`fedlr.launch.flwr_run.flwr_run`,
which starts a SuperLink of its own (free ports, ``FLWR_HOME/local/<port>/``,
:class:`fedlr.launch.flwr_run.LocalSuperLink`), as ``make run`` does: another
``flower-superlink`` on the machine (a user's own run, another test session)
is neither used nor waited for, nor stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def superlink_pids(home: Path | None = None) -> list[int]:
    """PIDs of the running ``flower-superlink`` processes (under ``home`` if given)."""
    import psutil

    text = None if home is None else str(Path(home).resolve())
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if not any("flower-superlink" in part for part in cmdline):
            continue
        if text is None or any(text in part for part in cmdline):
            found.append(int(proc.info["pid"]))
    return found


@contextmanager
def local_superlink_home(home: Path) -> Iterator[Path]:
    """``home`` as FLWR_HOME; the SuperLinks started under it are stopped by PID.

    ``flwr_run`` gives each run a SuperLink of its own under
    ``home/local/<port>/``, so SuperLinks elsewhere on the machine do not
    matter; after the block, only those whose files live under ``home`` are
    stopped (:func:`fedlr.launch.flwr_run.stop_local_superlinks`).
    """
    from fedlr.launch.flwr_run import stop_local_superlinks

    try:
        yield home
    finally:
        stop_local_superlinks(home)


@pytest.fixture()
def flwr_home(tmp_path: Path) -> Iterator[Path]:
    """A fresh FLWR_HOME for one test (see :func:`local_superlink_home`)."""
    with local_superlink_home(tmp_path / "flwr-home") as home:
        yield home
