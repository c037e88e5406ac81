"""Per-round checkpoints of a run: atomic, hashed, code-free, the last K kept.

After every round the ServerApp saves ``checkpoint-<round>.pt`` in the run
directory, a dict of:

``round``
    The last finished round.
``arrays``
    The global arrays after that round (dict of str to tensor).
``strategy``
    :meth:`~fedlr.strategies.base.FedLRStrategy.state_dict` (FedSpec's rank, FOT's
    bases and threshold, QR-Mix's stage, SORF-VeRA's b and d, ...).
``plan``
    The server plan's own state (e.g. a continual run's accuracy matrix).
``rng``
    Python's ``random``, NumPy's and torch's global generator states, as
    tensors, ints and tuples.
``results``, ``layers`` (checkpoints of older fedlr versions only)
    The CSV rows so far. Checkpoints no longer carry the history: a resumed
    run reads ``results.csv`` and ``layers.csv`` up to the checkpoint's round
    (:meth:`fedlr.runs.results.ResultsWriter.restore`), so a checkpoint's size
    does not grow with the run.
``extra``
    Anything else the round loop keeps (initial metrics, ...).
``config``
    The run config (to refuse resuming a different run).

Safety, because a run directory may be shared or tampered with:

* every file holds only tensors and plain Python containers and is read with
  ``torch.load(weights_only=True)``, which runs no code from the file (a
  planted pickle is refused, not executed);
* ``checkpoint.json``, the manifest, lists the kept checkpoints with the
  SHA-256 of each file; a file whose hash differs (flipped bytes, a swapped
  file) is refused with :class:`~fedlr.errors.CheckpointError` before it is
  read, and :func:`load_checkpoint` falls back to the previous one with a
  warning;
* files are written to ``*.tmp`` (synced) and renamed, the manifest last, so
  a crash at any moment leaves the previous complete checkpoint; the last
  ``keep`` checkpoints are kept (run-config ``keep-checkpoints``), older ones
  deleted;
* a write that fails (a full disk: ``ENOSPC``, a quota, no permission) removes
  its ``*.tmp``, leaves the manifest naming the previous checkpoint and raises
  :class:`~fedlr.errors.CheckpointWriteError` saying how much space was needed
  and which round is intact;
* a resumed run checks the checkpoint's arrays against its own layout (keys,
  shapes, dtypes) before round 1 (:func:`check_checkpoint_arrays`), and its
  strategy state's keys against those the method keeps, before the strategy
  loads it (:func:`check_checkpoint_state`).

The manifest's ``round`` is the newest checkpoint's round (for people and
tools).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import shutil
from collections.abc import Iterable, Mapping
from logging import WARNING, getLogger
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlr.data.assets import file_sha256
from fedlr.errors import (
    CheckpointError,
    CheckpointLayoutError,
    CheckpointStateError,
    CheckpointWriteError,
    ConfigError,
)

__all__ = [
    "IGNORED_ON_RESUME",
    "MANIFEST",
    "check_checkpoint_arrays",
    "check_checkpoint_state",
    "check_resumable",
    "checkpoint_name",
    "get_rng_state",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
    "set_rng_state",
]

MANIFEST = "checkpoint.json"
REQUIRED = ("round", "arrays", "strategy", "rng", "config")
IGNORED_ON_RESUME = frozenset(
    {"resume-from", "num-server-rounds", "output-dir", "keep-checkpoints", "tracker"}
)
"""Run-config keys that may differ between a run and its resumption."""

_LOG = getLogger("fedlr")


def checkpoint_name(server_round: int) -> str:
    """File name of the checkpoint after ``server_round``."""
    return f"checkpoint-{server_round:05d}.pt"


def get_rng_state() -> dict[str, Any]:
    """The global generators' states (Python, NumPy, torch CPU) as plain data."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    random.setstate(_as_tuple(state["python"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["name"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])


def _as_tuple(value: Any) -> Any:
    """Lists back to tuples (``random.setstate`` wants nested tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    """``value`` with NumPy scalars as Python numbers (loadable code-free)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / MANIFEST
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        entries: list[dict[str, Any]] = [
            {
                "round": int(e["round"]),
                "file": str(e["file"]),
                "sha256": str(e["sha256"]),
            }
            for e in data["checkpoints"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a checkpoint manifest: {exc}") from exc
    for entry in entries:
        if Path(entry["file"]).name != entry["file"]:
            raise CheckpointError(
                f"{path} names a file outside the run directory: {entry['file']!r}"
            )
    return entries


_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""``OSError`` numbers that mean the file system (or the quota) is full."""


def _write_all(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` and sync it (``os.write`` loop)."""
    view = memoryview(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while view:
            written = os.write(fd, view[: 1 << 20])
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` through ``path.tmp`` and a rename; no ``.tmp`` is left.

    Raises
    ------
    OSError
        From the write (then the temporary file is removed and ``path`` is
        as it was).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write_all(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_arrays(path: Path, arrays: Mapping[str, torch.Tensor]) -> None:
    """Write ``arrays`` (``torch.save``) to ``path`` atomically.

    Serialised in memory, then written through ``path.tmp`` and a rename:
    a full disk leaves no partial file and no ``.tmp``.

    Raises
    ------
    CheckpointWriteError
        Naming the path, the size and what to do.
    """
    buffer = io.BytesIO()
    torch.save(dict(arrays), buffer)
    data = buffer.getvalue()
    try:
        _atomic_write(path, data)
    except OSError as exc:
        raise _write_error(
            exc, path, len(data), None, kept="no partial file was left"
        ) from exc


def _write_error(
    exc: OSError, path: Path, nbytes: int, previous: int | None, kept: str | None = None
) -> CheckpointWriteError:
    """The named error of a failed checkpoint write, saying what to do."""
    if kept is None:
        kept = (
            f"the previous checkpoint (round {previous}) is intact"
            if previous is not None
            else "no earlier checkpoint exists"
        )
    needed = f"needed ~{max(nbytes / 1e6, 0.01):.2f} MB"
    if exc.errno in _NO_SPACE:
        try:
            free = f", {shutil.disk_usage(path.parent).free / 1e6:.2f} MB free"
        except OSError:
            free = ""
        reason = f"no space left writing {path} ({needed}{free})"
        todo = "free space or set output-dir elsewhere"
    else:
        reason = f"cannot write {path} ({needed}): {exc.strerror or exc}"
        todo = "check the directory's permissions and disk, or set output-dir elsewhere"
    return CheckpointWriteError(f"{reason}: {todo}; {kept}", previous_round=previous)


def save_checkpoint(
    run_dir: Path, payload: Mapping[str, Any], *, keep: int = 2
) -> Path:
    """Write ``payload`` as ``run_dir/checkpoint-<round>.pt`` and update the manifest.

    Parameters
    ----------
    run_dir : Path
    payload : mapping
        Must hold ``round``; tensors and plain containers only.
    keep : int, default 2
        Checkpoints to keep (older ones are deleted after the manifest no
        longer lists them).

    Raises
    ------
    KeyError
        If ``payload`` has no ``round``.
    ValueError
        If ``keep`` < 1.
    CheckpointWriteError
        If the file or the manifest cannot be written (a full disk, a quota,
        no permission): no partial or unlisted file is left, the manifest
        still names the previous checkpoints, and the message says how much
        space was needed and which round a resumed run would continue from.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    run_dir = Path(run_dir)
    server_round = int(payload["round"])
    path = run_dir / checkpoint_name(server_round)
    buffer = io.BytesIO()  # serialised first: the size is known, the disk untouched
    torch.save(_plain(dict(payload)), buffer)
    data = buffer.getvalue()
    listed = _safe_manifest(run_dir)
    previous = max((e["round"] for e in listed), default=None)
    # 1. The checkpoint, through a temporary file and a rename.
    try:
        _atomic_write(path, data)
    except OSError as exc:
        raise _write_error(exc, path, len(data), previous) from exc
    # 2. The manifest, last: until it is renamed, it names the previous files.
    entries = [e for e in listed if e["round"] != server_round]
    entries.append(
        {"round": server_round, "file": path.name, "sha256": _sha256_bytes(data)}
    )
    entries.sort(key=lambda e: e["round"])
    kept, dropped = entries[-keep:], entries[:-keep]
    manifest = json.dumps({"round": server_round, "checkpoints": kept}, indent=1)
    try:
        _atomic_write(run_dir / MANIFEST, manifest.encode())
    except OSError as exc:
        if path.name not in {e["file"] for e in listed}:
            path.unlink(missing_ok=True)  # listed nowhere: free its space
        raise _write_error(exc, run_dir / MANIFEST, len(manifest), previous) from exc
    for entry in dropped:
        (run_dir / entry["file"]).unlink(missing_ok=True)
    return path


def _safe_manifest(run_dir: Path) -> list[dict[str, Any]]:
    """The manifest's entries, or none if it is unreadable (it is rewritten)."""
    try:
        return _read_manifest(run_dir)
    except CheckpointError as exc:
        _LOG.log(WARNING, "fedlr: starting a new checkpoint manifest: %s", exc)
        return []


def read_checkpoint(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """Read one checkpoint file, code-free, after checking its hash.

    Raises
    ------
    CheckpointError
        If the file is missing, its SHA-256 differs from ``sha256``, it is not
        a code-free torch file of plain data (a pickle that would run code is
        refused here), or an entry is missing.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    if sha256 is not None:
        actual = file_sha256(path)
        if actual != sha256:
            raise CheckpointError(
                f"{path} has SHA-256 {actual[:16]}..., the manifest "
                f"{sha256[:16]}...: the file was changed after it was written"
            )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad or unsafe file
        raise CheckpointError(f"cannot read {path} safely: {exc}") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} holds a {type(payload).__name__}, not a dict")
    for key in REQUIRED:
        if key not in payload:
            raise CheckpointError(f"{path} has no '{key}' entry")
    return payload


def load_checkpoint(run_dir: Path | str) -> dict[str, Any]:
    """The newest good checkpoint of a run directory.

    Checkpoints are tried newest first; one that is missing, fails its hash
    or cannot be read code-free is skipped with a warning naming the reason,
    and the previous one is used.

    Raises
    ------
    ConfigError
        (key ``resume-from``) if the directory has no manifest or no listed
        checkpoint is good; the message gives each one's reason.
    """
    run_dir = Path(run_dir)
    try:
        entries = _read_manifest(run_dir)
    except CheckpointError as exc:
        raise ConfigError("resume-from", str(exc)) from exc
    if not entries:
        raise ConfigError(
            "resume-from",
            f"no {MANIFEST} listing checkpoints in '{run_dir}' (is it a run "
            "directory?)",
        )
    reasons: list[str] = []
    for entry in reversed(entries):
        try:
            payload = read_checkpoint(run_dir / entry["file"], entry["sha256"])
            if int(payload["round"]) != entry["round"]:
                raise CheckpointError(
                    f"{entry['file']} holds round {payload['round']}, the manifest "
                    f"says {entry['round']}"
                )
        except CheckpointError as exc:
            _LOG.log(WARNING, "fedlr: skipping a checkpoint: %s", exc)
            reasons.append(str(exc))
            continue
        if reasons:
            _LOG.log(
                WARNING,
                "fedlr: resuming from the checkpoint of round %d instead",
                entry["round"],
            )
        return payload
    raise ConfigError(
        "resume-from", f"no good checkpoint in '{run_dir}': {'; '.join(reasons)}"
    )


def check_checkpoint_arrays(
    arrays: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    source: str | Path = "the checkpoint",
) -> None:
    """Refuse checkpoint arrays that do not fit the run's layout.

    A checkpoint whose hash is valid can still hold another run's arrays
    (another rank, model or precision, or a file re-saved by hand); every
    client would fail on them in the first round. Checked before round 1.

    Parameters
    ----------
    arrays : mapping of str to tensor
        The checkpoint's global arrays.
    expected : mapping of str to (shape, dtype)
        The arrays this run sends: every key, its shape and dtype (a
        strategy's ``expected_arrays()`` after its state is restored, the
        dtypes of the plan's initial arrays).
    source : str or Path
        Named in the message (the ``resume-from`` directory).

    Raises
    ------
    CheckpointLayoutError
        Naming the first key (in sorted order) that is missing, unexpected,
        or of another shape or dtype, with both shapes and dtypes.
    """
    prefix = f"{source}: the checkpoint's arrays do not fit this run's layout"
    todo = (
        "resume with the settings that run used, or start a new run without resume-from"
    )
    for key in sorted(set(arrays) | set(expected)):
        if key not in arrays:
            shape, dtype = expected[key]
            raise CheckpointLayoutError(
                f"{prefix}: '{key}' ({tuple(shape)}, {_dtype_name(dtype)}) is "
                f"missing ({len(set(expected) - set(arrays))} of {len(expected)} "
                f"keys missing); {todo}"
            )
        tensor = arrays[key]
        got = (tuple(int(n) for n in tensor.shape), _dtype_name(tensor.dtype))
        if key not in expected:
            raise CheckpointLayoutError(
                f"{prefix}: '{key}' {got[0]} {got[1]} is not an array of this "
                f"run ({len(set(arrays) - set(expected))} unexpected keys); {todo}"
            )
        shape, dtype = expected[key]
        want = (tuple(int(n) for n in shape), _dtype_name(dtype))
        if got != want:
            raise CheckpointLayoutError(
                f"{prefix}: '{key}' has shape {got[0]} {got[1]} in the "
                f"checkpoint, this run's layout {want[0]} {want[1]}; {todo}"
            )


def check_checkpoint_state(
    state: Any, kept: Iterable[str], *, method: str, source: str | Path
) -> None:
    """Refuse a checkpoint's strategy state with a key the method does not keep.

    A strategy's loader would otherwise fail on it with a bare ``ValueError``
    (or, for a key no loader checks, ignore it). Checked before the strategy
    loads the state, so before round 1 trains.

    Parameters
    ----------
    state : object
        The checkpoint's ``strategy`` entry (a mapping of str keys).
    kept : iterable of str
        The keys the run's strategy keeps: those of its ``state_dict()``
        as built (every strategy writes the same keys in every round).
    method : str
        The run's method, named in the message.
    source : str or Path
        The checkpoint file, named in the message.

    Raises
    ------
    CheckpointStateError
        One line naming the first unknown key (in sorted order), how many
        there are, the method, the keys it keeps and the file.
    """
    known = sorted(kept)
    todo = (
        "resume with the fedlr version and settings that wrote it, or start a "
        "new run without resume-from"
    )
    if not isinstance(state, Mapping):
        raise CheckpointStateError(
            f"{source}: the strategy state is a {type(state).__name__}, not a "
            f"mapping of the keys method '{method}' keeps ({known}); {todo}"
        )
    unknown = sorted(str(key) for key in state if key not in known)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointStateError(
            f"{source}: strategy-state key {unknown[0]!r}{more} is not one that "
            f"method '{method}' keeps ({known or 'none'}); {todo}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_resumable(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Refuse to resume when the run configs differ beyond the allowed keys.

    A key the checkpoint's config lacks (one added to fedlr after the
    checkpoint was written) passes when this run leaves it at its default,
    which is what the version that wrote the checkpoint did.

    Parameters
    ----------
    saved : mapping
        The run config stored with the checkpoint.
    current : mapping
        This run's full run config (every key).
    defaults : mapping, optional
        Every key's declared default (:meth:`MethodConfig.defaults
        <fedlr.strategies.registry.MethodConfig.defaults>`); without it a
        key missing from ``saved`` is a difference.

    Raises
    ------
    ConfigError
        Naming the first differing key and both values: ``method`` first,
        then the keys both configs have, then a key only one has.
    """
    defaults = defaults or {}
    # The method first, then the keys both configs have: a key only one of
    # them has is most often another method's (fedex-lora's fedex-downlink
    # when fedavg-lora resumes it), so the real difference is named first.
    for key in sorted(
        set(saved) | set(current),
        key=lambda k: (k != "method", k not in saved or k not in current, k),
    ):
        if key in IGNORED_ON_RESUME:
            continue
        if key not in current:
            raise ConfigError(
                key,
                f"the checkpoint was made with {saved[key]!r} for a key this "
                "fedlr version does not have; resume with the version that "
                "wrote it",
            )
        if key not in saved:
            if key in defaults and current[key] == defaults[key]:
                continue  # newer than the checkpoint, left at its default
            raise ConfigError(
                key,
                f"the checkpoint predates this key, so it ran with the key's "
                f"default {defaults.get(key, '(unknown)')!r}; this run has "
                f"{current[key]!r}: a resumed run must use the same settings",
            )
        a, b = saved[key], current[key]
        if a != b:
            raise ConfigError(
                key,
                f"the checkpoint was made with {a!r}, this run has {b!r}; a "
                "resumed run must use the same settings",
            )
