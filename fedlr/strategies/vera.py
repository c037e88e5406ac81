"""FedAvg-VeRA and VeRA-FedEx: averaging VeRA's scaling vectors.

Every node holds the same frozen projections ``A`` (r, d_in) and ``B``
(d_out, r), built from the shared ``projection-seed`` and rank; a layer's
update is ``Lambda_b B Lambda_d A`` with trainable ``b`` (d_out,) and ``d``
(r,). Only ``b``, ``d`` and the head travel.

``fedavg-vera`` takes weighted means of ``b`` and ``d``. Since
``mean_i(Lambda_b_i B Lambda_d_i A) != Lambda_b_bar B Lambda_d_bar A``, the
Frobenius gap between them is logged every round.

``vera-fedex`` folds that residual, times ``fedex-lr``, into each adapted
layer's frozen base weight (one GEMM on stacked factors, see
:func:`fedlr.linalg.vera.fold_vera_residual`) and sends the new base weights
down. With ``fedex-lr = 1`` the aggregation is exact. A GPT-2 ``Conv1D``
layer stores ``W0`` as (d_in, d_out) (``VeraModule.fan_in_fan_out``); its
residual is folded in transposed.

The server puts ``projection-seed`` and ``projection-rank`` in every round's
ConfigRecord; clients check them against what they built (a mismatch raises
:class:`~fedlr.errors.ProjectionMismatchError`) and echo them in their
metrics; a reply with other values is dropped.

References
----------
.. [1] Kopiczko, Blankevoort, Asano, "VeRA: Vector-based Random Matrix
   Adaptation", ICLR 2024.
.. [2] Singhal, Ponkshe, Vepakomma, "FedEx-LoRA: Exact Aggregation for
   Federated and Efficient Fine-Tuning of Foundation Models", ACL 2025.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar, Self

import torch
from flwr.app import ArrayRecord, Message
from flwr.supercore import log

from fedlr.adapters.plugin import check_projection_model, load_from_initial, vera_view
from fedlr.adapters.roles import AdaptedModel, Role, RoleLayout
from fedlr.adapters.vera import VeraLayout, VeraModel
from fedlr.client_apps.payloads import VERA
from fedlr.config.run import RunConfig
from fedlr.errors import ReplyValidationError
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.linalg import weighted_mean
from fedlr.linalg.vera import fold_vera_residual, vera_gap_norms
from fedlr.options import Options, option
from fedlr.round.describe import app_arguments
from fedlr.round.instructions import check_bound_model, fingerprint_model
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from fedlr.strategies.fedex_downlink import (
    BaseWeights,
    DownlinkOptions,
    FactoredDownlink,
    check_downlink,
    downlink_option,
)
from fedlr.strategies.registration import ClientContract, register_method
from fedlr.tasks.vera import VeraOptions
from fedlr.wire import protocol
from fedlr.wire.downlink import vera_delta

__all__ = [
    "FedAvgVeRA",
    "ProjectionChecked",
    "VeraFedEx",
    "VeraFedExOptions",
    "VeraStrategy",
    "check_projection_metrics",
]


def check_projection_metrics(
    node: int, metrics: Mapping[str, float], seed: int, rank: int
) -> None:
    """Raise :class:`ReplyValidationError` unless the reply echoes seed and rank."""
    got = (metrics.get("projection-seed"), metrics.get("projection-rank"))
    if got != (float(seed), float(rank)):
        raise ReplyValidationError(
            node,
            f"projection mismatch: reply reports (projection-seed, projection-rank) "
            f"= {got}, the server uses ({seed}, {rank})",
        )


class ProjectionReplies(Replies):
    """ProjectionChecked's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: ProjectionChecked

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        update = super().validate_reply(message, expected)
        check_projection_metrics(
            update.node_id,
            update.metrics,
            self.method.projection_seed,
            self.method.projection_rank,
        )
        return update


class ProjectionChecked(FedLRStrategy):
    """A strategy over a VeRA-family model: shared projections by seed and rank.

    Replies must echo the projection seed and rank. The plug-in methods
    (:meth:`for_model`, :meth:`initial_arrays`, :meth:`load_into`) accept
    models whose layout is a ``layout_type``.
    """

    replies_type: ClassVar[type[Replies]] = ProjectionReplies

    layout_type: ClassVar[type[RoleLayout]]
    layout: Any
    send_roles: ClassVar[tuple[Role, ...]]
    train_roles: ClassVar[tuple[Role, ...]]
    projection_seed: int
    projection_rank: int

    @classmethod
    def from_run_config(
        cls, config: RunConfig, vm: VeraModel, options: Options | None = None
    ) -> Self:
        """Build from the run config's common keys, the method's options and
        the server's model (the projections, of a ``layout_type`` layout)."""
        if not isinstance(vm.layout, cls.layout_type):
            raise TypeError(f"{cls.__name__} needs a {cls.layout_type.__name__}")
        return cls(
            layout=vm.layout,
            projection_a=vm.projection_a,
            projection_b=vm.projection_b,
            options=options,
            **app_arguments(cls, config),
        )

    def round_config(self, server_round: int) -> dict[str, Any]:
        return {
            protocol.TRAIN_ROLES: protocol.encode_roles(self.train_roles),
            **self.projection_config(),
        }

    def projection_config(self) -> dict[str, Any]:
        """ConfigRecord values every client checks its projections against."""
        return {
            protocol.PROJECTION_SEED: self.projection_seed,
            protocol.PROJECTION_RANK: self.projection_rank,
        }

    def send_keys(self) -> list[str]:
        """Keys of the global arrays sent to clients."""
        return self.layout.keys(*self.send_roles)

    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.layout.shapes(*self.train_roles))

    # ------------------------------------------------------ plug-in users
    @classmethod
    def for_model(cls, model: torch.nn.Module | AdaptedModel, **kwargs: Any) -> Self:
        """The strategy for a user's own VeRA-family model (layout, projections).

        Parameters
        ----------
        model : peft.PeftModel or VeraModel
            The server's copy of the model every node builds (peft's
            ``VeraConfig`` with a fixed ``projection_prng_key``, or
            :func:`~fedlr.adapters.build_sorf_vera_model`).
        **kwargs
            The strategy's other parameters.

        Raises
        ------
        UnsupportedModelError
            If ``model`` is not a model of the strategy's family.
        """
        view = vera_view(model, cls.layout_type)
        strategy = cls(
            layout=view.layout,
            projection_a=view.projection_a,
            projection_b=view.projection_b,
            **kwargs,
        )
        strategy.base_fingerprint = fingerprint_model(strategy, view)
        return strategy

    def initial_arrays(self, model: torch.nn.Module | AdaptedModel) -> ArrayRecord:
        """The first round's global arrays: the ``send_roles`` tensors of ``model``.

        Raises
        ------
        UnsupportedModelError
            If ``model`` is not a model of the strategy's family.
        ProjectionMismatchError, ShapeMismatchError
            If it does not match the strategy's projections or layout.
        """
        view = vera_view(model, self.layout_type)
        check_projection_model(self.layout, view, self.send_roles)
        check_bound_model(self, view, what="the model given to initial_arrays")
        return state_to_record(view.state(self.send_roles), self.send_keys())

    def load_into(
        self,
        model: torch.nn.Module | AdaptedModel,
        arrays: ArrayRecord | Mapping[str, torch.Tensor],
    ) -> None:
        """Load global arrays into ``model`` (e.g. in a server ``evaluate_fn``).

        Tensors the arrays leave out keep their initial values (base weights
        the round did not send are the pristine ones).

        Raises
        ------
        UnsupportedModelError
            If ``model`` is not a model of the strategy's family.
        ProjectionMismatchError, ShapeMismatchError, UnknownKeyError
            If it or the arrays do not match the strategy.
        """
        view = vera_view(model, self.layout_type)
        check_projection_model(self.layout, view, self.send_roles)
        state = (
            record_to_state(arrays) if isinstance(arrays, ArrayRecord) else dict(arrays)
        )
        check_bound_model(self, view, what="the model given to load_into")
        load_from_initial(view, state)


class VeraStrategy(ProjectionChecked):
    """A strategy over VeRA adapters described by a :class:`VeraLayout`.

    Parameters
    ----------
    layout : VeraLayout
    projection_a : (r, max d_in) torch.Tensor
        The shared frozen ``A`` (sliced per layer).
    projection_b : (max d_out, r) torch.Tensor
        The shared frozen ``B``.
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.base.FedLRStrategy`.
    """

    layout_type: ClassVar[type[RoleLayout]] = VeraLayout
    send_roles: ClassVar[tuple[Role, ...]] = (
        Role.VERA_LAMBDA_B,
        Role.VERA_LAMBDA_D,
        Role.HEAD,
    )
    train_roles: ClassVar[tuple[Role, ...]] = (
        Role.VERA_LAMBDA_B,
        Role.VERA_LAMBDA_D,
        Role.HEAD,
    )

    def __init__(
        self,
        *,
        layout: VeraLayout,
        projection_a: torch.Tensor,
        projection_b: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        r = layout.rank
        d_in = max(m.d_in for m in layout.modules)
        d_out = max(m.d_out for m in layout.modules)
        if (
            projection_a.shape[0] != r
            or projection_b.shape[1] != r
            or projection_a.shape[1] < d_in
            or projection_b.shape[0] < d_out
        ):
            raise ValueError(
                f"projections A {tuple(projection_a.shape)} and B "
                f"{tuple(projection_b.shape)} do not fit rank {r}, d_in {d_in}, "
                f"d_out {d_out}"
            )
        self.layout = layout
        self.projection_a = projection_a
        self.projection_b = projection_b
        self.projection_seed = layout.projection_seed
        self.projection_rank = layout.rank

    def summary(self) -> None:
        """Log the settings, then FedAvg's."""
        log(
            INFO,
            "\t├──> %s: %d VeRA modules, rank %d, projection seed %d",
            type(self).__name__,
            len(self.layout.modules),
            self.layout.rank,
            self.layout.projection_seed,
        )
        super().summary()

    def projections(self, d_out: int, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``A[:, :d_in]`` and ``B[:d_out]`` of a layer."""
        return self.projection_a[:, :d_in], self.projection_b[:d_out]

    def gap_report(self, updates: list[ClientUpdate]) -> RoundReport:
        """``||sum_i w_i Lb_i B Ld_i A - Lb_bar B Ld_bar A||_F`` per layer and total.

        The relative gap divides by the norm of the mean client update; both
        from the ``d_out x r`` matrices of :func:`fedlr.linalg.vera.vera_gap_norms`,
        linear in the number of clients.
        """
        weights = [u.weight for u in updates]
        layers: dict[str, tuple[float, float]] = {}
        for m in self.layout.modules:
            a, b = self.projections(m.d_out, m.d_in)
            lbs = [u.arrays[m.lambda_b_key] for u in updates]
            lds = [u.arrays[m.lambda_d_key] for u in updates]
            gap, ideal = vera_gap_norms(lbs, lds, a, b, weights)
            layers[m.name] = (m.scaling * gap, m.scaling * ideal)
        return RoundReport.from_layers(layers, rank=float(self.layout.rank))

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        """Weighted means of ``b``, ``d`` and the head (FedAvg-VeRA's rule,
        and the lambdas VeRA-FedEx folds its residual around)."""
        weights = [u.weight for u in updates]
        state = dict(current)
        for key in self.layout.keys(*self.train_roles):
            state[key] = weighted_mean([u.arrays[key] for u in updates], weights)
        return state, self.gap_report(updates)


@register_method(
    "fedavg-vera",
    payload=VERA,
    summary="weighted means of VeRA's lambda_b, lambda_d and the head",
    sum_only=True,
    client_contract=ClientContract(
        carries="`vera_lambda_b`, `vera_lambda_d`, head (VeRA-FedEx: base weights, "
        "dense or as changes like `fedex-lora`); `projection-seed`, "
        "`projection-rank`",
        helpers="check the projections (else `ProjectionMismatchError`); echo them in "
        "the metrics; VeRA-FedEx: the base weights as for `fedex-lora`",
    ),
)
class FedAvgVeRA(VeraStrategy):
    """Weighted means of ``b``, ``d`` and the head.

    The family's aggregation (:meth:`VeraStrategy.aggregate_updates`) as it
    is. Parameters: see :class:`VeraStrategy`.
    """


@dataclass(frozen=True)
class VeraFedExOptions(VeraOptions, DownlinkOptions):
    """VeRA-FedEx's run-config keys (the ``vera`` payload's and its own)."""

    fedex_lr: float = option(
        1.0, "fraction of the residual folded into W0 (1 = exact)", range="(0, 1]"
    )
    fedex_downlink: str = downlink_option()

    def check(self) -> None:
        super().check()
        check_downlink(self.fedex_downlink)


@register_method(
    "vera-fedex",
    payload=VERA,
    options=VeraFedExOptions,
    summary="FedAvg of VeRA's lambdas plus the exact residual folded into W0",
    client=(BaseWeights,),
    client_contract=ClientContract(
        carries="`vera_lambda_b`, `vera_lambda_d`, head (VeRA-FedEx: base weights, "
        "dense or as changes like `fedex-lora`); `projection-seed`, "
        "`projection-rank`",
        helpers="check the projections (else `ProjectionMismatchError`); echo them in "
        "the metrics; VeRA-FedEx: the base weights as for `fedex-lora`",
    ),
)
class VeraFedEx(FactoredDownlink, VeraStrategy):
    """FedAvg-VeRA whose residual (times ``fedex_lr``) is folded into ``W0``.

    The new base weights reach the nodes through the factored downlink
    (:class:`~fedlr.strategies.fedex_downlink.FactoredDownlink`): the
    residual is ``s (B o M) A`` with ``M = sum_i w_i b_i d_i^T - b_bar
    d_bar^T``, so only the factors of ``M`` (d_out x (k - 1) and r x (k - 1),
    from a factored SVD of the sum) travel (:func:`fedlr.wire.downlink.vera_delta`).

    Parameters: see :class:`VeraStrategy`; its options
    (:class:`VeraFedExOptions`) add ``fedex_lr`` and ``fedex_downlink``
    (``"factored"`` or ``"dense"``). The global arrays must include the base
    weights (role ``base``) of every adapted layer.
    """

    method_options: VeraFedExOptions

    def delta_projections(self) -> Any:
        return self.projections

    def step_bytes_bound(self, sampled: int) -> float:
        """``M``'s factors: rank at most ``k - 1``, ``(d_out + r)`` items each."""
        q = max(sampled - 1, 0)
        return self.factored_bound(
            {m.name: (q, m.d_out, self.projection_rank) for m in self.layout.modules}
        )

    send_roles: ClassVar[tuple[Role, ...]] = (
        Role.VERA_LAMBDA_B,
        Role.VERA_LAMBDA_D,
        Role.HEAD,
        Role.BASE,
    )

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state, report = super().aggregate_updates(server_round, updates, current)
        weights = [u.weight for u in updates]
        for m in self.layout.modules:
            if m.base_key not in current:
                raise KeyError(
                    f"global arrays lack the base weight '{m.base_key}' that "
                    "VeRA-FedEx folds the residual into"
                )
            lambda_bs = [u.arrays[m.lambda_b_key] for u in updates]
            lambda_ds = [u.arrays[m.lambda_d_key] for u in updates]
            base = current[m.base_key]
            delta = (
                vera_delta(
                    lambda_bs,
                    lambda_ds,
                    weights,
                    m.scaling * self.method_options.fedex_lr,
                    m.d_in,
                    dtype=base.dtype,
                    transposed=m.fan_in_fan_out,
                )
                if self.factored
                else None
            )
            a, b = self.projections(m.d_out, m.d_in)
            state[m.base_key] = self.fold_base(
                m.base_key,
                base,
                delta,
                lambda w=base, bs=lambda_bs, ds=lambda_ds, a=a, b=b, m=m: (
                    fold_vera_residual(
                        w,
                        bs,
                        ds,
                        a,
                        b,
                        weights,
                        scaling=m.scaling,
                        step=self.method_options.fedex_lr,
                        transposed=m.fan_in_fan_out,
                    )
                ),
            )
        return state, self.publish_base(state, report)
