"""FedAvg on vision models, and QR-Mix: Hessian-eigenpair aggregation of the FC layer.

``fedavg``
    The example-weighted mean of every parameter (McMahan et al., 2017).
``qrmix``
    Stage 1 (rounds ``1 .. warmup-rounds``): FedAvg. Stage 2: FedAvg for every
    layer but the head; the head (the final FC layer) moves by the QR-Mix
    step computed from each client's top-``k`` Hessian eigenpairs ``(V_i,
    Λ_i)`` and FC delta ``Δ_i`` (:func:`fedlr.linalg.qrmix_update`):
    ``fisher`` form ``γ (H̄ + τI)⁻¹ b`` (default) or the source's ``literal``
    form ``γ (τ Q z + b − Q Qᵀ b) = γ τ (H̄ + τI)⁻¹ b``. With a warm-up
    checkpoint every round is stage 2.

Both serve the ``qrmix`` client kind (:mod:`fedlr.client_apps.qrmix`); the round's
stage travels as ``qrmix-stage`` in the ConfigRecord and stage-2 replies carry
an extra ArrayRecord ``eigen`` (``vectors``, ``values``, ``delta``), validated
here before any arithmetic: shapes, finiteness, eigenvalues >= 0, orthonormal
vectors, and a delta that matches the reply's head weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from flwr.app import ArrayRecord, Message
from flwr.supercore import log

from fedlr.client.features import Record
from fedlr.client_apps.payloads import QRMIX
from fedlr.config.run import RunConfig
from fedlr.errors import ReplyValidationError
from fedlr.flower.records import record_to_state
from fedlr.linalg.qrmix import ClientEigen, fc_flatten, fc_unflatten, qrmix_update
from fedlr.options import Options, option, require
from fedlr.round.describe import app_arguments
from fedlr.round.replies import Replies
from fedlr.strategies.base import (
    ClientUpdate,
    FedLRStrategy,
    RoundReport,
    weighted_means,
)
from fedlr.strategies.registration import register_method
from fedlr.tasks.image import EigenOptions
from fedlr.wire import protocol

__all__ = ["QRMix", "QRMixOptions", "VisionFedAvg"]

_ORTHONORMAL_TOL = 1e-3  # eigenvectors travel as float32


@register_method(
    "fedavg",
    payload=QRMIX,
    summary="FedAvg of every weight of a vision model (local SGD)",
    sum_only=True,
)
class VisionFedAvg(FedLRStrategy):
    """Example-weighted FedAvg of every parameter of a vision model.

    Parameters
    ----------
    shapes : mapping of str to tuple of int
        Every parameter of the model (``named_parameters`` keys) and its shape.
    head : str
        Module name of the final FC layer (its ``.weight`` and ``.bias`` are
        parameters).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.base.FedLRStrategy`.
    """

    warmup_checkpoint: str = ""
    """A ``final_arrays.pt`` the run starts from instead of the seeded model
    (QR-Mix's ``qrmix-warmup-checkpoint``); empty: the seeded model."""

    columns: ClassVar[tuple[str, ...]] = (
        "stage",
        "head-step",
        "fedavg-head-step",
        "top-eigenvalue",
    )
    """Extra ``results.csv`` columns this family reports."""

    def __init__(
        self, *, shapes: Mapping[str, tuple[int, ...]], head: str, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.weight_key, self.bias_key = f"{head}.weight", f"{head}.bias"
        for key in (self.weight_key, self.bias_key):
            if key not in self.shapes:
                raise KeyError(f"head parameter '{key}' is not among the shapes")
        num_classes, num_features = self.shapes[self.weight_key]
        self.num_classes, self.num_features = int(num_classes), int(num_features)

    @classmethod
    def from_run_config(
        cls,
        config: RunConfig,
        *,
        shapes: Mapping[str, tuple[int, ...]],
        head: str,
        options: Options | None = None,
    ) -> Self:
        """Build from the run config's common keys and the method's options."""
        return cls(
            shapes=shapes, head=head, options=options, **app_arguments(cls, config)
        )

    @property
    def head_dim(self) -> int:
        """``P = K (F + 1)``, the flattened head's length."""
        return self.num_classes * (self.num_features + 1)

    def stage(self, server_round: int) -> int:
        """1 (FedAvg) for every round."""
        return 1

    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes)

    def round_config(self, server_round: int) -> dict[str, Any]:
        return {protocol.QRMIX_STAGE: self.stage(server_round)}

    def head_vector(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The head of ``state`` flattened bias first, (P,)."""
        return fc_flatten(state[self.weight_key], state[self.bias_key])

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = weighted_means(updates, self.shapes, like=current)
        step = self.head_vector(state).double() - self.head_vector(current).double()
        norm = float(torch.linalg.vector_norm(step))
        report = RoundReport(
            metrics={
                "stage": float(self.stage(server_round)),
                "head-step": norm,
                "fedavg-head-step": norm,
                "top-eigenvalue": math.nan,
            }
        )
        return state, report


@dataclass(frozen=True)
class QRMixOptions(EigenOptions):
    """QR-Mix's run-config keys (the ``qrmix`` payload's and its own)."""

    warmup_rounds: int = option(
        5, "FedAvg rounds before the QR-Mix head update", range=">= 0"
    )
    qrmix_tau: float = option(1.0, "ridge τ of (H̄ + τI)", range="> 0")
    qrmix_gamma: float = option(1.0, "step scale γ", range="> 0")
    qrmix_form: str = option(
        "fisher",
        "`fisher` = γ(H̄ + τI)⁻¹b, `literal` = the source's γ(τQz + b − QQᵀb) "
        "([methods/qrmix.md](methods/qrmix.md))",
        choices=("fisher", "literal"),
    )
    qrmix_warmup_checkpoint: str = option(
        "",
        "absolute path of a `final_arrays.pt` (same model and data) to start "
        "from; every round is then stage 2",
        bad=[("warm.pt", "absolute path")],
    )

    def check(self) -> None:
        super().check()
        checkpoint = self.qrmix_warmup_checkpoint
        require(
            not checkpoint or Path(checkpoint).expanduser().is_absolute(),
            "qrmix-warmup-checkpoint",
            f"must be an absolute path (apps run from a copied bundle), "
            f"got '{checkpoint}'",
        )


class QRMixReplies(Replies):
    """QRMix's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: QRMix

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        """The base checks, then in stage 2 the ``eigen`` record.

        Raises
        ------
        ReplyValidationError
            On a missing or malformed ``eigen`` record: wrong keys or shapes,
            NaN/Inf, a negative eigenvalue, non-orthonormal vectors, or a
            ``delta`` that does not match the reply's head weights.
        """
        update = super().validate_reply(message, expected)
        if self.method._stage == 2:
            self.method.parse_eigen(update)
        return update

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Stage 2: the ``eigen`` record (vectors p x k, values k, delta p)."""
        if self.method._stage != 2:
            return {}
        p, k = self.method.head_dim, self.method.k
        shapes = ((p, k), (k,), (p,))
        return {protocol.EIGEN: dict(zip(protocol.EIGEN_KEYS, shapes, strict=True))}

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """Clipping moves the head by ``f``; the ``eigen`` delta (the head's
        change, which stage 2's least squares consumes) moves with it, the
        curvature (vectors, values) does not."""
        f = update.clip_factor
        if f == 1.0 or protocol.EIGEN not in update.extras:
            return update
        eigen = dict(update.extras[protocol.EIGEN])
        eigen["delta"] = (eigen["delta"].double() * f).to(eigen["delta"].dtype)
        return dataclasses.replace(
            update, extras={**update.extras, protocol.EIGEN: eigen}
        )


@register_method(
    "qrmix",
    payload=QRMIX,
    options=QRMixOptions,
    summary="FedAvg warm-up, then the FC layer from clients' Hessian eigenpairs",
    records=(
        Record(
            protocol.EIGEN,
            "stage 2: the node's top-k eigenpairs of its FC layer's Hessian and "
            "its head's change (from its data)",
        ),
    ),
)
class QRMix(VisionFedAvg):
    """FedAvg, then the QR-Mix update of the FC head.

    Parameters
    ----------
    options : QRMixOptions, optional
        ``warmup_rounds`` (stage-1, FedAvg, rounds; stage 2 from round
        ``warmup_rounds + 1``; 0 with ``qrmix_warmup_checkpoint``),
        ``qrmix_tau`` (ridge ``τ > 0``, the source's ``beta``),
        ``qrmix_gamma`` (step scale ``γ``), ``qrmix_k`` (eigenpairs per
        client, capped at the head's ``P``) and ``qrmix_form`` (``"fisher"``
        or ``"literal"``, see :func:`fedlr.linalg.qrmix_update`); each can be
        passed by name.
    **kwargs
        Other parameters: see :class:`VisionFedAvg`.
    """

    method_options: QRMixOptions

    replies_type: ClassVar[type[Replies]] = QRMixReplies

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        opts = self.method_options
        self.warmup_rounds = 0 if opts.qrmix_warmup_checkpoint else opts.warmup_rounds
        """Stage-1 rounds (0 with a warm-up checkpoint, which skips stage 1)."""
        self.k = min(opts.qrmix_k, self.head_dim)
        """Eigenpairs per client, ``qrmix-k`` capped at the head's size."""
        self._stage = 1
        self._current_head: torch.Tensor | None = None
        self.warmup_checkpoint = opts.qrmix_warmup_checkpoint

    def summary(self) -> None:
        """Log the settings, then FedAvg's."""
        log(
            INFO,
            "\t├──> QRMix: %d warm-up rounds, form %s, tau %g, gamma %g, k %d, "
            "head %s (P = %d)",
            self.warmup_rounds,
            self.method_options.qrmix_form,
            self.method_options.qrmix_tau,
            self.method_options.qrmix_gamma,
            self.k,
            self.weight_key.rsplit(".", 1)[0],
            self.head_dim,
        )
        super().summary()

    def stage(self, server_round: int) -> int:
        """1 for the warm-up rounds, then 2."""
        return 1 if server_round <= self.warmup_rounds else 2

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """Remember the round's stage and global head (the replies are checked
        against them)."""
        if train:
            self._stage = self.stage(server_round)
            self._current_head = self.head_vector(record_to_state(arrays)).double()
        return super().instructions(server_round, messages, arrays, train=train)

    # -------------------------------------------------------------- validation

    def parse_eigen(self, update: ClientUpdate) -> ClientEigen:
        """Check and unpack a stage-2 reply's ``eigen`` record."""
        node = update.node_id
        k = self.k
        eigen = update.extras[protocol.EIGEN]
        values = eigen["values"].double()
        if bool((values < 0).any()):
            raise ReplyValidationError(
                node, f"negative eigenvalue {float(values.min()):.3g} (Hessian is PSD)"
            )
        vectors = eigen["vectors"].double()
        gram_error = float(
            (vectors.T @ vectors - torch.eye(k, dtype=torch.float64)).abs().max()
        )
        if gram_error > _ORTHONORMAL_TOL:
            raise ReplyValidationError(
                node,
                f"eigenvectors are not orthonormal (max |VᵀV - I| {gram_error:.3g})",
            )
        delta = eigen["delta"].double()
        if self._current_head is not None:
            local = self.head_vector(update.arrays).double()
            expected_delta = local - self._current_head
            mismatch = float((delta - expected_delta).abs().max())
            scale = 1.0 + float(expected_delta.abs().max())
            if mismatch > 1e-4 * scale:
                raise ReplyValidationError(
                    node,
                    f"eigen 'delta' differs from the reply's head minus the global "
                    f"head by {mismatch:.3g}",
                )
        return ClientEigen(vectors=vectors, values=values, delta=delta)

    # ------------------------------------------------------------- aggregation
    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state, report = super().aggregate_updates(server_round, updates, current)
        if self.stage(server_round) == 1:
            return state, report
        payloads = [self.parse_eigen(u) for u in updates]
        step = qrmix_update(
            payloads,
            [u.weight for u in updates],
            tau=self.method_options.qrmix_tau,
            gamma=self.method_options.qrmix_gamma,
            form=self.method_options.qrmix_form,
        )
        d_weight, d_bias = fc_unflatten(step, self.num_classes, self.num_features)
        for key, d in ((self.weight_key, d_weight), (self.bias_key, d_bias)):
            state[key] = (current[key].double() + d).to(current[key].dtype)
        report.metrics["head-step"] = float(torch.linalg.vector_norm(step))
        report.metrics["top-eigenvalue"] = max(float(p.values.max()) for p in payloads)
        return state, report
