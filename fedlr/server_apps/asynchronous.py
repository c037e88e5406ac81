"""The asynchronous ServerApp loop (FedAsync-LoRA, FedBuff-LoRA).

:func:`run_async` replaces the synchronous rounds of
:func:`fedlr.server_apps.runner.run_server` for a method whose strategy is an
:class:`~fedlr.strategies.async_lora.AsyncLoraStrategy`:

1. Keep ``async-concurrency`` nodes busy: a free node is sent the current
   global arrays (version ``t``) at once, through the strategy's own
   instruction steps (:func:`fedlr.round.instructions.train_config`, the
   method's per-node hook); its ``server-round`` is the node's own job
   count, so its training seed differs from job to job (and equals the
   synchronous round's when every node trains once per version).
2. Handle each reply as it comes (``push_messages`` / ``pull_messages``):
   a reply staler than ``max-staleness`` is dropped with the reason logged;
   the others go through the synchronous round's reply step,
   ``strategy.replies.accept`` (decode, validate, size screen, against the
   arrays the node was sent: a :class:`~fedlr.round.value.Round` of that
   one instruction), and are buffered with their staleness
   (:class:`~fedlr.strategies.async_lora.StaleUpdate`).
3. Every ``buffer_size`` updates (1 for FedAsync, ``K`` for FedBuff) the
   synchronous round's remaining steps run on the buffer
   (:func:`fedlr.round.pipeline.aggregate_accepted` on the version's
   :class:`~fedlr.round.value.Round`: the method, the publish check,
   metrics), which becomes the strategy's ``round``; an accepted step is
   a new global version and a results row (``virtual-time``,
   ``staleness-mean``, ``staleness-max``, ``dropped-stale``), evaluated
   every ``eval-every`` versions. The run ends at version
   ``num-server-rounds``.

Every reply is a row of ``updates.csv`` in the run directory (node,
partition, the version it was trained from and applied to, staleness,
virtual send and arrival times, staleness weight, or why it was dropped).

On an :class:`~fedlr.flower.grid.InProcessGrid` (``run_in_process``, tests)
the loop runs on a virtual clock (:class:`~fedlr.flower.virtual_clock.
VirtualClockGrid`: node speeds from ``async-trace`` or a trace generated
from ``seed`` and ``speed-spread``); under ``flwr run`` it runs on the real
grid and ``virtual-time`` is the seconds since the first instruction.
"""

from __future__ import annotations

import csv
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlr.errors import ConfigError, NoValidRepliesError, ReplyValidationError
from fedlr.flower.grid import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.flower.virtual_clock import (
    NodeSpeed,
    VirtualClockGrid,
    generated_trace,
    read_trace,
)
from fedlr.round.instructions import message_nbytes, train_config
from fedlr.round.pipeline import aggregate_accepted
from fedlr.round.publish import RoundReport
from fedlr.round.value import Round
from fedlr.strategies.async_lora import (
    AsyncLoraStrategy,
    StaleUpdate,
    staleness_weight,
    with_staleness,
)
from fedlr.wire.protocol import SERVER_ROUND

__all__ = ["UPDATE_COLUMNS", "AsyncEngine", "run_async"]

UPDATE_COLUMNS = (
    "event",
    "node",
    "partition-id",
    "base-version",
    "applied-version",
    "staleness",
    "sent-at",
    "arrived-at",
    "staleness-weight",
    "reason",
)
"""The columns of ``updates.csv``: one row per reply (``event`` is
``applied`` or ``dropped``)."""

_POLL_SECONDS = 0.5


def node_speeds(
    grid: InProcessGrid, strategy: AsyncLoraStrategy, seed: int
) -> dict[int, NodeSpeed]:
    """Each in-process node's speed, by node id: ``async-trace`` by partition
    id, or a trace generated from ``seed`` and ``speed-spread``."""
    opts = strategy.async_options
    partitions = {
        nid: int(ctx.node_config["partition-id"]) for nid, ctx in grid.contexts.items()
    }
    count = len(partitions)
    if opts.async_trace:
        by_partition = read_trace(Path(opts.async_trace), count)
    else:
        by_partition = generated_trace(count, spread=opts.speed_spread, seed=seed)
    return {nid: by_partition[pid] for nid, pid in partitions.items()}


def run_async(run: Any, grid: Grid) -> Path:
    """Run ``run`` (a prepared :class:`fedlr.server_apps.runner.ServerRun`)
    asynchronously on ``grid``; return the results directory.

    Raises
    ------
    ConfigError
        For ``resume-from`` (the in-flight jobs are not checkpointed) or
        ``secure-aggregation`` (SecAgg+ is a synchronous exchange), before
        any instruction goes out.
    NoValidRepliesError
        If ``10 * buffer_size + concurrency`` replies in a row are dropped.
    """
    strategy = run.strategy
    if not isinstance(strategy, AsyncLoraStrategy):
        raise TypeError(f"{type(strategy).__name__} is not an asynchronous method")
    if run.resume is not None:
        raise ConfigError(
            "resume-from",
            f"{run.config.method} is asynchronous: its in-flight jobs are not "
            "checkpointed, a run cannot resume",
        )
    if run.exchange is not None:
        raise ConfigError(
            "secure-aggregation",
            f"{run.config.method} is asynchronous: SecAgg+ is a synchronous "
            "exchange of a round's sampled nodes",
        )
    if isinstance(grid, InProcessGrid):
        grid = VirtualClockGrid(grid, node_speeds(grid, strategy, run.config.seed))
    arrays, _ = run.start()
    engine = AsyncEngine(run, grid, arrays)
    engine.run()
    return run.finish(engine.arrays)  # type: ignore[no-any-return]


@dataclass
class Job:
    """An instruction in flight."""

    node: int
    version: int
    sent_at: float
    deadline: float


class AsyncEngine:
    """The loop of :func:`run_async` (module docstring).

    Parameters
    ----------
    run : ServerRun
        Prepared and started: its strategy, config, plan, results writer.
    grid : Grid
        A :class:`~fedlr.flower.virtual_clock.VirtualClockGrid` or a real one.
    arrays : ArrayRecord
        Version 0.
    """

    def __init__(self, run: Any, grid: Grid, arrays: ArrayRecord) -> None:
        self.run_ = run
        self.grid = grid
        self.config = run.config
        self.strategy: AsyncLoraStrategy = run.strategy
        self.options = self.strategy.async_options
        self.train_config = ConfigRecord(run.plan.train_config)
        self.arrays = arrays
        self.version = 0
        self.records: dict[int, ArrayRecord] = {0: arrays}
        self.states: dict[int, dict[str, torch.Tensor]] = {0: record_to_state(arrays)}
        self.in_flight: dict[str, Job] = {}
        self.jobs: Counter[int] = Counter()
        self.buffer: list[StaleUpdate] = []
        self.arrivals: dict[int, tuple[float, float]] = {}
        """Each buffered update's virtual send and arrival times (by ``id``)."""
        self.dropped: list[str] = []
        self.dropped_stale = 0
        self.bytes_down = 0
        self.dropped_in_a_row = 0
        self.started = time.monotonic()
        nodes = sorted(int(n) for n in grid.get_node_ids())
        random.Random(self.config.seed).shuffle(nodes)
        self.idle: deque[int] = deque(nodes)
        wanted = self.options.async_concurrency or max(
            int(len(nodes) * self.config.fraction_train), 1
        )
        self.concurrency = min(wanted, len(nodes))
        self.log_path = Path(run.run_dir) / "updates.csv"
        with self.log_path.open("w", newline="") as handle:
            csv.writer(handle).writerow(UPDATE_COLUMNS)
        log(
            INFO,
            "fedlr: asynchronous, %d of %d nodes busy, %d update(s) per version, "
            "max staleness %d, staleness weight %s, %s clock",
            self.concurrency,
            len(nodes),
            self.strategy.buffer_size,
            self.options.max_staleness,
            self.options.staleness_fn,
            "virtual" if isinstance(grid, VirtualClockGrid) else "real",
        )

    # ------------------------------------------------------------------ time
    @property
    def now(self) -> float:
        """Virtual seconds (the virtual clock's), or real seconds since start."""
        if isinstance(self.grid, VirtualClockGrid):
            return self.grid.now
        return time.monotonic() - self.started

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Dispatch, receive and apply until version ``num-server-rounds``."""
        target = self.config.num_server_rounds
        while self.version < target:
            self.dispatch()
            for reply in self.receive():
                self.handle(reply)
                if self.version >= target:
                    break
        log(
            INFO,
            "fedlr: asynchronous run done at version %d, virtual time %.1f s, "
            "%d instruction(s) still in flight",
            self.version,
            self.now,
            len(self.in_flight),
        )

    def dispatch(self) -> None:
        """Send the current arrays to free nodes up to the concurrency."""
        strategy = self.strategy
        messages: list[Message] = []
        while self.idle and len(self.in_flight) + len(messages) < self.concurrency:
            node = self.idle.popleft()
            self.jobs[node] += 1
            config = train_config(strategy, self.version + 1, self.train_config)
            config[SERVER_ROUND] = self.jobs[node]
            content = RecordDict(
                {
                    strategy.arrayrecord_key: self.arrays,
                    strategy.configrecord_key: config,
                }
            )
            message = Message(
                content=content, message_type=MessageType.TRAIN, dst_node_id=node
            )
            messages.extend(
                strategy.instructions(
                    self.version + 1, [message], self.arrays, train=True
                )
            )
        if not messages:
            return
        sent_at = self.now
        ids = list(self.grid.push_messages(messages))
        for message_id, message in zip(ids, messages, strict=True):
            job = Job(
                node=int(message.metadata.dst_node_id),
                version=self.version,
                sent_at=sent_at,
                deadline=time.monotonic() + self.config.round_timeout,
            )
            if message_id is None:  # the SuperLink refused it (Flower logs why)
                self.idle.append(job.node)
                self.drop(job, -1, f"node {job.node}: the instruction was not pushed")
                continue
            self.bytes_down += message_nbytes(message)
            self.in_flight[message_id] = job

    def receive(self) -> list[Message]:
        """The next replies: the virtual clock's next instant, or what a real
        grid has (polling; a job past ``round-timeout`` is dropped as lost)."""
        while self.in_flight:
            replies = list(self.grid.pull_messages(list(self.in_flight)))
            if replies:
                return replies
            if isinstance(self.grid, VirtualClockGrid):
                break
            now = time.monotonic()
            for message_id, job in list(self.in_flight.items()):
                if now > job.deadline:
                    del self.in_flight[message_id]
                    self.idle.append(job.node)
                    self.drop(job, -1, "no reply (timed out)")
            if not self.in_flight:
                break
            time.sleep(_POLL_SECONDS)
        if not self.in_flight and not self.idle:
            raise RuntimeError("no node is busy and none is free")
        return []

    # --------------------------------------------------------------- replies
    def handle(self, reply: Message) -> None:
        """Check one reply (staleness, then the reply step), buffer it, apply
        a full buffer."""
        job = self.in_flight.pop(reply.metadata.reply_to_message_id, None)
        if job is None:
            reason = str(
                ReplyValidationError(
                    int(reply.metadata.src_node_id),
                    "the node was not sent this instruction (or it timed out)",
                )
            )
            log(WARNING, "version %d: dropped a reply: %s", self.version + 1, reason)
            return
        self.idle.append(job.node)
        staleness = self.version - job.version
        if staleness > self.options.max_staleness:
            self.dropped_stale += 1
            self.drop(
                job,
                staleness,
                str(
                    ReplyValidationError(
                        job.node,
                        f"staleness {staleness} (trained from version "
                        f"{job.version}, now {self.version}) exceeds "
                        f"max-staleness {self.options.max_staleness}",
                    )
                ),
            )
            return
        strategy = self.strategy
        sent = Round(self.version + 1, self.records[job.version], sent=(job.node,))
        base = self.states[job.version]
        updates, checked = strategy.replies.accept(sent, [reply], base, 0)
        if not updates:
            self.drop(job, staleness, "; ".join(checked.dropped), logged=True)
            return
        self.dropped_in_a_row = 0
        update = with_staleness(
            updates[0], version=job.version, staleness=staleness, base=base
        )
        self.buffer.append(update)
        self.arrivals[id(update)] = (job.sent_at, self.now)
        if len(self.buffer) >= strategy.buffer_size:
            self.apply()

    def drop(self, job: Job, staleness: int, reason: str, logged: bool = False) -> None:
        """Record a dropped reply (logged, counted in the next row's ``dropped``)."""
        if not logged:
            log(WARNING, "version %d: dropped a reply: %s", self.version + 1, reason)
        self.dropped.append(reason)
        self.dropped_in_a_row += 1
        self.write_event(
            "dropped", job.node, -1, job.version, -1, staleness, job.sent_at, reason
        )
        limit = 10 * self.strategy.buffer_size + self.concurrency
        if self.dropped_in_a_row >= limit:
            raise NoValidRepliesError(
                self.version + 1, 0, self.strategy.buffer_size, self.dropped[-limit:]
            )

    def write_event(
        self,
        event: str,
        node: int,
        partition: int,
        base_version: int,
        applied_version: int,
        staleness: int,
        sent_at: float,
        reason: str = "",
        arrived_at: float | None = None,
    ) -> None:
        weight = (
            staleness_weight(staleness, self.options)
            if staleness >= 0
            else float("nan")
        )
        with self.log_path.open("a", newline="") as handle:
            csv.writer(handle).writerow(
                [
                    event,
                    node,
                    partition,
                    base_version,
                    applied_version,
                    staleness,
                    f"{sent_at:.6g}",
                    f"{self.now if arrived_at is None else arrived_at:.6g}",
                    f"{weight:.6g}",
                    reason,
                ]
            )

    # ----------------------------------------------------------------- apply
    def apply(self) -> None:
        """Run the buffer through the method and publish a new version: the
        synchronous round's steps on a :class:`~fedlr.round.value.Round` of
        the buffer (``m`` = its updates), which becomes the strategy's
        ``round``."""
        strategy = self.strategy
        updates = sorted(self.buffer, key=lambda u: (u.partition_id, u.node_id))
        self.buffer = []
        strategy.round = Round(
            self.version + 1,
            self.arrays,
            instructed=len(updates),
            bytes_down=self.bytes_down,
            rejected_before=strategy.rejected_rounds,
            dropped=list(self.dropped),
        )  # the round in progress: client-level DP reads its m
        started = time.perf_counter()
        new, _, done = aggregate_accepted(
            strategy, strategy.round, list(updates), self.states[self.version]
        )
        aggregated = time.perf_counter() - started
        self.dropped, self.bytes_down = [], 0
        if new is None:  # rejected: the version stays, the replies are spent
            strategy.round = done
            self.write_applied(updates, -1, f"rejected: {done.rejection}")
            return
        self.version += 1
        self.arrays = new
        self.records[self.version] = new
        self.states[self.version] = record_to_state(new)
        self.write_applied(updates, self.version)
        metrics = {"virtual-time": self.now, "dropped-stale": float(self.dropped_stale)}
        report = RoundReport({**done.report.metrics, **metrics}, done.report.layers)
        timing = {"aggregate-seconds": aggregated}
        strategy.round = replace(done, report=report, timing=timing)
        self.run_.evaluate_round(self.version, self.arrays)
        self.prune()

    def write_applied(
        self, updates: list[StaleUpdate], version: int, rejection: str = ""
    ) -> None:
        """One ``updates.csv`` row per buffered update: ``applied`` to
        ``version``, or ``dropped`` with the round's ``rejection``."""
        for u in updates:
            sent, arrived = self.arrivals.pop(id(u), (float("nan"),) * 2)
            self.write_event(
                "dropped" if rejection else "applied",
                u.node_id,
                u.partition_id,
                u.version,
                version,
                u.staleness,
                sent,
                rejection,
                arrived,
            )

    def prune(self) -> None:
        """Forget versions no job in flight was sent (the current one stays)."""
        keep = {self.version} | {job.version for job in self.in_flight.values()}
        for version in list(self.records):
            if version not in keep:
                del self.records[version]
                del self.states[version]
