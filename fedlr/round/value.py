"""The round as a value: what was sent and to whom, the replies, each step's
result and the report.

A strategy's ``configure_train`` makes the :class:`Round` (what it sent,
:func:`fedlr.round.instructions.train_round`); ``aggregate_train`` passes it
through the steps (:func:`fedlr.round.pipeline.aggregate_round`), each adding
its result with ``dataclasses.replace``, and keeps the finished one as the
strategy's ``round``. The strategy keeps nothing else of a round:
:class:`LatestRound` reads its fields under the names a strategy had
(``last_report``, ``rejected_rounds``, ``instructed``...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, Message

from fedlr.robust.screen import ScreenOutcome
from fedlr.round.publish import RoundReport

__all__ = ["LatestRound", "Round"]


@dataclass(frozen=True)
class Round:
    """One round of a strategy, as the steps leave it.

    What was sent (set when the round begins)
    ------------------------------------------
    number : int
        The server round.
    arrays : ArrayRecord
        The global arrays sent.
    sent : tuple of int, optional
        The nodes sent a train instruction (``None``: not recorded, e.g. the
        legacy API, whose server reports lost replies itself); a reply from
        any other node is dropped, an instructed node without one is
        ``no reply``.
    instructed : int, optional
        How many nodes were sent one (client-level DP's ``m``, whatever
        replies).
    population : int
        The nodes sampled from (client-level DP's ``N``).
    bytes_down : int
        The ArrayRecords of every instruction sent.
    instruction : Message, optional
        The round's first train instruction (what the server's own update
        trains).
    rejected_before : int
        Rounds of the run rejected before this one.

    What the steps made of the replies
    ----------------------------------
    dropped : list of str
        Why each dropped reply was dropped (naming its node).
    screen : ScreenOutcome, optional
        The update-size screen (every update's ratio to the round's median).
    robust : list of str
        Why the robust rule clipped or left out an update (one per node).
    rejection : str, optional
        Why the method's result was refused (the previous state is kept).
    report : RoundReport
        What the round published besides the arrays.
    timing : dict of str to float
        Wall-clock seconds (``train-seconds``, ``aggregate-seconds``,
        ``federated-eval-seconds``), set by the driver.
    evaluation : dict of str to float
        A personalised method's federated evaluation (the clients' mean and
        spread).
    """

    number: int
    arrays: ArrayRecord
    sent: tuple[int, ...] | None = None
    instructed: int | None = None
    population: int = 0
    bytes_down: int = 0
    instruction: Message | None = None
    rejected_before: int = 0
    dropped: list[str] = field(default_factory=list)
    screen: ScreenOutcome | None = None
    robust: list[str] = field(default_factory=list)
    rejection: str | None = None
    report: RoundReport = field(default_factory=RoundReport)
    timing: Mapping[str, float] = field(default_factory=dict)
    evaluation: Mapping[str, float] = field(default_factory=dict)

    @property
    def rejected_rounds(self) -> int:
        """Rounds of the run rejected so far, this one included."""
        return self.rejected_before + (self.rejection is not None)


class LatestRound:
    """A strategy's read access to its latest round (``round``) under the
    names its run-wide readers use (the runner, the server plan, client-level
    DP's ``m`` and ``N``); anything else of a round is ``round``'s field."""

    round: Round | None = None
    """The latest round: set by the strategy's own hooks (``configure_train``
    begins it, ``aggregate_train`` finishes it) and by the drivers that run
    the steps in their place (``run_round``'s timing, the asynchronous
    engine)."""

    @property
    def last_report(self) -> RoundReport:
        return self.round.report if self.round is not None else RoundReport()

    @property
    def last_rejection(self) -> str | None:
        return self.round.rejection if self.round is not None else None

    @property
    def rejected_rounds(self) -> int:
        return self.round.rejected_rounds if self.round is not None else 0

    @property
    def last_timing(self) -> Mapping[str, float]:
        return self.round.timing if self.round is not None else {}

    @property
    def last_evaluation(self) -> Mapping[str, float]:
        return self.round.evaluation if self.round is not None else {}

    @property
    def instructed(self) -> int | None:
        return self.round.instructed if self.round is not None else None

    @property
    def nodes_sampled_from(self) -> int:
        return self.round.population if self.round is not None else 0
