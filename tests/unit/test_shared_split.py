"""One split for every task, and a data layer that imports no task.

The text tasks (:mod:`fedlr.tasks.text`), the image task (:mod:`fedlr.tasks.image`)
and the continual streams once each built a run's
:class:`~fedlr.data.PartitionConfig` and cached a split of their own; they now
share :func:`fedlr.data.splits.dataset_split` and
:func:`~fedlr.data.splits.partition_config`. ``RECORDED`` holds SHA-256
digests of the held-out and partition indices made by the code before that
change (the tasks' own ``_split`` functions and the streams' own
``PartitionConfig``), so the shared function must cut every data set exactly
as before: bit for bit, for several data sets, partitioners, seeds and sizes.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fedlr.config.run import RunConfig
from fedlr.data import FederatedSplit, PartitionConfig
from fedlr.data.splits import dataset_split, partition_config
from fedlr.tasks.continual import ContinualOptions, stream_from_config
from fedlr.tasks.image import ImageTask
from fedlr.tasks.text import text_task
from tests.conftest import ROOT
from tests.unit.test_import_cycles import import_graph

RECORDED = {
    ("polarity", "dirichlet", 0, 3, None): "a701137cd7cb9845",
    ("polarity", "dirichlet", 0, 3, 2): "da85421ee82fcb12",
    ("polarity", "iid", 7, 4, None): "023dc9b758b311bf",
    ("polarity", "pathological", 3, 5, 2): "60b2c178e39eb3eb",
    ("digits", "dirichlet", 0, 4, None): "86683e9111c63f18",
    ("digits", "iid", 11, 3, 2): "82ad19c31e27139f",
    ("digits", "pathological", 5, 10, None): "2c7b22ee0ac5b1a6",
}
"""(dataset, partitioner, seed, num-partitions, split(n)) -> digest, old code."""

RECORDED_STREAM = {
    # (stream, seed, num-partitions, task) -> rows digest : split digest
    ("permuted-mnist", 0, 3, 1): "91dea01740f1f599:fe6f64f4e84a2efa",
    ("split-mnist", 4, 5, 0): "64db6742b2842fcc:ec5247f6b89a193a",
}
"""Tasks of ``num-tasks=2``, ``task-examples=2000`` streams, old code."""

TASK_MODULES = (
    "fedlr.tasks.text",
    "fedlr.tasks.image",
    "fedlr.tasks.vera",
    "fedlr.tasks.continual",
)


def digest(split: FederatedSplit) -> str:
    """SHA-256 (16 hex digits) of the held-out rows, then each partition's."""
    h = hashlib.sha256()
    h.update(np.asarray(split.heldout_indices, dtype=np.int64).tobytes())
    for p in range(split.num_partitions):
        h.update(b"|")
        h.update(np.asarray(split.partition_indices(p), dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(("key", "expected"), list(RECORDED.items()))
def test_the_tasks_cut_every_data_set_as_before(key, expected, assets):
    dataset, partitioner, seed, num, asked = key
    config = RunConfig(
        dataset=dataset,
        model="tiny-bert" if dataset == "polarity" else "cnn",
        partitioner=partitioner,
        seed=seed,
        num_partitions=num,
    )
    task = text_task(config) if dataset == "polarity" else ImageTask(config)
    split = task.split(asked)
    assert split.num_partitions == (asked or num)
    assert digest(split) == expected
    # one function, one cache: the task's split is the shared one
    assert split is dataset_split(config, asked)


@pytest.mark.parametrize(("key", "expected"), list(RECORDED_STREAM.items()))
def test_the_streams_cut_every_task_as_before(key, expected):
    stream_name, seed, num, task = key
    config = RunConfig.from_mapping(
        {"dataset": stream_name, "model": "cnn", "seed": seed, "num-partitions": num}
    )
    options = ContinualOptions(num_tasks=2, task_examples=2000)
    rows, split = stream_from_config(config, options, num).split(task)
    rows_digest = hashlib.sha256(rows.tobytes()).hexdigest()[:16]
    assert f"{rows_digest}:{digest(split)}" == expected


def test_partition_config_reads_the_run_and_a_node_count():
    config = RunConfig(
        partitioner="pathological",
        num_partitions=6,
        seed=17,
        dirichlet_alpha=0.3,
        classes_per_partition=1,
        eval_fraction=0.25,
        min_partition_size=2,
    )
    expected = PartitionConfig(
        partitioner="pathological",
        num_partitions=6,
        seed=17,
        dirichlet_alpha=0.3,
        classes_per_partition=1,
        eval_fraction=0.25,
        min_partition_size=2,
    )
    assert partition_config(config) == expected
    assert partition_config(config, 0) == expected  # 0: the run's count
    assert partition_config(config, 4).num_partitions == 4
    stream = stream_from_config(
        config.replace(dataset="permuted-mnist"), ContinualOptions(), 5
    )
    assert stream.partition_config == partition_config(config, 5)


def test_the_data_layer_imports_nothing_that_builds_on_it():
    """No module of ``fedlr.data`` imports a module that imports ``fedlr.data``.

    The data layer is a floor: whatever it imports (``fedlr.errors``, ...) must
    not reach back into it, as ``data/continual.py -> image_task.py ->
    data/partition.py`` did. Checked on the whole import graph, so a new task
    module is covered without a list.
    """
    edges = import_graph(ROOT / "fedlr")
    data = {m for m in edges if m.startswith("fedlr.data.")}
    assert "fedlr.data.continual" in data and "fedlr.data.splits" in data

    def reaches_data(start: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module in data:
                return True
            if module not in seen:
                seen.add(module)
                todo.extend(edges.get(module, ()))
        return False

    upward = {
        (low, high)
        for low in sorted(data)
        for high in edges[low]
        if high not in data and reaches_data(high)
    }
    assert upward == set(), f"the data layer imports modules built on it: {upward}"
    assert not {high for low in data for high in edges[low]} & set(TASK_MODULES)
    # and the property holds for what the tasks do import from it
    assert edges["fedlr.tasks.image"] & data and edges["fedlr.tasks.continual"] & data
