"""The method's state around a trial aggregation, and the faults that reject it.

:func:`method_state` copies what a strategy's ``aggregate_updates`` may change
(its checkpointed ``state_dict()`` and the attributes its classes declare in
``round_state``); :func:`restore_method_state` puts it back. The round
pipeline uses them to undo a rejected round
(:func:`fedlr.round.pipeline.aggregate_accepted`), the held-out check to try
the aggregation without each reply (:class:`fedlr.round.protect.HeldOutStep`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol

import torch

__all__ = [
    "NUMERIC_FAULTS",
    "Stateful",
    "method_state",
    "restore_method_state",
    "state_attributes",
]

NUMERIC_FAULTS: tuple[type[BaseException], ...] = (
    torch.linalg.LinAlgError,  # type: ignore[attr-defined]
    ArithmeticError,
)
"""Errors of an aggregation kernel that reject the round, not the run (a
failed SVD, an overflow)."""


# ------------------------------------------------------------ method state
class Stateful(Protocol):
    """A method's checkpointed state (a strategy's ``state_dict`` pair)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def state_attributes(cls: type) -> tuple[str, ...]:
    """Every attribute name the classes of ``cls``'s MRO declare in
    ``round_state`` (what their ``aggregate_updates`` may change)."""
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        for name in vars(klass).get("round_state", ()):
            if name not in names:
                names.append(name)
    return tuple(names)


def method_state(strategy: Stateful) -> dict[str, Any]:
    """A copy of the method's explicit state: its checkpointed
    ``state_dict()`` and every attribute its classes declare in
    ``round_state``."""
    return {
        "state_dict": copy.deepcopy(strategy.state_dict()),
        "attributes": {
            name: copy.deepcopy(getattr(strategy, name))
            for name in state_attributes(type(strategy))
            if hasattr(strategy, name)
        },
    }


def restore_method_state(strategy: Stateful, snapshot: Mapping[str, Any]) -> None:
    """Put back what :func:`method_state` copied (a rejected round)."""
    strategy.load_state_dict(snapshot["state_dict"])
    for name, value in snapshot["attributes"].items():
        setattr(strategy, name, value)
