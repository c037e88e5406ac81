"""A run's federated split of a registered data set, cached per process.

The server and every client must cut a data set the same way: the same
held-out rows and the same partitions. :func:`dataset_split` is the one place
that turns a run's settings into that split (the text and image tasks call
it), and :func:`partition_config` the one place that reads a run's
partitioning keys (the continual streams use it for each task's split).
Splits are cached per process (a Ray actor serves many clients), keyed by the
data set and the :class:`~fedlr.data.partition.PartitionConfig`.

The settings are read by attribute (:class:`SplitSettings`), so the data
layer needs nothing from the run config's module: a
:class:`~fedlr.config.run.RunConfig` is one.
"""

from __future__ import annotations

import functools
from typing import Protocol

from fedlr.data.partition import FederatedSplit, PartitionConfig, split_dataset
from fedlr.data.registry import load_dataset

__all__ = ["SplitSettings", "dataset_split", "partition_config"]


class SplitSettings(Protocol):
    """The run-config keys that decide a split (read-only attributes)."""

    @property
    def dataset(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def partitioner(self) -> str: ...

    @property
    def num_partitions(self) -> int: ...

    @property
    def dirichlet_alpha(self) -> float: ...

    @property
    def classes_per_partition(self) -> int: ...

    @property
    def eval_fraction(self) -> float: ...

    @property
    def min_partition_size(self) -> int: ...


def partition_config(
    settings: SplitSettings, num_partitions: int | None = None
) -> PartitionConfig:
    """The run's partitioning, for ``num_partitions`` clients (default: the run's).

    Parameters
    ----------
    settings : SplitSettings
        ``partitioner``, ``num-partitions``, ``seed``, ``dirichlet-alpha``,
        ``classes-per-partition``, ``eval-fraction``, ``min-partition-size``.
    num_partitions : int, optional
        A node's own count (its ``num-partitions`` node config); ``None`` or 0
        means ``settings.num_partitions``.

    Raises
    ------
    ValueError
        From :class:`PartitionConfig`, naming the field and the bad value.
    """
    return PartitionConfig(
        partitioner=settings.partitioner,
        num_partitions=num_partitions or settings.num_partitions,
        seed=settings.seed,
        dirichlet_alpha=settings.dirichlet_alpha,
        classes_per_partition=settings.classes_per_partition,
        eval_fraction=settings.eval_fraction,
        min_partition_size=settings.min_partition_size,
    )


@functools.lru_cache(maxsize=8)
def _split(dataset: str, config: PartitionConfig) -> FederatedSplit:
    return split_dataset(load_dataset(dataset, seed=config.seed), config)


def dataset_split(
    settings: SplitSettings, num_partitions: int | None = None
) -> FederatedSplit:
    """Held-out split and client partitions of ``settings.dataset`` (cached).

    The data set is loaded in the order of ``load_dataset(dataset, seed=seed)``
    and cut by :func:`~fedlr.data.partition.split_dataset` with
    :func:`partition_config` ``(settings, num_partitions)``.

    Raises
    ------
    UnknownDatasetError
        If ``settings.dataset`` is not registered.
    ValueError
        If the partitioning cannot be met on the data set.
    """
    return _split(settings.dataset, partition_config(settings, num_partitions))
