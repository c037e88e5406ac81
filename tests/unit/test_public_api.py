"""The public surface: one import place for plug-in users, flwr-free kernels."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_strategies_are_reexported_from_fedlr():
    import fedlr
    from fedlr import strategies

    assert fedlr.FedExLoRA is strategies.FedExLoRA
    assert fedlr.FedAvgLoRA is strategies.FedAvgLoRA
    assert "fedex-lora" in fedlr.available_methods()
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = fedlr.Nope


@pytest.mark.parametrize(
    "module",
    [
        "fedlr",
        "fedlr.linalg",
        "fedlr.adapters",
        "fedlr.config.run",
        "fedlr.runs.results",
    ],
)
def test_library_modules_do_not_import_flwr(module):
    code = f"import sys, {module}; print('flwr' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
