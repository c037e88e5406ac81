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
from collections.abc import Callable, Iterable
from dataclasses import replace
from logging import INFO, WARNING
from typing import Protocol

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlr.flower.records import record_to_state, state_to_record
from fedlr.round.contract import RoundStrategy
from fedlr.round.protect import Protected, protection_steps
from fedlr.round.publish import (
    RoundReport,
    check_new_state,
    client_metrics,
    merged_metrics,
    round_metrics,
)
from fedlr.round.replies import short
from fedlr.round.state import NUMERIC_FAULTS, method_state, restore_method_state
from fedlr.round.value import Round
from fedlr.wire.updates import ClientUpdate

__all__ = [
    "Exchange",
    "RoundHooks",
    "aggregate_accepted",
    "aggregate_round",
    "method_result",
    "publish",
    "run_round",
]

Exchange = Callable[[Grid, Iterable[Message], float | None], Iterable[Message]]
"""Sends a round's train instructions and returns the replies (``run_round``)."""


# -------------------------------------------------------------------- round
def aggregate_round(
    strategy: RoundStrategy, server_round: int, replies: Iterable[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None, Round]:
    """A strategy's ``aggregate_train``: the round's steps in order, on the
    round ``configure_train`` began (``strategy.round``).

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
    round : Round
        The finished round (its drops, each step's result, its report).
    """
    if strategy.round is None:
        raise RuntimeError(
            "aggregate_train called before configure_train: the strategy does "
            "not know the current global arrays"
        )
    sent = replace(strategy.round, number=server_round)  # the hook's number
    current = record_to_state(sent.arrays)
    # 1. decode, validate, screen
    updates, accepted = strategy.replies.accept(
        sent, replies, current, strategy.min_replies
    )
    return aggregate_accepted(strategy, accepted, updates, current)


def aggregate_accepted(
    strategy: RoundStrategy,
    accepted: Round,
    updates: list[ClientUpdate],
    current: dict[str, torch.Tensor],
) -> tuple[ArrayRecord | None, MetricRecord | None, Round]:
    """Steps 2-4 of :func:`aggregate_round` on updates already accepted by
    ``strategy.replies`` (``accepted.dropped``: the reasons of the others):
    protection, the method (its state restored if the result is refused),
    publish.

    The asynchronous engine (:mod:`fedlr.server_apps.asynchronous`) accepts
    each reply as it arrives and calls this on a buffer of them.
    """
    # 2. protection: the robust rule | client-level DP
    done = Protected(updates)
    for step in protection_steps(strategy, accepted):
        done = step(accepted.number, done, current)
    # 3. the method (the clients' updates and the server's own, if any)
    state, report, rejection = method_result(strategy, accepted.number, done, current)
    # 4. publish
    finished = replace(accepted, robust=done.robust, rejection=rejection)
    return publish(strategy, finished, done, len(updates), state, report)


def method_result(
    strategy: RoundStrategy,
    server_round: int,
    done: Protected,
    current: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], RoundReport, str | None]:
    """The method's ``aggregate_updates`` on the protected updates (the
    clients' and the server's own), and why its result is refused (``None``:
    accepted); when refused, the method's explicit state is restored."""
    snapshot = method_state(strategy)
    state: dict[str, torch.Tensor] = {}
    report = RoundReport()
    try:
        state, report = strategy.aggregate_updates(
            server_round, done.updates + done.trusted, current
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
    if rejection is not None:
        restore_method_state(strategy, snapshot)
    return state, report, rejection


def publish(
    strategy: RoundStrategy,
    finished: Round,
    done: Protected,
    valid: int,
    state: dict[str, torch.Tensor],
    report: RoundReport,
) -> tuple[ArrayRecord | None, MetricRecord, Round]:
    """The round's metrics and report (of the ``valid`` updates, ``done``
    protected); the new global arrays unless the round was rejected (then
    counted and logged, and ``None``)."""
    metrics = round_metrics(
        done.updates,
        valid=valid,
        dropped=len(finished.dropped),
        bytes_down=finished.bytes_down,
        rejected=finished.rejection is not None,
        protection=done.metrics,
    )
    clients = client_metrics(
        strategy.train_metrics_aggr_fn,
        strategy.weighted_by_key,
        done.updates,
        done.left_out,
    )
    metrics["rejected-rounds"] = float(finished.rejected_rounds)
    if finished.rejection is not None:
        log(
            WARNING,
            "round %d rejected: %s; the previous global model is kept and the "
            "run goes on (%d rejected so far)",
            finished.number,
            finished.rejection,
            finished.rejected_rounds,
        )
        report = RoundReport(metrics=dict(metrics))
    else:
        metrics.update(report.metrics)
        log(
            INFO,
            "round %d: aggregated %d replies (%d dropped)",
            finished.number,
            len(done.updates),
            len(finished.dropped),
        )
        report = RoundReport(metrics=dict(metrics), layers=report.layers)
    published = merged_metrics(strategy, clients, metrics, strategy.weighted_by_key)
    arrays = None if finished.rejection is not None else state_to_record(state)
    return arrays, published, replace(finished, report=report)


# ------------------------------------------------------------------- driver
class RoundHooks(Protocol):
    """A strategy as :func:`run_round` drives it: Flower's four hooks, and its
    latest round (the driver adds the round's timing)."""

    round: Round | None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...
    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...
    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None: ...


def run_round(
    strategy: RoundHooks,
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

    The round's ``timing`` (``strategy.last_timing``) holds its wall-clock
    seconds:
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
    timing = {
        "train-seconds": trained - start,
        "aggregate-seconds": aggregated - trained,
        "federated-eval-seconds": time.perf_counter() - aggregated,
    }
    if strategy.round is not None:
        strategy.round = replace(strategy.round, timing=timing)
    return arrays
