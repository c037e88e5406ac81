"""Server plans: what the ServerApp builds for a method.

A method's registry entry names its payload kind
(:class:`~fedlr.client_apps.payload_kind.PayloadKind`); the plan builder of that
kind (``plan(method_config) -> ServerPlan``) is registered here under the
kind's name (:func:`register_plan`), in the plan's own module, and
:func:`fedlr.server_apps.builtin_plans.build_plan` builds a method's plan.
The payload kinds and the registry below do not import the plans. A plan is
everything the generic round loop in :mod:`fedlr.server_apps.runner` needs
and nothing about how the loop runs:

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

A plan whose global model is evaluated on the server's held-out split is built
by :func:`heldout_plan` (the ``lora``, ``vera`` and ``qrmix`` kinds); every
plan's train ConfigRecord starts from :func:`base_train_config`.

A family adds a module of :mod:`fedlr.server_apps` with its builder,
decorated with ``@register_plan("<payload kind name>")``, and names it in
:mod:`fedlr.server_apps.builtin_plans` (the lookup, above the plan modules,
which import this one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from fedlr.config.run import RunConfig
from fedlr.data.splits import dataset_split
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.registry import MethodConfig, MethodSpec
from fedlr.wire import protocol

__all__ = [
    "EvaluateFn",
    "PlanBuilder",
    "ServerPlan",
    "base_train_config",
    "check_strategy",
    "heldout_plan",
    "plan_builder",
    "register_plan",
]

_S = TypeVar("_S", bound=FedLRStrategy)
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
        Extra ``results.csv`` columns (beyond :data:`fedlr.runs.results.COLUMNS`),
        filled from ``evaluate``'s result and from the strategy's round
        metrics.
    description : str
        One line for the log (model, data, sizes).
    finish : callable, optional
        ``finish(run_dir) -> extra summary fields``, called once at the end.
    save_state, load_state : callable, optional
        The plan's own state for checkpoints (e.g. a continual run's accuracy
        matrix): ``save_state() -> dict`` and ``load_state(dict)``.
    largest_partition : callable, optional
        ``largest_partition(num_partitions) -> int``: the most training
        examples a client holds when the data is cut into that many
        partitions, when the plan knows the partitions; the default
        ``max-num-examples`` (a reply claiming more is dropped).
    needs_evaluation : callable, optional
        ``needs_evaluation(server_round) -> bool``: rounds the plan must
        evaluate whatever ``eval-every`` says (a continual run's task ends).
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
    largest_partition: Callable[[int], int] | None = None
    needs_evaluation: Callable[[int], bool] | None = None


def check_strategy(spec: MethodSpec, base: type[_S]) -> type[_S]:
    """The method's strategy class, which must be a ``base`` (else ``TypeError``).

    A payload kind's plan serves strategies of one family; a method registered
    with the wrong payload kind fails here, at start-up, naming both.
    """
    if not issubclass(spec.strategy, base):
        raise TypeError(
            f"method '{spec.name}' has payload kind '{spec.payload.name}' but its "
            f"strategy {spec.strategy.__qualname__} is not a {base.__name__}"
        )
    return spec.strategy


def base_train_config(config: RunConfig, lr: float | None = None) -> dict[str, Any]:
    """Base values of the train ConfigRecord: ``lr``, ``local-steps``, ``batch-size``.

    Parameters
    ----------
    config : RunConfig
    lr : float, optional
        The round-1 learning rate when the kind has its own (VeRA's
        ``vera-lr``); default the run's ``lr``.
    """
    return {
        protocol.LR: config.lr if lr is None else lr,
        protocol.LOCAL_STEPS: config.local_steps,
        protocol.BATCH_SIZE: config.batch_size,
    }


def heldout_plan(
    config: RunConfig,
    *,
    strategy: FedLRStrategy,
    initial_arrays: dict[str, torch.Tensor],
    evaluate: EvaluateFn,
    heldout_examples: int,
    device: torch.device,
    columns: tuple[str, ...] = (),
    lr: float | None = None,
    model_note: str = "",
    note: str = "",
) -> ServerPlan:
    """The plan of a kind whose global model is evaluated on the held-out split.

    The shared part of the ``lora``, ``vera``/``sorf-vera`` and ``qrmix`` plans:
    the data set is cut by :func:`fedlr.data.splits.dataset_split` (as the
    tasks cut it), so ``largest_partition(n)`` is its largest partition for
    ``n`` clients; the train ConfigRecord is :func:`base_train_config`; the
    description reads ``"<model> on <dataset><model_note>, <k> held-out
    examples, device <device><note>"``.

    Parameters
    ----------
    config : RunConfig
    strategy, initial_arrays, evaluate, columns
        As in :class:`ServerPlan`.
    heldout_examples : int
        Size of the server's evaluation set (for the description).
    device : torch.device
        Where ``evaluate`` runs (for the description).
    lr : float, optional
        See :func:`base_train_config`.
    model_note, note : str
        Description text after the data set's name and at the end.
    """
    return ServerPlan(
        strategy=strategy,
        initial_arrays=initial_arrays,
        evaluate=evaluate,
        train_config=base_train_config(config, lr),
        largest_partition=lambda n: dataset_split(config, n).largest_partition,
        columns=columns,
        description=(
            f"{config.model} on {config.dataset}{model_note}, {heldout_examples} "
            f"held-out examples, device {device}{note}"
        ),
    )


PlanBuilder = Callable[[MethodConfig], ServerPlan]
"""``plan(method_config) -> ServerPlan``: the server side of one payload kind."""

_PLANS: dict[str, PlanBuilder] = {}


def register_plan(payload: str) -> Callable[[PlanBuilder], PlanBuilder]:
    """Function decorator registering the server plan of payload kind ``payload``.

    The function is returned unchanged.

    Raises
    ------
    ValueError
        If the kind already has a plan.
    """

    def decorator(builder: PlanBuilder) -> PlanBuilder:
        if payload in _PLANS:
            raise ValueError(
                f"payload kind '{payload}' already has a server plan, "
                f"{_PLANS[payload].__qualname__}"
            )
        _PLANS[payload] = builder
        return builder

    return decorator


def plan_builder(payload: str) -> PlanBuilder:
    """The server plan registered so far for payload kind ``payload``
    (:mod:`fedlr.server_apps.builtin_plans` registers fedlr's own first).

    Raises
    ------
    LookupError
        If no plan is registered for the kind.
    """
    if payload not in _PLANS:
        raise LookupError(
            f"no server plan is registered for payload kind '{payload}'; "
            f"registered: {', '.join(sorted(_PLANS))}"
        )
    return _PLANS[payload]
