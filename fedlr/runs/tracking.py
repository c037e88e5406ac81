"""Experiment trackers: where a run's settings and per-round rows go besides the CSVs.

One small interface, :class:`Tracker`, fed by the results writer
(:class:`fedlr.runs.results.ResultsWriter`): the run's resolved settings once
(:meth:`Tracker.log_params`), then every row appended to ``results.csv``
(:meth:`Tracker.log_metrics`, the round as the step; finite numbers only, so
a round without evaluation logs no accuracy). The run-config key
``tracker`` picks one:

``none``
    Nothing besides the CSVs (the default).
``tensorboard``
    Event files in ``<run dir>/tensorboard/`` (``torch.utils.tensorboard``;
    offline, ``tensorboard --logdir <run dir>``). A resumed run purges the
    steps after its checkpoint, so the curves have no duplicates.
``mlflow``
    An MLflow run in the experiment ``fedlr`` (or ``$MLFLOW_EXPERIMENT_NAME``)
    of ``$MLFLOW_TRACKING_URI`` when set, else of a local file store in
    ``<run dir>/mlruns/`` (``mlflow ui --backend-store-uri <run dir>/mlruns``).
    MLflow 3 keeps the file store in maintenance mode and asks for
    ``MLFLOW_ALLOW_FILE_STORE=true``; fedlr sets it for the local store.
``wandb``
    A Weights & Biases run (project ``fedlr`` or ``$WANDB_PROJECT``, files
    under the run directory; ``WANDB_MODE=offline`` keeps it local). The
    ``wandb`` package is optional: imported only when chosen, and a
    :class:`~fedlr.errors.ConfigError` says how to install it when missing.

The tracker packages are imported when a tracker is opened, not with this
module: every Flower process imports fedlr, only the server tracks.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import numbers
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from fedlr.config.run import TRACKERS
from fedlr.errors import ConfigError

__all__ = [
    "MlflowTracker",
    "NoTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "check_tracker_installed",
    "code_version",
    "numeric_metrics",
    "open_tracker",
]

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""The package each tracker imports when it is opened (``none`` needs none)."""

MLFLOW_EXPERIMENT = "fedlr"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"


def numeric_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``row`` (strings, NaN and infinities left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue  # numpy's integers and floats are numbers.Real too
        if math.isfinite(value):
            out[key] = float(value)
    return out


def code_version(package_dirs: Sequence[Path] | None = None) -> str:
    """``git describe --always --dirty`` of fedlr's checkout, else its version.

    The checkout is the git work tree that tracks the fedlr package being run:
    the directory it is imported from, else the source directory of an
    editable install (``pip install -e .``). ``flwr run`` imports fedlr from
    its copy of the app (no ``.git``), so the editable install's checkout is
    what names the commit there. A directory inside some other repository
    (an ignored copy, a home directory under git) does not count: the
    package's ``__init__.py`` must be tracked. ``package_dirs`` overrides the
    candidates (tests). Without a usable checkout or ``git``, the installed
    package's version (``fedlr 0.1.0``); never an error.
    """
    candidates = _package_dirs() if package_dirs is None else list(package_dirs)
    for directory in candidates:
        described = _git_describe(directory)
        if described:
            return f"git {described}"
    try:
        return f"fedlr {version('fedlr')}"
    except PackageNotFoundError:
        return "unknown"


def _package_dirs() -> list[Path]:
    """The fedlr package imported, then the one of an editable install."""
    here = Path(__file__).resolve().parents[1]  # the fedlr package
    dirs = [here]
    try:
        text = distribution("fedlr").read_text("direct_url.json")
        info = json.loads(text) if text else {}
    except (PackageNotFoundError, OSError, ValueError):
        info = {}
    url = info.get("url", "") if isinstance(info, dict) else ""
    editable = isinstance(info, dict) and info.get("dir_info", {}).get("editable")
    if editable and isinstance(url, str) and url.startswith("file://"):
        source = Path(unquote(urlparse(url).path)) / here.name
        if source.is_dir() and source.resolve() != here:
            dirs.append(source.resolve())
    return dirs


def _git(directory: Path, *args: str) -> str | None:
    """``git -C directory args``'s output, or None when it fails."""
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git_describe(package_dir: Path) -> str | None:
    """``git describe --always --dirty`` of the work tree tracking ``package_dir``."""
    if not (package_dir / "__init__.py").is_file():
        return None
    if _git(package_dir, "ls-files", "--error-unmatch", "__init__.py") is None:
        return None  # not a work tree, or one that does not track this package
    return _git(package_dir, "describe", "--always", "--dirty") or None


class Tracker:
    """Receives a run's settings and its per-round metrics (this base records
    nothing: each tracker overrides all three methods)."""

    name = "none"

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record the run's settings (once, at the start of a new run)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record the finite numbers of one round (``step`` = the round)."""

    def close(self) -> None:
        """Flush and finish (the run is over)."""


class NoTracker(Tracker):
    """``tracker = "none"``: the CSVs only."""


def _settings_text(params: Mapping[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {params[k]!r} |" for k in sorted(params))
    return "| key | value |\n|---|---|\n" + rows


class TensorBoardTracker(Tracker):
    """Scalars per round in ``<run_dir>/tensorboard/``; settings as a text table.

    Parameters
    ----------
    run_dir : pathlib.Path
    purge_step : int, optional
        A resumed run's first round: events at this step and later, written
        before the crash, are dropped.
    """

    name = "tensorboard"

    def __init__(self, run_dir: Path, *, purge_step: int | None = None) -> None:
        summary = importlib.import_module("torch.utils.tensorboard")
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._writer = summary.SummaryWriter(
            log_dir=str(self.log_dir), purge_step=purge_step
        )

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._writer.add_text("settings", _settings_text(params), global_step=0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MlflowTracker(Tracker):
    """One MLflow run: the settings as params, each round's numbers as metrics.

    Parameters
    ----------
    run_dir : pathlib.Path
    run_name : str
        The MLflow run's name (fedlr's run directory name).
    tracking_uri : str, optional
        Default ``$MLFLOW_TRACKING_URI``, else the file store
        ``<run_dir>/mlruns``.
    """

    name = "mlflow"

    def __init__(
        self, run_dir: Path, *, run_name: str, tracking_uri: str | None = None
    ) -> None:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (Path(run_dir) / MLFLOW_DIR).resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        client_module = importlib.import_module("mlflow.tracking")
        self._entities = importlib.import_module("mlflow.entities")
        self._client = client_module.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", MLFLOW_EXPERIMENT)
        found = self._client.get_experiment_by_name(name)
        self.experiment_id = (
            found.experiment_id if found else self._client.create_experiment(name)
        )
        run = self._client.create_run(self.experiment_id, run_name=run_name)
        self.run_id: str = run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        entries = [self._entities.Param(k, str(params[k])) for k in sorted(params)]
        for start in range(0, len(entries), 100):  # MLflow's batch limit
            self._client.log_batch(self.run_id, params=entries[start : start + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        entries = [
            self._entities.Metric(key, value, stamp, step)
            for key, value in metrics.items()
        ]
        if entries:
            self._client.log_batch(self.run_id, metrics=entries)

    def close(self) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED")


class WandbTracker(Tracker):
    """A Weights & Biases run (the optional ``wandb`` package).

    Raises
    ------
    ConfigError
        (key ``tracker``) when ``wandb`` is not installed.
    """

    name = "wandb"

    def __init__(self, run_dir: Path, *, run_name: str) -> None:
        try:
            wandb = importlib.import_module("wandb")
        except ImportError:
            raise ConfigError(
                "tracker",
                "'wandb' needs the wandb package (pip install wandb), or choose "
                "tensorboard or mlflow",
            ) from None
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fedlr"),
            name=run_name,
            dir=str(run_dir),
        )

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def check_tracker_installed(name: str) -> None:
    """Refuse a tracker whose package is not installed, without importing it.

    Only looks the package up (:func:`importlib.util.find_spec`), so the
    launcher can say so in one line before anything starts; unknown names
    are left to the run config's own check.

    Raises
    ------
    ConfigError
        (key ``tracker``) when the tracker's package is missing.
    """
    package = TRACKER_PACKAGES.get(name)
    if package is None or importlib.util.find_spec(package) is not None:
        return
    others = [t for t in TRACKER_PACKAGES if t != name and _installed(t)]
    instead = f", or choose {' or '.join(others)}" if others else ""
    raise ConfigError(
        "tracker",
        f"'{name}' needs the {package} package (pip install {package}){instead}",
    )


def _installed(tracker: str) -> bool:
    return importlib.util.find_spec(TRACKER_PACKAGES[tracker]) is not None


def open_tracker(
    name: str,
    run_dir: Path,
    *,
    run_name: str | None = None,
    resume_step: int | None = None,
) -> Tracker:
    """The tracker ``name`` (one of :data:`TRACKERS`) for the run in ``run_dir``.

    Parameters
    ----------
    name : str
    run_dir : pathlib.Path
    run_name : str, optional
        Default: the run directory's name.
    resume_step : int, optional
        A resumed run's first round (TensorBoard purges the later steps).

    Raises
    ------
    ConfigError
        (key ``tracker``) for an unknown name, or ``wandb`` not installed.
    """
    label = run_name or Path(run_dir).name
    if name == "none":
        return NoTracker()
    if name == "tensorboard":
        return TensorBoardTracker(run_dir, purge_step=resume_step)
    if name == "mlflow":
        return MlflowTracker(run_dir, run_name=label)
    if name == "wandb":
        return WandbTracker(run_dir, run_name=label)
    raise ConfigError("tracker", f"'{name}' is not one of {', '.join(TRACKERS)}")
