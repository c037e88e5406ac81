"""How an adapted layer stores its base weight: ``nn.Linear`` or GPT-2's ``Conv1D``.

``torch.nn.Linear`` stores ``W0`` as (d_out, d_in), like peft's ``B @ A``.
``transformers.pytorch_utils.Conv1D`` (GPT-2 and other causal LMs) stores it
as (d_in, d_out): peft's ``fan_in_fan_out=True``, under which the layer's
weight is ``W0 + s (B @ A)^T``. Anything that relates ``W0`` to ``B @ A``
(FedEx folds, the factored downlink) transposes for those layers and only
for them; the layouts record which (``LoraModule.fan_in_fan_out``,
``VeraModule.fan_in_fan_out``).
"""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import check_target_module_exists
from transformers.pytorch_utils import Conv1D

from fedlr.errors import ConfigError, UnsupportedModelError

__all__ = [
    "ALL_LINEAR",
    "AUTO_TARGETS",
    "all_linear_layers",
    "peft_targets",
    "resolve_targets",
    "stores_fan_in_fan_out",
    "targets_fan_in_fan_out",
]

ALL_LINEAR = "all-linear"
"""peft's name for every linear layer of a model but its output layer."""


AUTO_TARGETS = (("query", "value"), ("q_proj", "v_proj"), ("c_attn",))
"""What ``target-modules = "auto"`` picks: the first of these groups whose
every name is a module of the model (BERT, LLaMA/Qwen/OPT, GPT-2)."""


def resolve_targets(model: torch.nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """``target-modules`` for ``model``: ``auto`` becomes its attention q/v names.

    Raises
    ------
    ConfigError
        (key ``target-modules``) when ``auto`` finds none of
        :data:`AUTO_TARGETS` in the model.
    """
    if tuple(names) != ("auto",):
        return tuple(names)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for group in AUTO_TARGETS:
        if set(group) <= present:
            return group
    raise ConfigError(
        "target-modules",
        f"'auto' knows {' / '.join(','.join(g) for g in AUTO_TARGETS)}, none of "
        f"which are all in {type(model).__name__}; name the modules to adapt",
    )


def all_linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every ``nn.Linear``/``Conv1D`` but the output layer.

    What ``target-modules = "all-linear"`` adapts (as peft's ``all-linear``:
    the model's output embeddings, when it has them, are left out).
    """
    getter = getattr(model, "get_output_embeddings", None)
    output = getter() if callable(getter) else None
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear | Conv1D) and module is not output
    ]


def peft_targets(names: tuple[str, ...]) -> str | list[str]:
    """``target-modules`` as peft takes it: the string ``"all-linear"`` or a list."""
    return ALL_LINEAR if tuple(names) == (ALL_LINEAR,) else list(names)


def stores_fan_in_fan_out(base_layer: torch.nn.Module, *, name: str = "") -> bool:
    """Whether ``base_layer`` stores its weight as (d_in, d_out).

    Parameters
    ----------
    base_layer : torch.nn.Module
        The layer an adapter wraps (peft's ``get_base_layer()``).
    name : str, optional
        Its module path, for the message.

    Returns
    -------
    bool
        ``True`` for ``Conv1D``, ``False`` for ``nn.Linear``.

    Raises
    ------
    UnsupportedModelError
        For any other layer type (fedlr adapts linear maps only).
    """
    if isinstance(base_layer, Conv1D):
        return True
    if isinstance(base_layer, torch.nn.Linear):
        return False
    raise UnsupportedModelError(
        f"adapted layer '{name}' is a {type(base_layer).__name__}; fedlr adapts "
        "torch.nn.Linear and transformers' Conv1D layers only"
    )


def targets_fan_in_fan_out(model: torch.nn.Module, config: object) -> bool:
    """Whether every module ``config`` targets in ``model`` is a ``Conv1D``.

    The value to give peft's ``fan_in_fan_out`` up front (peft corrects it per
    layer with a warning otherwise); ``False`` when no target matches or the
    targets mix ``nn.Linear`` and ``Conv1D`` (peft then sets each layer's own).

    Parameters
    ----------
    model : torch.nn.Module
        The model before peft wraps it.
    config : peft.LoraConfig or peft.VeraConfig
        Matched with peft's own ``check_target_module_exists``.
    """
    if getattr(config, "target_modules", None) == ALL_LINEAR:
        targets = [module for _, module in all_linear_layers(model)]
    else:
        targets = [
            module
            for name, module in model.named_modules()
            if name and check_target_module_exists(config, name)
        ]
    return bool(targets) and all(isinstance(m, Conv1D) for m in targets)
