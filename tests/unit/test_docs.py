"""Docs that cannot drift: commands, lists and tables checked against the code."""

from __future__ import annotations

import re
import subprocess
import sys

from fedlr.runs.results import COLUMNS
from tests.conftest import ROOT

_PY = re.compile(r"```python\n(.*?)```", flags=re.DOTALL)


def _page(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def _recipe(target: str) -> str:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{target}:.*\n\t(.+)$", makefile, flags=re.MULTILINE)
    assert match, target
    return match.group(1).replace("$(PY) -m ", "")


def test_quickstart_names_the_makefiles_lint_and_type_commands():
    text = " ".join(_page("quickstart.md").split())
    for target in ("lint", "typecheck"):
        assert f"`{_recipe(target)}` (`make {target}`)" in text, target


def test_data_page_first_snippet_runs_and_prints_what_it_says(assets):
    block = _PY.findall(_page("data.md"))[0]
    printed = re.search(r"^# (\(.*\))$", block, flags=re.MULTILINE)
    assert printed, "the snippet shows what available_datasets() prints"
    result = subprocess.run(
        [sys.executable, "-c", block],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == printed.group(1)


def test_quickstart_documents_every_results_column_in_order():
    text = _page("quickstart.md")
    section = text[text.index("`results.csv` columns") :]
    table = section[: section.index("\n\n", section.index("| column"))]
    documented: list[str] = []
    for line in table.splitlines()[2:]:
        cell = line.split("|")[1]
        documented += re.findall(r"`([a-z0-9-]+)`", cell)
    assert documented == list(COLUMNS)
