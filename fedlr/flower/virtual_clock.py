"""A virtual clock for simulated asynchronous federations.

:class:`VirtualClockGrid` wraps a ``Grid`` whose replies are computed in
process (:class:`~fedlr.flower.grid.InProcessGrid`): a pushed instruction is
answered at once, but its reply is *released* only at the virtual time the
node would have sent it, ``now + local-steps * step-seconds + (bytes down +
bytes up) / bytes-per-second``, from the node's :class:`NodeSpeed`.
:meth:`~VirtualClockGrid.pull_messages` returns the earliest replies among
those asked for, all of them released at the same virtual instant, and moves
the clock there; so a run of 100 nodes of very different speeds takes the
real time of its computations, not of its slowest nodes.

Node speeds come from a trace: :func:`generated_trace` (a seeded spread) or
:func:`read_trace` (a CSV ``partition-id,step-seconds,bytes-per-second``).
"""

from __future__ import annotations

import csv
import heapq
import itertools
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from flwr.app import Error, Message, RecordDict
from flwr.serverapp import Grid

from fedlr.errors import ConfigError
from fedlr.flower.grid import GridWrapper
from fedlr.flower.records import record_nbytes

__all__ = [
    "LOST_REPLY",
    "TRACE_COLUMNS",
    "NodeSpeed",
    "VirtualClockGrid",
    "generated_trace",
    "read_trace",
    "write_trace",
]

TRACE_COLUMNS = ("partition-id", "step-seconds", "bytes-per-second")
LOST_REPLY = "no reply (lost on the virtual clock)"
_LOCAL_STEPS = "local-steps"
_CONFIG = "config"


@dataclass(frozen=True)
class NodeSpeed:
    """One node's speed on the virtual clock.

    Attributes
    ----------
    step_seconds : float
        Virtual seconds per local training step (> 0).
    bytes_per_second : float
        The node's link, both directions (> 0).
    """

    step_seconds: float
    bytes_per_second: float

    def __post_init__(self) -> None:
        for name in ("step_seconds", "bytes_per_second"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")

    def seconds(self, steps: int, nbytes: int) -> float:
        """Virtual seconds of a job of ``steps`` local steps moving ``nbytes``."""
        return steps * self.step_seconds + nbytes / self.bytes_per_second


def generated_trace(
    num_nodes: int,
    *,
    spread: float,
    seed: int,
    step_seconds: float = 1.0,
    bytes_per_second: float = 1e6,
) -> dict[int, NodeSpeed]:
    """Seeded node speeds with the slowest exactly ``spread`` times the fastest.

    Compute and network factors are ``spread ** (i / (n - 1))``, ``i = 0..n-1``
    (log-evenly spaced from 1 to ``spread``), each list shuffled
    independently with ``random.Random(seed)``: node ``p`` steps in
    ``step_seconds * f_p`` and moves ``bytes_per_second / g_p``.

    Returns
    -------
    dict of int to NodeSpeed
        By partition id ``0..num_nodes-1``.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if not (math.isfinite(spread) and spread >= 1):
        raise ValueError(f"spread must be finite and >= 1, got {spread}")
    rng = random.Random(seed)
    steps = (
        [1.0] * num_nodes
        if num_nodes == 1
        else [spread ** (i / (num_nodes - 1)) for i in range(num_nodes)]
    )
    links = list(steps)
    rng.shuffle(steps)
    rng.shuffle(links)
    return {
        p: NodeSpeed(step_seconds * steps[p], bytes_per_second / links[p])
        for p in range(num_nodes)
    }


def write_trace(path: Path, speeds: Mapping[int, NodeSpeed]) -> None:
    """Write ``speeds`` as a trace CSV (:data:`TRACE_COLUMNS`)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TRACE_COLUMNS)
        for pid in sorted(speeds):
            s = speeds[pid]
            writer.writerow([pid, repr(s.step_seconds), repr(s.bytes_per_second)])


def read_trace(path: Path, num_nodes: int) -> dict[int, NodeSpeed]:
    """Node speeds from a trace CSV with the header :data:`TRACE_COLUMNS`.

    Raises
    ------
    ConfigError
        Naming ``async-trace``: a missing file or column, a row that does not
        parse, a partition listed twice, or a partition ``0..num_nodes-1``
        without a row.
    """
    if not path.is_file():
        raise ConfigError("async-trace", f"no trace file at {path}")
    speeds: dict[int, NodeSpeed] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = sorted(set(TRACE_COLUMNS) - set(reader.fieldnames or ()))
        if missing:
            raise ConfigError(
                "async-trace",
                f"{path}: missing columns {missing} (need {TRACE_COLUMNS})",
            )
        for line, row in enumerate(reader, start=2):
            try:
                pid = int(row["partition-id"])
                speed = NodeSpeed(
                    float(row["step-seconds"]), float(row["bytes-per-second"])
                )
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    "async-trace", f"{path}, line {line}: {exc}"
                ) from None
            if pid in speeds:
                raise ConfigError(
                    "async-trace", f"{path}, line {line}: partition {pid} listed twice"
                )
            speeds[pid] = speed
    absent = [p for p in range(num_nodes) if p not in speeds]
    if absent:
        raise ConfigError(
            "async-trace",
            f"{path}: no row for partitions {absent[:5]}"
            f"{' ...' if len(absent) > 5 else ''} of the {num_nodes} nodes",
        )
    return speeds


def _local_steps(message: Message) -> int:
    config = message.content.config_records.get(_CONFIG)
    value = None if config is None else config.get(_LOCAL_STEPS)
    return int(value) if isinstance(value, (int, float)) else 1


def _nbytes(content: RecordDict) -> int:
    return sum(record_nbytes(r) for r in content.array_records.values())


class VirtualClockGrid(GridWrapper):
    """Release an in-process grid's replies in virtual-time order.

    Parameters
    ----------
    inner : Grid
        Computes each reply when its instruction is pulled (an
        :class:`~fedlr.flower.grid.InProcessGrid`); a ``None`` / missing reply
        is released as an error reply (:data:`LOST_REPLY`) at its time.
    speeds : mapping of int to NodeSpeed
        Each node id's speed.

    Attributes
    ----------
    now : float
        The virtual time: the release time of the last replies pulled.
    """

    def __init__(self, inner: Grid, speeds: Mapping[int, NodeSpeed]) -> None:
        missing = sorted(set(inner.get_node_ids()) - set(speeds))
        if missing:
            raise ValueError(f"no speed for nodes {missing[:5]}")
        super().__init__(inner)
        self.speeds = dict(speeds)
        self.now = 0.0
        self._queue: list[tuple[float, int, str]] = []
        self._replies: dict[str, Message] = {}
        self._seq = itertools.count()

    # -- Grid interface (what the clock changes) ---------------------------
    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Compute each reply now; schedule its release (time of the job)."""
        ids: list[str] = []
        for message in messages:
            (message_id,) = list(self.inner.push_messages([message]))
            got = list(self.inner.pull_messages([message_id]))
            node = int(message.metadata.dst_node_id)
            if got:
                reply = got[0]
                up = 0 if reply.has_error() else _nbytes(reply.content)
            else:
                reply = Message(Error(code=0, reason=LOST_REPLY), reply_to=message)
                up = 0
            nbytes = _nbytes(message.content) + up
            release = self.now + self.speeds[node].seconds(
                _local_steps(message), nbytes
            )
            heapq.heappush(self._queue, (release, next(self._seq), message_id))
            self._replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The earliest replies among ``message_ids``, all released at one
        virtual instant (in the order they were pushed); the clock moves
        there. Empty when none of them is pending."""
        wanted = set(message_ids)
        pending = [e for e in self._queue if e[2] in wanted]
        if not pending:
            return []
        first = min(pending)[0]
        due = sorted(e for e in pending if e[0] == first)
        for entry in due:
            self._queue.remove(entry)
        heapq.heapify(self._queue)
        self.now = max(self.now, first)
        return [self._replies.pop(e[2]) for e in due]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages`` and pull until every reply is released."""
        ids = list(self.push_messages(messages))
        replies: list[Message] = []
        while ids:
            got = list(self.pull_messages(ids))
            if not got:
                break
            done = {m.metadata.reply_to_message_id for m in got}
            ids = [i for i in ids if i not in done]
            replies.extend(got)
        return replies
