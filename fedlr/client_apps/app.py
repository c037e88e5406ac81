"""The dispatching ClientApp of ``flwr run``: picks the payload kind by method.

``[tool.flwr.app.components] clientapp = "client_apps.app:app"`` names it. The
run config's ``method`` is looked up in the registry; its payload kind
(:mod:`fedlr.payloads`) holds the ``train`` and ``evaluate`` handlers. An
instruction the node refuses is answered with an error reply naming the key
(:func:`refuse_bad_instructions`).
"""

from __future__ import annotations

from logging import WARNING, getLogger

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from fedlr.client_apps.secagg import secagg_mod
from fedlr.config import RunConfig
from fedlr.errors import InstructionError
from fedlr.strategies.registry import PayloadKind, get_method

__all__ = ["app", "refuse_bad_instructions"]

_LOG = getLogger("fedlr")


def refuse_bad_instructions(
    message: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """A Flower client mod: an instruction the node refuses gets an error reply.

    The handlers check an instruction before they change anything
    (:mod:`fedlr.instruction_checks`); an
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


app = ClientApp(mods=[refuse_bad_instructions])


def _payload(context: Context) -> PayloadKind:
    return get_method(RunConfig.from_mapping(context.run_config).method).payload


@app.train(mods=[secagg_mod])
def train(message: Message, context: Context) -> Message:
    """Train with the method's payload kind (through SecAgg+ when the server
    runs it: :mod:`fedlr.client_apps.secagg`)."""
    return _payload(context).train(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate with the method's payload kind."""
    return _payload(context).evaluate(message, context)
