"""The method registry: one validated :class:`MethodSpec` per method.

A method is one unit: its name, its strategy class, its options (a frozen
:class:`~fedlr.options.Options` dataclass of its own run-config keys) and its
payload kind (:class:`PayloadKind`: the ClientApp handlers and the server plan
of one kind of payload, see :mod:`fedlr.payloads`). A strategy module
registers its method once, with the class decorator::

    @register_method(
        "fedspec",
        payload=LORA,
        options=FedSpecOptions,
        summary="truncated SVD of the mean of products, adaptive rank",
    )
    class FedSpec(SvdLoraStrategy): ...

The registry finds the built-in methods itself: the first lookup imports every
module of :mod:`fedlr.strategies` (so a new method is its module and nothing
else). The ServerApp and the ClientApp look methods up with
:func:`get_method`, never with ``if`` chains over names, and parse the run
config with :func:`resolve`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fedlr.config import RunConfig
from fedlr.errors import ConfigError, UnknownMethodError
from fedlr.options import Options

if TYPE_CHECKING:
    from flwr.app import Context, Message

    from fedlr.server_apps.plans import ServerPlan
    from fedlr.strategies.base import FedLRStrategy

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "PayloadKind",
    "all_option_keys",
    "available_methods",
    "get_method",
    "option_defaults",
    "register_method",
    "registered_methods",
    "resolve",
]

Handler = Callable[["Message", "Context"], "Message"]
PlanBuilder = Callable[["MethodConfig"], "ServerPlan"]
T = TypeVar("T", bound=type)

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class PayloadKind:
    """What travels between server and clients for a family of methods.

    Attributes
    ----------
    name : str
        ``lora``, ``vera``, ``sorf-vera``, ``qrmix`` or ``gpse``.
    options : type of Options
        The run-config keys both sides read (e.g. VeRA's projection rank);
        every method of this kind has options that extend these.
    train, evaluate : callable
        The ClientApp handlers, ``(message, context) -> reply``.
    plan : callable
        The server plan builder, ``plan(method_config) -> ServerPlan``.
    """

    name: str
    options: type[Options]
    train: Handler
    evaluate: Handler
    plan: PlanBuilder


@dataclass(frozen=True)
class MethodSpec:
    """A registered aggregation method.

    Attributes
    ----------
    name : str
        The ``method`` value in the run config (kebab-case).
    strategy : type of FedLRStrategy
        The Flower strategy class.
    payload : PayloadKind
        The client handlers and server plan that serve it.
    options : type of Options
        The method's own run-config keys; a subclass of ``payload.options``.
    summary : str
        One line for listings.
    """

    name: str
    strategy: type[FedLRStrategy]
    payload: PayloadKind
    options: type[Options]
    summary: str

    def __post_init__(self) -> None:
        from fedlr.strategies.base import FedLRStrategy

        if not _NAME.match(self.name):
            raise ValueError(
                f"method name '{self.name}' must be kebab-case (e.g. 'fedex-lora')"
            )
        if not (
            isinstance(self.strategy, type) and issubclass(self.strategy, FedLRStrategy)
        ):
            raise TypeError(
                f"method '{self.name}': strategy {self.strategy!r} is not a "
                "FedLRStrategy subclass"
            )
        if not issubclass(self.options, self.payload.options):
            raise TypeError(
                f"method '{self.name}': options {self.options.__qualname__} must "
                f"extend its payload kind's {self.payload.options.__qualname__}"
            )
        shadowed = sorted(
            set(self.options.option_fields()) & set(RunConfig.option_fields())
        )
        if shadowed:
            raise ValueError(
                f"method '{self.name}': options redeclare common run-config keys "
                f"{shadowed}"
            )


@dataclass(frozen=True)
class MethodConfig:
    """A parsed run config: the common keys, the method and its options.

    Attributes
    ----------
    run : RunConfig
    spec : MethodSpec
    options : Options
        An instance of ``spec.options`` (the payload kind's keys included).
    """

    run: RunConfig
    spec: MethodSpec
    options: Options

    def to_mapping(self) -> dict[str, Any]:
        """The flat run config (every common key and every option)."""
        return {**self.run.to_mapping(), **self.options.to_mapping()}


_REGISTRY: dict[str, MethodSpec] = {}
_LOADED = False


def register_method(
    name: str,
    *,
    payload: PayloadKind,
    summary: str,
    options: type[Options] | None = None,
) -> Callable[[T], T]:
    """Class decorator registering a strategy as method ``name``.

    ``options`` defaults to the payload kind's options (a method without keys
    of its own).

    Raises
    ------
    ValueError
        If ``name`` is taken, or its options declare a key that another
        registered method declares with another type or default.
    TypeError
        If the class is not a FedLRStrategy or the options do not extend the
        payload kind's.
    """

    def decorator(cls: T) -> T:
        spec = MethodSpec(
            name=name,
            strategy=cls,
            payload=payload,
            options=options or payload.options,
            summary=summary,
        )
        if name in _REGISTRY:
            raise ValueError(
                f"method '{name}' is already registered by "
                f"{_REGISTRY[name].strategy.__qualname__}"
            )
        _check_consistent(spec)
        _REGISTRY[name] = spec
        return cls

    return decorator


def _check_consistent(spec: MethodSpec) -> None:
    """A key declared by several methods has one type and one default."""
    for other in _REGISTRY.values():
        theirs = other.options.option_fields()
        for key, f in spec.options.option_fields().items():
            if key in theirs and (
                str(theirs[key].type) != str(f.type) or theirs[key].default != f.default
            ):
                raise ValueError(
                    f"option '{key}' of method '{spec.name}' ({f.type} = "
                    f"{f.default!r}) disagrees with method '{other.name}' "
                    f"({theirs[key].type} = {theirs[key].default!r})"
                )


def _load_builtin() -> None:
    """Import every module of :mod:`fedlr.strategies` once (they register)."""
    global _LOADED
    if _LOADED:
        return
    import fedlr.strategies as package

    # A module that fails to import raises here, on every lookup, rather than
    # leaving a registry that silently lacks its methods.
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _LOADED = True


def get_method(name: str) -> MethodSpec:
    """Look up a method; unknown names raise :class:`UnknownMethodError`."""
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(name, available_methods()) from None


def available_methods() -> list[str]:
    """Registered method names, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def registered_methods() -> list[MethodSpec]:
    """Every registered :class:`MethodSpec`, sorted by name."""
    _load_builtin()
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def all_option_keys() -> dict[str, dataclasses.Field[Any]]:
    """Every method option's run-config key and field (common keys excluded)."""
    keys: dict[str, dataclasses.Field[Any]] = {}
    for spec in registered_methods():
        keys.update(spec.options.option_fields())
    return keys


def resolve(run_config: Mapping[str, Any]) -> MethodConfig:
    """Parse a flat Flower run config: common keys, method, method options.

    Keys of other methods are accepted (one pyproject table serves every
    method) and ignored; a key no method knows is an error.

    Raises
    ------
    ConfigError
        On an unknown key or a bad value, naming the key.
    UnknownMethodError
        If ``method`` is not registered.
    """
    run = RunConfig.from_mapping(run_config)
    spec = get_method(run.method)
    options = spec.options.from_run_config(run_config)
    if run.quantization != "none" and getattr(spec.strategy, "folds_base", False):
        raise ConfigError(
            "quantization",
            f"method '{spec.name}' folds each round's residual into the base "
            f"weights, which a {run.quantization} base cannot hold exactly "
            '(rounding would undo the fold); use quantization="none" or a '
            "method that keeps the base frozen (fedavg-lora, fedsvd, fedspec, "
            "ffa-lora, fedsa-lora, ...)",
        )
    return MethodConfig(run=run, spec=spec, options=options)


def option_defaults() -> dict[str, Any]:
    """Default of every method option (the pyproject table's method keys)."""
    return {key: f.default for key, f in all_option_keys().items()}
