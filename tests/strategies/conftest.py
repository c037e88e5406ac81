"""Helpers to build real Flower reply messages for strategy tests."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedlr.flower.records import state_to_record

_COUNTER = [0]


def instruction(node_id: int) -> Message:
    """A train instruction addressed to ``node_id`` (as a grid would push it)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 0
    msg = Message(content=RecordDict(), dst_node_id=node_id, message_type="train")
    _COUNTER[0] += 1
    msg.metadata.__dict__["_message_id"] = f"m{_COUNTER[0]}"
    return msg


def reply(
    node_id: int,
    arrays: Mapping[str, torch.Tensor] | ArrayRecord,
    metrics: Mapping[str, float | int] | None,
) -> Message:
    """A client's reply carrying ``arrays`` and ``metrics``."""
    record = arrays if isinstance(arrays, ArrayRecord) else state_to_record(arrays)
    content = RecordDict({"arrays": record})
    if metrics is not None:
        content["metrics"] = MetricRecord(dict(metrics))
    return Message(content, reply_to=instruction(node_id))
