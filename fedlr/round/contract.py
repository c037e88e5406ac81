"""What the round's steps need of a strategy, as a protocol mypy checks.

:class:`RoundStrategy` is the whole contract between the steps of
:mod:`fedlr.round` and a strategy
(:class:`~fedlr.strategies.base.FedLRStrategy` satisfies it): the method's
hooks, its frozen settings (read-only properties here: no step writes them)
and its latest :class:`~fedlr.round.value.Round`. The reply step reads a part
of it (:class:`~fedlr.round.replies.ReplyMethod`), a trial aggregation
another (:class:`~fedlr.round.state.Stateful`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from flwr.app import ArrayRecord, Message

from fedlr.adapters.roles import Role
from fedlr.options import Options
from fedlr.privacy.client_dp import ClientDpLedger
from fedlr.robust.heldout import HeldOutCheck
from fedlr.robust.rules import RobustConfig
from fedlr.robust.server_update import ServerUpdate
from fedlr.round.publish import MetricsAggregation, RoundReport
from fedlr.round.replies import Replies, ReplyMethod
from fedlr.round.state import Stateful
from fedlr.round.value import Round
from fedlr.wire.fingerprint import BaseFingerprint
from fedlr.wire.updates import ClientUpdate

__all__ = ["RoundStrategy"]


class RoundStrategy(ReplyMethod, Stateful, Protocol):
    """A strategy as the round's steps see it."""

    @property
    def send_roles(self) -> tuple[Role, ...]: ...
    @property
    def min_replies(self) -> int: ...
    @property
    def lr_decay(self) -> float: ...
    @property
    def max_update_ratio(self) -> float: ...
    @property
    def robust(self) -> RobustConfig: ...
    @property
    def heldout_check(self) -> HeldOutCheck | None: ...
    @property
    def server_update(self) -> ServerUpdate | None: ...
    @property
    def client_dp_ledger(self) -> ClientDpLedger | None: ...
    @property
    def base_fingerprint(self) -> BaseFingerprint | None: ...
    @property
    def client_evaluates(self) -> bool | None: ...
    @property
    def fraction_evaluate(self) -> float: ...
    @property
    def method_options(self) -> Options: ...
    @property
    def replies(self) -> Replies: ...
    @property
    def round(self) -> Round | None: ...
    @property
    def rejected_rounds(self) -> int: ...
    @property
    def train_metrics_aggr_fn(self) -> MetricsAggregation: ...
    @property
    def evaluate_metrics_aggr_fn(self) -> MetricsAggregation: ...

    def round_config(self, server_round: int) -> dict[str, Any]: ...

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]: ...

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]: ...
