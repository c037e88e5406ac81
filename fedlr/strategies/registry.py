"""The method registry: every registered :class:`MethodSpec`, looked up by name.

A strategy module registers its method with
:func:`~fedlr.strategies.registration.register_method` (in
:mod:`fedlr.strategies.registration`, re-exported here). This module is the
lookup side: it finds the built-in methods itself, importing every module of
:mod:`fedlr.strategies` on the first lookup (:func:`load_builtin_methods`, so
a new method is its module and nothing else), which is why it sits above the
strategy modules and none of them imports it. The ServerApp and the ClientApp
look methods up with :func:`get_method`, never with ``if`` chains over names,
and parse the run config with :func:`resolve`: the common keys
(:class:`~fedlr.config.run.RunConfig`, which knows no method), the method, and its
options, refusing a key no registered method declares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fedlr.strategies as builtin
from fedlr.client.features import ClientFeature
from fedlr.client.method_features import client_features as recorded_features
from fedlr.client.method_features import mark_builtin_loaded
from fedlr.client_apps.payload_kind import PayloadKind
from fedlr.config.run import RunConfig, load_extensions
from fedlr.discovery import import_submodules
from fedlr.errors import ConfigError, UnknownMethodError
from fedlr.options import METHOD_DEFAULT, Options
from fedlr.privacy import dp_sgd  # noqa: F401  (registers the common DP-SGD feature)
from fedlr.robust.heldout import check_heldout_method
from fedlr.robust.rules import ROBUST_AUTO
from fedlr.robust.server_update import (
    AUTO_SHARE,
    refuse_server_update,
    server_update_refusal,
)
from fedlr.strategies.refusals import check_privacy, reply_records
from fedlr.strategies.registration import (
    MethodSpec,
    OptionClashError,
    Traits,
    register_method,
    registered,
)

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "OptionClashError",
    "PayloadKind",
    "Traits",
    "all_option_keys",
    "available_methods",
    "client_features",
    "get_method",
    "load_builtin_methods",
    "method_defaults",
    "option_defaults",
    "register_method",
    "registered_methods",
    "resolve",
    "resolve_auto",
]


@dataclass(frozen=True)
class MethodConfig:
    """A parsed run config: the common keys, the method and its options.

    Attributes
    ----------
    run : RunConfig
    spec : MethodSpec
    options : Options
        An instance of ``spec.options`` (the payload kind's keys included).
    auto : str
        What ``robust = auto`` became and why (the start-up line); empty
        when ``robust`` was set.
    """

    run: RunConfig
    spec: MethodSpec
    options: Options
    auto: str = ""

    def to_mapping(self) -> dict[str, Any]:
        """The flat run config (every common key and every option)."""
        return {**self.run.to_mapping(), **self.options.to_mapping()}

    def defaults(self) -> dict[str, Any]:
        """Every key of :meth:`to_mapping` with its declared default."""
        return {**self.run.defaults(), **self.options.defaults()}


def load_builtin_methods() -> None:
    """Import every module of :mod:`fedlr.strategies` once (they register)."""
    import_submodules(builtin)
    mark_builtin_loaded()


def client_features() -> list[type[ClientFeature]]:
    """Every registered method's client features and the common ones
    (:func:`fedlr.client.features.common_feature`), each once, in run order
    (the built-in methods loaded first; :mod:`fedlr.client.method_features`)."""
    load_builtin_methods()
    return recorded_features()


def get_method(name: str) -> MethodSpec:
    """Look up a method; unknown names raise :class:`UnknownMethodError`."""
    for spec in registered_methods():
        if spec.name == name:
            return spec
    raise UnknownMethodError(name, available_methods())


def available_methods() -> list[str]:
    """Registered method names, sorted."""
    return [spec.name for spec in registered_methods()]


def registered_methods() -> list[MethodSpec]:
    """Every registered :class:`MethodSpec`, sorted by name."""
    load_builtin_methods()
    return registered()


def all_option_keys() -> dict[str, dataclasses.Field[Any]]:
    """Every method option's run-config key and field (common keys excluded).

    A key several methods declare has one declaration up to its default
    (:func:`~fedlr.strategies.registration.check_shared_keys`); the first
    method's (by name) is returned.
    """
    keys: dict[str, dataclasses.Field[Any]] = {}
    for spec in registered_methods():
        for key, f in spec.options.option_fields().items():
            keys.setdefault(key, f)
    return keys


def method_defaults() -> dict[str, dict[str, Any]]:
    """The keys whose default differs between methods: key -> {method: default}.

    ``pyproject.toml`` holds :data:`fedlr.options.METHOD_DEFAULT` (``""``)
    for them, which :func:`resolve` reads as "not set": each method then uses
    its own default.
    """
    defaults: dict[str, dict[str, Any]] = {}
    for spec in registered_methods():
        for key, f in spec.options.option_fields().items():
            defaults.setdefault(key, {})[spec.name] = f.default
    return {
        key: by_method
        for key, by_method in defaults.items()
        if len({repr(value) for value in by_method.values()}) > 1
    }


def resolve(run_config: Mapping[str, Any]) -> MethodConfig:
    """Parse a flat Flower run config: common keys, method, method options.

    Keys of other methods are accepted (one pyproject table serves every
    method) and ignored; a key no registered method declares is an error,
    with the closest key. A key whose default differs between methods and
    whose value is ``""`` (what ``pyproject.toml`` holds for it) takes the
    method's own default.

    Raises
    ------
    ConfigError
        On an unknown key or a bad value, naming the key.
    UnknownMethodError
        If ``method`` is not registered.
    """
    load_extensions(run_config)  # an extension may register a method
    run = RunConfig.from_mapping(run_config, method_keys=all_option_keys())
    spec = get_method(run.method)
    options = spec.options.from_run_config(
        run_config, method_defaults=method_defaults()
    )
    if run.quantization != "none" and spec.traits.folds_base:
        raise ConfigError(
            "quantization",
            f"method '{spec.name}' folds each round's residual into the base "
            f"weights, which a {run.quantization} base cannot hold exactly "
            '(rounding would undo the fold); use quantization="none" or a '
            "method that keeps the base frozen (fedavg-lora, fedsvd, fedspec, "
            "ffa-lora, fedsa-lora, ...)",
        )
    run, auto = resolve_auto(run, spec)
    if run.heldout_check:
        check_heldout_method(
            spec.name,
            spec.payload.name,
            spec.traits.personalised,
            secure_aggregation=run.secure_aggregation,
            client_dp=run.privacy.client_dp is not None,
        )
    if run.clip_reference == "server" and run.server_update_share == 0:
        raise ConfigError(
            "clip-reference",
            "'server' clips at the norm of the server's own update; set "
            "server-update-share > 0",
        )
    if run.server_update_share > 0:
        refuse_server_update(
            server_update_refusal(**_server_update_conditions(run, spec))
        )
    check_privacy(
        spec.name,
        spec.traits.sum_only,
        spec.payload.name,
        run.privacy,
        spec.client,
        options,
        spec.records,
    )
    return MethodConfig(run=run, spec=spec, options=options, auto=auto)


def _server_update_conditions(run: RunConfig, spec: MethodSpec) -> dict[str, Any]:
    """What :func:`~fedlr.robust.server_update.server_update_refusal` reads of
    a run: the method's registered traits, records and engine, and the run's
    exchanges."""
    records = sorted({r.name for _, r in reply_records(spec.client, spec.records)})
    return {
        "method": spec.name,
        "payload": spec.payload.name,
        "personalised": spec.traits.personalised,
        "secure_aggregation": run.secure_aggregation,
        "client_dp": run.privacy.client_dp is not None,
        "records": records,
        "asynchronous": spec.strategy.asynchronous,
        "client_ranks": bool(run.rank_list),
    }


def resolve_auto(run: RunConfig, spec: MethodSpec) -> tuple[RunConfig, str]:
    """``robust = auto`` made concrete for ``spec``'s run, and a line saying
    what it became and why (``""`` when ``robust`` is set).

    Where the server can train the method's round
    (:func:`~fedlr.robust.server_update.server_update_refusal` finds nothing):
    ``norm-clip`` at ``clip-ratio`` times the norm of the server's own update
    (``clip-reference = server``), which enters each round at
    ``server-update-share`` (:data:`~fedlr.robust.server_update.AUTO_SHARE`
    when it is 0). Elsewhere ``none``, with the reason. The run's other keys
    are kept: an explicit ``server-update-share`` that the method cannot take
    is still refused, by its own key.
    """
    if run.robust != ROBUST_AUTO:
        return run, ""
    reason = server_update_refusal(**_server_update_conditions(run, spec))
    if reason is not None:
        return (
            dataclasses.replace(run, robust="none"),
            f"robust = auto: no rule, as the server cannot add its own update "
            f"here ({reason})",
        )
    share = run.server_update_share or AUTO_SHARE
    return (
        dataclasses.replace(
            run, robust="norm-clip", clip_reference="server", server_update_share=share
        ),
        f"robust = auto: norm-clip at {run.clip_ratio:g} x the norm of the "
        f"server's own update, which enters each round at share {share:g} "
        "(docs/reliability.md, 'The default: robust = auto')",
    )


def option_defaults() -> dict[str, Any]:
    """Each method option's value in the pyproject table: its default, or
    :data:`~fedlr.options.METHOD_DEFAULT` where methods declare
    different ones."""
    per_method = method_defaults()
    return {
        key: METHOD_DEFAULT if key in per_method else f.default
        for key, f in all_option_keys().items()
    }
