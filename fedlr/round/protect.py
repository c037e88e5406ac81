"""The round's protection steps, between the screen and the method.

They act on a round's validated updates, composed from the run config: the
robust rule (:class:`RobustStep`: norm clipping, trimming, the geometric
median, weight caps, in the method's update space), the held-out check
(:class:`HeldOutStep`: leave out a reply that raises the server's
validation loss, :mod:`fedlr.robust.heldout`) and client-level DP
(:class:`ClientDpStep`: each update clipped, the mean noised; refused beside
a robust rule at construction, :func:`fedlr.strategies.refusals.check_robust`).
Each step returns the updates the method aggregates, the updates it left out
and its metrics; :func:`protection_steps` composes them for a strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from logging import DEBUG, WARNING
from typing import Any, Protocol

import torch
from flwr.supercore import log

from fedlr.errors import ReplyValidationError, ServerUpdateError
from fedlr.privacy.client_dp import DP_EPSILON, largest_spent, privatize
from fedlr.robust.heldout import HeldOutCheck, leave_one_out
from fedlr.robust.rules import RobustConfig, robust_aggregate, rule_named
from fedlr.robust.server_update import SERVER_NODE, ServerUpdate, server_weight
from fedlr.robust.spaces import UpdateSpace
from fedlr.round.contract import RoundStrategy
from fedlr.round.replies import Replies, conform_dtypes, short
from fedlr.round.state import NUMERIC_FAULTS, method_state, restore_method_state
from fedlr.round.value import Round
from fedlr.wire.protocol import TRAIN_LOSS
from fedlr.wire.updates import ClientUpdate

__all__ = [
    "SERVER",
    "ClientDpStep",
    "HeldOutStep",
    "OwnUpdate",
    "Protected",
    "ProtectionStep",
    "RobustStep",
    "ServerUpdateStep",
    "own_update",
    "protection_steps",
]


@dataclass(frozen=True)
class Protected:
    """What the protection steps pass on.

    Attributes
    ----------
    updates : list of ClientUpdate
        The updates the method aggregates (clipped, re-weighted, noised...).
    left_out : list of ClientUpdate
        Updates a robust rule left out (their metrics are reported apart).
    metrics : dict of str to float
        The steps' round metrics (``robust-trimmed``, ``client-dp-epsilon``...).
    trusted : list of ClientUpdate
        Updates that are not clients' (the server's own,
        :class:`ServerUpdateStep`): the method aggregates
        them with ``updates``; the clients' metrics do not count them.
    robust : list of str
        Why the robust rule clipped or left out an update (one per node).
    """

    updates: list[ClientUpdate]
    left_out: list[ClientUpdate] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    trusted: list[ClientUpdate] = field(default_factory=list)
    robust: list[str] = field(default_factory=list)


class ProtectionStep(Protocol):
    """One step between the screen and the method."""

    def __call__(
        self,
        server_round: int,
        done: Protected,
        current: Mapping[str, torch.Tensor],
    ) -> Protected: ...


@dataclass
class RobustStep:
    """The robust rule, in the space of the strategy's reply step.

    The kept updates' extra records follow their arrays
    (:meth:`~fedlr.round.replies.Replies.clip_extras`), then the rule bounds
    each record that follows its arrays
    (:meth:`~fedlr.round.replies.Replies.clips_record`) as it declares
    (:attr:`~fedlr.robust.registration.RobustRule.followed_records`); the
    reasons are logged and kept in :attr:`Protected.robust`. With ``clip-reference =
    "server"`` the round's bound is ``clip-ratio`` times the norm of the
    server's own update (:func:`own_update`) in that space.
    """

    config: RobustConfig
    replies: Replies
    own: OwnUpdate | None = None

    def __call__(
        self, server_round: int, done: Protected, current: Mapping[str, torch.Tensor]
    ) -> Protected:
        updates = done.updates
        space = self.replies.space(current)
        config = self.config
        if config.clip_reference == "server" and config.clip_norm == 0:
            config = self.server_bound(server_round, space, config)
        outcome = robust_aggregate(updates, space, config)
        kept_nodes = {u.node_id for u in outcome.updates}
        left_out = [u for u in updates if u.node_id not in kept_nodes]
        kept = [self.replies.clip_extras(u) for u in outcome.updates]
        followed = rule_named(self.config.rule).followed_records
        for name in self.replies.records():
            if followed is not None and self.replies.clips_record(name):
                kept, more = followed(kept, name, self.config)
                outcome.reasons.extend(more)
        # At the server's norm (robust = auto) a clip is the normal case, not
        # a sign of attack: counted in robust-clipped, its detail at DEBUG.
        level = DEBUG if self.config.clip_reference == "server" else WARNING
        for reason in outcome.reasons:
            log(
                level,
                "round %d: robust (%s): %s",
                server_round,
                self.config.rule,
                reason,
            )
        return replace(
            done,
            updates=kept,
            left_out=done.left_out + left_out,
            metrics={**done.metrics, **outcome.metrics},
            robust=outcome.reasons,
        )

    def server_bound(
        self, server_round: int, space: UpdateSpace, config: RobustConfig
    ) -> RobustConfig:
        """The round's rule at ``clip-ratio`` times the norm of the server's
        own update in ``space``; without a valid server update this round
        (:class:`OwnUpdate`, which warned), at ``clip-ratio`` times the
        round's median norm, the rule's ``clip-reference = "median"``."""
        if self.own is None:
            raise RuntimeError(
                "clip-reference = server needs the server's own update "
                "(server-update-share > 0; refused at configuration)"
            )
        own = self.own.get(server_round)
        if own is not None:
            try:
                norm, why = float(space.norm(own)), ""
            except NUMERIC_FAULTS as exc:
                norm, why = math.nan, f" ({type(exc).__name__}: {short(str(exc))})"
            if math.isfinite(norm):
                return replace(config, clip_norm=max(config.clip_ratio * norm, 1e-30))
            self.own.fail(
                server_round, f"its norm in the method's space is {norm}{why}"
            )
        return replace(config, clip_reference="median")


@dataclass
class HeldOutStep:
    """The held-out check (:mod:`fedlr.robust.heldout`), after the robust rule.

    Each try is the method's own ``aggregate_updates`` on the round's
    updates with one left out, its state restored after it
    (:func:`~fedlr.round.state.method_state`); a try that fails numerically
    counts as an infinite loss. With fewer than 3 updates nothing is tried.
    Metrics: ``heldout-loss`` (the validation loss of what is aggregated,
    before client-level DP's noise), ``heldout-left-out``.
    """

    check: HeldOutCheck
    strategy: RoundStrategy

    def __call__(
        self, server_round: int, done: Protected, current: Mapping[str, torch.Tensor]
    ) -> Protected:
        kept = list(done.updates)
        left: list[ClientUpdate] = []
        most = (len(kept) - 1) // 2  # never half of the round's replies
        if len(kept) < 3:  # nothing would be left out: no tries
            return replace(done, metrics={**done.metrics, "heldout-left-out": 0.0})
        snapshot = method_state(self.strategy)  # each try restores it
        loss = self.loss(server_round, kept, current, snapshot)
        while len(kept) >= 3 and len(left) < most:
            without = [
                self.loss(server_round, kept[:i] + kept[i + 1 :], current, snapshot)
                for i in range(len(kept))
            ]
            i = leave_one_out(loss, without, self.check.margin)
            if i is None:
                break
            log(
                WARNING,
                "round %d: held-out check: node %d left out (validation loss "
                "%.4f with its update, %.4f without; margin %g)",
                server_round,
                kept[i].node_id,
                loss,
                without[i],
                self.check.margin,
            )
            left.append(kept.pop(i))
            loss = without[i]
        metrics = {"heldout-loss": loss, "heldout-left-out": float(len(left))}
        return replace(
            done,
            updates=kept,
            left_out=done.left_out + left,
            metrics={**done.metrics, **metrics},
        )

    def loss(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: Mapping[str, torch.Tensor],
        snapshot: Mapping[str, Any],
    ) -> float:
        """The validation loss of what the method would publish from
        ``updates`` (``inf`` if it fails numerically); the method's state is
        ``snapshot`` again afterwards."""
        try:
            state, _ = self.strategy.aggregate_updates(
                server_round, updates, dict(current)
            )
        except NUMERIC_FAULTS:
            return math.inf
        finally:
            restore_method_state(self.strategy, snapshot)
        return float(self.check.loss(state))


SERVER = "the server's own update"
"""How logs and errors name the server's update (never by a node id)."""


def own_update(strategy: RoundStrategy, sent: Round) -> ClientUpdate:
    """The server's own update of round ``sent`` (its :data:`SERVER_NODE`).

    The round's train instruction (``sent.instruction``) trained
    by ``strategy.server_update`` (once per instruction: asking again is
    free; its reply comes from :data:`SERVER_NODE`), checked by the
    strategy's reply step like any reply, but for the ``max-num-examples``
    cap: that cap bounds what a client's claim buys, and the server's weight
    is its share whatever it trained on
    (:meth:`~fedlr.round.replies.Replies.reply_weight`).

    Raises
    ------
    ServerUpdateError
        Naming the server and why: no instruction, its training raised
        (whatever the error), its reply is not valid (an error reply, a
        non-finite array...) or its training loss is not finite.
    """
    update: ServerUpdate | None = strategy.server_update
    instruction = sent.instruction
    if update is None or instruction is None:
        raise ServerUpdateError(
            "there is no round instruction to train (configure_train keeps it)"
        )
    try:
        reply = update.train(instruction)
    except Exception as exc:  # the server's own: never ends the round
        raise ServerUpdateError(
            f"its training raised {type(exc).__name__}: {short(str(exc))}"
        ) from exc
    replies: Replies = strategy.replies
    try:
        checked = replies.validate_reply(reply, strategy.reply_shapes())
        dtypes = replies.layout_dtypes(sent.arrays)
        own = replace(conform_dtypes(checked, dtypes), node_id=SERVER_NODE)
    except ReplyValidationError as exc:
        raise ServerUpdateError(f"its reply is not valid: {exc.reason}") from exc
    except Exception as exc:
        raise ServerUpdateError(
            f"its reply could not be checked: {type(exc).__name__}: {short(str(exc))}"
        ) from exc
    loss = own.metrics.get(TRAIN_LOSS, 0.0)
    if not math.isfinite(loss):
        raise ServerUpdateError(f"its training loss is {loss}")
    return own


@dataclass
class OwnUpdate:
    """The server's own update of one round, trained and checked once, for
    the steps that read it (the clip at its norm, :class:`ServerUpdateStep`).

    A failure (:class:`~fedlr.errors.ServerUpdateError` from
    :func:`own_update`, or a norm that is not finite) never ends the round:
    one WARNING names the server and the reason, and the round runs without
    the server's update (:meth:`get` is ``None``): no share for it, and the
    clip at its norm falls back to the round's median
    (:meth:`RobustStep.server_bound`).
    """

    strategy: RoundStrategy
    sent: Round
    _update: ClientUpdate | None = field(default=None, init=False, repr=False)
    _tried: bool = field(default=False, init=False, repr=False)

    def get(self, server_round: int) -> ClientUpdate | None:
        """The server's update of the round, or ``None`` if it failed."""
        if not self._tried:
            self._tried = True
            try:
                self._update = own_update(self.strategy, self.sent)
            except ServerUpdateError as exc:
                self.fail(server_round, exc.reason)
        return self._update

    def fail(self, server_round: int, reason: str) -> None:
        """Leave the server's update out of the round, with one warning."""
        self._tried, self._update = True, None
        log(
            WARNING,
            "round %d: %s is left out: %s; the round runs without it (no "
            "share for the server; a clip at its norm uses the round's median "
            "norm instead)",
            server_round,
            SERVER,
            reason,
        )


@dataclass
class ServerUpdateStep:
    """The server's own update (:mod:`fedlr.robust.server_update`), after the
    robust rule and the held-out check.

    :func:`own_update` (through :class:`OwnUpdate`), weighted as the share
    ``s`` of the round's weight (:func:`server_weight` of the clients'
    weights after the rule). Metrics: ``server-update-weight`` (the share of
    the round it had: 0 in a round that runs without it) and
    ``server-update-loss`` (its training loss; NaN without it).
    """

    update: ServerUpdate
    own: OwnUpdate

    def __call__(
        self, server_round: int, done: Protected, current: Mapping[str, torch.Tensor]
    ) -> Protected:
        own = self.own.get(server_round)
        if own is None:
            metrics = {"server-update-weight": 0.0, "server-update-loss": math.nan}
            return replace(done, metrics={**done.metrics, **metrics})
        weight = server_weight(self.update.share, [u.weight for u in done.updates])
        own = replace(own, weight=weight)
        total = weight + math.fsum(u.weight for u in done.updates)
        metrics = {
            "server-update-weight": weight / total if total > 0 else 0.0,
            "server-update-loss": float(own.metrics.get(TRAIN_LOSS, math.nan)),
        }
        return replace(
            done, metrics={**done.metrics, **metrics}, trusted=[*done.trusted, own]
        )


@dataclass
class ClientDpStep:
    """Client-level DP (when on) and DP-SGD's largest client epsilon.

    :func:`fedlr.privacy.client_dp.privatize` of the strategy's ``privacy``
    on the arrays of its ``reply_shapes()``, ``m`` the round's instructed
    nodes and ``N`` its population (:class:`~fedlr.round.value.Round`), the
    release recorded in its ``client_dp_ledger``; then the largest
    ``dp-epsilon-spent`` the replies report (``dp-epsilon``).
    """

    strategy: RoundStrategy
    sent: Round

    def __call__(
        self, server_round: int, done: Protected, current: Mapping[str, torch.Tensor]
    ) -> Protected:
        updates, metrics = done.updates, dict(done.metrics)
        settings = self.strategy.privacy.client_dp
        if settings is not None:
            ledger = self.strategy.client_dp_ledger
            if ledger is None:  # a strategy makes one whenever client DP is on
                raise RuntimeError("client-level DP is on without its ledger")
            updates, privacy = privatize(
                updates,
                current,
                list(self.strategy.reply_shapes()),
                settings,
                sent=self.sent.instructed,
                population=self.sent.population,
                server_round=server_round,
                ledger=ledger,
            )
            metrics.update(privacy)
        spent = largest_spent(updates)
        if spent is not None:
            metrics[DP_EPSILON] = spent
        return replace(done, updates=updates, metrics=metrics)


def protection_steps(strategy: RoundStrategy, sent: Round) -> list[ProtectionStep]:
    """The protection steps of ``strategy``'s round ``sent``, from its settings.

    The robust rule when one is active, the held-out check and the server's
    own update when the server plan set them, then client-level DP (which
    also reports DP-SGD's largest client epsilon, so it always runs).
    """
    steps: list[ProtectionStep] = []
    # set by the server plan; trained at most once this round
    server = strategy.server_update
    own = OwnUpdate(strategy, sent) if server is not None else None
    if strategy.robust.active:
        steps.append(RobustStep(strategy.robust, strategy.replies, own))
    if strategy.heldout_check is not None:  # set by the server plan
        steps.append(HeldOutStep(strategy.heldout_check, strategy))
    if server is not None and own is not None:
        steps.append(ServerUpdateStep(server, own))
    steps.append(ClientDpStep(strategy, sent))
    return steps
