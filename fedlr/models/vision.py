"""Image classifiers in plain torch: a small CNN, a four-layer MLP, an AlexNet-like CNN.

Every model is a :class:`VisionModel`: ``forward(x)`` maps images of shape
(N, C, H, W) to logits (N, num_classes) through ``head(features(x))``, and the
class declares its layers by name:

- :attr:`VisionModel.head` names the final ``nn.Linear`` (``"classifier"`` in
  every model here; the FC layer whose Hessian QR-Mix aggregates);
  :meth:`VisionModel.features` returns its input.
- :meth:`VisionModel.projected_layers` lists, in forward order, the
  ``nn.Conv2d`` / ``nn.Linear`` layers whose updates FOT projects off the
  bases of earlier tasks.

``cnn``
    Two 5x5 convolutions (padding 2, ReLU, 2x2 max-pool each), then two linear
    layers (``fc1`` with ReLU, then ``classifier``): the CNN of McMahan et al. (2017)
    at CPU-friendly width. Projected: ``conv1, conv2, fc1``.
``mlp``
    Four linear layers ``fc1, fc2, fc3, classifier`` with ReLU between, on the
    flattened image (permuted MNIST). Projected: all four, since the head is
    shared across the tasks of a permuted stream.
``alexnet``
    The AlexNet-like network of GPM (Saha et al., 2021) used by FOT: convs
    4x4, 3x3, 2x2 (each ReLU, dropout, 2x2 max-pool), ``fc1``, ``fc2``,
    ``classifier``; no batch norm (its running statistics would have to be
    federated too). Widths are halved for CPU. Projected: ``conv1, conv2,
    conv3, fc1, fc2``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from fedlr.errors import ConfigError

__all__ = [
    "VISION_MODELS",
    "AlexNetLike",
    "SmallCNN",
    "VisionMLP",
    "VisionModel",
    "build_vision_model",
]


class VisionModel(nn.Module):
    """Base class: ``forward = head(features(x))`` with declared layer roles.

    Subclasses set the class attributes :attr:`head` (name of the final
    ``nn.Linear``) and :attr:`projected` (names of the layers FOT projects, in
    forward order) and implement :meth:`features`.
    """

    head: ClassVar[str] = "classifier"
    projected: ClassVar[tuple[str, ...]] = ()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Input of the head layer.

        Parameters
        ----------
        x : (N, C, H, W) torch.Tensor

        Returns
        -------
        (N, F) torch.Tensor
            ``F = head_layer().in_features``.
        """
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes) for images ``x`` of shape (N, C, H, W)."""
        return self.head_layer()(self.features(x))  # type: ignore[no-any-return]

    @classmethod
    def projected_layers(cls) -> tuple[str, ...]:
        """Names of the ``nn.Conv2d`` / ``nn.Linear`` layers FOT projects, in order."""
        return cls.projected

    def head_layer(self) -> nn.Linear:
        """The final fully connected layer (``nn.Linear``) named by :attr:`head`."""
        layer = self.get_submodule(self.head)
        if not isinstance(layer, nn.Linear):  # pragma: no cover - declaration bug
            raise TypeError(f"head '{self.head}' is {type(layer).__name__}")
        return layer

    def layer(self, name: str) -> nn.Conv2d | nn.Linear:
        """A declared conv/linear layer by name.

        Raises
        ------
        KeyError
            If ``name`` is not a conv/linear layer of this model.
        """
        try:
            module = self.get_submodule(name)
        except AttributeError:
            raise KeyError(f"{type(self).__name__} has no layer '{name}'") from None
        if not isinstance(module, nn.Conv2d | nn.Linear):
            raise KeyError(f"'{name}' is a {type(module).__name__}, not conv/linear")
        return module


def _pooled(size: int, kernel: int, pad: int = 0) -> int:
    """Spatial size after a stride-1 conv with ``kernel``/``pad`` and a 2x2 pool."""
    return (size + 2 * pad - kernel + 1) // 2


class SmallCNN(VisionModel):
    """Two conv + two FC layers (McMahan et al., 2017), for MNIST and CIFAR.

    Parameters
    ----------
    in_shape : (C, H, W)
    num_classes : int
    channels : (int, int)
        Output channels of ``conv1`` and ``conv2``.
    hidden : int
        Width of ``fc1`` (the head's input dimension).
    """

    projected = ("conv1", "conv2", "fc1")

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        num_classes: int,
        *,
        channels: tuple[int, int] = (32, 64),
        hidden: int = 128,
    ) -> None:
        super().__init__()
        c, h, w = in_shape
        self.conv1 = nn.Conv2d(c, channels[0], kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(channels[0], channels[1], kernel_size=5, padding=2)
        flat = channels[1] * (h // 4) * (w // 4)
        if flat == 0:
            raise ConfigError("model", f"cnn needs images of at least 4x4, got {h}x{w}")
        self.fc1 = nn.Linear(flat, hidden)
        self.classifier = nn.Linear(hidden, num_classes)
        self.pool = nn.MaxPool2d(2)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, hidden)."""
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return torch.relu(self.fc1(x.flatten(1)))


class VisionMLP(VisionModel):
    """Four linear layers on the flattened image (permuted MNIST).

    Parameters
    ----------
    in_shape : (C, H, W)
    num_classes : int
    hidden : int
        Width of the three hidden layers.
    """

    projected = ("fc1", "fc2", "fc3", "classifier")

    def __init__(
        self, in_shape: tuple[int, int, int], num_classes: int, *, hidden: int = 256
    ) -> None:
        super().__init__()
        c, h, w = in_shape
        self.fc1 = nn.Linear(c * h * w, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, hidden)."""
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return torch.relu(self.fc3(x))


class AlexNetLike(VisionModel):
    """GPM's AlexNet-like CNN (three convs, two FC, head) at half width.

    Parameters
    ----------
    in_shape : (C, H, W)
        H and W of at least 16.
    num_classes : int
    channels : (int, int, int)
        Output channels of ``conv1..conv3`` (kernels 4, 3, 2; stride 1, no
        padding; each followed by ReLU, dropout and a 2x2 max-pool).
    hidden : int
        Width of ``fc1`` and ``fc2``.
    dropout : (float, float)
        Dropout after the first two convs and after conv3 / the FC layers.
    """

    projected = ("conv1", "conv2", "conv3", "fc1", "fc2")

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        num_classes: int,
        *,
        channels: tuple[int, int, int] = (32, 64, 128),
        hidden: int = 512,
        dropout: tuple[float, float] = (0.2, 0.5),
    ) -> None:
        super().__init__()
        c, h, w = in_shape
        sizes = []
        for size in (h, w):
            for kernel in (4, 3, 2):
                size = _pooled(size, kernel)
            sizes.append(size)
        if min(sizes) < 1:
            raise ConfigError(
                "model", f"alexnet needs images of at least 16x16, got {h}x{w}"
            )
        self.conv1 = nn.Conv2d(c, channels[0], kernel_size=4)
        self.conv2 = nn.Conv2d(channels[0], channels[1], kernel_size=3)
        self.conv3 = nn.Conv2d(channels[1], channels[2], kernel_size=2)
        self.fc1 = nn.Linear(channels[2] * sizes[0] * sizes[1], hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_classes)
        self.pool = nn.MaxPool2d(2)
        self.drop_conv = nn.Dropout(dropout[0])
        self.drop_fc = nn.Dropout(dropout[1])

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, hidden)."""
        x = self.pool(self.drop_conv(torch.relu(self.conv1(x))))
        x = self.pool(self.drop_conv(torch.relu(self.conv2(x))))
        x = self.pool(self.drop_fc(torch.relu(self.conv3(x))))
        x = self.drop_fc(torch.relu(self.fc1(x.flatten(1))))
        return self.drop_fc(torch.relu(self.fc2(x)))


_BUILDERS: dict[str, Callable[[tuple[int, int, int], int], VisionModel]] = {
    "cnn": SmallCNN,
    "mlp": VisionMLP,
    "alexnet": AlexNetLike,
}

VISION_MODELS: tuple[str, ...] = tuple(_BUILDERS)
"""Names accepted by :func:`build_vision_model` (``model`` in the run config)."""


def build_vision_model(
    name: str, in_shape: tuple[int, int, int], num_classes: int, seed: int
) -> VisionModel:
    """Build a seeded image classifier.

    Parameters
    ----------
    name : {"cnn", "mlp", "alexnet"}
    in_shape : (C, H, W)
        Shape of one image.
    num_classes : int
    seed : int
        Seeds the parameter initialisation (same seed, same weights).

    Returns
    -------
    VisionModel

    Raises
    ------
    ConfigError
        On an unknown ``name`` (listing the known ones), a bad ``in_shape``
        or ``num_classes``, or images too small for the model.
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise ConfigError(
            "model",
            f"'{name}' is not a vision model; known: {', '.join(VISION_MODELS)}",
        )
    if len(in_shape) != 3 or min(in_shape) < 1:
        raise ConfigError("model", f"in_shape must be (C, H, W) >= 1, got {in_shape}")
    if num_classes < 2:
        raise ConfigError("model", f"num_classes must be >= 2, got {num_classes}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(tuple(int(s) for s in in_shape), int(num_classes))  # type: ignore[arg-type]
