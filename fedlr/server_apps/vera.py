"""Server plans of the ``vera`` and ``sorf-vera`` client kinds.

Both build the text classifier with the method's adapters (the same builder the
clients use, so the frozen projections agree), the strategy, and a held-out
evaluation of the global model after every round. Clients train with
``vera-lr`` (VeRA's scaling vectors need a larger step than LoRA's factors).
SORF-VeRA adds the refit residuals ``b-residual`` and ``d-residual`` to
``results.csv``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedlr.adapters.vera import VeraModel
from fedlr.client.train import pick_device
from fedlr.config.run import RunConfig
from fedlr.server_apps.plans import (
    ServerPlan,
    check_strategy,
    heldout_plan,
    register_plan,
)
from fedlr.strategies.registry import MethodConfig
from fedlr.strategies.sorf_vera import SorfVeRA
from fedlr.strategies.vera import VeraStrategy
from fedlr.tasks.text import text_task
from fedlr.tasks.vera import (
    SorfVeraOptions,
    VeraOptions,
    build_sorf_vera_text_model,
    build_vera_text_model,
)

__all__ = ["sorf_vera_plan", "vera_plan"]

SORF_COLUMNS = ("b-residual", "d-residual")


def _plan(
    config: RunConfig,
    vm: VeraModel,
    strategy: VeraStrategy | SorfVeRA,
    columns: tuple[str, ...],
    lr: float,
) -> ServerPlan:
    task = text_task(config)
    heldout = task.heldout()
    device = pick_device(config.device)
    initial = vm.state(strategy.send_roles)

    def evaluate_global(
        server_round: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, float]:
        vm.load(state)
        result = task.evaluate(vm.model, heldout, device)
        vm.model.to("cpu")
        return result

    return heldout_plan(
        config,
        strategy=strategy,
        initial_arrays=initial,
        evaluate=evaluate_global,
        heldout_examples=len(heldout),
        device=device,
        columns=(*task.metric_columns, *columns),
        lr=lr,
        note=(
            f", rank {strategy.projection_rank}, "
            f"projection seed {strategy.projection_seed}"
        ),
    )


@register_plan("vera")
def vera_plan(method: MethodConfig) -> ServerPlan:
    """Seeded VeRA classifier, its strategy and held-out evaluation."""
    strategy_cls = check_strategy(method.spec, VeraStrategy)
    options = VeraOptions.of(method.options)
    vm = build_vera_text_model(method.run, options)
    strategy = strategy_cls.from_run_config(method.run, vm, options)
    columns = tuple(strategy.extra_columns)
    return _plan(method.run, vm, strategy, columns, options.vera_lr)


@register_plan("sorf-vera")
def sorf_vera_plan(method: MethodConfig) -> ServerPlan:
    """Seeded SORF-VeRA classifier, its strategy and held-out evaluation."""
    strategy_cls = check_strategy(method.spec, SorfVeRA)
    options = SorfVeraOptions.of(method.options)
    vm = build_sorf_vera_text_model(method.run, options)
    strategy = strategy_cls.from_run_config(method.run, vm, options)
    return _plan(method.run, vm, strategy, SORF_COLUMNS, options.vera_lr)
