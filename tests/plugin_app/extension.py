"""A user's own data set and vision model for fedlr's apps (docs/data.md).

Name this module in the run config (``extensions = "plugin_app.extension"``)
and every process of the run (the server, each client) imports it before it
reads the rest of the config, so ``dataset = "stripes"`` and
``model = "tiny-cnn"`` are known everywhere.
"""

import datasets
import numpy as np
import torch
from torch import nn

from fedlr.data import DatasetSpec, register_dataset
from fedlr.models import VisionModel, register_model

CLASSES = ["top", "upper", "lower", "bottom"]


def load_stripes() -> datasets.Dataset:
    """800 noisy 8x8 grey images; the class is the row band that is bright."""
    rng = np.random.default_rng(0)
    labels = np.arange(800) % len(CLASSES)
    images = rng.integers(0, 96, size=(800, 8, 8))
    for image, label in zip(images, labels, strict=True):
        image[2 * label : 2 * label + 2, :] += 150
    features = datasets.Features(
        {
            "image": datasets.Array2D(shape=(8, 8), dtype="uint8"),
            "label": datasets.ClassLabel(names=CLASSES),
        }
    )
    return datasets.Dataset.from_dict(
        {"image": images.astype(np.uint8), "label": labels}, features=features
    )


class TinyCNN(VisionModel):
    """One convolution and the head; FOT may project ``conv``."""

    head = "classifier"
    projected = ("conv",)

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = in_shape
        self.conv = nn.Conv2d(channels, 8, kernel_size=3, padding=1)
        self.classifier = nn.Linear(8 * height * width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)).flatten(1)


register_dataset(
    DatasetSpec(
        name="stripes",
        kind="image",
        num_classes=len(CLASSES),
        offline=True,
        loader=load_stripes,
        description="synthetic 8x8 bands (an extension example)",
    )
)
register_model("tiny-cnn", TinyCNN)
