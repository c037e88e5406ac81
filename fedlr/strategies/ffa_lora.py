"""FFA-LoRA: ``A`` frozen at its seeded initialisation, only ``B`` trained.

Every client builds its adapter from the run's seed, so ``A_0`` is identical
everywhere and never travels; clients train ``B`` (and the head) and the
server averages them. With a shared ``A`` the average of the updates is exact:

    sum_i w_i B_i A_0 = (sum_i w_i B_i) A_0 = B_bar A_0,

so the Frobenius gap is zero up to rounding (it is still measured, from the
factors, every round). Upload and download are halved compared with
FedAvg-LoRA.

References
----------
.. [1] Sun, Li, Liu, Ji, "Improving LoRA in Privacy-preserving Federated
   Learning" (FFA-LoRA), ICLR 2024.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fedlr.adapters.roles import Role
from fedlr.client_apps.payloads import LORA
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.lora_svd import SeededLoraStrategy
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FFALoRA"]


@register_method(
    "ffa-lora",
    payload=LORA,
    summary="A frozen at its seeded init and never sent; B averaged",
    sum_only=True,
    client_contract=ClientContract(
        carries="`B`, head (`A` never travels)",
        helpers="`A` stays your model's seeded initial one, frozen: build the model "
        "from a fixed seed",
    ),
)
class FFALoRA(SeededLoraStrategy):
    """Average ``B`` and the head; ``A`` stays at the seeded initialisation.

    The frozen ``A_0`` (needed only to measure the gap) comes from
    :meth:`~fedlr.strategies.lora_svd.SeededLoraStrategy.bind_initial`; without it the
    gap is not measured (reported as NaN).

    Parameters: see :class:`~fedlr.strategies.lora_svd.SeededLoraStrategy`.
    """

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_B, Role.HEAD)

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = self.averaged(updates, current)
        modules = self.layout.modules
        if not all(m.a_key in self.initial_state for m in modules):
            nan = float("nan")
            return state, RoundReport(
                metrics={"frobenius-gap": nan, "relative-gap": nan, "rank": self.rank}
            )
        k = len(updates)
        factors = {
            m.name: (
                [u.arrays[m.b_key] for u in updates],
                [self.initial_state[m.a_key]] * k,
            )
            for m in modules
        }
        aggregate = {
            m.name: (state[m.b_key], self.initial_state[m.a_key]) for m in modules
        }
        return state, self.factored_gap_report(updates, factors, aggregate)
