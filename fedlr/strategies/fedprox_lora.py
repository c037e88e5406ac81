"""FedProx-LoRA: FedAvg of the LoRA factors with a proximal term on the clients.

Each client minimises its local loss plus ``(mu / 2) ||theta - theta_t||^2``
over the parameters it trains (LoRA ``A``, ``B`` and the head), where
``theta_t`` are the global values it received this round. The term keeps
local updates near the global model when clients' data differ; the server
aggregates exactly as FedAvg-LoRA does. ``mu`` travels to the clients as
``proximal-mu`` in the round's ConfigRecord, as in Flower's ``FedProx``.

References
----------
.. [1] Li et al., "Federated Optimization in Heterogeneous Networks"
   (FedProx), MLSys 2020.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import torch

from fedlr.client.features import Bound, ClientFeature, RoundJob
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float
from fedlr.options import NoOptions, option
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["PROXIMAL_MU", "FedProxLoRA", "ProximalOptions", "ProximalTerm"]

PROXIMAL_MU = "proximal-mu"
"""Instruction key: weight ``mu`` of the clients' proximal term
``(mu / 2) ||theta - theta_global||^2`` over the trained parameters."""


class ProximalTerm(ClientFeature):
    """The client side: ``(mu / 2) sum_p ||p - p_0||^2`` added to the loss.

    On for a ``train`` instruction with ``proximal-mu`` > 0; ``p`` runs over
    the parameters the round trains and ``p_0`` are their values as loaded
    (the global ones).

    The term reads no data (a function of the parameters and the received
    ones), so DP-SGD adds its gradient ``mu (p - p_0)`` after the per-example
    clipping and noise (:mod:`fedlr.privacy.dp_sgd`).
    """

    keys = (Bound(PROXIMAL_MU, "float", 0.0),)
    loss_reads_data = False
    order = 40

    def __init__(self, mu: float) -> None:
        self.mu = mu

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        mu = options.proximal_mu if isinstance(options, ProximalOptions) else 0.0
        return f"FedProx's proximal term (proximal-mu = {mu:g})" if mu > 0 else None

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if not job.is_train:
            return None
        mu = config_float(job.config, PROXIMAL_MU, 0.0)
        if not (math.isfinite(mu) and mu >= 0):
            raise ProtocolError(f"'{PROXIMAL_MU}' must be >= 0, got {mu}")
        return cls(mu) if mu > 0 else None

    def loss(self, job: RoundJob) -> Callable[[], torch.Tensor]:
        params = job.parameters()
        anchors = [p.detach().clone() for p in params]
        mu = self.mu

        def term() -> torch.Tensor:
            if not params:
                return torch.zeros(())
            total = torch.zeros((), device=params[0].device, dtype=params[0].dtype)
            for p, p0 in zip(params, anchors, strict=True):
                total = total + (p - p0.to(p.device)).pow(2).sum()
            return 0.5 * mu * total

        return term


@dataclass(frozen=True)
class ProximalOptions(NoOptions):
    """FedProx-LoRA's run-config key."""

    proximal_mu: float = option(
        0.01,
        "weight μ of the clients' proximal term (μ/2)·‖θ − θ_global‖² over the "
        "parameters they train (0 gives FedAvg-LoRA)",
        range=">= 0",
    )


@register_method(
    "fedprox-lora",
    payload=LORA,
    options=ProximalOptions,
    summary="FedAvg of A and B; clients add FedProx's proximal term",
    client=(ProximalTerm,),
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg, plus `proximal-mu`",
        helpers="`job.penalty()` is `(mu / 2) ‖θ − θ_global‖²`; add it to your loss",
    ),
)
class FedProxLoRA(FedAvgLoRA):
    """FedAvg-LoRA whose clients train with a proximal term.

    Parameters
    ----------
    layout : AdapterLayout
    options : ProximalOptions, optional
        ``proximal_mu``, the ``mu`` of the proximal term (0 gives FedAvg-LoRA;
        or pass ``proximal_mu=`` by name).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: ProximalOptions

    def round_config(self, server_round: int) -> dict[str, Any]:
        """The base round config plus ``proximal-mu``."""
        config = super().round_config(server_round)
        config[PROXIMAL_MU] = self.method_options.proximal_mu
        return config
