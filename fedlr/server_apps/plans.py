"""Server plans: what the ServerApp builds for a method, keyed by client kind.

A method's registry entry names its ``client_kind`` (``lora``, ``vera`` ...);
the same name selects the ClientApp handlers (:mod:`fedlr.client_apps.app`) and the
server plan here. A plan is everything the generic round loop in
:mod:`fedlr.server_apps.runner` needs and nothing about how the loop runs:

* the strategy, built from the run config;
* the initial global arrays;
* the base train ConfigRecord values;
* an ``evaluate(server_round, state)`` returning at least ``accuracy`` and
  ``loss`` (server-side evaluation of the global model, or for a personalised
  method the strategy's aggregated federated evaluation);
* the extra result columns the plan or its strategy reports (declared, so a
  typo is an error, not a silent new column);
* an optional ``finish(run_dir)`` that writes extra files at the end and
  returns extra ``summary.json`` fields.

A family adds a module with a builder decorated by :func:`register_plan` and
imports it in :mod:`fedlr.server_apps.kinds`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedlr.config import RunConfig
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.registry import MethodSpec

__all__ = [
    "EvaluateFn",
    "PlanBuilder",
    "ServerPlan",
    "available_plans",
    "get_plan_builder",
    "register_plan",
]

EvaluateFn = Callable[[int, Mapping[str, torch.Tensor]], dict[str, float]]
FinishFn = Callable[[Path], dict[str, Any]]


@dataclass
class ServerPlan:
    """What the round loop runs for one method.

    Attributes
    ----------
    strategy : FedLRStrategy
    initial_arrays : dict of str to torch.Tensor
        The global arrays sent in round 1.
    evaluate : callable
        ``evaluate(server_round, state) -> {"accuracy": ..., "loss": ..., ...}``;
        round 0 is the initial model. Keys other than accuracy and loss must be
        declared in ``columns``.
    train_config : dict
        Base values of the train ConfigRecord (``lr`` is decayed per round by
        the strategy).
    columns : tuple of str
        Extra ``results.csv`` columns (beyond :data:`fedlr.results.COLUMNS`),
        filled from ``evaluate``'s result and from the strategy's round
        metrics.
    description : str
        One line for the log (model, data, sizes).
    finish : callable, optional
        ``finish(run_dir) -> extra summary fields``, called once at the end.
    save_state, load_state : callable, optional
        The plan's own state for checkpoints (e.g. a continual run's accuracy
        matrix): ``save_state() -> dict`` and ``load_state(dict)``.
    """

    strategy: FedLRStrategy
    initial_arrays: dict[str, torch.Tensor]
    evaluate: EvaluateFn
    train_config: dict[str, Any]
    columns: tuple[str, ...] = ()
    description: str = ""
    finish: FinishFn | None = None
    save_state: Callable[[], dict[str, Any]] | None = None
    load_state: Callable[[dict[str, Any]], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


PlanBuilder = Callable[[RunConfig, MethodSpec], ServerPlan]

_PLANS: dict[str, PlanBuilder] = {}


def register_plan(kind: str) -> Callable[[PlanBuilder], PlanBuilder]:
    """Decorator registering the server plan builder of a client kind.

    Raises
    ------
    ValueError
        If ``kind`` already has a builder.
    """

    def decorator(builder: PlanBuilder) -> PlanBuilder:
        if kind in _PLANS:
            raise ValueError(f"client kind '{kind}' already has a server plan")
        _PLANS[kind] = builder
        return builder

    return decorator


def get_plan_builder(kind: str) -> PlanBuilder:
    """The builder for ``kind``.

    Raises
    ------
    KeyError
        Naming the kind and the kinds that have plans.
    """
    try:
        return _PLANS[kind]
    except KeyError:
        raise KeyError(
            f"no server plan for client kind '{kind}'; known: {sorted(_PLANS)}"
        ) from None


def available_plans() -> list[str]:
    """Client kinds with a server plan, sorted."""
    return sorted(_PLANS)
