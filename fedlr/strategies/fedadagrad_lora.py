"""FedAdagrad-LoRA: the weighted mean of the LoRA factors as Adagrad's pseudo-gradient.

FedAdagrad [1]_ scales the server's step of each coordinate by the root of
the sum of all its past squared pseudo-gradients (Adagrad [2]_): coordinates
that keep moving take ever smaller steps, rarely moving ones keep large
ones. Per trained tensor (each ``lora_A``, ``lora_B`` and the head), with
``x_bar = sum_i w_i x_i`` (``w_i`` the clients' shares of ``u.weight``),
elementwise, in float64:

    Delta_t = x_bar - x_t,
    v_t     = v_{t-1} + Delta_t**2,                      v_0 = 0,
    x_{t+1} = x_t + eta Delta_t / (sqrt(v_t) + tau),

without momentum (``m_t = Delta_t``) or bias correction, as Flower 1.41's
``flwr.serverapp.strategy.FedAdagrad`` (its ``tau = 1e-3``; ``eta`` is 0.01,
not its 0.1, which leaves LoRA factors at chance); the two agree on the same
arrays and options to float32 rounding (its row in
``tests/strategies/test_every_method.py``). The round, its state
(``m``, ``v``) and its report are
:class:`~fedlr.strategies.fedadam_lora.AdaptiveServerLoRA`'s. Server-only:
the clients run the plain LoRA round; the aggregation reads only the
weighted mean, a sum.

References
----------
.. [1] Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan,
   "Adaptive Federated Optimization", ICLR 2021.
.. [2] Duchi, Hazan, Singer, "Adaptive Subgradient Methods for Online
   Learning and Stochastic Optimization", JMLR 2011.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.options import NoOptions, redeclare
from fedlr.strategies.fedadam_lora import AdaptiveServerLoRA, FedAdamOptions, ServerStep
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedAdagradLoRA", "FedAdagradOptions"]


@dataclass(frozen=True)
class FedAdagradOptions(NoOptions):
    """FedAdagrad-LoRA's run-config keys: Flower's ``FedAdagrad`` defaults
    but ``server-lr``, 0.01 (Flower's 0.1 leaves LoRA factors at chance;
    docs/methods/fedadagrad-lora.md)."""

    server_lr: float = redeclare(FedAdamOptions, "server-lr", 0.01)
    server_tau: float = redeclare(FedAdamOptions, "server-tau", 1e-3)


@register_method(
    "fedadagrad-lora",
    payload=LORA,
    options=FedAdagradOptions,
    summary="FedAvg of A and B as Adagrad's pseudo-gradient on the server",
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg", helpers="nothing: Adagrad on the server only"
    ),
)
class FedAdagradLoRA(AdaptiveServerLoRA):
    """FedAvg-LoRA's mean with an Adagrad step on the server.

    ``v_t = v_{t-1} + Delta_t**2``, ``beta1 = 0`` (the step follows
    ``Delta_t`` itself) and the step ``eta`` in every round.

    Parameters
    ----------
    options : FedAdagradOptions, optional
        ``server_lr`` (eta), ``server_tau``; default: their defaults (or
        pass either by name).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: FedAdagradOptions

    def server_step(self, server_round: int) -> ServerStep:
        opts = self.method_options
        return ServerStep(eta=opts.server_lr, beta1=0.0, tau=opts.server_tau)

    def next_second_moment(
        self, previous: torch.Tensor | None, delta: torch.Tensor
    ) -> torch.Tensor:
        squared = delta.square()
        return squared if previous is None else previous + squared
