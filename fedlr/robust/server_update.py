"""The server's own update: a trusted reply that no client can cancel.

A client that sends the negated honest mean at a typical norm passes every
rule that reads sizes and directions, and on non-IID partitions the honest
mean is a fraction of a typical update, so one such reply stalls the model
(docs/results/robustness.md). A clip and a weight cap bound what that reply
can pull (its share times the round's median norm) but leave nothing that
keeps the model moving once the honest mean is cancelled.

With ``server-update-share = s`` the server holds validation examples (the
held-out check's, :meth:`fedlr.tasks.text.TextTask.check_examples`) and,
each round, trains the round's instruction on them exactly as a node would
(:func:`fedlr.client.round.apply_round`, fedlr's loop,
:func:`fedlr.client_apps.common.train_reply`). Its reply goes through the
server's own reply checks and enters the method's aggregation after the
robust rule with the weight

    w_server = s / (1 - s) * sum_i w_i,

so it is the share ``s`` of the round's weight, whatever the clients claim
(the FLTrust setting of Cao et al. [1]_, a small trusted root data set, used
as an anchor rather than as a cosine reference, whose measured cosines with
honest updates are near zero here). What it assumes: the server's examples
come from the task's distribution; the share ``s`` of every round is the
server's data, whatever the clients hold.

References
----------
.. [1] Cao, Fang, Liu, Gong, "FLTrust: Byzantine-robust Federated Learning
   via Trust Bootstrapping", NDSS 2021.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, RecordDict

from fedlr.errors import ConfigError
from fedlr.wire.protocol import CONFIG

__all__ = [
    "AUTO_SHARE",
    "SERVER_NODE",
    "SERVER_UPDATE_COLUMNS",
    "ServerUpdate",
    "check_server_update_strategy",
    "refuse_server_update",
    "server_instruction",
    "server_update_refusal",
    "server_weight",
]

KEY = "server-update-share"
SERVER_UPDATE_COLUMNS = ("server-update-weight", "server-update-loss")
"""``results.csv`` columns of a run with the server's own update: the share
of the round's weight it had, and its training loss."""
SERVER_NODE = 0
"""The node id of the server's own update (Flower never gives a node 0)."""
AUTO_SHARE = 0.5
"""The share ``robust = auto`` gives the server's update where it applies
(``server-update-share`` left at 0): measured on the default task at 5 seeds
(docs/results/robustness.md)."""


@dataclass(frozen=True)
class ServerUpdate:
    """The server's own update of a strategy (set by its server plan).

    Attributes
    ----------
    train : callable
        ``train(instruction) -> reply``: the round's train instruction
        trained on the server's examples, answered as a node answers but as
        the server: a reply to :func:`server_instruction` of it, so that
        the reply, and every line and error about it, names the server
        (:data:`SERVER_NODE`), never the node the instruction was sent to.
    share : float
        ``server-update-share``, in (0, 1).
    examples : int
        How many examples ``train`` reads (for the start-up line).
    """

    train: Callable[[Message], Message]
    share: float
    examples: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and 0 < self.share < 1):
            raise ConfigError(
                "server-update-share", f"must be in (0, 1), got {self.share}"
            )


def server_instruction(instruction: Message, without: Collection[str] = ()) -> Message:
    """``instruction`` addressed to the server (:data:`SERVER_NODE`): its
    content, without the ConfigRecord keys ``without`` (the server's own
    settings are not the nodes', e.g. DP-SGD's keys)."""
    content = RecordDict(dict(instruction.content.items()))
    if CONFIG in content.config_records:
        sent = content.config_records[CONFIG]
        content[CONFIG] = ConfigRecord(
            {k: v for k, v in sent.items() if k not in without}
        )
    return Message(
        content,
        dst_node_id=SERVER_NODE,
        message_type=instruction.metadata.message_type,
        group_id=instruction.metadata.group_id,
    )


def server_weight(share: float, weights: Sequence[float]) -> float:
    """The server update's weight: the share ``share`` of the round's total.

    ``share / (1 - share) * sum(weights)``, so that the server's weight over
    the sum of all weights, its own included, is ``share``.

    Raises
    ------
    ValueError
        If ``share`` is not in (0, 1) or a weight is negative or not finite.
    """
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), got {share}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    return share / (1 - share) * math.fsum(weights)


def server_update_refusal(
    method: str,
    payload: str,
    personalised: bool,
    *,
    secure_aggregation: bool,
    client_dp: bool,
    records: Sequence[str] = (),
    asynchronous: bool = False,
    client_ranks: bool = False,
) -> str | None:
    """Why the server cannot add its own update to a run, or ``None`` if it
    can: the one list of conditions that the refusals below and
    ``robust = auto`` (:func:`fedlr.strategies.registry.resolve`) read.

    The server needs one global model to train (not a personalised method),
    validation examples (a ``lora`` server plan), every single reply after
    the robust rule (not SecAgg+, not client-level DP), no per-node state it
    lacks (no extra reply records), a round instruction (not the
    asynchronous engine) and one rank (no ``client-ranks``).
    """
    if personalised:
        return (
            f"method '{method}' is personalised: there is no one global model "
            "for the server to train"
        )
    if payload != "lora":
        return (
            f"method '{method}' sends '{payload}' payloads, and only the lora "
            "server plan holds validation examples"
        )
    for on, what in (
        (secure_aggregation, "secure-aggregation"),
        (client_dp, "client-level DP"),
    ):
        if on:
            return (
                f"{what} replaces the robust rule, after which the server's "
                "update joins the round; not combined in this version"
            )
    if records:
        return (
            f"method '{method}' replies with the records {', '.join(records)}, "
            "whose per-node state the server does not have"
        )
    if asynchronous:
        return (
            f"method '{method}' runs on the asynchronous engine, which has no "
            "round instruction for the server to train"
        )
    if client_ranks:
        return (
            "with client-ranks the nodes train at different ranks, and the "
            "server's update has no rank of its own"
        )
    return None


def refuse_server_update(reason: str | None) -> None:
    """Raise the refusal :func:`server_update_refusal` found, if any.

    Raises
    ------
    ConfigError
        (key ``server-update-share``) with ``reason``: a personalised
        method, a payload kind whose server plan holds no validation
        examples, SecAgg+ or client-level DP, extra reply records, the
        asynchronous engine or ``client-ranks``.
    """
    if reason is not None:
        raise ConfigError(KEY, f"{reason}; set server-update-share = 0")


def check_server_update_strategy(
    method: str, records: Sequence[str], *, asynchronous: bool
) -> None:
    """Refuse, when the server plan builds the strategy (before any client
    trains), a method whose round the server cannot answer as a node: the
    strategy's own records and engine, a second look after the registered
    ones that the configuration read.

    Raises
    ------
    ConfigError
        (key ``server-update-share``) for a method whose replies carry extra
        records (their per-node state has no server counterpart) or that
        runs on the asynchronous engine (no round instruction to train).
    """
    refuse_server_update(
        server_update_refusal(
            method,
            "lora",
            False,
            secure_aggregation=False,
            client_dp=False,
            records=records,
            asynchronous=asynchronous,
        )
    )
