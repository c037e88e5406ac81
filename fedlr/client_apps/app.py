"""The dispatching ClientApp of ``flwr run``: picks the payload kind by method.

``[tool.flwr.app.components] clientapp = "client_apps.app:app"`` names it. The
run config's ``method`` is looked up in the registry; its payload kind
(:mod:`fedlr.payloads`) holds the ``train`` and ``evaluate`` handlers.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedlr.config import RunConfig
from fedlr.strategies.registry import PayloadKind, get_method

__all__ = ["app"]

app = ClientApp()


def _payload(context: Context) -> PayloadKind:
    return get_method(RunConfig.from_mapping(context.run_config).method).payload


@app.train()
def train(message: Message, context: Context) -> Message:
    """Train with the method's payload kind."""
    return _payload(context).train(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate with the method's payload kind."""
    return _payload(context).evaluate(message, context)
