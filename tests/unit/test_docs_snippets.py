"""Every snippet of the docs, extracted from the pages as a reader sees them.

Shell blocks: each ``flwr run`` command streams (``--stream``) and names an
absolute output (``output-dir``; the plug-in app's own ``result-file``), and
its page says how to stop the SuperLink it leaves running. Python blocks:
every block not marked ``<!-- pseudo-code -->`` compiles and runs: the cheap
ones (no ``run_in_process``, no CLI) each in a fresh namespace of one
subprocess, each one that runs a federation (``run_in_process``) in a
subprocess of its own; a block marked ``<!-- file: PATH -->`` or ``<!--
excerpt: PATH -->`` is that file, or a verbatim part of it, and is checked
against it instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from fedlr.launch.local import run_in_process
from tests.conftest import ROOT, tiny_run_config

PSEUDO = "<!-- pseudo-code -->"
"""The marker of a block that is an outline, not code to run (the line before
its fence)."""
SHELL = {"bash", "sh", "shell", "console"}
_BLOCK = re.compile(
    r"(?:^[ \t]*(<!--[^\n]*-->)\n)?^([ \t]*)```(\w*)\n(.*?)^\2```", re.S | re.M
)
"""A fenced block, also one indented in a list item; the HTML comment on the
line before it, if any."""
PAGES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [*ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md"]
)
BARE_FLWR_RUN: dict[str, str] = {}
"""Pages owned elsewhere that still have a bare ``flwr run`` (issue 37):
expected failures until they are rewritten; remove a page when it is."""
NOT_COMPILING: dict[tuple[str, int], str] = {}
"""Python blocks (page, fence line) of pages owned elsewhere that are outlines
and not yet marked ``<!-- pseudo-code -->``."""
_EXPENSIVE = re.compile(r"run_in_process|subprocess|flwr run|^from \.", re.M)
_SOURCE = re.compile(r"<!-- (file|excerpt): (\S+) -->")


def _blocks(page: str) -> list[tuple[int, str, str, str]]:
    """(fence line, marker comment, language, body) of every fenced block."""
    return blocks_of((ROOT / page).read_text(encoding="utf-8"))


def blocks_of(text: str) -> list[tuple[int, str, str, str]]:
    """(fence line, marker comment, language, body) of every fenced block."""
    return [
        (
            text[: m.start(3)].count("\n") + 1,
            m.group(1) or "",
            m.group(3),
            textwrap.dedent(m.group(4)),
        )
        for m in _BLOCK.finditer(text)
    ]


def flwr_run_commands(body: str) -> list[str]:
    """The ``flwr run`` commands of a shell block, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [
        line
        for line in joined.splitlines()
        if not line.lstrip().startswith("#") and re.search(r"(^|\s)flwr run\b", line)
    ]


def command_problems(command: str) -> list[str]:
    """What a newcomer's ``flwr run`` command lacks."""
    problems = []
    if "--stream" not in command:
        problems.append("no --stream")
    output = re.search(r"""(output-dir|result-file)=\\?["']*(["'$/])""", command)
    if output is None:
        problems.append("no output-dir")
    return problems


def test_the_checks_catch_a_bare_flwr_run():
    """The rule itself: the issue's bare snippet fails, a complete one passes."""
    assert command_problems("flwr run . --run-config 'tracker=\"tensorboard\"'") == [
        "no --stream",
        "no output-dir",
    ]
    good = "flwr run . --stream \\\n  --run-config 'output-dir=\"/abs/path\"'"
    (command,) = flwr_run_commands(good)
    assert command_problems(command) == []
    assert flwr_run_commands("# flwr run . is typed here\nmake run") == []


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.xfail(reason=BARE_FLWR_RUN[page]))
        if page in BARE_FLWR_RUN
        else page
        for page in PAGES
    ],
)
def test_every_flwr_run_streams_names_its_output_and_says_how_to_stop(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    found = []
    for line, _, lang, body in _blocks(page):
        if lang not in SHELL:
            continue
        for command in flwr_run_commands(body):
            found.append(command)
            assert command_problems(command) == [], (page, line, command)
    if found:
        assert re.search(r"stop_local_superlinks|--keep-superlink|make run", text), page


def test_the_rewritten_pages_start_runs_with_make_run():
    """tracking, llm, data and reliability show ``make run`` (streams, writes
    to ./outputs, stops what it started) and no raw ``flwr run``."""
    pages = ("docs/tracking.md", "docs/llm.md", "docs/data.md", "docs/reliability.md")
    for page in pages:
        shell = [b for _, _, lang, b in _blocks(page) if lang in SHELL]
        assert not [c for b in shell for c in flwr_run_commands(b)], page
        assert sum(b.count("make run RUN_CONFIG=") for b in shell) >= 1, page


def _python_blocks() -> list[tuple[str, int, str]]:
    return [
        (page, line, body)
        for page in PAGES
        for line, marker, lang, body in _blocks(page)
        if lang == "python" and marker != PSEUDO
    ]


@pytest.mark.parametrize(
    ("page", "line"),
    [
        pytest.param(
            page, line, marks=pytest.mark.xfail(reason=NOT_COMPILING[(page, line)])
        )
        if (page, line) in NOT_COMPILING
        else (page, line)
        for page, line, _ in _python_blocks()
    ],
)
def test_every_python_block_not_marked_pseudo_code_compiles(page, line):
    body = next(b for p, n, b in _python_blocks() if (p, n) == (page, line))
    compile(body, f"{page}:{line}", "exec")


def cheap_blocks() -> list[tuple[str, int, str]]:
    """The python blocks of every page that run in seconds: no run of a
    federation, no CLI, not an app file shown for reading (``<!-- file: -->``,
    ``<!-- excerpt: -->``: :func:`test_file_and_excerpt_blocks_are_their_source`)."""
    return [
        (page, line, body)
        for page in PAGES
        for line, marker, lang, body in _blocks(page)
        if lang == "python" and not marker and not _EXPENSIVE.search(body)
    ]


def federation_blocks() -> list[tuple[str, int, str]]:
    """The python blocks that run a federation in process (unmarked, with
    ``run_in_process`` and no CLI or subprocess of their own)."""
    return [
        (page, line, body)
        for page in PAGES
        for line, marker, lang, body in _blocks(page)
        if lang == "python"
        and not marker
        and "run_in_process" in body
        and not re.search(r"subprocess|flwr run|^from \.", body, re.M)
    ]


def test_file_and_excerpt_blocks_are_their_source():
    found = 0
    for page in PAGES:
        for _, marker, _, body in _blocks(page):
            source = _SOURCE.fullmatch(marker)
            if source is None:
                continue
            kind, path = source.groups()
            text = (ROOT / path).read_text(encoding="utf-8")
            assert (body == text) if kind == "file" else (body in text), (page, path)
            found += 1
    assert found >= 4


def test_every_block_is_compiled_run_or_compared():
    """No python block falls between the runners: each unmarked one is cheap
    or runs a federation, each marked one is pseudo-code or a source copy."""
    for page in PAGES:
        for line, marker, lang, body in _blocks(page):
            if lang != "python":
                continue
            if marker:
                assert marker == PSEUDO or _SOURCE.fullmatch(marker), (page, line)
            else:
                cheap = not _EXPENSIVE.search(body)
                federation = (page, line, body) in federation_blocks()
                assert cheap or federation, (page, line)


_RUNNER = """
import sys, traceback
blocks = {blocks!r}
failed = []
for name, body in blocks:
    try:
        exec(compile(body, name, "exec"), {{"__name__": "__docs__"}})
    except Exception:
        failed.append(name)
        traceback.print_exc()
print("FAILED", failed)
"""


_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin"}


@pytest.mark.slow  # a subprocess or a whole run: the integration stage
def test_cheap_python_blocks_run(assets, tmp_path):
    """The blocks run where a reader runs them: a directory whose ``outputs/``
    holds a finished run (the quickstart reads the newest one), as a checkout
    has after ``make run``; here a real tiny run, not a copy of a results file."""
    blocks = [(f"{page}:{line}", body) for page, line, body in cheap_blocks()]
    pages = {name.split(":")[0] for name, _ in blocks}
    assert {"docs/plugin.md", "docs/data.md", "docs/architecture.md"} <= pages
    assert len(blocks) >= 20, blocks
    run_in_process(tiny_run_config(tmp_path / "outputs", **{"num-server-rounds": 1}))
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER.format(blocks=blocks)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**_ENV, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "FAILED []", result.stderr[-3000:]


@pytest.mark.slow  # a whole federation per block
@pytest.mark.parametrize(
    ("page", "line"), [(page, line) for page, line, _ in federation_blocks()]
)
def test_federation_blocks_run(assets, page, line):
    (body,) = [b for p, n, b in federation_blocks() if (p, n) == (page, line)]
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER.format(blocks=[(f"{page}:{line}", body)])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=_ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "FAILED []", result.stderr[-3000:]


def test_a_pseudo_code_block_is_neither_compiled_nor_run():
    text = f"{PSEUDO}\n```python\nstrategy = for_model(model, ...)  # outline\n```\n"
    text += "```python\nx = 1\n```\n"
    (line, marker, lang, _), (_, plain, _, body) = blocks_of(text)
    assert (line, marker, lang) == (2, PSEUDO, "python")
    assert plain == "" and body == "x = 1\n"
