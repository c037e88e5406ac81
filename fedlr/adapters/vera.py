"""VeRA through peft's ``VeraConfig``: build, declare roles, move state.

Every node builds the same frozen random projections ``A`` (r, max d_in) and
``B`` (max d_out, r) from the shared ``projection-seed`` and rank (peft's
``projection_prng_key``); only ``vera_lambda_b``, ``vera_lambda_d`` and the head
travel (and, for VeRA-FedEx, the base weights). Which tensor is which is found
by walking the modules (``isinstance`` of peft's ``VeraLayer`` and
``ModulesToSaveWrapper``) and matching storage with
``get_peft_model_state_dict``, never by substrings of keys.

:class:`~fedlr.adapters.roles.RoleLayout` is the plain-data declaration
shared with LoRA and SORF-VeRA: ``(role, key, shape)`` entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import cast

import torch
from peft import PeftModel, VeraConfig, get_peft_model
from peft.tuners.vera import VeraLayer
from peft.utils import ModulesToSaveWrapper, get_peft_model_state_dict

from fedlr.adapters.lora import adapter_state, live_parameters
from fedlr.adapters.orientation import (
    peft_targets,
    stores_fan_in_fan_out,
    targets_fan_in_fan_out,
)
from fedlr.adapters.roles import AdaptedModel, Role, RoleLayout
from fedlr.errors import ProjectionMismatchError

__all__ = [
    "VeraLayout",
    "VeraModel",
    "VeraModule",
    "VeraSettings",
    "apply_vera",
    "build_vera_model",
    "check_projection",
    "live_parameters",
    "shared_projections",
    "vera_layout",
]


@dataclass(frozen=True)
class VeraSettings:
    """VeRA hyperparameters.

    Attributes
    ----------
    rank : int
        ``r``, the size of ``d`` and the inner dimension of ``B A``.
    projection_seed : int
        peft's ``projection_prng_key``: seeds the shared ``A`` and ``B``.
    d_initial : float
        Initial value of every entry of ``d`` (``b`` starts at zero).
    dropout : float
        Dropout on the VeRA branch input.
    target_modules : tuple of str
    """

    rank: int = 256
    projection_seed: int = 0
    d_initial: float = 0.1
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("query", "value")
    head_modules: tuple[str, ...] = ("classifier",)

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("target_modules is empty")


@dataclass(frozen=True)
class VeraModule:
    """One adapted ``nn.Linear``: ``W = W0 + diag(b) B[:d_out] diag(d) A[:, :d_in]``.

    Over GPT-2's ``Conv1D`` (``fan_in_fan_out``) ``W0`` is stored (d_in, d_out)
    and the change is transposed: ``W0 + (diag(b) B diag(d) A)^T``.

    Attributes
    ----------
    name : str
    lambda_b_key, lambda_d_key, base_key : str
        Keys of ``b`` (d_out,), ``d`` (r,) and ``W0`` (d_out, d_in), or
        (d_in, d_out) with ``fan_in_fan_out``.
    d_out, d_in, rank : int
    scaling : float
        1 for peft's VeRA (it has no alpha).
    fan_in_fan_out : bool, default False
        Whether ``W0`` is stored (d_in, d_out) (a ``Conv1D``).
    """

    name: str
    lambda_b_key: str
    lambda_d_key: str
    base_key: str
    d_out: int
    d_in: int
    rank: int
    scaling: float = 1.0
    fan_in_fan_out: bool = False

    @property
    def base_shape(self) -> tuple[int, int]:
        """``W0``'s stored shape."""
        return (
            (self.d_in, self.d_out) if self.fan_in_fan_out else (self.d_out, self.d_in)
        )


@dataclass(frozen=True)
class VeraLayout(RoleLayout):
    """Declared roles of a VeRA model, with its projection identity.

    Attributes
    ----------
    modules : tuple of VeraModule
    head_shapes : mapping of str to tuple of int
    rank : int
    projection_seed : int
    """

    modules: tuple[VeraModule, ...]
    head_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    rank: int = 0
    projection_seed: int = 0

    def entries(self) -> Iterator[tuple[Role, str, tuple[int, ...]]]:
        for m in self.modules:
            yield Role.VERA_LAMBDA_B, m.lambda_b_key, (m.d_out,)
            yield Role.VERA_LAMBDA_D, m.lambda_d_key, (m.rank,)
            yield Role.BASE, m.base_key, m.base_shape
        for key, shape in self.head_shapes.items():
            yield Role.HEAD, key, tuple(shape)


def check_projection(
    layout_seed: int, layout_rank: int, sent_seed: int, sent_rank: int
) -> None:
    """Raise :class:`ProjectionMismatchError` unless seed and rank agree.

    Parameters
    ----------
    layout_seed, layout_rank : int
        What this node built its shared projections from.
    sent_seed, sent_rank : int
        What the server says every node uses.
    """
    if (layout_seed, layout_rank) != (sent_seed, sent_rank):
        raise ProjectionMismatchError(
            expected=(sent_seed, sent_rank), got=(layout_seed, layout_rank)
        )


def apply_vera(
    model: torch.nn.Module,
    settings: VeraSettings,
    *,
    head_modules: tuple[str, ...] | None = None,
) -> PeftModel:
    """Wrap ``model`` with VeRA adapters; the head stays trainable.

    When every target is a GPT-2 ``Conv1D``, peft's ``fan_in_fan_out`` is set.

    Raises
    ------
    ValueError
        If no module matches ``settings.target_modules``.
    """
    config = VeraConfig(
        r=settings.rank,
        target_modules=peft_targets(settings.target_modules),
        projection_prng_key=settings.projection_seed,
        save_projection=True,
        vera_dropout=settings.dropout,
        d_initial=settings.d_initial,
        modules_to_save=list(
            settings.head_modules if head_modules is None else head_modules
        )
        or None,
    )
    if targets_fan_in_fan_out(model, config):
        config.fan_in_fan_out = True  # GPT-2's Conv1D; peft would warn and set it
    return get_peft_model(model, config)


def vera_layout(model: PeftModel, settings: VeraSettings) -> VeraLayout:
    """Declare the roles of every tensor of a VeRA ``PeftModel``.

    Parameters
    ----------
    model : peft.PeftModel
        Built by :func:`apply_vera`.
    settings : VeraSettings
        The settings it was built with.

    Raises
    ------
    UnsupportedModelError
        If an adapted layer is neither ``nn.Linear`` nor ``Conv1D``.
    """
    adapter = model.active_adapter
    peft_ptr = {t.data_ptr(): k for k, t in get_peft_model_state_dict(model).items()}
    param_ptr = {p.data_ptr(): k for k, p in model.named_parameters()}
    modules: list[VeraModule] = []
    head: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        if isinstance(module, VeraLayer) and adapter in module.vera_lambda_b:
            base = module.get_base_layer()
            lb = module.vera_lambda_b[adapter]
            ld = module.vera_lambda_d[adapter]
            modules.append(
                VeraModule(
                    name=name,
                    lambda_b_key=peft_ptr[lb.data_ptr()],
                    lambda_d_key=peft_ptr[ld.data_ptr()],
                    base_key=param_ptr[cast(torch.Tensor, base.weight).data_ptr()],
                    d_out=int(module.out_features),
                    d_in=int(module.in_features),
                    rank=int(ld.numel()),
                    fan_in_fan_out=stores_fan_in_fan_out(base, name=name),
                )
            )
        elif isinstance(module, ModulesToSaveWrapper) and adapter in (
            module.modules_to_save
        ):
            for _, param in module.modules_to_save[adapter].named_parameters():
                head[peft_ptr[param.data_ptr()]] = tuple(param.shape)
    if not modules:
        raise ValueError("model has no VeRA layers for its active adapter")
    return VeraLayout(
        modules=tuple(modules),
        head_shapes=head,
        rank=settings.rank,
        projection_seed=settings.projection_seed,
    )


def shared_projections(model: PeftModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared frozen ``A`` (r, max d_in) and ``B`` (max d_out, r), copied."""
    adapter = model.active_adapter
    for module in model.modules():
        if isinstance(module, VeraLayer) and module.vera_A is not None:
            a = module.vera_A[adapter].detach().clone()
            b = cast(torch.nn.ParameterDict, module.vera_B)[adapter].detach().clone()
            return a, b
    raise ValueError("model has no VeRA layers")


@dataclass
class VeraModel(AdaptedModel):
    """A VeRA-adapted model, its layout, shared projections, pristine bases.

    Attributes
    ----------
    model : torch.nn.Module
    layout : VeraLayout
    projection_a : (r, max d_in) torch.Tensor
    projection_b : (max d_out, r) torch.Tensor
    pristine_base : dict of str to torch.Tensor
    """

    model: torch.nn.Module
    layout: RoleLayout
    projection_a: torch.Tensor
    projection_b: torch.Tensor
    pristine_base: dict[str, torch.Tensor]

    def train_only(self, roles: Iterable[Role]) -> None:
        """Make exactly the tensors with ``roles`` trainable."""
        trainable = set(self.layout.keys(*roles))
        for param in self.model.parameters():
            param.requires_grad_(False)
        for key, param in live_parameters(self.model, self.layout.all_keys()).items():
            param.requires_grad_(key in trainable)

    def state(self, roles: Iterable[Role]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the tensors with ``roles``."""
        return adapter_state(self.model, self.layout, roles)

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load ``state`` in place; base weights absent from it become pristine.

        Raises
        ------
        UnknownKeyError, ShapeMismatchError
            If a key is not declared or has another shape.
        """
        self.layout.check_shapes({k: v.shape for k, v in state.items()})
        full = {**{k: v for k, v in self.pristine_base.items() if k not in state}}
        full.update(state)
        params = live_parameters(self.model, full)
        with torch.no_grad():
            for key, value in full.items():
                params[key].copy_(value)


def build_vera_model(model: torch.nn.Module, settings: VeraSettings) -> VeraModel:
    """Apply VeRA and collect layout, projections and pristine base weights."""
    peft_model = apply_vera(model, settings)
    layout = vera_layout(peft_model, settings)
    a, b = shared_projections(peft_model)
    params = live_parameters(peft_model, layout.keys(Role.BASE))
    pristine = {k: p.detach().clone() for k, p in params.items()}
    return VeraModel(
        model=peft_model,
        layout=layout,
        projection_a=a,
        projection_b=b,
        pristine_base=pristine,
    )
