"""Imports every server plan module so each registers its client kind."""

from __future__ import annotations

from fedlr.server_apps import gpse, lora, qrmix, vera  # noqa: F401

__all__: list[str] = []
