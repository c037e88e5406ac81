"""FLoRA (Wang et al., NeurIPS 2024): the exact stacked sum folded into W0.

The exact weighted sum of the clients' products is folded into the base
weights (through the factored downlink of
:mod:`fedlr.strategies.fedex_downlink`); every client starts a fresh adapter
at its own rank each round. The family's protocol and reports:
:mod:`fedlr.strategies.hetero`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from fedlr.adapters.roles import Role
from fedlr.client_apps.payloads import LORA
from fedlr.linalg import factored_frobenius_norm, stacked_update
from fedlr.robust.spaces import PRODUCT
from fedlr.strategies.base import ClientUpdate
from fedlr.strategies.fedex_downlink import DownlinkOptions
from fedlr.strategies.hetero import HeteroFoldLoRA, LayerResult, LayerUpdates
from fedlr.strategies.registration import ClientContract, register_method
from fedlr.wire.downlink import lowrank_delta

__all__ = ["FLoRA"]


@register_method(
    "flora",
    payload=LORA,
    options=DownlinkOptions,
    summary="heterogeneous ranks: the exact sum of products (stacked factors) "
    "folded into W0; fresh adapters at each client's rank every round",
    client_contract=ClientContract(
        carries="head and base weights (dense or as changes, as `fedex-lora`); `A`, "
        "`B` never sent",
        helpers="start a fresh adapter (your model's initial `A`, `B = 0`) at your "
        "rank each round; reply `A`, `B`, head",
    ),
)
class FLoRA(HeteroFoldLoRA):
    """FLoRA: stack the clients' factors, fold the exact sum into ``W0``.

    Sends the head and the base weights (``A``, ``B`` never travel down:
    every client starts from its model's seeded initial adapter at its own
    rank, ``B = 0``), so every client receives ``M`` exactly: the gap is 0.

    Parameters: see :class:`HeteroRankLoRA` and ``fedex_downlink``.
    """

    aggregation_space: ClassVar[str] = PRODUCT  # an SVD / fold of the products

    send_roles: ClassVar[tuple[Role, ...]] = (Role.HEAD, Role.BASE)

    def start_of(
        self, update: ClientUpdate, current: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A fresh adapter: ``B0 = 0`` (its product is 0), ``A0`` the client's
        own ``A`` (so moving the update scales its product), the global head.
        """
        start = dict(current)
        for m in self.layout.modules:
            start[m.a_key] = update.arrays[m.a_key]
            start[m.b_key] = torch.zeros_like(update.arrays[m.b_key])
        return start

    def aggregate_layer(
        self,
        layer: LayerUpdates,
        current: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> LayerResult:
        module = layer.module
        base = current.get(module.base_key)
        if base is None:
            raise KeyError(
                f"global arrays lack the base weight '{module.base_key}' that "
                "FLoRA folds the sum of the updates into"
            )
        # M = left @ right is (d_out, d_in); a Conv1D stores W0 as (d_in, d_out):
        # fold and send M^T there (the Frobenius norm is the same).
        left, right = module.as_stored(*stacked_update(*layer.factors))
        delta = (
            lowrank_delta(left, right, 1.0, dtype=base.dtype) if self.factored else None
        )
        state[module.base_key] = self.fold_base(
            module.base_key,
            base,
            delta,
            lambda: torch.addmm(base.to(torch.float64), left, right).to(base.dtype),
        )
        return LayerResult(
            {r: 0.0 for r in self.client_ranks}, factored_frobenius_norm(left, right)
        )

    def step_bytes_bound(self, sampled: int) -> float:
        """The stacked sum has rank at most ``k R``."""
        q = sampled * self.rank
        return self.factored_bound(
            {m.name: (q, m.d_out, m.d_in) for m in self.layout.modules}
        )
