"""A strategy's round as composed steps, and the driver that runs one.

``aggregate_train`` is :func:`aggregate_round`::

    replies --decode, validate, screen (strategy.replies)-->
        updates --protection steps (robust rule, held-out check, the
                  server's own update | client-level DP)-->
        updates --the method's aggregate_updates (state rolled back if refused)-->
        new state --check, publish (metrics, bytes, report)--> ArrayRecord

Each step is an object with one job (:mod:`fedlr.round.replies`,
:mod:`fedlr.round.protect`, :mod:`fedlr.round.publish`), composed from the
strategy's settings every round; the method contributes its reply step
(``replies_type``), its ``aggregate_updates`` and its per-node
``instructions``. :func:`run_round` drives one round as Flower's
``Strategy.start`` does (train, then federated evaluation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlr.flower.records import record_to_state, state_to_record
from fedlr.round.protect import Protected, protection_steps
from fedlr.round.publish import (
    RoundReport,
    check_new_state,
    client_metrics,
    merge_metrics,
    round_metrics,
)
from fedlr.round.replies import short
from fedlr.round.state import NUMERIC_FAULTS, method_state, restore_method_state
from fedlr.wire.protocol import NUM_EXAMPLES, TRAIN_LOSS_ALIASES

__all__ = [
    "NUMERIC_FAULTS",
    "Exchange",
    "aggregate_accepted",
    "aggregate_round",
    "merged_metrics",
    "method_state",
    "restore_method_state",
    "run_round",
]

Exchange = Callable[[Grid, Iterable[Message], float | None], Iterable[Message]]
"""Sends a round's train instructions and returns the replies (``run_round``)."""


# ------------------------------------------------------------------ metrics
def merged_metrics(
    strategy: Any,
    clients: MetricRecord | None,
    own: Mapping[str, float],
    *,
    quiet: Iterable[str] = (),
) -> MetricRecord:
    """The clients' aggregated metrics with fedlr's own on top; a clash is
    logged once per key (``num-examples``, the training loss, the weight key
    and the keys of ``quiet`` are replaced silently)."""

    def warn(clashes: list[str]) -> None:
        log(
            WARNING,
            "the clients' aggregated metrics %s clash with fedlr's own; "
            "fedlr's values are reported (rename them in the ClientApp or "
            "the metrics aggregation fn)",
            clashes,
        )

    return merge_metrics(
        clients,
        own,
        warned=strategy._warned_clashes,
        quiet={NUM_EXAMPLES, strategy.weighted_by_key, *TRAIN_LOSS_ALIASES, *quiet},
        warn=warn,
    )


def _reject(
    strategy: Any, server_round: int, rejection: str, metrics: dict[str, float]
) -> None:
    """Count and log a rejected round (the previous state was restored)."""
    strategy.rejected_rounds += 1
    strategy.last_rejection = rejection
    metrics["rejected-rounds"] = float(strategy.rejected_rounds)
    strategy.last_report = RoundReport(metrics=dict(metrics))
    log(
        WARNING,
        "round %d rejected: %s; the previous global model is kept and the "
        "run goes on (%d rejected so far)",
        server_round,
        rejection,
        strategy.rejected_rounds,
    )


# -------------------------------------------------------------------- round
def aggregate_round(
    strategy: Any, server_round: int, replies: Iterable[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """A strategy's ``aggregate_train``: the round's steps in order.

    Dropped, each with a logged reason and counted in ``dropped``: replies
    that fail validation, updates far larger than the round's median
    (``screen_ratio``), a node's second reply, replies from nodes that were
    not sent an instruction this round, and (as ``no reply``) nodes that
    were sent one but did not answer. A result the publish check refuses
    (:func:`~fedlr.round.publish.check_new_state`), or a kernel's numeric
    fault, rejects the round: the method's state is restored
    (:func:`restore_method_state`) and ``None`` arrays are returned. Under
    secure aggregation the exchange sets ``strategy.aggregate_check``
    (:class:`~fedlr.privacy.secagg.AggregateCheck`), which rejects a round
    whose aggregate update is far above the recent rounds' the same way.

    Returns
    -------
    arrays : ArrayRecord or None
        The next global arrays (``None``: rejected, keep the previous ones).
    metrics : MetricRecord
        The clients' own metrics aggregated by ``train_metrics_aggr_fn``
        beside fedlr's; fedlr's win on a clash.
    """
    if strategy._current is None:
        raise RuntimeError(
            "aggregate_train called before configure_train: the strategy does "
            "not know the current global arrays"
        )
    current = record_to_state(strategy._current)
    # 1. decode, validate, screen
    updates, dropped = strategy.replies.accept(
        server_round, replies, current, strategy.min_replies
    )
    strategy.last_dropped = dropped
    return aggregate_accepted(strategy, server_round, updates, dropped, current)


def aggregate_accepted(
    strategy: Any,
    server_round: int,
    updates: list[Any],
    dropped: list[str],
    current: dict[str, torch.Tensor],
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Steps 2-4 of :func:`aggregate_round` on updates already accepted by
    ``strategy.replies`` (``dropped``: the reasons of the others): protection,
    the method (its state restored if the result is refused), publish.

    The asynchronous engine (:mod:`fedlr.server_apps.asynchronous`) accepts
    each reply as it arrives and calls this on a buffer of them.
    """
    valid = len(updates)
    # 2. protection: the robust rule | client-level DP
    strategy.last_robust = []
    done = Protected(updates, [], {})
    for step in protection_steps(strategy):
        done = step(server_round, done, current)
    updates = done.updates
    # 3. the method (the clients' updates and the server's own, if any), its
    # state restored if the result is refused
    snapshot = method_state(strategy)
    report = RoundReport()
    try:
        state, report = strategy.aggregate_updates(
            server_round, updates + done.trusted, current
        )
    except NUMERIC_FAULTS as exc:
        rejection: str | None = (
            f"the aggregation failed: {type(exc).__name__}: {short(str(exc))}"
        )
    else:
        rejection = check_new_state(state, current, strategy.max_update_ratio)
        check = getattr(strategy, "aggregate_check", None)  # SecAgg+'s
        if rejection is None and check is not None:
            rejection = check.check(state, current)
    # 4. publish
    metrics = round_metrics(
        updates,
        valid=valid,
        dropped=len(dropped),
        bytes_down=strategy._bytes_down,
        rejected=rejection is not None,
        protection=done.metrics,
    )
    clients = client_metrics(
        strategy.train_metrics_aggr_fn,
        strategy.weighted_by_key,
        updates,
        done.left_out,
    )
    if rejection is not None:
        restore_method_state(strategy, snapshot)
        _reject(strategy, server_round, rejection, metrics)
        return None, merged_metrics(strategy, clients, metrics)
    strategy.last_rejection = None
    metrics["rejected-rounds"] = float(strategy.rejected_rounds)
    metrics.update(report.metrics)
    strategy.last_report = RoundReport(metrics=dict(metrics), layers=report.layers)
    log(
        INFO,
        "round %d: aggregated %d replies (%d dropped)",
        server_round,
        len(updates),
        len(dropped),
    )
    return state_to_record(state), merged_metrics(strategy, clients, metrics)


# ------------------------------------------------------------------- driver
def run_round(
    strategy: Any,
    grid: Grid,
    server_round: int,
    arrays: ArrayRecord,
    train_config: ConfigRecord,
    evaluate_config: ConfigRecord | None = None,
    timeout: float | None = 3600.0,
    exchange: Exchange | None = None,
) -> ArrayRecord:
    """One round as ``Strategy.start`` runs it: train, then federated eval.

    The ServerApp drives rounds itself with this (so a run can start at any
    round when it resumes from a checkpoint); it calls the strategy's hooks
    in the same order as Flower's ``start``, so nodes that were sent an
    instruction but did not reply within ``timeout`` are reported as
    dropped (``no reply``) either way.

    ``strategy.last_timing`` holds the round's wall-clock seconds:
    ``train-seconds`` (instructions out, replies in), ``aggregate-seconds``
    (validation and the kernel) and ``federated-eval-seconds``.

    ``exchange(grid, instructions, timeout)``, when given, sends the train
    instructions and returns the replies in place of
    ``grid.send_and_receive`` (secure aggregation:
    :class:`fedlr.server_apps.secagg.SecAggPlusExchange`).

    Returns
    -------
    ArrayRecord
        The next global arrays.
    """
    start = time.perf_counter()
    sent = strategy.configure_train(server_round, arrays, train_config, grid)
    if exchange is None:
        replies = grid.send_and_receive(messages=sent, timeout=timeout)
    else:
        replies = exchange(grid, sent, timeout)
    trained = time.perf_counter()
    new_arrays, _ = strategy.aggregate_train(server_round, replies)
    if new_arrays is not None:
        arrays = new_arrays
    aggregated = time.perf_counter()
    messages = list(
        strategy.configure_evaluate(
            server_round, arrays, evaluate_config or ConfigRecord(), grid
        )
    )
    if messages:
        evaluations = grid.send_and_receive(messages=messages, timeout=timeout)
        strategy.aggregate_evaluate(server_round, evaluations)
    strategy.last_timing = {
        "train-seconds": trained - start,
        "aggregate-seconds": aggregated - trained,
        "federated-eval-seconds": time.perf_counter() - aggregated,
    }
    return arrays
