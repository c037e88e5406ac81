"""FedBuff-LoRA: buffered asynchronous aggregation of LoRA factors.

Nguyen et al. [1]_ (Algorithm 1): each node trains from the global model it
was sent, ``x_tau``, and sends its change ``Delta_k = y_k - x_tau``; the
server adds each reply's staleness-weighted change to a buffer and, every
``K`` replies, takes one step

    x_{t+1} = x_t + eta_g * sum_k w_k s(t - tau_k) (y_k - x_{tau_k}),

``w_k = n_k / sum_j n_j`` the buffered replies' shares of their
``num-examples`` (the paper's uniform ``1/K`` is the equal-size case),
``s(d) = 1 / sqrt(1 + d)`` by default (the paper's; any of
:mod:`fedlr.strategies.async_lora`'s functions). On LoRA factors it is
applied to every trained tensor separately: ``lora_A``, ``lora_B`` and the
head, as FedAvg-LoRA averages them.

Computed in float64 as one weighted sum over the replies' arrays and the
distinct base versions, rounded once to the arrays' dtype:

    x_{t+1} = sum_k c_k y_k + sum_v b_v x_v,
    c_k = eta_g w_k s_k,   b_v = [v = t] - sum_{k: tau_k = v} c_k,

with ``b_t`` computed as ``(N - eta_g sum_{k fresh} n_k s_k) / N`` (``N =
sum_k n_k``). With ``K`` the round's sample, no staleness (``s = 1``) and
``eta_g = 1``, ``b_t`` is exactly 0 and ``sum_k c_k y_k`` is FedAvg-LoRA's
weighted mean, operation for operation: the published arrays equal
FedAvg-LoRA's bit for bit (``tests/strategies/test_async.py``).

References
----------
.. [1] Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, "Federated
   Learning with Buffered Asynchronous Aggregation", AISTATS 2022.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.linalg import normalise_weights
from fedlr.options import option, redeclare
from fedlr.strategies.async_lora import (
    AsyncLoraStrategy,
    AsyncOptions,
    base_of,
    staleness_of,
    staleness_weight,
    weighted_sum,
)
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.fedavgm_lora import ServerMomentumOptions
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedBuffLoRA", "FedBuffOptions", "fedbuff_coefficients"]


@dataclass(frozen=True)
class FedBuffOptions(AsyncOptions):
    """FedBuff-LoRA's run-config keys: the engine's, ``K`` and ``eta_g``."""

    buffer_size: int = option(
        10,
        "FedBuff: replies buffered per server step, K "
        "([methods/fedbuff-lora.md](methods/fedbuff-lora.md))",
        range=">= 1",
    )
    server_lr: float = redeclare(ServerMomentumOptions, "server-lr", 1.0)


def fedbuff_coefficients(
    updates: list[ClientUpdate], weights: list[float], eta: float
) -> tuple[torch.Tensor, float, dict[int, float]]:
    """The float64 coefficients of one FedBuff step (module docstring).

    Parameters
    ----------
    updates : list of ClientUpdate
        The buffer (plain updates are fresh).
    weights : list of float
        ``s_k``, each update's staleness weight.
    eta : float
        ``eta_g``.

    Returns
    -------
    c : (K,) float64 tensor
        The replies' coefficients ``eta w_k s_k``.
    b_current : float
        The current state's coefficient ``(N - eta sum_{fresh} n_k s_k) / N``.
    b_stale : dict of int to float
        Each stale base version's coefficient ``-sum_{k: tau_k = v} c_k``.
    """
    examples = [u.weight for u in updates]
    shares = normalise_weights(examples, len(updates))
    s = torch.tensor(weights, dtype=torch.float64)
    c = shares * (eta * s)
    total = float(sum(examples))
    fresh = sum(
        eta * n * w
        for u, n, w in zip(updates, examples, weights, strict=True)
        if staleness_of(u) == 0
    )
    b_current = (total - fresh) / total
    b_stale: dict[int, float] = {}
    for k, u in enumerate(updates):
        if staleness_of(u) > 0:
            version = getattr(u, "version", -1)
            b_stale[version] = b_stale.get(version, 0.0) - float(c[k])
    return c, b_current, b_stale


@register_method(
    "fedbuff-lora",
    payload=LORA,
    options=FedBuffOptions,
    summary="FedBuff: asynchronous; every K replies, the staleness-weighted "
    "mean change of A and B",
    client_contract=ClientContract(
        carries="as FedAvg",
        helpers="nothing on the client. The asynchrony is fedlr's ServerApp loop: "
        "under your own ServerApp's synchronous `strategy.start()` every reply is "
        "fresh (staleness 0)",
    ),
)
class FedBuffLoRA(AsyncLoraStrategy):
    """Buffered asynchronous FedAvg of A, B and the head (module docstring).

    Parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: FedBuffOptions

    @property
    def buffer_size(self) -> int:
        return self.method_options.buffer_size

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        opts = self.method_options
        weights = [staleness_weight(staleness_of(u), opts) for u in updates]
        c, b_current, b_stale = fedbuff_coefficients(updates, weights, opts.server_lr)
        bases: dict[int, Mapping[str, torch.Tensor]] = {}
        for u in updates:
            if staleness_of(u) > 0:
                bases.setdefault(getattr(u, "version", -1), base_of(u, current))
        state = dict(current)
        for key in self.layout.keys(*self.train_roles):
            acc = weighted_sum([u.arrays[key] for u in updates], c)
            if b_current != 0.0:
                acc.add_(current[key].to(acc.dtype), alpha=b_current)
            for version, coefficient in sorted(b_stale.items()):
                if coefficient != 0.0:
                    acc.add_(bases[version][key].to(acc.dtype), alpha=coefficient)
            state[key] = acc.to(current[key].dtype)
        report = self.gap_report(updates)
        report.metrics.update(self.staleness_report(updates))
        return state, report
