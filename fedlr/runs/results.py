"""One results writer: a CSV row per round (pandas), plus per-layer rows.

``results.csv`` columns (always present, in this order):
round, method, accuracy, loss, frobenius-gap, relative-gap, rank, bytes-up,
bytes-down, seconds, clients, dropped, train-loss; then the extra columns a
method declares (e.g. ``tail-energy`` for FedSpec), in declared order.
``dp-epsilon`` (DP-SGD, the round's largest client epsilon) and
``client-dp-epsilon`` (client-level DP) are NaN without differential privacy
(``docs/privacy.md``). With a DP mechanism on, ``noise-reproducible`` (1:
the noise came from the run seed, ``reproducible-noise``, so no epsilon is a
guarantee) follows, and ``summary.json`` says ``privacy-noise`` and lists
under ``outside-epsilon`` the columns computed from the clients' replies
without noise, which no reported epsilon covers (:func:`privacy_summary`).
``layers.csv`` holds
``round, layer, frobenius-gap, relative-gap`` for methods that report gaps per
layer. Both files are appended to, one round's rows at a time, so a round
costs the same at round 3 and at round 3000; a crash can leave a torn last
line, which a resumed run drops: it keeps the rows up to its checkpoint's
round (:meth:`ResultsWriter.restore`) and rewrites the files once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from fedlr.errors import CheckpointError, ConfigError
from fedlr.privacy.settings import PrivacyConfig
from fedlr.runs.tracking import NoTracker, Tracker, numeric_metrics

__all__ = [
    "COLUMNS",
    "LAYER_COLUMNS",
    "NOISE_REPRODUCIBLE",
    "ResultsWriter",
    "ensure_output_dir",
    "privacy_summary",
    "read_results",
]

COLUMNS = (
    "round",
    "method",
    "accuracy",
    "loss",
    "frobenius-gap",
    "relative-gap",
    "rank",
    "bytes-up",
    "bytes-down",
    "seconds",
    "train-seconds",
    "aggregate-seconds",
    "eval-seconds",
    "clients",
    "dropped",
    "train-loss",
    "rejected-rounds",
    "robust-clipped",
    "robust-trimmed",
    "robust-capped",
    "dp-epsilon",
    "client-dp-epsilon",
)
LAYER_COLUMNS = ("round", "layer", "frobenius-gap", "relative-gap")
NOISE_REPRODUCIBLE = "noise-reproducible"
"""Column written when a DP mechanism is on: 1 with ``reproducible-noise``."""
INSIDE_EPSILON = frozenset(
    {"round", "method", "bytes-down", "client-dp-epsilon", NOISE_REPRODUCIBLE}
)
"""Columns that are not computed from the clients' replies (the epsilon, the
plan's bytes sent); with :data:`SERVER_EVALUATED` when the server evaluates
the published model on its own data."""
SERVER_EVALUATED = frozenset({"accuracy", "loss", "perplexity", "exact-match"})
"""The evaluation columns (``fedlr.wire.protocol.TASK_EVAL_METRICS`` besides
accuracy and loss; spelled out here, since this module imports no Flower)."""

COUNT_COLUMNS = frozenset(
    {
        "round",
        "rank",
        "clients",
        "dropped",
        "rejected-rounds",
        "robust-clipped",
        "robust-trimmed",
        "robust-capped",
        NOISE_REPRODUCIBLE,
    }
)
"""Columns of counts, written as integers (``4``, not ``4.0``); so is every
``bytes-*`` column."""


def privacy_summary(
    privacy: PrivacyConfig, columns: Sequence[str], *, server_evaluated: bool = True
) -> dict[str, Any]:
    """``summary.json``'s privacy fields; none without a DP mechanism.

    ``privacy-noise``: ``"secure"`` or ``"reproducible (epsilon is not a
    guarantee)"``. ``outside-epsilon``: the results columns outside
    :data:`INSIDE_EPSILON` (and :data:`SERVER_EVALUATED` unless
    ``server_evaluated`` is false: the clients evaluate), i.e. values
    computed from the clients' replies without noise (``train-loss``, the
    gaps, client counts, bytes up, timings, the clients' own ``dp-epsilon``),
    conservatively for client-level DP; no epsilon bounds what they reveal.
    """
    if not privacy.active:
        return {}
    inside = INSIDE_EPSILON | (SERVER_EVALUATED if server_evaluated else set())
    return {
        "privacy-noise": (
            "reproducible (epsilon is not a guarantee)"
            if privacy.reproducible
            else "secure"
        ),
        "outside-epsilon": [c for c in columns if c not in inside],
    }


def _is_count(column: str) -> bool:
    return column in COUNT_COLUMNS or column.startswith("bytes-")


def _counts_as_integers(frame: pd.DataFrame) -> pd.DataFrame:
    """Count columns as nullable integers where every value is a whole number."""
    for column in frame.columns:
        if not _is_count(column):
            continue
        values = pd.to_numeric(frame[column], errors="coerce")
        whole = values.dropna()
        if len(whole) and bool(((whole % 1) == 0).all()):
            frame[column] = values.round().astype("Int64")
    return frame


def ensure_output_dir(path: Path) -> Path:
    """Create the results directory ``output-dir`` (and its parents) if needed.

    Called before the server builds anything, so that a directory that
    cannot be used is refused before round 1, not with a raw ``OSError``.

    Raises
    ------
    ConfigError
        (key ``output-dir``) if ``path`` is a file, a symbolic link to
        nothing, below a file, or cannot be created or written to; the
        message says which and what to do.
    """
    path = Path(path)
    todo = "set output-dir to a directory you can write to"
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            "output-dir",
            f"'{path}' is a symbolic link to '{os.readlink(path)}', which does "
            f"not exist: create that directory, remove the link or {todo}",
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(
            "output-dir", f"'{path}' is a file, not a directory: move it away or {todo}"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            "output-dir", f"cannot create '{path}': {exc.strerror or exc}; {todo}"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("output-dir", f"'{path}' is not writable; {todo}")
    return path


def _atomic_write_csv(frame: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    _counts_as_integers(frame.copy()).to_csv(tmp, index=False)
    os.replace(tmp, path)


def _append_csv(rows: list[dict[str, Any]], columns: Sequence[str], path: Path) -> None:
    """Append ``rows`` to ``path`` (with the header if the file is new).

    Not synced: the checkpoint after the round is, and a resumed run trusts
    the CSV rows only up to its checkpoint's round.
    """
    header = not path.is_file() or path.stat().st_size == 0
    frame = _counts_as_integers(pd.DataFrame(rows, columns=list(columns)))
    with path.open("a", encoding="utf-8", newline="") as f:
        frame.to_csv(f, header=header, index=False)


class ResultsWriter:
    """Accumulate per-round rows and keep ``results.csv`` up to date.

    Parameters
    ----------
    run_dir : pathlib.Path
        Directory of this run (created).
    method : str
        Method name written in every row.
    config : mapping, optional
        Run configuration, saved once as ``config.json``.
    extra_columns : sequence of str, optional
        Method-specific columns written after :data:`COLUMNS`.
    tracker : fedlr.runs.tracking.Tracker, optional
        Also receives ``config`` (as the run's settings) and every appended
        row's finite numbers, the round as the step (:mod:`fedlr.runs.tracking`);
        :meth:`close` closes it.
    privacy : PrivacyConfig, optional
        With a DP mechanism on, :data:`NOISE_REPRODUCIBLE` is written last,
        filled from ``privacy.reproducible`` unless a row gives it.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        method: str,
        config: Mapping[str, Any] | None = None,
        extra_columns: Sequence[str] = (),
        tracker: Tracker | None = None,
        privacy: PrivacyConfig | None = None,
    ) -> None:
        self.privacy = privacy if privacy is not None else PrivacyConfig()
        if self.privacy.active and NOISE_REPRODUCIBLE not in extra_columns:
            extra_columns = (*extra_columns, NOISE_REPRODUCIBLE)
        clash = sorted(set(extra_columns) & set(COLUMNS))
        if clash or len(set(extra_columns)) != len(extra_columns):
            raise ValueError(
                f"extra columns {list(extra_columns)} repeat a column: "
                f"{clash or 'duplicates'}"
            )
        self.columns: tuple[str, ...] = (*COLUMNS, *extra_columns)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.method = method
        self.path = self.run_dir / "results.csv"
        self.layers_path = self.run_dir / "layers.csv"
        self._rows: list[dict[str, Any]] = []
        self.tracker: Tracker = tracker or NoTracker()
        if config is not None:
            self.tracker.log_params(config)
            tmp = self.run_dir / "config.json.tmp"
            tmp.write_text(json.dumps(dict(config), indent=2, sort_keys=True))
            os.replace(tmp, self.run_dir / "config.json")

    def append(
        self,
        row: Mapping[str, Any],
        *,
        layers: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """Add one round.

        Parameters
        ----------
        row : mapping
            Values keyed by :attr:`columns` (``method`` is filled in). Missing
            numeric columns are written as NaN; unknown keys raise ``KeyError``.
        layers : mapping of layer name to (gap, relative gap), optional
        """
        unknown = sorted(set(row) - set(self.columns))
        if unknown:
            raise KeyError(f"unknown result columns {unknown}; known: {self.columns}")
        if "round" not in row:
            raise KeyError("a results row needs 'round'")
        full = {c: row.get(c, math.nan) for c in self.columns}
        full["method"] = self.method
        if NOISE_REPRODUCIBLE in self.columns and NOISE_REPRODUCIBLE not in row:
            full[NOISE_REPRODUCIBLE] = 1.0 if self.privacy.reproducible else 0.0
        self._rows.append(full)
        _append_csv([full], self.columns, self.path)
        numbers = numeric_metrics({k: v for k, v in full.items() if k != "round"})
        self.tracker.log_metrics(numbers, step=int(row["round"]))
        if layers:
            layer_rows = [
                dict(zip(LAYER_COLUMNS, (row["round"], name, gap, rel), strict=True))
                for name, (gap, rel) in layers.items()
            ]
            _append_csv(layer_rows, LAYER_COLUMNS, self.layers_path)

    def restore(
        self,
        upto_round: int,
        rows: list[dict[str, Any]] | None = None,
        layer_rows: list[dict[str, Any]] | None = None,
    ) -> None:
        """Resume: keep the rows of rounds ``<= upto_round``, rewrite both CSVs.

        The rows come from the run's own CSVs (a torn last line, or rows of
        rounds after the checkpoint, are dropped); a checkpoint of an older
        fedlr that carries its ``rows`` and ``layer_rows`` gives them instead.

        Raises
        ------
        CheckpointError
            If ``results.csv`` lacks rows the checkpoint has (a round in
            ``1 .. upto_round`` missing).
        """
        if rows is None:
            rows = _read_rows(self.path, upto_round)
            layer_rows = _read_rows(self.layers_path, upto_round)
            have = {int(r["round"]) for r in rows}
            missing = sorted(set(range(1, upto_round + 1)) - have)
            if missing:
                raise CheckpointError(
                    f"{self.path}: rows of rounds {missing[:5]} are missing, but "
                    f"the checkpoint is after round {upto_round}; the run "
                    "directory was edited or is another run's"
                )
        self._rows = [{c: r.get(c, math.nan) for c in self.columns} for r in rows]
        for r in self._rows:
            r["method"] = self.method
        _atomic_write_csv(self.frame, self.path)
        if layer_rows:
            _atomic_write_csv(
                pd.DataFrame(layer_rows, columns=list(LAYER_COLUMNS)), self.layers_path
            )
        elif self.layers_path.is_file():
            self.layers_path.unlink()

    def close(self) -> None:
        """Close the tracker (the run is over)."""
        self.tracker.close()

    @property
    def frame(self) -> pd.DataFrame:
        """All rows so far."""
        return pd.DataFrame(self._rows, columns=list(self.columns))


def _read_rows(path: Path, upto_round: int) -> list[dict[str, Any]]:
    """The rows of ``path`` whose round is ``<= upto_round`` (none if absent).

    A torn last line (a crash while appending) fails to parse as a round and
    is dropped with the other rows after ``upto_round``.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return []
    frame = pd.read_csv(path)
    rounds = pd.to_numeric(frame["round"], errors="coerce")
    kept = frame[rounds.notna() & (rounds <= upto_round)]
    # A torn line can parse as an earlier round ("1" of "12"): first rows win.
    keys = ["round", "layer"] if "layer" in kept.columns else ["round"]
    kept = kept.drop_duplicates(subset=keys, keep="first")
    return [
        {k: (math.nan if pd.isna(v) else v) for k, v in row.items()}
        for row in kept.to_dict("records")
    ]


def read_results(run_dir: Path | str) -> pd.DataFrame:
    """Read ``results.csv`` of a run directory."""
    path = Path(run_dir) / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no results.csv in {run_dir}")
    return pd.read_csv(path)
