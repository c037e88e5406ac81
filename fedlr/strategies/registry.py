"""The method registry: ``method`` name -> strategy class and client kind.

Strategies register themselves with :func:`register_method`; the ServerApp
and ClientApp look methods up with :func:`get_method`, never with ``if``
chains over names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fedlr.errors import UnknownMethodError

__all__ = ["MethodSpec", "available_methods", "get_method", "register_method"]

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class MethodSpec:
    """A registered aggregation method.

    Attributes
    ----------
    name : str
        The ``method`` value in the run config.
    strategy_cls : type
        The Flower strategy class.
    client_kind : str
        Which ClientApp payload kind serves it (``lora`` ...).
    summary : str
        One line for listings.
    """

    name: str
    strategy_cls: type
    client_kind: str
    summary: str


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(name: str, *, client_kind: str, summary: str) -> Callable[[T], T]:
    """Class decorator adding a strategy to the registry.

    Raises
    ------
    ValueError
        If ``name`` is already registered.
    """

    def decorator(cls: T) -> T:
        if name in _REGISTRY:
            raise ValueError(
                f"method '{name}' is already registered by "
                f"{_REGISTRY[name].strategy_cls.__qualname__}"
            )
        _REGISTRY[name] = MethodSpec(name, cls, client_kind, summary)
        return cls

    return decorator


def get_method(name: str) -> MethodSpec:
    """Look up a method; unknown names raise :class:`UnknownMethodError`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(name, available_methods()) from None


def available_methods() -> list[str]:
    """Registered method names, sorted."""
    return sorted(_REGISTRY)
