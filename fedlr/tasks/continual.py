"""Continual learning: the accuracy matrix, ACC and FGT; task views; GPSE sketches.

After finishing task ``t`` (of ``T``) the global model is evaluated on the
held-out split of every task ``j <= t``, giving row ``t`` of the lower
triangular accuracy matrix ``a[t, j]``. Following GPM [1]_ and FOT [2]_:

* ``ACC = (1/T) Σ_j a[T-1, j]``, the mean final accuracy over all tasks;
* ``FGT = (1/(T-1)) Σ_{j < T-1} (max_{j <= t < T-1} a[t, j] - a[T-1, j])``,
  the mean drop from the best accuracy a task had at an earlier task boundary
  to its final accuracy (Chaudhry et al.'s forgetting measure; the last task
  cannot be forgotten yet and is left out). FGT is 0 for a single task.

:class:`TaskLogits` restricts a shared head to a task's classes
(task-incremental evaluation and training of the split streams), and
:func:`sketch_layer_inputs` is the client side of GPSE: it feeds local data
through the model and sketches each projected layer's residual input
activations (:class:`fedlr.linalg.fot.ResidualSketch`).

References
----------
.. [1] Saha, Garg, Roy, "Gradient Projection Memory for Continual Learning",
   ICLR 2021.
.. [2] Bakman et al., "Federated Orthogonal Training", ICLR 2024.
.. [3] Chaudhry et al., "Riemannian Walk for Incremental Learning", ECCV 2018.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from fedlr.config.run import RunConfig
from fedlr.data.continual import STREAMS, ContinualStream
from fedlr.data.images import ImageData
from fedlr.data.splits import partition_config
from fedlr.errors import ConfigError, ShapeMismatchError
from fedlr.linalg.fot import ResidualSketch, conv_activations, dense_activations
from fedlr.models.vision import VisionModel, build_vision_model, vision_models
from fedlr.options import option, require_nonnegative, require_positive
from fedlr.tasks.image import VisionOptions

__all__ = [
    "AccuracyMatrix",
    "ContinualOptions",
    "TaskLogits",
    "average_accuracy",
    "build_continual_model",
    "forgetting",
    "sketch_layer_inputs",
    "stream_from_config",
    "task_view",
]


@dataclass(frozen=True)
class ContinualOptions(VisionOptions):
    """Run-config keys of the ``gpse`` payload kind: the task stream and sketches."""

    num_tasks: int = option(
        3,
        "tasks of the stream (≥ 1; at most 5 for `split-mnist`, 10 for "
        "`split-cifar100`)",
        bad=[(0, "must be >= 1")],
    )
    rounds_per_task: int = option(
        5,
        "rounds per task (≥ 1); `lr` restarts at each task (`lr · lr-decay^j` "
        "in round j of a task)",
        bad=[(0, "must be >= 1")],
    )
    task_examples: int = option(
        0,
        "rows per task before the held-out split (`0`: all); ≥ 0",
        bad=[(-1, "must be >= 0")],
    )
    fot_activation_examples: int = option(
        125,
        "local examples of the finished task each client sketches; ≥ 1",
        bad=[(0, "must be >= 1")],
    )

    def check(self) -> None:
        super().check()
        require_positive(
            self, "num_tasks", "rounds_per_task", "fot_activation_examples"
        )
        require_nonnegative(self, "task_examples")


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


class TaskLogits(nn.Module):
    """A model whose logits are restricted to a task's classes.

    Parameters
    ----------
    model : nn.Module
        Maps (N, C, H, W) to (N, K) logits over every class.
    classes : sequence of int
        The task's global class ids; output column ``i`` is class
        ``classes[i]``.
    """

    classes: torch.Tensor

    def __init__(self, model: nn.Module, classes: Sequence[int]) -> None:
        super().__init__()
        self.model = model
        self.register_buffer(
            "classes", torch.tensor(list(classes), dtype=torch.long), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, len(classes))."""
        logits: torch.Tensor = self.model(x)
        return logits.index_select(1, self.classes)


def task_view(
    model: nn.Module, data: ImageData, classes: Sequence[int], num_classes: int
) -> tuple[nn.Module, ImageData]:
    """The model and data as a task sees them.

    When ``classes`` is every class (permuted streams) both are returned
    unchanged; otherwise the model's logits are restricted to ``classes``
    (:class:`TaskLogits`) and labels renumbered to positions in ``classes``.

    Raises
    ------
    ValueError
        If ``data`` holds a label outside ``classes``.
    """
    if tuple(classes) == tuple(range(num_classes)):
        return model, data
    lookup = torch.full((num_classes,), -1, dtype=torch.long)
    lookup[torch.tensor(list(classes), dtype=torch.long)] = torch.arange(len(classes))
    local = lookup[data.y]
    if bool((local < 0).any()):
        raise ValueError(f"data holds labels outside the task's classes {classes}")
    return TaskLogits(model, classes), ImageData(data.x, local)


def layer_activations(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The ``(d, n)`` activation matrix of a conv or linear layer's input ``x``.

    Raises
    ------
    TypeError
        For other layer types or non-numeric conv padding.
    """
    if isinstance(module, nn.Conv2d):
        if isinstance(module.padding, str):
            raise TypeError(
                f"conv padding '{module.padding}' is not supported; use integers"
            )
        return conv_activations(
            x,
            module.kernel_size,
            stride=module.stride,
            padding=module.padding,
            dilation=module.dilation,
        )
    if isinstance(module, nn.Linear):
        return dense_activations(x)
    raise TypeError(f"cannot project a {type(module).__name__}; conv2d or linear only")


@torch.no_grad()
def sketch_layer_inputs(
    model: nn.Module,
    layers: Sequence[str],
    data: ImageData,
    bases: Mapping[str, torch.Tensor],
    *,
    sketch_dim: int,
    seed: int,
    batch_size: int = 64,
) -> dict[str, ResidualSketch]:
    """GPSE on a client: sketch each layer's residual input activations.

    The model runs in eval mode over ``data``; a forward pre-hook on each
    named layer turns its input into activation columns (conv patches or
    dense features), residualises them against ``bases[name]`` (if present)
    and adds ``R G`` to that layer's sketch. ``G`` is drawn from a generator
    seeded by ``(seed, layer index)`` and never leaves the client.

    Parameters
    ----------
    model : nn.Module
    layers : sequence of str
        Names of ``nn.Conv2d`` / ``nn.Linear`` submodules.
    data : ImageData
    bases : mapping of str to (d, k) tensor
        Current bases; a missing layer has none yet.
    sketch_dim : int
        Sketch columns ``m``; 0 means the layer's ``d``.
    seed : int
    batch_size : int

    Returns
    -------
    dict of str to ResidualSketch
        With ``sketch`` of shape (d, m), ``fraction`` = r_l.
    """
    modules = {name: model.get_submodule(name) for name in layers}
    sketches: dict[str, ResidualSketch] = {}
    handles = []
    for index, (name, module) in enumerate(modules.items()):
        if not isinstance(module, nn.Conv2d | nn.Linear):
            raise TypeError(f"layer '{name}' is a {type(module).__name__}")
        d = int(module.weight[0].numel())
        basis = bases.get(name)
        if basis is not None and (basis.dim() != 2 or basis.shape[0] != d):
            raise ShapeMismatchError(
                f"basis of '{name}' has shape {tuple(basis.shape)}, expected ({d}, k)"
            )
        sketches[name] = ResidualSketch(
            basis=None if basis is None else basis.to(torch.float64),
            num_columns=sketch_dim or d,
            generator=torch.Generator().manual_seed(seed * 7_919 + index),
        )

        def hook(
            mod: nn.Module, inputs: tuple[torch.Tensor, ...], name: str = name
        ) -> None:
            sketches[name].add(layer_activations(mod, inputs[0]))

        handles.append(module.register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(data), batch_size):
            model(data.x[start : start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return sketches


def stream_from_config(
    config: RunConfig, options: ContinualOptions, num_partitions: int | None = None
) -> ContinualStream:
    """The task stream named by ``dataset`` with the run's partitioning.

    Raises
    ------
    ConfigError
        If ``dataset`` is not a stream or ``num-tasks`` does not fit it.
    """
    if config.dataset not in STREAMS:
        raise ConfigError(
            "dataset",
            f"'{config.dataset}' is not a continual stream; continual methods need "
            f"one of ({', '.join(sorted(STREAMS))})",
        )
    spec = STREAMS[config.dataset]
    if spec.max_tasks and options.num_tasks > spec.max_tasks:
        raise ConfigError(
            "num-tasks",
            f"{options.num_tasks} exceeds the {spec.max_tasks} tasks of '{spec.name}'",
        )
    return ContinualStream(
        config.dataset,
        num_tasks=options.num_tasks,
        partition=partition_config(config, num_partitions),
        examples_per_task=options.task_examples,
    )


def build_continual_model(config: RunConfig) -> VisionModel:
    """The seeded vision model named by ``model`` for the stream's inputs.

    Raises
    ------
    ConfigError
        If ``model`` is not a vision model or ``dataset`` not a stream.
    """
    if config.model not in vision_models():
        raise ConfigError(
            "model",
            f"'{config.model}' is not a vision model; continual methods need one "
            f"of ({', '.join(vision_models())})",
        )
    if config.dataset not in STREAMS:
        # raises the ConfigError naming the streams
        stream_from_config(config, ContinualOptions())
    spec = STREAMS[config.dataset]
    return build_vision_model(
        config.model, spec.in_shape, spec.num_classes, config.seed
    )
