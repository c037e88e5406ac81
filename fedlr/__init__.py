"""fedlr: federated fine-tuning on Flower with exact low-rank aggregation.

Plug-in users import strategies from here::

    from fedlr import FedExLoRA, AdapterLayout
    from fedlr import apply_round  # the client side of a plug-in ClientApp

The library itself (``fedlr.linalg``, ``fedlr.adapters``, ...) does not import
Flower; strategy names are resolved lazily from the ``strategies`` package.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "FedAvgLoRA": "fedlr.strategies",
    "FedExLoRA": "fedlr.strategies",
    "FedProxLoRA": "fedlr.strategies",
    "FOT": "fedlr.strategies",
    "FedAvgContinual": "fedlr.strategies",
    "FedLRStrategy": "fedlr.strategies",
    "LoraStrategy": "fedlr.strategies",
    "QRMix": "fedlr.strategies",
    "VisionFedAvg": "fedlr.strategies",
    "FedAvgVeRA": "fedlr.strategies",
    "VeraFedEx": "fedlr.strategies",
    "SorfVeRA": "fedlr.strategies",
    "available_methods": "fedlr.strategies",
    "get_method": "fedlr.strategies",
    "LegacyStrategy": "fedlr.strategies.legacy",
    "FFALoRA": "fedlr.strategies",
    "FedSVD": "fedlr.strategies",
    "FedSpec": "fedlr.strategies",
    "FedSALoRA": "fedlr.strategies",
    "GlobalSVD": "fedlr.strategies",
    "LocalSVD": "fedlr.strategies",
    "FlexLoRA": "fedlr.strategies",
    "HetLoRA": "fedlr.strategies",
    "FLoRA": "fedlr.strategies",
    "AdapterLayout": "fedlr.adapters",
    "LoraSettings": "fedlr.adapters",
    "adapter_state": "fedlr.adapters",
    "apply_lora": "fedlr.adapters",
    "load_adapter_state": "fedlr.adapters",
    "lora_layout": "fedlr.adapters",
    "LoraModule": "fedlr.adapters",
    "Role": "fedlr.adapters",
    "RunConfig": "fedlr.config",
    "InProcessGrid": "fedlr.flower",
    "ClientRound": "fedlr.client",
    "apply_round": "fedlr.client",
    "RobustConfig": "fedlr.robust",
    "SorfVeraSettings": "fedlr.adapters",
    "build_sorf_vera_model": "fedlr.adapters",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedlr' has no attribute '{name}'")
