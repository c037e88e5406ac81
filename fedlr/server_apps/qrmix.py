"""Server plan of the ``qrmix`` client kind: a vision model trained by local SGD.

Serves ``fedavg`` and ``qrmix``. The global model is evaluated on the server's
held-out split after every round; ``results.csv`` gains the strategy's
columns (``stage``, ``head-step``, ``fedavg-head-step``, ``top-eigenvalue``).
With ``qrmix-warmup-checkpoint`` set, the run starts from those weights (the
``final_arrays.pt`` of an earlier run of the same model and data).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from fedlr.client.train import pick_device
from fedlr.errors import ConfigError, ShapeMismatchError
from fedlr.server_apps.plans import (
    ServerPlan,
    check_strategy,
    heldout_plan,
    register_plan,
)
from fedlr.strategies.qrmix import VisionFedAvg
from fedlr.strategies.registry import MethodConfig
from fedlr.tasks.image import ImageTask, evaluate_images

__all__ = ["load_warmup_checkpoint", "qrmix_plan"]


def load_warmup_checkpoint(
    path: str, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Load a ``final_arrays.pt`` whose keys and shapes match the model.

    Raises
    ------
    ConfigError
        ``qrmix-warmup-checkpoint``: the file is missing, unreadable, or holds
        other keys or shapes than the model's parameters.
    """
    key = "qrmix-warmup-checkpoint"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(key, f"no file at '{file}'")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise ConfigError(key, f"cannot read '{file}': {exc}") from exc
    if not isinstance(state, dict) or set(state) != set(shapes):
        got = sorted(state)[:3] if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            key,
            f"'{file}' does not hold this model's parameters (got {got}, "
            f"expected e.g. {sorted(shapes)[:3]})",
        )
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ConfigError(
                key,
                f"'{name}' has shape {tuple(state[name].shape)} in '{file}', the "
                f"model {tuple(shape)}",
            )
    return {k: v.detach().to(torch.float32) for k, v in state.items()}


@register_plan("qrmix")
def qrmix_plan(method: MethodConfig) -> ServerPlan:
    """Seeded vision model, its strategy and held-out evaluation."""
    config = method.run
    strategy_cls = check_strategy(method.spec, VisionFedAvg)
    task = ImageTask(config)
    model = task.build_model()
    shapes = model.parameter_shapes()
    strategy = strategy_cls.from_run_config(
        config, shapes=shapes, head=model.head, options=method.options
    )
    initial = model.parameter_state()
    if strategy.warmup_checkpoint:
        initial = load_warmup_checkpoint(strategy.warmup_checkpoint, shapes)
    heldout = task.heldout()
    device = pick_device(config.device)
    size = sum(t.numel() for t in initial.values())

    def evaluate_global(
        server_round: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, float]:
        try:
            model.load_parameters(state)
        except ShapeMismatchError as exc:  # pragma: no cover - strategy bug
            raise RuntimeError(f"round {server_round}: {exc}") from exc
        accuracy, loss = evaluate_images(
            model, heldout, batch_size=config.eval_batch_size, device=device
        )
        model.to("cpu")
        return {"accuracy": accuracy, "loss": loss}

    return heldout_plan(
        config,
        strategy=strategy,
        initial_arrays=initial,
        evaluate=evaluate_global,
        heldout_examples=len(heldout),
        device=device,
        columns=strategy.columns,
        model_note=f" ({size} parameters)",
    )
