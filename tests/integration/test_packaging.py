"""The built wheel: one top-level import package, no clash with a user's own.

A Flower project often has top-level ``strategies/`` or ``client_apps/``
packages of its own. fedlr installs ``fedlr`` only, so such a project beside
an installed fedlr imports both without either shadowing the other.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # build from a copy of the project's files: a build/ folder left in the
    # checkout by an earlier build would put stale modules in the wheel
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("fedlr-*.whl")
    return path


def test_wheel_has_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"fedlr"}, top
    assert "fedlr/strategies/fedex_lora.py" in names
    assert "fedlr/client_apps/lora.py" in names
    assert "fedlr/server_apps/runner.py" in names


def test_user_strategies_package_beside_installed_fedlr(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    user = tmp_path / "user_app"
    (user / "strategies").mkdir(parents=True)
    (user / "strategies" / "__init__.py").write_text("MINE = True\n")
    (user / "client_apps").mkdir()
    (user / "client_apps" / "__init__.py").write_text("MINE = True\n")
    code = (
        "import fedlr, strategies, client_apps\n"
        "print(fedlr.__file__)\n"
        "print(fedlr.FedExLoRA.__module__)\n"
        "print(strategies.MINE, client_apps.MINE)\n"
        "print('fedex-lora' in fedlr.available_methods())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=user,
        env={"PYTHONPATH": f"{user}:{site}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    lines = out.stdout.split("\n")
    assert lines[0] == str(site / "fedlr" / "__init__.py")
    assert lines[1] == "fedlr.strategies.fedex_lora"
    assert lines[2] == "True True"
    assert lines[3] == "True"
