"""The operator's console when nodes refuse their budget: one line per refusal.

docs/privacy.md's example nodes' file (``dp-required``, ``dp-epsilon-budget =
3``, partition 2 at 1) under a run that asks for more than a node can give
(``dp-epsilon`` 2 and 8). Each refusal is an error reply naming the budget;
the console, as the launcher shows it (``fedlr.flower.output.is_noise``
drops Flower's per-round noise), holds one line per refusing node on the
node's side and one on the server's, however many rounds the node refuses,
and no traceback.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from logging import WARNING

import pytest

from fedlr.client_apps import gate
from fedlr.errors import NoValidRepliesError
from fedlr.flower.output import is_noise
from fedlr.launch.local import run_in_process
from fedlr.launch.run_config import format_run_config
from fedlr.privacy.node_policy import NODE_CONFIG_ENV, STATE_DIR_ENV
from tests.conftest import ROOT, tiny_run_config
from tests.integration.conftest import local_superlink_home

NODES = """dp-required = true
dp-epsilon-budget = 3.0

[partition.2]
dp-epsilon-budget = 1.0
"""


@pytest.mark.slow  # two in-process DP runs (~2 min on 2 cores)
@pytest.mark.parametrize(("run_epsilon", "stops"), [(2.0, False), (8.0, True)])
def test_a_budget_refusal_is_one_line_per_node_and_no_traceback(
    tmp_path, assets, monkeypatch, caplog, capfd, run_epsilon, stops
):
    nodes = tmp_path / "nodes.toml"
    nodes.write_text(NODES)
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    monkeypatch.setattr(gate, "_SAID", set())
    caplog.set_level(logging.DEBUG)
    config = tiny_run_config(
        tmp_path / "out",
        method="fedavg-lora",
        **{"num-server-rounds": 3, "dp-max-grad-norm": 1.0, "dp-epsilon": run_epsilon},
    )
    if stops:  # every node refuses round 1: the run ends with the reasons
        with pytest.raises(NoValidRepliesError, match="dp-epsilon-budget 3"):
            run_in_process(config)
    else:
        run_in_process(config)
    # the console: Flower's handler shows its logger's INFO lines, a node's
    # fedlr lines show from WARNING (Python's last-resort handler)
    shown = [
        record
        for record in caplog.records
        if record.levelno >= (logging.INFO if record.name == "flwr" else WARNING)
    ]
    lines = [f"{r.levelname} : {r.getMessage()}" for r in shown]
    lines = [line for line in lines if not is_noise(line)]
    text = capfd.readouterr()
    lines += [
        line for line in (text.out + text.err).splitlines() if "Traceback" in line
    ]
    assert not any("Traceback" in line for line in lines)
    node_lines = [
        line for line in lines if re.match(r"WARNING : node \d+ refused", line)
    ]
    dropped = [line for line in lines if "dropped a reply" in line]
    refusing = {line.split()[3] for line in node_lines}
    # partition 2 (budget 1) refuses every round; at epsilon 8 every node does
    assert len(refusing) == (3 if stops else 1)
    assert len(node_lines) == len(refusing) == len(dropped)
    assert all("dp-epsilon-budget" in line for line in node_lines + dropped)
    print(f"console lines at dp-epsilon {run_epsilon:g}: {len(lines)}")
    assert len(lines) <= 30, "\n".join(lines)


@pytest.mark.slow  # an in-process DP round, then a launch (~1.5 min on 2 cores)
def test_a_refusal_mid_run_under_the_launcher_is_one_line_per_node(
    tmp_path, assets, monkeypatch
):
    """Image data: the launcher cannot read the nodes' ledgers before start, so
    the nodes refuse in round 1 and the run ends with NoValidRepliesError,
    shown as its one line (no traceback, Flower's re-raise and exit code
    lines left out) and one line from the launcher."""
    nodes = tmp_path / "nodes.toml"
    nodes.write_text("dp-required = true\ndp-epsilon-budget = 0.85\n")
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "node-ledgers"))
    config = {"method": "fedavg", "model": "cnn", "dataset": "digits", "lr": 0.05}
    config.update({"num-partitions": 2, "local-steps": 2, "batch-size": 16})
    config.update({"num-server-rounds": 1, "seed": 3, "device": "cpu"})
    config.update({"dp-max-grad-norm": 1.0, "dp-epsilon": 0.8})
    run_in_process({**config, "output-dir": str(tmp_path / "first")})  # spends 0.79
    config["output-dir"] = str(tmp_path / "second")
    with local_superlink_home(tmp_path / "flwr-home") as home:
        launch = [sys.executable, "-m", "fedlr.launch", "--flwr-home", str(home)]
        launch += ["--num-supernodes", "2", "--node-config-file", str(nodes)]
        proc = subprocess.run(
            [*launch, "--run-config", format_run_config(config)],
            cwd=ROOT,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "Exit Code" not in text
    shown = [line for line in proc.stdout.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(shown) if "initial accuracy" in line)
    refusal = shown[start + 1 :]  # the run's start-up summary comes before
    refused = [line for line in refusal if re.search(r"node \d+ refused: ", line)]
    dropped = [line for line in refusal if "dropped a reply" in line]
    # the server's line per node always; a node's own line as Ray forwards the
    # worker's output (it may not before the run ends): at most one per node
    assert len(dropped) == 2 and len(refused) <= 2, text
    assert all("dp-epsilon-budget 0.85" in line for line in refused + dropped)
    [error] = [line for line in refusal if "NoValidRepliesError" in line]
    assert error.startswith("fedlr.errors.NoValidRepliesError: round 1: 0 valid")
    assert "Simulation raised an exception" in refusal[-2]  # Flower's ERROR line
    assert len(refusal) == len(refused) + 4, "\n".join(refusal)
    last = proc.stderr.splitlines()[-1]
    assert re.fullmatch(r"fedlr: run \d+ ended with status finished:failed", last)
