"""What a family of methods sends, both sides: :class:`PayloadKind`.

The kinds themselves (``LORA``, ``VERA``, ...) are in
:mod:`fedlr.client_apps.payloads`; a method names its kind when it registers
(:func:`fedlr.strategies.registry.register_method`). The class lives below
both, so neither the payload kinds nor the registry import the other's layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedlr.options import Options

if TYPE_CHECKING:
    from flwr.app import Context, Message

__all__ = ["Handler", "PayloadKind"]

Handler = Callable[["Message", "Context"], "Message"]
"""A ClientApp handler, ``(message, context) -> reply``."""


@dataclass(frozen=True)
class PayloadKind:
    """What travels between server and clients for a family of methods.

    Attributes
    ----------
    name : str
        ``lora``, ``vera``, ``sorf-vera``, ``qrmix`` or ``gpse``.
    options : type of Options
        The run-config keys both sides read (e.g. VeRA's projection rank);
        every method of this kind has options that extend these.
    train, evaluate : callable
        The ClientApp handlers, ``(message, context) -> reply``.
    plugin : bool
        Whether a user's own model and ClientApp can carry it
        (:func:`fedlr.client.round.apply_round` and the strategies' ``for_model``):
        the LoRA and VeRA families.

    The server plan of a kind is registered under its name
    (:func:`fedlr.server_apps.plans.register_plan`).
    """

    name: str
    options: type[Options]
    train: Handler
    evaluate: Handler
    plugin: bool = False
