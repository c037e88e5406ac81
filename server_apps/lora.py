"""Server plan of the ``lora`` client kind: text classifier with LoRA.

The global model is evaluated on the server's held-out split after every round.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedlr.adapters import adapter_state
from fedlr.config import RunConfig
from fedlr.tasks import TextTask
from fedlr.train import evaluate, pick_device
from server_apps.plans import ServerPlan, register_plan
from strategies.lora import LoraStrategy
from strategies.registry import MethodSpec

__all__ = ["lora_plan"]


@register_plan("lora")
def lora_plan(config: RunConfig, spec: MethodSpec) -> ServerPlan:
    """Seeded LoRA classifier, its strategy and held-out evaluation."""
    if not issubclass(spec.strategy_cls, LoraStrategy):
        raise TypeError(
            f"method '{spec.name}' has client kind 'lora' but its strategy "
            f"{spec.strategy_cls.__qualname__} is not a LoraStrategy"
        )
    task = TextTask(config)
    lm = task.build_lora_model()
    strategy = spec.strategy_cls.from_run_config(config, lm.layout)
    initial = adapter_state(lm.model, lm.layout, strategy.send_roles)
    heldout = task.heldout()
    device = pick_device(config.device)

    def evaluate_global(
        server_round: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, float]:
        lm.load(state)
        accuracy, loss = evaluate(
            lm.model, heldout, batch_size=config.eval_batch_size, device=device
        )
        lm.model.to("cpu")
        return {"accuracy": accuracy, "loss": loss}

    return ServerPlan(
        strategy=strategy,
        initial_arrays=initial,
        evaluate=evaluate_global,
        train_config={
            "lr": config.lr,
            "local-steps": config.local_steps,
            "batch-size": config.batch_size,
        },
        description=(
            f"{config.model} on {config.dataset}, {len(heldout)} held-out "
            f"examples, device {device}"
        ),
    )
