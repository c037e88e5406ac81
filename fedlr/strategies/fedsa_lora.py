"""FedSA-LoRA: share ``A``, keep ``B`` personal.

``A`` learns general knowledge and ``B`` client-specific knowledge, so only
``A`` (and the head) is averaged; each client keeps its own ``B_i`` in its
``context.state`` across rounds and never sends it. Client ``i``'s model is
``W0 + s B_i A_bar``. Clients train and evaluate on their own train and
held-out parts; the round's accuracy is the mean over clients, with its spread.

The Frobenius gap measures what aggregation does to each client's own update:
``gap^2 = sum_i w_i ||B_i A_i - B_i A_bar||_F^2``, from the (r x r) Gram
matrices ``B_i^T B_i`` the clients send beside ``A_i``.

References
----------
.. [1] Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
   Learning" (FedSA-LoRA), ICLR 2025.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fedlr.adapters.roles import Role
from fedlr.client_apps.payloads import LORA
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.lora_svd import PersonalArrays, PersonalLoraStrategy
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedSALoRA"]


@register_method(
    "fedsa-lora",
    payload=LORA,
    summary="A averaged; each client keeps its own B (personalised)",
    client=(PersonalArrays,),
    client_contract=ClientContract(
        carries="`A`, head; `keep-roles` `lora_B`",
        helpers="load the node's own `B` from `context.state`; reply `A`, head and "
        "`personal-gram`; keep the new `B`",
    ),
)
class FedSALoRA(PersonalLoraStrategy):
    """Average ``A`` and the head; ``B`` stays on each client.

    Parameters: see :class:`~fedlr.strategies.lora_svd.PersonalLoraStrategy`.
    """

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.HEAD)
    keep_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_B,)

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = self.averaged(updates, current)
        return state, self.personal_gap_report(updates, state)
