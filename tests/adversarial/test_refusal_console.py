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
import re
from logging import WARNING

import pytest

from fedlr.client_apps import gate
from fedlr.errors import NoValidRepliesError
from fedlr.flower.output import is_noise
from fedlr.launch.local import run_in_process
from fedlr.privacy.node_policy import NODE_CONFIG_ENV
from tests.conftest import tiny_run_config

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
