"""fedlr strategies: one module per method, each a Flower ``Strategy``.

Importing this package registers every method (see :mod:`strategies.registry`).
"""

from strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from strategies.fedavg_lora import FedAvgLoRA
from strategies.fedex_lora import FedExLoRA
from strategies.fot import FOT, FedAvgContinual
from strategies.lora import LoraStrategy
from strategies.registry import (
    MethodSpec,
    available_methods,
    get_method,
    register_method,
)

__all__ = [
    "FOT",
    "ClientUpdate",
    "FedAvgContinual",
    "FedAvgLoRA",
    "FedExLoRA",
    "FedLRStrategy",
    "LoraStrategy",
    "MethodSpec",
    "RoundReport",
    "available_methods",
    "get_method",
    "register_method",
]
