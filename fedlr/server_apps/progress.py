"""Progress of a run as the ServerApp logs it: elapsed time, ETA, replies so far.

- :class:`RoundClock` turns each round's seconds into the round line's
  ``elapsed 4m10s eta 6m15s`` (the ETA is the mean round time so far times the
  rounds left).
- :func:`round_progress` wraps a deployment or simulation ``Grid`` for one
  round so that a long wait for replies logs ``k/n clients replied`` at most
  every ``every`` seconds; an in-process grid (which calls the ClientApp
  synchronously) is returned as it is.
- :func:`gap_text` renders the Frobenius gap, or nothing where the method has
  none (vision and continual methods).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlr.flower.grid import GridWrapper, InProcessGrid

__all__ = ["ProgressGrid", "RoundClock", "duration", "gap_text", "round_progress"]

#: Seconds between two ``k/n clients replied`` lines within a round.
PROGRESS_EVERY = 30.0
#: Seconds between two polls of the SuperLink for replies (Flower's own value).
POLL_SECONDS = 3.0


def duration(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``2h07m``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    total = round(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


@dataclass
class RoundClock:
    """Elapsed time since the run started and the ETA from the mean round time.

    Attributes
    ----------
    started : float
        ``time.monotonic()`` when the run started (this process's part of it,
        for a resumed run).
    rounds : list of float
        Seconds of each round this process ran.
    """

    started: float = field(default_factory=time.monotonic)
    rounds: list[float] = field(default_factory=list)

    def lap(self, seconds: float, rounds_left: int) -> str:
        """Record a round of ``seconds``; ``elapsed ... eta ...`` for its line."""
        self.rounds.append(seconds)
        elapsed = time.monotonic() - self.started
        if rounds_left <= 0:
            return f"elapsed {duration(elapsed)}"
        mean = sum(self.rounds) / len(self.rounds)
        return f"elapsed {duration(elapsed)} eta {duration(mean * rounds_left)}"


def gap_text(metrics: Mapping[str, Any]) -> str:
    """``gap 4.1e-03 (rel 2.5e-03) `` or ``""`` when the round has no gap."""
    gap = float(metrics.get("frobenius-gap", math.nan))
    if math.isnan(gap):
        return ""
    rel = float(metrics.get("relative-gap", math.nan))
    rel_part = "" if math.isnan(rel) else f" (rel {rel:.3e})"
    return f"gap {gap:.3e}{rel_part} "


class ProgressGrid(GridWrapper):
    """A ``Grid`` that logs how many replies of a round have arrived.

    Everything else is delegated to ``grid``; :meth:`send_and_receive` pushes the
    messages and pulls the replies as Flower's own grid does (every
    ``poll`` seconds until all replied or ``timeout``), logging
    ``fedlr [round t/T] k/n clients replied, 1m30s into the round`` at most
    every ``every`` seconds while some are missing.
    """

    def __init__(
        self,
        grid: Grid,
        *,
        label: str,
        every: float = PROGRESS_EVERY,
        poll: float = POLL_SECONDS,
    ) -> None:
        super().__init__(grid)
        self.label = label
        self.every = every
        self.poll = poll
        self.started = time.monotonic()

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        waiting = set(self.inner.push_messages(messages))
        sent = len(waiting)
        start = time.monotonic()
        last_line = start
        replies: list[Message] = []
        while timeout is None or time.monotonic() - start < timeout:
            arrived = list(self.inner.pull_messages(waiting))
            replies.extend(arrived)
            waiting.difference_update(m.metadata.reply_to_message_id for m in arrived)
            if not waiting:
                break
            now = time.monotonic()
            if now - last_line >= self.every:
                log(
                    INFO,
                    "fedlr [%s] %d/%d clients replied, %s into the round",
                    self.label,
                    sent - len(waiting),
                    sent,
                    duration(now - self.started),
                )
                last_line = now
            time.sleep(self.poll)
        return replies


def round_progress(grid: Grid, server_round: int, num_rounds: int) -> Grid:
    """``grid`` wrapped for round ``server_round`` (an in-process grid as it is)."""
    if isinstance(grid, InProcessGrid):
        return grid
    return ProgressGrid(grid, label=f"round {server_round}/{num_rounds}")
