"""The Ray simulation on an existing Ray cluster: a head and a second node.

The recipe of docs/deployment.md ("Running the simulation on a Ray cluster"),
on loopback: ``ray start --head`` and ``ray start --address`` (one CPU each,
their own ``--temp-dir``, free ports), then ``flwr run`` with ``RAY_ADDRESS``
in its environment. The local SuperLink that ``flwr run`` starts inherits it,
and Flower's Ray backend (``ray.init`` without an address) attaches to the
cluster instead of starting one. Clients need one CPU each, so the actor pool
has one actor per node.

The app is this repository's, with a test-only ClientApp
(``tests/integration/ray_probe_app.py``) that notes the Ray node id of every
message before handing it to fedlr's own ClientApp. The test asserts that the
run completed, that the ClientApp ran on both nodes (the head and the other),
and that nothing of the cluster is left afterwards: every process is stopped
by PID (``ray stop`` would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import ROOT, tiny_run_config

pytestmark = pytest.mark.slow

NODES = 4


class _Ports:
    """Free ports for the nodes of one cluster, no two the same.

    Single ports come from the kernel's ephemeral range and are never handed
    out twice. A worker-port range lies below that range (so no later
    kernel-chosen port can fall inside it) and every port in it is checked
    free. Ray refuses to start when two of its components share a port.
    """

    def __init__(self) -> None:
        self.used: set[int] = set()
        low, _ = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        self._below = int(low)

    @staticmethod
    def _bindable(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    def one(self) -> int:
        for _ in range(100):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in self.used:
                self.used.add(port)
                return port
        raise RuntimeError("no free port after 100 tries")

    def span(self, count: int) -> tuple[int, int]:
        """``count`` consecutive free ports below the ephemeral range."""
        start = 10_000 + (os.getpid() * 7919) % max(1, self._below - 10_000 - count)
        for _ in range(200):
            ports = range(start, start + count)
            if self.used.isdisjoint(ports) and all(map(self._bindable, ports)):
                self.used.update(ports)
                return start, start + count - 1
            start = 10_000 + (start + count - 10_000) % max(
                1, self._below - 10_000 - count
            )
        raise RuntimeError(f"no {count} consecutive free ports below {self._below}")


def _ray() -> str:
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.exists() else "ray"


class RayNode:
    """One ``ray start --block`` process; :meth:`stop` ends it and its children.

    ``--block`` keeps ``ray start`` in the foreground as the parent of the
    node's GCS (head), raylet and workers, so they can be found and stopped by
    PID. Every port is a free one: two nodes share this machine.
    """

    def __init__(
        self, args: list[str], temp_dir: Path, log: Path, free: _Ports
    ) -> None:
        ports = {
            "--node-manager-port": free.one(),
            "--object-manager-port": free.one(),
            "--dashboard-agent-listen-port": free.one(),
            "--dashboard-agent-grpc-port": free.one(),
            "--metrics-export-port": free.one(),
            "--runtime-env-agent-port": free.one(),
        }
        low, high = free.span(201)
        cmd = [
            _ray(),
            "start",
            "--block",
            *args,
            "--num-cpus=1",
            "--num-gpus=0",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            f"--min-worker-port={low}",
            f"--max-worker-port={high}",
            *(f"{flag}={port}" for flag, port in ports.items()),
        ]
        self.log = log
        self._log_file = log.open("w")
        env = os.environ.copy()
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._known: set[int] = set()

    def descendants(self) -> list[int]:
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self._known.update(k.pid for k in kids)
        return [k.pid for k in kids]

    def stop(self) -> list[int]:
        """SIGTERM ``ray start`` (it stops its node), then SIGKILL what is left."""
        import psutil

        self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = []
        for pid in sorted(self._known):
            try:
                proc = psutil.Process(pid)
                proc.wait(timeout=5)
            except psutil.NoSuchProcess:
                continue
            except psutil.TimeoutExpired:
                try:
                    proc.kill()
                    proc.wait(timeout=5)
                except psutil.NoSuchProcess:
                    continue
                left.append(pid)
        self._log_file.close()
        return left

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _cluster_nodes(address: str, timeout: float = 90.0) -> list[dict[str, object]]:
    """Alive nodes of the cluster at ``address`` (asked from a separate driver)."""
    code = (
        "import json, ray\n"
        f"ray.init(address={address!r}, logging_level='ERROR', "
        "include_dashboard=False)\n"
        "print(json.dumps([{'id': n['NodeID'], 'head': "
        "'node:__internal_head__' in n['Resources'], 'cpus': "
        "n['Resources'].get('CPU', 0)} for n in ray.nodes() if n['Alive']]))\n"
    )
    env = os.environ.copy()
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"cannot reach the cluster at {address}:\n{proc.stderr[-2000:]}"
        )
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture()
def ray_cluster(tmp_path):
    """A Ray head and a second Ray node on 127.0.0.1, one CPU each."""
    # Ray's socket paths must stay under 107 characters: a short temp dir.
    temp_dir = Path(tempfile.mkdtemp(prefix="fedlr-ray-", dir="/tmp"))
    default_marker = Path("/tmp/ray/ray_current_cluster")
    marker_before = default_marker.read_text() if default_marker.exists() else None
    free = _Ports()
    port = free.one()
    address = f"127.0.0.1:{port}"
    nodes: list[RayNode] = []
    try:
        nodes.append(
            RayNode(
                [
                    "--head",
                    f"--port={port}",
                    "--include-dashboard=false",
                    f"--ray-client-server-port={free.one()}",
                ],
                temp_dir,
                tmp_path / "ray-head.log",
                free,
            )
        )
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in nodes[0].text():
            if nodes[0].proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start:\n{nodes[0].text()}")
            time.sleep(1)
        nodes.append(
            RayNode([f"--address={address}"], temp_dir, tmp_path / "ray-node.log", free)
        )
        deadline = time.monotonic() + 120
        while True:
            alive = _cluster_nodes(address)
            if len(alive) == 2:
                break
            if nodes[1].proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the second Ray node did not join:\n{nodes[1].text()}")
            time.sleep(2)
        yield address, alive
    finally:
        left = [pid for node in reversed(nodes) for pid in node.stop()]
        shutil.rmtree(temp_dir, ignore_errors=True)
        marker_after = default_marker.read_text() if default_marker.exists() else None
        assert marker_after == marker_before, (
            "the cluster changed /tmp/ray/ray_current_cluster, which every later "
            "ray.init() on this machine would follow"
        )
        assert not left, f"Ray processes needed SIGKILL: {left}"


@pytest.fixture()
def probe_app(tmp_path) -> Path:
    """This repository's app with the node-noting ClientApp."""
    app = tmp_path / "app"
    shutil.copytree(
        ROOT / "server_apps",
        app / "server_apps",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    probe = ROOT / "tests" / "integration" / "ray_probe_app.py"
    shutil.copy(probe, app / "ray_probe.py")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pyproject, count = re.subn(
        r'(?m)^clientapp = ".*"$', 'clientapp = "ray_probe:app"', pyproject
    )
    assert count == 1
    (app / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    return app


def test_simulation_runs_clients_on_both_ray_nodes(
    tmp_path, assets, ray_cluster, flwr_home, probe_app, monkeypatch
):
    from fedlr.launch.flwr_run import flwr_run, stop_local_superlinks

    address, nodes = ray_cluster
    head = [n["id"] for n in nodes if n["head"]]
    other = [n["id"] for n in nodes if not n["head"]]
    assert len(head) == 1 and len(other) == 1, nodes

    output = tmp_path / "out"
    config = tiny_run_config(output, **{"num-server-rounds": 2})
    config.pop("num-partitions")  # the node config says how many
    # The SuperLink that `flwr run` starts inherits this environment, and
    # with it the simulation process whose ray.init() reads RAY_ADDRESS.
    monkeypatch.setenv("RAY_ADDRESS", address)
    outcome = flwr_run(
        probe_app,
        flwr_home=flwr_home,
        run_config=config,
        # one CPU per client: one actor fits on each one-CPU node
        federation_config={"num-supernodes": NODES, "client-resources-num-cpus": 1},
        timeout=600,
    )
    stop_local_superlinks(flwr_home)
    assert outcome.status == "finished:completed"

    (results,) = output.glob("*/results.csv")
    frame = pd.read_csv(results)
    assert frame["round"].tolist() == [1, 2]
    assert frame["clients"].tolist() == [NODES, NODES]
    assert (frame["dropped"] == 0).all()
    assert frame["accuracy"].between(0, 1).all()

    notes = [json.loads(p.read_text()) for p in (output / "ray-probe").glob("*.json")]
    train = [n for n in notes if n["kind"] == "train"]
    assert sorted((n["server-round"], n["partition-id"]) for n in train) == [
        (r, p) for r in (1, 2) for p in range(NODES)
    ]
    ran_on = {n["ray-node-id"] for n in notes}
    # Both nodes of the cluster ran ClientApp code, and no other node did
    # (a Ray started by the simulation itself would have a new node id).
    assert ran_on == {head[0], other[0]}, (ran_on, nodes)
    assert len({n["pid"] for n in notes}) == 2  # one actor per node
