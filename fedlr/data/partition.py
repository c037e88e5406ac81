"""Held-out split and client partitions, through ``flwr-datasets`` partitioners.

:func:`split_dataset` first takes a seeded, stratified held-out split (the
server's evaluation set), then partitions the rest among the clients:

- ``iid``: :class:`~flwr_datasets.partitioner.IidPartitioner` on a seeded
  shuffle of the training rows (sizes differ by at most one);
- ``dirichlet``: :class:`~flwr_datasets.partitioner.DirichletPartitioner`; for
  each class, the shares of the partitions are drawn from Dir(α·1), so a
  small ``dirichlet_alpha`` gives a strong label skew (Hsu et al., 2019,
  "Measuring the effects of non-identical data distribution");
- ``pathological``: :class:`~flwr_datasets.partitioner.PathologicalPartitioner`,
  each partition holds rows of exactly ``classes_per_partition`` classes
  (Li et al., 2022, "Federated Learning on Non-IID Data Silos").

Partitioning works on a small ``(row, label)`` index table, never on the
pixels or texts, and keeps integer row indices into the source dataset; a
partition is materialised with ``Dataset.select`` when asked for.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    Partitioner,
    PathologicalPartitioner,
)
from numpy.typing import NDArray
from sklearn.model_selection import train_test_split

from fedlr.errors import FedLRError

__all__ = [
    "CLASS_ASSIGNMENTS",
    "PARTITIONERS",
    "FederatedSplit",
    "PartitionConfig",
    "PartitionIndexError",
    "split_dataset",
]

logger = logging.getLogger("fedlr")

PARTITIONERS = ("iid", "dirichlet", "pathological")
"""Known values of :attr:`PartitionConfig.partitioner`."""

CLASS_ASSIGNMENTS = ("first-deterministic", "deterministic", "random")
"""Known values of :attr:`PartitionConfig.class_assignment` (see flwr-datasets)."""

_MAX_SEED = 2**32 - 1


class PartitionIndexError(FedLRError, IndexError):
    """A partition id outside ``[0, num_partitions)`` was requested.

    Parameters
    ----------
    partition_id : int
        The requested id.
    num_partitions : int
        How many partitions exist.
    """

    def __init__(self, partition_id: int, num_partitions: int) -> None:
        self.partition_id = partition_id
        self.num_partitions = num_partitions
        super().__init__(
            f"partition id {partition_id} is out of range: valid ids are "
            f"0..{num_partitions - 1} ({num_partitions} partitions)"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


@dataclass(frozen=True)
class PartitionConfig:
    """How to split a dataset into a held-out set and client partitions.

    Attributes
    ----------
    partitioner : {"iid", "dirichlet", "pathological"}
    num_partitions : int
        Number of client partitions, >= 1.
    seed : int
        Seed of the held-out split, the partitioner and its shuffles,
        in ``[0, 2**32)``.
    dirichlet_alpha : float
        Dirichlet concentration α > 0 (``dirichlet`` only); smaller is more
        skewed, large α approaches IID.
    classes_per_partition : int
        Classes per partition, >= 1 (``pathological`` only).
    eval_fraction : float
        Fraction of the whole dataset held out for evaluation, in (0, 1).
    min_partition_size : int
        Every partition must get at least this many rows, >= 0. ``dirichlet``
        redraws up to 10 times to meet it; the others fail if they miss it.
    class_assignment : {"first-deterministic", "deterministic", "random"}
        How ``pathological`` assigns classes to partitions (flwr-datasets'
        ``class_assignment_mode``). The default gives partition ``i`` the class
        ``i mod C`` plus seeded random others, so every class is used when
        ``num_partitions >= C``.

    Raises
    ------
    ValueError
        On construction, naming the field and the bad value.
    """

    partitioner: str
    num_partitions: int
    seed: int
    dirichlet_alpha: float = 0.5
    classes_per_partition: int = 2
    eval_fraction: float = 0.2
    min_partition_size: int = 10
    class_assignment: str = "first-deterministic"

    def __post_init__(self) -> None:
        n, seed, alpha = self.num_partitions, self.seed, self.dirichlet_alpha
        classes, fraction = self.classes_per_partition, self.eval_fraction
        size = self.min_partition_size
        for name, valid, must in (  # in field order; the first failure is raised
            ("partitioner", self.partitioner in PARTITIONERS,
             f"one of {', '.join(PARTITIONERS)}"),
            ("num_partitions", _is_int(n) and n >= 1, "an integer >= 1"),
            ("seed", _is_int(seed) and 0 <= seed <= _MAX_SEED,
             "an integer in [0, 2**32)"),
            ("dirichlet_alpha", _is_real(alpha) and alpha > 0, "> 0 and finite"),
            ("classes_per_partition", _is_int(classes) and classes >= 1,
             "an integer >= 1"),
            ("eval_fraction", _is_real(fraction) and 0 < fraction < 1, "in (0, 1)"),
            ("min_partition_size", _is_int(size) and size >= 0, "an integer >= 0"),
            ("class_assignment", self.class_assignment in CLASS_ASSIGNMENTS,
             f"one of {', '.join(CLASS_ASSIGNMENTS)}"),
        ):  # fmt: skip
            if not valid:
                raise ValueError(f"{name} must be {must}, got {getattr(self, name)!r}")


class FederatedSplit:
    """A dataset split into a held-out set and client partitions.

    Build it with :func:`split_dataset`. Every source row is in at most one
    of the held-out set and the partitions (in exactly one, unless a
    ``pathological`` configuration leaves classes unassigned).

    Parameters
    ----------
    dataset : datasets.Dataset
        The source dataset (with a ClassLabel ``label`` column).
    config : PartitionConfig
    heldout_indices : (H,) int array
        Source rows of the held-out set.
    partition_indices : list of (N_p,) int arrays
        Source rows of each partition, in the partitioner's (shuffled) order.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        config: PartitionConfig,
        heldout_indices: NDArray[np.int64],
        partition_indices: list[NDArray[np.int64]],
    ) -> None:
        if len(partition_indices) != config.num_partitions:
            raise ValueError(
                f"got {len(partition_indices)} partitions, config says "
                f"{config.num_partitions}"
            )
        self.dataset = dataset
        self.config = config
        self._heldout = _frozen(heldout_indices)
        self._partitions = [_frozen(p) for p in partition_indices]

    # ------------------------------------------------------------ structure

    @property
    def num_partitions(self) -> int:
        """Number of client partitions."""
        return len(self._partitions)

    @property
    def largest_partition(self) -> int:
        """Rows of the largest partition: the most ``num-examples`` a client has."""
        return max((len(p) for p in self._partitions), default=0)

    @property
    def class_names(self) -> list[str]:
        """Names of the ``label`` classes."""
        return list(self.dataset.features["label"].names)

    @property
    def heldout_indices(self) -> NDArray[np.int64]:
        """Source rows of the held-out set (read-only)."""
        return self._heldout

    def partition_indices(self, partition_id: int) -> NDArray[np.int64]:
        """Source rows of one partition (read-only).

        Parameters
        ----------
        partition_id : int
            In ``[0, num_partitions)``.

        Returns
        -------
        (N_p,) int64 array

        Raises
        ------
        PartitionIndexError
            If ``partition_id`` is out of range.
        """
        if not _is_int(partition_id) or not 0 <= partition_id < self.num_partitions:
            raise PartitionIndexError(partition_id, self.num_partitions)
        return self._partitions[partition_id]

    # ----------------------------------------------------------------- data

    @cached_property
    def heldout(self) -> datasets.Dataset:
        """The held-out (server evaluation) set."""
        return self.dataset.select(self._heldout)

    def partition(self, partition_id: int) -> datasets.Dataset:
        """One client's training partition.

        Parameters
        ----------
        partition_id : int
            In ``[0, num_partitions)``.

        Returns
        -------
        datasets.Dataset
            Same columns as the source dataset.

        Raises
        ------
        PartitionIndexError
            If ``partition_id`` is out of range.
        """
        return self.dataset.select(self.partition_indices(partition_id))

    def client_split(
        self, partition_id: int, eval_fraction: float = 0.2
    ) -> tuple[datasets.Dataset, datasets.Dataset]:
        """Split one partition into the client's own train and eval parts.

        The split is a seeded random permutation (seed ``(config.seed,
        partition_id)``), not stratified: a partition may hold a single row of
        some class.

        Parameters
        ----------
        partition_id : int
            In ``[0, num_partitions)``.
        eval_fraction : float
            Fraction of the partition to hold out, in (0, 1); at least one row
            goes to each side.

        Returns
        -------
        (train, eval) : tuple of datasets.Dataset

        Raises
        ------
        PartitionIndexError
            If ``partition_id`` is out of range.
        ValueError
            If ``eval_fraction`` is not in (0, 1) or the partition has < 2 rows.
        """
        if not _is_real(eval_fraction) or not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        rows = self.partition_indices(partition_id)
        n = len(rows)
        if n < 2:
            raise ValueError(
                f"partition {partition_id} has {n} row(s); need >= 2 to split"
            )
        n_eval = min(n - 1, max(1, round(n * eval_fraction)))
        rng = np.random.default_rng([self.config.seed, partition_id])
        perm = rng.permutation(n)
        eval_rows = rows[perm[:n_eval]]
        train_rows = rows[perm[n_eval:]]
        return self.dataset.select(train_rows), self.dataset.select(eval_rows)

    # ------------------------------------------------------------- reports

    def partition_sizes(self) -> list[int]:
        """Number of rows of each partition."""
        return [len(p) for p in self._partitions]

    @cached_property
    def _labels(self) -> NDArray[np.int64]:
        return _label_array(self.dataset)

    def label_counts(self) -> pd.DataFrame:
        """Rows per class in each partition.

        Returns
        -------
        pandas.DataFrame
            Shape (num_partitions, num_classes); index ``partition`` (0..P-1),
            columns the class names, int64 counts.
        """
        names = self.class_names
        counts = np.stack(
            [
                np.bincount(self._labels[p], minlength=len(names))
                for p in self._partitions
            ]
        ).astype(np.int64)
        frame = pd.DataFrame(counts, columns=names)
        frame.index.name = "partition"
        return frame

    def __repr__(self) -> str:
        c = self.config
        return (
            f"FederatedSplit(partitioner={c.partitioner!r}, "
            f"num_partitions={self.num_partitions}, seed={c.seed}, "
            f"heldout={len(self._heldout)}, sizes={self.partition_sizes()})"
        )


def _frozen(values: NDArray[Any]) -> NDArray[np.int64]:
    out = np.array(values, dtype=np.int64, copy=True)
    out.setflags(write=False)
    return out


def _label_array(ds: datasets.Dataset) -> NDArray[np.int64]:
    # the arrow path is ~100x faster than ds["label"] in datasets 4.x
    column = ds.with_format("arrow")["label"]
    return np.asarray(column.to_numpy(), dtype=np.int64)


def _given_split(ds: datasets.Dataset) -> NDArray[np.bool_] | None:
    """Rows a ``split`` column marks ``test``, if the data set has such rows."""
    if "split" not in ds.column_names:
        return None
    test = np.asarray(ds["split"]) == "test"
    return test if test.any() else None


def _heldout_split(
    labels: NDArray[np.int64],
    cfg: PartitionConfig,
    given: NDArray[np.bool_] | None = None,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Stratified, seeded (train rows, held-out rows).

    Same algorithm as ``Dataset.train_test_split(stratify_by_column="label")``
    (scikit-learn's StratifiedShuffleSplit) without its slow column read.
    A data set whose ``split`` column marks rows ``test`` (the instruction
    sets: whole problems held out) keeps exactly those as the held-out rows,
    whatever ``eval_fraction`` says.
    """
    rows = np.arange(len(labels), dtype=np.int64)
    if given is not None:
        return rows[~given], rows[given]
    try:
        train, heldout = train_test_split(
            rows,
            test_size=cfg.eval_fraction,
            random_state=cfg.seed,
            shuffle=True,
            stratify=labels,
        )
    except ValueError as err:
        raise ValueError(
            f"cannot hold out eval_fraction={cfg.eval_fraction} of {len(labels)} "
            f"rows stratified by label: {err}"
        ) from err
    return np.asarray(train, dtype=np.int64), np.asarray(heldout, dtype=np.int64)


def _make_partitioner(cfg: PartitionConfig) -> Partitioner:
    if cfg.partitioner == "iid":
        return IidPartitioner(num_partitions=cfg.num_partitions)
    if cfg.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions=cfg.num_partitions,
            partition_by="label",
            alpha=float(cfg.dirichlet_alpha),
            min_partition_size=cfg.min_partition_size,
            self_balancing=False,
            shuffle=True,
            seed=cfg.seed,
        )
    return PathologicalPartitioner(
        num_partitions=cfg.num_partitions,
        partition_by="label",
        num_classes_per_partition=cfg.classes_per_partition,
        class_assignment_mode=cfg.class_assignment,  # type: ignore[arg-type]
        shuffle=True,
        seed=cfg.seed,
    )


def _partition_rows(
    train_rows: NDArray[np.int64],
    train_labels: NDArray[np.int64],
    label_feature: datasets.ClassLabel,
    cfg: PartitionConfig,
) -> list[NDArray[np.int64]]:
    """Run the flwr-datasets partitioner on a (row, label) index table."""
    index = datasets.Dataset.from_dict(
        {"row": pa.array(train_rows), "label": pa.array(train_labels)},
        features=datasets.Features(
            {"row": datasets.Value("int64"), "label": label_feature}
        ),
    ).with_format("arrow")
    if cfg.partitioner == "iid":
        index = index.shuffle(seed=cfg.seed)  # IidPartitioner takes contiguous shards
    partitioner = _make_partitioner(cfg)
    partitioner.dataset = index
    with warnings.catch_warnings():
        # flwr-datasets warns on each Dirichlet redraw and on unused classes;
        # both are reported below with fedlr's own wording
        warnings.simplefilter("ignore", UserWarning)
        try:
            return [
                np.asarray(partitioner.load_partition(pid)["row"].to_numpy(), np.int64)
                for pid in range(cfg.num_partitions)
            ]
        except ValueError as err:
            if cfg.partitioner == "dirichlet" and "attempts" in str(err):
                raise ValueError(
                    f"dirichlet partitioning could not give each of the "
                    f"{cfg.num_partitions} partitions min_partition_size="
                    f"{cfg.min_partition_size} of {len(train_rows)} training rows "
                    f"with dirichlet_alpha={cfg.dirichlet_alpha} (seed {cfg.seed}); "
                    "lower min_partition_size or raise dirichlet_alpha "
                    "(run config: min-partition-size, dirichlet-alpha), or use "
                    "fewer partitions or partitioner='iid'"
                ) from err
            raise


def split_dataset(ds: datasets.Dataset, cfg: PartitionConfig) -> FederatedSplit:
    """Hold out a stratified evaluation set, then partition the rest.

    Steps: (1) seeded stratified held-out split of ``eval_fraction`` of the
    rows (or the rows a ``split`` column marks ``test``); (2) the partitioner
    named by ``cfg`` on the remaining rows; (3) every partition checked
    against ``min_partition_size``.

    Parameters
    ----------
    ds : datasets.Dataset
        Any dataset with a :class:`datasets.ClassLabel` column ``label``.
    cfg : PartitionConfig

    Returns
    -------
    FederatedSplit

    Raises
    ------
    TypeError
        If ``ds`` has no ClassLabel ``label`` column.
    ValueError
        If the configuration cannot be met on this dataset (more partitions
        than training rows, more classes per partition than classes, a
        partition below ``min_partition_size``, Dirichlet draws that keep
        failing, a class too small to stratify).
    """
    label_feature = ds.features.get("label")
    if not isinstance(label_feature, datasets.ClassLabel):
        raise TypeError(
            f"split_dataset needs a ClassLabel column 'label', got {label_feature!r}"
        )
    labels = _label_array(ds)
    train_rows, heldout_rows = _heldout_split(labels, cfg, _given_split(ds))
    if cfg.num_partitions > len(train_rows):
        raise ValueError(
            f"num_partitions={cfg.num_partitions} exceeds the {len(train_rows)} "
            "training rows"
        )
    num_classes = int(np.unique(labels[train_rows]).size)
    if cfg.partitioner == "pathological" and cfg.classes_per_partition > num_classes:
        raise ValueError(
            f"classes_per_partition={cfg.classes_per_partition} exceeds the "
            f"{num_classes} classes present"
        )
    parts = _partition_rows(train_rows, labels[train_rows], label_feature, cfg)

    sizes = [len(p) for p in parts]
    if min(sizes) < cfg.min_partition_size:
        smallest = int(np.argmin(sizes))
        raise ValueError(
            f"partition {smallest} has {sizes[smallest]} rows, below "
            f"min_partition_size={cfg.min_partition_size} ({cfg.partitioner}, "
            f"{len(train_rows)} training rows); use fewer partitions or lower "
            "min_partition_size (run config: min-partition-size)"
        )
    unassigned = len(train_rows) - sum(sizes)
    if unassigned:
        logger.warning(
            "%s partitioning left %d of %d training rows unassigned (classes that "
            "no partition was given); with class_assignment='first-deterministic' "
            "and num_partitions >= the number of classes every class is used",
            cfg.partitioner,
            unassigned,
            len(train_rows),
        )
    split = FederatedSplit(ds, cfg, heldout_rows, parts)
    logger.debug("%r", split)
    return split
