"""Declared parameter roles: which tensor of an adapted model is which.

Strategies never guess a tensor's meaning from its key. The model side walks
its modules once (see :func:`fedlr.adapters.lora.lora_layout`) and declares an
:class:`AdapterLayout`: for every adapted linear layer the keys of its ``A``,
``B`` and frozen base weight ``W0`` plus its scaling, and the keys of the
trainable head. The layout is plain data, so it can be built on the server,
written to JSON, or written by hand for a plug-in user's own model.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from fedlr.errors import ShapeMismatchError, UnknownKeyError

__all__ = ["AdaptedModel", "AdapterLayout", "LoraModule", "Role", "RoleLayout"]


class Role(enum.Enum):
    """The role a tensor plays in an adapted model (LoRA, VeRA, SORF-VeRA)."""

    LORA_A = "lora_A"
    """Down projection ``A`` of shape (r, d_in)."""
    LORA_B = "lora_B"
    """Up projection ``B`` of shape (d_out, r)."""
    HEAD = "head"
    """Trainable task head (classifier), averaged like FedAvg."""
    BASE = "base"
    """Frozen base weight ``W0`` of an adapted layer: (d_out, d_in), or
    (d_in, d_out) for a ``Conv1D`` (the module's ``fan_in_fan_out``)."""
    VERA_LAMBDA_B = "vera_lambda_b"
    """VeRA output scaling vector ``b`` (d_out,)."""
    VERA_LAMBDA_D = "vera_lambda_d"
    """VeRA rank scaling vector ``d`` (r,)."""
    SORF_B_REAL = "sorf_b_real"
    """SORF-VeRA real parts ``a`` of the complex blocks of ``Gamma(b)`` (d_out/2,)."""
    SORF_B_IMAG = "sorf_b_imag"
    """SORF-VeRA imaginary parts ``c`` of the complex blocks (d_out/2,)."""
    SORF_D_SCALE = "sorf_d_scale"
    """SORF-VeRA magnitude ``m`` of ``Lambda_d = m G(theta)`` (1,)."""
    SORF_D_ANGLES = "sorf_d_angles"
    """SORF-VeRA Givens angles ``theta`` (r (r-1) / 2,)."""


class RoleLayout:
    """Declared ``(role, key, shape)`` entries of an adapted model.

    The one layout base of every adapter (LoRA's :class:`AdapterLayout`,
    VeRA's and SORF-VeRA's layouts); subclasses define :meth:`entries`.
    """

    def entries(self) -> Iterator[tuple[Role, str, tuple[int, ...]]]:
        """``(role, key, shape)`` of every declared tensor, in model order."""
        raise NotImplementedError

    def keys(self, *roles: Role) -> list[str]:
        """Keys holding any of ``roles``, in model order."""
        return [key for role, key, _ in self.entries() if role in roles]

    def all_keys(self) -> list[str]:
        """Every declared key."""
        return [key for _, key, _ in self.entries()]

    def shapes(self, *roles: Role) -> dict[str, tuple[int, ...]]:
        """Expected shape of every key with one of ``roles``."""
        return {key: shape for role, key, shape in self.entries() if role in roles}

    def check_shapes(self, shapes: Mapping[str, Iterable[int]]) -> None:
        """Check keys and shapes against the layout.

        Raises
        ------
        UnknownKeyError
            If a key is not declared (up to five are named).
        ShapeMismatchError
            If a declared key has another shape.
        """
        expected = {key: shape for _, key, shape in self.entries()}
        unknown = sorted(set(shapes) - set(expected))
        if unknown:
            raise UnknownKeyError(f"keys not in the adapter layout: {unknown[:5]}")
        for key, shape in shapes.items():
            if tuple(shape) != tuple(expected[key]):
                raise ShapeMismatchError(
                    f"'{key}' has shape {tuple(shape)}, layout declares "
                    f"{tuple(expected[key])}"
                )


class AdaptedModel(ABC):
    """A model with adapters whose tensors the layout declares by role.

    The one protocol of fedlr's LoRA, VeRA and SORF-VeRA models: the client
    apps and the server plans load a round's arrays, choose what trains and
    read the trained tensors through it, whatever the adapter.

    Attributes
    ----------
    model : torch.nn.Module
    layout : RoleLayout
    """

    model: torch.nn.Module
    layout: RoleLayout

    @abstractmethod
    def train_only(self, roles: Iterable[Role]) -> None:
        """Make exactly the tensors with ``roles`` trainable."""

    @abstractmethod
    def state(self, roles: Iterable[Role]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the tensors with ``roles``, keyed as the layout."""

    @abstractmethod
    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load ``state`` (keyed as the layout) in place.

        Raises
        ------
        UnknownKeyError, ShapeMismatchError
            If a key is not declared or has another shape.
        """


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear layer: ``W = W0 + scaling * B @ A``.

    For ``nn.Linear`` ``W0`` is stored (d_out, d_in); for GPT-2's ``Conv1D``
    (peft's ``fan_in_fan_out``) it is stored (d_in, d_out) and the layer's
    weight is ``W0 + scaling * (B @ A)^T``. ``d_out`` and ``d_in`` keep their
    meaning either way; only ``W0``'s shape (:meth:`shape_of`) and any change
    folded into it (:meth:`as_stored`) are transposed.

    Attributes
    ----------
    name : str
        Module path in the model.
    a_key, b_key, base_key : str
        Keys of ``A`` (r, d_in), ``B`` (d_out, r) and ``W0`` (d_out, d_in), or
        (d_in, d_out) with ``fan_in_fan_out``.
    scaling : float
        LoRA scaling ``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA).
    d_out, d_in, rank : int
        Shapes.
    fan_in_fan_out : bool, default False
        Whether ``W0`` is stored (d_in, d_out) (a ``Conv1D``).
    """

    name: str
    a_key: str
    b_key: str
    base_key: str
    scaling: float
    d_out: int
    d_in: int
    rank: int
    fan_in_fan_out: bool = False

    def shape_of(self, role: Role) -> tuple[int, int]:
        """Expected shape of the tensor with ``role`` in this module."""
        shapes = {
            Role.LORA_A: (self.rank, self.d_in),
            Role.LORA_B: (self.d_out, self.rank),
            Role.BASE: (
                (self.d_in, self.d_out)
                if self.fan_in_fan_out
                else (self.d_out, self.d_in)
            ),
        }
        if role not in shapes:
            raise KeyError(f"a LoRA module has no tensor with role {role.value}")
        return shapes[role]

    def as_stored(
        self, left: torch.Tensor, right: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors of the change ``left @ right`` (d_out, d_in) as ``W0`` stores it.

        Parameters
        ----------
        left : (d_out, p) torch.Tensor
        right : (p, d_in) torch.Tensor

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            ``(left, right)`` themselves, or ``(right^T, left^T)`` (views)
            with ``fan_in_fan_out``: their product is ``(left @ right)^T``.
        """
        return (right.T, left.T) if self.fan_in_fan_out else (left, right)


@dataclass(frozen=True)
class AdapterLayout(RoleLayout):
    """The declared roles of every tensor a LoRA strategy handles.

    Attributes
    ----------
    modules : tuple of LoraModule
        Adapted layers, in model order.
    head_shapes : mapping of str to tuple of int
        Keys and shapes of the trainable head tensors.
    """

    modules: tuple[LoraModule, ...]
    head_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for key in self.all_keys():
            if key in seen:
                raise ValueError(f"key '{key}' is declared twice in the layout")
            seen.add(key)

    def entries(self) -> Iterator[tuple[Role, str, tuple[int, ...]]]:
        """``(role, key, shape)`` of every declared tensor, in model order."""
        for module in self.modules:
            yield Role.LORA_A, module.a_key, module.shape_of(Role.LORA_A)
            yield Role.LORA_B, module.b_key, module.shape_of(Role.LORA_B)
            yield Role.BASE, module.base_key, module.shape_of(Role.BASE)
        for key, shape in self.head_shapes.items():
            yield Role.HEAD, key, tuple(shape)

    def at_rank(self, rank: int) -> AdapterLayout:
        """This layout with every module at ``rank`` and scaling ``alpha / rank``
        (``alpha = scaling * rank`` of each module): heterogeneous ranks."""
        if rank < 1:
            raise ValueError(f"a LoRA rank must be >= 1, got {rank}")
        return replace(
            self,
            modules=tuple(
                replace(m, rank=rank, scaling=m.scaling * m.rank / rank)
                for m in self.modules
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (see :meth:`from_dict`)."""
        return {
            "modules": [asdict(m) for m in self.modules],
            "head_shapes": {k: list(v) for k, v in self.head_shapes.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterLayout:
        """Inverse of :meth:`to_dict`."""
        return cls(
            modules=tuple(LoraModule(**m) for m in data["modules"]),
            head_shapes={k: tuple(v) for k, v in data.get("head_shapes", {}).items()},
        )
