"""fedlr strategies: one module per method, each a Flower ``Strategy``.

Importing this package registers every method (see :mod:`fedlr.strategies.registry`).
"""

from fedlr.strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.fedex_lora import FedExLoRA
from fedlr.strategies.fedsa_lora import FedSALoRA
from fedlr.strategies.fedspec import FedSpec
from fedlr.strategies.fedsvd import FedSVD
from fedlr.strategies.ffa_lora import FFALoRA
from fedlr.strategies.fot import FOT, FedAvgContinual
from fedlr.strategies.global_svd import GlobalSVD, LocalSVD
from fedlr.strategies.lora import LoraStrategy
from fedlr.strategies.lora_svd import PersonalLoraStrategy, SvdLoraStrategy
from fedlr.strategies.qrmix import QRMix, VisionFedAvg
from fedlr.strategies.registry import (
    MethodSpec,
    available_methods,
    get_method,
    register_method,
)
from fedlr.strategies.sorf_vera import SorfVeRA
from fedlr.strategies.vera import FedAvgVeRA, VeraFedEx, VeraStrategy

__all__ = [
    "FOT",
    "ClientUpdate",
    "FFALoRA",
    "FedAvgContinual",
    "FedAvgLoRA",
    "FedAvgVeRA",
    "FedExLoRA",
    "FedLRStrategy",
    "FedSALoRA",
    "FedSVD",
    "FedSpec",
    "GlobalSVD",
    "LocalSVD",
    "LoraStrategy",
    "MethodSpec",
    "PersonalLoraStrategy",
    "QRMix",
    "RoundReport",
    "SorfVeRA",
    "SvdLoraStrategy",
    "VeraFedEx",
    "VeraStrategy",
    "VisionFedAvg",
    "available_methods",
    "get_method",
    "register_method",
]
