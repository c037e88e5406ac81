"""An in-process ``Grid``: calls a ``ClientApp`` directly, no Ray, no SuperLink.

It gives strategy and app tests real Flower ``Message`` objects and real
``Context`` objects with per-node state that persists across rounds, so the
whole round path (configure -> ClientApp -> validate -> aggregate) runs in a
few seconds. A ClientApp exception becomes an error reply, as it would on a
real SuperLink.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from logging import getLogger

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["GridWrapper", "InProcessGrid", "ReplyHook", "RoundHook"]

_LOG = getLogger("fedlr")
_SERVER_NODE_ID = 1

ReplyHook = Callable[[int, Message, Message], Message | None]
RoundHook = Callable[[list[tuple[int, Message, Message]]], list[Message | None]]


class GridWrapper(Grid):
    """A ``Grid`` that hands everything to ``inner``; a subclass overrides
    what it changes (the progress lines of a round, the virtual clock)."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self.inner.create_message(
            content, message_type, dst_node_id, group_id, ttl
        )

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.inner.send_and_receive(messages, timeout=timeout)


class InProcessGrid(Grid):
    """Route messages to a ``ClientApp`` in this process.

    Parameters
    ----------
    client_app : flwr.clientapp.ClientApp
        The app every node runs.
    num_nodes : int
        Number of simulated nodes; node ``i`` gets
        ``node_config = {"partition-id": i, "num-partitions": num_nodes}``.
    run_config : mapping
        The run config every node's ``Context`` carries.
    run_id : int
        Run id stamped on messages.
    reply_hook : callable, optional
        ``hook(partition_id, instruction, reply) -> reply``, applied to every
        reply; tests use it to corrupt replies of chosen nodes, or return
        ``None`` to lose a reply (as if the node timed out).
    node_config : mapping, optional
        Node-config values every node gets besides its ``partition-id`` and
        ``num-partitions`` (a node operator's own settings, e.g. the privacy
        limits of :mod:`fedlr.privacy.node_policy`).
    """

    def __init__(
        self,
        client_app: ClientApp,
        *,
        num_nodes: int,
        run_config: Mapping[str, bool | float | int | str],
        run_id: int = 1,
        reply_hook: ReplyHook | None = None,
        round_hook: RoundHook | None = None,
        node_config: Mapping[str, bool | float | int | str] | None = None,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self._client_app = client_app
        self._run = Run.create_empty(run_id)
        self._reply_hook = reply_hook
        self._round_hook = round_hook
        self._node_ids = [1000 + i for i in range(num_nodes)]
        self._partition = {nid: i for i, nid in enumerate(self._node_ids)}
        self.contexts: dict[int, Context] = {
            nid: Context(
                run_id=run_id,
                node_id=nid,
                node_config={
                    **(node_config or {}),
                    "partition-id": i,
                    "num-partitions": num_nodes,
                },
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for i, nid in enumerate(self._node_ids)
        }
        self._pending: dict[str, Message] = {}
        self._counter = itertools.count()
        self.messages_sent = 0
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = _SERVER_NODE_ID
        TaskIdentity.task_id = 0

    # -- Grid interface ----------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content=content,
            dst_node_id=dst_node_id,
            message_type=message_type,
            group_id=group_id,
            ttl=ttl,
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids: list[str] = []
        for message in messages:
            dst = message.metadata.dst_node_id
            if dst not in self.contexts:
                raise ValueError(f"message for unknown node {dst}")
            message_id = f"{next(self._counter)}-{uuid.uuid4().hex[:8]}"
            message.metadata.__dict__["_message_id"] = message_id
            self._pending[message_id] = message
            ids.append(message_id)
            self.messages_sent += 1
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies: list[Message] = []
        for message_id in message_ids:
            message = self._pending.pop(message_id, None)
            if message is not None:
                reply = self._deliver(message)
                if reply is not None:  # None: the reply is lost (a timeout)
                    replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        start = time.monotonic()
        sent = list(messages)
        replies: list[Message] = []
        for message_id in self.push_messages(sent):
            if timeout is not None and time.monotonic() - start > timeout:
                self._pending.pop(message_id, None)
                continue
            replies.extend(self.pull_messages([message_id]))
        if self._round_hook is None:
            return replies
        by_id = {m.metadata.message_id: m for m in sent}
        round_ = []
        for reply in replies:
            instruction = by_id[reply.metadata.reply_to_message_id]
            node = instruction.metadata.dst_node_id
            round_.append((self._partition[node], instruction, reply))
        return [r for r in self._round_hook(round_) if r is not None]

    # -- delivery ------------------------------------------------------------
    def _deliver(self, message: Message) -> Message | None:
        node_id = message.metadata.dst_node_id
        context = self.contexts[node_id]
        try:
            reply = self._client_app(message, context)
        except Exception as exc:
            _LOG.warning("node %d: ClientApp raised %r", node_id, exc)
            reply = Message(Error(code=0, reason=repr(exc)), reply_to=message)
        if self._reply_hook is not None:
            return self._reply_hook(self._partition[node_id], message, reply)
        return reply
