"""Federated evaluation's aggregation: the global model's, or each client's own.

:func:`aggregate_evaluation` is a strategy's ``aggregate_evaluate`` (the
replies' metrics by Flower's ``evaluate_metrics_aggr_fn``);
:func:`aggregate_personal_evaluation` is a personalised method's (the mean
and spread of the clients' accuracies on their own models).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING

from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore import log

from fedlr.errors import ReplyValidationError
from fedlr.round.contract import RoundStrategy
from fedlr.round.publish import merged_metrics, without_helper_metrics
from fedlr.wire import protocol

__all__ = [
    "NO_EVALUATE_HANDLER",
    "aggregate_evaluation",
    "aggregate_personal_evaluation",
    "no_evaluate_handler",
]

NO_EVALUATE_HANDLER = "No evaluate function registered"
"""Flower's error reason when a ClientApp has no ``@app.evaluate()``."""


def no_evaluate_handler(
    strategy: RoundStrategy, server_round: int, replies: list[Message]
) -> bool:
    """Whether ``replies`` show that the ClientApp has no evaluate function
    (all of them Flower's error for it), when ``evaluate`` was not given;
    if so, one warning says that federated evaluation is off from now on
    (the strategy sets its ``fraction_evaluate`` to 0)."""
    missing = (
        strategy.client_evaluates is None
        and bool(replies)
        and all(
            m.has_error() and NO_EVALUATE_HANDLER in str(m.error.reason)
            for m in replies
        )
    )
    if missing:
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
    return missing


def aggregate_evaluation(
    strategy: RoundStrategy, server_round: int, replies: list[Message]
) -> MetricRecord | None:
    """A strategy's ``aggregate_evaluate``: the replies' metrics by
    ``evaluate_metrics_aggr_fn``.

    A reply carries a MetricRecord only (no arrays needed); an error reply
    or one without exactly one MetricRecord and a positive integer weight
    is dropped with a logged reason. ``None`` when no reply is valid. The
    helpers' ids and flags (:data:`fedlr.wire.protocol.HELPER_METRICS`) are not
    averaged.
    """
    contents: list[RecordDict] = []
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
    return strategy.evaluate_metrics_aggr_fn(contents, strategy.weighted_by_key)


def aggregate_personal_evaluation(
    strategy: RoundStrategy, server_round: int, replies: Iterable[Message]
) -> tuple[MetricRecord | None, dict[str, float]]:
    """A personalised method's ``aggregate_evaluate``: each client evaluates
    its own model on its held-out part; the mean and spread of the clients'
    accuracies (the round's ``evaluation``, also returned).

    Beside them, the clients' own metrics as ``evaluate_metrics_aggr_fn``
    aggregates them (replies with a valid ``num-examples``); fedlr's
    ``accuracy`` and ``loss`` (unweighted means over clients) replace
    the aggregation function's values of those keys.
    """
    scores: list[Mapping[str, float]] = []
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
        score = client_scores(server_round, metrics)
        if score is not None:
            scores.append(score)
    clients = (
        strategy.evaluate_metrics_aggr_fn(contents, strategy.weighted_by_key)
        if contents
        else None
    )
    if not scores:
        return clients, {}
    evaluation = spread(scores)
    quiet = ("accuracy", "loss", *protocol.TASK_EVAL_METRICS)
    merged = merged_metrics(
        strategy, clients, evaluation, strategy.weighted_by_key, quiet=quiet
    )
    return merged, evaluation


def client_scores(server_round: int, metrics: MetricRecord) -> dict[str, float] | None:
    """A client's finite ``accuracy``, ``loss`` and task metrics
    (:data:`~fedlr.wire.protocol.TASK_EVAL_METRICS`); ``None`` without a
    finite scalar accuracy and loss."""
    acc, loss = metrics.get("accuracy"), metrics.get("loss")
    if not isinstance(acc, (int, float)) or not isinstance(loss, (int, float)):
        log(
            INFO,
            "round %d: evaluate reply without scalar accuracy and loss",
            server_round,
        )
        return None
    if not (math.isfinite(acc) and math.isfinite(loss)):
        return None
    out = {"accuracy": float(acc), "loss": float(loss)}
    for key in protocol.TASK_EVAL_METRICS:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def spread(scores: list[Mapping[str, float]]) -> dict[str, float]:
    """The clients' mean and spread: ``accuracy`` and ``loss`` (unweighted
    means), ``accuracy-std``, ``-min``, ``-max``, ``evaluated-clients``
    and the mean of each task metric over the clients that report it."""
    accuracies = [s["accuracy"] for s in scores]
    extras = {
        key: [s[key] for s in scores if key in s] for key in protocol.TASK_EVAL_METRICS
    }
    return {
        "accuracy": statistics.fmean(accuracies),
        "loss": statistics.fmean(s["loss"] for s in scores),
        "accuracy-std": statistics.pstdev(accuracies),
        "accuracy-min": min(accuracies),
        "accuracy-max": max(accuracies),
        "evaluated-clients": float(len(accuracies)),
        **{k: statistics.fmean(v) for k, v in extras.items() if v},
    }
