"""Images as tensors: the pair every image source hands to the vision loops.

:class:`ImageData` is what the image task (:mod:`fedlr.tasks.image`) and the
continual streams (:mod:`fedlr.data.continual`) return: normalised float32
images and int64 labels. :func:`to_image_data` turns the registry's ``uint8``
pixels into one, normalised per channel by :data:`NORMALISATION`. It lives in
the data layer so that a data source never imports a task.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch
from numpy.typing import NDArray

from fedlr.errors import ShapeMismatchError

if TYPE_CHECKING:
    import datasets

__all__ = ["NORMALISATION", "ImageData", "pixel_arrays", "to_image_data"]


NORMALISATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "digits": ((0.3053,), (0.3759,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
"""Per-channel (mean, std) of pixels scaled to [0, 1], by dataset name.

Data sets without an entry are normalised with mean 0.5 and std 0.5.
"""


def pixel_arrays(ds: datasets.Dataset) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """An image data set's pixels ``(N, H, W[, 3])`` and labels, in its row order.

    Read straight from the Arrow storage (milliseconds, where the ``numpy``
    formatter takes seconds).
    """
    table = ds.with_format("arrow")
    column = table["image"].combine_chunks()
    storage = column.storage if hasattr(column, "storage") else column
    while isinstance(storage, pa.ListArray | pa.LargeListArray | pa.FixedSizeListArray):
        storage = storage.flatten()
    shape = tuple(int(s) for s in ds.features["image"].shape)
    images = np.asarray(storage.to_numpy(zero_copy_only=False), dtype=np.uint8)
    labels = np.asarray(table["label"].to_numpy(), dtype=np.int64)
    return images.reshape((len(ds), *shape)), labels


@dataclass(frozen=True)
class ImageData:
    """Images and labels as tensors.

    Attributes
    ----------
    x : (N, C, H, W) torch.Tensor of float32
    y : (N,) torch.Tensor of int64
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.dim() != 4:
            raise ShapeMismatchError(
                f"x must have shape (N, C, H, W), got {tuple(self.x.shape)}"
            )
        if self.y.dim() != 1 or self.y.shape[0] != self.x.shape[0]:
            raise ShapeMismatchError(
                f"y must have shape ({self.x.shape[0]},), got {tuple(self.y.shape)}"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def in_shape(self) -> tuple[int, int, int]:
        """Shape (C, H, W) of one image."""
        c, h, w = self.x.shape[1:]
        return int(c), int(h), int(w)

    def select(
        self, idx: Sequence[int] | torch.Tensor | NDArray[np.int64]
    ) -> ImageData:
        """The rows ``idx`` (any integer index sequence)."""
        index = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ImageData(self.x[index], self.y[index])


def to_image_data(
    images: NDArray[np.uint8], labels: NDArray[np.int64], dataset: str
) -> ImageData:
    """uint8 images (N, H, W[, C]) -> normalised float32 (N, C, H, W) tensors.

    Parameters
    ----------
    images : (N, H, W) or (N, H, W, C) uint8 array
    labels : (N,) int64 array
    dataset : str
        Registry name whose :data:`NORMALISATION` applies (0.5, 0.5 if none).
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32) / 255.0
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2).contiguous()
    channels = x.shape[1]
    mean, std = NORMALISATION.get(dataset, ((0.5,) * channels, (0.5,) * channels))
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return ImageData((x - m) / s, torch.from_numpy(np.array(labels, dtype=np.int64)))
