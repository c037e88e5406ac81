"""SCAFFOLD-LoRA: control variates on the LoRA factors against client drift.

SCAFFOLD [1]_ keeps a server control variate ``c`` and one per client,
``c_i``, over the trained parameters (here every ``lora_A``, ``lora_B`` and
the head). Each local step of client ``i`` follows the corrected gradient

    g_i(y) - c_i + c,

so that a client whose data pull its updates away from the others' is pushed
back by the drift it showed before. After ``K`` local steps with step size
``eta`` the client updates its control variate by the paper's option II,

    c_i+ = c_i - c + (x - y_i) / (K eta),

(``x``: the global parameters it received, ``y_i``: its trained ones) and
sends ``Delta c_i = c_i+ - c_i`` beside its parameters. The server averages
the parameters as FedAvg-LoRA does (a global step size of 1) and moves its
control variate by

    c <- c + (|S| / N) mean_{i in S} Delta c_i,

``S`` the round's clients and ``N`` the nodes it could have sampled.

fedlr's clients train with AdamW, whose step is not ``eta g``; ``(x - y_i) /
(K eta)`` is then the mean normalised step, not the mean gradient, and the
correction acts as a drift estimate in that scale (as in SCAFFOLD ports to
adaptive local solvers). ``K`` is the number of corrected steps the node
actually took (the calls of :meth:`fedlr.client.round.ClientRound.after_backward`),
``eta`` the round's ``lr``.

What travels: the instruction carries the extra ArrayRecord
``scaffold-control`` (``c``, keyed as the trained arrays); the reply carries
``scaffold-delta`` (``Delta c_i``, same keys). ``c_i`` stays on the node, in
``context.state``.

References
----------
.. [1] Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
   Federated Learning", ICML 2020.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedlr.adapters.lora import LoraModel, parameters_by_key
from fedlr.client.features import ClientFeature, Record, RoundJob
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float, record_to_state
from fedlr.round.instructions import with_records
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.lora import LoraReplies, saved_tensors
from fedlr.strategies.registration import register_method
from fedlr.wire import protocol
from fedlr.wire.payloads import LORA

__all__ = ["CONTROL", "CONTROL_DELTA", "ScaffoldCorrection", "ScaffoldLoRA"]

CONTROL = "scaffold-control"
"""Instruction ArrayRecord: the server's control variate ``c``."""
CONTROL_DELTA = "scaffold-delta"
"""Reply ArrayRecord: the client's control-variate change ``Delta c_i``."""
_NODE_CONTROL = "fedlr-scaffold"
"""``context.state`` ArrayRecord: the node's control variate ``c_i``."""


class ScaffoldCorrection(ClientFeature):
    """The client side: corrected gradients, the control variate's update.

    On for a ``train`` instruction that carries ``scaffold-control``. The
    record is checked before use (exactly the trained LoRA arrays' keys and
    shapes, finite); the node's ``c_i`` starts at zero and is dropped with a
    warning-free restart at zero when it no longer fits (another rank).

    Its replies carry an extra record (``scaffold-delta``), which client-level
    DP would not noise: the method is refused with it at configuration.
    """

    receives = (
        Record(CONTROL, "the server's control variate `c`, keyed as the arrays"),
    )
    sends = (
        Record(
            CONTROL_DELTA,
            "the node's control-variate change `Δc_i = c_i+ − c_i`, keyed as "
            "the trained arrays",
        ),
    )
    node_state = (
        Record(_NODE_CONTROL, "the node's control variate `c_i` (an ArrayRecord)"),
    )
    order = 45

    def __init__(self, control: dict[str, torch.Tensor]) -> None:
        self.control = control
        self.own: dict[str, torch.Tensor] = {}
        self.anchors: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.nn.Parameter] = {}
        self.correction: dict[str, torch.Tensor] = {}
        self.steps = 0

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "SCAFFOLD's control-variate gradient correction"

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        records = job.message.content.array_records
        if not job.is_train or CONTROL not in records:
            return None
        if not isinstance(job.adapted, LoraModel):
            raise ProtocolError(
                f"'{CONTROL}' corrects LoRA gradients; the model has a "
                f"{type(job.adapted.layout).__name__}"
            )
        shapes = job.adapted.layout.shapes(*job.train_roles)
        control = protocol.validate_arrays(records[CONTROL], shapes, name=CONTROL)
        return cls(control)

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        view = cast(LoraModel, job.adapted)  # for_round checked it
        kept = job.context.state.array_records.get(_NODE_CONTROL)
        own = record_to_state(kept) if kept is not None else {}
        for key, c in self.control.items():
            mine = own.get(key)
            fits = mine is not None and mine.shape == c.shape
            self.own[key] = (
                mine.to(c.dtype) if mine is not None and fits else torch.zeros_like(c)
            )
            self.anchors[key] = state[key].detach().clone()
            self.correction[key] = c - self.own[key]
        self.params = {
            k: p
            for k, p in parameters_by_key(view.model, view.layout).items()
            if k in self.control
        }

    def after_backward(self, job: RoundJob) -> None:
        for key, param in self.params.items():
            if param.grad is None:
                continue
            fix = self.correction[key]
            if fix.device != param.grad.device or fix.dtype != param.grad.dtype:
                fix = self.correction[key] = fix.to(param.grad.device, param.grad.dtype)
            param.grad.add_(fix)
        self.steps += 1

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, Any],
        content: RecordDict,
    ) -> None:
        if self.steps == 0:
            raise ProtocolError(
                "scaffold-lora corrects every local step: call job.after_backward() "
                "after each loss.backward() (fedlr.client.round.ClientRound)"
            )
        lr = config_float(job.config, protocol.LR)
        if not lr > 0:
            raise ProtocolError(f"'{protocol.LR}' must be > 0 for scaffold-lora")
        scale = 1.0 / (self.steps * lr)
        delta: dict[str, torch.Tensor] = {}
        new: dict[str, torch.Tensor] = {}
        for key, c in self.control.items():
            drift = (self.anchors[key].double() - trained[key].double()) * scale
            updated = self.own[key].double() - c.double() + drift
            new[key] = updated.to(c.dtype)
            delta[key] = (updated - self.own[key].double()).to(c.dtype)
        job.context.state[_NODE_CONTROL] = ArrayRecord(new)
        content[CONTROL_DELTA] = ArrayRecord(delta)


class ScaffoldReplies(LoraReplies):
    """ScaffoldLoRA's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: ScaffoldLoRA

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Every reply carries ``scaffold-delta``, keyed as the trained arrays."""
        return {CONTROL_DELTA: self.method.layout.shapes(*self.method.train_roles)}

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """A clipped reply's control delta, as if its step had been the clipped one.

        ``Delta c_i = -c + (x - y_i) / (K eta)``; with ``y_i`` moved to
        ``x + f (y_i - x)`` it becomes ``f (Delta c_i + c) - c``.
        """
        f = update.clip_factor
        if f == 1.0:
            return update
        delta = update.extras[CONTROL_DELTA]
        moved = {
            k: (
                f * (v.double() + self.method.control[k].double())
                - self.method.control[k].double()
            ).to(v.dtype)
            for k, v in delta.items()
        }
        return dataclasses.replace(
            update, extras={**update.extras, CONTROL_DELTA: moved}
        )


@register_method(
    "scaffold-lora",
    payload=LORA,
    summary="FedAvg of A and B with SCAFFOLD control variates against drift",
    client=(ScaffoldCorrection,),
    sum_only=True,
)
class ScaffoldLoRA(FedAvgLoRA):
    """FedAvg-LoRA whose clients follow SCAFFOLD's corrected gradients.

    The server keeps the control variate ``c`` (zero at the start, saved in
    :meth:`state_dict`), sends it with every train instruction and moves it
    by the mean of the clients' ``scaffold-delta`` times the fraction of
    nodes that replied. The round reports ``control-norm``, ``||c||_F``.

    Parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    replies_type: ClassVar[type[Replies]] = ScaffoldReplies

    extra_columns: tuple[str, ...] = ("control-norm",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.control: dict[str, torch.Tensor] = {
            key: torch.zeros(shape)
            for key, shape in self.layout.shapes(*self.train_roles).items()
        }

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """``scaffold-control``: ``c`` for every train instruction."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        if not train:
            return messages
        control = ArrayRecord({k: v.clone() for k, v in self.control.items()})
        return [with_records(m, {CONTROL: control}) for m in messages]

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state, report = super().aggregate_updates(server_round, updates, current)
        share = len(updates) / max(self.nodes_sampled_from, len(updates))
        norm_sq = 0.0
        for key, c in self.control.items():
            deltas = torch.stack(
                [u.extras[CONTROL_DELTA][key].double() for u in updates]
            )
            moved = c.double() + share * deltas.mean(dim=0)
            self.control[key] = moved.to(c.dtype)
            norm_sq += float(moved.square().sum())
        report.metrics["control-norm"] = norm_sq**0.5
        return state, report

    def state_dict(self) -> dict[str, Any]:
        """The control variate ``c``."""
        return {"control": {k: v.clone() for k, v in self.control.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        shapes = self.layout.shapes(*self.train_roles)
        saved = saved_tensors(self, state, "control", shapes, complete=True)
        if saved is not None:
            self.control = saved
