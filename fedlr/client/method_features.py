"""The registered methods' client features: a table below the client side.

A method lists its client features when it registers
(:func:`fedlr.strategies.registration.register_method`, ``client=(...)``),
and the registration records them here. The client's common round
(:func:`fedlr.client.round.apply_round`) asks every recorded feature, and the
common ones (:func:`fedlr.client.features.common_feature`), without importing the
strategies: they sit floors above the client side, and their modules import
the client side's.

The table is complete once the built-in methods are loaded
(:func:`fedlr.strategies.registry.load_builtin_methods`, which fedlr's
ClientApp runs before its first round and ``from fedlr import apply_round``
runs too). Until then :func:`client_features` raises
:class:`MethodsNotLoadedError` rather than leave a method's feature off
without a word.
"""

from __future__ import annotations

from fedlr.client.features import ClientFeature, common_features, ordered

__all__ = [
    "MethodsNotLoadedError",
    "client_features",
    "mark_builtin_loaded",
    "record_method_features",
]

_FEATURES: dict[str, tuple[type[ClientFeature], ...]] = {}
_LOADED: list[bool] = [False]


class MethodsNotLoadedError(RuntimeError):
    """The client features were asked for before the built-in methods loaded."""


def record_method_features(
    method: str, features: tuple[type[ClientFeature], ...]
) -> None:
    """Record the client features of method ``method`` (its registration calls this)."""
    _FEATURES[method] = features


def mark_builtin_loaded() -> None:
    """Note that every built-in method has registered (the registry calls this)."""
    _LOADED[0] = True


def client_features() -> list[type[ClientFeature]]:
    """Every registered method's client features and the common ones, each
    once, in run order (:func:`fedlr.client.features.ordered`).

    Raises
    ------
    MethodsNotLoadedError
        If the built-in methods have not been loaded in this process.
    """
    if not _LOADED[0]:
        raise MethodsNotLoadedError(
            "the built-in methods are not loaded in this process, so their client "
            "features are unknown: import apply_round from fedlr (`from fedlr "
            "import apply_round`) or call fedlr.strategies.available_methods() "
            "first"
        )
    own = [feature for features in _FEATURES.values() for feature in features]
    return ordered([*own, *common_features()])
