r"""Typed run-config options: a frozen dataclass per group of keys.

Flower hands every node one flat ``run_config`` (``[tool.flwr.app.config]``
plus ``--run-config`` overrides). fedlr reads it in groups: the common keys
(:class:`fedlr.config.run.RunConfig`), the keys of a payload kind (e.g. VeRA's
projection rank, read by the clients and the server alike) and the keys of a
method (e.g. FedSpec's threshold, read by the server). Each group is an
:class:`Options` subclass: a frozen dataclass whose fields are its keys
(snake_case here, kebab-case in the run config), declared with
:func:`option`: default, help text, the values it allows (``range`` or
``choices``) and other values its checks refuse, in the field metadata. The
declared ranges and choices are checked for every group before its own
:meth:`Options.check`. The declarations are the one place a key is
described: ``python -m fedlr.configdoc write`` generates the pyproject table
and the key tables of ``docs/configuration.md`` from them (a range is shown
after the help text), and ``tests/unit/test_config_errors.py`` refuses a value
just outside every declared range.

Example::

    @dataclass(frozen=True)
    class FedSpecOptions(Options):
        fedspec_threshold: float = option(
            0.05, "grow the rank while the tail fraction exceeds this", range="[0, 1)"
        )

A key several methods read is declared by each of them with the same type,
help text and range; only the default may differ between methods
(:func:`redeclare` copies a declaration with another default). The method
registry checks both (:func:`fedlr.strategies.registration.register_method`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Self

from fedlr.errors import ConfigError

__all__ = [
    "METHOD_DEFAULT",
    "NoOptions",
    "Options",
    "Range",
    "bad_values",
    "coerce",
    "declaration",
    "kebab",
    "option",
    "redeclare",
    "require",
    "require_finite",
    "require_nonnegative",
    "require_positive",
]

METHOD_DEFAULT = ""
"""The run-config value of a key whose default differs between methods that
leaves each method its own default (what ``pyproject.toml`` holds for it)."""


def kebab(name: str) -> str:
    """``lora_rank`` -> ``lora-rank``."""
    return name.replace("_", "-")


_NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?(?:\*\*\d+)?"
_INTERVAL = re.compile(rf"^([\[(])\s*({_NUMBER})\s*,\s*({_NUMBER})\s*([\])])$")
_HALF_LINE = re.compile(rf"^(>=|>)\s*({_NUMBER})$")


def _number(text: str) -> float:
    """``"1"``, ``"0.5"``, ``"1e-3"`` or ``"2**32"`` as a number."""
    if "**" in text:
        base, power = text.split("**")
        return float(int(base) ** int(power))
    return float(text)


@dataclass(frozen=True)
class Range:
    """The values a numeric key allows, as declared: ``[0, 1)``, ``>= 1``, ``> 0``.

    An interval's bounds are written as the message shows them (``[0, 2**32)``);
    a half-line of a float key also requires a finite value.

    Attributes
    ----------
    text : str
        The declaration, e.g. ``"(0, 1]"`` or ``">= 0"``.
    low, high : float
        The bounds (``high`` is ``inf`` for a half-line).
    low_closed, high_closed : bool
        Whether each bound is allowed.
    """

    text: str
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> Range:
        """A :class:`Range` from its declaration.

        Raises
        ------
        ValueError
            If ``text`` is neither ``[a, b]``-style nor ``>= a`` / ``> a``, or
            the interval is empty.
        """
        spec = text.strip()
        interval = _INTERVAL.match(spec)
        if interval:
            opening, low, high, closing = interval.groups()
            made = cls(
                spec, _number(low), _number(high), opening == "[", closing == "]"
            )
            if made.low > made.high:
                raise ValueError(f"empty range {text!r}")
            return made
        half = _HALF_LINE.match(spec)
        if half:
            sign, low = half.groups()
            return cls(spec, _number(low), math.inf, sign == ">=", False)
        raise ValueError(
            f"range {text!r} is not '[a, b]', '[a, b)', '(a, b]', '(a, b)', "
            "'>= a' or '> a'"
        )

    @property
    def is_interval(self) -> bool:
        return math.isfinite(self.high)

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, (int, float)) or math.isnan(value):
            return False
        low_ok = value >= self.low if self.low_closed else value > self.low
        if not self.is_interval:
            return low_ok and math.isfinite(value)
        high_ok = value <= self.high if self.high_closed else value < self.high
        return low_ok and high_ok

    def phrase(self, kind: str) -> str:
        """What a value must be: ``in [0, 1)``, ``>= 1``, ``finite and > 0``."""
        if self.is_interval:
            return f"in {self.text}"
        return f"finite and {self.text}" if kind == "float" else self.text

    def describe(self, kind: str) -> str:
        """The range in the docs: ``in [0, 1)``, ``≥ 1``, ``finite and > 0``."""
        return self.phrase(kind).replace(">=", "≥")

    def outside(self, kind: str) -> list[Any]:
        """Values just outside the range (one per bound; ``inf`` for a float
        half-line), of the key's type: the refusals the tests try."""
        step = 1 if kind == "int" else 1.0
        out: list[Any] = []
        for bound, closed, direction in (
            (self.low, self.low_closed, -1),
            (self.high, self.high_closed, +1),
        ):
            if not math.isfinite(bound):
                continue
            value = bound + direction * step if closed else bound
            out.append(int(value) if kind == "int" else float(value))
        if kind == "float" and not self.is_interval:
            out.append(math.inf)
        return out


def option(
    default: Any,
    help: str,
    *,
    range: str | None = None,
    choices: Sequence[str] | None = None,
    bad: Iterable[tuple[Any, str]] = (),
) -> Any:
    """A dataclass field of an :class:`Options` class: one run-config key.

    The declaration is the key's only description: ``python -m
    fedlr.configdoc write`` renders the ``[tool.flwr.app.config]`` table of
    ``pyproject.toml`` and the key tables of ``docs/configuration.md`` from
    it, :class:`Options` checks the declared range and choices, and the tests
    refuse a value outside them and each bad value.

    Parameters
    ----------
    default : object
        The value when the run config does not set the key.
    help : str
        What the key does: one line of Markdown, shown as the key's row in
        ``docs/configuration.md`` (links relative to ``docs/``), followed there
        by the range; do not restate the range or the default.
    range : str, optional
        The values a numeric key allows (:meth:`Range.parse`): ``"[0, 1)"``,
        ``"(0, 1]"``, ``"[8, 4096]"``, ``">= 1"``, ``"> 0"`` (a float
        half-line is also finite). A value outside is refused with
        ``must be <range>, got <value>``.
    choices : sequence of str, optional
        The values a string key allows; another is refused with ``'<value>'
        is not one of <choices>``.
    bad : iterable of (value, str)
        Other values :meth:`Options.check` refuses, each with a regular
        expression of the :class:`~fedlr.errors.ConfigError` message
        (``tests/unit/test_config_errors.py`` parses each one). A key whose
        values are checked only when the apps start has none.

    Raises
    ------
    ValueError
        If ``help`` is not one line, ``range`` does not parse, or the default
        is outside the declared range or choices.
    """
    if "\n" in help or "|" in help:
        raise ValueError(f"help must be one line without '|': {help!r}")
    parsed = Range.parse(range) if range is not None else None
    if parsed is not None and default not in parsed:
        raise ValueError(f"default {default!r} is outside the range {range!r}")
    allowed = tuple(choices) if choices is not None else None
    if allowed is not None and default not in allowed:
        raise ValueError(f"default {default!r} is not among the choices {allowed}")
    cases = tuple((value, str(message)) for value, message in bad)
    metadata = {"help": help, "bad": cases, "range": parsed, "choices": allowed}
    return dataclasses.field(default=default, metadata=metadata)


def redeclare(options: type[Options], key: str, default: Any) -> Any:
    """``key``'s declaration in ``options`` with another default.

    For a method that reads a key another method declares (FedAdam-LoRA's
    ``server-lr``, declared by FedAvgM-LoRA): the same type, help text and
    range, and the method's own default::

        server_lr: float = redeclare(ServerMomentumOptions, "server-lr", 0.01)

    Raises
    ------
    KeyError
        If ``options`` has no such key.
    ValueError
        If ``default`` is outside the declared range or choices.
    """
    f = options.option_fields()[key]
    meta = f.metadata
    range_ = meta.get("range")
    return option(
        default,
        meta["help"],
        range=range_.text if range_ is not None else None,
        choices=meta.get("choices"),
        bad=meta.get("bad", ()),
    )


def _kind(f: dataclasses.Field[Any]) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


def declaration(
    f: dataclasses.Field[Any],
) -> tuple[str, str, str, tuple[str, ...] | None, tuple[tuple[Any, str], ...]]:
    """What a key means, apart from its default: (type, help, range, choices, bad).

    Two declarations of one key (by two methods) must be equal in these.
    """
    meta = f.metadata
    range_ = meta.get("range")
    return (
        _kind(f),
        str(meta.get("help", "")),
        range_.text if range_ is not None else "",
        meta.get("choices"),
        tuple(meta.get("bad", ())),
    )


def bad_values(key: str, f: dataclasses.Field[Any]) -> list[tuple[Any, str]]:
    """``(value, message regex)`` the key's declaration says are refused.

    The values just outside its range, one value not among its choices, and
    its ``bad`` values.
    """
    meta = f.metadata
    kind = _kind(f)
    cases: list[tuple[Any, str]] = []
    range_ = meta.get("range")
    if range_ is not None:
        expected = re.escape(f"must be {range_.phrase(kind)}, got")
        cases += [(value, expected) for value in range_.outside(kind)]
    choices = meta.get("choices")
    if choices is not None:
        cases.append((f"not-a-{key}", re.escape(f"is not one of {', '.join(choices)}")))
    cases += list(meta.get("bad", ()))
    return cases


def require(condition: bool, key: str, reason: str) -> None:
    """Raise :class:`ConfigError` for ``key`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, reason)


def require_positive(options: Options, *names: str, finite: bool = False) -> None:
    """Every named field is >= 1 (ints) or finite and > 0 (``finite=True``)."""
    for name in names:
        value = getattr(options, name)
        if finite:
            require(
                math.isfinite(value) and value > 0,
                kebab(name),
                f"must be finite and > 0, got {value}",
            )
        else:
            require(value >= 1, kebab(name), f"must be >= 1, got {value}")


def require_nonnegative(options: Options, *names: str) -> None:
    """Every named field is >= 0."""
    for name in names:
        value = getattr(options, name)
        require(value >= 0, kebab(name), f"must be >= 0, got {value}")


def require_finite(options: Options, *names: str) -> None:
    """Every named field is a finite number."""
    for name in names:
        value = getattr(options, name)
        require(math.isfinite(value), kebab(name), f"must be finite, got {value}")


_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "bool": ((bool,), "true/false"),
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
}
"""A field type's accepted Python types and how a refusal names it (a bool
is no number)."""


def coerce(key: str, raw: Any, annotation: Any) -> Any:
    """Check a run-config value's type against a field annotation.

    Raises
    ------
    ConfigError
        If ``raw`` is not of the field's type (ints are accepted for floats).
    """
    kind = annotation if isinstance(annotation, str) else annotation.__name__
    if kind not in _TYPES:
        raise ConfigError(key, f"unsupported field type {kind}")  # pragma: no cover
    types, expected = _TYPES[kind]
    accepted = isinstance(raw, types) and (kind == "bool" or not isinstance(raw, bool))
    if not accepted:
        raise ConfigError(key, f"expected {expected}, got {raw!r}")
    return float(raw) if kind == "float" else raw


@dataclass(frozen=True)
class Options:
    """Base of a group of run-config keys (subclass as a frozen dataclass)."""

    def __post_init__(self) -> None:
        self.check_declared()
        self.check()

    def check_declared(self) -> None:
        """Refuse a value outside its declared range or choices (in field order).

        Raises
        ------
        ConfigError
            Naming the key: ``must be in [0, 1), got 1.0``,
            ``'x' is not one of a, b``.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            range_ = f.metadata.get("range")
            if range_ is not None and value not in range_:
                reason = f"must be {range_.phrase(_kind(f))}, got {value}"
                raise ConfigError(kebab(f.name), reason)
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                reason = f"'{value}' is not one of {', '.join(choices)}"
                raise ConfigError(kebab(f.name), reason)

    def check(self) -> None:
        """Validate what the declarations cannot say; raise :class:`ConfigError`
        naming the key."""

    @classmethod
    def option_fields(cls) -> dict[str, dataclasses.Field[Any]]:
        """Run-config key (kebab-case) -> dataclass field, for every option (a
        field not declared with :func:`option` is no key)."""
        return {kebab(f.name): f for f in fields(cls) if "help" in f.metadata}

    @classmethod
    def from_run_config(
        cls, run_config: Mapping[str, Any], *, method_defaults: Collection[str] = ()
    ) -> Self:
        """This group's values from a flat run config; other keys are ignored.

        Parameters
        ----------
        run_config : mapping
            The flat run config (kebab-case keys).
        method_defaults : collection of str
            Keys whose default differs between methods: for them the value
            :data:`METHOD_DEFAULT` (``""``, what ``pyproject.toml`` holds)
            means "not set", and this group's own default applies.

        Raises
        ------
        ConfigError
            On a value of the wrong type or out of range.
        """
        values: dict[str, Any] = {}
        for key, f in cls.option_fields().items():
            if key not in run_config:
                continue
            raw = run_config[key]
            if key in method_defaults and raw == METHOD_DEFAULT:
                continue
            values[f.name] = coerce(key, raw, f.type)
        return cls(**values)

    @classmethod
    def of(cls, options: Options | None) -> Self:
        """``options`` checked to be this group (``None``: the defaults).

        Raises
        ------
        TypeError
            If ``options`` is another group (e.g. a method built with the
            options of another method).
        """
        if options is None:
            return cls()
        if not isinstance(options, cls):
            raise TypeError(
                f"expected {cls.__qualname__}, got {type(options).__qualname__}"
            )
        return options

    def to_mapping(self) -> dict[str, Any]:
        """Run-config form (kebab-case keys) of every option."""
        return {key: getattr(self, f.name) for key, f in self.option_fields().items()}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Run-config key (kebab-case) -> this group's declared default."""
        return {key: f.default for key, f in cls.option_fields().items()}

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (snake_case names), validated again."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class NoOptions(Options):
    """A payload kind or method without keys of its own.

    The ``lora`` payload kind reads only common keys, so a LoRA method with
    keys of its own extends this (``class FedSpecOptions(NoOptions)``).
    """
