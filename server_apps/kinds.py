"""Imports every server plan module so each registers its client kind."""

from __future__ import annotations

from server_apps import lora, vera  # noqa: F401

__all__: list[str] = []
