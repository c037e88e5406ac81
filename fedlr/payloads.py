"""The payload kinds: what travels for each family of methods, both sides.

A :class:`~fedlr.strategies.registry.PayloadKind` bundles the run-config keys
both sides read, the ClientApp handlers (:mod:`fedlr.client_apps`) and the
server plan (:mod:`fedlr.server_apps`) of one kind of payload. A method names
its kind in its registration (``@register_method(..., payload=LORA)``); the
ServerApp builds ``spec.payload.plan`` and the ClientApp calls
``spec.payload.train``, so neither keeps a table of its own.

The plan builders are imported when a plan is built: a plan module imports
strategy base classes, whose package registers methods that import this
module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlr.client_apps import gpse, lora, qrmix, sorf_vera, vera
from fedlr.continual import ContinualOptions
from fedlr.image_task import EigenOptions
from fedlr.options import NoOptions
from fedlr.strategies.registry import MethodConfig, PayloadKind
from fedlr.vera_tasks import SorfVeraOptions, VeraOptions

if TYPE_CHECKING:
    from fedlr.server_apps.plans import ServerPlan

__all__ = ["GPSE", "LORA", "PAYLOADS", "QRMIX", "SORF_VERA", "VERA"]


def _lora_plan(config: MethodConfig) -> ServerPlan:
    from fedlr.server_apps.lora import lora_plan

    return lora_plan(config)


def _vera_plan(config: MethodConfig) -> ServerPlan:
    from fedlr.server_apps.vera import vera_plan

    return vera_plan(config)


def _sorf_vera_plan(config: MethodConfig) -> ServerPlan:
    from fedlr.server_apps.vera import sorf_vera_plan

    return sorf_vera_plan(config)


def _qrmix_plan(config: MethodConfig) -> ServerPlan:
    from fedlr.server_apps.qrmix import qrmix_plan

    return qrmix_plan(config)


def _gpse_plan(config: MethodConfig) -> ServerPlan:
    from fedlr.server_apps.gpse import gpse_plan

    return gpse_plan(config)


LORA = PayloadKind(
    name="lora",
    options=NoOptions,
    train=lora.train_message,
    evaluate=lora.evaluate_message,
    plan=_lora_plan,
)
"""LoRA factors (A, B), the head and, for FedEx-LoRA, updated base weights."""

VERA = PayloadKind(
    name="vera",
    options=VeraOptions,
    train=vera.train_message,
    evaluate=vera.evaluate_message,
    plan=_vera_plan,
)
"""VeRA scaling vectors over frozen projections shared by seed."""

SORF_VERA = PayloadKind(
    name="sorf-vera",
    options=SorfVeraOptions,
    train=sorf_vera.train_message,
    evaluate=sorf_vera.evaluate_message,
    plan=_sorf_vera_plan,
)
"""SORF-VeRA's rotation angles and scale (b is refit on the server)."""

QRMIX = PayloadKind(
    name="qrmix",
    options=EigenOptions,
    train=qrmix.train_message,
    evaluate=qrmix.evaluate_message,
    plan=_qrmix_plan,
)
"""Every weight of a vision model; in QR-Mix's stage 2 also Hessian eigenpairs."""

GPSE = PayloadKind(
    name="gpse",
    options=ContinualOptions,
    train=gpse.train_message,
    evaluate=gpse.evaluate_message,
    plan=_gpse_plan,
)
"""Every weight of a vision model; at task boundaries activation sketches."""

PAYLOADS = (LORA, VERA, SORF_VERA, QRMIX, GPSE)
"""Every payload kind."""
