"""The plug-in app's own model and data: an MLP with peft LoRA, synthetic data."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build_model(seed: int = 0) -> PeftModel:
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["fc1", "fc2"], modules_to_save=["head"]
    )
    return get_peft_model(MLP(), config)


def load_data(partition: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Two Gaussian classes; each partition sees its own shift of the inputs."""
    g = torch.Generator().manual_seed(100 + partition)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 1.5 * (2 * y[:, None] - 1)
    x[:, partition % 8] += 1.0
    return x, y


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
