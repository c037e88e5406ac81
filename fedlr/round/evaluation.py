"""Federated evaluation's aggregation: the global model's, or each client's own.

:func:`aggregate_evaluation` is a strategy's ``aggregate_evaluate`` (the
replies' metrics by Flower's ``evaluate_metrics_aggr_fn``);
:func:`aggregate_personal_evaluation` is a personalised method's (the mean
and spread of the clients' accuracies on their own models).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore import log

from fedlr.errors import ReplyValidationError
from fedlr.round.pipeline import merged_metrics
from fedlr.round.publish import without_helper_metrics
from fedlr.wire import protocol

__all__ = [
    "NO_EVALUATE_HANDLER",
    "aggregate_evaluation",
    "aggregate_personal_evaluation",
    "no_evaluate_handler",
]

NO_EVALUATE_HANDLER = "No evaluate function registered"
"""Flower's error reason when a ClientApp has no ``@app.evaluate()``."""


def no_evaluate_handler(strategy: Any, replies: list[Message]) -> bool:
    """Whether ``replies`` show that the ClientApp has no evaluate function
    (all of them Flower's error for it), when ``evaluate`` was not given."""
    return (
        strategy.client_evaluates is None
        and bool(replies)
        and all(
            m.has_error() and NO_EVALUATE_HANDLER in str(m.error.reason)
            for m in replies
        )
    )


def aggregate_evaluation(
    strategy: Any, server_round: int, replies: Iterable[Message]
) -> MetricRecord | None:
    """A strategy's ``aggregate_evaluate``: the replies' metrics by
    ``evaluate_metrics_aggr_fn``.

    A reply carries a MetricRecord only (no arrays needed); an error reply
    or one without exactly one MetricRecord and a positive integer weight
    is dropped with a logged reason. ``None`` when no reply is valid. The
    helpers' ids and flags (:data:`fedlr.wire.protocol.HELPER_METRICS`) are not
    averaged.

    When ``evaluate`` was not given and every reply is Flower's ``No
    evaluate function registered`` error, the ClientApp cannot evaluate:
    one warning says so and ``fraction_evaluate`` becomes 0 for the rest
    of the run.
    """
    contents: list[RecordDict] = []
    replies = list(replies)
    if no_evaluate_handler(strategy, replies):
        log(
            WARNING,
            "round %d: the ClientApps have no @app.evaluate() (%d replies: "
            "'%s'); federated evaluation is off from now on "
            "(fraction_evaluate=0.0). Build the strategy with evaluate=False "
            "to skip it from the start",
            server_round,
            len(replies),
            NO_EVALUATE_HANDLER,
        )
        strategy.fraction_evaluate = 0.0
        strategy.min_evaluate_nodes = 0
        return None
    for message in replies:
        node = int(message.metadata.src_node_id)
        try:
            if message.has_error():
                raise ReplyValidationError(
                    node, f"client error: {message.error.reason}"
                )
            strategy.replies.reply_weight(node, message.content)
        except ReplyValidationError as exc:
            log(WARNING, "round %d: dropped an evaluate reply: %s", server_round, exc)
            continue
        contents.append(without_helper_metrics(message.content))
    if not contents:
        return None
    result: MetricRecord | None = strategy.evaluate_metrics_aggr_fn(
        contents, strategy.weighted_by_key
    )
    return result


def aggregate_personal_evaluation(
    strategy: Any, server_round: int, replies: Iterable[Message]
) -> MetricRecord | None:
    """A personalised method's ``aggregate_evaluate``: each client evaluates
    its own model on its held-out part; the mean and spread of the clients'
    accuracies, kept in ``strategy.last_evaluation``.

    Beside them, the clients' own metrics as ``evaluate_metrics_aggr_fn``
    aggregates them (replies with a valid ``num-examples``); fedlr's
    ``accuracy`` and ``loss`` (unweighted means over clients) replace
    the aggregation function's values of those keys.
    """
    accuracies: list[float] = []
    losses: list[float] = []
    extras: dict[str, list[float]] = {k: [] for k in protocol.TASK_EVAL_METRICS}
    contents: list[RecordDict] = []
    for message in replies:
        if message.has_error():
            log(INFO, "round %d: evaluate error: %s", server_round, message.error)
            continue
        metrics = next(iter(message.content.metric_records.values()), None)
        if metrics is None:
            continue
        try:  # the user's metrics are aggregated by evaluate_metrics_aggr_fn
            strategy.replies.reply_weight(
                int(message.metadata.src_node_id), message.content
            )
            contents.append(without_helper_metrics(message.content))
        except ReplyValidationError as exc:
            log(WARNING, "round %d: evaluate reply: %s", server_round, exc)
        acc, loss = metrics.get("accuracy"), metrics.get("loss")
        if not isinstance(acc, (int, float)) or not isinstance(loss, (int, float)):
            log(
                INFO,
                "round %d: evaluate reply without scalar accuracy and loss",
                server_round,
            )
            continue
        if math.isfinite(acc) and math.isfinite(loss):
            accuracies.append(float(acc))
            losses.append(float(loss))
            for key, values in extras.items():
                value = metrics.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    values.append(float(value))
    clients = (
        strategy.evaluate_metrics_aggr_fn(contents, strategy.weighted_by_key)
        if contents
        else None
    )
    if not accuracies:
        strategy.last_evaluation = {}
        return clients
    strategy.last_evaluation = {
        "accuracy": statistics.fmean(accuracies),
        "loss": statistics.fmean(losses),
        "accuracy-std": statistics.pstdev(accuracies),
        "accuracy-min": min(accuracies),
        "accuracy-max": max(accuracies),
        "evaluated-clients": float(len(accuracies)),
        **{k: statistics.fmean(v) for k, v in extras.items() if v},
    }
    quiet = ("accuracy", "loss", *protocol.TASK_EVAL_METRICS)
    return merged_metrics(strategy, clients, strategy.last_evaluation, quiet=quiet)
