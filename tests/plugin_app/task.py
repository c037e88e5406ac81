"""The plug-in app's own model and data: a small MLP, synthetic data.

One app serves every LoRA- and VeRA-family method: the run config's
``method`` picks the adapter (peft LoRA, peft VeRA or fedlr's SORF-VeRA).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.serverapp.strategy import Result
from peft import LoraConfig, VeraConfig, get_peft_model

from fedlr import SorfVeraSettings, build_sorf_vera_model, get_method
from fedlr.adapters import AdaptedModel


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.classifier = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build_model(method: str, seed: int = 0):
    """The same seeded model on every node and on the server."""
    torch.manual_seed(seed)
    family = get_method(method).payload.name
    if family == "lora":
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["fc1", "fc2"],
            modules_to_save=["classifier"],
        )
        return get_peft_model(MLP(), config)
    if family == "vera":
        config = VeraConfig(
            r=8,
            target_modules=["fc1", "fc2"],
            projection_prng_key=seed,
            save_projection=True,
            modules_to_save=["classifier"],
        )
        return get_peft_model(MLP(), config)
    if family == "sorf-vera":  # head: the module called "classifier"
        settings = SorfVeraSettings(
            rank=4, projection_seed=seed, target_modules=("fc1", "fc2")
        )
        return build_sorf_vera_model(MLP(), settings)
    raise ValueError(f"'{method}' is not a LoRA- or VeRA-family method")


def load_data(
    partition: int | None, split: str = "train", n: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two Gaussian classes; each partition sees its own shift of the inputs.

    ``partition=None`` is the server's held-out set (no shift).
    """
    offset = 50 if partition is None else partition
    g = torch.Generator().manual_seed(100 + offset + (0 if split == "train" else 1000))
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 1.5 * (2 * y[:, None] - 1)
    if partition is not None:
        x[:, partition % 8] += 1.0
    return x, y


@torch.no_grad()
def score(model, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Accuracy and cross-entropy (``model``: a torch module or SORF-VeRA's)."""
    net = model.model if isinstance(model, AdaptedModel) else model
    logits = net(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return float((logits.argmax(1) == y).float().mean()), float(loss)


def save_result(result: Result, path: str) -> None:
    """Write the run's metrics per round as JSON (when ``path`` is set)."""
    if not path:
        return
    rounds = {
        "train": result.train_metrics_clientapp,
        "evaluate-clients": result.evaluate_metrics_clientapp,
        "evaluate-server": result.evaluate_metrics_serverapp,
    }
    data = {
        name: {str(r): dict(m) for r, m in metrics.items()}
        for name, metrics in rounds.items()
    }
    Path(path).write_text(json.dumps(data), encoding="utf-8")
