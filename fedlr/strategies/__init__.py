"""fedlr strategies: one module per method, each a Flower ``Strategy``.

Every method registers itself in its own module
(:func:`~fedlr.strategies.registry.register_method`); the registry imports
the modules of this package on its first lookup. The names below are resolved
on first access, so importing one strategy module imports no other.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "ClientUpdate": "base",
    "FedLRStrategy": "base",
    "RoundReport": "base",
    "FedAvgLoRA": "fedavg_lora",
    "FactoredDownlink": "fedex_downlink",
    "FedExLoRA": "fedex_lora",
    "FedProxLoRA": "fedprox_lora",
    "ProximalOptions": "fedprox_lora",
    "FedSALoRA": "fedsa_lora",
    "FedSpec": "fedspec",
    "FedSpecOptions": "fedspec",
    "FedSVD": "fedsvd",
    "FFALoRA": "ffa_lora",
    "FOT": "fot",
    "FOTOptions": "fot",
    "FedAvgContinual": "fot",
    "FLoRA": "hetero",
    "FlexLoRA": "hetero",
    "HetLoRA": "hetero",
    "HeteroFedSpec": "fedspec",
    "HeteroRankLoRA": "hetero",
    "GlobalSVD": "global_svd",
    "LocalSVD": "global_svd",
    "LegacyStrategy": "legacy",
    "LoraStrategy": "lora",
    "PersonalLoraStrategy": "lora_svd",
    "SvdLoraStrategy": "lora_svd",
    "QRMix": "qrmix",
    "QRMixOptions": "qrmix",
    "VisionFedAvg": "qrmix",
    "MethodConfig": "registry",
    "MethodSpec": "registry",
    "PayloadKind": "registry",
    "available_methods": "registry",
    "get_method": "registry",
    "register_method": "registry",
    "registered_methods": "registry",
    "resolve": "registry",
    "SorfVeRA": "sorf_vera",
    "FedAvgVeRA": "vera",
    "VeraFedEx": "vera",
    "VeraFedExOptions": "vera",
    "VeraStrategy": "vera",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        module = importlib.import_module(f"{__name__}.{_NAMES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module '{__name__}' has no attribute '{name}'")
