"""LoRA through peft: build the adapter, declare its roles, move its state.

The state of A, B and the head moves through peft's
``get_peft_model_state_dict`` / ``set_peft_model_state_dict``; which key is
which is found by walking the modules (``isinstance`` of peft's ``LoraLayer``
and ``ModulesToSaveWrapper``) and matching tensors by storage, never by
substrings of the key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper, get_peft_model_state_dict
from peft.utils import set_peft_model_state_dict as _set_peft_state

from fedlr.adapters.orientation import (
    peft_targets,
    stores_fan_in_fan_out,
    targets_fan_in_fan_out,
)
from fedlr.adapters.roles import (
    AdaptedModel,
    AdapterLayout,
    LoraModule,
    Role,
    RoleLayout,
)
from fedlr.errors import ConfigError, ShapeMismatchError

__all__ = [
    "LoraModel",
    "LoraSettings",
    "adapter_state",
    "apply_lora",
    "live_parameters",
    "load_adapter_state",
    "lora_layout",
    "parameters_by_key",
]


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyperparameters.

    Attributes
    ----------
    rank : int
        ``r``, the inner dimension of ``B @ A``.
    alpha : float
        ``lora_alpha``; the scaling is ``alpha / r``.
    dropout : float
        Dropout on the LoRA branch input.
    target_modules : tuple of str
        Names of the ``nn.Linear`` (or GPT-2 ``Conv1D``) modules to adapt
        (peft's ``target_modules``); ``("all-linear",)`` is peft's every
        linear layer but the output layer.
    head_modules : tuple of str
        Modules trained in full and sent with the adapters (the classifier
        head); empty for a causal LM, whose output layer stays frozen.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("query", "value")
    head_modules: tuple[str, ...] = ("classifier",)

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("target_modules is empty")


def apply_lora(
    model: torch.nn.Module,
    settings: LoraSettings,
    *,
    head_modules: tuple[str, ...] | None = None,
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; the head modules stay trainable.

    Parameters
    ----------
    model : torch.nn.Module
        Any module with ``nn.Linear`` or ``transformers`` ``Conv1D`` layers
        named as in the targets. When every target is a ``Conv1D`` (GPT-2),
        peft's ``fan_in_fan_out`` is set (it stores ``W0`` as (d_in, d_out)).
    settings : LoraSettings
    head_modules : tuple of str, optional
        Modules trained in full and saved with the adapter (peft's
        ``modules_to_save``), e.g. the classification head; default
        ``settings.head_modules``.

    Raises
    ------
    ValueError
        If no module of ``model`` matches ``settings.target_modules``.
    ConfigError
        (a ValueError) for key ``lora-rank`` if a target is narrower than the
        rank.
    UnsupportedModelError
        If a target is neither ``nn.Linear`` nor ``Conv1D``.
    """
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=cast(Any, settings.alpha),  # peft accepts floats; typed int
        lora_dropout=settings.dropout,
        target_modules=peft_targets(settings.target_modules),
        modules_to_save=list(
            settings.head_modules if head_modules is None else head_modules
        )
        or None,
    )
    if targets_fan_in_fan_out(model, config):
        config.fan_in_fan_out = True  # GPT-2's Conv1D; peft would warn and set it
    peft_model = get_peft_model(model, config)
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            stores_fan_in_fan_out(module.get_base_layer(), name=name)
            d_in = int(cast(int, module.in_features))  # peft: Linear's or Conv1D's
            d_out = int(cast(int, module.out_features))
            narrow = min(d_in, d_out)
            if settings.rank > narrow:
                raise ConfigError(
                    "lora-rank",
                    f"rank {settings.rank} exceeds the smaller side {narrow} of a "
                    f"target layer ({d_out} x {d_in})",
                )
    return peft_model


def _storage_to_name(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    return {t.data_ptr(): name for name, t in named}


def lora_layout(model: PeftModel) -> AdapterLayout:
    """Declare the roles of every tensor of a LoRA ``PeftModel``.

    Parameters
    ----------
    model : peft.PeftModel
        A model built by :func:`apply_lora` (one active adapter).

    Returns
    -------
    AdapterLayout
        Keys are those of ``get_peft_model_state_dict`` for A, B and the head,
        and of ``model.named_parameters()`` for the base weights. A layer
        over a ``Conv1D`` has ``fan_in_fan_out`` (``W0`` is (d_in, d_out)).

    Raises
    ------
    UnsupportedModelError
        If an adapted layer is neither ``nn.Linear`` nor ``Conv1D``.
    ShapeMismatchError
        If a base weight's shape does not fit its ``A`` and ``B``.
    """
    adapter = model.active_adapter
    peft_keys = _storage_to_name(get_peft_model_state_dict(model).items())
    param_keys = _storage_to_name(model.named_parameters())

    def key_of(t: torch.Tensor, table: Mapping[int, str], what: str) -> str:
        try:
            return table[t.data_ptr()]
        except KeyError as exc:
            raise RuntimeError(f"no state-dict key found for {what}") from exc

    modules: list[LoraModule] = []
    head_shapes: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            a = cast(torch.Tensor, module.lora_A[adapter].weight)
            b = cast(torch.Tensor, module.lora_B[adapter].weight)
            base_layer = module.get_base_layer()
            base = cast(torch.Tensor, base_layer.weight)
            lora_module = LoraModule(
                name=name,
                a_key=key_of(a, peft_keys, f"{name} A"),
                b_key=key_of(b, peft_keys, f"{name} B"),
                base_key=key_of(base, param_keys, f"{name} base weight"),
                scaling=float(module.scaling[adapter]),
                d_out=int(b.shape[0]),
                d_in=int(a.shape[1]),
                rank=int(a.shape[0]),
                fan_in_fan_out=stores_fan_in_fan_out(base_layer, name=name),
            )
            if tuple(base.shape) != lora_module.shape_of(Role.BASE):
                raise ShapeMismatchError(
                    f"layer '{name}': base weight {tuple(base.shape)} does not fit "
                    f"A {tuple(a.shape)} and B {tuple(b.shape)} "
                    f"(fan_in_fan_out={lora_module.fan_in_fan_out})"
                )
            modules.append(lora_module)
        elif isinstance(module, ModulesToSaveWrapper) and adapter in (
            module.modules_to_save
        ):
            for _, param in module.modules_to_save[adapter].named_parameters():
                head_shapes[key_of(param, peft_keys, f"{name} head")] = tuple(
                    param.shape
                )
    if not modules:
        raise ValueError("model has no LoRA layers for its active adapter")
    return AdapterLayout(modules=tuple(modules), head_shapes=head_shapes)


def adapter_state(
    model: torch.nn.Module, layout: RoleLayout, roles: Iterable[Role]
) -> dict[str, torch.Tensor]:
    """Copy the tensors with ``roles`` out of ``model`` (detached, on CPU).

    Parameters
    ----------
    model : torch.nn.Module
        A peft model, or a model with its own adapter modules (SORF-VeRA).
    layout : RoleLayout
        From :func:`lora_layout` (or the method's layout) on this model.
    roles : iterable of Role

    Returns
    -------
    dict of str to torch.Tensor
        Keyed as in ``layout``.
    """
    tensors = _tensors(model, layout.keys(*roles))
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}


def load_adapter_state(
    model: PeftModel, layout: AdapterLayout, state: Mapping[str, torch.Tensor]
) -> None:
    """Load tensors keyed as in ``layout`` into ``model`` in place.

    A, B and head go through ``set_peft_model_state_dict``; base weights are
    copied into the adapted layers' frozen ``base_layer.weight``.

    Raises
    ------
    UnknownKeyError
        If a key is not declared in ``layout``.
    ShapeMismatchError
        If a tensor's shape differs from the layout.
    """
    layout.check_shapes({k: v.shape for k, v in state.items()})
    base_keys = set(layout.keys(Role.BASE))
    peft_part = {k: v for k, v in state.items() if k not in base_keys}
    if peft_part:
        result = _set_peft_state(model, peft_part)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ShapeMismatchError(f"peft did not accept keys {unexpected[:5]}")
    if base_keys & set(state):
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key in base_keys & set(state):
                params[key].copy_(state[key])


def _tensors(model: torch.nn.Module, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensor behind each key: peft's state-dict entry, else the named parameter."""
    peft_state = (
        get_peft_model_state_dict(model) if isinstance(model, PeftModel) else {}
    )
    named = dict(model.named_parameters())
    return {key: peft_state[key] if key in peft_state else named[key] for key in keys}


def live_parameters(
    model: torch.nn.Module, keys: Iterable[str]
) -> dict[str, torch.nn.Parameter]:
    """The live ``nn.Parameter`` behind each key (peft's state-dict keys or the
    model's parameter names), matched by storage, not by name.

    Used to switch ``requires_grad`` by role and to load values in place.
    """
    by_ptr = {p.data_ptr(): p for p in model.parameters()}
    return {key: by_ptr[t.data_ptr()] for key, t in _tensors(model, keys).items()}


def parameters_by_key(
    model: PeftModel, layout: AdapterLayout
) -> dict[str, torch.nn.Parameter]:
    """The live ``nn.Parameter`` behind every key of ``layout``."""
    return live_parameters(model, layout.all_keys())


@dataclass
class LoraModel(AdaptedModel):
    """A LoRA-adapted model with its declared layout and pristine base weights.

    Attributes
    ----------
    model : peft.PeftModel
    layout : AdapterLayout
    pristine_base : dict of str to torch.Tensor
        The base weights as built, to restore when a round does not send them
        (a cached model may have received FedEx-updated ones earlier).
    """

    model: PeftModel
    layout: AdapterLayout
    pristine_base: dict[str, torch.Tensor]

    def train_only(self, roles: Iterable[Role]) -> None:
        """Make exactly the tensors with ``roles`` trainable (by declared role)."""
        trainable = set(self.layout.keys(*roles))
        for key, param in parameters_by_key(self.model, self.layout).items():
            param.requires_grad_(key in trainable)

    def state(self, roles: Iterable[Role]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the tensors with ``roles``."""
        return adapter_state(self.model, self.layout, tuple(roles))

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a round's global ``state``; absent base weights become pristine."""
        restore = {k: v for k, v in self.pristine_base.items() if k not in state}
        load_adapter_state(self.model, self.layout, {**restore, **state})
