"""The method registry: one validated :class:`MethodSpec` per method.

A method is one unit: its name, its strategy class, its options (a frozen
:class:`~fedlr.options.Options` dataclass of its own run-config keys) and its
payload kind (:class:`PayloadKind`: the run-config keys and the ClientApp
handlers of one kind of payload, see :mod:`fedlr.payloads`; the ServerApp
finds the kind's server plan by its name, :mod:`fedlr.server_apps.plans`). A
strategy module registers its method once, with the class decorator::

    @register_method(
        "fedspec",
        payload=LORA,
        options=FedSpecOptions,
        summary="truncated SVD of the mean of products, adaptive rank",
    )
    class FedSpec(SeededLoraStrategy): ...

The registry finds the built-in methods itself: the first lookup imports every
module of :mod:`fedlr.strategies`
(:func:`fedlr.method_options.load_builtin_methods`, so a new method is its
module and nothing else). The ServerApp and the ClientApp look methods up
with :func:`get_method`, never with ``if`` chains over names, and parse the
run config with :func:`resolve`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fedlr.config import RunConfig
from fedlr.errors import ConfigError, UnknownMethodError
from fedlr.features import ClientFeature, common_features, ordered
from fedlr.method_options import (
    load_builtin_methods,
    method_option_keys,
    record_method_options,
)
from fedlr.options import Options
from fedlr.payload_kind import PayloadKind
from fedlr.privacy import dp_sgd  # noqa: F401  (registers the common DP-SGD feature)
from fedlr.privacy.client_dp import check_privacy
from fedlr.strategies.base import FedLRStrategy

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "PayloadKind",
    "Traits",
    "all_option_keys",
    "available_methods",
    "client_features",
    "get_method",
    "option_defaults",
    "register_method",
    "registered_methods",
    "resolve",
]

T = TypeVar("T", bound=type)

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Traits:
    """What the server plan and the tooling need to know about a method.

    Attributes
    ----------
    personalised : bool
        Each client keeps part of its model; the round's accuracy is the mean
        of the clients' own evaluations (federated evaluation).
    heterogeneous_ranks : bool
        Accepts ``client-ranks`` (clients of different LoRA ranks).
    folds_base : bool
        Folds a residual into the frozen base weights (no quantised base).
    sum_only : bool
        The aggregation needs only (weighted) sums of the clients' arrays and
        extra records, never one client's arrays: the methods secure
        aggregation can serve (the per-round gap report, a diagnostic, does
        read each client's factors).
    plugin : bool
        A user's own model and ClientApp can run it (the payload kind's).
    """

    personalised: bool = False
    heterogeneous_ranks: bool = False
    folds_base: bool = False
    sum_only: bool = False
    plugin: bool = False


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
    client : tuple of type
        The method's client features (:class:`fedlr.features.ClientFeature`
        subclasses, each in the method's own module): what a node does for
        this method beyond the common round.
    sum_only : bool
        Declared at registration: see :class:`Traits`.
    """

    name: str
    strategy: type[FedLRStrategy]
    payload: PayloadKind
    options: type[Options]
    summary: str
    client: tuple[type[ClientFeature], ...] = ()
    sum_only: bool = False

    @property
    def traits(self) -> Traits:
        """The method's :class:`Traits`: ``sum_only`` as registered, the
        others as its strategy class (family) declares them."""
        cls = self.strategy
        return Traits(
            personalised=cls.personalised,
            heterogeneous_ranks=cls.heterogeneous_ranks,
            folds_base=cls.folds_base,
            sum_only=self.sum_only,
            plugin=self.payload.plugin,
        )

    def strategy_for(self, client_ranks: bool) -> type[FedLRStrategy]:
        """The strategy class a run builds: the registered one, or with
        ``client-ranks`` its declared heterogeneous-rank variant
        (:attr:`FedLRStrategy.hetero_variant`)."""
        variant = self.strategy.hetero_variant
        if client_ranks and variant is not None:
            return variant
        return self.strategy

    def __post_init__(self) -> None:
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
        odd = [c for c in self.client if not _is_feature(c)]
        if odd:
            raise TypeError(
                f"method '{self.name}': client features {odd!r} are not "
                "ClientFeature subclasses"
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


def register_method(
    name: str,
    *,
    payload: PayloadKind,
    summary: str,
    options: type[Options] | None = None,
    client: tuple[type[ClientFeature], ...] = (),
    sum_only: bool = False,
) -> Callable[[T], T]:
    """Class decorator registering a strategy as method ``name``.

    ``options`` defaults to the payload kind's options (a method without keys
    of its own); it becomes the class's ``options_type``, the options its
    constructor takes (``options=`` or field by field).

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
            client=tuple(client),
            sum_only=sum_only,
        )
        if name in _REGISTRY:
            raise ValueError(
                f"method '{name}' is already registered by "
                f"{_REGISTRY[name].strategy.__qualname__}"
            )
        _check_consistent(spec)
        declared = spec.strategy.__dict__.get("options_type")
        if declared is not None and declared is not spec.options:
            raise TypeError(
                f"method '{name}': {cls.__qualname__}.options_type is "
                f"{declared.__qualname__}, registered with "
                f"{spec.options.__qualname__}"
            )
        spec.strategy.options_type = spec.options
        _REGISTRY[name] = spec
        record_method_options(name, spec.options)
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


def _is_feature(cls: object) -> bool:
    return isinstance(cls, type) and issubclass(cls, ClientFeature)


def client_features() -> list[type[ClientFeature]]:
    """Every registered method's client features and the common ones
    (:func:`fedlr.features.common_feature`), each once, in run order."""
    own = [c for spec in registered_methods() for c in spec.client]
    return ordered([*own, *common_features()])


def get_method(name: str) -> MethodSpec:
    """Look up a method; unknown names raise :class:`UnknownMethodError`."""
    load_builtin_methods()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(name, available_methods()) from None


def available_methods() -> list[str]:
    """Registered method names, sorted."""
    load_builtin_methods()
    return sorted(_REGISTRY)


def registered_methods() -> list[MethodSpec]:
    """Every registered :class:`MethodSpec`, sorted by name."""
    load_builtin_methods()
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def all_option_keys() -> dict[str, dataclasses.Field[Any]]:
    """Every method option's run-config key and field (common keys excluded)."""
    return method_option_keys()


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
    if run.quantization != "none" and spec.traits.folds_base:
        raise ConfigError(
            "quantization",
            f"method '{spec.name}' folds each round's residual into the base "
            f"weights, which a {run.quantization} base cannot hold exactly "
            '(rounding would undo the fold); use quantization="none" or a '
            "method that keeps the base frozen (fedavg-lora, fedsvd, fedspec, "
            "ffa-lora, fedsa-lora, ...)",
        )
    check_privacy(
        spec.name,
        spec.traits.sum_only,
        spec.payload.name,
        run.privacy,
        [c for f in spec.client if (c := f.training_change(options)) is not None],
    )
    return MethodConfig(run=run, spec=spec, options=options)


def option_defaults() -> dict[str, Any]:
    """Default of every method option (the pyproject table's method keys)."""
    return {key: f.default for key, f in all_option_keys().items()}
