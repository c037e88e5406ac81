"""The server plans that evaluate on the held-out split share one builder.

The ``lora``, ``vera``/``sorf-vera`` and ``qrmix`` plans each once built their
:class:`~fedlr.server_apps.plans.ServerPlan` by hand (train ConfigRecord,
largest partition, description); they now go through
:func:`~fedlr.server_apps.plans.heldout_plan`. ``RECORDED`` holds what the
hand-built plans gave before that change (descriptions and the largest
partition for 2, 3 and 5 clients), so the builder must give the same.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedlr.server_apps.builtin_plans import build_plan
from fedlr.server_apps.plans import base_train_config
from fedlr.strategies.registry import resolve
from fedlr.tasks.image import ImageTask
from fedlr.tasks.text import text_task
from fedlr.wire import protocol
from tests.conftest import tiny_run_config

VISION = {"model": "cnn", "dataset": "digits", "num-partitions": 3, "seed": 3}
PERSONAL = "; personalised: each client evaluates on its own held-out part"
RECORDED: dict[str, tuple[dict[str, Any], str, list[int]]] = {
    # method: (overrides, description, largest partition for 2, 3, 5 clients)
    "fedavg-lora": (
        {},
        "tiny-bert on polarity, 128 held-out examples, device cpu",
        [2140, 2438, 1168],
    ),
    "fedsa-lora": (
        {},
        "tiny-bert on polarity, 128 held-out examples, device cpu" + PERSONAL,
        [2140, 2438, 1168],
    ),
    "fedavg-vera": (
        {"vera-rank": 8, "vera-lr": 0.05},
        "tiny-bert on polarity, 128 held-out examples, device cpu, rank 8, "
        "projection seed 0",
        [2140, 2438, 1168],
    ),
    "qrmix": (
        {**VISION, "warmup-rounds": 1, "qrmix-k": 4},
        "cnn on digits (86282 parameters), 360 held-out examples, device cpu",
        [735, 623, 449],
    ),
}


@pytest.mark.parametrize("method", sorted(RECORDED))
def test_heldout_plans_are_built_as_before(method, tmp_path, assets):
    overrides, description, largest = RECORDED[method]
    if "dataset" in overrides:
        raw = {"method": method, "device": "cpu", "output-dir": str(tmp_path)}
        raw.update(overrides)
    else:
        raw = tiny_run_config(tmp_path, method=method, **overrides)
    config = resolve(raw)
    plan = build_plan(config)
    assert plan.description == description
    assert [plan.largest_partition(n) for n in (2, 3, 5)] == largest
    # the builder's partitions are the task's (the split clients train on)
    run = config.run
    task = ImageTask(run) if "dataset" in overrides else text_task(run)
    assert plan.largest_partition(4) == task.split(4).largest_partition
    lr = overrides.get("vera-lr", run.lr)
    assert plan.train_config == {
        protocol.LR: lr,
        protocol.LOCAL_STEPS: run.local_steps,
        protocol.BATCH_SIZE: run.batch_size,
    }
    assert plan.train_config == base_train_config(run, lr)
