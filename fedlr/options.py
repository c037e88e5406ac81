r"""Typed run-config options: a frozen dataclass per group of keys.

Flower hands every node one flat ``run_config`` (``[tool.flwr.app.config]``
plus ``--run-config`` overrides). fedlr reads it in groups: the common keys
(:class:`fedlr.config.RunConfig`), the keys of a payload kind (e.g. VeRA's
projection rank, read by the clients and the server alike) and the keys of a
method (e.g. FedSpec's threshold, read by the server). Each group is an
:class:`Options` subclass: a frozen dataclass whose fields are its keys
(snake_case here, kebab-case in the run config), declared with
:func:`option` (default, help text and values it refuses, in the field
metadata), with the checks in :meth:`Options.check`. The declarations are the
one place a key is described: ``python -m fedlr.configdoc write`` generates
the pyproject table and the key tables of ``docs/configuration.md`` from them.

Example::

    @dataclass(frozen=True)
    class FedSpecOptions(Options):
        fedspec_threshold: float = option(
            0.05, "grow the rank while ..., in [0, 1)", bad=[(1.0, "must be in")]
        )

        def check(self) -> None:
            require(0.0 <= self.fedspec_threshold < 1.0, "fedspec-threshold",
                    f"must be in [0, 1), got {self.fedspec_threshold}")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Self

from fedlr.errors import ConfigError

__all__ = [
    "NoOptions",
    "Options",
    "coerce",
    "kebab",
    "option",
    "require",
    "require_positive",
]


def kebab(name: str) -> str:
    """``lora_rank`` -> ``lora-rank``."""
    return name.replace("_", "-")


def option(default: Any, help: str, *, bad: Iterable[tuple[Any, str]] = ()) -> Any:
    """A dataclass field of an :class:`Options` class: one run-config key.

    The declaration is the key's only description: ``python -m
    fedlr.configdoc write`` renders the ``[tool.flwr.app.config]`` table of
    ``pyproject.toml`` and the key tables of ``docs/configuration.md`` from
    it, and the tests refuse each bad value.

    Parameters
    ----------
    default : object
        The value when the run config does not set the key.
    help : str
        What the key does and which values it allows: one line of Markdown,
        shown as the key's row in ``docs/configuration.md`` (links relative
        to ``docs/``).
    bad : iterable of (value, str)
        Values :meth:`Options.check` refuses, each with a regular expression
        of the :class:`~fedlr.errors.ConfigError` message
        (``tests/unit/test_config_errors.py`` parses each one). A key whose
        values are checked only when the apps start has none.
    """
    if "\n" in help or "|" in help:
        raise ValueError(f"help must be one line without '|': {help!r}")
    cases = tuple((value, str(message)) for value, message in bad)
    return dataclasses.field(default=default, metadata={"help": help, "bad": cases})


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


def coerce(key: str, raw: Any, annotation: Any) -> Any:
    """Check a run-config value's type against a field annotation.

    Raises
    ------
    ConfigError
        If ``raw`` is not of the field's type (ints are accepted for floats).
    """
    kind = annotation if isinstance(annotation, str) else annotation.__name__
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        raise ConfigError(key, f"expected true/false, got {raw!r}")
    if kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(key, f"expected an integer, got {raw!r}")
        return raw
    if kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(key, f"expected a number, got {raw!r}")
        return float(raw)
    if kind == "str":
        if not isinstance(raw, str):
            raise ConfigError(key, f"expected a string, got {raw!r}")
        return raw
    raise ConfigError(key, f"unsupported field type {kind}")  # pragma: no cover


@dataclass(frozen=True)
class Options:
    """Base of a group of run-config keys (subclass as a frozen dataclass)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Validate the values; raise :class:`ConfigError` naming the key."""

    @classmethod
    def option_fields(cls) -> dict[str, dataclasses.Field[Any]]:
        """Run-config key (kebab-case) -> dataclass field, for every option."""
        return {kebab(f.name): f for f in fields(cls)}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Self:
        """This group's values from a flat run config; other keys are ignored.

        Raises
        ------
        ConfigError
            On a value of the wrong type or out of range.
        """
        values: dict[str, Any] = {}
        for key, f in cls.option_fields().items():
            if key in run_config:
                values[f.name] = coerce(key, run_config[key], f.type)
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
        return {kebab(f.name): getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (snake_case names), validated again."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class NoOptions(Options):
    """A payload kind or method without keys of its own.

    The ``lora`` payload kind reads only common keys, so a LoRA method with
    keys of its own extends this (``class FedSpecOptions(NoOptions)``).
    """
