"""The payload kinds: what travels for each family of methods, both sides.

A :class:`~fedlr.client_apps.payload_kind.PayloadKind` bundles the run-config keys
both sides read and the ClientApp handlers (:mod:`fedlr.client_apps`) of one
kind of payload. A method names its kind in its registration
(``@register_method(..., payload=LORA)``); the ClientApp calls
``spec.payload.train`` and the ServerApp builds the plan registered under the
kind's name (:func:`fedlr.server_apps.plans.build_plan`), so neither keeps a
table of its own. This module does not import the server plans: they import
the strategies, whose modules import this one.
"""

from __future__ import annotations

from types import ModuleType

from fedlr.client_apps import gpse, lora, qrmix, sorf_vera, vera
from fedlr.client_apps.payload_kind import PayloadKind
from fedlr.options import NoOptions, Options
from fedlr.tasks.continual import ContinualOptions
from fedlr.tasks.image import EigenOptions
from fedlr.tasks.vera import SorfVeraOptions, VeraOptions

__all__ = ["GPSE", "LORA", "PAYLOADS", "QRMIX", "SORF_VERA", "VERA"]


def _kind(
    name: str, options: type[Options], handlers: ModuleType, *, plugin: bool = False
) -> PayloadKind:
    """The kind ``name`` whose ClientApp handlers are the ``train_message`` and
    ``evaluate_message`` of the module ``handlers``."""
    return PayloadKind(
        name, options, handlers.train_message, handlers.evaluate_message, plugin
    )


LORA = _kind("lora", NoOptions, lora, plugin=True)
"""LoRA factors (A, B), the head and, for FedEx-LoRA, updated base weights."""

VERA = _kind("vera", VeraOptions, vera, plugin=True)
"""VeRA scaling vectors over frozen projections shared by seed."""

SORF_VERA = _kind("sorf-vera", SorfVeraOptions, sorf_vera, plugin=True)
"""SORF-VeRA's rotation angles and scale (b is refit on the server)."""

QRMIX = _kind("qrmix", EigenOptions, qrmix)
"""Every weight of a vision model; in QR-Mix's stage 2 also Hessian eigenpairs."""

GPSE = _kind("gpse", ContinualOptions, gpse)
"""Every weight of a vision model; at task boundaries activation sketches."""

PAYLOADS = (LORA, VERA, SORF_VERA, QRMIX, GPSE)
"""Every payload kind."""
