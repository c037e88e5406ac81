"""Finding the built-in parts that register themselves: import a package's modules.

The methods register with a decorator in their own modules;
:func:`import_submodules` imports every module of a package once, so that the
method registry (:func:`fedlr.strategies.registry.load_builtin_methods`) finds
a new method in its module and nothing else. A discovery is an import of every
module of the package by the module that asks for it (the import-cycle test
counts it so): the registry sits above the strategy modules, which register
through :mod:`fedlr.strategies.registration`. :func:`import_extensions`
imports the user's modules named in the run config.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["ExtensionImportError", "import_extensions", "import_submodules"]

_DONE: set[str] = set()


class ExtensionImportError(ImportError):
    """A module named in the run config's ``extensions`` failed to import."""


def import_extensions(names: str) -> None:
    """Import the user modules ``names`` (comma-separated), once per process.

    The run config's ``extensions`` key: a user's module that calls
    :func:`fedlr.data.register_dataset` or :func:`fedlr.models.register_model`
    at import is imported on every process of a run (server, each client)
    before the rest of the config is resolved, so the names it registers are
    known everywhere.

    Raises
    ------
    ExtensionImportError
        Naming the module and the cause, when one fails to import.
    """
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ExtensionImportError(
                f"cannot import '{name}' ({type(exc).__name__}: {exc}); "
                "it must be importable on every process of the run (installed, "
                "or a module of the app's directory)"
            ) from exc


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
