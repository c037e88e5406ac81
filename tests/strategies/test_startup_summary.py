"""The strategy's start-up settings name the clip's reference as the
start-up line does (``robust = auto``: norm-clip at the norm of the server's
own update, not at the median)."""

from __future__ import annotations

import pytest

from fedlr.robust.rules import RobustConfig
from fedlr.round.describe import settings
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from tests.plugin_app.task import build_model


@pytest.mark.parametrize(
    ("reference", "ratio", "shown"),
    [
        ("server", 1.0, "server update"),
        ("server", 2.0, "2 x server update"),
        ("median", 1.0, "median"),
        ("median", 1.5, "1.5 x median"),
    ],
)
def test_norm_clip_names_its_reference(reference, ratio, shown):
    robust = RobustConfig(rule="norm-clip", clip_reference=reference, clip_ratio=ratio)
    strategy = FedAvgLoRA.for_model(build_model("fedavg-lora"), robust=robust)
    assert settings(strategy)["clip_norm"] == shown
    fixed = RobustConfig(rule="norm-clip", clip_norm=3.0, clip_reference=reference)
    strategy = FedAvgLoRA.for_model(build_model("fedavg-lora"), robust=fixed)
    assert settings(strategy)["clip_norm"] == 3.0
