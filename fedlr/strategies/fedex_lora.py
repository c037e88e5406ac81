"""FedEx-LoRA: FedAvg of A and B plus the exact residual folded into ``W0``.

With client weights ``w_i`` (num-examples, normalised), FedAvg gives
``B_bar = sum_i w_i B_i`` and ``A_bar = sum_i w_i A_i``. The residual

    Delta_res = sum_i w_i B_i A_i - B_bar A_bar

has rank at most ``(k+1) r`` and is not trainable, so it is added, times the
LoRA scaling ``s = alpha / r``, to the frozen base weight of each adapted
layer: ``W0 <- W0 + s Delta_res``. Then ``W0 + s B_bar A_bar`` equals
``W0 + s sum_i w_i B_i A_i``: the aggregation is exact. peft's ``B @ A`` has
``nn.Linear``'s (out, in) shape, so it is added as it is; a GPT-2 ``Conv1D``
stores ``W0`` as (in, out) (``LoraModule.fan_in_fan_out``), and for that
layer, and only that one, the residual is added transposed,
``W0 <- W0 + s Delta_res^T`` (the factored downlink sends the swapped pair of
factors). The residual is built once per layer and shared with the gap report
(:meth:`~fedlr.strategies.lora.LoraStrategy.layer_residuals`): with few
clients a product of stacked factors applied as one GEMM
(:meth:`fedlr.linalg.StackedResidual.fold`); with many, the centred form
``sum_i w_i (B_i - B_bar)(A_i - A_bar)`` accumulated in place, a chunk of
clients per GEMM, into one ``d_out x d_in`` buffer that also gives the exact
gap (:meth:`fedlr.linalg.StreamedResidual.fold`), linear in the number of
clients. The new base weights are sent to the clients next round.

References
----------
.. [1] Singhal, Ponkshe, Vepakomma, "FedEx-LoRA: Exact Aggregation for
   Federated and Efficient Fine-Tuning of Foundation Models", ACL 2025.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from fedlr.adapters.roles import Role
from fedlr.config import RunConfig
from fedlr.downlink import lowrank_delta
from fedlr.linalg import StackedResidual
from fedlr.options import Options
from fedlr.payloads import LORA
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.fedex_downlink import DownlinkOptions, FactoredDownlink
from fedlr.strategies.registry import register_method

__all__ = ["FedExLoRA"]


@register_method(
    "fedex-lora",
    payload=LORA,
    options=DownlinkOptions,
    summary="FedAvg of A, B plus the exact residual folded into W0",
)
class FedExLoRA(FactoredDownlink, FedAvgLoRA):
    """FedAvg-LoRA whose residual is folded into the base weights.

    Parameters
    ----------
    layout : AdapterLayout
    fedex_downlink : {"factored", "dense"}, default "factored"
        How the new base weights reach the nodes
        (:class:`~fedlr.strategies.fedex_downlink.FactoredDownlink`).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.

    The global arrays must include the base weights (role ``base``) of every
    adapted layer.
    """

    @classmethod
    def strategy_kwargs(
        cls, config: RunConfig, options: Options | None
    ) -> dict[str, Any]:
        return {"fedex_downlink": DownlinkOptions.of(options).fedex_downlink}

    def step_bytes_bound(self, sampled: int) -> float:
        """One change has rank at most ``(k - 1) r`` per layer."""
        q = max(sampled - 1, 0)
        return self.factored_bound(
            {m.name: (q * m.rank, m.d_out, m.d_in) for m in self.layout.modules}
        )

    send_roles: ClassVar[tuple[Role, ...]] = (
        Role.LORA_A,
        Role.LORA_B,
        Role.HEAD,
        Role.BASE,
    )

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        for module in self.layout.modules:
            if module.base_key not in current:
                raise KeyError(
                    f"global arrays lack the base weight '{module.base_key}' that "
                    "FedEx-LoRA folds the residual into"
                )
        # Each layer's stacked factors once: the fold and the gap share them.
        residuals = self.layer_residuals(updates)
        state = dict(current)
        state.update(self.weighted_means(updates, self.layout.keys(*self.train_roles)))
        for module in self.layout.modules:
            residual = residuals[module.name]
            base = current[module.base_key]
            delta = (
                lowrank_delta(
                    *module.as_stored(residual.left, residual.right),
                    module.scaling,
                    dtype=base.dtype,
                )
                if self.factored and isinstance(residual, StackedResidual)
                else None
            )
            state[module.base_key] = self.fold_base(
                module.base_key,
                base,
                delta,
                lambda r=residual, w=base, m=module: r.fold(
                    w, m.scaling, transposed=m.fan_in_fan_out
                ),
            )
        return state, self.publish_base(state, self.gap_report(updates, residuals))
