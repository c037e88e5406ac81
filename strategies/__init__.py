"""fedlr strategies: one module per method, each a Flower ``Strategy``.

Importing this package registers every method (see :mod:`strategies.registry`).
"""

from strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from strategies.fedavg_lora import FedAvgLoRA
from strategies.fedex_lora import FedExLoRA
from strategies.fedsa_lora import FedSALoRA
from strategies.fedspec import FedSpec
from strategies.fedsvd import FedSVD
from strategies.ffa_lora import FFALoRA
from strategies.fot import FOT, FedAvgContinual
from strategies.global_svd import GlobalSVD, LocalSVD
from strategies.lora import LoraStrategy
from strategies.lora_svd import PersonalLoraStrategy, SvdLoraStrategy
from strategies.qrmix import QRMix, VisionFedAvg
from strategies.registry import (
    MethodSpec,
    available_methods,
    get_method,
    register_method,
)
from strategies.sorf_vera import SorfVeRA
from strategies.vera import FedAvgVeRA, VeraFedEx, VeraStrategy

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
