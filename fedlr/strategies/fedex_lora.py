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

Heterogeneous ranks (``client-ranks``): :meth:`FedExLoRA.from_run_config`
builds a :class:`HeteroFedExLoRA`, which gives each client FlexLoRA's
factors at its own rank and folds what they leave out into that client's
base weights, so that every client, whatever its rank, starts each round
from the exact mean of the client models.

``fedex-fold-scale`` ``c`` in [0, 1] (default 1) folds ``c s Delta_res``
instead: 1 is FedEx-LoRA, 0 keeps the base weights and is FedIT's
(``fedavg-lora``'s) model, in between the model keeps ``(1 - c)`` of the
residual's error. It exists to test what the fold itself does to accuracy
(docs/results/drift), not as a recommended setting.

References
----------
.. [1] Singhal, Ponkshe, Vepakomma, "FedEx-LoRA: Exact Aggregation for
   Federated and Efficient Fine-Tuning of Foundation Models", ACL 2025.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self, cast

import torch

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.ranks import fold_tail
from fedlr.adapters.roles import Role
from fedlr.client.features import Bound, ClientFeature, RoundJob
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ConfigError
from fedlr.linalg import (
    StackedResidual,
    factored_frobenius_norm,
    flexlora_factors,
    stacked_update,
)
from fedlr.options import Options, option
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.fedex_downlink import (
    BaseWeights,
    DownlinkOptions,
    FactoredDownlink,
)
from fedlr.strategies.hetero import HeteroFoldLoRA, LayerResult, LayerUpdates
from fedlr.strategies.registration import (
    ClientContract,
    ContractVariant,
    register_method,
)
from fedlr.wire import protocol
from fedlr.wire.downlink import lowrank_delta

__all__ = ["FOLD_TAIL", "FedExLoRA", "FedExOptions", "FoldTail", "HeteroFedExLoRA"]

FOLD_TAIL = "fold-tail"
"""Instruction key of heterogeneous FedEx: with ``leading-rank``, the
components a node of rank ``r`` cuts away, ``(alpha / R) B[:, r:] A[r:]``, are
added to its base weights (:func:`fedlr.adapters.ranks.fold_tail`), so that
its model equals the global one exactly."""


@dataclass(frozen=True)
class FedExOptions(DownlinkOptions):
    """FedEx-LoRA's run-config keys."""

    fedex_fold_scale: float = option(
        1.0,
        "share c of each round's exact residual folded into W0: 1 is FedEx-LoRA "
        "(exact), 0 drops the residual as FedIT does (fedavg-lora's model); for "
        "studying the fold, see [results/drift](results/drift/README.md)",
        range="[0, 1]",
    )


class FoldTail(ClientFeature):
    """Heterogeneous FedEx's client side: the cut components go into ``W0``.

    On with ``fold-tail`` and ``leading-rank`` for a LoRA model: a node of
    rank ``r`` sent wider factors keeps their leading ``r`` components (the
    common round's cut) and adds the rest, ``(alpha / R) B[:, r:] A[r:]``, to
    the base weights it uses this round (:func:`fedlr.adapters.ranks.fold_tail`);
    the kept copy of the base weights stays the server's.
    """

    keys = (Bound(FOLD_TAIL, "bool"),)
    order = 20

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        config = job.config
        on = bool(config.get(protocol.LEADING_RANK, False)) and bool(
            config.get(FOLD_TAIL, False)
        )
        return cls() if on and isinstance(job.adapted, LoraModel) else None

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        layout = cast(LoraModel, job.adapted).layout
        base = {k: state[k] for k in layout.keys(Role.BASE)}
        state.update(fold_tail(layout, received, base))


@register_method(
    "fedex-lora",
    payload=LORA,
    options=FedExOptions,
    summary="FedAvg of A, B plus the exact residual folded into W0",
    client=(BaseWeights, FoldTail),
    client_contract=ClientContract(
        carries="as FedAvg, plus the base weights with the folded residual: dense, or "
        "(to a node that replied `base-held`) the changes it missed as "
        "low-rank factors in `base-delta`",
        helpers="load the base weights too; keep them in `context.state`, apply the "
        "changes, check `base-check`, reply `base-held` (a ClientApp that "
        "never replies `base-held` is always sent dense weights)",
        variants=(
            ContractVariant(
                when="with `client-ranks`",
                carries="`A`, `B` at the largest client rank R (always all R "
                "components), head, base weights (dense or as changes); "
                "`leading-rank`, `fold-tail`",
                helpers="keep your rank's leading components and fold the rest into "
                "the base weights you train from (`apply_round` does both), "
                "so your model is the global one exactly; keep the base "
                "weights as received for the next changes; reply `A`, `B` at "
                "your rank, head",
            ),
        ),
    ),
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

    method_options: FedExOptions

    heterogeneous_ranks: ClassVar[bool] = True
    """Accepts ``client-ranks`` (then :meth:`from_run_config` builds a
    :class:`HeteroFedExLoRA`, its ``hetero_variant``)."""

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
        state.update(weighted_means(updates, self.layout.keys(*self.train_roles)))
        # fedex-fold-scale 0: FedIT's model, the base weights stay.
        folded = self.layout.modules if self.method_options.fedex_fold_scale > 0 else ()
        for module in folded:
            residual = residuals[module.name]
            base = current[module.base_key]
            scaling = module.scaling * self.method_options.fedex_fold_scale
            delta = (
                lowrank_delta(
                    *module.as_stored(residual.left, residual.right),
                    scaling,
                    dtype=base.dtype,
                )
                if self.factored and isinstance(residual, StackedResidual)
                else None
            )
            state[module.base_key] = self.fold_base(
                module.base_key,
                base,
                delta,
                lambda r=residual, w=base, s=scaling, m=module: r.fold(
                    w, s, transposed=m.fan_in_fan_out
                ),
            )
        return state, self.publish_base(state, self.gap_report(updates, residuals))


class HeteroFedExLoRA(HeteroFoldLoRA):
    """FedEx-LoRA over clients of different ranks (``client-ranks``).

    The global state is FlexLoRA's: ``A``, ``B`` at the largest rank ``R``,
    the balanced factors of the truncated SVD of the mean of the updates
    ``M = sum_i w_i s_i B_i A_i`` (``s_i = alpha / r_i``), and the base
    weights ``W0``; the global model is ``W = W0 + s_R B A``. A client of
    rank ``r`` keeps the leading ``r`` components (``leading-rank``) and adds
    the rest, ``s_R B[:, r:] A[r:]``, to its base weights (``fold-tail``,
    :func:`fedlr.adapters.ranks.fold_tail`), so its model is ``W`` exactly, at
    every rank.

    Aggregation averages the client models themselves. Client ``i`` trained
    ``W0 + T_i + s_i B_i A_i``, with ``T_i = s_R B[:, r_i:] A[r_i:]`` its
    folded tail, so the mean is ``W0 + sum_i w_i T_i + M``. The new ``A``,
    ``B`` are FlexLoRA's factors of ``M`` and the new base weights take the
    rest, exactly:

        W0' = W0 + s_R B diag(c) A + M - s_R B' A',
        c_k = sum of w_i over the clients with r_i <= k (k = 0 .. R-1).

    That change has rank at most ``2 R + sum_i r_i`` and is folded in float64
    from stacked factors (never a ``d_out x d_in`` matrix per client) and sent
    through the factored downlink. Every client then receives the mean of the
    client models exactly: ``gap-rank-<r>`` is 0; ``frobenius-gap`` is
    ``||M - s_R B' A'||_F``, the part of ``M`` that the adapters cannot hold
    and the base weights take (FedEx's residual).

    Parameters: see :class:`~fedlr.strategies.hetero.HeteroRankLoRA` and
    ``fedex_downlink`` (:class:`~fedlr.strategies.fedex_downlink.FactoredDownlink`).
    """

    method_options: FedExOptions
    options_type: ClassVar[type[Options]] = FedExOptions
    """FedEx-LoRA's options (the registry builds this class for fedex-lora with
    ``client-ranks``), so ``fedex_fold_scale=`` is taken by name, as by
    :class:`FedExLoRA`; only its default, 1, is allowed here. The family's
    :class:`~fedlr.strategies.fedex_downlink.DownlinkOptions` are taken too
    (as FedEx-LoRA's with that default)."""

    trims_downlink: ClassVar[bool] = False  # a node needs the tail it folds

    def __init__(self, *, options: Options | None = None, **kwargs: Any) -> None:
        if isinstance(options, DownlinkOptions) and not isinstance(
            options, FedExOptions
        ):  # the family's options: FedEx-LoRA's with the default fold scale
            options = FedExOptions(
                **{f.name: getattr(options, f.name) for f in fields(options)}
            )
        super().__init__(options=options, **kwargs)
        scale = self.method_options.fedex_fold_scale
        if scale != 1.0:
            raise ConfigError(
                "fedex-fold-scale",
                f"HeteroFedExLoRA (fedex-lora with client-ranks) folds the whole "
                f"residual: every client's model must be the exact mean of the "
                f"client models, got {scale}; leave it at 1.0 or use FedExLoRA "
                "at one rank",
            )

    send_roles: ClassVar[tuple[Role, ...]] = FedExLoRA.send_roles

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        config[FOLD_TAIL] = True
        return config

    def aggregate_layer(
        self,
        layer: LayerUpdates,
        current: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> LayerResult:
        """Write one layer's new ``A``, ``B`` and base weight into ``state``.

        Every rank receives the mean exactly (gap 0); the layer's
        ``frobenius-gap`` is ``||M - s_R B' A'||_F``.
        """
        module = layer.module
        base = current.get(module.base_key)
        if base is None:
            raise KeyError(
                f"global arrays lack the base weight '{module.base_key}' that "
                "FedEx-LoRA folds the residual into"
            )
        f64 = torch.float64
        s_r = module.scaling  # alpha / R
        b_old = current[module.b_key].to(f64)
        a_old = current[module.a_key].to(f64)
        total = float(sum(layer.weights))
        cover = torch.zeros(self.rank, dtype=f64)  # c_k
        for w, a_i in zip(layer.weights, layer.as_, strict=True):
            cover[int(a_i.shape[0]) :] += w / total
        m_left, m_right = stacked_update(*layer.factors)
        b, a, _ = flexlora_factors(*layer.factors, self.rank)
        self.set_factors(module, b, a, current, state)
        # The factors as stored (maybe float32): the fold makes W exact for them.
        b_new, a_new = state[module.b_key].to(f64), state[module.a_key].to(f64)
        rest_left = torch.cat([m_left, -s_r * b_new], dim=1)  # M - s_R B' A'
        rest_right = torch.cat([m_right, a_new], dim=0)
        left, right = module.as_stored(
            torch.cat([s_r * b_old * cover, rest_left], dim=1),
            torch.cat([a_old, rest_right], dim=0),
        )
        delta = (
            lowrank_delta(left, right, 1.0, dtype=base.dtype) if self.factored else None
        )
        state[module.base_key] = self.fold_base(
            module.base_key,
            base,
            delta,
            lambda: torch.addmm(base.to(f64), left, right).to(base.dtype),
        )
        return LayerResult(
            {r: 0.0 for r in self.client_ranks},
            factored_frobenius_norm(m_left, m_right),
            factored_frobenius_norm(rest_left, rest_right),
        )

    def step_bytes_bound(self, sampled: int) -> float:
        """One change has rank at most ``(k + 2) R``."""
        q = (sampled + 2) * self.rank
        return self.factored_bound(
            {m.name: (q, m.d_out, m.d_in) for m in self.layout.modules}
        )


FedExLoRA.hetero_variant = HeteroFedExLoRA
