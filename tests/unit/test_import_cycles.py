"""No import cycles between the modules of fedlr, counting every import.

Imports inside functions and under ``TYPE_CHECKING`` count too: they hide a
cycle from Python's import machinery, not from the reader. The layering this
keeps: the run config, the robust step and the payload kinds import neither
the strategies nor the server apps; a payload kind's server plan is found by
the kind's name (:mod:`fedlr.server_apps.plans`), the methods' run-config keys
through :mod:`fedlr.method_options`.

The graph is built as the repository's ``import_cycles.py`` tool builds it
(kept here so that a clean clone runs it): a module's edges are the fedlr
modules it names in any ``import``/``from ... import`` (relative ones
resolved; ``from pkg import mod`` names ``pkg.mod``), each cut to the longest
module it starts with; a package's ``__init__`` is left out of the graph (it
re-exports), and so is a module's import of its own submodules.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from fedlr.payloads import PAYLOADS
from fedlr.server_apps import gpse, lora, qrmix, vera
from fedlr.server_apps.plans import plan_builder, register_plan
from tests.conftest import ROOT

Graph = dict[str, set[str]]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(module: str, is_package: bool, node: ast.AST) -> list[str]:
    """The dotted names an import statement refers to (modules or attributes)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
    return []


def import_graph(root: Path) -> Graph:
    """Module -> the package's modules it imports, package ``__init__``s left out."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    edges: Graph = {}
    for module, path in files.items():
        if module in packages:
            continue
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in imported_names(module, is_package, node):
                while name and name not in files:  # the longest module it names
                    name = name.rpartition(".")[0]
                if (
                    name
                    and name != module
                    and not name.startswith(module + ".")
                    and name not in packages
                ):
                    targets.add(name)
        edges[module] = targets
    return edges


def cycles(edges: Graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def describe(edges: Graph, found: list[list[str]]) -> str:
    lines = []
    for group in found:
        lines.append(f"cycle of {len(group)} modules:")
        for m in group:
            inside = sorted(w for w in edges[m] if w in group)
            lines.append(f"  {m} -> {', '.join(inside)}")
    return "\n".join(lines)


def test_fedlr_has_no_import_cycles() -> None:
    edges = import_graph(ROOT / "fedlr")
    found = cycles(edges)
    report = describe(edges, found)
    if found:
        print(report)
    assert not found, f"{len(found)} import cycles in fedlr:\n{report}"


def test_lower_layers_import_no_strategies_or_server_apps() -> None:
    edges = import_graph(ROOT / "fedlr")
    for low in ("fedlr.config", "fedlr.robust", "fedlr.payloads", "fedlr.options"):
        upward = sorted(
            m
            for m in edges[low]
            if m.startswith(("fedlr.strategies.", "fedlr.server_apps."))
        )
        assert not upward, f"{low} imports {upward}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


def test_the_counter_sees_hidden_imports(tmp_path: Path) -> None:
    """Function-level, TYPE_CHECKING, relative and ``from pkg import mod``
    imports all count; a package ``__init__`` importing its modules does not."""
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a, b, c, sub\n",
            "pkg/a.py": "def f():\n    from pkg.sub import d\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from . import a\n",
            "pkg/c.py": "import os\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/d.py": "from .. import b\nfrom ..c import thing\n",
        },
    )
    edges = import_graph(root)
    assert edges == {
        "pkg.a": {"pkg.sub.d"},
        "pkg.b": {"pkg.a"},
        "pkg.c": set(),
        "pkg.sub.d": {"pkg.b", "pkg.c"},
    }
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.sub.d"]]
    assert "pkg.sub.d -> pkg.b" in describe(edges, cycles(edges))


def test_the_counter_finds_nothing_in_a_layered_package(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.top import main\n",
            "pkg/low.py": "X = 1\n",
            "pkg/top.py": "from pkg.low import X\n\ndef main():\n    import pkg.low\n",
        },
    )
    assert cycles(import_graph(root)) == []


def test_every_payload_kind_has_its_server_plan_by_name() -> None:
    """The plans register under their kind's name; no payload kind names one."""
    expected = {
        "lora": lora.lora_plan,
        "vera": vera.vera_plan,
        "sorf-vera": vera.sorf_vera_plan,
        "qrmix": qrmix.qrmix_plan,
        "gpse": gpse.gpse_plan,
    }
    assert {p.name: plan_builder(p.name) for p in PAYLOADS} == expected
    with pytest.raises(LookupError, match=r"no server plan .* 'nope'; registered: "):
        plan_builder("nope")
    with pytest.raises(ValueError, match="'lora' already has a server plan"):
        register_plan("lora")(lora.lora_plan)
