"""The run-config listings are generated from the option declarations.

``pyproject.toml``'s ``[tool.flwr.app.config]`` and the key tables of
``docs/configuration.md`` must be what ``python -m fedlr.configdoc write``
renders; a declaration changed without rerunning it fails here with the diff.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest

from fedlr.config.run import RunConfig
from fedlr.configdoc import generate as configdoc
from fedlr.options import option
from fedlr.strategies.registry import option_defaults, registered_methods
from tests.conftest import ROOT


def test_committed_files_are_generated_from_the_declarations():
    stale = configdoc.outdated(ROOT)
    diffs = "".join(item.diff for item in stale)
    assert not stale, f"{diffs}\nrun `{configdoc.COMMAND}`"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    for name in (
        "pyproject.toml",
        "docs/configuration.md",
        "README.md",
        "docs/reliability.md",  # the features' rows (configdoc.features)
        "docs/privacy.md",
        "docs/plugin.md",  # what each method needs from the client
    ):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_check_shows_the_diff_and_write_restores_the_files(copy, capsys):
    pyproject = copy / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace("lora-rank = 8", "lora-rank = 4")
    )
    docs = copy / "docs" / "configuration.md"
    docs.write_text(docs.read_text().replace("| `lr` | float |", "| `lr` | int |"))
    assert configdoc.main(["check", "--root", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "-lora-rank = 4\n+lora-rank = 8" in out
    assert "-| `lr` | int |" in out and "docs/configuration.md (generated)" in out
    assert configdoc.main(["write", "--root", str(copy)]) == 0
    assert pyproject.read_text() == (ROOT / "pyproject.toml").read_text()
    assert configdoc.main(["check", "--root", str(copy)]) == 0


def test_only_the_generated_parts_are_rewritten(copy):
    docs = copy / "docs" / "configuration.md"
    edited = docs.read_text().replace("## Validation", "## Validation (edited)")
    docs.write_text(edited)
    pyproject = copy / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace("line-length = 88", "line-length = 90")
    )
    assert configdoc.outdated(copy) == []
    docs.write_text(edited.replace(configdoc.BEGIN, ""))
    with pytest.raises(ValueError, match="needs one"):
        configdoc.outdated(copy)


def test_the_table_holds_every_key_with_its_default():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    table = data["tool"]["flwr"]["app"]["config"]
    assert RunConfig.from_mapping(table) == RunConfig()
    assert table == {**RunConfig().to_mapping(), **option_defaults()}


def test_the_method_row_lists_every_registered_method():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    (row,) = [line for line in doc.splitlines() if line.startswith("| `method` |")]
    listed = re.findall(r"`([a-z0-9-]+)`", row.split("registered:")[1])
    assert listed == [spec.name for spec in registered_methods()]


def test_every_key_has_one_line_of_help():
    for key in [*configdoc.common_keys(), *configdoc.method_keys()]:
        assert key.help.strip(), f"'{key.name}' has no help text"
        assert key.type in ("int", "float", "str", "bool"), (key.name, key.type)
    with pytest.raises(ValueError, match="one line"):
        option(1, "two\nlines")


def test_the_readme_lists_every_registered_method_and_each_has_its_page():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Methods", 1)[1].split("\n## ", 1)[0]
    missing = [s.name for s in registered_methods() if f"`{s.name}`" not in section]
    assert not missing, f"README.md's Methods table lacks {missing}"
    pages = [s.name for s in registered_methods()]
    absent = [n for n in pages if not (ROOT / "docs" / "methods" / f"{n}.md").is_file()]
    assert not absent, f"methods without a docs/methods/<name>.md page: {absent}"


def test_every_plugin_method_declares_what_it_needs_from_the_client() -> None:
    """A method of a plug-in payload kind (the LoRA and VeRA families) has its
    row in docs/plugin.md's table; the vision and continual kinds have none."""
    specs = registered_methods()
    lacking = [s.name for s in specs if s.payload.plugin and s.client_contract is None]
    assert not lacking, (
        f"methods without client_contract=ClientContract(...): {lacking}"
    )
    stray = [s.name for s in specs if not s.payload.plugin and s.client_contract]
    assert not stray, f"methods of non-plug-in kinds with a client contract: {stray}"
    assert {s.payload.name for s in specs if s.payload.plugin} >= {"lora", "vera"}
    doc = (ROOT / "docs" / "plugin.md").read_text()
    table = doc.split(configdoc.PLUGIN_BEGIN)[1].split(configdoc.END)[0]
    named = re.findall(r"^\| `([a-z0-9-]+)`", table, flags=re.MULTILINE)
    expected = [
        s.name
        for s in specs
        if s.client_contract is not None
        for _ in range(1 + len(s.client_contract.variants))
    ]
    assert named == expected
    assert "| `hetlora` with pruning | as above, plus `prune-gamma`" in table


def test_a_stale_plugin_table_fails_the_check(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plugin = copy / "docs" / "plugin.md"
    plugin.write_text(
        plugin.read_text().replace(
            "| `fedavg-lora` | `A`, `B`, head | load; train all three |\n", ""
        )
    )
    assert configdoc.main(["check", "--root", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "+| `fedavg-lora` | `A`, `B`, head | load; train all three |" in out
    assert "docs/plugin.md (generated)" in out
    assert configdoc.main(["write", "--root", str(copy)]) == 0
    assert plugin.read_text() == (ROOT / "docs" / "plugin.md").read_text()
