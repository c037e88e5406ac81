"""Slow: Flower's deployment engine with TLS and SuperNode authentication.

One ``flower-superlink`` and two ``flower-supernode`` processes on 127.0.0.1,
each with its own ``FLWR_HOME`` as if on its own machine, TLS certificates
generated here, SuperNode keys registered with ``flwr supernode register``;
``flwr run`` of this app (FedEx-LoRA on the tiny model) against that SuperLink.
Every process started here is stopped by PID, also when the test fails, and
every wait has a timeout.
"""

from __future__ import annotations

import itertools
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import psutil
import pytest

from fedlr.flower.certs import generate_supernode_keys, generate_tls_certificates
from fedlr.launch.flwr_run import (
    FlwrRunError,
    flwr_env,
    flwr_run,
    register_supernode,
    write_superlink_connection,
)
from tests.conftest import ROOT, tiny_run_config

pytestmark = pytest.mark.slow

CONNECTION = "fedlr-test"
NUM_NODES = 2
START_TIMEOUT = 90.0
RUN_TIMEOUT = 300.0
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Deployment:
    """The processes of one test deployment, their logs, and how to stop them."""

    root: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def start(self, name: str, cmd: list[str], flwr_home: Path) -> None:
        env = flwr_env(flwr_home)
        env["TOKENIZERS_PARALLELISM"] = "false"
        log = self.root / f"{name}.log"
        self.logs[name] = log
        with log.open("wb") as sink:
            self.procs[name] = subprocess.Popen(
                cmd,
                env=env,
                cwd=self.root,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tails(self, chars: int = 4000) -> str:
        parts = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"----- {name} (last {chars} chars) -----\n{text[-chars:]}")
        return "\n".join(parts)

    def check_alive(self, *names: str) -> None:
        for name in names or tuple(self.procs):
            code = self.procs[name].poll()
            if code is not None:
                pytest.fail(f"{name} exited with {code}\n{self.log_tails()}")

    def wait_for(
        self, what: str, predicate: Callable[[], bool], timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.5)
        pytest.fail(
            f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_tails()}"
        )

    def _ours(self) -> list[psutil.Process]:
        """Started processes and everything they spawned, found by PID."""
        roots = {p.pid for p in self.procs.values()}
        found: dict[int, psutil.Process] = {}
        for pid in roots:
            try:
                proc = psutil.Process(pid)
                found[pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
            except psutil.NoSuchProcess:
                continue
        # SuperExec processes are tied to their parent by `--parent-pid PID`;
        # catch those whose parent already exited (and their children).
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmd = proc.info.get("cmdline") or []
            for flag, value in itertools.pairwise(cmd):
                if flag == "--parent-pid" and value.isdigit() and int(value) in roots:
                    found[proc.pid] = proc
                    try:
                        for child in proc.children(recursive=True):
                            found[child.pid] = child
                    except psutil.NoSuchProcess:
                        pass
        return list(found.values())

    def stop(self) -> list[int]:
        """SIGTERM every process we own, SIGKILL what is left after 15 s."""
        procs = self._ours()
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                continue
        _, alive = psutil.wait_procs(procs, timeout=15)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(alive, timeout=5)
        for popen in self.procs.values():
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                popen.kill()
        return [p.pid for p in procs]


@pytest.fixture()
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    dep = Deployment(root=tmp_path)
    try:
        yield dep
    finally:
        pids = dep.stop()
        leftover = [
            pid
            for pid in pids
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
        ]
        assert not leftover, f"processes still running after teardown: {leftover}"


def _online_nodes(cli_home: Path) -> set[int]:
    proc = subprocess.run(
        [str(BIN / "flwr"), "supernode", "ls", CONNECTION, "--format", "json"],
        env=flwr_env(cli_home),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        nodes = json.loads(proc.stdout).get("nodes", [])
    except json.JSONDecodeError:
        return set()
    return {int(n["node-id"]) for n in nodes if n.get("status") == "online"}


def test_tls_deployment_with_supernode_auth(tmp_path, assets, deployment):
    """fedex-lora over a TLS SuperLink and two authenticated SuperNodes."""
    started = time.monotonic()
    certs = generate_tls_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    cli_home = tmp_path / "cli-home"
    port = _free_port()
    write_superlink_connection(
        cli_home, CONNECTION, f"127.0.0.1:{port}", root_certificates=certs.ca_cert
    )

    # 1. The SuperLink: TLS on one port (Fleet, Control and Runtime APIs),
    #    SuperNode authentication, no `uv sync` of the app at run time.
    deployment.start(
        "superlink",
        [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile",
            str(certs.ca_cert),
            "--ssl-certfile",
            str(certs.server_cert),
            "--ssl-keyfile",
            str(certs.server_key),
            "--enable-supernode-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ],
        tmp_path / "superlink-home",
    )
    deployment.wait_for(
        f"the SuperLink on port {port}",
        lambda: deployment.check_alive("superlink") or _listening(port),
        START_TIMEOUT,
    )

    # 2. Register the SuperNodes' public keys; start each with its private key.
    node_ids: set[int] = set()
    for i in range(NUM_NODES + 1):
        keys = generate_supernode_keys(tmp_path / "keys", f"supernode-{i}")
        registered = i < NUM_NODES  # the last one is never registered
        if registered:
            node_ids.add(
                register_supernode(
                    keys.public_key, flwr_home=cli_home, superlink=CONNECTION
                )
            )
        name = f"supernode-{i}" if registered else "unregistered-supernode"
        cmd = [
            str(BIN / "flower-supernode"),
            "--superlink",
            f"127.0.0.1:{port}",
            "--root-certificates",
            str(certs.ca_cert),
            "--auth-supernode-private-key",
            str(keys.private_key),
            "--node-config",
            f"partition-id={i} num-partitions={NUM_NODES}",
            "--port",
            str(_free_port()),
        ]
        if not registered:
            cmd += ["--max-retries", "1", "--max-wait-time", "20"]
        deployment.start(name, cmd, tmp_path / f"{name}-home")
    assert len(node_ids) == NUM_NODES

    supernodes = [f"supernode-{i}" for i in range(NUM_NODES)]
    deployment.wait_for(
        f"{NUM_NODES} registered SuperNodes online",
        lambda: (
            deployment.check_alive("superlink", *supernodes)
            or _online_nodes(cli_home) == node_ids
        ),
        START_TIMEOUT,
    )

    # 3. A SuperNode whose key was not registered is refused and exits.
    refused = deployment.procs["unregistered-supernode"]
    try:
        code = refused.wait(timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"unregistered SuperNode was not refused\n{deployment.log_tails()}")
    refusal = deployment.logs["unregistered-supernode"].read_text(errors="replace")
    assert code != 0, deployment.log_tails()
    assert "Failed to initialize the connection to the SuperLink" in refusal, refusal
    assert _online_nodes(cli_home) == node_ids

    # 4. `flwr run` against the SuperLink connection, then the run's status.
    output = tmp_path / "out"
    config = tiny_run_config(output, **{"num-partitions": NUM_NODES})
    try:
        outcome = flwr_run(
            ROOT,
            flwr_home=cli_home,
            run_config=config,
            superlink=CONNECTION,
            timeout=RUN_TIMEOUT,
        )
    except FlwrRunError as exc:
        pytest.fail(f"{exc}\n{deployment.log_tails()}")
    assert outcome.status == "finished:completed"

    # 5. The results: 2 rounds, both SuperNodes in each, nothing dropped.
    (run_dir,) = sorted(p.parent for p in output.glob("*/results.csv"))
    frame = pd.read_csv(run_dir / "results.csv")
    logs = deployment.log_tails()
    assert frame["round"].tolist() == [1, 2], logs
    assert frame["clients"].tolist() == [NUM_NODES, NUM_NODES], logs
    assert (frame["dropped"] == 0).all(), logs
    assert frame["accuracy"].between(0, 1).all(), logs
    assert (frame["frobenius-gap"] > 0).all(), logs
    assert f"run{outcome.run_id}" in run_dir.name
    deployment.check_alive("superlink", *supernodes)
    sys.stderr.write(f"deployment test body: {time.monotonic() - started:.1f} s\n")


def test_stop_is_by_pid_and_complete(tmp_path, deployment):
    """Teardown stops a started process and the children it spawned."""
    home = tmp_path / "home"
    deployment.start(
        "parent",
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time;"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
            "time.sleep(300)",
        ],
        home,
    )
    parent = psutil.Process(deployment.procs["parent"].pid)
    deployment.wait_for("the child process", lambda: bool(parent.children()), 30)
    child = parent.children()[0]
    pids = deployment.stop()
    assert {parent.pid, child.pid} <= set(pids)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert deployment.procs["parent"].poll() is not None
