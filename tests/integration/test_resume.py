"""Kill a run with SIGKILL after round 2, resume it, get bit-identical weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.conftest import ROOT, tiny_run_config

pytestmark = pytest.mark.slow

ROUNDS = 4


def _start(config, path, *extra):
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.inprocess_run", str(path), *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out.strip().splitlines()[-1]


def _wait_for_checkpoint(run_root, round_, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for info in run_root.glob("*/checkpoint.json"):
            if json.loads(info.read_text())["round"] >= round_:
                return info.parent
        if proc.poll() is not None:
            raise AssertionError(f"run exited early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no checkpoint of round {round_} within {timeout} s")


METHODS = {
    "fedex-lora": {},
    # a low threshold makes the rank grow (2 -> 4 -> 6 ...) across the kill
    "fedspec": {"lora-rank": 2, "fedspec-threshold": 1e-4, "fedspec-max-rank": 8},
    # 2 tasks x 2 rounds: the killed round 3 is the task boundary (GPSE sketches)
    "fot": {
        "model": "mlp",
        "dataset": "permuted-mnist",
        "num-tasks": 2,
        "rounds-per-task": 2,
        "task-examples": 1000,
        "fot-activation-examples": 50,
        "num-partitions": 2,
        "local-steps": 10,
        "batch-size": 32,
        "lr": 0.1,
        "momentum": 0.0,
        "max-eval-examples": 200,
    },
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_killed_run_resumes_bit_identical(tmp_path, assets, method):
    overrides = {"method": method, "num-server-rounds": ROUNDS, **METHODS[method]}
    straight_cfg = tiny_run_config(tmp_path / "straight", **overrides)
    straight_dir = _finish(_start(straight_cfg, tmp_path / "straight.json"))

    crash_cfg = tiny_run_config(tmp_path / "crash", **overrides)
    proc = _start(crash_cfg, tmp_path / "crash.json", "--hang-at-round", "3")
    try:
        run_dir = _wait_for_checkpoint(tmp_path / "crash", 2, proc)
        assert json.loads((run_dir / "checkpoint.json").read_text())["round"] == 2
        os.kill(proc.pid, signal.SIGKILL)  # a crash, not a clean stop
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "final_arrays.pt").exists()
    assert len(pd.read_csv(run_dir / "results.csv")) == 2

    resumed_cfg = {**crash_cfg, "resume-from": str(run_dir)}
    resumed_dir = _finish(_start(resumed_cfg, tmp_path / "resume.json"))
    assert resumed_dir == str(run_dir)

    want = torch.load(f"{straight_dir}/final_arrays.pt")
    got = torch.load(run_dir / "final_arrays.pt")
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key
    a = pd.read_csv(f"{straight_dir}/results.csv")
    b = pd.read_csv(run_dir / "results.csv")
    assert b["round"].tolist() == list(range(1, ROUNDS + 1))
    cols = ["accuracy", "loss", "frobenius-gap", "clients", "dropped", "train-loss"]
    if method == "fot":
        cols += ["acc", "fgt", "basis-dims"]
        assert (run_dir / "accuracy_matrix.csv").read_text() == (
            Path(straight_dir) / "accuracy_matrix.csv"
        ).read_text()
    pd.testing.assert_frame_equal(a[cols], b[cols])
    if method == "fedspec":  # the rank grew before and after the kill
        ranks = b["rank"].tolist()
        assert ranks == a["rank"].tolist() and ranks[0] < ranks[1] < ranks[3], ranks
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed-after-round"] == 2 and summary["rounds"] == ROUNDS
