"""Server plan of the ``gpse`` client kind: continual learning on a task stream.

The run is ``num-tasks`` tasks of ``rounds-per-task`` rounds
(``num-server-rounds`` must equal their product). After every round the global
model is evaluated on the held-out split of every task seen so far: the CSV
row's ``accuracy``/``loss`` are the means over those tasks, ``task-accuracy``
the current task's, ``acc`` the same mean and ``fgt`` the running forgetting
(drop from each finished task's best boundary accuracy to now). At the last
round of each task the per-task accuracies become a row of the accuracy
matrix; ``finish`` writes ``accuracy_matrix.csv`` and adds ``ACC``, ``FGT``
and the matrix to ``summary.json`` (definitions in :mod:`fedlr.continual`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedlr import protocol
from fedlr.continual import (
    AccuracyMatrix,
    ContinualOptions,
    build_continual_model,
    forgetting,
    stream_from_config,
    task_view,
)
from fedlr.errors import ConfigError
from fedlr.image_task import ImageData, evaluate_images
from fedlr.server_apps.plans import ServerPlan, check_strategy, register_plan
from fedlr.strategies.fot import FedAvgContinual
from fedlr.strategies.registry import MethodConfig
from fedlr.train import pick_device

__all__ = ["gpse_plan"]

COLUMNS = ("task", "task-accuracy", "acc", "fgt", "basis-dims", "projected-share")


@register_plan("gpse")
def gpse_plan(method: MethodConfig) -> ServerPlan:
    """Stream, seeded vision model, continual strategy, per-task evaluation."""
    config = method.run
    check_strategy(method.spec, FedAvgContinual)
    strategy_cls: type[FedAvgContinual] = method.spec.strategy  # type: ignore[assignment]
    options = ContinualOptions.of(method.options)
    rounds = options.num_tasks * options.rounds_per_task
    if config.num_server_rounds != rounds:
        raise ConfigError(
            "num-server-rounds",
            f"must equal num-tasks x rounds-per-task = {options.num_tasks} x "
            f"{options.rounds_per_task} = {rounds}, got {config.num_server_rounds}",
        )
    stream = stream_from_config(config, options)
    model = build_continual_model(config)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in initial.items()}
    strategy = strategy_cls.from_run_config(
        config, shapes, model.projected_layers(), method.options
    )
    device = pick_device(config.device)
    heldout: dict[int, ImageData] = {}
    matrix = AccuracyMatrix()

    def heldout_of(task: int) -> ImageData:
        if task not in heldout:
            data = stream.heldout(task)
            cap = config.max_eval_examples
            heldout[task] = data.select(range(min(len(data), cap))) if cap else data
        return heldout[task]

    def evaluate(
        server_round: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, float]:
        model.load_state_dict(dict(state))
        task, position = strategy.task_of(server_round)
        accuracies: list[float] = []
        losses: list[float] = []
        for j in range(task + 1):
            module, view = task_view(
                model, heldout_of(j), stream.task_classes(j), stream.num_classes
            )
            accuracy, loss = evaluate_images(
                module, view, batch_size=config.eval_batch_size, device=device
            )
            accuracies.append(accuracy)
            losses.append(loss)
        model.to("cpu")
        if server_round > 0 and position == options.rounds_per_task - 1:
            matrix.record(accuracies)
        finished = matrix.rows[:task]
        fgt = forgetting(finished, current=accuracies[: len(finished) + 1])
        mean_acc = sum(accuracies) / len(accuracies)
        return {
            "accuracy": mean_acc,
            "loss": sum(losses) / len(losses),
            "task": float(task),
            "task-accuracy": accuracies[-1],
            "acc": mean_acc,
            "fgt": fgt,
        }

    def finish(run_dir: Path) -> dict[str, Any]:
        matrix.to_csv(run_dir / "accuracy_matrix.csv")
        return {
            "ACC": matrix.acc if matrix.rows else math.nan,
            "FGT": matrix.fgt,
            "accuracy-matrix": matrix.rows,
        }

    return ServerPlan(
        strategy=strategy,
        initial_arrays=initial,
        evaluate=evaluate,
        train_config={
            protocol.LR: config.lr,
            protocol.LOCAL_STEPS: config.local_steps,
            protocol.BATCH_SIZE: config.batch_size,
        },
        columns=COLUMNS,
        largest_partition=lambda n: max(
            stream_from_config(config, options, n).split(t)[1].largest_partition
            for t in range(options.num_tasks)
        ),
        needs_evaluation=lambda r: (
            strategy.task_of(r)[1] == options.rounds_per_task - 1
        ),
        description=(
            f"{config.model} on {config.dataset}: {options.num_tasks} tasks x "
            f"{options.rounds_per_task} rounds, device {device}"
        ),
        finish=finish,
        save_state=lambda: {"matrix": [list(row) for row in matrix.rows]},
        load_state=lambda state: setattr(
            matrix, "rows", [list(row) for row in state.get("matrix", [])]
        ),
    )
