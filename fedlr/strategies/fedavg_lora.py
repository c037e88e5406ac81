"""FedAvg-LoRA (FedIT): average A and B separately, weighted by examples.

The global update ``B_bar A_bar`` differs from the mean of the client updates
``sum_i w_i B_i A_i``; the difference is logged every round as the Frobenius
gap (see :class:`~fedlr.strategies.lora.LoraStrategy`).

References
----------
.. [1] Zhang et al., "Towards Building the Federated GPT: Federated Instruction
   Tuning" (FedIT), ICASSP 2024.
"""

from __future__ import annotations

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora import LoraStrategy
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedAvgLoRA"]


@register_method(
    "fedavg-lora",
    payload=LORA,
    summary="FedIT: weighted means of A and B",
    sum_only=True,
    client_contract=ClientContract(
        carries="`A`, `B`, head", helpers="load; train all three"
    ),
)
class FedAvgLoRA(LoraStrategy):
    """Weighted means of every trained tensor (A, B, head).

    Parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(*self.train_roles)))
        return state, self.gap_report(updates)
