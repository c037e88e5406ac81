"""What a strategy says about itself: its settings at start-up, and the
constructor arguments fedlr's own ServerApp passes from the run config."""

from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.supercore import log

from fedlr.config.run import RunConfig
from fedlr.robust.rules import rule_named

__all__ = ["app_arguments", "log_summary", "settings"]


def settings(strategy: Any) -> dict[str, Any]:
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
    out.update(rule_named(robust.rule).settings(robust))
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


def log_summary(strategy: Any) -> None:
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
        "screen_ratio": config.screen_ratio,
        "fraction_evaluate": 1.0 if cls.federated_evaluation else 0.0,
        "evaluate": cls.federated_evaluation,
        "min_train_nodes": 1,
        "min_evaluate_nodes": 1,
        "min_available_nodes": 1,
    }
