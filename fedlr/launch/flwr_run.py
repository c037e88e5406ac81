"""Run the app through the real ``flwr run`` CLI and check that it finished.

``flwr run --stream`` exits 0 even when the ServerApp fails, and its local
SuperLink outlives the run. :func:`flwr_run` gives each local simulation its
own SuperLink (:class:`~fedlr.flower.superlink.LocalSuperLink`), reads the
status of its own run id only and raises :class:`FlwrRunError` unless it is
``finished:completed``; on Ctrl-C it stops the run (``flwr stop``) and every
process it started, then raises :class:`RunInterrupted` with a one-line
message. ``python -m fedlr.launch`` (what ``make run`` calls) checks the
run config first (:mod:`fedlr.launch.run_config`), then runs it, echoing the
output without Flower's noise (:mod:`fedlr.flower.output`).

The launch's public names live here for its users: the SuperLink helpers of
:mod:`fedlr.flower.superlink` (:func:`write_superlink_connection`,
:func:`register_supernode`, :func:`stop_local_superlinks`, ...) and the
run-config checks of :mod:`fedlr.launch.run_config` are importable from this
module too.

Command line::

    python -m fedlr.launch --num-supernodes 4 --run-config "lr=0.001"
    python -m fedlr.launch --superlink my-link --run-config "lr=0.001"
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import psutil

from fedlr.errors import ConfigError, FedLRError
from fedlr.flower.output import OutputStream, is_noise
from fedlr.flower.superlink import (
    FlwrRunError,
    LocalSuperLink,
    flwr_env,
    flwr_executable,
    register_supernode,
    run_status,
    stop_local_superlinks,
    superlink_arg,
    superlinks_under,
    write_superlink_connection,
)
from fedlr.launch.run_config import (
    check_before_start,
    check_cuda,
    check_nodes,
    check_run_config,
    format_run_config,
    is_fedlr_app,
    node_policies,
    parse_run_config,
)
from fedlr.privacy.node_policy import NODE_CONFIG_ENV, check_node_config_file
from fedlr.strategies.registry import MethodConfig

__all__ = [
    "FlwrRunError",
    "LocalSuperLink",
    "RunInterrupted",
    "RunOutcome",
    "check_before_start",
    "check_run_config",
    "cli_logging",
    "flwr_env",
    "flwr_run",
    "format_run_config",
    "is_fedlr_app",
    "is_noise",
    "parse_run_config",
    "register_supernode",
    "stop_local_superlinks",
    "write_superlink_connection",
]

_LOG = logging.getLogger("fedlr")


#: Seconds between two looks at the processes a run started.
_SAMPLE_SECONDS = 2.0


class RunInterrupted(FlwrRunError):
    """The run was interrupted (Ctrl-C / SIGTERM) and stopped; one-line message."""


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


@dataclass
class _Processes:
    """Every process a run started: the CLI's descendants and our SuperLink's.

    Sampled while the run goes on, so processes whose parent died (and that
    were re-parented) are still known; psutil's ``Process`` remembers each
    one's start time, so a reused PID is never signalled.
    """

    home: Path | None
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    def sample(self, root: int) -> None:
        roots: list[psutil.Process] = []
        with suppress(psutil.NoSuchProcess):
            roots.append(psutil.Process(root))
        if self.home is not None:
            roots += superlinks_under(self.home)
        for proc in roots:
            try:
                family = [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for member in family:
                self.seen.setdefault(member.pid, member)

    def stop(self, root: int) -> int:
        """Terminate (then kill) every process seen alive; return how many."""
        self.sample(root)
        alive = [p for p in self.seen.values() if _alive(p)]
        for proc in alive:
            with suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, left = psutil.wait_procs(alive, timeout=10)
        for proc in left:
            with suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(left, timeout=5)
        return len(alive)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def _no_interrupts() -> Iterator[None]:
    """Ignore Ctrl-C while a run is being stopped (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def flwr_run(
    app_dir: Path,
    *,
    flwr_home: Path,
    run_config: Mapping[str, bool | int | float | str] | str | None = None,
    federation_config: Mapping[str, bool | int | float | str] | None = None,
    timeout: float = 3600.0,
    echo: bool = False,
    superlink: str | None = None,
    verbose: bool = False,
    keep_superlink: bool = True,
) -> RunOutcome:
    """Run ``flwr run APP_DIR [SUPERLINK] --stream`` and return the final status.

    Parameters
    ----------
    app_dir : Path
        The Flower app (the folder with ``pyproject.toml``).
    flwr_home : Path
        ``FLWR_HOME`` of the CLI: its ``config.toml`` names the SuperLinks. A
        local simulation runs on a SuperLink of its own, in
        ``flwr_home/local/<port>/`` (:class:`LocalSuperLink`).
    run_config : mapping or str, optional
        ``--run-config`` overrides.
    federation_config : mapping, optional
        ``--federation-config`` overrides (simulation only, e.g.
        ``num-supernodes``).
    timeout : float
        Seconds before the run is stopped and counts as failed.
    echo : bool
        Copy the CLI's output to stdout as it arrives.
    superlink : str, optional
        Name of a SuperLink connection in ``FLWR_HOME/config.toml`` (see
        :func:`write_superlink_connection`); ``None``: a local simulation.
    verbose : bool
        Echo Flower's, Ray's and transformers' hints, warnings and progress
        bars too (:func:`is_noise`), and let the processes print them.
    keep_superlink : bool
        Leave the local SuperLink running after the run (stop it with
        :func:`stop_local_superlinks`); otherwise it and every process it
        started are stopped, and its home is removed after a completed run.

    Raises
    ------
    RunInterrupted
        On Ctrl-C (``KeyboardInterrupt``): the run was stopped (``flwr
        stop``), so were the CLI and, for a local simulation, the SuperLink
        and every process it started.
    FlwrRunError
        If the CLI fails, times out, or the run did not complete.
    """
    link = None if superlink is not None else LocalSuperLink.allocate(flwr_home)
    home = link.home if link is not None else Path(flwr_home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    env = flwr_env(home, link=link, quiet=not verbose)
    cmd = _flwr_command(app_dir, superlink, run_config, federation_config)
    _LOG.debug("running: %s", " ".join(cmd))
    stream = OutputStream(echo=echo, verbose=verbose)
    processes = _Processes(home=link.home if link is not None else None)
    proc, reader = _start(cmd, env, stream)
    completed = False
    try:
        try:
            code = _wait(proc, processes, timeout)
        except subprocess.TimeoutExpired:
            _stop_run(env, stream.run_id, superlink)
            raise FlwrRunError(
                f"`flwr run` exceeded {timeout:.0f} s:\n{stream.text[-3000:]}"
            ) from None
        reader.join(timeout=15)
        outcome = _completed_run(code, stream, env, superlink)
        completed = True
        return outcome
    except KeyboardInterrupt:
        with _no_interrupts():
            status = _stop_run(env, stream.run_id, superlink)
            stopped = _stop_processes(proc, processes, link, keep=False)
        raise _interrupted(stream.run_id, status, stopped, link) from None
    finally:
        with _no_interrupts():
            _stop_processes(proc, processes, link, keep=keep_superlink)
            reader.join(timeout=5)
            proc.stdout.close()  # type: ignore[union-attr]  # a PIPE (_start)
            if completed and link is not None and not keep_superlink:
                shutil.rmtree(link.home, ignore_errors=True)


def _interrupted(
    run_id: str | None, status: str, stopped: int, link: LocalSuperLink | None
) -> RunInterrupted:
    """The one-line error of a run stopped by Ctrl-C."""
    run = f"run {run_id}" if run_id else "the run (not started yet)"
    return RunInterrupted(
        f"interrupted: {run} stopped ({status}); stopped {stopped} processes "
        "it started" + ("" if link is None else f" (SuperLink log: {link.log_file})")
    )


def _start(
    cmd: list[str], env: Mapping[str, str], stream: OutputStream
) -> tuple[subprocess.Popen[str], threading.Thread]:
    """Start ``cmd`` in a session of its own, its output read into ``stream``
    by a daemon thread."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    if proc.stdout is None:  # pragma: no cover - PIPE was requested
        raise FlwrRunError("no output pipe from `flwr run`")
    reader = threading.Thread(target=stream.read, args=(proc.stdout,), daemon=True)
    reader.start()
    return proc, reader


def _flwr_command(
    app_dir: Path,
    superlink: str | None,
    run_config: Mapping[str, bool | int | float | str] | str | None,
    federation_config: Mapping[str, bool | int | float | str] | None,
) -> list[str]:
    """``flwr run APP_DIR [SUPERLINK] --stream`` with its config overrides."""
    cmd = [flwr_executable(), "run", str(app_dir), *superlink_arg(superlink)]
    cmd.append("--stream")
    if run_config:
        text = (
            run_config if isinstance(run_config, str) else format_run_config(run_config)
        )
        cmd += ["--run-config", text]
    if federation_config:
        cmd += ["--federation-config", format_run_config(federation_config)]
    return cmd


def _completed_run(
    code: int, stream: OutputStream, env: Mapping[str, str], superlink: str | None
) -> RunOutcome:
    """The run's outcome once the CLI has exited with ``code``.

    Raises
    ------
    FlwrRunError
        If the CLI failed, printed no run id, or the run (its own id's
        status, asked of the SuperLink) did not complete.
    """
    output = stream.text
    if code != 0:
        raise FlwrRunError(f"`flwr run` exited {code}:\n{output[-3000:]}")
    if stream.run_id is None:
        raise FlwrRunError(f"`flwr run` printed no run id:\n{output[-3000:]}")
    outcome = RunOutcome(
        stream.run_id, run_status(env, stream.run_id, superlink), output
    )
    if outcome.status != "finished:completed":
        raise FlwrRunError(
            f"run {outcome.run_id} ended with status {outcome.status}:\n"
            f"{output[-3000:]}"
        )
    return outcome


def _wait(proc: subprocess.Popen[str], processes: _Processes, timeout: float) -> int:
    """Wait for the CLI, noting the processes it starts; its exit code."""
    deadline = time.monotonic() + timeout
    while True:
        processes.sample(proc.pid)
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        try:
            return proc.wait(timeout=min(_SAMPLE_SECONDS, left))
        except subprocess.TimeoutExpired:
            continue


def _stop_run(env: Mapping[str, str], run_id: str | None, superlink: str | None) -> str:
    """``flwr stop RUN_ID``; the run's status afterwards (or why it is unknown)."""
    if run_id is None:
        return "no run id yet"
    try:
        subprocess.run(
            [flwr_executable(), "stop", run_id, *superlink_arg(superlink)],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        deadline = time.monotonic() + 20
        status = run_status(env, run_id, superlink)
        while (
            status.startswith(("running", "pending", "starting"))
            and time.monotonic() <= deadline
        ):
            time.sleep(1)
            status = run_status(env, run_id, superlink)
        return status
    except (FlwrRunError, subprocess.TimeoutExpired, OSError) as exc:
        return f"status unknown: {str(exc).splitlines()[0]}"


def _stop_processes(
    proc: subprocess.Popen[str],
    processes: _Processes,
    link: LocalSuperLink | None,
    *,
    keep: bool,
) -> int:
    """Stop the CLI; unless ``keep``, every process of the local SuperLink too."""
    count = 0
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        count += 1
    if link is not None and not keep:
        count += processes.stop(proc.pid)
    return count


@contextmanager
def cli_logging(level: int = logging.INFO) -> Iterator[None]:
    """Plain one-line messages of the ``fedlr`` logger on stderr, each once.

    While the block runs the logger has a handler of its own and does not
    propagate, so a handler another library put on the root logger neither
    reformats nor repeats its lines; the previous state is restored after.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = (_LOG.level, _LOG.propagate)
    _LOG.addHandler(handler)
    _LOG.setLevel(level)
    _LOG.propagate = False
    try:
        yield
    finally:
        _LOG.removeHandler(handler)
        _LOG.setLevel(saved[0])
        _LOG.propagate = saved[1]


def _interrupt_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """CLI: check the run config, run the app, verify the run (exit 0 if completed).

    Exit codes: 0 completed, 1 the run failed, 2 a bad run config (one line on
    stderr, before anything starts), 130 interrupted (Ctrl-C or SIGTERM: the
    run and every process the launch started are stopped).
    """
    args = _parser().parse_args(argv)
    with cli_logging():
        try:
            return _launch(args)
        except KeyboardInterrupt:  # before the run started: nothing to stop
            _LOG.error("fedlr: interrupted before the run started")
            return 130


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m fedlr.launch``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", default=".", help="app directory")
    parser.add_argument(
        "--flwr-home",
        default=".flwr",
        help="FLWR_HOME to use; each local simulation gets a SuperLink of its "
        "own under FLWR_HOME/local/<port>/ (free ports)",
    )
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
    _add_simulation_arguments(parser)
    parser.add_argument(
        "--keep-superlink",
        action="store_true",
        help="leave the local SuperLink running after the run",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show Flower's, Ray's and transformers' hints, warnings and "
        "progress bars too",
    )
    return parser


def _add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """The local simulation's options: its nodes' resources and settings."""
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
        "--node-config-file",
        default="",
        help="TOML file of the simulated nodes' own settings (their privacy "
        "limits: dp-required, dp-epsilon-budget, ...; a [partition.<id>] table "
        "for one node), passed to them as FEDLR_NODE_CONFIG; see docs/privacy.md",
    )


def _nodes_file(args: argparse.Namespace) -> str:
    """The simulated nodes' own settings: ``--node-config-file``, else the
    exported ``FEDLR_NODE_CONFIG``, checked key by key; passed on unchanged
    (the launcher never writes a user's node settings)."""
    path = args.node_config_file or os.environ.get(NODE_CONFIG_ENV, "")
    if not path:
        return ""
    resolved = str(Path(path).expanduser().resolve())
    check_node_config_file(resolved)  # a bad file fails here, before the run
    return resolved


def _check_nodes(
    args: argparse.Namespace, method: MethodConfig | None, path: str
) -> None:
    """The refusals the simulated nodes would make of every round, from
    their own settings (:func:`~fedlr.launch.run_config.check_nodes`)."""
    environ = {**os.environ, NODE_CONFIG_ENV: path}
    if method is not None:
        check_nodes(method, node_policies(args.num_supernodes, environ=environ))
    if path:  # the user's own file, as it is: the nodes read it
        os.environ[NODE_CONFIG_ENV] = path
        _LOG.info("fedlr: simulated nodes' own settings from %s", path)


def _check_launch(args: argparse.Namespace, app: Path) -> None:
    """Every check before anything starts: the node settings, the run config
    (a fedlr app's in full, checked as the ServerApp would), CUDA, the
    simulated nodes' refusals.

    Raises
    ------
    FedLRError
        The first check that fails.
    """
    if args.superlink and args.node_config_file:
        raise ConfigError(
            "--node-config-file",
            "sets the simulated nodes' settings; a deployment's SuperNodes "
            "take theirs with flower-supernode --node-config",
        )
    nodes = "" if args.superlink else _nodes_file(args)
    method = None
    if is_fedlr_app(app):
        method = check_run_config(app, args.run_config)
        check_before_start(
            method,
            num_supernodes=None if args.superlink else args.num_supernodes,
            client_gpus=args.client_gpus,
        )
    else:
        parse_run_config(args.run_config)
        if not args.superlink:
            check_cuda("none", args.client_gpus)
    if not args.superlink:
        _check_nodes(args, method, nodes)
    if method is not None:
        _LOG.info(
            "fedlr: run config checked: method %s, %d rounds",
            method.spec.name,
            method.run.num_server_rounds,
        )


def _launch(args: argparse.Namespace) -> int:
    app = Path(args.app)
    try:
        _check_launch(args, app)
    except FedLRError as exc:
        _LOG.error("error: %s", exc)
        return 2
    federation: dict[str, bool | int | float | str] = {
        "num-supernodes": args.num_supernodes
    }
    if args.client_cpus:
        federation["client-resources-num-cpus"] = args.client_cpus
    if args.client_gpus:
        federation["client-resources-num-gpus"] = args.client_gpus
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
        # Ctrl-C stops the run even where SIGINT came in ignored (a script's
        # background job: the shell sets SIGINT to SIG_IGN for `cmd &`)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        outcome = flwr_run(
            app,
            flwr_home=Path(args.flwr_home).resolve(),
            run_config=args.run_config or None,
            federation_config=None if args.superlink else federation,
            echo=True,
            superlink=args.superlink,
            verbose=args.verbose,
            keep_superlink=args.keep_superlink,
        )
    except RunInterrupted as exc:
        _LOG.error("fedlr: %s", exc)
        return 130
    except FlwrRunError as exc:  # its output, echoed above, says why
        _LOG.error("fedlr: %s", str(exc).splitlines()[0].rstrip(":"))
        return 1
    _LOG.info("fedlr: run %s: %s", outcome.run_id, outcome.status)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
