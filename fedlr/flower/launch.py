"""Run the app through the real ``flwr run`` CLI and check that it finished.

``flwr run --stream`` exits 0 even when the ServerApp fails, and it starts a
detached local SuperLink that outlives the run. This module wraps both facts:
:func:`flwr_run` runs the app, then asks ``flwr list --format json`` for the
run's final status and raises :class:`FlwrRunError` unless it is
``finished:completed``; :func:`stop_local_superlinks` stops the SuperLinks
started under a given ``FLWR_HOME`` by PID.

For a deployment (a SuperLink started with ``flower-superlink`` and SuperNodes
started with ``flower-supernode``, see ``docs/deployment.md``),
:func:`write_superlink_connection` names the SuperLink in ``FLWR_HOME``'s
``config.toml``, :func:`register_supernode` registers a SuperNode's public key
with it, and ``flwr_run(..., superlink=NAME)`` runs the app there.

Command line (what ``make run`` calls)::

    python -m fedlr.flower.launch --num-supernodes 4 --run-config "lr=0.001"
    python -m fedlr.flower.launch --superlink my-link --run-config "lr=0.001"
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fedlr.errors import DeploymentError

__all__ = [
    "FlwrRunError",
    "RunOutcome",
    "flwr_env",
    "flwr_run",
    "format_run_config",
    "register_supernode",
    "stop_local_superlinks",
    "write_superlink_connection",
]

_LOG = logging.getLogger("fedlr")


class FlwrRunError(RuntimeError):
    """``flwr run`` did not end with a completed run."""


@dataclass(frozen=True)
class RunOutcome:
    """The final state of a ``flwr run``.

    Attributes
    ----------
    run_id : str
    status : str
        e.g. ``finished:completed`` or ``finished:failed``.
    output : str
        What the CLI printed (stdout and stderr).
    """

    run_id: str
    status: str
    output: str


def _flwr_executable() -> str:
    local = Path(sys.executable).with_name("flwr")
    if local.exists():
        return str(local)
    found = shutil.which("flwr")
    if found is None:
        raise FlwrRunError("the `flwr` CLI is not installed in this environment")
    return found


def format_run_config(values: Mapping[str, bool | int | float | str]) -> str:
    """Render ``{key: value}`` as ``flwr run --run-config`` TOML pairs."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        parts.append(f"{key}={text}")
    return " ".join(parts)


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for the CLI: project-local ``FLWR_HOME``, no runtime ``uv sync``."""
    env = os.environ.copy()
    env["FLWR_HOME"] = str(Path(flwr_home).resolve())
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def _superlink_arg(superlink: str | None) -> list[str]:
    return [] if superlink is None else [superlink]


def _list_runs(
    env: Mapping[str, str], superlink: str | None = None
) -> list[dict[str, object]]:
    proc = subprocess.run(
        [_flwr_executable(), "list", *_superlink_arg(superlink), "--format", "json"],
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


def flwr_run(
    app_dir: Path,
    *,
    flwr_home: Path,
    run_config: Mapping[str, bool | int | float | str] | str | None = None,
    federation_config: Mapping[str, bool | int | float | str] | None = None,
    timeout: float = 3600.0,
    echo: bool = False,
    superlink: str | None = None,
) -> RunOutcome:
    """Run ``flwr run APP_DIR [SUPERLINK] --stream`` and return the final status.

    Parameters
    ----------
    app_dir : Path
        The Flower app (the folder with ``pyproject.toml``).
    flwr_home : Path
        ``FLWR_HOME`` of the CLI: its ``config.toml`` names the SuperLinks.
    run_config : mapping or str, optional
        ``--run-config`` overrides.
    federation_config : mapping, optional
        ``--federation-config`` overrides (simulation only, e.g.
        ``num-supernodes``).
    timeout : float
        Seconds before the CLI is stopped and the run counts as failed.
    echo : bool
        Copy the CLI's output to stdout as it arrives.
    superlink : str, optional
        Name of a SuperLink connection in ``FLWR_HOME/config.toml`` (see
        :func:`write_superlink_connection`); ``None`` uses the default one,
        the local simulation SuperLink unless configured otherwise.

    Raises
    ------
    FlwrRunError
        If the CLI fails, times out, or the run did not complete.
    """
    env = flwr_env(flwr_home)
    before = {str(r.get("run-id")) for r in _safe_list(env, superlink)}
    cmd = [_flwr_executable(), "run", str(app_dir), *_superlink_arg(superlink)]
    cmd.append("--stream")
    if run_config:
        text = (
            run_config if isinstance(run_config, str) else format_run_config(run_config)
        )
        cmd += ["--run-config", text]
    if federation_config:
        cmd += ["--federation-config", format_run_config(federation_config)]
    _LOG.info("running: %s", " ".join(cmd))
    lines: list[str] = []
    with subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        if proc.stdout is None:  # pragma: no cover - PIPE was requested
            raise FlwrRunError("no output pipe from `flwr run`")
        # A reader thread keeps the deadline exact even when the CLI goes quiet.
        reader = threading.Thread(
            target=_collect_lines, args=(proc.stdout, lines, echo), daemon=True
        )
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            reader.join(timeout=5)
            raise FlwrRunError(
                f"`flwr run` exceeded {timeout:.0f} s:\n{''.join(lines)[-3000:]}"
            ) from None
        reader.join(timeout=15)
    output = "".join(lines)
    if code != 0:
        raise FlwrRunError(f"`flwr run` exited {code}:\n{output[-3000:]}")
    runs = _list_runs(env, superlink)
    new = [r for r in runs if str(r.get("run-id")) not in before]
    if not new:
        raise FlwrRunError(f"no new run appeared in `flwr list`:\n{output[-3000:]}")
    run = max(new, key=lambda r: str(r.get("pending-at", "")))
    outcome = RunOutcome(str(run.get("run-id")), str(run.get("status")), output)
    if outcome.status != "finished:completed":
        raise FlwrRunError(
            f"run {outcome.run_id} ended with status {outcome.status}:\n"
            f"{output[-3000:]}"
        )
    return outcome


def _collect_lines(stream: IO[str], lines: list[str], echo: bool) -> None:
    for line in stream:
        lines.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def _safe_list(
    env: Mapping[str, str], superlink: str | None = None
) -> list[dict[str, object]]:
    try:
        return _list_runs(env, superlink)
    except (FlwrRunError, subprocess.TimeoutExpired):
        return []


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
        _flwr_executable(),
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

    Returns
    -------
    list of int
        PIDs that were signalled.
    """
    import psutil

    home = str(Path(flwr_home).resolve())
    stopped: list[int] = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any("flower-superlink" in part for part in cmdline) and any(
            home in part for part in cmdline
        ):
            try:
                proc.terminate()
                proc.wait(timeout=15)
            except psutil.TimeoutExpired:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
            stopped.append(int(proc.info["pid"]))
    return stopped


def main(argv: list[str] | None = None) -> int:
    """CLI: run the app in the current directory and verify the run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", default=".", help="app directory")
    parser.add_argument("--flwr-home", default=".flwr", help="FLWR_HOME to use")
    parser.add_argument("--num-supernodes", type=int, default=4)
    parser.add_argument(
        "--superlink",
        default=None,
        help="run on this SuperLink connection of FLWR_HOME/config.toml (a "
        "deployment) instead of the local simulation; --num-supernodes and the "
        "client resources are then ignored",
    )
    parser.add_argument(
        "--run-config", default="", help="extra `key=value ...` overrides (TOML)"
    )
    parser.add_argument(
        "--client-cpus",
        type=int,
        default=0,
        help="CPUs Ray reserves per simulated client (an integer in Flower 1.41's "
        "federation config; 0: Flower's default, 2)",
    )
    parser.add_argument(
        "--client-gpus",
        type=float,
        default=0.0,
        help="share of a GPU Ray reserves per simulated client (0: none)",
    )
    parser.add_argument(
        "--keep-superlink",
        action="store_true",
        help="leave the local SuperLink running after the run",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    federation: dict[str, bool | int | float | str] = {
        "num-supernodes": args.num_supernodes
    }
    if args.client_cpus:
        federation["client-resources-num-cpus"] = args.client_cpus
    if args.client_gpus:
        federation["client-resources-num-gpus"] = args.client_gpus
    home = Path(args.flwr_home).resolve()
    try:
        outcome = flwr_run(
            Path(args.app),
            flwr_home=home,
            run_config=args.run_config or None,
            federation_config=None if args.superlink else federation,
            echo=True,
            superlink=args.superlink,
        )
    except FlwrRunError as exc:
        _LOG.error("%s", exc)
        return 1
    finally:
        if not args.keep_superlink and not args.superlink:
            stop_local_superlinks(home)
    _LOG.info("run %s: %s", outcome.run_id, outcome.status)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
