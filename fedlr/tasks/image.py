"""Image classification: data as tensors, a vision model, local SGD, evaluation.

The image counterpart of :mod:`fedlr.tasks.text`: the server and every client build
the same seeded model, the same held-out split and the same partitions
(through :func:`fedlr.data.splits.dataset_split`, as the text tasks), cached
per process. The training and evaluation functions take a plain tensor pair
(:class:`~fedlr.data.images.ImageData`, re-exported here with
:func:`~fedlr.data.images.to_image_data` and :data:`NORMALISATION`), so any
source of ``(x, y)`` tensors (a continual task stream, a permuted copy) goes
through the same loops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from fedlr.client.train import LoopControl, TrainSettings, in_batches, train_steps
from fedlr.config.run import RunConfig
from fedlr.data import DATASETS, dataset_info, load_dataset
from fedlr.data.images import NORMALISATION, ImageData, pixel_arrays, to_image_data
from fedlr.data.partition import FederatedSplit
from fedlr.data.splits import dataset_split
from fedlr.errors import ConfigError
from fedlr.models.vision import VisionModel, build_vision_model, vision_models
from fedlr.options import (
    Options,
    option,
    require,
    require_nonnegative,
    require_positive,
)

__all__ = [
    "NORMALISATION",
    "EigenOptions",
    "ImageData",
    "ImageRows",
    "ImageTask",
    "VisionOptions",
    "evaluate_images",
    "image_logits",
    "image_loss",
    "image_pixels",
    "image_scores",
    "to_image_data",
    "train_sgd",
]


@dataclass(frozen=True)
class VisionOptions(Options):
    """Run-config keys of the vision clients' local SGD (``qrmix``, ``gpse`` kinds)."""

    momentum: float = option(
        0.9,
        "SGD momentum of the vision clients, in [0, 1)",
        bad=[(1.0, r"in \[0, 1\)")],
    )

    def check(self) -> None:
        require(
            0.0 <= self.momentum < 1.0,
            "momentum",
            f"must be in [0, 1), got {self.momentum}",
        )


@dataclass(frozen=True)
class EigenOptions(VisionOptions):
    """Keys of the ``qrmix`` payload kind: the clients' Hessian eigenpairs."""

    qrmix_k: int = option(
        10,
        "Hessian eigenpairs per client (≥ 1; capped at the head's size)",
        bad=[(0, "must be >= 1")],
    )
    qrmix_oversample: int = option(
        10, "oversampling s of the subspace iteration (≥ 0)", bad=[(-1, "must be >= 0")]
    )
    qrmix_power_iters: int = option(
        2, "power iterations q (≥ 0)", bad=[(-1, "must be >= 0")]
    )

    def check(self) -> None:
        super().check()
        require_positive(self, "qrmix_k")
        require_nonnegative(self, "qrmix_oversample", "qrmix_power_iters")


# ------------------------------------------------------------------ loading


@functools.lru_cache(maxsize=4)
def image_pixels(
    dataset: str, seed: int
) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """All images and labels of ``load_dataset(dataset, seed=seed)``, as arrays.

    Row ``i`` is the dataset's row ``i`` (so the indices of a
    :class:`FederatedSplit` built on the same dataset apply). Cached.

    Returns
    -------
    images : (N, H, W) or (N, H, W, 3) uint8 array
    labels : (N,) int64 array
    """
    return pixel_arrays(load_dataset(dataset, seed=seed))


def _image_datasets() -> list[str]:
    return sorted(name for name, spec in DATASETS.items() if spec.kind == "image")


@dataclass(frozen=True)
class ImageTask:
    """Image classification with a vision model from :mod:`fedlr.models.vision`.

    Parameters
    ----------
    config : RunConfig
        Uses ``dataset`` (an image data set), ``model`` (a vision model),
        the partitioning keys, ``seed``, ``eval-fraction`` and
        ``max-eval-examples``.

    Raises
    ------
    ConfigError
        If ``dataset`` is not an image data set or ``model`` not a vision model.
    """

    config: RunConfig

    def __post_init__(self) -> None:
        spec = dataset_info(self.config.dataset)  # UnknownDatasetError lists names
        if spec.kind != "image":
            raise ConfigError(
                "dataset",
                f"'{spec.name}' is not an image data set (kind: {spec.kind}); "
                f"vision models need one of ({', '.join(_image_datasets())})",
            )
        if self.config.model not in vision_models():
            raise ConfigError(
                "model",
                f"'{self.config.model}' is not a vision model; image data sets "
                f"need one of ({', '.join(vision_models())})",
            )

    @property
    def num_classes(self) -> int:
        """Number of classes of the data set."""
        return int(dataset_info(self.config.dataset).num_classes)

    @property
    def in_shape(self) -> tuple[int, int, int]:
        """Shape (C, H, W) of one image."""
        images, _ = self._pixels()
        if images.ndim == 3:
            return 1, int(images.shape[1]), int(images.shape[2])
        return int(images.shape[3]), int(images.shape[1]), int(images.shape[2])

    def _pixels(self) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
        return image_pixels(self.config.dataset, self.config.seed)

    def split(self, num_partitions: int | None = None) -> FederatedSplit:
        """Held-out split and client partitions (cached, :func:`dataset_split`)."""
        return dataset_split(self.config, num_partitions)

    def _rows(self, rows: NDArray[np.int64]) -> ImageData:
        images, labels = self._pixels()
        return to_image_data(images[rows], labels[rows], self.config.dataset)

    def heldout(self) -> ImageData:
        """The server's evaluation set (first ``max-eval-examples`` if set)."""
        rows = self.split().heldout_indices
        cap = self.config.max_eval_examples
        if cap and len(rows) > cap:
            rows = rows[:cap]
        return self._rows(rows)

    def partition(self, partition_id: int, num_partitions: int) -> ImageData:
        """A client's training partition."""
        return self._rows(self.split(num_partitions).partition_indices(partition_id))

    def build_model(self) -> VisionModel:
        """The seeded vision model named by ``model``."""
        return build_vision_model(
            self.config.model, self.in_shape, self.num_classes, self.config.seed
        )


# ------------------------------------------------------------ train / eval


@dataclass(frozen=True)
class ImageRows:
    """:class:`~fedlr.data.images.ImageData` as the training loops'
    :class:`~fedlr.client.train.TrainData`: ``batch(indices)`` is
    ``{"x": images, "labels": labels}`` (DP-SGD's loop and the privacy
    ledger's :func:`~fedlr.privacy.budget.data_key` read it)."""

    data: ImageData

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        rows = torch.as_tensor(list(indices), dtype=torch.long)
        return {"x": self.data.x[rows], "labels": self.data.y[rows]}


def train_sgd(
    model: torch.nn.Module,
    data: ImageData,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    device: torch.device | None = None,
    control: LoopControl | None = None,
) -> float:
    """Run ``steps`` SGD steps of cross-entropy on the trainable parameters.

    The training loop of the text payloads
    (:func:`fedlr.client.train.train_steps`, with :func:`image_logits` and
    :func:`image_loss`), run without touching the caller's CPU random state.

    Parameters
    ----------
    model : torch.nn.Module
        Maps (B, C, H, W) to logits (B, K).
    data : ImageData
    steps : int
        Optimiser steps (mini-batches drawn by a seeded permutation per epoch).
    lr, momentum, weight_decay : float
        ``torch.optim.SGD`` settings.
    batch_size : int
    seed : int
        Seeds the batch order and dropout.
    device : torch.device, optional
        Defaults to CPU.
    control : LoopControl, optional
        A loop that draws the batches, computes the loss and wraps the
        optimizer itself: sample-level DP-SGD
        (:func:`fedlr.privacy.dp_sgd.private_loop`: Poisson batches,
        per-example clipping and secure noise, charged to the node's ledger).

    Returns
    -------
    float
        Mean training loss over the steps (NaN if every step drew no example).

    Raises
    ------
    ValueError
        On an empty ``data`` or ``steps < 1``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    settings = TrainSettings(
        local_steps=steps,
        lr=lr,
        batch_size=batch_size,
        weight_decay=weight_decay,
        max_grad_norm=0.0,
        optimizer="sgd",
        momentum=momentum,
    )
    with torch.random.fork_rng(devices=[]):
        return train_steps(
            model,
            ImageRows(data),
            settings,
            seed=seed,
            device=device or torch.device("cpu"),
            control=control,
            forward=image_logits,
            loss=image_loss,
        )


def image_logits(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """A vision model's logits on ``batch["x"]``."""
    return model(batch["x"])  # type: ignore[no-any-return]


def image_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` against ``batch["labels"]``."""
    return torch.nn.functional.cross_entropy(logits, batch["labels"])


@torch.no_grad()
def evaluate_images(
    model: torch.nn.Module,
    data: ImageData,
    *,
    batch_size: int,
    device: torch.device | None = None,
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``data`` (eval mode).

    Returns
    -------
    (accuracy, loss) : tuple of float
        Both NaN when ``data`` is empty.
    """
    if len(data) == 0:
        return math.nan, math.nan
    device = device or torch.device("cpu")
    model.to(device).eval()
    totals = [0, 0.0]  # correct, loss sum

    def step(start: int, stop: int) -> None:
        x = data.x[start:stop].to(device)
        y = data.y[start:stop].to(device)
        logits = model(x)
        loss = float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        totals[0] += int((logits.argmax(-1) == y).sum())
        totals[1] += loss

    in_batches(len(data), batch_size, step)
    return totals[0] / len(data), totals[1] / len(data)


@torch.no_grad()
def image_scores(
    model: torch.nn.Module,
    data: ImageData,
    *,
    batch_size: int,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's cross-entropy and whether it was classified right (eval
    mode): what a noised evaluation sums
    (:func:`fedlr.privacy.dp_evaluation.noised_metrics`).

    Returns
    -------
    (losses, correct) : two (N,) float tensors on the CPU
    """
    device = device or torch.device("cpu")
    model.to(device).eval()
    losses: list[torch.Tensor] = []
    correct: list[torch.Tensor] = []

    def step(start: int, stop: int) -> None:
        x, y = data.x[start:stop].to(device), data.y[start:stop].to(device)
        logits = model(x)
        ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        losses.append(ce.float().cpu())
        correct.append((logits.argmax(-1) == y).float().cpu())

    in_batches(len(data), batch_size, step)
    if not losses:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(losses), torch.cat(correct)
