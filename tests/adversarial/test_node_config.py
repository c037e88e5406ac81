"""A careless operator against the nodes' own settings.

Each test is what an operator gets wrong (a misspelt key, a string for a
boolean, nodes that require DP-SGD under a run without it, a budget the
ledgers cannot pay, reproducible noise the nodes never allowed) and asserts
the named refusal: on the node, and in the launcher in one line with exit
code 2 before any SuperLink starts. The launcher and ``run_in_process``
never write the user's node settings: the file, the exported
``FEDLR_NODE_CONFIG`` and the ``node_config`` mapping are what the nodes
read, unchanged.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedlr.errors import ConfigError, NodeConfigError, NoValidRepliesError
from fedlr.launch import flwr_run as launch
from fedlr.launch.local import run_in_process
from fedlr.launch.run_config import check_nodes, check_run_config, node_policies
from fedlr.privacy.budget import PrivacyLedger
from fedlr.privacy.node_policy import (
    NODE_CONFIG_ENV,
    NODE_CONFIG_KEYS,
    node_policy,
)
from tests.conftest import ROOT, tiny_run_config

#: Seconds within which the launcher answers (the registry included).
LIMIT = 10.0

DP = 'dp-max-grad-norm=1.0 dp-noise-multiplier=1.0 robust="none"'


def _launch(tmp_path: Path, capfd: Any, *args: str) -> tuple[int, list[str], float]:
    """``python -m fedlr.launch`` in this process: exit code, the
    non-empty stderr lines and the seconds it took."""
    capfd.readouterr()
    home = tmp_path / "flwr-home"
    started = time.perf_counter()
    code = launch.main(["--app", str(ROOT), "--flwr-home", str(home), *args])
    seconds = time.perf_counter() - started
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert not home.exists()  # no FLWR_HOME: no SuperLink was started
    return code, [line for line in err.splitlines() if line.strip()], seconds


def _file(tmp_path: Path, text: str, name: str = "nodes.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- the node
@pytest.mark.parametrize("typo", ["dp-requird", "dp_required", "DP-REQUIRED"])
def test_a_misspelt_key_stops_the_node_with_did_you_mean(tmp_path, typo):
    for text in (f"{typo} = true\n", f"[partition.2]\n{typo} = true\n"):
        environ = {NODE_CONFIG_ENV: str(_file(tmp_path, text))}
        with pytest.raises(NodeConfigError, match="did you mean 'dp-required'"):
            node_policy({"partition-id": 0}, environ)  # every node, not only 2
    # from the SuperNode's own --node-config (a deployment)
    with pytest.raises(NodeConfigError, match="did you mean 'dp-required'") as info:
        node_policy({"partition-id": 0, "num-partitions": 4, typo: True})
    assert info.value.key == typo


def test_values_are_typed_and_bounded_as_flower_parses_them(tmp_path):
    # Flower's --node-config is TOML: dp-required=true arrives as a bool, 3 as
    # an int (fine for a float key), "true" only if the operator quoted it
    ok = node_policy({"partition-id": 1, "dp-required": True, "dp-epsilon-budget": 3})
    assert ok.dp_required and ok.dp_epsilon_budget == 3.0
    refused = [
        ({"dp-required": "true"}, "expected true/false, got 'true'"),
        ({"dp-epsilon-budget": "3"}, "expected a number, got '3'"),
        ({"dp-max-steps-per-round": 0}, "must be >= 1, got 0"),
        ({"dp-max-steps-per-round": 2.5}, "expected an integer"),
        ({"dp-accountant": "gdp"}, "'gdp' is not one of prv, rdp"),
        ({"max-local-steps": 0}, "must be >= 1, got 0"),
        ({"secagg-max-shares": "100"}, "expected an integer, got '100'"),
        ({"partition-id": -1}, "must be >= 0, got -1"),
    ]
    for values, reason in refused:
        with pytest.raises(NodeConfigError, match=reason):
            node_policy(values)
    # Flower's simulation gives every node these two: they are known keys
    assert {"partition-id", "num-partitions"} <= set(NODE_CONFIG_KEYS)
    node_policy({"partition-id": 3, "num-partitions": 4})


def test_a_node_key_the_file_does_not_hold_and_a_bad_table_are_refused(tmp_path):
    cases = [
        ("max-local-steps = 2\n", "max-local-steps", "not read from the nodes' file"),
        ("[partitions.1]\ndp-required = true\n", "partitions", "did you mean"),
        ("[partition.x]\ndp-required = true\n", "partition.x", "an integer >= 0"),
        ("dp-delta = 1e-300\n", "dp-delta", "at least 1e-20"),
        (
            "[partition.1]\ndp-epsilon-budget = -1\n",
            "dp-epsilon-budget",
            r"\[partition.1\]",
        ),
    ]
    for text, key, reason in cases:
        environ = {NODE_CONFIG_ENV: str(_file(tmp_path, text))}
        with pytest.raises(NodeConfigError, match=reason) as info:
            node_policy({"partition-id": 0}, environ)
        assert info.value.key == key


def test_a_misspelt_key_stops_an_in_process_run_before_it_starts(tmp_path, assets):
    config = tiny_run_config(tmp_path / "out", **{"num-server-rounds": 1})
    with pytest.raises(NodeConfigError, match="did you mean 'dp-required'"):
        run_in_process(config, node_config={"dp-requird": True})
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


# ---------------------------------------------------------------- the launcher
@pytest.mark.parametrize(
    "text",
    ["dp-requird = true\n", "dp-required = true\n[partition.1]\ndp_required = true\n"],
)
def test_the_launcher_refuses_a_misspelt_key_in_one_line(tmp_path, capfd, text):
    nodes = _file(tmp_path, text)
    code, lines, seconds = _launch(tmp_path, capfd, "--node-config-file", str(nodes))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: node-config '")
    assert "did you mean 'dp-required'" in lines[0] and str(nodes) in lines[0]
    assert seconds < LIMIT, f"{seconds:.1f} s"


def test_nodes_require_dp_the_run_has_none_one_line_before_start(
    tmp_path, capfd, monkeypatch
):
    nodes = _file(tmp_path, "dp-required = true\ndp-epsilon-budget = 3.0\n")
    monkeypatch.setenv(NODE_CONFIG_ENV, "")
    code, lines, seconds = _launch(tmp_path, capfd, "--node-config-file", str(nodes))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: run-config 'dp-max-grad-norm'")
    assert "the nodes of partitions 0-3 would refuse every round" in lines[0]
    assert "dp-required = true" in lines[0]
    assert seconds < LIMIT, f"{seconds:.1f} s"
    # one node alone, and SecAgg+ required of a run without it
    _file(tmp_path, "[partition.2]\ndp-required = true\n")
    code, lines, _ = _launch(tmp_path, capfd, "--node-config-file", str(nodes))
    assert code == 2 and "the node of partition 2 would refuse" in lines[0]
    _file(tmp_path, "secure-aggregation-required = true\n")
    code, lines, _ = _launch(
        tmp_path, capfd, "--node-config-file", str(nodes), "--run-config", DP
    )
    assert code == 2 and lines[0].startswith("error: run-config 'secure-aggregation'")


def test_a_run_epsilon_above_what_the_ledgers_leave_is_refused(
    tmp_path, capfd, monkeypatch
):
    state = tmp_path / "state"
    ledger = PrivacyLedger(state, "hospital-a")
    with ledger.locked():  # an earlier run spent 2.216 of the budget of 3
        ledger.append((2.0, 0.5, 3), run_id=1, server_round=1, delta=1e-5)
    nodes = _file(
        tmp_path,
        f'dp-required = true\ndp-epsilon-budget = 3.0\nstate-dir = "{state}"\n'
        '[partition.0]\ndp-ledger-id = "hospital-a"\n',
    )
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    run = 'dp-max-grad-norm=1.0 dp-epsilon=1.5 robust="none"'
    code, lines, _ = _launch(tmp_path, capfd, "--run-config", run)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: run-config 'dp-epsilon': 1.5 is more than")
    assert "the node of partition 0 can still spend" in lines[0]
    assert "less the 2.216 its ledger holds leaves 0.7842" in lines[0]
    # the other nodes' ledgers are empty: 1.5 fits their budget of 3; and
    # more than the budget itself is refused whatever the ledgers hold
    method = check_run_config(ROOT, 'dp-max-grad-norm=1.0 dp-epsilon=0.5 robust="none"')
    check_nodes(method, node_policies(4))
    method = check_run_config(ROOT, 'dp-max-grad-norm=1.0 dp-epsilon=4 robust="none"')
    fresh = {pid: p for pid, p in node_policies(4).items() if pid != 0}
    with pytest.raises(ConfigError, match="the nodes of partitions 1-3 can still"):
        check_nodes(method, fresh, num_nodes=4)
    assert len(ledger.history()) == 1  # read, never written


# ---------------------------------------------------------------- consent
def test_reproducible_noise_from_nodes_that_did_not_consent_is_refused(
    tmp_path, capfd, monkeypatch
):
    text = (
        "dp-required = true\ndp-epsilon-budget = 3.0\n"
        "dp-allow-reproducible-noise = false\n"
    )
    nodes = _file(tmp_path, text)
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))  # the user's exported file
    seeded = DP + " reproducible-noise=true"
    code, lines, _ = _launch(tmp_path, capfd, "--run-config", seeded)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: run-config 'reproducible-noise'")
    assert "the nodes of partitions 0-3 did not consent" in lines[0]
    # without any file the nodes did not consent either
    monkeypatch.delenv(NODE_CONFIG_ENV)
    code, lines, _ = _launch(tmp_path, capfd, "--run-config", seeded)
    assert code == 2 and "did not consent" in lines[0]
    assert NODE_CONFIG_ENV not in os.environ  # nothing generated
    assert nodes.read_text() == text  # the user's settings, unchanged


def test_the_launcher_passes_the_users_settings_on_unchanged(
    tmp_path, capfd, monkeypatch
):
    text = (
        "dp-required = true\ndp-epsilon-budget = 3.0\n"
        "dp-allow-reproducible-noise = true\n"
    )
    nodes = _file(tmp_path, text)
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    seen: dict[str, Any] = {}

    def started(app: Path, **kwargs: Any) -> launch.RunOutcome:
        """What the nodes would read when the run starts (nothing starts)."""
        seen["path"] = os.environ[NODE_CONFIG_ENV]
        seen["policy"] = node_policy({"partition-id": 0})
        return launch.RunOutcome("1", "finished:completed", "")

    monkeypatch.setattr(launch, "flwr_run", started)
    # the launch would install its SIGTERM handler in pytest's process: skip it
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    code = launch.main(
        [
            "--app",
            str(ROOT),
            "--flwr-home",
            str(tmp_path / "home"),
            "--run-config",
            DP + " reproducible-noise=true",
        ]
    )
    assert code == 0
    assert seen["path"] == str(nodes.resolve()) and nodes.read_text() == text
    policy = seen["policy"]
    assert policy.dp_required and policy.dp_epsilon_budget == 3.0
    assert policy.dp_allow_reproducible_noise


class _Recorder:
    """A ClientApp that records each node's policy and answers nothing."""

    def __init__(self) -> None:
        self.policies: list[Any] = []
        self.app = ClientApp()

        @self.app.train()
        def train(message: Message, context: Context) -> Message:
            self.policies.append(node_policy(context.node_config))
            raise RuntimeError("recorded")


def test_run_in_process_never_writes_the_users_node_settings(
    tmp_path, assets, monkeypatch
):
    text = "dp-allow-reproducible-noise = false\ndp-epsilon-budget = 3.0\n"
    nodes = _file(tmp_path, text)
    monkeypatch.setenv(NODE_CONFIG_ENV, str(nodes))
    seeded = tiny_run_config(
        tmp_path / "out",
        **{
            "num-server-rounds": 1,
            "dp-max-grad-norm": 1.0,
            "dp-noise-multiplier": 1.0,
            "reproducible-noise": True,
        },
    )
    with pytest.raises(ConfigError, match="did not consent"):
        run_in_process(seeded)
    own = {"max-local-steps": 50}
    with pytest.raises(ConfigError, match="did not consent"):
        run_in_process(seeded, node_config=own)
    assert own == {"max-local-steps": 50} and nodes.read_text() == text
    # a run without reproducible noise: the nodes read the user's file as it is
    recorder = _Recorder()
    with pytest.raises(NoValidRepliesError):
        run_in_process({**seeded, "reproducible-noise": False}, client_app=recorder.app)
    assert len(recorder.policies) == 3
    assert not any(p.dp_allow_reproducible_noise for p in recorder.policies)
    assert all(p.dp_epsilon_budget == 3.0 for p in recorder.policies)
