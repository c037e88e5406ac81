"""Adapter state <-> ``ArrayRecord``, keyed by the layout's declared keys."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from flwr.app import ArrayRecord

__all__ = ["record_nbytes", "record_to_state", "state_to_record"]


def state_to_record(
    state: Mapping[str, torch.Tensor], keys: Iterable[str] | None = None
) -> ArrayRecord:
    """Pack tensors (all, or those named in ``keys``, in that order)."""
    selected = list(state) if keys is None else list(keys)
    missing = [k for k in selected if k not in state]
    if missing:
        raise KeyError(f"state has no tensors for keys {missing[:5]}")
    return ArrayRecord({k: state[k].detach().to("cpu").contiguous() for k in selected})


def record_to_state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Unpack an ``ArrayRecord`` into CPU tensors (dtype preserved)."""
    return dict(record.to_torch_state_dict())


def record_nbytes(record: ArrayRecord) -> int:
    """Payload bytes of the arrays in ``record`` (what travels on the wire)."""
    return sum(len(array.data) for array in record.values())
