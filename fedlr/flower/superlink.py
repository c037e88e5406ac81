"""The SuperLinks a launch talks to, through the ``flwr`` CLI.

``flwr run`` starts a detached local SuperLink on fixed ports that outlives
the run and that every later ``flwr run`` on the machine attaches to; a
:class:`LocalSuperLink` is a private one instead (its own ``FLWR_HOME`` and
free ports), and :func:`stop_local_superlinks` stops those started under a
given ``FLWR_HOME`` by PID.

For a deployment (a SuperLink started with ``flower-superlink`` and SuperNodes
started with ``flower-supernode``, see ``docs/deployment.md``),
:func:`write_superlink_connection` names the SuperLink in ``FLWR_HOME``'s
``config.toml`` and :func:`register_supernode` registers a SuperNode's public
key with it. :func:`flwr_env` is the environment every ``flwr`` command of a
launch runs in; :func:`run_status` asks a SuperLink for one run's status.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from fedlr.errors import DeploymentError

__all__ = [
    "FlwrRunError",
    "LocalSuperLink",
    "flwr_env",
    "flwr_executable",
    "register_supernode",
    "run_status",
    "stop_local_superlinks",
    "superlinks_under",
    "write_superlink_connection",
]


class FlwrRunError(RuntimeError):
    """``flwr run`` did not end with a completed run."""


def flwr_executable() -> str:
    local = Path(sys.executable).with_name("flwr")
    if local.exists():
        return str(local)
    found = shutil.which("flwr")
    if found is None:
        raise FlwrRunError("the `flwr` CLI is not installed in this environment")
    return found


@dataclass(frozen=True)
class LocalSuperLink:
    """A private local simulation SuperLink: its own ``FLWR_HOME`` and ports.

    ``flwr run`` starts the local SuperLink on the ports named by
    ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and ``FLWR_LOCAL_CONTROL_API_PORT``
    (39091 and 39093 when unset) and uses any SuperLink already answering
    there; free ports and a home of its own keep concurrent runs apart.

    Attributes
    ----------
    home : Path
        ``FLWR_HOME`` of this SuperLink (its ``local-superlink/`` database
        and log live there).
    http_port, control_port : int
    """

    home: Path
    http_port: int
    control_port: int

    @classmethod
    def allocate(cls, flwr_home: Path | str) -> LocalSuperLink:
        """Two free loopback ports and ``flwr_home/local/<http-port>``."""
        http = _free_port()
        control = _free_port()
        while control == http:
            control = _free_port()
        home = Path(flwr_home).resolve() / "local" / str(http)
        return cls(home=home, http_port=http, control_port=control)

    @property
    def log_file(self) -> Path:
        """The SuperLink's log (the ServerApp's and clients' full output)."""
        return self.home / "local-superlink" / "superlink.log"

    def env(self) -> dict[str, str]:
        """Environment entries that point the ``flwr`` CLI at this SuperLink."""
        return {
            "FLWR_HOME": str(self.home),
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(self.http_port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(self.control_port),
        }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def flwr_env(
    flwr_home: Path, *, link: LocalSuperLink | None = None, quiet: bool = False
) -> dict[str, str]:
    """Environment for the CLI: project-local ``FLWR_HOME``, no runtime ``uv sync``.

    Parameters
    ----------
    flwr_home : Path
        ``FLWR_HOME`` (replaced by ``link.home`` when ``link`` is given).
    link : LocalSuperLink, optional
        A private local SuperLink: its home and ports; Ray then starts a
        cluster of its own (``RAY_ADDRESS=local``) unless ``RAY_ADDRESS`` is set.
    quiet : bool
        Silence transformers' warnings and progress bars and Ray's accelerator
        FutureWarning in every process the run starts (SuperLink, ServerApp,
        Ray workers inherit this environment).
    """
    env = os.environ.copy()
    env["FLWR_HOME"] = str(Path(flwr_home).resolve())
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    if link is not None:
        env.update(link.env())
        env.setdefault("RAY_ADDRESS", "local")
    if quiet:
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        ray_warning = "ignore::FutureWarning:ray._private.worker"
        env["PYTHONWARNINGS"] = ",".join(
            w for w in (env.get("PYTHONWARNINGS", ""), ray_warning) if w
        )
    return env


def superlink_arg(superlink: str | None) -> list[str]:
    return [] if superlink is None else [superlink]


def _list_runs(
    env: Mapping[str, str], superlink: str | None = None, run_id: str | None = None
) -> list[dict[str, object]]:
    only = [] if run_id is None else ["--run-id", str(run_id)]
    cmd = [flwr_executable(), "list", *superlink_arg(superlink), *only]
    proc = subprocess.run(
        [*cmd, "--format", "json"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise FlwrRunError(f"`flwr list` printed no JSON: {proc.stdout!r}") from exc
    runs = data.get("runs", [])
    return list(runs) if isinstance(runs, list) else []


def run_status(
    env: Mapping[str, str], run_id: str, superlink: str | None = None
) -> str:
    """The status of run ``run_id`` alone (``flwr list --run-id``)."""
    for run in _list_runs(env, superlink, run_id):
        if str(run.get("run-id")) == str(run_id):
            return str(run.get("status"))
    raise FlwrRunError(f"`flwr list --run-id {run_id}` does not know the run")


def superlinks_under(home: Path) -> list[psutil.Process]:
    text = str(Path(home).resolve())
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any("flower-superlink" in part for part in cmdline) and any(
            text in part for part in cmdline
        ):
            found.append(proc)
    return found


def write_superlink_connection(
    flwr_home: Path,
    name: str,
    address: str,
    *,
    root_certificates: Path | None = None,
    insecure: bool = False,
) -> Path:
    """Add (or replace) a SuperLink connection in ``FLWR_HOME/config.toml``.

    The ``flwr`` CLI (``flwr run . NAME``, ``flwr list NAME``,
    ``flwr supernode register KEY NAME``) reads the SuperLink's address and TLS
    settings from this file. Other connections in the file are kept; a new
    file also gets Flower's default ``local`` connection (the simulation
    SuperLink), which stays the default.

    Parameters
    ----------
    flwr_home : Path
        The CLI's ``FLWR_HOME`` (created if missing).
    name : str
        Connection name, e.g. ``my-link``.
    address : str
        ``HOST:PORT`` of the SuperLink (the port of ``flower-superlink --port``).
    root_certificates : Path, optional
        CA certificate that signed the SuperLink's certificate. Without it and
        without ``insecure``, the system trust store is used.
    insecure : bool
        Plain HTTP (a SuperLink started with ``--insecure``). Not for real
        deployments.

    Returns
    -------
    Path
        The ``config.toml`` written.

    Raises
    ------
    DeploymentError
        If ``name`` or ``address`` is malformed, or both ``root_certificates``
        and ``insecure`` are given.
    """
    import tomli_w

    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise DeploymentError(
            f"connection name '{name}' must be letters, digits, '-' or '_'"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeploymentError(f"SuperLink address '{address}' is not HOST:PORT")
    if insecure and root_certificates is not None:
        raise DeploymentError("root_certificates and insecure exclude each other")
    home = Path(flwr_home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    data: dict[str, object] = {}
    if path.exists():
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    links = data.setdefault("superlink", {})
    if not isinstance(links, dict):
        raise DeploymentError(f"{path}: [superlink] is not a table")
    links.setdefault("default", "local")
    links.setdefault("local", {"address": ":local:"})
    entry: dict[str, object] = {"address": address}
    if root_certificates is not None:
        entry["root-certificates"] = str(Path(root_certificates).resolve())
    if insecure:
        entry["insecure"] = True
    links[name] = entry
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path


def register_supernode(
    public_key: Path, *, flwr_home: Path, superlink: str, timeout: float = 120.0
) -> int:
    """Register a SuperNode's public key with a SuperLink; return its node ID.

    Runs ``flwr supernode register PUBLIC_KEY SUPERLINK --format json``. Needed
    when the SuperLink runs with ``--enable-supernode-auth``: it then accepts
    only SuperNodes whose ``--auth-supernode-private-key`` matches a registered
    public key.

    Raises
    ------
    FlwrRunError
        If the CLI fails or prints no node ID.
    """
    env = flwr_env(flwr_home)
    cmd = [
        flwr_executable(),
        "supernode",
        "register",
        str(Path(public_key).resolve()),
        superlink,
        "--format",
        "json",
    ]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        data = {}
    node_id = data.get("node-id") if isinstance(data, dict) else None
    if proc.returncode != 0 or not data.get("success") or node_id is None:
        raise FlwrRunError(
            f"`flwr supernode register` failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return int(node_id)


def stop_local_superlinks(flwr_home: Path) -> list[int]:
    """Stop the ``flower-superlink`` processes whose files live under ``flwr_home``.

    This includes the private SuperLinks of :func:`flwr_run` in
    ``flwr_home/local/``, of any launch that used this ``flwr_home``.

    Returns
    -------
    list of int
        PIDs that were signalled.
    """
    stopped: list[int] = []
    for proc in superlinks_under(Path(flwr_home)):
        try:
            proc.terminate()
            proc.wait(timeout=15)
        except psutil.TimeoutExpired:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
        stopped.append(int(proc.pid))
    return stopped
