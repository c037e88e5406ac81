"""One malicious client among five honest ones, under the real ``flwr run``.

The app is fedlr's ServerApp with the malicious ClientApp of
``tests/adversarial/malicious_app.py`` (copied, with ``payloads.py``, into an
app directory outside the repository): partition 0 boosts its update 50x and
claims 10**15 examples. The default server drops its replies
(``max-num-examples``: the largest partition) and the run ends with the global
arrays of the same federation run in process with partition 0's replies lost.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.conftest import ROOT
from tests.integration.test_plugin_flwr_run import flwr_home  # noqa: F401 (fixture)
from tests.strategies.test_every_method import ASSETS, CASES, run_config

pytestmark = pytest.mark.slow

NODES = 6  # five honest, one attacker
ATTACK = "boosted-50x-claiming-1e15"
_CONFIG_TABLE = re.compile(r"\[tool\.flwr\.app\.config\]\n(.*?)(?:\n\[|\Z)", re.DOTALL)


def _app_dir(root: Path) -> Path:
    """fedlr's ServerApp and the malicious ClientApp as a user's own app."""
    package = root / "attacker"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(ROOT / "tests" / "adversarial" / "payloads.py", package / "payloads.py")
    source = (ROOT / "tests" / "adversarial" / "malicious_app.py").read_text()
    source = re.sub(r'(?m)^ATTACK = ".*"$', f'ATTACK = "{ATTACK}"', source)
    (package / "client_app.py").write_text(source)
    (table,) = _CONFIG_TABLE.findall((ROOT / "pyproject.toml").read_text())
    (root / "pyproject.toml").write_text(
        "[build-system]\n"
        'requires = ["hatchling"]\n'
        'build-backend = "hatchling.build"\n\n'
        "[project]\n"
        'name = "attacker"\n'
        'version = "1.0.0"\n'
        "dependencies = []\n\n"
        "[tool.flwr.app]\n"
        'publisher = "fedlr-tests"\n\n'
        "[tool.flwr.app.components]\n"
        'serverapp = "fedlr.server_apps.app:app"\n'
        'clientapp = "attacker.client_app:app"\n\n'
        "[tool.flwr.app.config]\n" + table
    )
    return root


def _config(method: str, out: Path) -> dict:
    from fedlr.data.assets import ensure_assets

    case = CASES[method]
    ensure_assets(ASSETS[case.family], quiet=True)
    config = run_config(case, out)
    if "num-server-rounds" not in case.overrides:
        config["num-server-rounds"] = 2
    config["num-partitions"] = NODES
    if case.family != "text":
        # six clients hold fewer examples each than the three of CASES: a
        # smaller step keeps the honest clients' SGD finite
        config["lr"] = 0.02
    return config


def _lose_partition_0(partition, instruction, reply):
    return None if partition == 0 else reply


@pytest.mark.parametrize("method", ["fedex-lora", "fedspec", "fot", "qrmix"])
def test_one_malicious_client_among_five(method, tmp_path, flwr_home):  # noqa: F811
    from fedlr.launch.flwr_run import flwr_run
    from fedlr.launch.local import run_in_process

    app = _app_dir(tmp_path / "app")
    assert ROOT.resolve() not in app.resolve().parents
    config = _config(method, tmp_path / "out")
    outcome = flwr_run(
        app,
        flwr_home=flwr_home,
        run_config={k: v for k, v in config.items() if k != "num-partitions"},
        federation_config={"num-supernodes": NODES},
        timeout=600,
    )
    assert outcome.status == "finished:completed"
    assert "exceeds max-num-examples" in outcome.output
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    frame = pd.read_csv(run_dir / "results.csv")
    assert (frame["dropped"] == 1).all() and (frame["clients"] == NODES - 1).all()
    assert (frame["rejected-rounds"] == 0).all()
    got = torch.load(run_dir / "final_arrays.pt", weights_only=True)

    reference = run_in_process(
        _config(method, tmp_path / "ref"), reply_hook=_lose_partition_0
    )
    want = torch.load(reference / "final_arrays.pt", weights_only=True)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-6), key
