"""fedlr: federated fine-tuning on Flower with exact low-rank aggregation.

Plug-in users import strategies from here::

    from fedlr import FedExLoRA, AdapterLayout
    from fedlr import apply_round  # the client side of a plug-in ClientApp

The library itself (``fedlr.linalg``, ``fedlr.adapters``, ...) does not import
Flower; names are resolved lazily. Every registered method's strategy class is
exported under its class name, found in the method registry
(:func:`fedlr.strategies.registry.registered_methods`), so a new method is
importable from here without an edit to this file.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "FedLRStrategy": "fedlr.strategies",
    "LoraStrategy": "fedlr.strategies",
    "available_methods": "fedlr.strategies",
    "get_method": "fedlr.strategies",
    "LegacyStrategy": "fedlr.strategies.legacy",
    "AdapterLayout": "fedlr.adapters",
    "LoraSettings": "fedlr.adapters",
    "adapter_state": "fedlr.adapters",
    "apply_lora": "fedlr.adapters",
    "load_adapter_state": "fedlr.adapters",
    "lora_layout": "fedlr.adapters",
    "LoraModule": "fedlr.adapters",
    "Role": "fedlr.adapters",
    "RunConfig": "fedlr.config.run",
    "InProcessGrid": "fedlr.flower",
    "ClientRound": "fedlr.client.round",
    "apply_round": "fedlr.client.round",
    "RobustConfig": "fedlr.robust.rules",
    "SorfVeraSettings": "fedlr.adapters",
    "build_sorf_vera_model": "fedlr.adapters",
}


def _strategies() -> dict[str, Any]:
    """Every registered method's strategy class, by class name."""
    registry = importlib.import_module("fedlr.strategies.registry")
    return {s.strategy.__name__: s.strategy for s in registry.registered_methods()}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        if _LAZY[name] == "fedlr.client.round":  # its client features: every method's
            _strategies()
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "__all__":
        return ["__version__", *sorted({*_LAZY, *_strategies()})]
    if name[:1].isupper():  # a class name, never a submodule's
        strategies = _strategies()
        if name in strategies:
            return strategies[name]
    raise AttributeError(f"module 'fedlr' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_strategies()})
