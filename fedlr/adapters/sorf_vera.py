"""SORF-VeRA: a module wrapping ``nn.Linear``, ``Delta W = S Gamma(b) B Lambda_d A``.

* ``A`` (r, d_in), ``B`` (d_out, r): frozen, shared by every layer and node,
  drawn from the projection seed (Kaiming-uniform as peft's VeRA);
* ``S = (D1 H D2 H D3)[:d_out, :d_out]``: signs from the projection seed, one
  set per output size, applied by FWHT (:func:`fedlr.linalg.sorf.sorf_apply`);
* ``b_real``, ``b_imag`` (d_out/2,): frozen on clients, set by the server's
  refit each round (start at ``b = 1``, ``Gamma = I``);
* ``d_scale`` (1,), ``d_angles`` (r (r-1)/2,): trained; ``Lambda_d = m G(theta)``.

The forward computes ``Delta W x`` right to left,
``x -> A x -> Lambda_d (.) -> B (.) -> Gamma(b) (.) -> S (.)``, without
building ``Delta W``, ``Gamma`` or ``S``: the only matrices formed are the
(r, r) ``Lambda_d`` and the frozen factors. The wrapped layer is kept as
``base_layer``; nothing is patched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn import functional
from transformers.pytorch_utils import Conv1D

from fedlr.adapters.orientation import ALL_LINEAR, all_linear_layers
from fedlr.adapters.roles import Role, RoleLayout
from fedlr.adapters.vera import VeraModel, live_parameters
from fedlr.errors import ShapeMismatchError, UnsupportedModelError
from fedlr.linalg.sorf import (
    SorfSigns,
    build_lambda_d_rot,
    gamma_apply,
    sorf_apply,
    sorf_signs,
)

__all__ = [
    "SorfVeraLayout",
    "SorfVeraLinear",
    "SorfVeraModel",
    "SorfVeraModule",
    "SorfVeraSettings",
    "apply_sorf_vera",
    "build_sorf_vera_model",
    "layer_of",
    "layer_signs",
    "shared_sorf_projections",
]


@dataclass(frozen=True)
class SorfVeraSettings:
    """SORF-VeRA hyperparameters.

    Attributes
    ----------
    rank : int
        ``r``; ``Lambda_d`` has ``r (r-1) / 2`` Givens angles.
    projection_seed : int
        Seeds ``A``, ``B`` and the SORF signs.
    d_scale_initial : float
        Initial ``m`` (0 starts from the pretrained model).
    target_modules : tuple of str
    """

    rank: int = 16
    projection_seed: int = 0
    d_scale_initial: float = 0.0
    target_modules: tuple[str, ...] = ("query", "value")
    head_modules: tuple[str, ...] = ("classifier",)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be a positive integer, got {self.rank}")
        if not self.target_modules:
            raise ValueError("target_modules is empty")


def _kaiming_uniform(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    bound = math.sqrt(6.0 / shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def shared_sorf_projections(
    rank: int, d_in: int, d_out: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared frozen ``A`` (rank, d_in) and ``B`` (d_out, rank) from ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    a = _kaiming_uniform((rank, d_in), gen)
    b = _kaiming_uniform((d_out, rank), gen)
    return a, b


def layer_signs(d_out: int, projection_seed: int) -> SorfSigns:
    """The SORF signs of every layer with ``d_out`` outputs (seeded, shared)."""
    return sorf_signs(d_out, projection_seed * 1_000_003 + d_out)


class SorfVeraLinear(torch.nn.Module):
    """``y = base_layer(x) + S Gamma(b) B Lambda_d A x``.

    Parameters
    ----------
    base_layer : torch.nn.Linear
        The wrapped layer (frozen); ``out_features`` must be even.
    projection_a : (r, >= d_in) torch.Tensor
        Shared ``A``; sliced to ``d_in`` columns.
    projection_b : (>= d_out, r) torch.Tensor
        Shared ``B``; sliced to ``d_out`` rows.
    signs : SorfSigns
        ``S`` of size ``d_out``.
    d_scale_initial : float
    """

    proj_a: torch.Tensor
    proj_b: torch.Tensor
    sign_1: torch.Tensor
    sign_2: torch.Tensor
    sign_3: torch.Tensor

    def __init__(
        self,
        base_layer: torch.nn.Linear,
        projection_a: torch.Tensor,
        projection_b: torch.Tensor,
        signs: SorfSigns,
        d_scale_initial: float = 0.0,
    ) -> None:
        super().__init__()
        d_out, d_in = base_layer.out_features, base_layer.in_features
        r = int(projection_a.shape[0])
        if d_out % 2:
            raise ShapeMismatchError(
                f"SORF-VeRA needs an even out_features for its 2x2 blocks, got {d_out}"
            )
        if (
            projection_a.shape[1] < d_in
            or projection_b.shape[0] < d_out
            or projection_b.shape[1] != r
            or signs.d != d_out
        ):
            raise ShapeMismatchError(
                f"projections A {tuple(projection_a.shape)}, B "
                f"{tuple(projection_b.shape)}, S of size {signs.d} do not fit a "
                f"({d_out}, {d_in}) layer"
            )
        self.base_layer = base_layer
        self.rank = r
        self.register_buffer("proj_a", projection_a[:, :d_in], persistent=False)
        self.register_buffer("proj_b", projection_b[:d_out], persistent=False)
        self.register_buffer("sign_1", signs.d1, persistent=False)
        self.register_buffer("sign_2", signs.d2, persistent=False)
        self.register_buffer("sign_3", signs.d3, persistent=False)
        m = d_out // 2
        self.b_real = torch.nn.Parameter(torch.ones(m), requires_grad=False)
        self.b_imag = torch.nn.Parameter(torch.zeros(m), requires_grad=False)
        self.d_scale = torch.nn.Parameter(torch.full((1,), float(d_scale_initial)))
        self.d_angles = torch.nn.Parameter(torch.zeros(r * (r - 1) // 2))

    @property
    def signs(self) -> SorfSigns:
        """The SORF signs of this layer."""
        return SorfSigns(
            d1=self.sign_1, d2=self.sign_2, d3=self.sign_3, d=int(self.proj_b.shape[0])
        )

    def lambda_d(self) -> torch.Tensor:
        """``Lambda_d = m G(theta)``, (r, r)."""
        return build_lambda_d_rot(self.d_scale, self.d_angles, self.rank)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``Delta W x`` along the last dimension, right to left.

        Parameters
        ----------
        x : (..., d_in) torch.Tensor

        Returns
        -------
        (..., d_out) torch.Tensor
        """
        dtype = self.d_scale.dtype
        h = functional.linear(x.to(dtype), self.proj_a)  # A x
        h = functional.linear(h, self.lambda_d())  # Lambda_d A x
        h = functional.linear(h, self.proj_b)  # B ...
        h = gamma_apply(self.b_real, self.b_imag, h)  # Gamma(b) ...
        return sorf_apply(self.signs, h)  # S ...

    def delta_weight(self) -> torch.Tensor:
        """Dense ``Delta W`` (d_out, d_in), for tests and merging only."""
        eye = torch.eye(int(self.proj_a.shape[1]), dtype=self.d_scale.dtype)
        return self.delta(eye).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base_layer(x) + Delta W x``."""
        out: torch.Tensor = self.base_layer(x)
        return out + self.delta(x).to(out.dtype)


@dataclass(frozen=True)
class SorfVeraModule:
    """Keys and shapes of one SORF-VeRA layer.

    Attributes
    ----------
    name : str
    b_real_key, b_imag_key, d_scale_key, d_angles_key, base_key : str
    d_out, d_in, rank : int
    """

    name: str
    b_real_key: str
    b_imag_key: str
    d_scale_key: str
    d_angles_key: str
    base_key: str
    d_out: int
    d_in: int
    rank: int


@dataclass(frozen=True)
class SorfVeraLayout(RoleLayout):
    """Declared roles of a SORF-VeRA model.

    Attributes
    ----------
    modules : tuple of SorfVeraModule
    head_shapes : mapping of str to tuple of int
    rank : int
    projection_seed : int
    """

    modules: tuple[SorfVeraModule, ...]
    head_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    rank: int = 0
    projection_seed: int = 0

    def entries(self) -> Iterator[tuple[Role, str, tuple[int, ...]]]:
        for m in self.modules:
            yield Role.SORF_B_REAL, m.b_real_key, (m.d_out // 2,)
            yield Role.SORF_B_IMAG, m.b_imag_key, (m.d_out // 2,)
            yield Role.SORF_D_SCALE, m.d_scale_key, (1,)
            yield Role.SORF_D_ANGLES, m.d_angles_key, (m.rank * (m.rank - 1) // 2,)
            yield Role.BASE, m.base_key, (m.d_out, m.d_in)
        for key, shape in self.head_shapes.items():
            yield Role.HEAD, key, tuple(shape)


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(last == t or re.fullmatch(t, name) for t in targets)


def apply_sorf_vera(
    model: torch.nn.Module,
    settings: SorfVeraSettings,
    *,
    head_modules: tuple[str, ...] | None = None,
) -> SorfVeraLayout:
    """Wrap every target ``nn.Linear`` of ``model`` in place; return the layout.

    Every parameter is frozen except ``d_scale``, ``d_angles`` and the head.

    Raises
    ------
    ValueError
        If no ``nn.Linear`` matches the targets.
    UnsupportedModelError
        If a target is a GPT-2 ``Conv1D`` (its (d_in, d_out) weight is not
        supported by SORF-VeRA's wrapping layer; use LoRA or VeRA there).
    """
    chosen = (
        {name for name, _ in all_linear_layers(model)}
        if tuple(settings.target_modules) == (ALL_LINEAR,)
        else None
    )

    def matches(name: str) -> bool:
        if chosen is not None:
            return name in chosen
        return _matches(name, settings.target_modules)

    conv1d = [
        name
        for name, module in model.named_modules()
        if isinstance(module, Conv1D) and matches(name)
    ]
    if conv1d:
        raise UnsupportedModelError(
            f"SORF-VeRA wraps nn.Linear layers only; targets {conv1d[:3]} are "
            "transformers Conv1D layers (use LoRA or VeRA for them)"
        )
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and matches(name)
    ]
    if not targets:
        raise ValueError(
            f"no nn.Linear module matches target modules {settings.target_modules}"
        )
    d_in = max(m.in_features for _, m in targets)
    d_out = max(m.out_features for _, m in targets)
    a, b = shared_sorf_projections(settings.rank, d_in, d_out, settings.projection_seed)
    for param in model.parameters():
        param.requires_grad_(False)
    modules = _wrap(model, targets, a, b, settings)
    head = _train_head(
        model, settings.head_modules if head_modules is None else head_modules
    )
    return SorfVeraLayout(
        modules=tuple(modules),
        head_shapes=head,
        rank=settings.rank,
        projection_seed=settings.projection_seed,
    )


def _wrap(
    model: torch.nn.Module,
    targets: list[tuple[str, torch.nn.Linear]],
    a: torch.Tensor,
    b: torch.Tensor,
    settings: SorfVeraSettings,
) -> list[SorfVeraModule]:
    """Replace each target ``nn.Linear`` by a :class:`SorfVeraLinear` over the
    shared projections (one set of SORF signs per output size); their roles."""
    signs_by_size: dict[int, SorfSigns] = {}
    modules: list[SorfVeraModule] = []
    for name, linear in targets:
        size = linear.out_features
        if size not in signs_by_size:
            signs_by_size[size] = layer_signs(size, settings.projection_seed)
        wrapped = SorfVeraLinear(
            linear, a, b, signs_by_size[size], settings.d_scale_initial
        )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, wrapped)
        modules.append(
            SorfVeraModule(
                name=name,
                b_real_key=f"{name}.b_real",
                b_imag_key=f"{name}.b_imag",
                d_scale_key=f"{name}.d_scale",
                d_angles_key=f"{name}.d_angles",
                base_key=f"{name}.base_layer.weight",
                d_out=linear.out_features,
                d_in=linear.in_features,
                rank=settings.rank,
            )
        )
    return modules


def _train_head(
    model: torch.nn.Module, head_modules: Sequence[str]
) -> dict[str, tuple[int, ...]]:
    """Make the head's parameters trainable; their shapes by key."""
    head: dict[str, tuple[int, ...]] = {}
    for head_name in head_modules:
        for pname, param in model.get_submodule(head_name).named_parameters():
            param.requires_grad_(True)
            head[f"{head_name}.{pname}"] = tuple(param.shape)
    return head


class SorfVeraModel(torch.nn.Module, VeraModel):
    """A SORF-VeRA model: an ``nn.Module`` and its :class:`VeraModel` view.

    Calling it runs the wrapped module (``model``, registered as the
    submodule ``model``), so it trains, moves (``.to``), switches mode
    (``.train()``, ``.eval()``) and lists parameters like any module; its
    ``layout``, ``projection_a``, ``projection_b`` and ``pristine_base`` are
    those of :class:`VeraModel`, keyed relative to ``model``. Equality and
    hashing are by identity, as for every module.
    """

    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __init__(
        self,
        model: torch.nn.Module,
        layout: RoleLayout,
        projection_a: torch.Tensor,
        projection_b: torch.Tensor,
        pristine_base: dict[str, torch.Tensor],
    ) -> None:
        torch.nn.Module.__init__(self)
        self.model = model
        self.layout = layout
        self.projection_a = projection_a
        self.projection_b = projection_b
        self.pristine_base = pristine_base

    def forward(self, *args: object, **kwargs: object) -> object:
        """The wrapped module's forward."""
        return self.model(*args, **kwargs)


def build_sorf_vera_model(
    model: torch.nn.Module, settings: SorfVeraSettings
) -> SorfVeraModel:
    """Apply SORF-VeRA and collect layout, projections and pristine bases.

    Returns
    -------
    SorfVeraModel
        An ``nn.Module`` (calling it calls ``model``, now with SORF-VeRA
        layers) that is also the :class:`VeraModel` fedlr's helpers take.
    """
    layout = apply_sorf_vera(model, settings)
    a, b = shared_sorf_projections(
        settings.rank,
        max(m.d_in for m in layout.modules),
        max(m.d_out for m in layout.modules),
        settings.projection_seed,
    )
    params = live_parameters(model, layout.keys(Role.BASE))
    return SorfVeraModel(
        model=model,
        layout=layout,
        projection_a=a,
        projection_b=b,
        pristine_base={k: p.detach().clone() for k, p in params.items()},
    )


def layer_of(model: torch.nn.Module, module: SorfVeraModule) -> SorfVeraLinear:
    """The live :class:`SorfVeraLinear` of ``module``."""
    layer = model.get_submodule(module.name)
    if not isinstance(layer, SorfVeraLinear):
        raise TypeError(f"module '{module.name}' is not a SorfVeraLinear")
    return layer
