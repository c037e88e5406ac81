"""Server plan of the ``gpse`` client kind: continual learning on a task stream.

The run is ``num-tasks`` tasks of ``rounds-per-task`` rounds
(``num-server-rounds`` must equal their product). After every round the global
model is evaluated on the held-out split of every task seen so far: the CSV
row's ``accuracy``/``loss`` are the means over those tasks, ``task-accuracy``
the current task's, ``acc`` the same mean and ``fgt`` the running forgetting
(drop from each finished task's best boundary accuracy to now). At the last
round of each task the per-task accuracies become a row of the accuracy
matrix; ``finish`` writes ``accuracy_matrix.csv`` and adds ``ACC``, ``FGT``
and the matrix to ``summary.json`` (definitions in :mod:`fedlr.tasks.continual`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedlr.client.train import pick_device
from fedlr.config.run import RunConfig
from fedlr.data.continual import ContinualStream
from fedlr.data.images import ImageData
from fedlr.errors import ConfigError
from fedlr.models.vision import VisionModel
from fedlr.server_apps.plans import (
    ServerPlan,
    base_train_config,
    check_strategy,
    register_plan,
)
from fedlr.strategies.fot import FedAvgContinual
from fedlr.strategies.registry import MethodConfig
from fedlr.tasks.continual import (
    AccuracyMatrix,
    ContinualOptions,
    build_continual_model,
    forgetting,
    stream_from_config,
    task_view,
)
from fedlr.tasks.image import evaluate_images

__all__ = ["gpse_plan"]

COLUMNS = ("task", "task-accuracy", "acc", "fgt", "basis-dims", "projected-share")


@register_plan("gpse")
def gpse_plan(method: MethodConfig) -> ServerPlan:
    """Stream, seeded vision model, continual strategy, per-task evaluation."""
    config = method.run
    strategy_cls = check_strategy(method.spec, FedAvgContinual)
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
    evaluation = _TaskEvaluation(config, options, stream, model, strategy)
    return ServerPlan(
        strategy=strategy,
        initial_arrays=initial,
        evaluate=evaluation,
        train_config=base_train_config(config),
        columns=COLUMNS,
        largest_partition=lambda n: max(
            stream_from_config(config, options, n).split(t)[1].largest_partition
            for t in range(options.num_tasks)
        ),
        needs_evaluation=evaluation.at_boundary,
        description=(
            f"{config.model} on {config.dataset}: {options.num_tasks} tasks x "
            f"{options.rounds_per_task} rounds, device {evaluation.device}"
        ),
        finish=evaluation.finish,
        save_state=evaluation.save_state,
        load_state=evaluation.load_state,
    )


class _TaskEvaluation:
    """The global model on every task seen so far, and the run's accuracy matrix.

    Called with ``(server_round, state)`` it gives the round's metrics (the
    module docstring); at a task's last round it records the matrix row.
    The matrix is the plan's state (saved with a checkpoint).
    """

    def __init__(
        self,
        config: RunConfig,
        options: ContinualOptions,
        stream: ContinualStream,
        model: VisionModel,
        strategy: FedAvgContinual,
    ) -> None:
        self.config, self.options, self.stream = config, options, stream
        self.model, self.strategy = model, strategy
        self.device = pick_device(config.device)
        self.matrix = AccuracyMatrix()
        self._heldout: dict[int, ImageData] = {}

    def heldout(self, task: int) -> ImageData:
        """Task ``task``'s held-out split, at most ``max-eval-examples`` (cached)."""
        if task not in self._heldout:
            data = self.stream.heldout(task)
            cap = self.config.max_eval_examples
            self._heldout[task] = (
                data.select(range(min(len(data), cap))) if cap else data
            )
        return self._heldout[task]

    def at_boundary(self, server_round: int) -> bool:
        """Whether ``server_round`` is its task's last round."""
        position = self.strategy.task_of(server_round)[1]
        return position == self.options.rounds_per_task - 1

    def __call__(
        self, server_round: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, float]:
        self.model.load_state_dict(dict(state))
        task = self.strategy.task_of(server_round)[0]
        accuracies: list[float] = []
        losses: list[float] = []
        for j in range(task + 1):
            module, view = task_view(
                self.model,
                self.heldout(j),
                self.stream.task_classes(j),
                self.stream.num_classes,
            )
            accuracy, loss = evaluate_images(
                module, view, batch_size=self.config.eval_batch_size, device=self.device
            )
            accuracies.append(accuracy)
            losses.append(loss)
        self.model.to("cpu")
        if server_round > 0 and self.at_boundary(server_round):
            self.matrix.record(accuracies)
        finished = self.matrix.rows[:task]
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

    def finish(self, run_dir: Path) -> dict[str, Any]:
        """Write ``accuracy_matrix.csv``; the summary's ``ACC``, ``FGT`` and matrix."""
        matrix = self.matrix
        matrix.to_csv(run_dir / "accuracy_matrix.csv")
        return {
            "ACC": matrix.acc if matrix.rows else math.nan,
            "FGT": matrix.fgt,
            "accuracy-matrix": matrix.rows,
        }

    def save_state(self) -> dict[str, Any]:
        """The accuracy matrix, for a checkpoint."""
        return {"matrix": [list(row) for row in self.matrix.rows]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """The accuracy matrix of a resumed run."""
        self.matrix.rows = [list(row) for row in state.get("matrix", [])]
