"""Continual metrics (ACC, FGT, accuracy matrix) and the task streams."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlr.data import PartitionConfig
from fedlr.data.continual import STREAMS, ContinualStream, UnknownStreamError
from fedlr.tasks.continual import AccuracyMatrix, average_accuracy, forgetting
from fedlr.tasks.image import to_image_data


# -------------------------------------------------------------------- metrics
def test_acc_and_fgt_on_a_known_matrix():
    m = AccuracyMatrix()
    m.record([0.9])
    m.record([0.7, 0.8])
    m.record([0.6, 0.85, 0.95])
    assert math.isclose(m.acc, (0.6 + 0.85 + 0.95) / 3)
    # task 0: best 0.9 -> 0.6 (0.3); task 1: best 0.8 -> 0.85 (-0.05)
    assert math.isclose(m.fgt, (0.3 - 0.05) / 2)
    frame = m.frame()
    assert frame.shape == (3, 3) and math.isnan(frame.iloc[0, 1])
    assert frame.loc[2, "task-1"] == 0.85


def test_running_forgetting_uses_current_accuracies():
    rows = [[0.9], [0.7, 0.8]]
    assert math.isclose(forgetting(rows, current=[0.5, 0.4, 0.1]), (0.4 + 0.4) / 2)
    assert forgetting([], current=[0.3]) == 0.0
    with pytest.raises(ValueError, match=r"tasks 0\.\.2"):
        forgetting(rows, current=[0.1])


def test_single_task_has_no_forgetting_and_bad_rows_raise():
    assert forgetting([[0.7]]) == 0.0
    assert average_accuracy([[0.7]]) == 0.7
    with pytest.raises(ValueError, match="row 1"):
        average_accuracy([[0.5], [0.1]])
    m = AccuracyMatrix()
    with pytest.raises(ValueError, match=r"tasks 0\.\.0"):
        m.record([0.1, 0.2])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 1000))
def test_fgt_against_dense_definition(tasks, seed):
    rng = np.random.default_rng(seed)
    full = rng.random((tasks, tasks))
    rows = [list(full[t, : t + 1]) for t in range(tasks)]
    expect = (
        np.mean([full[j:-1, j].max() - full[-1, j] for j in range(tasks - 1)])
        if tasks > 1
        else 0.0
    )
    assert math.isclose(forgetting(rows), float(expect), abs_tol=1e-12)
    assert math.isclose(average_accuracy(rows), float(full[-1].mean()))
    # no forgetting when accuracies never drop
    monotone = [[max(full[: t + 1, j]) for j in range(t + 1)] for t in range(tasks)]
    assert forgetting(monotone) <= 0.0 + 1e-12


# -------------------------------------------------------------------- streams
@pytest.fixture(scope="module")
def mnist_asset():
    from fedlr.data.assets import ensure_assets

    ensure_assets(["mnist"])


def _stream(name, tasks, **kw):
    cfg = PartitionConfig("dirichlet", num_partitions=2, seed=5, dirichlet_alpha=0.5)
    return ContinualStream(name, num_tasks=tasks, partition=cfg, **kw)


def test_permuted_mnist_tasks(mnist_asset):
    s = _stream("permuted-mnist", 3, examples_per_task=600)
    assert s.permutation(0) is None
    p1, p2 = s.permutation(1), s.permutation(2)
    assert p1 is not None and p2 is not None
    assert sorted(p1.tolist()) == list(range(784))
    assert not torch.equal(p1, p2)
    assert torch.equal(p1, _stream("permuted-mnist", 3).permutation(1))  # seeded
    assert s.task_classes(1) == tuple(range(10))
    rows0, split0 = s.split(0)
    rows1, _ = s.split(1)
    assert len(rows0) == len(rows1) == 600
    # the task's own rows, permuted by π_1: undo it and compare to the source
    x1 = s.partition(1, 0)
    rows_p = rows1[s.split(1)[1].partition_indices(0)]
    from fedlr.data.continual import _base_arrays

    images, labels = _base_arrays("mnist")
    raw = to_image_data(images[rows_p], labels[rows_p], "mnist").x
    raw = raw.reshape(len(rows_p), -1)
    unpermuted = torch.empty_like(raw)
    unpermuted[:, p1] = x1.x.reshape(len(x1), -1)
    torch.testing.assert_close(unpermuted, raw)
    assert torch.equal(x1.y, torch.from_numpy(labels[rows_p]))
    # held-out and partitions are disjoint and cover the task's rows
    parts = [set(split0.partition_indices(i).tolist()) for i in range(2)]
    held = set(split0.heldout_indices.tolist())
    assert not (parts[0] & parts[1]) and not (held & (parts[0] | parts[1]))
    assert len(held | parts[0] | parts[1]) == 600
    assert s.heldout(0).x.shape[1:] == (1, 28, 28)
    assert math.isclose(float(s.heldout(0).x.min()), -0.1307 / 0.3081, rel_tol=1e-5)


def test_split_mnist_tasks_hold_their_class_pairs(mnist_asset):
    s = _stream("split-mnist", 3, examples_per_task=400)
    for t in range(3):
        assert s.task_classes(t) == (2 * t, 2 * t + 1)
        labels = set(s.partition(t, 1).y.tolist()) | set(s.heldout(t).y.tolist())
        assert labels == {2 * t, 2 * t + 1}
        assert s.permutation(t) is None


def test_stream_errors():
    cfg = PartitionConfig("iid", num_partitions=2, seed=0)
    with pytest.raises(UnknownStreamError, match="permuted-mnist"):
        ContinualStream("nope", num_tasks=2, partition=cfg)
    with pytest.raises(ValueError, match="num_tasks=6"):
        ContinualStream("split-mnist", num_tasks=6, partition=cfg)
    with pytest.raises(IndexError):
        ContinualStream("split-mnist", num_tasks=2, partition=cfg).task_classes(2)
    assert STREAMS["split-cifar100"].classes_per_task == 10
    assert ContinualStream("split-cifar100", num_tasks=10, partition=cfg).task_classes(
        9
    ) == tuple(range(90, 100))
