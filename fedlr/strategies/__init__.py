"""fedlr strategies: one module per method, each a Flower ``Strategy``.

Every method registers itself in its own module
(:func:`~fedlr.strategies.registry.register_method`); the registry imports
the modules of this package on its first lookup. Every registered method's
strategy class is exported here under its class name, from the registry; the
table below adds the shared bases and option classes. Names are resolved on
first access, so importing one strategy module imports no other.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "ClientUpdate": "base",
    "FedLRStrategy": "base",
    "RoundReport": "base",
    "FactoredDownlink": "fedex_downlink",
    "ProximalOptions": "fedprox_lora",
    "FedSpecOptions": "fedspec",
    "FOTOptions": "fot",
    "HeteroFedSpec": "fedspec",
    "HeteroRankLoRA": "hetero",
    "LegacyStrategy": "legacy",
    "LoraStrategy": "lora",
    "PersonalLoraStrategy": "lora_svd",
    "SeededLoraStrategy": "lora_svd",
    "QRMixOptions": "qrmix",
    "MethodConfig": "registry",
    "MethodSpec": "registry",
    "PayloadKind": "registry",
    "available_methods": "registry",
    "get_method": "registry",
    "register_method": "registry",
    "registered_methods": "registry",
    "resolve": "registry",
    "VeraFedExOptions": "vera",
    "VeraStrategy": "vera",
}


def _strategies() -> dict[str, Any]:
    """Every registered method's strategy class, by class name."""
    registry = importlib.import_module(f"{__name__}.registry")
    return {s.strategy.__name__: s.strategy for s in registry.registered_methods()}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        module = importlib.import_module(f"{__name__}.{_NAMES[name]}")
        return getattr(module, name)
    if name == "__all__":
        return sorted({*_NAMES, *_strategies()})
    if name[:1].isupper():  # a class name, never a submodule's
        strategies = _strategies()
        if name in strategies:
            return strategies[name]
    raise AttributeError(f"module '{__name__}' has no attribute '{name}'")
