"""No import cycles between the modules of fedlr, none between its folders,
and no import runs up a floor.

Every import counts: imports inside functions and under ``TYPE_CHECKING``
(they hide a cycle from Python's import machinery, not from the reader), and
imports through :mod:`importlib`: ``importlib.import_module("fedlr.x")`` is an
edge to ``fedlr.x``, and a discovery of a package's modules
(``import_submodules(pkg)``, ``pkgutil.iter_modules(pkg.__path__)``,
``pkgutil.walk_packages``) is an edge from the discovering module to every
module of that package. The method registry's discovery of
:mod:`fedlr.strategies` is such an edge; it is why the strategy modules
register through :mod:`fedlr.strategies.registration` and never import
:mod:`fedlr.strategies.registry`, and why :class:`fedlr.config.run.RunConfig`
knows no method (the registry hands it the methods' keys).

The graph is built as the repository's ``import_cycles.py`` tool builds it
(kept here so that a clean clone runs it), plus the importlib edges: a
module's edges are the fedlr modules it names in any ``import``/``from ...
import`` (relative ones resolved; ``from pkg import mod`` names ``pkg.mod``),
each cut to the longest module it starts with; a package's ``__init__`` is
left out of the graph (it re-exports, resolving names lazily), and so is a
module's import of its own submodules.

:data:`FLOORS` declares the layers of fedlr once, bottom first, as folders
(each subpackage of ``fedlr``, plus ``fedlr`` for its own top-level modules):
a folder sits on exactly one floor, a module imports from its folder's floor
or below, never from one above, and no two folders import each other, around
a loop or on one floor. A failure names each offending import by file:line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

from fedlr.client_apps.payloads import PAYLOADS
from fedlr.server_apps import gpse, lora, qrmix, vera
from fedlr.server_apps.builtin_plans import plan_builder
from fedlr.server_apps.plans import register_plan
from tests.conftest import ROOT

Graph = dict[str, set[str]]

#: The floors of fedlr, bottom first: (name, folders). A folder is a
#: subpackage of ``fedlr`` by name; ``fedlr`` is its own top-level modules.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # errors, the option declarations, discovery, the random generators;
    # the kernels; the data sets
    ("foundation", ("fedlr", "linalg", "data")),
    # records, grids, the SuperLink processes and the CLI's output
    ("Flower glue", ("flower",)),
    ("adapters", ("adapters",)),
    # what travels: record names and keys, updates, the factored downlink
    ("wire", ("wire",)),
    # a node's round: its checks, features, pruning, training loops
    ("client", ("client",)),
    # what the run config names: robust rules, privacy mechanisms
    ("mechanisms", ("robust", "privacy")),
    ("config", ("config",)),
    ("models and tasks", ("models", "tasks")),
    # the payload kinds and their handlers
    ("client apps", ("client_apps",)),
    ("round and strategies", ("round", "strategies")),
    # results, trackers, checkpoints, the exported adapter
    ("runs", ("runs",)),
    ("server apps", ("server_apps",)),
    # what a process starts (the dispatching ClientApp, run_in_process,
    # the flwr run launcher, sweeps) and the generated docs
    ("launch", ("launch", "configdoc")),
)

#: Imports that run up a floor and are known: (importer, imported).
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()

#: Calls that import every module of the package they are given.
DISCOVERY_CALLS = frozenset({"import_submodules", "iter_modules", "walk_packages"})


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


def _aliases(module: str, is_package: bool, tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name an import binds it to."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            prefix = imported_names(module, is_package, node)[0]
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{prefix}.{alias.name}"
    return bound


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``pkg.sub`` for an expression naming an imported module (``pkg.sub``,
    an alias of it, or ``alias.__path__``), else ``None``."""
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        if base is None:
            return None
        return base if node.attr == "__path__" else f"{base}.{node.attr}"
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _string(node: ast.AST, module: str) -> str | None:
    """The module name an ``import_module`` argument spells: a literal, or
    the literal start of an f-string (``__name__`` read as the module's own
    name); ``None`` when it starts with anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                text += part.value
            elif (
                isinstance(part, ast.FormattedValue)
                and isinstance(part.value, ast.Name)
                and part.value.id == "__name__"
            ):
                text += module
            else:
                return text or None
        return text
    return None


def importlib_targets(
    module: str, is_package: bool, tree: ast.AST, files: dict[str, Path]
) -> dict[str, int]:
    """The fedlr modules a module imports through :mod:`importlib` (each
    with the line of the call).

    ``importlib.import_module(name)`` imports ``name`` (a name ending in a
    package and a dot, the start of an f-string, imports any module of that
    package: all of them count); a discovery call (:data:`DISCOVERY_CALLS`)
    given a package imports every module of it.
    """
    aliases = _aliases(module, is_package, tree)
    found: dict[str, int] = {}

    def package_modules(package: str) -> dict[str, int]:
        return {m: node.lineno for m in files if m.startswith(package + ".")}

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "import_module" and node.args:
            text = _string(node.args[0], module)
            if text is None:
                continue
            if text.endswith("."):
                found |= package_modules(text[:-1])
            else:
                found[text] = node.lineno
        elif name in DISCOVERY_CALLS and node.args:
            package = _dotted(node.args[0], aliases)
            if package is not None:
                found |= package_modules(package)
    return found


Sites = dict[tuple[str, str], str]


def import_sites(root: Path, *, with_importlib: bool = True) -> Sites:
    """(module, imported module) -> ``path:line`` of its first import, for
    every module of the package, package ``__init__``s left out."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    sites: Sites = {}
    for module, path in files.items():
        if module in packages:
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = [
            (name, node.lineno)
            for node in ast.walk(tree)
            for name in imported_names(module, False, node)
        ]
        if with_importlib:
            names += sorted(importlib_targets(module, False, tree, files).items())
        sites.setdefault((module, module), "")  # every module is a node
        for name, line in sorted(names, key=lambda pair: pair[1]):
            while name and name not in files:  # the longest module it names
                name = name.rpartition(".")[0]
            if (
                name
                and name != module
                and not name.startswith(module + ".")
                and name not in packages
            ):
                sites.setdefault(
                    (module, name), f"{path.relative_to(root.parent)}:{line}"
                )
    return sites


def import_graph(root: Path, *, with_importlib: bool = True) -> Graph:
    """Module -> the package's modules it imports, package ``__init__``s left out."""
    edges: Graph = {}
    for module, target in import_sites(root, with_importlib=with_importlib):
        edges.setdefault(module, set())
        if target != module:
            edges[module].add(target)
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


Floors = tuple[tuple[str, tuple[str, ...]], ...]


def folder_of(module: str) -> str:
    """``pkg.folder.mod`` -> ``folder``; a top-level ``pkg.mod`` -> ``pkg``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else parts[0]


def floor_of(module: str, floors: Floors) -> int:
    """The index of the floor of ``module``'s folder.

    Raises
    ------
    LookupError
        If no floor names the folder.
    """
    folder = folder_of(module)
    for level, (_, folders) in enumerate(floors):
        if folder in folders:
            return level
    raise LookupError(f"{folder} (of {module}) is on no floor: add it to FLOORS")


def folder_graph(edges: Graph) -> Graph:
    """Folder -> the other folders its modules import."""
    folders: Graph = {}
    for module, targets in edges.items():
        mine = folders.setdefault(folder_of(module), set())
        mine |= {folder_of(t) for t in targets} - {folder_of(module)}
    return folders


def upward_imports(edges: Graph, floors: Floors) -> set[tuple[str, str]]:
    """Every (importer, imported) whose imported module is on a higher floor."""
    return {
        (m, w)
        for m, targets in edges.items()
        for w in targets
        if floor_of(w, floors) > floor_of(m, floors)
    }


def _where(sites: Sites, pairs: Iterable[tuple[str, str]]) -> str:
    return "\n".join(f"  {sites[m, w]}: {m} -> {w}" for m, w in sorted(pairs))


# ------------------------------------------------------------------ fedlr
def test_fedlr_has_no_import_cycles_counting_importlib() -> None:
    edges = import_graph(ROOT / "fedlr")
    found = cycles(edges)
    report = describe(edges, found)
    assert not found, f"{len(found)} import cycles in fedlr:\n{report}"


def test_every_folder_of_fedlr_is_on_one_floor() -> None:
    listed = [folder for _, folders in FLOORS for folder in folders]
    twice = sorted({f for f in listed if listed.count(f) > 1})
    assert not twice, f"folders on more than one floor: {twice}"
    found = {folder_of(m) for m in import_graph(ROOT / "fedlr")}
    assert not found - set(listed), (
        f"folders on no floor: {sorted(found - set(listed))}"
    )
    assert not set(listed) - found, (
        f"floors name no folder: {sorted(set(listed) - found)}"
    )


def test_fedlr_has_no_folder_cycles() -> None:
    """No two folders import each other, directly or around a loop (on one
    floor too); each import of a loop is named by file:line."""
    sites = import_sites(ROOT / "fedlr")
    edges = import_graph(ROOT / "fedlr")
    found = cycles(folder_graph(edges))
    loops = [
        (m, w)
        for m, targets in edges.items()
        for w in targets
        for group in found
        if folder_of(m) != folder_of(w) and {folder_of(m), folder_of(w)} <= set(group)
    ]
    assert not found, f"folder cycles {found}, through:\n{_where(sites, loops)}"


def test_no_import_runs_up_a_floor() -> None:
    sites = import_sites(ROOT / "fedlr")
    upward = upward_imports(import_graph(ROOT / "fedlr"), FLOORS)
    names = [name for name, _ in FLOORS]
    lines = [
        f"  {sites[m, w]}: {m} ({names[floor_of(m, FLOORS)]}) -> "
        f"{w} ({names[floor_of(w, FLOORS)]})"
        for m, w in sorted(upward - KNOWN_UPWARD)
    ]
    assert not lines, "imports that run up a floor:\n" + "\n".join(lines)
    gone = sorted(KNOWN_UPWARD - upward)
    assert not gone, f"known upward imports no longer there (drop them): {gone}"


def test_the_run_config_and_the_client_import_no_strategy() -> None:
    """Named, because these were loops the tool could not see: the run config
    discovered every strategy, and the client asked the registry."""
    edges = import_graph(ROOT / "fedlr")
    for low in (
        "fedlr.config.run",
        "fedlr.options",
        "fedlr.robust.rules",
        "fedlr.client_apps.payloads",
        "fedlr.client.round",
        "fedlr.client.method_features",
    ):
        upward = sorted(
            m
            for m in edges[low]
            if m.startswith(("fedlr.strategies.", "fedlr.server_apps."))
        )
        assert not upward, f"{low} imports {upward}"
    assert "fedlr.strategies.fedspec" in edges["fedlr.strategies.registry"]
    strategies = [m for m in edges if m.startswith("fedlr.strategies.")]
    importers = sorted(m for m in strategies if "fedlr.strategies.registry" in edges[m])
    assert not importers, f"strategy modules import the registry: {importers}"


_FRESH_PROCESS = """
import sys
from fedlr.config.run import RunConfig
from fedlr.client.method_features import MethodsNotLoadedError, client_features
RunConfig.from_mapping({"method": "fedspec", "fedspec-threshold": 0.5})
assert not [m for m in sys.modules if m.startswith("fedlr.strategies.")], "config"
try:
    client_features()
except MethodsNotLoadedError:
    pass
else:
    raise AssertionError("client features before the methods loaded")
from fedlr import apply_round
names = [f.__name__ for f in client_features()]
assert "ProximalTerm" in names and "ScaffoldCorrection" in names, names
print("ok")
"""


def test_config_loads_no_strategy_and_the_client_table_waits_for_them() -> None:
    """At run time too: parsing the run config imports no strategy module; the
    client's table of features refuses to answer before the methods loaded,
    and ``from fedlr import apply_round`` loads them."""
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ------------------------------------------------------------------ the counter
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


def test_the_counter_sees_importlib_loops(tmp_path: Path) -> None:
    """A registry that discovers its plug-ins while they import it is a cycle;
    with the registration below the discovery, it is none."""
    files = {
        "pkg/__init__.py": "",
        "pkg/plugins/__init__.py": "",
        "pkg/plugins/one.py": "from pkg.registry import register\n",
        "pkg/plugins/two.py": "from pkg.registry import register\n",
        "pkg/named.py": "import importlib\n"
        "def load():\n    importlib.import_module('pkg.plugins.one')\n",
        "pkg/prefixed.py": "import importlib\n"
        "def load(n):\n    importlib.import_module(f'pkg.plugins.{n}')\n",
        "pkg/user.py": "import importlib\n"
        "def load(n):\n    importlib.import_module(n)\n",
    }
    discovery = (
        "import pkgutil\nimport importlib\nimport pkg.plugins as found\n"
        "from pkg.discovery import import_submodules\n"
        "def register(c):\n    return c\n"
        "def load():\n    import_submodules(found)\n"
        "    for m in pkgutil.iter_modules(found.__path__):\n        pass\n"
    )
    root = _write(tmp_path / "a", {**files, "pkg/registry.py": discovery})
    edges = import_graph(root)
    assert edges["pkg.registry"] == {"pkg.plugins.one", "pkg.plugins.two"}
    assert edges["pkg.named"] == {"pkg.plugins.one"}
    assert edges["pkg.prefixed"] == {"pkg.plugins.one", "pkg.plugins.two"}
    assert edges["pkg.user"] == set()
    assert cycles(edges) == [["pkg.plugins.one", "pkg.plugins.two", "pkg.registry"]]
    assert cycles(import_graph(root, with_importlib=False)) == []

    split = {
        "pkg/plugins/one.py": "from pkg.registration import register\n",
        "pkg/plugins/two.py": "from pkg.registration import register\n",
        "pkg/registration.py": "def register(c):\n    return c\n",
        "pkg/registry.py": "import pkg.plugins as found\n"
        "from pkg.registration import register\n"
        "def load():\n    import_submodules(found)\n",
    }
    root = _write(tmp_path / "b", {**files, **split})
    assert cycles(import_graph(root)) == []


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


def test_an_upward_import_and_a_folder_loop_are_found_and_named(
    tmp_path: Path,
) -> None:
    """A function-level import from a lower folder into a higher one runs up a
    floor and closes a folder loop, though the modules form none."""
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": (
                "import pkg.errors\n\ndef f():\n    from pkg.high.c import g\n"
            ),
            "pkg/low/b.py": "",
            "pkg/high/__init__.py": "",
            "pkg/high/c.py": "from pkg.low.b import x\n",
            "pkg/side/__init__.py": "",
            "pkg/side/d.py": "",
        },
    )
    floors = (("bottom", ("pkg", "low", "side")), ("top", ("high",)))
    edges = import_graph(root)
    sites = import_sites(root)
    assert cycles(edges) == []
    assert cycles(folder_graph(edges)) == [["high", "low"]]
    assert upward_imports(edges, floors) == {("pkg.low.a", "pkg.high.c")}
    assert sites["pkg.low.a", "pkg.high.c"] == "pkg/low/a.py:4"
    assert sites["pkg.low.a", "pkg.errors"] == "pkg/low/a.py:1"
    with pytest.raises(LookupError, match=r"side \(of pkg\.side\.d\) is on no floor"):
        floor_of("pkg.side.d", floors[1:])
    assert floor_of("fedlr.launch.client_app", FLOORS) > floor_of(
        "fedlr.client_apps.lora", FLOORS
    )


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
