"""RoLoRA: alternating optimisation of the LoRA factors, one factor a round.

Chen et al. [1]_ train the two LoRA factors in alternation. fedlr's rounds
(``t`` the server round, from 1):

* odd ``t``: every client receives ``(A_t, B_t)``, trains ``B`` (and the
  head) with ``A_t`` frozen and sends ``B_i``; the server sets
  ``B_{t+1} = sum_i w_i B_i`` and keeps ``A_{t+1} = A_t``;
* even ``t``: every client trains ``A`` (and the head) with ``B_t`` frozen
  and sends ``A_i``; the server sets ``A_{t+1} = sum_i w_i A_i`` and keeps
  ``B_{t+1} = B_t``.

``w_i`` are the clients' shares of ``u.weight`` (``num-examples``). Since the
factor not trained this round is the same on every client, the published
product is the mean of the clients' products exactly (up to rounding):

    odd t:   sum_i w_i B_i A_t = (sum_i w_i B_i) A_t = B_{t+1} A_{t+1},
    even t:  sum_i w_i B_t A_i = B_t (sum_i w_i A_i) = B_{t+1} A_{t+1}.

``B`` trains first because LoRA starts from ``B_1 = 0``: ``A``'s gradient,
``s B^T (dL/dy) x^T``, is zero while ``B`` is, so an ``A`` round first would
change nothing. Each round uploads one factor (half of FedAvg-LoRA's
adapter bytes); both factors go down, so a node holds no state between rounds
and may miss rounds. The aggregation is a weighted mean: sum-only.

References
----------
.. [1] Chen, Guo, Ju, Dalal, Zhu, Khisti, "Robust Federated Finetuning of LLMs
   via Alternating Optimization of LoRA" (RoLoRA), NeurIPS 2025.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedlr.adapters.roles import Role
from fedlr.client_apps.payloads import LORA
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora_svd import RoundRoles
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["RoLoRA", "trained_factor"]


def trained_factor(server_round: int) -> Role:
    """The factor round ``server_round`` trains: ``B`` when odd, ``A`` when even."""
    return Role.LORA_B if server_round % 2 == 1 else Role.LORA_A


@register_method(
    "rolora",
    payload=LORA,
    summary="alternating factors: odd rounds train and average B (A fixed), "
    "even rounds A (B fixed); the mean of products is exact",
    sum_only=True,
    client_contract=ClientContract(
        carries="`A`, `B`, head; `train-roles` `lora_B,head` in odd rounds, "
        "`lora_A,head` in even rounds",
        helpers="train exactly the `train-roles` (the other factor frozen); reply "
        "them only",
    ),
)
class RoLoRA(RoundRoles):
    """Average only this round's trained factor (and the head).

    ``train_roles`` lists every role a client trains over two rounds (A, B,
    head); :meth:`round_roles` is one round's, sent as ``train-roles``. The
    round whose replies are checked is the last one instructions were built
    for (:attr:`last_round`, kept in :meth:`state_dict`), as FOT does.

    Parameters: see :class:`~fedlr.strategies.lora_svd.SeededLoraStrategy`.
    """

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    extra_columns: tuple[str, ...] = ("trained-factor",)
    """0 in a round that trained ``B``, 1 in one that trained ``A``."""

    @staticmethod
    def round_roles(server_round: int) -> tuple[Role, ...]:
        """The roles round ``server_round`` trains: its factor and the head."""
        return (trained_factor(server_round), Role.HEAD)

    def state_dict(self) -> dict[str, Any]:
        """The last instructed round (which factor its replies carry)."""
        return {"round": self._round}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"round"})
        if unknown:
            raise ValueError(f"RoLoRA: unknown state keys {unknown}")
        self._round = int(state.get("round", 0))

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        roles = self.round_roles(server_round)
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(*roles), like=current))
        trains_b = roles[0] is Role.LORA_B
        factors: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        aggregate: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for m in self.layout.modules:
            if trains_b:  # every client's A is the global one
                bs = [u.arrays[m.b_key] for u in updates]
                as_ = [current[m.a_key]] * len(updates)
            else:  # every client's B is the global one
                bs = [current[m.b_key]] * len(updates)
                as_ = [u.arrays[m.a_key] for u in updates]
            factors[m.name] = (bs, as_)
            aggregate[m.name] = (state[m.b_key], state[m.a_key])
        report = self.factored_gap_report(updates, factors, aggregate)
        report.metrics["trained-factor"] = 0.0 if trains_b else 1.0
        return state, report
