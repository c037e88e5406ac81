"""The dispatching ClientApp of ``flwr run``: picks the payload kind by method.

``[tool.flwr.app.components] clientapp = "client_apps.app:app"`` names it. The
run config's ``method`` is looked up in the registry; its payload kind
(:mod:`fedlr.client_apps.payloads`) holds the ``train`` and ``evaluate`` handlers.
Every message the node receives, of any type, first passes the node's policy
gate (:mod:`fedlr.client_apps.gate`); a message it refuses, and a refusal of
the handlers behind it, is answered with an error reply naming the key.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedlr.client_apps.gate import policy_gate
from fedlr.client_apps.secagg import secagg_mod
from fedlr.config.run import RunConfig
from fedlr.strategies.registry import PayloadKind, get_method

__all__ = ["GatedClientApp", "app", "gate", "refuse_bad_instructions"]


def _payload(context: Context) -> PayloadKind:
    return get_method(RunConfig.from_mapping(context.run_config).method).payload


gate = policy_gate(lambda context: _payload(context).name)
"""The node's policy gate for the run's payload kind, as a Flower mod."""

refuse_bad_instructions = gate
"""The same mod, under the name ClientApps built on fedlr's handlers use."""


class GatedClientApp(ClientApp):
    """A ClientApp whose every message passes :data:`gate` first: the
    registered types and those Flower would answer with an exception
    (a query, an unregistered action) alike."""

    def __call__(self, message: Message, context: Context) -> Message:
        return gate(message, context, super().__call__)


app = GatedClientApp()


@app.train(mods=[secagg_mod])
def train(message: Message, context: Context) -> Message:
    """Train with the method's payload kind (through SecAgg+ when the server
    runs it: :mod:`fedlr.client_apps.secagg`)."""
    return _payload(context).train(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate with the method's payload kind."""
    return _payload(context).evaluate(message, context)
