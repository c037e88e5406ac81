"""The dispatching ClientApp of ``flwr run``: picks the payload kind by method.

``[tool.flwr.app.components] clientapp = "client_apps.app:app"`` names it. The
run config's ``method`` is looked up in the registry; its payload kind
(:mod:`fedlr.wire.payloads`) holds the ``train`` and ``evaluate`` handlers. An
instruction the node refuses is answered with an error reply naming the key
(:func:`refuse_bad_instructions`).
"""

from __future__ import annotations

from logging import WARNING, getLogger

from flwr.app import Context, Error, Message
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedlr.client_apps.secagg import secagg_mod
from fedlr.config.run import RunConfig
from fedlr.errors import InstructionError, NodePolicyError
from fedlr.flower.records import config_float
from fedlr.privacy.dp_sgd import DP_MAX_GRAD_NORM
from fedlr.privacy.node_policy import node_policy
from fedlr.strategies.registry import PayloadKind, get_method
from fedlr.wire import protocol

__all__ = ["app", "enforce_node_policy", "refuse_bad_instructions"]

_LOG = getLogger("fedlr")


def refuse_bad_instructions(
    message: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """A Flower client mod: an instruction the node refuses gets an error reply.

    The handlers check an instruction before they change anything
    (:mod:`fedlr.wire.checks`); an
    :class:`~fedlr.errors.InstructionError` becomes an error reply whose
    reason names the key, the node logs it and serves the next round as
    before. Other exceptions are left to Flower (an error reply too).
    """
    try:
        return call_next(message, context)
    except InstructionError as exc:
        _LOG.log(WARNING, "node %s: %s", context.node_id, exc)
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(exc))
        return Message(error, reply_to=message)


def enforce_node_policy(
    message: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """A Flower client mod: the node's own requirements on every train message.

    Whatever the method's payload kind, a node whose operator set
    ``secure-aggregation-required`` refuses a train round outside SecAgg+,
    and one that set ``dp-required`` refuses an instruction without DP-SGD
    (:mod:`fedlr.privacy.node_policy`); the refusal names the key. The
    instruction's other DP values are checked against the node's limits by
    the DP-SGD feature (:class:`fedlr.privacy.dp_sgd.DpSgd`).
    """
    if message.metadata.message_type == MessageType.TRAIN and message.has_content():
        policy = node_policy(context.node_config)
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
        config = content.config_records.get(protocol.CONFIG)
        if config is not None and config_float(config, DP_MAX_GRAD_NORM, 0.0) <= 0:
            policy.check_instruction(None)
    return call_next(message, context)


app = ClientApp(mods=[refuse_bad_instructions])


def _payload(context: Context) -> PayloadKind:
    return get_method(RunConfig.from_mapping(context.run_config).method).payload


@app.train(mods=[enforce_node_policy, secagg_mod])
def train(message: Message, context: Context) -> Message:
    """Train with the method's payload kind (through SecAgg+ when the server
    runs it: :mod:`fedlr.client_apps.secagg`)."""
    return _payload(context).train(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate with the method's payload kind."""
    return _payload(context).evaluate(message, context)
