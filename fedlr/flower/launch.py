"""Run the app through the real ``flwr run`` CLI and check that it finished.

``flwr run --stream`` exits 0 even when the ServerApp fails, and it starts a
detached local SuperLink that outlives the run. This module wraps both facts:
:func:`flwr_run` runs the app, then asks ``flwr list --format json`` for the
run's final status and raises :class:`FlwrRunError` unless it is
``finished:completed``; :func:`stop_local_superlinks` stops the SuperLinks
started under a given ``FLWR_HOME`` by PID.

Command line (what ``make run`` calls)::

    python -m fedlr.flower.launch --num-supernodes 4 --run-config "lr=0.001"
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
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "FlwrRunError",
    "RunOutcome",
    "flwr_env",
    "flwr_run",
    "format_run_config",
    "stop_local_superlinks",
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


def _list_runs(env: Mapping[str, str]) -> list[dict[str, object]]:
    proc = subprocess.run(
        [_flwr_executable(), "list", "--format", "json"],
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
) -> RunOutcome:
    """Run ``flwr run APP_DIR --stream`` and return the run's final status.

    Raises
    ------
    FlwrRunError
        If the CLI fails, times out, or the run did not complete.
    """
    env = flwr_env(flwr_home)
    before = {str(r.get("run-id")) for r in _safe_list(env)}
    cmd = [_flwr_executable(), "run", str(app_dir), "--stream"]
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
        deadline = time.monotonic() + timeout
        if proc.stdout is None:  # pragma: no cover - PIPE was requested
            raise FlwrRunError("no output pipe from `flwr run`")
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGTERM)
                raise FlwrRunError(f"`flwr run` exceeded {timeout:.0f} s")
        code = proc.wait()
    output = "".join(lines)
    if code != 0:
        raise FlwrRunError(f"`flwr run` exited {code}:\n{output[-3000:]}")
    new = [r for r in _list_runs(env) if str(r.get("run-id")) not in before]
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


def _safe_list(env: Mapping[str, str]) -> list[dict[str, object]]:
    try:
        return _list_runs(env)
    except (FlwrRunError, subprocess.TimeoutExpired):
        return []


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
        "--run-config", default="", help="extra `key=value ...` overrides (TOML)"
    )
    parser.add_argument("--client-cpus", type=float, default=0.0)
    parser.add_argument("--client-gpus", type=float, default=0.0)
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
        federation["backend.client-resources.num-cpus"] = args.client_cpus
    if args.client_gpus:
        federation["backend.client-resources.num-gpus"] = args.client_gpus
    home = Path(args.flwr_home).resolve()
    try:
        outcome = flwr_run(
            Path(args.app),
            flwr_home=home,
            run_config=args.run_config or None,
            federation_config=federation,
            echo=True,
        )
    except FlwrRunError as exc:
        _LOG.error("%s", exc)
        return 1
    finally:
        if not args.keep_superlink:
            stop_local_superlinks(home)
    _LOG.info("run %s: %s", outcome.run_id, outcome.status)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
