"""The ``flwr`` CLI's output as a launch shows it: noise out, fedlr's lines kept.

Flower's, Ray's and transformers' noise (the SuperNode-count hint, Ray's
accelerator FutureWarning, weight-loading progress bars, Flower's per-round
INFO lines) is kept out of the echo unless ``verbose``
(:func:`is_noise`); fedlr's lines, warnings and errors stay, without ANSI
colour codes when stdout is not a terminal (:class:`OutputStream`). A
traceback that ends in a fedlr error (a named refusal: every node refused its
budget, no valid replies) is shown as that error's one line, once; any other
traceback is shown whole. Used by
:func:`fedlr.launch.flwr_run.flwr_run` and the comparison runner.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import IO

from fedlr.errors import FedLRError

__all__ = ["OutputStream", "is_noise", "isatty", "strip_ansi"]

#: Lines of Flower, Ray and transformers that say nothing about the run:
#: dropped from the output unless ``verbose`` (they stay in the SuperLink log).
_NOISE = re.compile(
    r"default simulated SuperNodes changed from"
    r"|Flower configuration not found\. Created default configuration"
    r"|To change federation size, use the following command"
    r"|flwr federation simulation-config"
    r"|fraction_evaluate is set to 0\.0"
    r"|FutureWarning"
    r"|RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
    r"|^\s*warnings\.warn\("
    r"|\d+%\|"  # tqdm progress bars (model loading)
    r"|Loading weights"
    r"|Manually terminating ClientAppActor"  # Ray's actors at the run's end
)


#: Flower's INFO (and DEBUG) lines of each round, noise unless ``verbose``:
#: fedlr's own round line says what they say. Warnings and errors never match.
_FLOWER_ROUND = re.compile(
    r"\s*DEBUG\s*:"
    r"|\s*INFO\s*:\s*("
    r"$"  # Flower's empty spacer lines
    r"|\[ROUND \d+/\d+\]"
    r"|(configure|aggregate)_(train|evaluate): (Sampled|Received)"
    r"|\S*\s*└──> (Aggregated )?MetricRecord"
    r"|Starting \w+ strategy:"
    r"|Global evaluation\s*$"
    r")"
)


#: ANSI escape sequences (Flower's coloured log levels).
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


_RUN_ID = re.compile(r"Successfully started run (\d+)")

_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = (
    "The above exception was the direct cause of the following exception",
    "During handling of the above exception, another exception occurred",
)
#: The last line of a traceback that ends in a fedlr error: it says it all.
_FEDLR_ERROR = re.compile(re.escape(FedLRError.__module__) + r"\.\w+: ")
#: Flower's lines after a ServerApp exception (its exit code and docs link).
_FLOWER_EXIT = re.compile(
    r"Exit Code: \d+"
    r"|An unhandled exception occurred when running"
    r"|For more information, visit: <https://flower\.ai"
)


def strip_ansi(line: str) -> str:
    """``line`` without ANSI escape sequences (colours, cursor moves)."""
    return _ANSI.sub("", line)


def is_noise(line: str) -> bool:
    """Whether a CLI output line is Flower/Ray/transformers noise (see ``_NOISE``).

    Flower's per-round INFO lines (``[ROUND n/N]``, ``configure_train:
    Sampled``, ``aggregate_train: Received``, empty INFO lines) are noise;
    a fedlr line, a warning and an error never are.
    """
    plain = strip_ansi(line)
    if _FLOWER_ROUND.match(plain) is not None and "fedlr" not in plain:
        return True
    return _NOISE.search(plain) is not None


@dataclass
class OutputStream:
    """The CLI's output as it arrives: kept whole, echoed without noise."""

    echo: bool
    verbose: bool
    lines: list[str] = field(default_factory=list)
    run_id: str | None = None
    colour: bool | None = None
    """Keep ANSI colour codes in the echo; ``None``: only if stdout is a TTY."""
    _traceback: list[str] | None = field(default=None, repr=False)
    _errors_shown: set[str] = field(default_factory=set, repr=False)
    _after_error: bool = field(default=False, repr=False)

    def read(self, stream: IO[str]) -> None:
        colour = self.colour
        if colour is None:
            colour = isatty(sys.stdout)
        try:
            for line in stream:
                self.lines.append(line)
                if self.run_id is None:
                    match = _RUN_ID.search(line)
                    if match:
                        self.run_id = match.group(1)
                if self.echo:
                    for shown in self._shown(line):
                        sys.stdout.write(shown if colour else strip_ansi(shown))
                        sys.stdout.flush()
        except (ValueError, OSError):  # the pipe was closed: the CLI is gone
            return

    def _shown(self, line: str) -> list[str]:
        """The lines to echo now for ``line`` (none while a traceback is read)."""
        if self.verbose:
            return [line]
        plain = strip_ansi(line).rstrip("\n")
        if self._traceback is not None:
            self._traceback.append(line)
            last = (  # the exception's line ends the traceback
                plain.strip()
                and not plain.startswith((" ", "\t", *_CHAINED))
                and _TRACEBACK not in plain
            )
            return self._traceback_shown(plain) if last else []
        if _TRACEBACK in plain or plain.startswith(_CHAINED):
            self._traceback = [line]
            return []
        if self._after_error and (not plain.strip() or _FLOWER_EXIT.search(plain)):
            return []
        if is_noise(line):
            return []
        self._after_error = False
        return [line]

    def _traceback_shown(self, last: str) -> list[str]:
        """A finished traceback: its fedlr error's one line (once), else whole.

        A traceback chained to a fedlr error already shown (Flower re-raising
        it) says nothing more."""
        block, self._traceback = self._traceback or [], None
        error = _FEDLR_ERROR.search(last)
        if error is not None:
            said = last[error.start() :]
            self._after_error = True
            if said in self._errors_shown:
                return []
            self._errors_shown.add(said)
            return [said + "\n"]
        if self._after_error and strip_ansi(block[0]).startswith(_CHAINED):
            return []
        return block

    @property
    def text(self) -> str:
        return "".join(self.lines)


def isatty(stream: object) -> bool:
    """Whether ``stream`` is a terminal (False for a closed or odd stream)."""
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False
