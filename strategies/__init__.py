"""fedlr strategies: one module per method, each a Flower ``Strategy``.

Importing this package registers every method (see :mod:`strategies.registry`).
"""

from strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from strategies.fedavg_lora import FedAvgLoRA
from strategies.fedex_lora import FedExLoRA
from strategies.lora import LoraStrategy
from strategies.registry import (
    MethodSpec,
    available_methods,
    get_method,
    register_method,
)
from strategies.sorf_vera import SorfVeRA
from strategies.vera import FedAvgVeRA, VeraFedEx, VeraStrategy

__all__ = [
    "ClientUpdate",
    "FedAvgLoRA",
    "FedAvgVeRA",
    "FedExLoRA",
    "FedLRStrategy",
    "LoraStrategy",
    "MethodSpec",
    "RoundReport",
    "SorfVeRA",
    "VeraFedEx",
    "VeraStrategy",
    "available_methods",
    "get_method",
    "register_method",
]
