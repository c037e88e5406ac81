"""The dispatching ClientApp of ``flwr run``: picks the payload kind by method.

``[tool.flwr.app.components] clientapp = "client_apps.app:app"`` names it. The run
config's ``method`` is looked up in the registry; its ``client_kind`` names
the handler module (``lora`` ...).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import fedlr.strategies  # noqa: F401  (registers every method)
from fedlr.client_apps import gpse, lora, qrmix, sorf_vera, vera
from fedlr.config import RunConfig
from fedlr.strategies.registry import get_method

__all__ = ["CLIENT_KINDS", "app"]

Handler = Callable[[Message, Context], Message]

CLIENT_KINDS: dict[str, dict[str, Handler]] = {
    "lora": {"train": lora.train_message, "evaluate": lora.evaluate_message},
    "qrmix": {"train": qrmix.train_message, "evaluate": qrmix.evaluate_message},
    "gpse": {"train": gpse.train_message, "evaluate": gpse.evaluate_message},
    "vera": {"train": vera.train_message, "evaluate": vera.evaluate_message},
    "sorf-vera": {
        "train": sorf_vera.train_message,
        "evaluate": sorf_vera.evaluate_message,
    },
}

app = ClientApp()


def _handler(context: Context, action: str) -> Handler:
    method = RunConfig.from_mapping(context.run_config).method
    kind = get_method(method).client_kind
    if kind not in CLIENT_KINDS:
        raise KeyError(f"method '{method}' needs client kind '{kind}', not installed")
    return CLIENT_KINDS[kind][action]


@app.train()
def train(message: Message, context: Context) -> Message:
    """Train with the method's payload kind."""
    return _handler(context, "train")(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate with the method's payload kind."""
    return _handler(context, "evaluate")(message, context)
