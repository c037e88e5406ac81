"""The test suite beside a user's own run: a ``flwr run`` test passes while
another fedlr run (a real launch, as ``make run`` starts it: its own
``flower-superlink``, SuperExec, Ray) is going on the same machine, and
leaves that run alone.

A test that used to refuse in that situation (issue 37: the SecAgg+
``flwr run`` tests refused when any other ``flower-superlink`` ran) is run
here, unchanged, through pytest in a subprocess while the other run trains:
the shortest of them (one round, a node failing after its keys).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.test_launch import (
    LAUNCH_TIMEOUT,
    STOP_TIMEOUT,
    _cleanup,
    _cmdlines,
    _start,
)

pytestmark = pytest.mark.slow


@pytest.mark.early(seconds=105)
def test_a_flwr_run_test_passes_while_another_run_is_going(tmp_path, assets):
    other = _start("users-run", tmp_path / "users-home", tmp_path / "users-out", 200)
    try:
        other.wait_for(r"fedlr: initial accuracy", timeout=LAUNCH_TIMEOUT)
        other.watch()
        assert "flower-superlink" in _cmdlines(other.seen)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/integration/test_secagg_flwr_run.py::"
                "test_a_node_failing_after_sharing_keys_is_tolerated",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1200,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
        assert result.returncode == 0, result.stdout[-3000:]
        assert "1 passed" in result.stdout
        # The user's run is still going, untouched, and still training.
        assert other.proc.poll() is None, other.text[-3000:]
        other.watch()
        assert "flower-superlink" in _cmdlines(other.seen)
        os.kill(other.proc.pid, signal.SIGINT)
        assert other.proc.wait(timeout=STOP_TIMEOUT) == 130, other.text[-3000:]
        assert "Traceback" not in other.text
    finally:
        _cleanup([other])
