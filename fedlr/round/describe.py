"""What a strategy says about itself: its settings, checked at construction
and logged at start-up, and the constructor arguments fedlr's own ServerApp
passes from the run config."""

from __future__ import annotations

import math
from logging import INFO
from typing import Any

from flwr.supercore import log

from fedlr.config.run import RunConfig
from fedlr.robust.rules import rule_named
from fedlr.round.contract import RoundStrategy

__all__ = [
    "app_arguments",
    "check_settings",
    "evaluate_arguments",
    "log_summary",
    "settings",
]


def check_settings(
    min_replies: int,
    lr_decay: float,
    max_num_examples: int | None,
    max_update_ratio: float,
    screen_ratio: float,
) -> None:
    """Refuse a strategy's common settings out of range (``ValueError``
    naming the setting and the value)."""
    if min_replies < 1:
        raise ValueError(f"min_replies must be >= 1, got {min_replies}")
    if not 0.0 < lr_decay <= 1.0:
        raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay}")
    if max_num_examples is not None and max_num_examples < 1:
        raise ValueError(f"max_num_examples must be >= 1, got {max_num_examples}")
    if not (math.isfinite(max_update_ratio) and max_update_ratio >= 0):
        raise ValueError(f"max_update_ratio must be >= 0, got {max_update_ratio}")
    if not (math.isfinite(screen_ratio) and screen_ratio >= 0):
        raise ValueError(f"screen_ratio must be >= 0, got {screen_ratio}")


def evaluate_arguments(evaluate: bool | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """FedAvg's arguments under a strategy's ``evaluate``: ``False`` sets
    ``fraction_evaluate`` to 0; ``True`` beside a ``fraction_evaluate`` of 0
    is refused (``ValueError``: nothing would be sent to evaluate)."""
    if evaluate is False:
        return {**kwargs, "fraction_evaluate": 0.0}
    if evaluate and kwargs.get("fraction_evaluate", 1.0) == 0.0:
        raise ValueError(
            "evaluate=True asks for federated evaluation, but fraction_evaluate "
            "is 0.0: nothing would be sent to evaluate"
        )
    return kwargs


def settings(strategy: RoundStrategy) -> dict[str, Any]:
    """The strategy's fedlr settings, for its summary: the common ones by
    constructor name, then every ``method_options`` key, then the
    strategy's ``extra_settings`` (settings that are no option, e.g.
    ``client_ranks``)."""
    robust = strategy.robust
    out: dict[str, Any] = {
        "min_replies": strategy.min_replies,
        "lr_decay": strategy.lr_decay,
        "robust": robust.rule,
    }
    out.update(rule_named(robust.rule).describe(robust))
    if robust.max_client_weight < 1.0:
        out["max_client_weight"] = robust.max_client_weight
    if robust.max_weight_ratio > 0:
        out["max_weight_ratio"] = robust.max_weight_ratio
    if strategy.max_num_examples is not None:
        out["max_num_examples"] = strategy.max_num_examples
    if strategy.max_update_ratio > 0:
        out["max_update_ratio"] = strategy.max_update_ratio
    out["screen_ratio"] = strategy.screen_ratio or "off"
    return {
        **out,
        **strategy.method_options.to_mapping(),
        **getattr(strategy, "extra_settings", {}),
    }


def log_summary(strategy: RoundStrategy) -> None:
    """Log :func:`settings`, the plug-in fingerprint and federated
    evaluation's state (before FedAvg's own summary)."""
    items = list(settings(strategy).items())
    log(INFO, "\t├──> fedlr options (%s):", type(strategy).__name__)
    for i, (name, value) in enumerate(items):
        branch = "└" if i == len(items) - 1 else "├"
        log(INFO, "\t│\t%s── %s: %s", branch, name, value)
    if strategy.base_fingerprint is not None:
        log(
            INFO,
            "\t├──> nodes' models checked against a fingerprint of %d frozen "
            "weights of the server's model",
            len(strategy.base_fingerprint.keys),
        )
    if strategy.client_evaluates is None and strategy.fraction_evaluate > 0.0:
        log(
            INFO,
            "\t├──> federated evaluation is on (fraction_evaluate=%s): every "
            "round's global arrays go to the ClientApps' @app.evaluate(); for "
            "a ClientApp without one, build the strategy with evaluate=False",
            strategy.fraction_evaluate,
        )


def app_arguments(cls: Any, config: RunConfig) -> dict[str, Any]:
    """Constructor arguments of fedlr's own ServerApp, from the run config.

    Besides the run config's keys, the app's choices that differ from
    Flower's defaults: the server evaluates the global model itself, so
    federated evaluation is off unless the method needs it
    (``federated_evaluation``), and one node is enough.
    """
    return {
        "min_replies": config.min_replies,
        "fraction_train": config.fraction_train,
        "lr_decay": config.lr_decay,
        "robust": config.robust_config,
        "max_num_examples": config.max_num_examples or None,
        "max_update_ratio": config.max_update_ratio,
        "privacy": config.privacy,
        # SecAgg+ with client-level DP: the nodes clip and noise (distributed)
        "client_dp_on_nodes": config.secure_aggregation
        and config.privacy.client_dp is not None,
        "screen_ratio": config.screen_ratio,
        "fraction_evaluate": 1.0 if cls.federated_evaluation else 0.0,
        "evaluate": cls.federated_evaluation,
        "min_train_nodes": 1,
        "min_evaluate_nodes": 1,
        "min_available_nodes": 1,
    }
