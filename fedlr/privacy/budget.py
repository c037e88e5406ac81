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

The ledger id is the node config's ``dp-ledger-id``, or else a SHA-256 of the
node's training data as the training loop sees it (:func:`data_key`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fedlr.errors import ProtocolError
from fedlr.privacy.accounting import History

__all__ = ["PrivacyLedger", "data_key"]

_VERSION = 1


def data_key(data: Any, chunk: int = 4096) -> str:
    """SHA-256 of a training set's tensors (``data.batch(indices)`` over all of it).

    Parameters
    ----------
    data : fedlr.client.train.TrainData
        ``len(data)`` examples; ``data.batch(indices)`` a dict of tensors.
    chunk : int
        Examples hashed per batch.
    """
    digest = hashlib.sha256()
    n = len(data)
    digest.update(f"n={n};".encode())
    for start in range(0, n, chunk):
        batch = data.batch(list(range(start, min(n, start + chunk))))
        for key in sorted(batch):
            tensor = batch[key].detach().to("cpu").contiguous()
            digest.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
    ProtocolError
        If ``ledger_id`` is empty or has other characters.
    """

    def __init__(self, directory: Path, ledger_id: str) -> None:
        if not ledger_id or not all(c.isalnum() or c in "-_." for c in ledger_id):
            raise ProtocolError(
                f"dp-ledger-id must be letters, digits, '-', '_' or '.', got "
                f"{ledger_id!r}"
            )
        self.path = Path(directory) / "dp-ledger" / f"{ledger_id}.json"

    def entries(self) -> list[dict[str, Any]]:
        """Every recorded release (an empty list for a new ledger).

        Raises
        ------
        ProtocolError
            If the file exists but does not parse: restarting the account at
            zero would under-report, so the node refuses instead.
        """
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        try:
            table = json.loads(text)
            entries = list(table["entries"])
            for entry in entries:
                float(entry["noise-multiplier"])
                float(entry["sample-rate"])
                int(entry["steps"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(
                f"the node's privacy ledger {self.path} is unreadable ({exc}); "
                "the node cannot account its privacy and trains no more until an "
                "operator repairs it"
            ) from None
        return entries

    def history(self) -> History:
        """``[(noise_multiplier, sample_rate, steps), ...]`` of every release."""
        return [
            (float(e["noise-multiplier"]), float(e["sample-rate"]), int(e["steps"]))
            for e in self.entries()
        ]

    @contextmanager
    def locked(self) -> Iterator[PrivacyLedger]:
        """Hold the ledger's exclusive lock (across processes) in the block."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a+") as handle:
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
        """
        sigma, rate, steps = release
        entries = self.entries()
        entries.append(
            {
                "noise-multiplier": float(sigma),
                "sample-rate": float(rate),
                "steps": int(steps),
                "delta": float(delta),
                "run-id": int(run_id),
                "round": int(server_round),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
        )
        _write_durably(self.path, {"version": _VERSION, "entries": entries})


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
