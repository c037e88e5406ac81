"""FedAdam-LoRA, and the adaptive server step it shares with FedYogi and FedAdagrad.

Reddi et al.'s FedOpt [1]_ keeps the clients' round (FedAvg-LoRA's: every
trained tensor, each ``lora_A``, ``lora_B`` and the head) and replaces the
server's step by an adaptive optimiser's. Per trained tensor, with
``x_bar = sum_i w_i x_i`` (``w_i`` the clients' shares of ``u.weight``) and
round ``t``, elementwise, in float64:

    Delta_t = x_bar - x_t,
    m_t     = beta1 m_{t-1} + (1 - beta1) Delta_t,        m_0 = 0,
    v_t     = (the optimiser's second moment of Delta_t), v_0 = 0,
    x_{t+1} = x_t + eta_t m_t / (sqrt(v_t) + tau),

cast back to each tensor's dtype. :class:`AdaptiveServerLoRA` is that round;
a method says only its ``v_t`` and its step size ``eta_t`` (the hooks
``next_second_moment`` and ``server_step``). FedAdam's, here:

    v_t   = beta2 v_{t-1} + (1 - beta2) Delta_t**2,
    eta_t = eta sqrt(1 - beta2**(t + 1)) / (1 - beta1**(t + 1)).

The bias correction ``eta_t`` and its exponent ``t + 1`` (``t`` the server
round, from 1) are Flower 1.41's ``flwr.serverapp.strategy.FedAdam``, as are
the defaults ``beta1 = 0.9``, ``beta2 = 0.99``, ``tau = 1e-3`` (``eta`` is
0.01, not Flower's 0.1, which leaves LoRA factors at chance): the two agree
on the same arrays and options to float32 rounding (its row in
``tests/strategies/test_every_method.py``). FedYogi-LoRA and FedAdagrad-LoRA
(:mod:`fedlr.strategies.fedyogi_lora`, :mod:`fedlr.strategies.fedadagrad_lora`)
are the two other subclasses. Server-only: the clients run the plain LoRA
round; the aggregation reads only the weighted mean, a sum.

References
----------
.. [1] Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan,
   "Adaptive Federated Optimization", ICLR 2021.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.linalg import weighted_mean
from fedlr.options import NoOptions, option, redeclare
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.fedavgm_lora import ServerMomentumOptions
from fedlr.strategies.lora import LoraStrategy, saved_tensors
from fedlr.strategies.registration import ClientContract, register_method

__all__ = [
    "AdaptiveServerLoRA",
    "FedAdamLoRA",
    "FedAdamOptions",
    "ServerStep",
    "adam_step_size",
]

FIRST_MOMENT, SECOND_MOMENT = "first-moment", "second-moment"
"""The :meth:`AdaptiveServerLoRA.state_dict` keys of ``m`` and ``v``."""


@dataclass(frozen=True)
class FedAdamOptions(NoOptions):
    """FedAdam-LoRA's run-config keys: Flower's ``FedAdam`` defaults but
    ``server-lr``, 0.01 (Flower's 0.1 leaves LoRA factors at chance;
    docs/methods/fedadam-lora.md)."""

    server_lr: float = redeclare(ServerMomentumOptions, "server-lr", 0.01)
    server_beta1: float = option(
        0.9,
        "first-moment decay β₁ of the adaptive server step "
        "([methods/fedadam-lora.md](methods/fedadam-lora.md))",
        range="[0, 1)",
    )
    server_beta2: float = option(
        0.99, "second-moment decay β₂ of the adaptive server step", range="[0, 1)"
    )
    server_tau: float = option(
        1e-3,
        "adaptivity τ of the adaptive server step, added to √v in its denominator",
        range="> 0",
    )


@dataclass(frozen=True)
class ServerStep:
    """One round's scalars of ``x + eta m / (sqrt(v) + tau)``.

    Attributes
    ----------
    eta : float
        The round's step size ``eta_t`` (bias-corrected or not).
    beta1 : float
        The first-moment decay (0: ``m_t = Delta_t``).
    tau : float
        The adaptivity, added to ``sqrt(v_t)``.
    """

    eta: float
    beta1: float
    tau: float


def adam_step_size(eta: float, beta1: float, beta2: float, server_round: int) -> float:
    """Flower's bias-corrected step ``eta sqrt(1 - beta2**(t+1)) / (1 - beta1**(t+1))``.

    ``t`` is the server round (from 1), as in Flower 1.41's ``FedAdam``.
    """
    t = server_round + 1.0
    return eta * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)


class AdaptiveServerLoRA(LoraStrategy):
    """FedAvg-LoRA's mean as the pseudo-gradient of an adaptive server step.

    Not a method: the round FedAdam-, FedYogi- and FedAdagrad-LoRA share.
    A subclass gives :meth:`server_step` (``eta_t``, ``beta1``, ``tau``)
    and :meth:`next_second_moment` (``v_t``). The moments ``m`` and ``v``
    (per trained tensor, zero at the start, in the tensor's dtype) are saved in
    :meth:`state_dict`; nothing else changes in a round. The round reports
    the gap of FedAvg-LoRA's mean (as ``fedavg-lora`` does) and
    ``server-step-norm``, ``||x_{t+1} - x_t||_F`` over the trained tensors.

    Parameters
    ----------
    **kwargs
        See :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    extra_columns: tuple[str, ...] = ("server-step-norm",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.first_moment: dict[str, torch.Tensor] = {}
        self.second_moment: dict[str, torch.Tensor] = {}

    def server_step(self, server_round: int) -> ServerStep:
        """The round's ``eta_t``, ``beta1`` and ``tau`` (from the options)."""
        raise NotImplementedError

    def next_second_moment(
        self, previous: torch.Tensor | None, delta: torch.Tensor
    ) -> torch.Tensor:
        """``v_t`` from ``v_{t-1}`` (``None``: zero, the first round) and
        ``Delta_t``, elementwise, both float64 of one tensor's shape."""
        raise NotImplementedError

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        step = self.server_step(server_round)
        beta1 = step.beta1
        weights = [u.weight for u in updates]
        state = dict(current)
        first: dict[str, torch.Tensor] = {}
        second: dict[str, torch.Tensor] = {}
        step_sq = 0.0
        for key in self.layout.keys(*self.train_roles):
            x = current[key].double()
            mean = weighted_mean(
                [u.arrays[key] for u in updates], weights, dtype=torch.float64
            )
            delta = mean - x
            m = (1.0 - beta1) * delta
            previous = None
            if key in self.first_moment:
                m += beta1 * self.first_moment[key].double()
                previous = self.second_moment[key].double()
            v = self.next_second_moment(previous, delta)
            change = step.eta * m / (v.sqrt() + step.tau)
            first[key] = m.to(current[key].dtype)
            second[key] = v.to(current[key].dtype)
            state[key] = (x + change).to(current[key].dtype)
            step_sq += float(change.square().sum())
        self.first_moment, self.second_moment = first, second
        report = self.gap_report(updates)
        report.metrics["server-step-norm"] = math.sqrt(step_sq)
        return state, report

    def state_dict(self) -> dict[str, Any]:
        """The moments ``m`` and ``v``, by tensor key."""
        return {
            FIRST_MOMENT: {k: t.clone() for k, t in self.first_moment.items()},
            SECOND_MOMENT: {k: t.clone() for k, t in self.second_moment.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the moments of :meth:`state_dict` (both, or neither).

        Raises
        ------
        ValueError
            For an unknown key, a moment that does not fit the layout, or
            ``m`` and ``v`` of different tensors.
        """
        names = (FIRST_MOMENT, SECOND_MOMENT)
        unknown = sorted(set(state) - set(names))
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown state keys {unknown}")
        shapes = self.layout.shapes(*self.train_roles)
        first, second = (
            saved_tensors(
                self, {n: state[n]} if n in state else {}, n, shapes, complete=False
            )
            or {}
            for n in names
        )
        if first.keys() != second.keys():
            raise ValueError(
                f"{type(self).__name__}: the saved {FIRST_MOMENT} and "
                f"{SECOND_MOMENT} are of different tensors: "
                f"{sorted(first.keys() ^ second.keys())}"
            )
        self.first_moment, self.second_moment = first, second


@register_method(
    "fedadam-lora",
    payload=LORA,
    options=FedAdamOptions,
    summary="FedAvg of A and B as Adam's pseudo-gradient on the server",
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg", helpers="nothing: Adam on the server only"
    ),
)
class FedAdamLoRA(AdaptiveServerLoRA):
    """FedAvg-LoRA's mean with an Adam step on the server.

    ``v_t = beta2 v_{t-1} + (1 - beta2) Delta_t**2`` and Flower's
    bias-corrected step (:func:`adam_step_size`); the round, its state and
    its report are :class:`AdaptiveServerLoRA`'s.

    Parameters
    ----------
    options : FedAdamOptions, optional
        ``server_lr`` (eta), ``server_beta1``, ``server_beta2``,
        ``server_tau``; default: their defaults (or pass any by name).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: FedAdamOptions

    def server_step(self, server_round: int) -> ServerStep:
        opts = self.method_options
        eta_t = adam_step_size(
            opts.server_lr, opts.server_beta1, opts.server_beta2, server_round
        )
        return ServerStep(eta=eta_t, beta1=opts.server_beta1, tau=opts.server_tau)

    def next_second_moment(
        self, previous: torch.Tensor | None, delta: torch.Tensor
    ) -> torch.Tensor:
        beta2 = self.method_options.server_beta2
        v = (1.0 - beta2) * delta.square()
        if previous is not None:
            v += beta2 * previous
        return v
