"""Every public name a module declares in ``__all__`` exists and star-imports.

``from fedlr.linalg import *`` once raised AttributeError on names listed in
``__all__`` but never imported; this walks every package and module under
``fedlr/`` (``pkgutil``), so a stale ``__all__`` anywhere fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import pytest

import fedlr


def _module_names() -> list[str]:
    def fail(name: str) -> None:
        raise ImportError(f"cannot import package {name}")

    found = pkgutil.walk_packages(fedlr.__path__, prefix="fedlr.", onerror=fail)
    # a package's __main__ is the `python -m` entry point: importing it runs it
    names = (info.name for info in found if not info.name.endswith(".__main__"))
    return ["fedlr", *sorted(names)]


MODULES = _module_names()


def test_walk_finds_the_packages_and_their_modules() -> None:
    for name in (
        "fedlr.linalg",
        "fedlr.linalg.sorf_refit",
        "fedlr.strategies",
        "fedlr.strategies.base",
        "fedlr.client_apps",
        "fedlr.server_apps",
    ):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_every_name_in_all_exists(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return  # no declared surface: the star import is checked below
    assert all(isinstance(n, str) for n in exported), exported
    assert len(set(exported)) == len(exported), f"duplicates in {name}.__all__"
    missing = [n for n in exported if not hasattr(module, n)]  # lazy names load
    assert missing == [], f"{name}.__all__ names missing attributes: {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_star_import_works(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)  # a module name from the walk
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is not None:
        assert set(exported) <= set(namespace)
        for n in exported:
            assert namespace[n] is getattr(module, n)


def _public_all(module: ModuleType) -> set[str]:
    return set(getattr(module, "__all__", ()))


def test_linalg_reexports_every_kernel_module() -> None:
    import fedlr.linalg

    kernels = [m for m in MODULES if m.startswith("fedlr.linalg.")]
    assert kernels
    for name in kernels:
        names = _public_all(importlib.import_module(name))
        missing = sorted(names - _public_all(fedlr.linalg))
        assert missing == [], f"fedlr.linalg does not re-export {missing} of {name}"
