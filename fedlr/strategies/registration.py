"""Registering a method: :class:`MethodSpec` and :func:`register_method`.

A method is one unit: its name, its strategy class, its options (a frozen
:class:`~fedlr.options.Options` dataclass of its own run-config keys) and its
payload kind (:class:`PayloadKind`: the run-config keys and the ClientApp
handlers of one kind of payload, see :mod:`fedlr.client_apps.payloads`; the ServerApp
finds the kind's server plan by its name, :mod:`fedlr.server_apps.plans`). A
strategy module registers its method once, with the class decorator::

    @register_method(
        "fedspec",
        payload=LORA,
        options=FedSpecOptions,
        summary="truncated SVD of the mean of products, adaptive rank",
    )
    class FedSpec(SeededLoraStrategy): ...

This module is what a strategy module imports to register; the lookups
(:func:`fedlr.strategies.registry.get_method`, ``resolve``, ...) are in
:mod:`fedlr.strategies.registry`, which finds the built-in methods by
importing every module of :mod:`fedlr.strategies` and so sits above them.
Each registration also records the method's client features in
:mod:`fedlr.client.method_features`, a table below the client side.

A run-config key two methods declare is one setting: the same type, help
text, range, choices and bad values (:func:`fedlr.options.redeclare` copies a
declaration); only the default may differ between methods, for a key of the
methods' own (not a payload kind's, which the clients read without knowing the
method) that is not a string (``""`` in ``pyproject.toml`` stands for "each
method's own default", :data:`fedlr.options.METHOD_DEFAULT`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from fedlr.client.features import ClientFeature, Record
from fedlr.client.method_features import record_method_features
from fedlr.client_apps.payload_kind import PayloadKind
from fedlr.config.run import RunConfig
from fedlr.options import Options, declaration
from fedlr.robust.spaces import AGGREGATION_SPACES
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.refusals import PrivacyTraits

__all__ = [
    "ClientContract",
    "ContractVariant",
    "MethodSpec",
    "OptionClashError",
    "PayloadKind",
    "Traits",
    "check_shared_keys",
    "register_method",
    "registered",
]

T = TypeVar("T", bound=type)

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


class OptionClashError(ValueError):
    """Two methods declare one run-config key as two different settings."""


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
    aggregation_space : str or None
        A LoRA method's declared space (its strategy's ``aggregation_space``,
        one of :data:`~fedlr.robust.spaces.AGGREGATION_SPACES`): ``factors``
        where it combines ``A`` and ``B`` apart, ``product`` where only the
        products reach its aggregate; the screen, the robust rules and the
        server-update clip measure a reply there. None: not a LoRA method
        (its reply step's own space).
    """

    personalised: bool = False
    heterogeneous_ranks: bool = False
    folds_base: bool = False
    sum_only: bool = False
    plugin: bool = False
    aggregation_space: str | None = None


@dataclass(frozen=True)
class ContractVariant:
    """What a plug-in ClientApp relies on in one variant of a method's round.

    Attributes
    ----------
    when : str
        The variant, as it follows the method's name in the table
        (``with pruning``, ``with `client-ranks```).
    carries : str
        What the instruction carries in this variant.
    helpers : str
        What the helpers (``apply_round``, ``job.reply()``, ...) do, or what
        the ClientApp must call, in this variant.
    """

    when: str
    carries: str
    helpers: str

    def __post_init__(self) -> None:
        blank = [n for n in ("when", "carries", "helpers") if not getattr(self, n)]
        if blank:
            raise ValueError(f"client contract variant: {blank} are empty")


@dataclass(frozen=True)
class ClientContract:
    """What a plug-in ClientApp relies on for a method: one row of the
    generated table of ``docs/plugin.md`` ("What each method needs from the
    client", :func:`fedlr.configdoc.generate.render_plugin`).

    Attributes
    ----------
    carries : str
        What the method's instruction carries (arrays, records, config keys).
    helpers : str
        What the helpers (``apply_round``, ``job.penalty()``,
        ``job.reply()``, ...) do for it, or what the ClientApp must call.
    variants : tuple of ContractVariant
        Variants of the round with their own needs, each a row after the
        method's (``hetlora`` with pruning).
    """

    carries: str
    helpers: str
    variants: tuple[ContractVariant, ...] = ()

    def __post_init__(self) -> None:
        blank = [n for n in ("carries", "helpers") if not getattr(self, n)]
        if blank:
            raise ValueError(f"client contract: {blank} are empty")
        odd = [v for v in self.variants if not isinstance(v, ContractVariant)]
        if odd:
            raise TypeError(f"client contract variants {odd!r} are not ContractVariant")


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
        The method's client features (:class:`fedlr.client.features.ClientFeature`
        subclasses, each in the method's own module): what a node does for
        this method beyond the common round.
    sum_only : bool
        Declared at registration: see :class:`Traits`.
    records : tuple of Record
        Extra reply records that no client feature declares (the payload
        kind's handler sends them: FOT's ``sketches``, QR-Mix's ``eigen``);
        with the features' (:attr:`ClientFeature.sends`), what the
        configuration-time privacy check sees
        (:func:`fedlr.strategies.refusals.check_privacy`).
    client_contract : ClientContract or None
        What a plug-in ClientApp relies on (its row in ``docs/plugin.md``);
        every method of a plug-in payload kind (``payload.plugin``: the LoRA
        and VeRA families) declares one, the others none.
    """

    name: str
    strategy: type[FedLRStrategy]
    payload: PayloadKind
    options: type[Options]
    summary: str
    client: tuple[type[ClientFeature], ...] = ()
    sum_only: bool = False
    records: tuple[Record, ...] = ()
    client_contract: ClientContract | None = None

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
            aggregation_space=getattr(cls, "aggregation_space", None),
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
        space = getattr(self.strategy, "aggregation_space", None)
        if space is not None and space not in AGGREGATION_SPACES:
            raise TypeError(
                f"method '{self.name}': aggregation_space {space!r} is none of "
                f"{list(AGGREGATION_SPACES)}"
            )
        contract = self.client_contract
        if contract is not None and not isinstance(contract, ClientContract):
            raise TypeError(
                f"method '{self.name}': client_contract {contract!r} is not a "
                "ClientContract"
            )


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(
    name: str,
    *,
    payload: PayloadKind,
    summary: str,
    options: type[Options] | None = None,
    client: tuple[type[ClientFeature], ...] = (),
    sum_only: bool = False,
    records: tuple[Record, ...] = (),
    client_contract: ClientContract | None = None,
) -> Callable[[T], T]:
    """Class decorator registering a strategy as method ``name``.

    ``options`` defaults to the payload kind's options (a method without keys
    of its own); it becomes the class's ``options_type``, the options its
    constructor takes (``options=`` or field by field). ``client_contract``
    says what a plug-in ClientApp relies on (the method's row in
    ``docs/plugin.md``, generated by ``python -m fedlr.configdoc write``): every
    method of a plug-in payload kind declares one.

    Raises
    ------
    ValueError
        If ``name`` is taken.
    OptionClashError
        If its options declare a key that a registered method declares as
        another setting (:func:`check_shared_keys`).
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
            records=tuple(records),
            client_contract=client_contract,
        )
        if name in _REGISTRY:
            raise ValueError(
                f"method '{name}' is already registered by "
                f"{_REGISTRY[name].strategy.__qualname__}"
            )
        check_shared_keys(spec, _REGISTRY.values())
        declared = spec.strategy.__dict__.get("options_type")
        if declared is not None and declared is not spec.options:
            raise TypeError(
                f"method '{name}': {cls.__qualname__}.options_type is "
                f"{declared.__qualname__}, registered with "
                f"{spec.options.__qualname__}"
            )
        spec.strategy.options_type = spec.options
        spec.strategy.privacy_traits = PrivacyTraits(  # its constructor refuses too
            name, spec.sum_only, payload.name, spec.client, spec.records
        )
        _REGISTRY[name] = spec
        record_method_features(name, spec.client)
        return cls

    return decorator


def _describe(spec: MethodSpec, key: str, f: dataclasses.Field[Any]) -> str:
    """``FedAdamOptions.server_lr: float = 0.01, in (0, 1], "help"`` of method ..."""
    kind, help_text, range_text, choices, bad = declaration(f)
    parts = [f"{kind} = {f.default!r}"]
    if range_text:
        parts.append(f"range {range_text}")
    if choices is not None:
        parts.append(f"choices {list(choices)}")
    if bad:
        parts.append(f"bad {[value for value, _ in bad]}")
    parts.append(f"help {help_text!r}")
    return (
        f"method '{spec.name}' declares '{key}' as "
        f"{spec.options.__qualname__}.{f.name}: {', '.join(parts)}"
    )


def check_shared_keys(spec: MethodSpec, others: Iterable[MethodSpec]) -> None:
    """A key ``spec`` shares with registered methods is the same setting.

    Each other method's declaration of the key must have the same type, help
    text, range, choices and bad values. The defaults may differ, but only for
    a key of the methods' own that is not a string: a payload kind's key is
    read by the clients without knowing the method, and a string key's
    ``""`` (:data:`fedlr.options.METHOD_DEFAULT`) could be a value.

    Raises
    ------
    OptionClashError
        Naming both methods and both declarations.
    """
    mine = spec.options.option_fields()
    for other in others:
        theirs = other.options.option_fields()
        for key in sorted(set(mine) & set(theirs)):
            f, g = mine[key], theirs[key]
            reason = ""
            if declaration(f) != declaration(g):
                reason = (
                    "one key is one setting: declare it with the same type, help, "
                    "range, choices and bad values (fedlr.options.redeclare "
                    "copies a declaration), or name the new setting differently"
                )
            elif f.default != g.default:
                own = (
                    key not in spec.payload.options.option_fields()
                    and key not in other.payload.options.option_fields()
                )
                if not own:
                    reason = (
                        "a payload kind's key is read by the clients, which do not "
                        "know the method: it has one default"
                    )
                elif declaration(f)[0] == "str":
                    reason = (
                        'a string key has one default ("" could be a value, so it '
                        "cannot stand for each method's own default)"
                    )
            if reason:
                raise OptionClashError(
                    f"run-config key '{key}' clashes: {_describe(spec, key, f)}; "
                    f"{_describe(other, key, g)}; {reason}"
                )


def _is_feature(cls: object) -> bool:
    return isinstance(cls, type) and issubclass(cls, ClientFeature)


def registered() -> list[MethodSpec]:
    """The methods registered so far, sorted by name (no built-in is loaded:
    :func:`fedlr.strategies.registry.registered_methods` loads them first)."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]
