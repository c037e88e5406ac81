"""FedYogi-LoRA: the weighted mean of the LoRA factors as Yogi's pseudo-gradient.

FedYogi [1]_ is FedAdam with Yogi's second moment [2]_: ``v`` changes by
``(1 - beta2) Delta_t**2`` towards ``Delta_t**2``, an amount set by the
update alone, where Adam's changes by ``(1 - beta2) (Delta_t**2 - v)``, set
by the gap. After large updates a run of small ones shrinks ``v`` (and so
raises the effective step ``eta / sqrt(v)``) slowly, where Adam's ``v``
forgets them geometrically. Per trained tensor (each ``lora_A``, ``lora_B``
and the head), with ``x_bar = sum_i w_i x_i`` (``w_i`` the clients' shares
of ``u.weight``), elementwise, in float64:

    Delta_t = x_bar - x_t,
    m_t     = beta1 m_{t-1} + (1 - beta1) Delta_t,                      m_0 = 0,
    v_t     = v_{t-1} - (1 - beta2) Delta_t**2 sign(v_{t-1} - Delta_t**2), v_0 = 0,
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau),

without bias correction, as the paper's Algorithm 2 and Flower 1.41's
``flwr.serverapp.strategy.FedYogi``, whose defaults these are (``eta =
0.01``, ``beta1 = 0.9``, ``beta2 = 0.99``, ``tau = 1e-3``); the two agree on
the same arrays to float32 rounding (its row in
``tests/strategies/test_every_method.py``). The round, its state (``m``,
``v``) and its report are
:class:`~fedlr.strategies.fedadam_lora.AdaptiveServerLoRA`'s. Server-only:
the clients run the plain LoRA round; the aggregation reads only the
weighted mean, a sum.

References
----------
.. [1] Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan,
   "Adaptive Federated Optimization", ICLR 2021.
.. [2] Zaheer, Reddi, Sachan, Kale, Kumar, "Adaptive Methods for Nonconvex
   Optimization", NeurIPS 2018.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.options import NoOptions, redeclare
from fedlr.strategies.fedadam_lora import AdaptiveServerLoRA, FedAdamOptions, ServerStep
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedYogiLoRA", "FedYogiOptions"]


@dataclass(frozen=True)
class FedYogiOptions(NoOptions):
    """FedYogi-LoRA's run-config keys (Flower's ``FedYogi`` defaults)."""

    server_lr: float = redeclare(FedAdamOptions, "server-lr", 0.01)
    server_beta1: float = redeclare(FedAdamOptions, "server-beta1", 0.9)
    server_beta2: float = redeclare(FedAdamOptions, "server-beta2", 0.99)
    server_tau: float = redeclare(FedAdamOptions, "server-tau", 1e-3)


@register_method(
    "fedyogi-lora",
    payload=LORA,
    options=FedYogiOptions,
    summary="FedAvg of A and B as Yogi's pseudo-gradient on the server",
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg", helpers="nothing: Yogi on the server only"
    ),
)
class FedYogiLoRA(AdaptiveServerLoRA):
    """FedAvg-LoRA's mean with a Yogi step on the server.

    ``v_t = v_{t-1} - (1 - beta2) Delta_t**2 sign(v_{t-1} - Delta_t**2)``
    (``v`` stays >= 0: above ``Delta_t**2`` it falls by less than the gap,
    below it it grows) and the step ``eta`` in every round.

    Parameters
    ----------
    options : FedYogiOptions, optional
        ``server_lr`` (eta), ``server_beta1``, ``server_beta2``,
        ``server_tau``; default: their defaults (or pass any by name).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: FedYogiOptions

    def server_step(self, server_round: int) -> ServerStep:
        opts = self.method_options
        return ServerStep(
            eta=opts.server_lr, beta1=opts.server_beta1, tau=opts.server_tau
        )

    def next_second_moment(
        self, previous: torch.Tensor | None, delta: torch.Tensor
    ) -> torch.Tensor:
        squared = delta.square()
        v = torch.zeros_like(squared) if previous is None else previous
        return v - (1.0 - self.method_options.server_beta2) * squared * torch.sign(
            v - squared
        )
