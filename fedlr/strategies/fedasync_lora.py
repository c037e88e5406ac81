"""FedAsync-LoRA: every reply mixed into the global LoRA factors at once.

Xie et al. [1]_ (Algorithm 1, "Option I"): a node trains from the global
model ``x_tau`` it was sent; its model ``y`` reaches the server at version
``t`` and is mixed in at once,

    x_{t+1} = (1 - alpha_t) x_t + alpha_t y,    alpha_t = alpha * s(t - tau),

``s`` a staleness function (:mod:`fedlr.strategies.async_lora`: polynomial
``(1 + d)^(-a)`` by default with the paper's ``a = 0.5``, hinge, or
constant), ``alpha`` the mixing hyperparameter (``async-alpha``, default 0.6,
the paper's middle setting). On LoRA factors each trained tensor is mixed
separately: ``lora_A``, ``lora_B`` and the head, in float64, rounded once to
the arrays' dtype.

The engine applies one reply per server version. Called with several
updates (Flower's synchronous ``start()``, the shared strategy tests) the
method mixes them in turn, in the order given, each as its own version.

References
----------
.. [1] Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", OPT 2020
   (arXiv:1903.03934, 2019).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.options import option
from fedlr.strategies.async_lora import (
    AsyncLoraStrategy,
    AsyncOptions,
    check_finite_weight,
    staleness_of,
    staleness_weight,
)
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedAsyncLoRA", "FedAsyncOptions", "mixing_weight"]


@dataclass(frozen=True)
class FedAsyncOptions(AsyncOptions):
    """FedAsync-LoRA's run-config keys (the asynchronous engine's, and ``alpha``)."""

    async_alpha: float = option(
        0.6,
        "FedAsync: the mixing weight α of a fresh reply, α_t = α s(δ) "
        "([methods/fedasync-lora.md](methods/fedasync-lora.md))",
        range="(0, 1]",
    )


def mixing_weight(staleness: int, options: FedAsyncOptions) -> float:
    """``alpha_t = alpha * s(staleness)``."""
    return options.async_alpha * staleness_weight(staleness, options)


@register_method(
    "fedasync-lora",
    payload=LORA,
    options=FedAsyncOptions,
    summary="FedAsync: asynchronous; each reply's A and B mixed in at once, "
    "weighted by its staleness",
    client_contract=ClientContract(
        carries="as FedAvg",
        helpers="nothing on the client. The asynchrony is fedlr's ServerApp loop: "
        "under your own ServerApp's synchronous `strategy.start()` every reply is "
        "fresh and mixed in turn",
    ),
)
class FedAsyncLoRA(AsyncLoraStrategy):
    """Asynchronous mixing of A, B and the head (module docstring).

    Parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: FedAsyncOptions

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        opts = self.method_options
        keys = self.layout.keys(*self.train_roles)
        mixed = {key: current[key].to(torch.float64) for key in keys}
        alphas = []
        for u in updates:
            alpha = check_finite_weight(
                mixing_weight(staleness_of(u), opts), "the mixing weight"
            )
            alphas.append(alpha)
            for key in keys:
                y = u.arrays[key].to(torch.float64)
                mixed[key] = (1.0 - alpha) * mixed[key] + alpha * y
        state = dict(current)
        state.update({key: mixed[key].to(current[key].dtype) for key in keys})
        report = self.gap_report(updates)
        report.metrics.update(self.staleness_report(updates))
        if alphas:
            report.metrics["mixing-weight"] = alphas[-1]
        return state, report
