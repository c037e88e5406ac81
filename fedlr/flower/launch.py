"""Run the app through the real ``flwr run`` CLI and check that it finished.

``flwr run --stream`` exits 0 even when the ServerApp fails, and it starts a
detached local SuperLink on fixed ports that outlives the run and that every
later ``flwr run`` on the machine attaches to. This module wraps these facts:

- :func:`check_run_config` resolves the run config that ``flwr run`` would
  start (the app's ``[tool.flwr.app.config]`` plus the overrides) through the
  same registry the ServerApp uses, before anything starts: a typo is one
  line in seconds, not a traceback after the SuperLink and Ray started;
- :func:`flwr_run` gives each local simulation its own SuperLink (a fresh
  ``FLWR_HOME`` under ``flwr_home/local/`` and free ports), reads the status
  of its own run id only (``flwr list --run-id``) and raises
  :class:`FlwrRunError` unless it is ``finished:completed``; on Ctrl-C it
  stops the run (``flwr stop``) and every process it started, then raises
  :class:`RunInterrupted` with a one-line message;
- Flower's, Ray's and transformers' noise (the SuperNode-count hint, Ray's
  accelerator FutureWarning, weight-loading progress bars, Flower's per-round
  INFO lines) is kept out of the output unless ``verbose``; fedlr's lines,
  warnings and errors stay, without ANSI colour codes when stdout is not a
  terminal.

:func:`stop_local_superlinks` stops the SuperLinks started under a given
``FLWR_HOME`` by PID.

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
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import click
import psutil
from flwr.common.config import flatten_dict, parse_config_args

from fedlr.errors import ConfigError, DeploymentError, FedLRError
from fedlr.privacy.node_policy import NODE_CONFIG_ENV, check_node_config_file
from fedlr.strategies.registry import MethodConfig, resolve

__all__ = [
    "FlwrRunError",
    "LocalSuperLink",
    "RunInterrupted",
    "RunOutcome",
    "app_run_config",
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
    "strip_ansi",
    "write_superlink_connection",
]

_LOG = logging.getLogger("fedlr")

#: Seconds between two looks at the processes a run started.
_SAMPLE_SECONDS = 2.0

#: Lines of Flower, Ray and transformers that say nothing about the run:
#: dropped from the output unless ``verbose`` (they stay in the SuperLink log).
_NOISE = re.compile(
    r"default simulated SuperNodes changed from"
    r"|Flower configuration not found\. Created default configuration"
    r"|To change federation size, use the following command"
    r"|flwr federation simulation-config"
    r"|fraction_evaluate is set to 0\.0"
    r"|FutureWarning"
    r"|RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
    r"|^\s*warnings\.warn\("
    r"|\d+%\|"  # tqdm progress bars (model loading)
    r"|Loading weights"
)
#: Flower's INFO (and DEBUG) lines of each round, noise unless ``verbose``:
#: fedlr's own round line says what they say. Warnings and errors never match.
_FLOWER_ROUND = re.compile(
    r"\s*DEBUG\s*:"
    r"|\s*INFO\s*:\s*("
    r"$"  # Flower's empty spacer lines
    r"|\[ROUND \d+/\d+\]"
    r"|(configure|aggregate)_(train|evaluate): (Sampled|Received)"
    r"|\S*\s*└──> (Aggregated )?MetricRecord"
    r"|Starting \w+ strategy:"
    r"|Global evaluation\s*$"
    r")"
)
#: ANSI escape sequences (Flower's coloured log levels).
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_RUN_ID = re.compile(r"Successfully started run (\d+)")


class FlwrRunError(RuntimeError):
    """``flwr run`` did not end with a completed run."""


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


# --------------------------------------------------------- local config check
def app_run_config(app_dir: Path | str) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]`` table, flattened as Flower does.

    Raises
    ------
    ConfigError
        If ``APP_DIR/pyproject.toml`` is missing or not TOML.
    """
    path = Path(app_dir) / "pyproject.toml"
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--app", f"cannot read {path}: {exc}") from None
    table = data.get("tool", {}).get("flwr", {}).get("app", {})
    return dict(flatten_dict(table.get("config", {})))


def is_fedlr_app(app_dir: Path | str) -> bool:
    """Whether the app's ServerApp is fedlr's (so its run config is fedlr's)."""
    path = Path(app_dir) / "pyproject.toml"
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return False
    components = data.get("tool", {}).get("flwr", {}).get("app", {})
    server = str(components.get("components", {}).get("serverapp", ""))
    return server.startswith(("server_apps.", "fedlr."))


def parse_run_config(text: str | None) -> dict[str, Any]:
    """``--run-config`` text (``'k=v k2="s"'`` or a ``.toml`` path) as Flower parses it.

    Raises
    ------
    ConfigError
        On text that is not ``key=value`` TOML: naming the key whose value
        does not parse (e.g. ``lora-rank=four``), else ``--run-config``.
    """
    if not text or not text.strip():
        return {}
    try:
        return dict(parse_config_args([text]))
    except click.ClickException as exc:
        bad = _unparsable_pair(text)
        if bad is not None:
            key, value = bad
            raise ConfigError(
                key,
                f"{value} is not a TOML value: write a number, true or false, "
                f'or a quoted string ({key}="{value.strip(_QUOTES)}")',
            ) from None
        raise ConfigError("--run-config", exc.message) from None
    except (ValueError, OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--run-config", str(exc).splitlines()[0]) from None


_QUOTES = "'\""

#: One ``key=value`` pair of ``--run-config``, as Flower's parser splits them.
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def _unparsable_pair(text: str) -> tuple[str, str] | None:
    """The first ``(key, value)`` of ``text`` whose value is not TOML."""
    for key, value in _PAIR.findall(text):
        try:
            tomllib.loads(f"{key} = {value}")
        except tomllib.TOMLDecodeError:
            return key, value
    return None


def check_run_config(
    app_dir: Path | str, run_config: Mapping[str, Any] | str | None = None
) -> MethodConfig:
    """Resolve the run config ``flwr run`` would start, here and now.

    The app's defaults plus the overrides go through
    :func:`fedlr.strategies.registry.resolve`, the ServerApp's own parsing, so
    a method typo, an unknown key or a value of the wrong type is reported
    before any SuperLink, Ray or model starts.

    Raises
    ------
    ConfigError
        On an unknown key (with the closest key), a bad type or value.
    fedlr.errors.UnknownMethodError
        On a method no one registered (with the closest name).
    """
    overrides = (
        parse_run_config(run_config)
        if run_config is None or isinstance(run_config, str)
        else dict(run_config)
    )
    defaults = app_run_config(app_dir)
    method = resolve({**defaults, **overrides})
    stale = sorted(set(overrides) - set(defaults))
    if stale:  # fedlr knows the key, the app's table does not: Flower refuses it
        raise ConfigError(
            stale[0],
            "missing from the app's [tool.flwr.app.config]; regenerate it with "
            "`python -m fedlr.configdoc write`",
        )
    return method


def check_before_start(
    method: MethodConfig,
    *,
    num_supernodes: int | None = None,
    client_gpus: float = 0.0,
) -> None:
    """Make, now, the refusals the ServerApp or the simulation would make at start.

    Each is cheap and builds no model: the data set against the data
    registry (and the task's kind of data set), the tracker's package, secure
    aggregation's eligibility and share count (with client-level DP: the
    quantiser's room for the noise), ``min-replies`` against the nodes a round
    samples, CUDA for ``quantization`` or ``client_gpus``, and in a local
    simulation ``resume-from``: a run directory with a good checkpoint whose
    settings this run repeats (the ServerApp's own checks at start, made
    here; the checkpoint's strategy state is checked by the ServerApp, which
    builds the strategy). The run-config
    checks of :func:`check_run_config` (the method, keys, types, privacy) come
    first.

    Parameters
    ----------
    method : MethodConfig
        The resolved run config (:func:`check_run_config`).
    num_supernodes : int, optional
        The local simulation's node count; ``None`` for a deployment, whose
        node count, GPUs and server packages are not known here (those
        checks are skipped).
    client_gpus : float
        Share of a GPU per simulated client (``--client-gpus``).

    Raises
    ------
    ConfigError
        Naming the key (or the ``--option``) that would be refused.
    """
    from fedlr.runs.tracking import check_tracker_installed

    run = method.run
    _check_dataset(method)
    if num_supernodes is not None:  # a deployment's server has its own packages
        check_tracker_installed(run.tracker)
    sampled = None
    if num_supernodes is not None:
        sampled = max(int(num_supernodes * run.fraction_train), 1)
        if run.min_replies > sampled:
            raise ConfigError(
                "min-replies",
                f"{run.min_replies} valid replies are needed per round but a "
                f"round samples {sampled} of the {num_supernodes} simulated nodes "
                f"(fraction-train {run.fraction_train}); lower min-replies or "
                "raise --num-supernodes",
            )
    if run.secure_aggregation:
        _check_secure(method, sampled)
    if num_supernodes is not None:
        _check_cuda(run.quantization, client_gpus)
        if run.resume_from:  # a deployment's checkpoint is on its server
            _check_resume(method)


def _check_resume(method: MethodConfig) -> None:
    """``resume-from`` names a run directory with a good checkpoint of a run
    with these settings (:func:`fedlr.runs.checkpoint.check_resumable`)."""
    from fedlr.runs.checkpoint import check_resumable, load_checkpoint

    saved = load_checkpoint(method.run.resume_from)
    check_resumable(saved["config"], method.to_mapping(), method.defaults())


def _check_dataset(method: MethodConfig) -> None:
    """The data set is registered and of the kind the method's task reads."""
    import difflib

    from fedlr.data import UnknownDatasetError, dataset_info
    from fedlr.models.causal import CAUSAL_MODELS
    from fedlr.models.text import TEXT_MODELS

    run = method.run
    try:
        spec = dataset_info(run.dataset)
    except UnknownDatasetError as exc:
        close = difflib.get_close_matches(run.dataset, exc.known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            "dataset",
            f"unknown data set '{run.dataset}'; {hint}known: {', '.join(exc.known)}",
        ) from None
    image_task = method.spec.payload.name == "qrmix"  # the image ServerPlan
    if image_task != (spec.kind == "image"):
        task = "an image method" if image_task else f"method '{method.spec.name}'"
        need = "image" if image_task else "text or instruction"
        raise ConfigError(
            "dataset",
            f"'{spec.name}' is a data set of kind {spec.kind}; {task} needs an "
            f"{need} data set",
        )
    if spec.kind == "instruct" and run.model in TEXT_MODELS:
        raise ConfigError(
            "model",
            f"'{run.model}' is an encoder classifier; instruction tuning on "
            f"'{spec.name}' needs a decoder ({', '.join(CAUSAL_MODELS)} or a hub id)",
        )
    if spec.kind == "text" and run.model in CAUSAL_MODELS:
        raise ConfigError(
            "model",
            f"'{run.model}' is a decoder; classifying '{spec.name}' needs an "
            f"encoder ({', '.join(TEXT_MODELS)} or a hub id)",
        )


def _check_secure(method: MethodConfig, sampled: int | None) -> None:
    """SecAgg+'s refusals of :func:`fedlr.server_apps.secagg.secure_exchange`
    that need no model, as the one-line error a typo gets."""
    from fedlr.errors import SecureAggregationError
    from fedlr.server_apps.secagg_checks import check_secure_config, check_secure_method

    try:
        if sampled is None:  # a deployment: the node count is not known here
            check_secure_method(method)
        else:
            check_secure_config(method, sampled)
    except SecureAggregationError as exc:
        raise ConfigError("secure-aggregation", str(exc)) from None


def _check_cuda(quantization: str, client_gpus: float) -> None:
    """A GPU share or a bitsandbytes base needs CUDA (and bitsandbytes)."""
    import importlib.util

    import torch

    if client_gpus < 0:
        raise ConfigError("--client-gpus", f"must be >= 0, got {client_gpus}")
    cuda = torch.cuda.is_available()
    if client_gpus > 0 and not cuda:
        raise ConfigError(
            "--client-gpus",
            f"{client_gpus} of a GPU per client, but torch sees no CUDA GPU on "
            "this machine: use --client-gpus 0 (CLIENT_GPUS=0)",
        )
    if quantization != "none" and not cuda:
        raise ConfigError(
            "quantization",
            f"'{quantization}' needs CUDA (bitsandbytes kernels); this machine "
            'has none: use quantization="none"',
        )
    if quantization != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "quantization",
            f"'{quantization}' needs the bitsandbytes package "
            "(pip install bitsandbytes)",
        )


# ------------------------------------------------------------- environment
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


def strip_ansi(line: str) -> str:
    """``line`` without ANSI escape sequences (colours, cursor moves)."""
    return _ANSI.sub("", line)


def is_noise(line: str) -> bool:
    """Whether a CLI output line is Flower/Ray/transformers noise (see ``_NOISE``).

    Flower's per-round INFO lines (``[ROUND n/N]``, ``configure_train:
    Sampled``, ``aggregate_train: Received``, empty INFO lines) are noise;
    a fedlr line, a warning and an error never are.
    """
    plain = strip_ansi(line)
    if _FLOWER_ROUND.match(plain) is not None and "fedlr" not in plain:
        return True
    return _NOISE.search(plain) is not None


def _superlink_arg(superlink: str | None) -> list[str]:
    return [] if superlink is None else [superlink]


def _list_runs(
    env: Mapping[str, str], superlink: str | None = None, run_id: str | None = None
) -> list[dict[str, object]]:
    only = [] if run_id is None else ["--run-id", str(run_id)]
    proc = subprocess.run(
        [
            _flwr_executable(),
            "list",
            *_superlink_arg(superlink),
            *only,
            "--format",
            "json",
        ],
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


def _run_status(
    env: Mapping[str, str], run_id: str, superlink: str | None = None
) -> str:
    """The status of run ``run_id`` alone (``flwr list --run-id``)."""
    for run in _list_runs(env, superlink, run_id):
        if str(run.get("run-id")) == str(run_id):
            return str(run.get("status"))
    raise FlwrRunError(f"`flwr list --run-id {run_id}` does not know the run")


# ---------------------------------------------------------------- processes
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
            roots += _superlinks_under(self.home)
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


def _superlinks_under(home: Path) -> list[psutil.Process]:
    text = str(Path(home).resolve())
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any("flower-superlink" in part for part in cmdline) and any(
            text in part for part in cmdline
        ):
            found.append(proc)
    return found


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


@dataclass
class _Stream:
    """The CLI's output as it arrives: kept whole, echoed without noise."""

    echo: bool
    verbose: bool
    lines: list[str] = field(default_factory=list)
    run_id: str | None = None
    colour: bool | None = None
    """Keep ANSI colour codes in the echo; ``None``: only if stdout is a TTY."""

    def read(self, stream: IO[str]) -> None:
        colour = self.colour
        if colour is None:
            colour = _isatty(sys.stdout)
        try:
            for line in stream:
                self.lines.append(line)
                if self.run_id is None:
                    match = _RUN_ID.search(line)
                    if match:
                        self.run_id = match.group(1)
                if self.echo and (self.verbose or not is_noise(line)):
                    sys.stdout.write(line if colour else strip_ansi(line))
                    sys.stdout.flush()
        except (ValueError, OSError):  # the pipe was closed: the CLI is gone
            return

    @property
    def text(self) -> str:
        return "".join(self.lines)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


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
    stream = _Stream(echo=echo, verbose=verbose)
    processes = _Processes(home=link.home if link is not None else None)
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
        run = f"run {stream.run_id}" if stream.run_id else "the run (not started yet)"
        raise RunInterrupted(
            f"interrupted: {run} stopped ({status}); stopped {stopped} processes "
            "it started"
            + ("" if link is None else f" (SuperLink log: {link.log_file})")
        ) from None
    finally:
        with _no_interrupts():
            _stop_processes(proc, processes, link, keep=keep_superlink)
            reader.join(timeout=5)
            proc.stdout.close()
            if completed and link is not None and not keep_superlink:
                shutil.rmtree(link.home, ignore_errors=True)


def _flwr_command(
    app_dir: Path,
    superlink: str | None,
    run_config: Mapping[str, bool | int | float | str] | str | None,
    federation_config: Mapping[str, bool | int | float | str] | None,
) -> list[str]:
    """``flwr run APP_DIR [SUPERLINK] --stream`` with its config overrides."""
    cmd = [_flwr_executable(), "run", str(app_dir), *_superlink_arg(superlink)]
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
    code: int, stream: _Stream, env: Mapping[str, str], superlink: str | None
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
        stream.run_id, _run_status(env, stream.run_id, superlink), output
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
            [_flwr_executable(), "stop", run_id, *_superlink_arg(superlink)],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        deadline = time.monotonic() + 20
        status = _run_status(env, run_id, superlink)
        while status.startswith(("running", "pending", "starting")):
            if time.monotonic() > deadline:
                break
            time.sleep(1)
            status = _run_status(env, run_id, superlink)
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

    This includes the private SuperLinks of :func:`flwr_run` in
    ``flwr_home/local/``, of any launch that used this ``flwr_home``.

    Returns
    -------
    list of int
        PIDs that were signalled.
    """
    stopped: list[int] = []
    for proc in _superlinks_under(Path(flwr_home)):
        try:
            proc.terminate()
            proc.wait(timeout=15)
        except psutil.TimeoutExpired:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
        stopped.append(int(proc.pid))
    return stopped


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
    args = parser.parse_args(argv)
    with cli_logging():
        try:
            return _launch(args)
        except KeyboardInterrupt:  # before the run started: nothing to stop
            _LOG.error("fedlr: interrupted before the run started")
            return 130


def _node_config_file(args: argparse.Namespace, reproducible: bool) -> None:
    """Point the simulated nodes at their own settings (``FEDLR_NODE_CONFIG``).

    The file is checked here, before anything starts. Whoever runs a local
    simulation owns its nodes, so ``reproducible-noise = true`` without a file
    gives them ``dp-allow-reproducible-noise = true`` (logged).
    """
    path = args.node_config_file
    if not path and reproducible:
        home = Path(args.flwr_home).resolve()
        home.mkdir(parents=True, exist_ok=True)
        generated = home / "node-config-reproducible-noise.toml"
        generated.write_text("dp-allow-reproducible-noise = true\n")
        path = str(generated)
        _LOG.warning(
            "fedlr: reproducible-noise = true: the simulated nodes draw their DP "
            "noise from the run seed; epsilon is not a guarantee"
        )
    if not path:
        return
    resolved = str(Path(path).expanduser().resolve())
    check_node_config_file(resolved)  # a bad file fails here, before the run
    os.environ[NODE_CONFIG_ENV] = resolved
    _LOG.info("fedlr: simulated nodes' own settings from %s", resolved)


def _launch(args: argparse.Namespace) -> int:
    app = Path(args.app)
    reproducible = False
    try:
        if is_fedlr_app(app):
            method = check_run_config(app, args.run_config)
            check_before_start(
                method,
                num_supernodes=None if args.superlink else args.num_supernodes,
                client_gpus=args.client_gpus,
            )
            reproducible = method.run.reproducible_noise
            _LOG.info(
                "fedlr: run config checked: method %s, %d rounds",
                method.spec.name,
                method.run.num_server_rounds,
            )
        else:
            parse_run_config(args.run_config)
            if not args.superlink:
                _check_cuda("none", args.client_gpus)
        if not args.superlink:
            _node_config_file(args, reproducible)
        elif args.node_config_file:
            raise ConfigError(
                "--node-config-file",
                "sets the simulated nodes' settings; a deployment's SuperNodes "
                "take theirs with flower-supernode --node-config",
            )
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
    except FlwrRunError as exc:
        _LOG.error("%s", exc)
        return 1
    _LOG.info("fedlr: run %s: %s", outcome.run_id, outcome.status)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
