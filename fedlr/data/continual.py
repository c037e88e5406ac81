"""Continual task streams: a sequence of tasks, each split among the clients.

==================  ======  ==========  ==========================================
stream              base    max tasks   task ``t``
==================  ======  ==========  ==========================================
``permuted-mnist``  mnist   unbounded   every class; pixels permuted by a fixed
                                        seeded permutation ``π_t`` (task 0 is the
                                        identity, i.e. plain MNIST)
``split-mnist``     mnist   5           classes ``(2t, 2t+1)``
``split-cifar100``  cifar100 10         classes ``10t .. 10t+9`` (online, hub)
==================  ======  ==========  ==========================================

Each task has its own rows (for ``permuted-mnist`` a seeded sample of the base
set, or all of it; for the split streams the rows of its classes, optionally
capped), its own held-out split and its own client partitions, made by
:func:`~fedlr.data.partition.split_dataset` with the run's partitioner
(Dirichlet by default) and seed ``seed + t``. Labels keep their global ids;
:meth:`ContinualStream.task_classes` says which logits a task uses (split
streams are task-incremental: a shared head whose logits are restricted to the
task's classes; permuted MNIST uses all ten). Images are returned as
:class:`~fedlr.data.images.ImageData`, normalised like the base set
(:data:`~fedlr.data.images.NORMALISATION`); the permutation is applied after
normalisation (one channel, so the two commute).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import datasets
import numpy as np
import torch
from numpy.typing import NDArray

from fedlr.data.images import ImageData, pixel_arrays, to_image_data
from fedlr.data.partition import FederatedSplit, PartitionConfig, split_dataset
from fedlr.data.registry import load_dataset
from fedlr.errors import FedLRError

__all__ = ["STREAMS", "ContinualStream", "StreamSpec", "UnknownStreamError"]


class UnknownStreamError(FedLRError, KeyError, ValueError):
    """The requested continual stream is not known."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"unknown continual stream '{name}'; known streams: "
            f"{', '.join(sorted(STREAMS))}"
        )

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence.
        return str(self.args[0])


@dataclass(frozen=True)
class StreamSpec:
    """A continual stream.

    Attributes
    ----------
    name : str
    base : str
        Dataset registry name of the source images.
    num_classes : int
        Classes of the base set (the model's output size).
    classes_per_task : int
        0 for a permuted stream (every task has every class).
    max_tasks : int
        0 for unbounded (permutations).
    in_shape : (C, H, W)
    """

    name: str
    base: str
    num_classes: int
    classes_per_task: int
    max_tasks: int
    in_shape: tuple[int, int, int]

    @property
    def permuted(self) -> bool:
        """Whether tasks differ by a pixel permutation (not by classes)."""
        return self.classes_per_task == 0


STREAMS: dict[str, StreamSpec] = {
    s.name: s
    for s in (
        StreamSpec("permuted-mnist", "mnist", 10, 0, 0, (1, 28, 28)),
        StreamSpec("split-mnist", "mnist", 10, 2, 5, (1, 28, 28)),
        StreamSpec("split-cifar100", "cifar100", 100, 10, 10, (3, 32, 32)),
    )
}


@functools.cache
def _base_arrays(name: str) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """The base set's pixels ``(N, H, W[, 3])`` and labels, in source order
    (tasks select their rows with their own seeds)."""
    return pixel_arrays(load_dataset(name, seed=None))


class ContinualStream:
    """A seeded sequence of tasks with per-task held-out splits and partitions.

    Parameters
    ----------
    name : str
        A key of :data:`STREAMS`.
    num_tasks : int
        ``T`` >= 1 (at most the stream's ``max_tasks`` when bounded).
    partition : PartitionConfig
        Partitioner, number of partitions, eval fraction; its seed is the
        stream's seed (task ``t`` partitions with ``seed + t``).
    examples_per_task : int, default 0
        Cap on each task's rows before the held-out split (0: all rows).

    Raises
    ------
    UnknownStreamError
        If ``name`` is not a stream.
    ValueError
        If ``num_tasks`` is out of range.
    """

    def __init__(
        self,
        name: str,
        *,
        num_tasks: int,
        partition: PartitionConfig,
        examples_per_task: int = 0,
    ) -> None:
        if name not in STREAMS:
            raise UnknownStreamError(name)
        self.spec = STREAMS[name]
        if num_tasks < 1 or (self.spec.max_tasks and num_tasks > self.spec.max_tasks):
            bound = self.spec.max_tasks or "any number of"
            raise ValueError(
                f"stream '{name}' has {bound} tasks; num_tasks={num_tasks} "
                "is out of range"
            )
        if examples_per_task < 0:
            raise ValueError(f"examples_per_task must be >= 0, got {examples_per_task}")
        self.num_tasks = num_tasks
        self.partition_config = partition
        self.seed = partition.seed
        self.examples_per_task = examples_per_task
        self._splits: dict[int, tuple[NDArray[np.int64], FederatedSplit]] = {}

    # ------------------------------------------------------------- structure
    @property
    def num_classes(self) -> int:
        """Output size of the model."""
        return self.spec.num_classes

    @property
    def in_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the inputs."""
        return self.spec.in_shape

    def _check_task(self, task: int) -> None:
        if not 0 <= task < self.num_tasks:
            raise IndexError(f"task {task} is outside [0, {self.num_tasks})")

    def task_classes(self, task: int) -> tuple[int, ...]:
        """Global class ids of task ``task`` (the logits it uses)."""
        self._check_task(task)
        per = self.spec.classes_per_task
        if per == 0:
            return tuple(range(self.spec.num_classes))
        return tuple(range(per * task, per * (task + 1)))

    def permutation(self, task: int) -> torch.Tensor | None:
        """``π_t`` over the flattened ``C*H*W`` pixels, None for the identity."""
        self._check_task(task)
        if not self.spec.permuted or task == 0:
            return None
        size = int(np.prod(self.spec.in_shape))
        rng = np.random.default_rng([self.seed, task])
        return torch.from_numpy(rng.permutation(size).astype(np.int64))

    # ------------------------------------------------------------------ data
    def _task_rows(self, task: int) -> NDArray[np.int64]:
        _, labels = _base_arrays(self.spec.base)
        if self.spec.permuted:
            rows = np.arange(len(labels), dtype=np.int64)
        else:
            rows = np.flatnonzero(np.isin(labels, self.task_classes(task)))
        cap = self.examples_per_task
        if cap and len(rows) > cap:
            rng = np.random.default_rng([self.seed, task, 1])
            rows = np.sort(rng.choice(rows, size=cap, replace=False))
        return rows.astype(np.int64)

    def split(self, task: int) -> tuple[NDArray[np.int64], FederatedSplit]:
        """``(rows, split)``: the task's base rows and its federated split.

        The split's indices refer to positions in ``rows``.
        """
        self._check_task(task)
        if task not in self._splits:
            rows = self._task_rows(task)
            _, labels = _base_arrays(self.spec.base)
            names = [str(i) for i in range(self.spec.num_classes)]
            table = datasets.Dataset.from_dict(
                {"label": labels[rows]},
                features=datasets.Features({"label": datasets.ClassLabel(names=names)}),
            )
            cfg = replace(self.partition_config, seed=self.seed + task)
            self._splits[task] = (rows, split_dataset(table, cfg))
        return self._splits[task]

    def _tensors(self, task: int, rows: NDArray[np.int64]) -> ImageData:
        images, labels = _base_arrays(self.spec.base)
        data = to_image_data(images[rows], labels[rows], self.spec.base)
        perm = self.permutation(task)
        if perm is None:
            return data
        n = len(data)
        x = data.x.reshape(n, -1)[:, perm].reshape(n, *self.spec.in_shape)
        return ImageData(x, data.y)

    def heldout(self, task: int) -> ImageData:
        """The task's held-out (server evaluation) split."""
        rows, split = self.split(task)
        return self._tensors(task, rows[split.heldout_indices])

    def partition(self, task: int, partition_id: int) -> ImageData:
        """One client's training data of task ``task``."""
        rows, split = self.split(task)
        return self._tensors(task, rows[split.partition_indices(partition_id)])
