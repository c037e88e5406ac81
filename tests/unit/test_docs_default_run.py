"""The default run's own numbers in README.md and docs/quickstart.md are a
fresh run's: the default configuration (``make run``'s, ``robust = auto``)
run in process, every round, its log compared with the pasted lines.

Each pasted line must equal the fresh one field for field, except the
times (the round's seconds, ``elapsed``, ``eta``), which depend on the
machine.
"""

from __future__ import annotations

import logging
import re

import pytest

from fedlr.launch.local import run_in_process
from tests.conftest import ROOT

_TIMES = re.compile(r" \d+(\.\d+)?s elapsed \S+( eta \S+)?")
_FINAL = re.compile(r"final accuracy (\d\.\d{4})")


def _quoted_lines() -> list[str]:
    """The quickstart's pasted progress lines (the block after its
    "Progress lines" heading)."""
    text = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    section = text[text.index("### Progress lines") :]
    block = section[section.index("```\n") + 4 :]
    block = block[: block.index("```")]
    return [line for line in block.splitlines() if line and line != "..."]


def _comparable(line: str) -> str:
    return _TIMES.sub(" <times>", line)


def test_the_docs_quote_the_quoted_lines_and_numbers_of_one_run():
    """Cheap: the quoted lines agree with each other and with the numbers
    in the prose of both pages."""
    lines = _quoted_lines()
    initial = re.fullmatch(r"fedlr: initial accuracy (\d\.\d{4}), loss \S+", lines[0])
    assert initial is not None, lines[0]
    final = _FINAL.search(lines[-1])
    assert final is not None, lines[-1]
    quickstart = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in (quickstart, readme):
        assert f"{initial.group(1)} before training" in page
        assert f"**{final.group(1)} after" in page
        assert "0.7425" in page and 'robust = "none"' in page  # labelled


@pytest.mark.early(seconds=355)
@pytest.mark.slow  # the whole default run: about 5 minutes on 2 cores
def test_the_quoted_lines_are_a_fresh_default_runs(tmp_path, assets, caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_in_process({"output-dir": str(tmp_path)})
    logged = [
        m
        for m in caplog.messages
        if m.startswith(("fedlr: initial", "fedlr [round ", "round "))
        or m.startswith("fedlr: finished")
    ]
    for quoted in _quoted_lines():
        if quoted.startswith("fedlr: finished"):
            final = _FINAL.search(quoted)
            assert final is not None
            [line] = [m for m in logged if m.startswith("fedlr: finished")]
            assert f"final accuracy {final.group(1)};" in line, line
            continue
        want = _comparable(quoted)
        assert want in [_comparable(m) for m in logged], quoted
