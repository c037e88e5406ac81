"""FlexLoRA (Bai et al., NeurIPS 2024): heterogeneous ranks by truncated SVD.

The server forms the exact weighted mean of the clients' products
``M = sum_i w_i s_i B_i A_i`` (:mod:`fedlr.linalg.hetero`) and gives each
client the truncated SVD of ``M`` at its own rank: its best rank-``r``
approximation. The family's protocol and reports: :mod:`fedlr.strategies.hetero`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch

from fedlr.client_apps.payloads import LORA
from fedlr.linalg import flexlora_factors
from fedlr.robust.spaces import PRODUCT
from fedlr.strategies.hetero import HeteroRankLoRA, LayerResult, LayerUpdates
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FlexLoRA"]


@register_method(
    "flexlora",
    payload=LORA,
    summary="heterogeneous ranks: truncated SVD of the mean of products; each "
    "client gets its best approximation at its own rank",
    client_contract=ClientContract(
        carries="`A`, `B` (the largest client rank, or your rank once the server "
        "knows it), head; `leading-rank`",
        helpers="keep your model's own rank: cut the leading components and rescale; "
        "reply at your rank (one of the server's `client_ranks`)",
    ),
)
class FlexLoRA(HeteroRankLoRA):
    """FlexLoRA: each client receives the best rank-``r_i`` approximation of ``M``.

    Parameters: see :class:`HeteroRankLoRA`.
    """

    aggregation_space: ClassVar[str] = PRODUCT  # an SVD / fold of the products

    def aggregate_layer(
        self,
        layer: LayerUpdates,
        current: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> LayerResult:
        b, a, svd = flexlora_factors(*layer.factors, self.rank)
        self.set_factors(layer.module, b, a, current, state)
        gaps = {r: math.sqrt(max(svd.energy_beyond(r), 0.0)) for r in self.client_ranks}
        return LayerResult(gaps, math.sqrt(max(svd.total_energy, 0.0)))
