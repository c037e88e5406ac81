"""One policy gate for every message a node answers.

Every message reaches the node's handlers through :func:`policy_gate`:
train, evaluate, query, any other type Flower may deliver, every payload
kind, every SecAgg+ stage. The gate knows, from a table (:data:`ACCESS`),
what answering each ``(message type, payload kind)`` reads of the node's
data, what it releases, and which privacy mechanism the payload kind
implements for it. A message it cannot account for under the node's policy
(:mod:`fedlr.privacy.node_policy`) is refused by name:

* a message type, or a payload kind, the table does not list (a query, an
  action such as ``train.export``): refused, whatever the policy;
* a train round outside SecAgg+ on a node that set
  ``secure-aggregation-required``;
* a train round without DP-SGD on a ``dp-required`` node; with DP-SGD (asked
  or required), a payload kind that does not implement it (VeRA,
  SORF-VeRA), or an instruction that switches on a release no mechanism
  covers (:class:`Extra`: QR-Mix's eigenpairs, FOT's activation sketches);
* an evaluate instruction on a ``dp-required`` node, unless its operator
  set ``dp-evaluation-noise-multiplier`` > 0 (then the reply's metrics are
  noised and charged to the ledger, :mod:`fedlr.privacy.dp_evaluation`).

A SecAgg+ stage without the round's instruction (keys, shares, unmasking)
reads nothing of the data; it passes to the node's SecAgg+ mod and its guard
(:mod:`fedlr.client_apps.secagg`). The stage that carries the instruction is
gated as the payload's train round.

Every refusal, here or in the handlers (a spent budget, a value out of the
node's limits, a SecAgg+ guard check), is an error reply whose reason names
the key, and one line in the node's log (:func:`refusal_reply`); the node's
state is unchanged and it serves the next round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from logging import DEBUG, WARNING, getLogger

from flwr.app import ConfigRecord, Context, Error, Message
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedlr.errors import (
    InstructionError,
    NodePolicyError,
    PrivacyBudgetError,
    PrivacyUnsupportedError,
    RecordError,
)
from fedlr.flower.records import config_float
from fedlr.privacy.dp_sgd import DP_MAX_GRAD_NORM
from fedlr.privacy.node_policy import NodePolicy, node_policy
from fedlr.wire import protocol

__all__ = [
    "ACCESS",
    "DP_SGD",
    "NOISED_EVALUATION",
    "REFUSALS",
    "SECAGG_STAGE",
    "Access",
    "Extra",
    "access_of",
    "policy_gate",
    "refusal_reply",
    "trains_with_dp_sgd",
]

_LOG = getLogger("fedlr")

DP_SGD = "dp-sgd"
"""Sample-level DP-SGD (:func:`fedlr.privacy.dp_sgd.private_loop`)."""
NOISED_EVALUATION = "noised-evaluation"
"""The Gaussian mechanism on an evaluation's sums
(:mod:`fedlr.privacy.dp_evaluation`)."""

REFUSALS = (InstructionError, PrivacyBudgetError, PrivacyUnsupportedError)
"""What a node refuses with an error reply (:class:`~fedlr.errors.NodePolicyError`
and the SecAgg+ guard's are instruction errors)."""


@dataclass(frozen=True)
class Extra:
    """A release a train instruction switches on by a ConfigRecord value.

    ``key`` at ``off`` (or absent) releases nothing more; any other value
    releases ``releases``, computed from the node's data, which no privacy
    mechanism of the payload covers.
    """

    key: str
    off: int
    releases: str


@dataclass(frozen=True)
class Access:
    """What answering one kind of message reads and releases.

    Attributes
    ----------
    reads : str
        What of the node's data the answer is computed from.
    releases : str
        What leaves the node.
    mechanism : str
        The privacy mechanism the payload kind implements for it
        (:data:`DP_SGD`, :data:`NOISED_EVALUATION`), or ``""``: none, so a
        node that requires DP refuses it.
    extras : tuple of Extra
        Further releases an instruction may switch on, outside any mechanism.
    """

    reads: str
    releases: str
    mechanism: str = ""
    extras: tuple[Extra, ...] = ()


_PARTITION = "its training partition"
_EVALUATED = "its data: its partition, or its own held-out part (personalised methods)"
_METRICS = "num-examples, loss and accuracy"

ACCESS: dict[tuple[str, str], Access] = {
    (MessageType.TRAIN, "lora"): Access(
        _PARTITION, "the trained LoRA arrays and head; train metrics", DP_SGD
    ),
    (MessageType.TRAIN, "vera"): Access(
        _PARTITION, "the trained VeRA vectors and head; train metrics"
    ),
    (MessageType.TRAIN, "sorf-vera"): Access(
        _PARTITION, "the trained SORF-VeRA angles, scales and head; train metrics"
    ),
    (MessageType.TRAIN, "qrmix"): Access(
        _PARTITION,
        "every weight of the vision model after local SGD; train metrics",
        DP_SGD,
        (
            Extra(
                protocol.QRMIX_STAGE,
                1,
                "the FC layer's Hessian eigenpairs and head change (QR-Mix stage 2)",
            ),
        ),
    ),
    (MessageType.TRAIN, "gpse"): Access(
        "its current task's data; at a task boundary the finished task's",
        "every weight of the vision model after local SGD; train metrics",
        DP_SGD,
        (
            Extra(
                protocol.GPSE_TASK,
                -1,
                "random projections of its activations on the finished task "
                "(FOT's sketches)",
            ),
        ),
    ),
    **{
        (MessageType.EVALUATE, kind): Access(_EVALUATED, _METRICS, NOISED_EVALUATION)
        for kind in ("lora", "vera", "sorf-vera", "qrmix", "gpse")
    },
}
"""What each ``(message type, payload kind)`` reads and releases. A pair not
listed is refused."""

SECAGG_STAGE = Access(
    "nothing of its data",
    "SecAgg+ public keys, encrypted shares or unmask shares, as its guard allows",
)
"""A SecAgg+ stage message without the round's instruction."""


def trains_with_dp_sgd(payload: str) -> bool:
    """Whether a ``payload`` kind's train round implements DP-SGD (:data:`ACCESS`)."""
    found = ACCESS.get((MessageType.TRAIN, payload))
    return found is not None and found.mechanism == DP_SGD


def access_of(message: Message, payload: str) -> Access:
    """What answering ``message`` for a ``payload`` kind reads and releases.

    Raises
    ------
    InstructionError
        (key ``message-type``) for a type or payload kind :data:`ACCESS` does
        not list.
    """
    kind = message.metadata.message_type
    content = message.content
    if (
        kind == MessageType.TRAIN
        and RECORD_KEY_CONFIGS in content.config_records
        and protocol.CONFIG not in content.config_records
        and protocol.ARRAYS not in content.array_records
    ):
        return SECAGG_STAGE
    found = ACCESS.get((kind, payload))
    if found is None:
        answered = sorted({t for t, p in ACCESS if p == payload})
        raise InstructionError(
            "message-type",
            f"'{kind}' for a '{payload}' payload: this node cannot account for "
            f"what it would read and release, so it answers only "
            f"{', '.join(answered) or 'nothing'}",
        )
    return found


def admit(message: Message, context: Context, payload: str) -> Access:
    """Refuse ``message`` if the node's policy cannot account for it.

    Raises
    ------
    InstructionError, NodePolicyError, PrivacyUnsupportedError
        Naming the message type or key (see the module docstring).
    """
    if not message.has_content():
        raise InstructionError("message", "carries an error, not an instruction")
    access = access_of(message, payload)
    if access is SECAGG_STAGE:
        return access
    policy = node_policy(context.node_config)
    if message.metadata.message_type == MessageType.TRAIN:
        _admit_train(message, policy, access, payload)
    elif policy.dp_required and policy.dp_evaluation_noise_multiplier <= 0:
        raise NodePolicyError(
            "evaluate",
            f"would release {access.releases} computed on {access.reads}, with no "
            "noise, but this node releases nothing un-noised from its data "
            "(node config dp-required = true); its operator may allow a noised "
            "evaluation charged to its budget (dp-evaluation-noise-multiplier > 0)",
        )
    return access


def _admit_train(
    message: Message, policy: NodePolicy, access: Access, payload: str
) -> None:
    content = message.content
    if (
        policy.secure_aggregation_required
        and RECORD_KEY_CONFIGS not in content.config_records
    ):
        raise NodePolicyError(
            "secure-aggregation",
            "is off for this train round, but this node trains only under "
            "SecAgg+ (node config secure-aggregation-required = true)",
        )
    config = content.config_records.get(protocol.CONFIG, ConfigRecord())
    private = _number(config, DP_MAX_GRAD_NORM, 0.0) > 0
    if not private:
        policy.check_instruction(None)  # dp-required: refused by name
        return
    if access.mechanism != DP_SGD:
        raise PrivacyUnsupportedError(
            f"{DP_MAX_GRAD_NORM}: a '{payload}' payload has no DP-SGD (no "
            f"per-example gradient sampler for its layers); it would release "
            f"{access.releases} un-noised, so this node does not train it"
        )
    for extra in access.extras:
        value = _number(config, extra.key, extra.off)
        if value != extra.off:
            raise NodePolicyError(
                extra.key,
                f"= {value:g} asks for {extra.releases}, computed on the node's "
                "data with no noise; DP-SGD covers the trained weights only, "
                "so a DP round does not release them",
            )


def _number(config: ConfigRecord, key: str, default: float) -> float:
    try:
        value = config_float(config, key, default)
    except RecordError:
        raise InstructionError(key, f"is {config[key]!r}, not a number") from None
    return value if math.isfinite(value) else math.inf  # NaN: not "off"


_SAID: set[tuple[int, int, str]] = set()
"""``(run, node, refused key)`` this process has logged at WARNING."""


def refusal_reply(message: Message, context: Context, exc: Exception) -> Message:
    """The error reply of a refusal, with one line in the node's log: at
    WARNING the first time the node refuses that key in a run (a budget
    refusal: its type), at DEBUG when it repeats in later rounds."""
    said = (
        int(context.run_id),
        int(context.node_id),
        str(getattr(exc, "key", type(exc).__name__)),
    )
    level = DEBUG if said in _SAID else WARNING
    _SAID.add(said)
    _LOG.log(level, "node %s refused: %s", context.node_id, exc)
    error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(exc))
    return Message(error, reply_to=message)


def policy_gate(payload: Callable[[Context], str]) -> Mod:
    """The gate as a Flower mod; ``payload(context)`` names the run's payload kind.

    Refusals (:data:`REFUSALS`) raised by the gate or by the handlers behind
    it become error replies (:func:`refusal_reply`); other exceptions are
    left to Flower.
    """

    def gate(
        message: Message, context: Context, call_next: ClientAppCallable
    ) -> Message:
        try:
            admit(message, context, payload(context))
            return call_next(message, context)
        except REFUSALS as exc:
            return refusal_reply(message, context, exc)

    return gate
