"""fedlr strategies: one module per method, each a Flower ``Strategy``.

Importing this package registers every method (see :mod:`strategies.registry`).
"""

from strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from strategies.fedavg_lora import FedAvgLoRA
from strategies.fedex_lora import FedExLoRA
from strategies.lora import LoraStrategy
from strategies.qrmix import QRMix, VisionFedAvg
from strategies.registry import (
    MethodSpec,
    available_methods,
    get_method,
    register_method,
)

__all__ = [
    "ClientUpdate",
    "FedAvgLoRA",
    "FedExLoRA",
    "FedLRStrategy",
    "LoraStrategy",
    "MethodSpec",
    "QRMix",
    "RoundReport",
    "VisionFedAvg",
    "available_methods",
    "get_method",
    "register_method",
]
