"""The plug-in app, copied out of the repository, under the real `flwr run`.

The app is tests/plugin_app/ with the ``pyproject.toml`` that docs/plugin.md
shows (read from the page, so the page is what runs). It is copied into a
temporary directory outside the repository: only what a user's own project
would have. Each run uses Flower's local simulation (Ray) with three
SuperNodes; the ServerApp writes its per-round metrics to ``result-file``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import local_superlink_home

pytestmark = pytest.mark.slow

APP_FILES = ("__init__.py", "task.py", "client_app.py", "server_app.py")
NODES = 3
_PYPROJECT = re.compile(
    r"<!-- app-file: pyproject.toml -->\n```toml\n(.*?)```", flags=re.DOTALL
)


@pytest.fixture(scope="module")
def flwr_home(tmp_path_factory):
    """One FLWR_HOME (and SuperLink) for the module's `flwr run` tests."""
    with local_superlink_home(tmp_path_factory.mktemp("flwr-home")) as home:
        yield home


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory) -> Path:
    """The plug-in app as a user's own project, outside the repository."""
    text = (ROOT / "docs" / "plugin.md").read_text(encoding="utf-8")
    (pyproject,) = _PYPROJECT.findall(text)
    root = tmp_path_factory.mktemp("my-app")
    assert ROOT.resolve() not in root.resolve().parents
    package = root / "plugin_app"
    package.mkdir()
    for name in APP_FILES:
        shutil.copy(ROOT / "tests" / "plugin_app" / name, package / name)
    (root / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    return root


def _run(app_dir: Path, flwr_home: Path, tmp_path: Path, method: str, **config):
    from fedlr.launch.flwr_run import flwr_run

    result_file = tmp_path / f"{method}.json"
    run_config = {
        "method": method,
        "num-server-rounds": 2,
        "local-steps": 5,
        "min-nodes": NODES,
        "result-file": str(result_file),
        **config,
    }
    outcome = flwr_run(
        app_dir,
        flwr_home=flwr_home,
        run_config=run_config,
        federation_config={"num-supernodes": NODES},
        timeout=300,
    )
    assert outcome.status == "finished:completed"
    assert "dropped a reply" not in outcome.output
    return json.loads(result_file.read_text(encoding="utf-8"))


def _check_sane(result: dict) -> None:
    train = result["train"]
    assert sorted(train) == ["1", "2"]
    for metrics in train.values():
        assert metrics["clients"] == NODES and metrics["dropped"] == 0
        assert metrics["num-examples"] == NODES * 128
        assert math.isfinite(metrics["train-loss"]) and metrics["train-loss"] > 0
        assert math.isfinite(metrics["frobenius-gap"])
    server = result["evaluate-server"]
    assert sorted(server) == ["0", "1", "2"]
    for metrics in server.values():
        assert 0.0 <= metrics["accuracy"] <= 1.0
        assert math.isfinite(metrics["loss"]) and metrics["loss"] > 0


def test_fedsvd_under_flwr_run(app_dir, flwr_home, tmp_path):
    result = _run(app_dir, flwr_home, tmp_path, "fedsvd")
    _check_sane(result)
    assert all(m["rank"] == 4 for m in result["train"].values())
    # FedSVD's aggregate is exact (the clients share A): the gap is rounding.
    assert all(m["relative-gap"] < 1e-4 for m in result["train"].values())


def test_fedspec_rank_growth_under_flwr_run(app_dir, flwr_home, tmp_path):
    result = _run(
        app_dir,
        flwr_home,
        tmp_path,
        "fedspec",
        **{"fedspec-threshold": 0.0, "fedspec-max-rank": 6},
    )
    _check_sane(result)
    # Round 1 grows the rank 4 -> 6; round 2's clients rebuilt at rank 6 (a
    # reply at another rank would have been dropped).
    assert [result["train"][r]["rank"] for r in ("1", "2")] == [6, 6]


def test_sorf_vera_under_flwr_run(app_dir, flwr_home, tmp_path):
    result = _run(app_dir, flwr_home, tmp_path, "sorf-vera")
    _check_sane(result)
    for metrics in result["train"].values():
        assert 0.0 <= metrics["b-residual"] < 1.0
        assert 0.0 <= metrics["d-residual"] < 1.0


@pytest.mark.parametrize(
    ("method", "column"),
    [("fedavgm-lora", "momentum-norm"), ("scaffold-lora", "control-norm")],
)
def test_server_state_methods_under_flwr_run(
    app_dir, flwr_home, tmp_path, method, column
):
    """The worked examples of docs/architecture.md through the plug-in app:
    server momentum (server only) and SCAFFOLD (extra records both ways and
    the gradient hook in the user's loop)."""
    result = _run(app_dir, flwr_home, tmp_path, method)
    _check_sane(result)
    norms = [result["train"][r][column] for r in ("1", "2")]
    assert all(math.isfinite(n) and n > 0 for n in norms)
