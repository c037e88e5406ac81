"""`python -m fedlr.launch` as users run it: concurrent launches, Ctrl-C.

Three launches start at once with the same ``--flwr-home`` (the tiny BERT,
two clients). Two run one round each and must each report their own run;
the third (30 rounds: it cannot finish first, even on a loaded machine whose
log lines arrive late) gets SIGINT once its first round started. The test
follows the third launch's process tree (CLI, SuperLink, SuperExec, ServerApp,
simulation, Ray) while it runs and asserts that after the interrupt none of
those processes is left, that the run was stopped on its SuperLink before
that SuperLink went down (``finished:stopped``), that the run wrote no
summary, and that the launch said so in one line, without a traceback. The
other two launches, whose processes the interrupt must not touch, complete.

Processes are followed and stopped by PID only (other people run Flower and
Ray on the same machine).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import psutil
import pytest

from fedlr.launch.flwr_run import format_run_config
from tests.conftest import ROOT, tiny_run_config

pytestmark = pytest.mark.slow

#: Seconds a launch may take on a loaded 2-core machine.
LAUNCH_TIMEOUT = 300
STOP_TIMEOUT = 300
"""Seconds a launch may take to exit after Ctrl-C: above the launcher's own
budget (``flwr stop`` up to 60 s, then 20 s of polling the run's status, each
poll a ``flwr`` CLI start, then the CLI and the SuperLink's processes, up to
15 s each). Two launches stopping at once on a loaded 2-core machine took
more than 120 s."""


@dataclass
class Launch:
    """One ``python -m fedlr.launch`` process and what it printed."""

    name: str
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def watch(self) -> None:
        """Note every process below the launch (with its start time)."""
        try:
            root = psutil.Process(self.proc.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for member in family:
            self.seen.setdefault(member.pid, member)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.watch()
            match = re.search(pattern, self.text)
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(
            f"{self.name}: no {pattern!r} in {timeout:.0f} s:\n{self.text[-3000:]}"
        )


def _start(name: str, home: Path, output: Path, rounds: int) -> Launch:
    config = tiny_run_config(
        output,
        method="fedavg-lora",
        **{"num-server-rounds": rounds, "local-steps": 1, "num-partitions": 2},
    )
    cmd = [
        sys.executable,
        "-m",
        "fedlr.launch.flwr_run",
        "--app",
        str(ROOT),
        "--flwr-home",
        str(home),
        "--num-supernodes",
        "2",
        "--client-cpus",
        "1",
        "--run-config",
        format_run_config(config),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a SIGINT for one launch reaches only it
    )
    launch = Launch(name, proc)
    threading.Thread(target=launch.read, daemon=True).start()
    return launch


def _cmdlines(processes: dict[int, psutil.Process]) -> str:
    """The command lines of the processes still there (a short-lived child may
    have gone between being seen and being read)."""
    names = []
    for proc in processes.values():
        try:
            names.append(" ".join(proc.cmdline()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return " ".join(names)


def _left(processes: dict[int, psutil.Process]) -> list[str]:
    left = []
    for proc in processes.values():
        try:  # is_running() also checks the start time: a reused PID is not ours
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            continue
    return left


def _cleanup(launches: list[Launch]) -> None:
    """After a failure: interrupt what still runs, then kill what it left."""
    for launch in launches:
        if launch.proc.poll() is None:
            launch.watch()
            os.kill(launch.proc.pid, signal.SIGINT)
    for launch in launches:
        try:
            launch.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launch.proc.kill()
        for proc in launch.seen.values():
            try:
                if proc.is_running():
                    proc.kill()
            except psutil.NoSuchProcess:
                continue


@pytest.mark.early(seconds=99)
def test_concurrent_launches_keep_to_their_runs_and_ctrl_c_stops_one(tmp_path, assets):
    home = tmp_path / "flwr-home"  # the same for all three: no sharing anyway
    started = time.monotonic()
    first = _start("first", home, tmp_path / "out-first", rounds=1)
    second = _start("second", home, tmp_path / "out-second", rounds=1)
    stopped = _start("stopped", home, tmp_path / "out-stopped", rounds=30)
    launches = [first, second, stopped]
    try:
        # 1. Ctrl-C once the third launch's first round is under way.
        # (Flower's '[ROUND 1/30]' lines are hidden without --verbose: fedlr's
        # round-0 line comes just before round 1's instructions go out)
        stopped.wait_for(r"fedlr: initial accuracy", timeout=LAUNCH_TIMEOUT)
        for _ in range(10):  # let the clients (Ray) start
            stopped.watch()
            time.sleep(1)
        names = _cmdlines(stopped.seen)
        assert "flower-superlink" in names, names
        os.kill(stopped.proc.pid, signal.SIGINT)
        assert stopped.proc.wait(timeout=STOP_TIMEOUT) == 130, stopped.text[-3000:]
        run_id = re.search(r"Successfully started run (\d+)", stopped.text)
        assert run_id is not None
        said = [line for line in stopped.lines if "interrupted" in line]
        assert len(said) == 1, stopped.text[-3000:]
        assert f"run {run_id.group(1)} stopped (finished:stopped)" in said[0]
        assert "Traceback" not in stopped.text
        assert "I/O operation on closed file" not in stopped.text
        time.sleep(2)
        assert _left(stopped.seen) == []
        assert not list((tmp_path / "out-stopped").glob("*/summary.json"))

        # 2. The other two each report their own run, completed.
        ports = set()
        for launch in (first, second):
            code = launch.proc.wait(timeout=max(10.0, LAUNCH_TIMEOUT - 60))
            assert code == 0, launch.text[-3000:]
            own = re.search(r"Successfully started run (\d+)", launch.text)
            assert own is not None
            assert f"fedlr: run {own.group(1)}: finished:completed" in launch.text
            port = re.search(
                r"Starting local SuperLink on 127\.0\.0\.1:(\d+)", launch.text
            )
            assert port is not None
            ports.add(port.group(1))
            output = tmp_path / f"out-{launch.name}"
            (run_dir,) = [p.parent for p in output.glob("*/summary.json")]
            assert run_dir.name.endswith(f"run{own.group(1)}")
            assert pd.read_csv(run_dir / "results.csv")["round"].tolist() == [1]
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["status"] == "finished"
            assert "default simulated SuperNodes" not in launch.text  # no noise
            assert _left(launch.seen) == []  # its SuperLink and Ray are gone
        assert len(ports | {"39091"}) == 3  # two SuperLinks, neither Flower's default
        assert first.text.count("finished:completed") == 1
        assert second.text.count("finished:completed") == 1
        total = time.monotonic() - started
        assert total < 2 * LAUNCH_TIMEOUT
    finally:
        _cleanup(launches)
