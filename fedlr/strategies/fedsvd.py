"""FedSVD: clients train ``B`` with ``A`` fixed; the server re-factorises by SVD.

Each round the clients receive ``(A, B)``, train only ``B`` (and the head)
with ``A`` fixed, and send ``B_i``. Since ``A`` is common,
``sum_i w_i B_i A = B_bar A`` exactly. The server takes the (factored) SVD
``B_bar A = U S V^T`` at rank ``r`` and sends

    A <- V^T        (orthonormal rows),
    B <- U S,

so the product is unchanged while ``A`` is re-orthonormalised along the
directions the clients' updates actually use. The SVD comes from thin QRs of
``B_bar`` (d_out, r) and ``A^T`` (d_in, r) and an (r, r) core; nothing of size
d_out x d_in is formed, and nothing grows with the number of clients but the
mean of ``B``. The gap report uses the same fact: every client shares ``A``, so
``sum_i w_i B_i A = B_bar A`` and the gap is exact from ``2 r``-wide factors
whatever the number of clients (:func:`fedlr.linalg.aggregate_gap`).

References
----------
.. [1] Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated
   Learning with LoRA", 2025.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fedlr.adapters.roles import Role
from fedlr.client_apps.payloads import LORA
from fedlr.linalg import factored_svd, pad_factors
from fedlr.robust.spaces import PRODUCT
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.lora_svd import SeededLoraStrategy
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FedSVD"]


@register_method(
    "fedsvd",
    payload=LORA,
    summary="clients train B with A fixed; server SVD of B_bar A -> A=V^T, B=US",
    sum_only=True,
    client_contract=ClientContract(
        carries="`A`, `B`, head; `train-roles` `lora_B,head`",
        helpers="freeze `A`; reply `B` and head only",
    ),
)
class FedSVD(SeededLoraStrategy):
    """Average ``B``; re-factorise ``B_bar A`` as ``(U S, V^T)``.

    Parameters: see :class:`~fedlr.strategies.lora_svd.SeededLoraStrategy`.
    """

    aggregation_space: ClassVar[str] = PRODUCT  # an SVD / fold of the products

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_B, Role.HEAD)

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = self.averaged(updates, current)
        factors: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        aggregate: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for m in self.layout.modules:
            a = current[m.a_key]
            b_bar = state[m.b_key]
            svd = factored_svd(b_bar.double(), a.double(), rank=m.rank)
            new_b, new_a = pad_factors(
                svd.u * svd.s, svd.vh, m.rank, seed=self.seed + server_round
            )
            state[m.b_key] = new_b.to(b_bar.dtype)
            state[m.a_key] = new_a.to(a.dtype)
            factors[m.name] = ([u.arrays[m.b_key] for u in updates], [a] * len(updates))
            aggregate[m.name] = (state[m.b_key], state[m.a_key])
        return state, self.factored_gap_report(updates, factors, aggregate)
