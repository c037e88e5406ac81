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
from fedlr.config import RunConfig
from fedlr.server_apps.plans import ServerPlan, register_plan
from fedlr.strategies.registry import MethodSpec
from fedlr.strategies.sorf_vera import SorfVeRA
from fedlr.strategies.vera import VeraStrategy
from fedlr.tasks import TextTask
from fedlr.train import evaluate, pick_device
from fedlr.vera_tasks import build_sorf_vera_text_model, build_vera_text_model

__all__ = ["sorf_vera_plan", "vera_plan"]

SORF_COLUMNS = ("b-residual", "d-residual")


def _plan(
    config: RunConfig,
    vm: VeraModel,
    strategy: VeraStrategy | SorfVeRA,
    columns: tuple[str, ...],
) -> ServerPlan:
    task = TextTask(config)
    heldout = task.heldout()
    device = pick_device(config.device)
    initial = vm.state(strategy.send_roles)

    def evaluate_global(
        server_round: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, float]:
        vm.load(state)
        accuracy, loss = evaluate(
            vm.model, heldout, batch_size=config.eval_batch_size, device=device
        )
        vm.model.to("cpu")
        return {"accuracy": accuracy, "loss": loss}

    return ServerPlan(
        strategy=strategy,
        initial_arrays=initial,
        evaluate=evaluate_global,
        train_config={
            "lr": config.vera_lr,
            "local-steps": config.local_steps,
            "batch-size": config.batch_size,
        },
        columns=columns,
        description=(
            f"{config.model} on {config.dataset}, {len(heldout)} held-out "
            f"examples, device {device}, rank {strategy.projection_rank}, "
            f"projection seed {strategy.projection_seed}"
        ),
    )


def _wrong_kind(spec: MethodSpec, cls: type, kind: str) -> TypeError:
    return TypeError(
        f"method '{spec.name}' has client kind '{kind}' but its strategy "
        f"{spec.strategy_cls.__qualname__} is not a {cls.__name__}"
    )


@register_plan("vera")
def vera_plan(config: RunConfig, spec: MethodSpec) -> ServerPlan:
    """Seeded VeRA classifier, its strategy and held-out evaluation."""
    if not issubclass(spec.strategy_cls, VeraStrategy):
        raise _wrong_kind(spec, VeraStrategy, "vera")
    vm = build_vera_text_model(config)
    strategy = spec.strategy_cls.from_run_config(config, vm)
    return _plan(config, vm, strategy, ())


@register_plan("sorf-vera")
def sorf_vera_plan(config: RunConfig, spec: MethodSpec) -> ServerPlan:
    """Seeded SORF-VeRA classifier, its strategy and held-out evaluation."""
    if not issubclass(spec.strategy_cls, SorfVeRA):
        raise _wrong_kind(spec, SorfVeRA, "sorf-vera")
    vm = build_sorf_vera_text_model(config)
    strategy = spec.strategy_cls.from_run_config(config, vm)
    return _plan(config, vm, strategy, SORF_COLUMNS)
