"""One results writer: a CSV row per round (pandas), plus per-layer rows.

``results.csv`` columns (always present, in this order):
round, method, accuracy, loss, frobenius-gap, relative-gap, rank, bytes-up,
bytes-down, seconds, clients, dropped, train-loss; then the extra columns a
method declares (e.g. ``tail-energy`` for FedSpec), in declared order.
``layers.csv`` holds
``round, layer, frobenius-gap, relative-gap`` for methods that report gaps per
layer. Files are rewritten atomically (write then rename) after every round so
a crash never leaves a half-written CSV.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["COLUMNS", "LAYER_COLUMNS", "ResultsWriter", "read_results"]

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
)
LAYER_COLUMNS = ("round", "layer", "frobenius-gap", "relative-gap")


def _atomic_write_csv(frame: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    frame.to_csv(tmp, index=False)
    os.replace(tmp, path)


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
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        method: str,
        config: Mapping[str, Any] | None = None,
        extra_columns: Sequence[str] = (),
    ) -> None:
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
        self._layer_rows: list[dict[str, Any]] = []
        if config is not None:
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
        self._rows.append(full)
        _atomic_write_csv(self.frame, self.path)
        if layers:
            for name, (gap, rel) in layers.items():
                self._layer_rows.append(
                    {
                        "round": row["round"],
                        "layer": name,
                        "frobenius-gap": gap,
                        "relative-gap": rel,
                    }
                )
            _atomic_write_csv(
                pd.DataFrame(self._layer_rows, columns=list(LAYER_COLUMNS)),
                self.layers_path,
            )

    def rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Copies of the result rows and layer rows (for a checkpoint)."""
        return [dict(r) for r in self._rows], [dict(r) for r in self._layer_rows]

    def restore(
        self, rows: list[dict[str, Any]], layer_rows: list[dict[str, Any]]
    ) -> None:
        """Replace the rows with a checkpoint's and rewrite both CSVs."""
        self._rows = [{c: r.get(c, math.nan) for c in self.columns} for r in rows]
        for r in self._rows:
            r["method"] = self.method
        self._layer_rows = [dict(r) for r in layer_rows]
        _atomic_write_csv(self.frame, self.path)
        if self._layer_rows:
            _atomic_write_csv(
                pd.DataFrame(self._layer_rows, columns=list(LAYER_COLUMNS)),
                self.layers_path,
            )

    @property
    def frame(self) -> pd.DataFrame:
        """All rows so far."""
        return pd.DataFrame(self._rows, columns=list(self.columns))


def read_results(run_dir: Path | str) -> pd.DataFrame:
    """Read ``results.csv`` of a run directory."""
    path = Path(run_dir) / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no results.csv in {run_dir}")
    return pd.read_csv(path)
