"""Image classifiers in plain torch: small CNN, MLP, AlexNet-like CNN, CIFAR ResNet.

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
``resnet``
    A CIFAR ResNet-20 (He et al., 2016): a 3x3 stem, three stages of three
    basic blocks (widths 16, 32, 64; stages 2 and 3 start with stride 2 and a
    1x1 projection shortcut), global average pooling, ``classifier``. Group
    normalisation (8 groups) instead of batch norm, as usual in federated
    training: no running statistics to federate, every state entry is a
    parameter. Projected: every convolution, in forward order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import nn

from fedlr.errors import ConfigError, ShapeMismatchError

__all__ = [
    "VISION_MODELS",
    "AlexNetLike",
    "CifarResNet",
    "SmallCNN",
    "VisionMLP",
    "VisionModel",
    "build_vision_model",
    "register_model",
    "vision_models",
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

    def projected_layers(self) -> tuple[str, ...]:
        """Names of the ``nn.Conv2d`` / ``nn.Linear`` layers FOT projects, in order."""
        return self.projected

    def head_layer(self) -> nn.Linear:
        """The final fully connected layer (``nn.Linear``) named by :attr:`head`."""
        layer = self.get_submodule(self.head)
        if not isinstance(layer, nn.Linear):  # pragma: no cover - declaration bug
            raise TypeError(f"head '{self.head}' is {type(layer).__name__}")
        return layer

    def parameter_state(self) -> dict[str, torch.Tensor]:
        """A detached copy of every parameter, keyed as ``named_parameters``."""
        return {k: p.detach().clone() for k, p in self.named_parameters()}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter, keyed as ``named_parameters``."""
        return {k: tuple(p.shape) for k, p in self.named_parameters()}

    def load_parameters(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` into the parameters (exactly the same keys and shapes).

        Raises
        ------
        ShapeMismatchError
            Naming missing or unexpected keys, or the first wrong shape.
        """
        params = dict(self.named_parameters())
        if set(state) != set(params):
            missing = sorted(set(params) - set(state))[:3]
            extra = sorted(set(state) - set(params))[:3]
            raise ShapeMismatchError(
                f"state does not match {type(self).__name__}: missing {missing}, "
                f"unexpected {extra}"
            )
        for key, param in params.items():
            if tuple(state[key].shape) != tuple(param.shape):
                raise ShapeMismatchError(
                    f"'{key}' has shape {tuple(state[key].shape)}, the model "
                    f"{tuple(param.shape)}"
                )
        with torch.no_grad():
            for key, param in params.items():
                param.copy_(state[key])

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


class _BasicBlock(nn.Module):
    """``relu(x' + F(x))`` with ``F`` = conv3x3-GN-ReLU-conv3x3-GN."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                nn.GroupNorm(groups, c_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(VisionModel):
    """ResNet for 32x32 images (ResNet-20 by default) with group norm.

    Parameters
    ----------
    in_shape : (C, H, W)
        H and W of at least 4 (two stride-2 stages).
    num_classes : int
    widths : (int, int, int)
        Channels of the three stages (multiples of ``groups``).
    blocks : int
        Basic blocks per stage (3: ResNet-20; 5: ResNet-32; 9: ResNet-56).
    groups : int
        Groups of every ``nn.GroupNorm``.
    """

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        num_classes: int,
        *,
        widths: tuple[int, int, int] = (16, 32, 64),
        blocks: int = 3,
        groups: int = 8,
    ) -> None:
        super().__init__()
        c, h, w = in_shape
        if min(h, w) < 4:
            raise ConfigError(
                "model", f"resnet needs images of at least 4x4, got {h}x{w}"
            )
        self.conv1 = nn.Conv2d(c, widths[0], 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, widths[0])
        stages = []
        c_in = widths[0]
        for i, width in enumerate(widths):
            for b in range(blocks):
                stride = 2 if i > 0 and b == 0 else 1
                stages.append(_BasicBlock(c_in, width, stride, groups))
                c_in = width
        self.blocks = nn.Sequential(*stages)
        self.classifier = nn.Linear(widths[-1], num_classes)
        # forward order: the stem, then per block conv1, conv2, shortcut conv
        self._convs = tuple(
            name
            for name, module in self.named_modules()
            if isinstance(module, nn.Conv2d)
        )

    def projected_layers(self) -> tuple[str, ...]:
        """Every convolution, in forward order (depends on ``blocks``)."""
        return self._convs

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, widths[-1]), after global average pooling."""
        x = torch.relu(self.norm1(self.conv1(x)))
        return self.blocks(x).mean(dim=(2, 3))


VisionBuilder = Callable[[tuple[int, int, int], int], VisionModel]
"""``builder(in_shape, num_classes) -> VisionModel`` (seeded by the caller)."""

_BUILDERS: dict[str, VisionBuilder] = {
    "cnn": SmallCNN,
    "mlp": VisionMLP,
    "alexnet": AlexNetLike,
    "resnet": CifarResNet,
}

VISION_MODELS: tuple[str, ...] = tuple(_BUILDERS)
"""fedlr's own vision models; :func:`vision_models` adds the registered ones."""


def register_model(name: str, builder: VisionBuilder) -> VisionBuilder:
    """Add a vision model under ``name`` (``model = "<name>"`` in the run config).

    Parameters
    ----------
    name : str
        The run-config name; must not be taken.
    builder : callable
        ``builder(in_shape, num_classes) -> VisionModel``: ``in_shape`` is
        ``(C, H, W)``; the model is a :class:`VisionModel` (its ``head`` layer
        an ``nn.Linear`` of ``num_classes`` outputs, ``projected`` the layers
        FOT projects). :func:`build_vision_model` seeds the call.

    Returns
    -------
    callable
        ``builder``, so the function can decorate a class or a factory.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.

    Inside ``flwr run`` every process must run the registration: name the
    module in the run config's ``extensions`` key (docs/data.md).
    """
    if not name:
        raise ValueError("a vision model needs a non-empty name")
    if name in _BUILDERS:
        raise ValueError(f"vision model '{name}' is already registered")
    _BUILDERS[name] = builder
    return builder


def vision_models() -> tuple[str, ...]:
    """Names accepted by :func:`build_vision_model`: fedlr's and the registered."""
    return tuple(_BUILDERS)


def build_vision_model(
    name: str, in_shape: tuple[int, int, int], num_classes: int, seed: int
) -> VisionModel:
    """Build a seeded image classifier.

    Parameters
    ----------
    name : str
        ``"cnn"``, ``"mlp"``, ``"alexnet"``, ``"resnet"`` or a name given to
        :func:`register_model`.
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
        or ``num_classes``, images too small for the model, or a registered
        builder that does not return a :class:`VisionModel`.
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise ConfigError(
            "model",
            f"'{name}' is not a vision model; known: {', '.join(vision_models())}",
        )
    if len(in_shape) != 3 or min(in_shape) < 1:
        raise ConfigError("model", f"in_shape must be (C, H, W) >= 1, got {in_shape}")
    if num_classes < 2:
        raise ConfigError("model", f"num_classes must be >= 2, got {num_classes}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = builder(tuple(int(s) for s in in_shape), int(num_classes))  # type: ignore[arg-type]
    if not isinstance(model, VisionModel):
        raise ConfigError(
            "model",
            f"the builder of '{name}' returned a {type(model).__name__}, not a "
            "fedlr.models.VisionModel (subclass it: set head and projected)",
        )
    return model
