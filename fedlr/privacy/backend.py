"""Opacus, imported on first use.

Importing Opacus costs about 2 s and, through ``logging.basicConfig`` in one of
its modules, gives the root logger a handler, which would print every Flower
log line of the process a second time. fedlr imports it only when a round
uses differential privacy (:func:`opacus_api`) and takes back that handler.
"""

from __future__ import annotations

import importlib
import logging
from functools import cache
from types import SimpleNamespace

__all__ = ["opacus_api"]

_NAMES = {
    "RDPAccountant": "opacus.accountants",
    "PRVAccountant": "opacus.accountants",
    "get_noise_multiplier": "opacus.accountants.utils",
    "GradSampleHooks": "opacus.grad_sample",
    "DPOptimizer": "opacus.optimizers",
}


@cache
def opacus_api() -> SimpleNamespace:
    """The Opacus names fedlr uses, imported once; the root logger as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        found = {
            name: getattr(importlib.import_module(module), name)
            for name, module in _NAMES.items()
        }
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
    return SimpleNamespace(**found)
