"""Method comparisons: run methods x seeds through ``flwr run``, tabulate, plot.

Two sub-commands::

    # run every (method, seed) of a config through `flwr run`, then tabulate
    python -m fedlr.launch.compare run --conf benchmarks/conf/lora-family.toml \\
        --methods fedavg-lora,fedex-lora --seeds 0,1,2 --out docs/results/lora

    # tabulate and plot finished runs
    python -m fedlr.launch.compare table RUN_DIR [RUN_DIR ...] --out DIR

``run`` reads the TOML run config (the same file ``flwr run . --run-config
FILE`` takes), sets ``method``, ``seed`` and ``output-dir`` per cell, runs it
with :func:`fedlr.launch.flwr_run.flwr_run` and keeps going when one cell fails
(the failure is listed in the table). Every cell's run config is resolved
before the first cell starts (a typo is one line, in seconds). A cell whose
directory already holds a finished run (``summary.json``) is skipped, and an
unfinished one (interrupted: rows and a checkpoint, no ``summary.json``)
continues from its checkpoint (``resume-from``): rerunning the same command
resumes the sweep. Ctrl-C stops the running cell (its run and every process
it started) and the sweep. ``table`` writes:

``table.md``, ``table.csv`` and ``comparison.png``
(:func:`fedlr.runs.table.write_table`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import tomllib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from transformers.utils import logging as hf_logging

from fedlr.errors import ConfigError, FedLRError
from fedlr.flower.output import is_noise, isatty
from fedlr.flower.superlink import FlwrRunError
from fedlr.launch.flwr_run import RunInterrupted, cli_logging, flwr_run
from fedlr.launch.local import run_in_process
from fedlr.launch.run_config import check_run_config, parse_run_config, unparsed_text
from fedlr.privacy.node_policy import STATE_DIR_ENV
from fedlr.runs.table import to_markdown, write_table
from fedlr.strategies.registry import resolve

__all__ = [
    "ENGINES",
    "SweepInterrupted",
    "cell_state",
    "main",
    "parse_overrides",
    "read_conf",
    "run_sweep",
]

_LOG = logging.getLogger("fedlr")

#: How :func:`run_sweep` runs a cell: the real ``flwr run`` or in this process.
ENGINES = ("flwr", "inprocess")


class SweepInterrupted(FedLRError):
    """Ctrl-C stopped a sweep; the message says where and how to resume."""


def cell_state(cell_dir: Path | str) -> tuple[Path | None, Path | None]:
    """A sweep cell's finished run and its newest unfinished one, if any.

    A run directory is finished when it holds ``summary.json`` (written last,
    after the final round); an unfinished one that holds a checkpoint
    manifest (``checkpoint.json``) can continue with ``resume-from``.

    Returns
    -------
    (finished, resumable) : (Path or None, Path or None)
    """
    runs = sorted(
        (p for p in Path(cell_dir).glob("*/") if p.is_dir()),
        key=lambda p: p.stat().st_mtime,
    )
    finished = [p for p in runs if (p / "summary.json").is_file()]
    resumable = [
        p for p in runs if p not in finished and (p / "checkpoint.json").is_file()
    ]
    return finished[-1] if finished else None, resumable[-1] if resumable else None


def read_conf(path: Path | str) -> dict[str, Any]:
    """Read a TOML run config and validate it with its method's options.

    Raises
    ------
    fedlr.errors.ConfigError
        On an unknown key or a bad value (with the key named).
    """
    with open(path, "rb") as fh:
        values = tomllib.load(fh)
    resolve(values)
    return values


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """Run-config overrides from ``--set`` arguments, parsed as ``flwr run`` does
    (:func:`~fedlr.launch.run_config.parse_run_config`).

    Each item holds one or more ``key=value`` pairs separated by spaces, values in
    TOML (``'lora-rank=4 partitioner="iid"'``).

    Raises
    ------
    fedlr.errors.ConfigError
        When an item is not ``key=value`` TOML.
    """
    out: dict[str, Any] = {}
    for item in items:
        rest = unparsed_text(item)
        if rest:
            raise ConfigError(
                "--set",
                f"{rest!r} is not key=value (e.g. 'lora-rank=4 "
                'partitioner="iid"\', strings in double quotes)',
            )
        out.update(parse_run_config(item))
    return out


def run_sweep(
    conf: Path | str,
    methods: Sequence[str],
    seeds: Sequence[int],
    out_dir: Path | str,
    *,
    overrides: Mapping[str, Any] | None = None,
    num_supernodes: int | None = None,
    flwr_home: Path | None = None,
    app_dir: Path = Path("."),
    engine: str = "flwr",
    client_gpus: float = 0.0,
    verbose: bool = False,
) -> tuple[list[Path], dict[str, str]]:
    """Run every (method, seed); return the run directories and the failures.

    Every cell's run config is resolved first (a bad one raises before any
    cell runs). A cell with a finished run in ``OUT/runs/<method>-seed<seed>/``
    is not run again; an unfinished one with a checkpoint continues from it
    (``resume-from``).

    Parameters
    ----------
    engine : {"flwr", "inprocess"}
        ``flwr``: each cell through the real ``flwr run`` (a local SuperLink of
        its own, Ray simulation engine, ``num_supernodes`` nodes,
        ``client_gpus`` of a GPU per client). ``inprocess``: each cell through
        :func:`fedlr.launch.local.run_in_process` (same ServerApp and
        ClientApp, same numbers, no SuperLink or Ray start-up per cell).
    client_gpus : float
        ``client-resources-num-gpus`` (federation config) for the ``flwr``
        engine, e.g. 0.25 for four clients per GPU; the ``device`` key
        (``auto``) then picks CUDA, MPS or the CPU on each client.
    verbose : bool
        Show Flower's, Ray's and transformers' noise (``flwr`` engine).

    Raises
    ------
    fedlr.errors.ConfigError, fedlr.errors.UnknownMethodError
        On a bad cell config, before any cell runs.
    SweepInterrupted
        On Ctrl-C: the running cell was stopped; rerunning resumes.
    """
    if engine not in ENGINES:
        raise ConfigError("--engine", f"'{engine}' is not one of {', '.join(ENGINES)}")
    if client_gpus < 0:
        raise ConfigError("--client-gpus", f"must be >= 0, got {client_gpus}")
    base = {**read_conf(conf), **(overrides or {})}
    nodes = num_supernodes or int(base.get("num-partitions", 4))
    federation: dict[str, Any] = {"num-supernodes": nodes}
    if client_gpus:
        federation["client-resources-num-gpus"] = client_gpus
    cells = _cells(base, methods, seeds, Path(out_dir).resolve(), engine, app_dir)

    def launch(config: dict[str, Any]) -> None:
        with _cell_nodes(Path(str(config["output-dir"]))):
            if engine == "flwr":
                flwr_run(
                    app_dir,
                    flwr_home=(flwr_home or Path(".flwr")).resolve(),
                    run_config=config,
                    federation_config=federation,
                    echo=True,
                    verbose=verbose,
                    keep_superlink=False,
                )
            else:
                run_in_process(config, num_nodes=nodes)

    return _run_cells(cells, engine, launch)


def _run_cells(
    cells: list[tuple[str, dict[str, Any]]],
    engine: str,
    launch: Callable[[dict[str, Any]], None],
) -> tuple[list[Path], dict[str, str]]:
    """Run the cells in order: the finished run directories and the failures
    (a failed cell does not stop the sweep; Ctrl-C does)."""
    run_dirs: list[Path] = []
    failures: dict[str, str] = {}
    for n, (cell, config) in enumerate(cells, start=1):
        progress = f"[{n}/{len(cells)}] {cell}"
        try:
            done = _run_cell(progress, config, engine, launch)
        except (RunInterrupted, KeyboardInterrupt) as exc:
            how = str(exc) if isinstance(exc, RunInterrupted) else "interrupted"
            raise SweepInterrupted(
                f"{cell}: {how}; {len(run_dirs)} of {len(cells)} cells finished; "
                "run the same command again to resume"
            ) from None
        except (FlwrRunError, FedLRError) as exc:
            failures[cell] = str(exc).splitlines()[0]
            _LOG.error("%s failed: %s", cell, failures[cell])
            continue
        if done is None:
            failures[cell] = "the run ended without a summary.json"
            continue
        run_dirs.append(done)
    return run_dirs, failures


@contextmanager
def _cell_nodes(cell_dir: Path) -> Iterator[None]:
    """Each cell's simulated nodes keep their privacy ledgers in the cell's
    ``node-state/`` (a cell is its own experiment: its DP-SGD epsilon is its
    own, and a resumed cell keeps counting), unless ``FEDLR_NODE_STATE_DIR``
    names one directory for every run."""
    if os.environ.get(STATE_DIR_ENV):
        yield
        return
    os.environ[STATE_DIR_ENV] = str(cell_dir / "node-state")
    try:
        yield
    finally:
        os.environ.pop(STATE_DIR_ENV, None)


def _cells(
    base: Mapping[str, Any],
    methods: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    engine: str,
    app_dir: Path,
) -> list[tuple[str, dict[str, Any]]]:
    """``(cell name, run config)`` of every (method, seed), each checked."""
    cells: list[tuple[str, dict[str, Any]]] = []
    for method, seed in ((m, s) for m in methods for s in seeds):
        cell = f"{method}-seed{seed}"
        config = {
            **base,
            "method": method,
            "seed": seed,
            "output-dir": str(out / "runs" / cell),
        }
        if engine == "flwr":  # the keys `flwr run` accepts: the app's table
            check_run_config(app_dir, config)
        else:
            resolve(config)
        cells.append((cell, config))
    return cells


def _run_cell(
    progress: str,
    config: dict[str, Any],
    engine: str,
    launch: Callable[[dict[str, Any]], None],
) -> Path | None:
    """Run (or resume, or skip) one cell; its finished run directory or None."""
    finished, resumable = cell_state(Path(config["output-dir"]))
    if finished is not None:
        _LOG.info("%s: finished earlier (%s), skipped", progress, finished.name)
        return finished
    if resumable is not None:
        config = {**config, "resume-from": str(resumable)}
        _LOG.info("%s: resuming %s", progress, resumable.name)
    else:
        _LOG.info("%s (%s engine)", progress, engine)
    started = time.perf_counter()
    launch(config)
    _LOG.info("%s done in %.0f s", progress, time.perf_counter() - started)
    return cell_state(Path(config["output-dir"]))[0]


@contextmanager
def _flower_lines_once(verbose: bool = False) -> Iterator[None]:
    """Flower's log lines through Flower's own handler only (not also the root's).

    In-process runs log through the ``flwr`` logger; when the root logger has
    a handler too, every line would be printed twice. Unless ``verbose``,
    Flower's hints and its per-round INFO lines
    (:func:`fedlr.flower.output.is_noise`, the same filter as under ``flwr
    run``) are left out, and Flower's level colours are written only to a
    terminal (a log file gets no ANSI codes).
    """
    flower = logging.getLogger("flwr")
    saved = flower.propagate
    flower.propagate = False
    quiet = _NoiseFilter()
    if not verbose:
        flower.addFilter(quiet)
    coloured = {
        handler: handler.colored  # Flower's ConsoleHandler
        for handler in flower.handlers
        if isinstance(handler, logging.StreamHandler) and hasattr(handler, "colored")
    }
    for handler in coloured:
        handler.colored = isatty(handler.stream)
    try:
        yield
    finally:
        flower.propagate = saved
        flower.removeFilter(quiet)
        for handler, colour in coloured.items():
            handler.colored = colour


class _NoiseFilter(logging.Filter):
    """Flower's noise, as :func:`~fedlr.flower.output.is_noise` sees a CLI line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_noise(f"{record.levelname} : {record.getMessage()}")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``run`` or ``table`` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    table_options = argparse.ArgumentParser(add_help=False)
    table_options.add_argument("--out", required=True, type=Path)
    table_options.add_argument("--by", default="", help="config keys that split rows")
    run = sub.add_parser(
        "run", parents=[table_options], help="run methods x seeds, then tabulate"
    )
    run.add_argument("--conf", required=True, type=Path, help="TOML run config")
    run.add_argument("--methods", required=True, help="comma-separated")
    run.add_argument("--seeds", default="0", help="comma-separated integers")
    run.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config overrides as for `flwr run --run-config`: "
        "'key=value key2=\"text\"' (TOML values; one or several arguments)",
    )
    run.add_argument("--num-supernodes", type=int, default=None)
    run.add_argument(
        "--engine",
        choices=ENGINES,
        default="flwr",
        help="flwr: each cell through `flwr run` (default); inprocess: the same "
        "ServerApp and ClientApp in this process, same numbers, no Ray start-up",
    )
    run.add_argument(
        "--client-gpus",
        type=float,
        default=0.0,
        help="GPU share per simulated client with the flwr engine (e.g. 0.25)",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="show Flower's, Ray's and transformers' hints, warnings and "
        "progress bars too",
    )
    table = sub.add_parser(
        "table", parents=[table_options], help="tabulate finished runs"
    )
    table.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", False)
    with cli_logging(), quiet_in_process(verbose):
        return _main(args, verbose)


@contextmanager
def quiet_in_process(verbose: bool = False) -> Iterator[None]:
    """In-process runs print fedlr's lines once and without the libraries' noise.

    Flower's lines go through Flower's own handler only (never twice), and
    unless ``verbose`` Flower's hints, transformers' warnings, progress bars
    and deprecation ``FutureWarning`` s (PEFT probes a deprecated attribute
    of every model it wraps) are left out. ``benchmarks/`` drivers that run
    in process use it too.
    """
    with _flower_lines_once(verbose), _quiet_libraries(verbose):
        yield


@contextmanager
def _quiet_libraries(verbose: bool) -> Iterator[None]:
    """transformers' warnings and progress bars off in this process (not ``verbose``).

    The in-process engine builds models here; the ``flwr`` engine's processes
    get the same through their environment (:func:`fedlr.flower.superlink.flwr_env`).
    """
    if verbose:
        yield
        return
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", category=FutureWarning, module=r"transformers\."
            )
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(
            "--seeds", f"'{text}' is not comma-separated integers"
        ) from None


def _main(args: argparse.Namespace, verbose: bool) -> int:
    by = [k for k in args.by.split(",") if k]
    failures: dict[str, str] = {}
    try:
        if args.command == "run":
            run_dirs, failures = run_sweep(
                args.conf,
                [m.strip() for m in args.methods.split(",") if m.strip()],
                _seeds(args.seeds),
                args.out,
                overrides=parse_overrides(args.set),
                num_supernodes=args.num_supernodes,
                engine=args.engine,
                client_gpus=args.client_gpus,
                verbose=verbose,
            )
        else:
            run_dirs = list(args.run_dirs)
    except SweepInterrupted as exc:
        _LOG.error("fedlr: %s", exc)
        return 130
    except (FedLRError, OSError) as exc:
        _LOG.error("error: %s", str(exc).splitlines()[0])
        return 2
    if not run_dirs:
        _LOG.error("no run finished")
        for cell, reason in failures.items():
            _LOG.error("  %s: %s", cell, reason)
        return 1
    result = write_table(run_dirs, args.out, by, failures)
    sys.stdout.write(to_markdown(result, by))  # the command's output
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
