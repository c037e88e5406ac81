"""A node's privacy ledger: every DP-SGD release it made, on its own disk.

The ledger is the node's durable state, outside any run: a JSON file
``<state-dir>/dp-ledger/<ledger-id>.json`` holding one entry per round the
node trained with DP-SGD (``noise-multiplier``, ``sample-rate``, ``steps``,
with the run id, round and time for the operator). A new run, a resumed run,
a restarted node and a replayed round all read and extend the same file, so
the node's budget (``dp-epsilon-budget``, :mod:`fedlr.privacy.node_policy`)
holds over all of them.

A round's spend is *reserved* before the node trains: the check and the
append happen under an exclusive lock on the ledger, and the file is replaced
atomically and fsynced (file and directory) before training starts. A node
that dies after the reservation has spent it (conservative); two runs on one
machine that train the same data cannot both pass the check on one budget.

The ledger id is the node config's ``dp-ledger-id``, or else a digest of the
raw data the node holds (:func:`data_key`): a SHA-256 over the sorted
SHA-256s of its examples (fedlr's text clients: each raw text and label of
the node's whole partition), so neither the order of the examples, nor their
tokenisation or ``max-length``, nor a personal train/eval split of them
changes it; other data gets another id. A training set that carries no such
digest (an image set, a plug-in's data) is digested example by example as
the training loop sees it, in any order.

A ledger that cannot be read (not JSON, binary, a directory in its place),
has another shape, or holds an impossible entry (steps < 1, a noise
multiplier that is not finite and > 0, a sampling rate outside (0, 1], a
delta outside (0, 1)) stops the node with a
:class:`~fedlr.errors.LedgerError` naming the file: skipping it, or an
entry, would under-report what the data has spent.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fedlr.errors import LedgerError, NodeConfigError
from fedlr.privacy.accounting import History
from fedlr.privacy.node_policy import check_ledger_id

__all__ = ["LEDGER_KEY", "PrivacyLedger", "data_key", "raw_data_key"]

_VERSION = 1

LEDGER_KEY = "ledger_key"
"""Attribute of a training set that names the digest of the raw data the node
holds (:func:`raw_data_key`), set by the client app that loaded it; a set
without it is digested example by example as the loop sees it."""


def _canonical(value: Any) -> Any:
    """A JSON-able form of a raw example's value (bytes, arrays, tensors too)."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": hashlib.sha256(bytes(value)).hexdigest()}
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu").contiguous().numpy()
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # numpy
        raw = value.tobytes() if getattr(value, "ndim", 0) else value.item()
        if isinstance(raw, bytes):
            meta = f"{value.dtype}:{tuple(value.shape)}"
            return {"array": meta, "sha256": hashlib.sha256(raw).hexdigest()}
        return raw
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def raw_data_key(examples: Iterable[Any]) -> str:
    """SHA-256 of a multiset of raw examples: the node's default ledger id.

    Each example (a mapping such as ``{"text": ..., "label": ...}``, or a
    tuple of an image's bytes and its label) is digested on its own; the
    digests are sorted and digested with their count. So the order of the
    examples does not change the key, and any added, removed or changed
    example does.
    """
    rows = sorted(
        hashlib.sha256(
            json.dumps(_canonical(e), sort_keys=True, default=str).encode()
        ).digest()
        for e in examples
    )
    digest = hashlib.sha256(f"examples={len(rows)};".encode())
    for row in rows:
        digest.update(row)
    return digest.hexdigest()


def data_key(data: Any) -> str:
    """The default ledger id of a training set.

    Its :data:`LEDGER_KEY` attribute (the digest of the raw data the node
    holds, which fedlr's text client apps set) if it has one; otherwise
    :func:`raw_data_key` of its examples as ``data.batch([i])`` gives them,
    one at a time (so the batches' padding does not enter it).

    Parameters
    ----------
    data : fedlr.client.train.TrainData
        ``len(data)`` examples; ``data.batch(indices)`` a dict of tensors.
    """
    key = getattr(data, LEDGER_KEY, "")
    if key:
        return str(key)
    return raw_data_key(data.batch([i]) for i in range(len(data)))


class PrivacyLedger:
    """The DP-SGD releases of one node's data, in ``directory``.

    Parameters
    ----------
    directory : pathlib.Path
        The node's state directory (created if missing).
    ledger_id : str
        The file's name (letters, digits, ``-``, ``_`` and ``.``).

    Raises
    ------
    NodeConfigError
        If ``ledger_id`` is empty or has other characters.
    """

    def __init__(self, directory: Path, ledger_id: str) -> None:
        if not ledger_id:
            raise NodeConfigError("dp-ledger-id", "is empty")
        check_ledger_id(ledger_id)
        self.path = Path(directory) / "dp-ledger" / f"{ledger_id}.json"

    def _refuse(self, what: str) -> LedgerError:
        return LedgerError(
            f"the node's privacy ledger {self.path} {what}; the node cannot "
            "account its privacy and answers no more until an operator repairs "
            "it (restarting the count, or skipping an entry, would under-report)"
        )

    def entries(self) -> list[dict[str, Any]]:
        """Every recorded release (an empty list for a new ledger).

        Raises
        ------
        LedgerError
            If the file exists but cannot be read as a ledger (binary, not
            JSON, a directory, another shape), or holds an impossible entry.
        """
        try:
            text = self.path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise self._refuse(f"is unreadable ({type(exc).__name__}: {exc})") from None
        try:
            table = json.loads(text)
        except ValueError as exc:
            raise self._refuse(f"is unreadable (not JSON: {exc})") from None
        if not isinstance(table, dict) or not isinstance(table.get("entries"), list):
            raise self._refuse('is unreadable (not {"version": 1, "entries": [...]})')
        if table.get("version") != _VERSION:
            raise self._refuse(f"has version {table.get('version')!r}, not {_VERSION}")
        for number, entry in enumerate(table["entries"]):
            problem = _impossible(entry)
            if problem:
                raise self._refuse(f"holds an impossible entry #{number}: {problem}")
        return list(table["entries"])

    def history(self) -> History:
        """``[(noise_multiplier, sample_rate, steps), ...]`` of every release."""
        return [
            (float(e["noise-multiplier"]), float(e["sample-rate"]), int(e["steps"]))
            for e in self.entries()
        ]

    @contextmanager
    def locked(self) -> Iterator[PrivacyLedger]:
        """Hold the ledger's exclusive lock (across processes) in the block.

        Raises
        ------
        LedgerError
            If the ledger's directory or lock file cannot be made or opened.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_suffix(".lock"), "a+")  # noqa: SIM115
        except OSError as exc:
            raise self._refuse(
                f"cannot be locked ({type(exc).__name__}: {exc})"
            ) from None
        with handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def append(
        self,
        release: tuple[float, float, int],
        *,
        run_id: int,
        server_round: int,
        delta: float,
    ) -> None:
        """Record one round's release; durable when this returns.

        Call inside :meth:`locked`. The file is written to a temporary name,
        fsynced, renamed over the ledger and the directory fsynced.

        Raises
        ------
        LedgerError
            If the release itself is impossible (it is not recorded), or the
            ledger cannot be read.
        """
        sigma, rate, steps = release
        entry = {
            "noise-multiplier": float(sigma),
            "sample-rate": float(rate),
            "steps": int(steps),
            "delta": float(delta),
            "run-id": int(run_id),
            "round": int(server_round),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        problem = _impossible(entry)
        if problem:
            raise self._refuse(f"was asked to record an impossible release: {problem}")
        entries = self.entries()
        entries.append(entry)
        _write_durably(self.path, {"version": _VERSION, "entries": entries})


def _impossible(entry: object) -> str:
    """Why ``entry`` cannot be a release, or ``""``."""
    if not isinstance(entry, dict):
        return f"{entry!r} is not an object"
    checks: Sequence[tuple[str, type | tuple[type, ...], str]] = (
        ("noise-multiplier", (int, float), "finite and > 0"),
        ("sample-rate", (int, float), "in (0, 1]"),
        ("steps", int, "an integer >= 1"),
    )
    for key, kinds, rule in checks:
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"'{key}' must be {rule}, got {value!r}"
    sigma, rate, steps = entry["noise-multiplier"], entry["sample-rate"], entry["steps"]
    if not (math.isfinite(sigma) and sigma > 0):
        return f"'noise-multiplier' must be finite and > 0, got {sigma!r}"
    if not (math.isfinite(rate) and 0 < rate <= 1):
        return f"'sample-rate' must be in (0, 1], got {rate!r}"
    if steps < 1:
        return f"'steps' must be an integer >= 1, got {steps!r}"
    delta = entry.get("delta", 0.5)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        return f"'delta' must be in (0, 1), got {delta!r}"
    if not (math.isfinite(delta) and 0 < delta < 1):
        return f"'delta' must be in (0, 1), got {delta!r}"
    return ""


def _write_durably(path: Path, table: dict[str, Sequence[Any] | int]) -> None:
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump(table, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
