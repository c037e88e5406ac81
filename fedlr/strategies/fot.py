"""FOT: federated orthogonal training for continual FL, and its FedAvg baseline.

A run is a stream of ``T`` tasks with ``rounds_per_task`` rounds each. Both
strategies tell the clients the current task (ConfigRecord ``task``,
``task-round``) and restart the learning-rate schedule at every task
(``lr * lr_decay ** task_round``).

``fedavg-continual`` is plain FedAvg of every weight on the stream.

``fot`` [1]_ adds:

* **FedProject** (every round): FedAvg gives ``w̄``; for each projected layer
  ``l`` the aggregated update ``g = w̄_l - w_l`` is replaced by
  ``g - (g_2 U_l) U_lᵀ`` (``g_2 = g.reshape(out, -1)``), so the global model
  does not move along input directions that earlier tasks use. Biases and
  other layers are averaged as usual.
* **GPSE** (at each task boundary): the first round of task ``t > 0`` carries
  ``gpse-task = t - 1`` and the current bases (ArrayRecord ``bases``). Before
  training on task ``t`` each client feeds its task ``t - 1`` data through
  the received global model (the final model of task ``t - 1``), residualises
  each projected layer's input activations against ``U_l`` and replies, beside
  its trained weights, with ``Y_l = R_l G_l`` (ArrayRecord ``sketches``,
  ``G_l`` client-local), ``r_l = ||R_l||² / ||A_l||²``
  (metric ``gpse-fraction.<layer>``) and ``b_l`` (``gpse-examples``). The
  server sums the sketches (sums only, compatible with secure aggregation),
  computes ``r̄_l = Σ b r / Σ b``, ``ε' = (r̄ - (1 - ε)) / r̄``, extends ``U_l``
  by the smallest ``k`` left singular vectors of ``Σ Y_l`` whose energy share
  reaches ``ε'``, re-orthonormalises by QR, then raises ``ε`` by
  ``eps_inc``. Only after that does it aggregate and project the round's
  updates, so the first update of task ``t`` already spares task ``t - 1``.

Replies of a boundary round without valid sketches (missing, wrong layer set
or shape, NaN, a fraction outside [0, 1]) are dropped through the base
strategy's validation path with the reason logged.

References
----------
.. [1] Bakman, Yaldiz, Ezzeldin, Avestimehr, "Federated Orthogonal Training:
   Mitigating Global Catastrophic Forgetting in Continual Federated Learning",
   ICLR 2024.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar, Self

import torch
from flwr.app import ArrayRecord, Message
from flwr.supercore import log

from fedlr.client.features import Record
from fedlr.client_apps.payloads import GPSE
from fedlr.config.run import RunConfig
from fedlr.errors import ReplyValidationError
from fedlr.linalg.fot import expand_basis, project_update, weighted_residual_fraction
from fedlr.options import Options, option
from fedlr.robust.spaces import ParameterSpace, RecordSpace, UpdateSpace
from fedlr.round.describe import app_arguments
from fedlr.round.replies import Replies
from fedlr.strategies.base import (
    ClientUpdate,
    FedLRStrategy,
    RoundReport,
    weighted_means,
)
from fedlr.strategies.registration import register_method
from fedlr.tasks.continual import ContinualOptions
from fedlr.wire import protocol

__all__ = ["FOT", "FOTOptions", "FedAvgContinual"]


@register_method(
    "fedavg-continual",
    payload=GPSE,
    summary="FedAvg on a continual task stream (baseline of fot)",
    sum_only=True,
)
class FedAvgContinual(FedLRStrategy):
    """FedAvg of every weight on a task stream.

    Parameters
    ----------
    shapes : mapping of str to tuple of int
        Keys and shapes of the global model's arrays (what clients return).
    options : ContinualOptions, optional
        The task stream: ``rounds_per_task`` and ``num_tasks`` (each can be
        passed by name).
    lr : float
        Base client learning rate; round ``j`` of a task sends
        ``lr * lr_decay ** j``.
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.base.FedLRStrategy`.
    """

    method_options: ContinualOptions

    def __init__(
        self, *, shapes: Mapping[str, tuple[int, ...]], lr: float, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.base_lr = lr

    @classmethod
    def from_run_config(
        cls,
        config: RunConfig,
        shapes: Mapping[str, tuple[int, ...]],
        projected: Sequence[str],
        options: Options | None = None,
    ) -> Self:
        """Build from the run config's common keys and the method's options.

        ``projected`` names the layers whose updates FOT projects (unused by
        the FedAvg baseline).
        """
        return cls(
            shapes=shapes,
            lr=config.lr,
            options=options,
            **app_arguments(cls, config),
            **cls.strategy_kwargs(projected),
        )

    @classmethod
    def strategy_kwargs(cls, projected: Sequence[str]) -> dict[str, Any]:
        """Constructor arguments besides the options (none here)."""
        return {}

    # ----------------------------------------------------------------- stream
    def task_of(self, server_round: int) -> tuple[int, int]:
        """``(task, round within the task)`` of a 1-based server round."""
        index = max(server_round - 1, 0)
        return divmod(index, self.method_options.rounds_per_task)

    def round_config(self, server_round: int) -> dict[str, Any]:
        task, position = self.task_of(server_round)
        return {
            protocol.TASK: task,
            protocol.TASK_ROUND: position,
            protocol.LR: self.base_lr * self.lr_decay**position,
        }

    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes)

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = weighted_means(updates, self.shapes, like=current)
        task, _ = self.task_of(server_round)
        return state, RoundReport(metrics={"task": float(task)})


@dataclass(frozen=True)
class FOTOptions(ContinualOptions):
    """FOT's run-config keys (the ``gpse`` payload's and its own)."""

    fot_eps: float = option(
        0.95, "GPSE energy threshold ε at the first task boundary", range="[0, 1]"
    )
    fot_eps_inc: float = option(
        0.01, "added to ε after each boundary (capped at 1)", range="[0, 1]"
    )
    fot_sketch_dim: int = option(
        0,
        "sketch columns m per layer (`0`: the layer's input dimension d)",
        range=">= 0",
    )


class FotReplies(Replies):
    """FOT's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: FOT

    def validate_reply(
        self, message: Message, expected: Mapping[str, tuple[int, ...]]
    ) -> ClientUpdate:
        """The base checks, then (boundary rounds) the sketches and fractions.

        Raises
        ------
        ReplyValidationError
            Missing sketches, wrong layer set, shape, dtype, NaN/Inf, or a
            residual fraction outside [0, 1] or a bad ``gpse-examples``.
        """
        update = super().validate_reply(message, expected)
        if self.method.boundary_task(self.method._round) < 0:
            return update
        node = update.node_id
        for layer in self.method.dims:
            r = update.metrics.get(protocol.gpse_fraction_key(layer))
            if r is None or not 0.0 <= r <= 1.0:
                raise ReplyValidationError(
                    node,
                    f"'{protocol.gpse_fraction_key(layer)}' must be in [0, 1], got {r}",
                )
        b = update.metrics.get(protocol.GPSE_EXAMPLES)
        if b is None or not math.isfinite(b) or b < 1:
            raise ReplyValidationError(
                node, f"'{protocol.GPSE_EXAMPLES}' must be >= 1, got {b}"
            )
        return update

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Boundary rounds: the ``sketches`` record, one per projected layer."""
        if self.method.boundary_task(self.method._round) < 0:
            return {}
        return {
            protocol.SKETCHES: {
                layer: self.method.sketch_shape(layer) for layer in self.method.dims
            }
        }

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """The sketches are of the trained model's activations, not of the
        update: clipping the update leaves them as sent."""
        return update

    def space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """The clients' weight changes, each projected layer's off its basis.

        What FOT would publish of a client's update is its projection: a
        change inside the protected span is removed anyway and does not count
        towards the norm robust options measure.
        """

        def project(key: str, delta: torch.Tensor) -> torch.Tensor:
            layer = key.removesuffix(".weight")
            if key.endswith(".weight") and layer in self.method.dims:
                return project_update(delta, self.method.bases.get(layer))
            return delta

        space = ParameterSpace(current, transform=project)
        # at a boundary, each client's sketches: bounded by the rule in their
        # own space (scaled towards zero: less of that client in the sum)
        space.records = tuple(RecordSpace(name) for name in self.records())
        return space


@register_method(
    "fot",
    payload=GPSE,
    options=FOTOptions,
    summary="FedAvg with updates projected off GPSE bases of earlier tasks",
    sum_only=True,
    records=(
        Record(
            protocol.SKETCHES,
            "at a task boundary, per projected layer: a random projection of "
            "the node's residual activations on the finished task (from its data)",
        ),
    ),
)
class FOT(FedAvgContinual):
    """Federated orthogonal training (FedProject + GPSE).

    Parameters
    ----------
    projected : sequence of str
        Names of the projected layers; their weights are ``<name>.weight``
        in ``shapes``, of shape ``(out, *rest)``, ``d = prod(rest)``.
    options : FOTOptions, optional
        Besides the stream's: ``fot_eps`` (energy threshold ``ε`` in [0, 1]
        at the first boundary), ``fot_eps_inc`` (added to ``ε`` after each
        boundary, capped at 1) and ``fot_sketch_dim`` (sketch columns ``m``,
        0: each layer's ``d``); each can be passed by name.
    **kwargs
        Other parameters: see :class:`FedAvgContinual`.
    """

    method_options: FOTOptions

    replies_type: ClassVar[type[Replies]] = FotReplies

    def __init__(self, *, projected: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dims: dict[str, int] = {}
        for name in projected:
            shape = self.shapes.get(f"{name}.weight")
            if shape is None or len(shape) < 2:
                raise ValueError(
                    f"projected layer '{name}' has no 2-D+ weight '{name}.weight' "
                    "in the global arrays"
                )
            self.dims[name] = math.prod(shape[1:])
        self.eps = self.method_options.fot_eps
        """The current threshold ``ε`` (grows after each boundary)."""
        self.bases: dict[str, torch.Tensor] = {}
        self._round = 0

    def state_dict(self) -> dict[str, Any]:
        """Bases per layer, the current threshold and the last round seen."""
        return {
            "bases": {k: v.clone() for k, v in self.bases.items()},
            "eps": self.eps,
            "round": self._round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"bases", "eps", "round"})
        if unknown:
            raise ValueError(f"FOT: unknown state keys {unknown}")
        bases = dict(state.get("bases", {}))
        for name, basis in bases.items():
            if name not in self.dims or basis.shape[0] != self.dims[name]:
                raise ValueError(
                    f"FOT: checkpointed basis '{name}' of shape "
                    f"{tuple(basis.shape)} does not fit the projected layers "
                    f"{self.dims}"
                )
        self.bases = bases
        self.eps = float(state.get("eps", self.eps))
        self._round = int(state.get("round", 0))

    @property
    def sketch_dim(self) -> int:
        """The ``fot-sketch-dim`` option."""
        return self.method_options.fot_sketch_dim

    @classmethod
    def strategy_kwargs(cls, projected: Sequence[str]) -> dict[str, Any]:
        """The projected layers (the model's, not an option)."""
        return {"projected": projected}

    def summary(self) -> None:
        """Log the settings, then FedAvg's."""
        log(
            INFO,
            "\t├──> FOT: %d projected layers %s, eps %.3f (+%.3f per task), "
            "sketch width %s",
            len(self.dims),
            list(self.dims),
            self.eps,
            self.method_options.fot_eps_inc,
            self.sketch_dim or "d",
        )
        super().summary()

    # ----------------------------------------------------------------- stream
    def boundary_task(self, server_round: int) -> int:
        """The finished task whose sketches round ``server_round`` collects, or -1."""
        task, position = self.task_of(server_round)
        return task - 1 if task > 0 and position == 0 else -1

    def sketch_shape(self, layer: str) -> tuple[int, int]:
        """``(d, m)`` of a layer's sketch."""
        d = self.dims[layer]
        return d, self.sketch_dim or d

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        config[protocol.GPSE_TASK] = self.boundary_task(server_round)
        config[protocol.SKETCH_DIM] = self.sketch_dim
        return config

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """At a boundary, every train instruction also carries the bases."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        if not train:
            return messages
        self._round = server_round
        if self.boundary_task(server_round) >= 0:
            bases = ArrayRecord({k: v.contiguous() for k, v in self.bases.items()})
            for message in messages:
                message.content[protocol.BASES] = bases
        return messages

    # -------------------------------------------------------------- validation

    # ------------------------------------------------------------- aggregation
    def expand_bases(self, updates: list[ClientUpdate]) -> dict[str, int]:
        """GPSE on the server: extend every layer's basis; return the k added."""
        counts = [u.metrics[protocol.GPSE_EXAMPLES] for u in updates]
        sketches = [u.extras[protocol.SKETCHES] for u in updates]
        added: dict[str, int] = {}
        for layer in self.dims:
            total = torch.stack([s[layer].to(torch.float64) for s in sketches]).sum(0)
            r_bar = weighted_residual_fraction(
                [u.metrics[protocol.gpse_fraction_key(layer)] for u in updates], counts
            )
            basis, k = expand_basis(self.bases.get(layer), total, r_bar, self.eps)
            if basis is not None:
                self.bases[layer] = basis
            added[layer] = k
        log(
            INFO,
            "FOT: eps %.4f, bases extended by %s -> widths %s",
            self.eps,
            added,
            {k: int(v.shape[1]) for k, v in self.bases.items()},
        )
        self.eps = min(1.0, self.eps + self.method_options.fot_eps_inc)
        return added

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        added = (
            self.expand_bases(updates) if self.boundary_task(server_round) >= 0 else {}
        )
        state, report = super().aggregate_updates(server_round, updates, current)
        removed_sq = 0.0
        update_sq = 0.0
        for layer in self.dims:
            key = f"{layer}.weight"
            g = state[key] - current[key]
            projected = project_update(g, self.bases.get(layer))
            state[key] = current[key] + projected
            update_sq += float(g.double().square().sum())
            removed_sq += float((g - projected).double().square().sum())
        report.metrics["basis-dims"] = float(
            sum(int(b.shape[1]) for b in self.bases.values())
        )
        report.metrics["basis-added"] = float(sum(added.values()))
        report.metrics["projected-share"] = (
            math.sqrt(removed_sq / update_sq) if update_sq > 0 else 0.0
        )
        return state, report
