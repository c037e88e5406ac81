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

``S`` the round's applied replies and ``N`` the nodes it could have sampled,
so that ``c = (1/N) sum_i c_i`` over every node's committed ``c_i``.

The local solver is plain SGD, the paper's setting (``local-optimizer =
auto``), at the method's own ``scaffold-lr``; with AdamW (``local-optimizer =
adamw``, the run's ``lr``) ``(x - y_i) / (K eta)`` is the mean normalised
step, not the mean gradient, and the correction is several times the
gradient (docs/methods/scaffold-lora.md has the numbers). ``K`` is the number
of corrected steps the node actually took (the calls of
:meth:`fedlr.client.round.ClientRound.after_backward`), ``eta`` the round's
``lr``.

A lost reply. The node keeps ``c_i+`` as *pending* (with its round and the
``c`` it received) and commits it only when the server's next instruction
says the server applied that round's delta, and with which factors (robust
clipping moves a delta to ``g (f (Delta c_i + c) - c)``); otherwise it rolls
back to ``c_i``. So a lost, dropped, screened or trimmed reply, or a rejected
round, leaves ``c`` the mean of the committed ``c_i``.

What travels: the instruction carries the extra ArrayRecord
``scaffold-control`` (``c``, keyed as the trained arrays) and the ConfigRecord
keys ``scaffold-applied-round``, ``scaffold-applied-clip`` and
``scaffold-applied-scale``; the reply carries ``scaffold-delta`` (``Delta
c_i``, same keys). ``c_i`` and the pending change stay on the node, in
``context.state``.

Against a hostile server, the node checks ``c`` (and the ``c_i`` it would
keep) before anything touches its state: finite after the cast to its
parameters' dtype and ``eta ||c|| <= r max(||x||, 1)``, ``r`` the node
config's ``scaffold-control-limit``. Against a hostile client, the server
screens every ``scaffold-delta`` (finite after the cast, size against the
round's median with the floor ``||c||``) and a clipping robust rule clips it.

References
----------
.. [1] Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
   Federated Learning", ICML 2020.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedlr.adapters.lora import LoraModel, parameters_by_key
from fedlr.client.features import (
    Bound,
    ClientFeature,
    Expected,
    Incoming,
    Record,
    RoundJob,
)
from fedlr.client.train import LOCAL_OPTIMIZER, OPTIMIZERS, default_optimizer
from fedlr.client_apps.payloads import LORA
from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError, InstructionError, ProtocolError
from fedlr.flower.records import config_float, config_int, record_to_state
from fedlr.options import NoOptions, option
from fedlr.robust.screen import record_norm
from fedlr.robust.spaces import RecordSpace, UpdateSpace
from fedlr.round.instructions import with_records
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.lora import LoraReplies, lora_model, saved_tensors
from fedlr.strategies.registration import ClientContract, register_method
from fedlr.wire import protocol

__all__ = [
    "APPLIED_CLIP",
    "APPLIED_ROUND",
    "APPLIED_SCALE",
    "CONTROL",
    "CONTROL_DELTA",
    "CONTROL_LIMIT",
    "DEFAULT_CONTROL_LIMIT",
    "ScaffoldCorrection",
    "ScaffoldLoRA",
    "ScaffoldOptions",
    "applied_change",
]

CONTROL = "scaffold-control"
"""Instruction ArrayRecord: the server's control variate ``c``."""
CONTROL_DELTA = "scaffold-delta"
"""Reply ArrayRecord: the client's control-variate change ``Delta c_i``."""
APPLIED_ROUND = "scaffold-applied-round"
"""Instruction ConfigRecord key: the last round whose ``scaffold-delta`` of
this node the server applied (0: none)."""
APPLIED_CLIP = "scaffold-applied-clip"
"""Instruction ConfigRecord key: the robust rule's clip factor ``f`` of the
node's arrays in that round (1: not clipped)."""
APPLIED_SCALE = "scaffold-applied-scale"
"""Instruction ConfigRecord key: the factor ``g`` the robust rule scaled that
round's control delta by after ``f`` (1: not scaled)."""
CONTROL_LIMIT = "scaffold-control-limit"
"""Node-config key: ``r`` of the node's bound ``eta ||c|| <= r max(||x||, 1)``."""
DEFAULT_CONTROL_LIMIT = 1.0
"""Default of ``scaffold-control-limit``: honest runs of the default task
stay under 1/100 of it (docs/methods/scaffold-lora.md)."""
_NODE_CONTROL = "fedlr-scaffold"
"""``context.state`` ArrayRecord: the node's committed control variate
(``c_i:<key>``) and its pending change (``pending:<key>``, the ``sent:<key>``
control of that round and ``pending-round``)."""
_OWN, _PENDING, _SENT, _PENDING_ROUND = "c_i:", "pending:", "sent:", "pending-round"
_INT32 = 2**31 - 1


def _norm(arrays: Mapping[str, torch.Tensor]) -> float:
    """Frobenius norm over every array, in float64 (Inf when one is not finite)."""
    total = sum(float(v.double().square().sum()) for v in arrays.values())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def applied_change(
    delta: Mapping[str, torch.Tensor],
    control: Mapping[str, torch.Tensor],
    clip: float,
    scale: float,
) -> dict[str, torch.Tensor]:
    """The control change the server applied for a reply, in float64.

    ``g (f (Delta c_i + c) - c)``: the reply's ``delta`` moved with its
    clipped step (:meth:`ScaffoldReplies.clip_extras`, ``f`` = ``clip``),
    then scaled by the robust rule's record clip (``g`` = ``scale``);
    ``Delta c_i`` itself when both are 1.

    Parameters
    ----------
    delta, control : mapping of str to torch.Tensor
        ``Delta c_i`` as sent and the control ``c`` of that round, same keys
        and shapes.
    clip, scale : float
        ``f`` and ``g``, each in [0, 1].
    """
    out: dict[str, torch.Tensor] = {}
    for key, d in delta.items():
        moved = d.double()
        if clip != 1.0:
            c = control[key].double()
            moved = clip * (moved + c) - c
        out[key] = moved * scale if scale != 1.0 else moved
    return out


@dataclass(frozen=True)
class ScaffoldOptions(NoOptions):
    """scaffold-lora's own run-config keys."""

    scaffold_lr: float = option(
        0.5,
        "the clients' learning rate in round 1 under plain SGD (`local-optimizer` "
        "`auto` or `sgd`), decayed by `lr-decay`; with `adamw` the run's `lr` "
        "applies",
        range="> 0",
    )


def _control_expected(incoming: Incoming) -> Expected | None:
    """``scaffold-control`` in a train instruction: exactly the trained
    arrays' keys and shapes."""
    if not incoming.is_train or CONTROL not in incoming.content.array_records:
        return None
    return Expected(incoming.layout.shapes(*incoming.train_roles))


class ScaffoldCorrection(ClientFeature):
    """The client side: corrected gradients, the control variate's update.

    On for a ``train`` instruction that carries ``scaffold-control``. Before
    anything touches the node's state, the record is checked: exactly the
    trained LoRA arrays' keys and shapes, finite in its own dtype and after
    the cast to the trained parameters' dtype (a float64 ``1e300`` becomes
    Inf in float32 and is refused), and ``eta ||c|| <= r max(||x||, 1)``
    (``eta`` the round's ``lr``, ``x`` the received arrays, ``r`` the node
    config's ``scaffold-control-limit``, never the message's). The node's
    ``c_i`` after this instruction (its pending change committed when the
    server says it applied it, rolled back otherwise) and the new ``c_i+``
    are held to the same bound. A refusal raises
    :class:`~fedlr.errors.InstructionError` naming the record; the node's
    state is untouched.

    Its replies carry an extra record (``scaffold-delta``), which client-level
    DP would not noise: the method is refused with it at configuration.
    """

    keys = (
        Bound(APPLIED_ROUND, "int", 0, _INT32, note="(0: none)"),
        Bound(APPLIED_CLIP, "float", 0.0, 1.0),
        Bound(APPLIED_SCALE, "float", 0.0, 1.0),
    )
    receives = (
        Record(
            CONTROL,
            "the server's control variate `c`, keyed as the arrays",
            _control_expected,
        ),
    )
    sends = (
        Record(
            CONTROL_DELTA,
            "the node's control-variate change `Δc_i = c_i+ − c_i`, keyed as "
            "the trained arrays",
        ),
    )
    node_state = (
        Record(
            _NODE_CONTROL,
            "the node's control variate `c_i` and its pending change (an ArrayRecord)",
        ),
    )
    order = 45

    def __init__(
        self,
        control: dict[str, torch.Tensor],
        own: dict[str, torch.Tensor],
        *,
        lr: float,
        limit: float,
    ) -> None:
        self.control = control
        self.own = own
        self.lr = lr
        self.limit = limit
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
        view = lora_model(job, f"'{CONTROL}' corrects LoRA gradients")
        shapes = view.layout.shapes(*job.train_roles)
        params = parameters_by_key(view.model, view.layout)
        try:
            received = protocol.validate_arrays(records[CONTROL], shapes, name=CONTROL)
        except InstructionError:
            raise
        except ProtocolError as exc:
            raise InstructionError(f"'{CONTROL}'", str(exc)) from None
        control = {
            key: _cast_finite(CONTROL, key, value, params[key].dtype)
            for key, value in received.items()
        }
        lr = config_float(job.config, protocol.LR)
        x = _received_norm(job, shapes)
        ratio = _node_limit(job.context.node_config)
        limit = ratio * max(x, 1.0)
        _check_bound(CONTROL, "c", lr, control, limit, ratio)
        own = _settle(
            job.context.state.array_records.get(_NODE_CONTROL), control, job.config
        )
        _check_bound(APPLIED_ROUND, "the committed c_i", lr, own, limit, ratio)
        return cls(control, own, lr=lr, limit=limit)

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        view = cast(LoraModel, job.adapted)  # for_round checked it
        for key, c in self.control.items():
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
        if not self.lr > 0:
            raise ProtocolError(f"'{protocol.LR}' must be > 0 for scaffold-lora")
        scale = 1.0 / (self.steps * self.lr)
        updated: dict[str, torch.Tensor] = {}
        for key, c in self.control.items():
            drift = (self.anchors[key].double() - trained[key].double()) * scale
            updated[key] = self.own[key].double() - c.double() + drift
        new = {
            k: _cast_finite(CONTROL_DELTA, k, v, self.control[k].dtype)
            for k, v in updated.items()
        }
        ratio = self.limit  # already r max(||x||, 1)
        if not self.lr * _norm(new) <= ratio:
            raise InstructionError(
                f"'{CONTROL_DELTA}'",
                f"the new c_i has eta ||c_i|| = {self.lr * _norm(new):.4g}, above "
                f"this node's bound {ratio:.4g} (node config '{CONTROL_LIMIT}' x "
                "max(||x||, 1)); nothing was kept",
            )
        delta = {
            k: (updated[k] - self.own[k].double()).to(c.dtype)
            for k, c in self.control.items()
        }
        kept: dict[str, torch.Tensor] = {}
        for key, c in self.control.items():
            kept[_OWN + key] = self.own[key].to(c.dtype)
            kept[_PENDING + key] = delta[key]
            kept[_SENT + key] = c
        server_round = config_int(job.config, protocol.SERVER_ROUND, 0)
        kept[_PENDING_ROUND] = torch.tensor(server_round, dtype=torch.int64)
        job.context.state[_NODE_CONTROL] = ArrayRecord(kept)
        content[CONTROL_DELTA] = ArrayRecord({k: v.clone() for k, v in delta.items()})


def _cast_finite(
    record: str, key: str, value: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``value`` in ``dtype``, refused unless finite after the cast."""
    cast_value = value.to(dtype)
    if not bool(torch.isfinite(cast_value).all()):
        raise InstructionError(
            f"'{record}' '{key}'",
            f"({str(value.dtype).removeprefix('torch.')}) is not finite in "
            f"{str(dtype).removeprefix('torch.')}, the trained parameters' dtype",
        )
    return cast_value


def _received_norm(job: RoundJob, shapes: Mapping[str, tuple[int, ...]]) -> float:
    """``||x||`` over the trained arrays the instruction carries (checked by
    the common round before the features run)."""
    arrays = job.message.content.array_records.get(protocol.ARRAYS)
    if arrays is None:
        return 0.0
    return _norm(
        {
            key: protocol.decode_array(arrays[key], tuple(shape), where=key)
            for key, shape in shapes.items()
            if key in arrays
        }
    )


def _node_limit(node_config: Mapping[str, object]) -> float:
    """The node config's ``scaffold-control-limit`` (``r``), checked."""
    value = node_config.get(CONTROL_LIMIT, DEFAULT_CONTROL_LIMIT)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(float(value)) and float(value) > 0)
    ):
        raise ConfigError(
            CONTROL_LIMIT, f"node config must be a finite number > 0, got {value!r}"
        )
    return float(value)


def _check_bound(
    key: str,
    what: str,
    lr: float,
    arrays: Mapping[str, torch.Tensor],
    limit: float,
    ratio: float,
) -> None:
    """Refuse ``eta ||arrays|| > limit`` (``limit = r max(||x||, 1)``)."""
    size = lr * _norm(arrays)
    if not size <= limit:
        raise InstructionError(
            f"'{key}'" if key == CONTROL else key,
            f"eta ||{what}|| = {size:.4g} exceeds this node's bound {limit:.4g} "
            f"(node config '{CONTROL_LIMIT}' = {ratio:g} x max(||x||, 1))",
        )


def _settle(
    kept: ArrayRecord | None, control: Mapping[str, torch.Tensor], config: ConfigRecord
) -> dict[str, torch.Tensor]:
    """The node's ``c_i`` after this instruction (nothing is written).

    Its committed ``c_i`` (zero on a new node or one whose stored ``c_i`` no
    longer fits), plus the pending change of round ``p`` when the
    instruction's ``scaffold-applied-round`` is ``p``, as the server applied
    it (:func:`applied_change` with ``scaffold-applied-clip`` and
    ``-scale``); else the pending change is rolled back.
    """
    stored = record_to_state(kept) if kept is not None else {}
    own: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    sent: dict[str, torch.Tensor] = {}
    for key, c in control.items():
        mine = stored.get(_OWN + key)
        own[key] = (
            mine.to(c.dtype)
            if mine is not None and mine.shape == c.shape
            else torch.zeros_like(c)
        )
        change, then = stored.get(_PENDING + key), stored.get(_SENT + key)
        if change is not None and then is not None and change.shape == c.shape:
            pending[key], sent[key] = change, then
    if _PENDING_ROUND not in stored or set(pending) != set(control):
        return own
    pending_round = int(stored[_PENDING_ROUND])
    if config_int(config, APPLIED_ROUND, 0) != pending_round or pending_round < 1:
        return own  # not applied: rolled back
    applied = applied_change(
        pending,
        sent,
        config_float(config, APPLIED_CLIP, 1.0),
        config_float(config, APPLIED_SCALE, 1.0),
    )
    return {
        key: (own[key].double() + applied[key]).to(c.dtype)
        for key, c in control.items()
    }


class ScaffoldReplies(LoraReplies):
    """ScaffoldLoRA's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: ScaffoldLoRA

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Every reply carries ``scaffold-delta``, keyed as the trained arrays."""
        return {CONTROL_DELTA: self.method.layout.shapes(*self.method.train_roles)}

    def record_floor(self, name: str, current: Mapping[str, torch.Tensor]) -> float:
        """``||c||`` for ``scaffold-delta``: never drop a delta no larger than
        the control variate itself.

        A node whose corrected steps cancel reports ``Delta c_i = -c`` and a
        robust clip moves an honest delta towards ``-c`` (``f (Delta c_i + c)
        - c``), so ``||c||`` is an honest size whatever the round's median
        (which is small once the ``c_i`` settle). And one reply within the
        floor moves ``c`` by at most ``||c|| / N``: ``c`` grows at most
        geometrically, never to a value a single reply chose.
        """
        if name == CONTROL_DELTA:
            return record_norm(self.method.control)
        return super().record_floor(name, current)

    def space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """The factors' change, and ``scaffold-delta`` as a record of its own:
        the weighting rules bound it there (``norm-clip`` clips it after
        :meth:`clip_extras`, :meth:`clips_record`)."""
        space = super().space(current)
        space.records = (RecordSpace(CONTROL_DELTA, by_norm_clip=False),)
        return space

    def clips_record(self, name: str) -> bool:
        """``scaffold-delta`` is an update: a clipping rule clips it too."""
        return name == CONTROL_DELTA or super().clips_record(name)

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """A clipped reply's control delta, as if its step had been the clipped one.

        ``Delta c_i = -c + (x - y_i) / (K eta)``; with ``y_i`` moved to
        ``x + f (y_i - x)`` it becomes ``f (Delta c_i + c) - c``.
        """
        f = update.clip_factor
        if f == 1.0:
            return update
        delta = update.extras[CONTROL_DELTA]
        applied = applied_change(delta, self.method.control, f, 1.0)
        moved = {k: v.to(delta[k].dtype) for k, v in applied.items()}
        return dataclasses.replace(
            update, extras={**update.extras, CONTROL_DELTA: moved}
        )


@register_method(
    "scaffold-lora",
    payload=LORA,
    options=ScaffoldOptions,
    summary="FedAvg of A and B with SCAFFOLD control variates against drift",
    client=(ScaffoldCorrection,),
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg, plus the ArrayRecord `scaffold-control`",
        helpers="call `job.after_backward()` after every `backward()` (it adds "
        "SCAFFOLD's correction c − cᵢ to the gradients); `job.reply()` adds "
        "`scaffold-delta` and keeps cᵢ in `context.state`",
    ),
)
class ScaffoldLoRA(FedAvgLoRA):
    """FedAvg-LoRA whose clients follow SCAFFOLD's corrected gradients.

    The server keeps the control variate ``c`` (zero at the start, saved in
    :meth:`state_dict`), sends it with every train instruction and moves it
    by the mean of the applied ``scaffold-delta`` times the fraction of nodes
    that replied. It remembers, per node, the last round whose delta it
    applied and the factors it applied it with (saved too, and put back on a
    rejected round), and tells the node in its next train instruction, so the
    node commits or rolls back its pending ``c_i``. The round reports
    ``control-norm``, ``||c||_F``.

    Parameters
    ----------
    local_optimizer : {"sgd", "adamw"}
        The clients' local solver, sent in every train instruction (the run
        config's ``local-optimizer``; ``auto``: ``sgd``).

    Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    replies_type: ClassVar[type[Replies]] = ScaffoldReplies
    method_options: ScaffoldOptions

    extra_columns: tuple[str, ...] = ("control-norm",)

    def __init__(self, *, local_optimizer: str = "sgd", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if local_optimizer not in OPTIMIZERS:
            raise ConfigError(
                LOCAL_OPTIMIZER,
                f"'{local_optimizer}' is not one of {', '.join(OPTIMIZERS)}",
            )
        self.local_optimizer = local_optimizer
        self.control: dict[str, torch.Tensor] = {
            key: torch.zeros(shape)
            for key, shape in self.layout.shapes(*self.train_roles).items()
        }
        self.applied: dict[int, tuple[int, float, float]] = {}

    @classmethod
    def strategy_kwargs(cls, config: RunConfig) -> dict[str, Any]:
        """``local_optimizer``: the run config's ``local-optimizer`` (``auto``: SGD)."""
        return {
            **super().strategy_kwargs(config),
            "local_optimizer": default_optimizer(config.local_optimizer, "sgd"),
        }

    def round_config(self, server_round: int) -> dict[str, Any]:
        """``local-optimizer``, and under SGD ``lr = scaffold-lr · lr-decay^(t−1)``."""
        config = super().round_config(server_round)
        config[LOCAL_OPTIMIZER] = self.local_optimizer
        if self.local_optimizer == "sgd":
            lr = self.method_options.scaffold_lr
            config[protocol.LR] = lr * self.lr_decay ** (server_round - 1)
        return config

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """``scaffold-control`` (``c``) and, per node, what was applied of its
        last delta, for every train instruction."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        if not train:
            return messages
        control = ArrayRecord({k: v.clone() for k, v in self.control.items()})
        out = []
        for message in messages:
            applied_round, clip, scale = self.applied.get(
                int(message.metadata.dst_node_id), (0, 1.0, 1.0)
            )
            sent = message.content.config_records.get(protocol.CONFIG)
            config = ConfigRecord(dict(sent) if sent is not None else {})
            config[APPLIED_ROUND] = applied_round
            config[APPLIED_CLIP] = clip
            config[APPLIED_SCALE] = scale
            out.append(
                with_records(message, {CONTROL: control, protocol.CONFIG: config})
            )
        return out

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
        for u in updates:
            scale = float(u.record_factors.get(CONTROL_DELTA, 1.0))
            self.applied[u.node_id] = (server_round, float(u.clip_factor), scale)
        report.metrics["control-norm"] = norm_sq**0.5
        return state, report

    def state_dict(self) -> dict[str, Any]:
        """The control variate ``c`` and, per node, the last round whose delta
        was applied with its factors ``(round, f, g)``."""
        return {
            "control": {k: v.clone() for k, v in self.control.items()},
            "applied": dict(self.applied),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        shapes = self.layout.shapes(*self.train_roles)
        rest = {k: v for k, v in state.items() if k != "applied"}
        saved = saved_tensors(self, rest, "control", shapes, complete=True)
        applied = _saved_applied(self, state.get("applied", {}))
        if saved is not None:
            self.control = saved
        self.applied = applied


def _saved_applied(owner: object, saved: object) -> dict[int, tuple[int, float, float]]:
    """A checked copy of a saved per-node map ``{node: (round, f, g)}``.

    Raises
    ------
    ValueError
        Naming the owner's class and the entry that does not fit.
    """
    who = type(owner).__name__
    if not isinstance(saved, Mapping):
        raise ValueError(f"{who}: the saved applied map is a {type(saved).__name__}")
    out: dict[int, tuple[int, float, float]] = {}
    for node, entry in saved.items():
        ok = (
            isinstance(node, int)
            and isinstance(entry, (tuple, list))
            and len(entry) == 3
            and isinstance(entry[0], int)
            and all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in entry[1:])
        )
        if not ok:
            raise ValueError(
                f"{who}: the saved applied map's entry {node!r}: {entry!r} is not "
                "(round, clip factor, scale) with factors in [0, 1]"
            )
        out[node] = (int(entry[0]), float(entry[1]), float(entry[2]))
    return out
