"""FedAvgM-LoRA: FedAvg of the LoRA factors with server momentum.

The server treats the change FedAvg-LoRA would make as a pseudo-gradient,
``Delta_t = x_t - sum_i w_i x_i`` over every trained tensor (each ``lora_A``,
``lora_B`` and the head; ``w_i`` the clients' example shares), and steps with
heavy-ball momentum [1]_:

    v_{t+1} = beta v_t + Delta_t,
    x_{t+1} = x_t - eta v_{t+1}.

``beta = 0`` and ``eta = 1`` give FedAvg-LoRA exactly. Momentum smooths the
direction across rounds when only some clients take part or their data
differ. Server-only: the clients run the plain LoRA round.

``Delta_t`` is formed from the updates that passed validation, the
update-size screen and the robust rule, nothing else: a dropped reply never
reaches ``v``. What passes stays in ``v``: one hostile round's step is
applied again, decaying by ``beta``, every later round, ``eta (1 -
beta^(T+1)) / (1 - beta)`` times in all after ``T`` rounds (10x in the limit
at the defaults); the screen and the robust rule bound the step it
multiplies (docs/methods/fedavgm-lora.md, "One hostile round under
momentum").

References
----------
.. [1] Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data
   Distribution for Federated Visual Classification", 2019 (FedAvgM).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.options import NoOptions, option
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.lora import saved_tensors
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedAvgMLoRA", "ServerMomentumOptions"]


@dataclass(frozen=True)
class ServerMomentumOptions(NoOptions):
    """FedAvgM-LoRA's run-config keys."""

    server_momentum: float = option(
        0.9,
        "momentum β of the server's step on the averaged factors (β = 0 with "
        "`server-lr` 1 is FedAvg-LoRA) "
        "([methods/fedavgm-lora.md](methods/fedavgm-lora.md))",
        range="[0, 1)",
    )
    server_lr: float = option(
        1.0, "the server's step size η on the aggregated update", range="> 0"
    )


@register_method(
    "fedavgm-lora",
    payload=LORA,
    options=ServerMomentumOptions,
    summary="FedAvg of A and B as a pseudo-gradient, with server momentum",
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg", helpers="nothing: server momentum only"
    ),
)
class FedAvgMLoRA(FedAvgLoRA):
    """FedAvg-LoRA with a momentum step on the server.

    The momentum buffer ``v`` (zero at the start) is saved in
    :meth:`state_dict`. The round reports ``momentum-norm``, ``||v||_F``.

    Parameters
    ----------
    options : ServerMomentumOptions, optional
        ``server_momentum`` (beta) and ``server_lr`` (eta); default: their
        defaults (or pass either by name).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: ServerMomentumOptions

    extra_columns: tuple[str, ...] = ("momentum-norm",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum: dict[str, torch.Tensor] = {}

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        averaged, report = super().aggregate_updates(server_round, updates, current)
        beta = self.method_options.server_momentum
        eta = self.method_options.server_lr
        state = dict(averaged)
        norm_sq = 0.0
        for key in self.layout.keys(*self.train_roles):
            x = current[key].double()
            step = x - averaged[key].double()
            old = self.momentum.get(key)
            v = step if old is None else beta * old.double() + step
            self.momentum[key] = v.to(current[key].dtype)
            state[key] = (x - eta * v).to(current[key].dtype)
            norm_sq += float(v.square().sum())
        report.metrics["momentum-norm"] = math.sqrt(norm_sq)
        return state, report

    def state_dict(self) -> dict[str, Any]:
        """The momentum buffer ``v``."""
        return {"momentum": {k: v.clone() for k, v in self.momentum.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        shapes = self.layout.shapes(*self.train_roles)
        saved = saved_tensors(self, state, "momentum", shapes, complete=False)
        self.momentum = saved or {}
