"""The options of the registered methods, below the run config.

One pyproject table serves every method, so
:meth:`fedlr.config.RunConfig.from_mapping` accepts a key that some registered
method's options declare. The methods register in their own modules, above
the run config (:func:`fedlr.strategies.registry.register_method`); each
registration records the method's options here, and
:func:`load_builtin_methods` finds the built-in methods by importing every
module of :mod:`fedlr.strategies` once (``pkgutil``: a new method is its
module and nothing else). The run config reads the methods' keys from here
without importing the registry, and the registry finds the built-in methods
with the same discovery.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import fedlr.strategies as builtin
from fedlr.discovery import import_submodules
from fedlr.options import Options

__all__ = ["load_builtin_methods", "method_option_keys", "record_method_options"]

_OPTIONS: dict[str, type[Options]] = {}


def record_method_options(name: str, options: type[Options]) -> None:
    """Record the options of method ``name`` (the registry calls this)."""
    _OPTIONS[name] = options


def load_builtin_methods() -> None:
    """Import every module of :mod:`fedlr.strategies` once (they register)."""
    import_submodules(builtin)


def method_option_keys() -> dict[str, dataclasses.Field[Any]]:
    """Every registered method option's run-config key and field.

    The common keys (:class:`~fedlr.config.RunConfig`) are not among them.
    The built-in methods are loaded first.
    """
    load_builtin_methods()
    keys: dict[str, dataclasses.Field[Any]] = {}
    for name in sorted(_OPTIONS):
        keys.update(_OPTIONS[name].option_fields())
    return keys
