"""Continual-learning metrics: the accuracy matrix, ACC and FGT.

After finishing task ``t`` (of ``T``) the global model is evaluated on the
held-out split of every task ``j <= t``, giving row ``t`` of the lower
triangular accuracy matrix ``a[t, j]``. Following GPM [1]_ and FOT [2]_:

* ``ACC = (1/T) Σ_j a[T-1, j]``, the mean final accuracy over all tasks;
* ``FGT = (1/(T-1)) Σ_{j < T-1} (max_{j <= t < T-1} a[t, j] - a[T-1, j])``,
  the mean drop from the best accuracy a task had at an earlier task boundary
  to its final accuracy (Chaudhry et al.'s forgetting measure; the last task
  cannot be forgotten yet and is left out). FGT is 0 for a single task.

References
----------
.. [1] Saha, Garg, Roy, "Gradient Projection Memory for Continual Learning",
   ICLR 2021.
.. [2] Bakman et al., "Federated Orthogonal Training", ICLR 2024.
.. [3] Chaudhry et al., "Riemannian Walk for Incremental Learning", ECCV 2018.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

__all__ = ["AccuracyMatrix", "average_accuracy", "forgetting"]


def _check_rows(rows: Sequence[Sequence[float]]) -> None:
    for t, row in enumerate(rows):
        if len(row) != t + 1:
            raise ValueError(
                f"accuracy matrix row {t} must hold tasks 0..{t} ({t + 1} values), "
                f"got {len(row)}"
            )


def average_accuracy(rows: Sequence[Sequence[float]]) -> float:
    """ACC: mean of the last row of a lower-triangular accuracy matrix."""
    _check_rows(rows)
    if not rows:
        return math.nan
    last = rows[-1]
    return sum(last) / len(last)


def forgetting(
    rows: Sequence[Sequence[float]], current: Sequence[float] | None = None
) -> float:
    """FGT: mean drop from the best earlier accuracy to the final one.

    Parameters
    ----------
    rows : sequence of sequences
        ``rows[t][j]`` = accuracy on task ``j`` after task ``t``.
    current : sequence of float, optional
        Accuracies on tasks ``0..len(rows)`` measured now (mid-task): the
        running forgetting of the tasks already finished, relative to
        ``rows``. Without it, the final row of ``rows`` is the "final" one.

    Returns
    -------
    float
        0 when there is no earlier task.
    """
    _check_rows(rows)
    if current is not None:
        if len(current) != len(rows) + 1:
            raise ValueError(
                f"current accuracies must cover tasks 0..{len(rows)}, "
                f"got {len(current)} values"
            )
        history, final = rows, current
    else:
        if not rows:
            return 0.0
        history, final = rows[:-1], rows[-1]
    if not history:
        return 0.0
    drops = [
        max(history[t][j] for t in range(j, len(history))) - final[j]
        for j in range(len(history))
    ]
    return sum(drops) / len(drops)


class AccuracyMatrix:
    """Rows of per-task accuracies recorded at task boundaries.

    Attributes
    ----------
    rows : list of list of float
        ``rows[t][j]``, ``j <= t``.
    """

    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def record(self, accuracies: Sequence[float]) -> None:
        """Append the row of task ``len(rows)`` (accuracies on tasks 0..t)."""
        t = len(self.rows)
        if len(accuracies) != t + 1:
            raise ValueError(
                f"after task {t} give accuracies of tasks 0..{t}, "
                f"got {len(accuracies)} values"
            )
        self.rows.append([float(a) for a in accuracies])

    @property
    def acc(self) -> float:
        """ACC of the rows so far."""
        return average_accuracy(self.rows)

    @property
    def fgt(self) -> float:
        """FGT of the rows so far."""
        return forgetting(self.rows)

    def frame(self) -> pd.DataFrame:
        """``(T, T)`` table: index ``after-task``, columns ``task-<j>`` (NaN above)."""
        size = len(self.rows)
        data = [row + [math.nan] * (size - len(row)) for row in self.rows]
        frame = pd.DataFrame(data, columns=[f"task-{j}" for j in range(size)])
        frame.index.name = "after-task"
        return frame

    def to_csv(self, path: Path) -> None:
        """Write :meth:`frame` as CSV."""
        self.frame().to_csv(path)
