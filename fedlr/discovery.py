"""Finding the built-in parts that register themselves: import a package's modules.

The method registry (:mod:`fedlr.method_options`) and the server plans
(:mod:`fedlr.server_apps.plans`) are filled by decorators in their own
modules; :func:`import_submodules` imports every module of a package once so
that a new method or plan is its module and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["import_submodules"]

_DONE: set[str] = set()


def import_submodules(package: ModuleType) -> None:
    """Import every module of ``package``, once per process.

    A module that fails to import raises here, on every call, rather than
    leaving a registry that silently lacks what it registers.
    """
    if package.__name__ in _DONE:
        return
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _DONE.add(package.__name__)
