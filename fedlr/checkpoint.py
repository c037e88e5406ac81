"""Per-round checkpoints of a run, written atomically, and resuming from them.

After every round the ServerApp saves ``checkpoint.pt`` in the run directory:

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
    Python's ``random``, NumPy's and torch's global generator states.
``results``, ``layers``
    The CSV rows so far.
``extra``
    Anything else the round loop keeps (initial metrics, ...).
``config``
    The run config (to refuse resuming a different run).

The file is written to ``checkpoint.pt.tmp`` and renamed, so a crash at any
moment leaves the previous complete checkpoint; ``checkpoint.json`` (also
renamed into place) says which round it holds, for people and tools.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlr.errors import ConfigError

__all__ = [
    "CHECKPOINT",
    "IGNORED_ON_RESUME",
    "check_resumable",
    "get_rng_state",
    "load_checkpoint",
    "save_checkpoint",
    "set_rng_state",
]

CHECKPOINT = "checkpoint.pt"
IGNORED_ON_RESUME = frozenset({"resume-from", "num-server-rounds", "output-dir"})
"""Run-config keys that may differ between a run and its resumption."""


def get_rng_state() -> dict[str, Any]:
    """The global generators' states: Python, NumPy, torch (CPU)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as ``run_dir/checkpoint.pt`` atomically.

    Raises
    ------
    KeyError
        If ``payload`` has no ``round``.
    """
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT
    tmp = path.with_suffix(".pt.tmp")
    torch.save(dict(payload), tmp)
    os.replace(tmp, path)
    info = run_dir / "checkpoint.json"
    info_tmp = info.with_suffix(".json.tmp")
    info_tmp.write_text(json.dumps({"round": int(payload["round"])}))
    os.replace(info_tmp, info)
    return path


def load_checkpoint(run_dir: Path | str) -> dict[str, Any]:
    """Read a run directory's checkpoint.

    Raises
    ------
    ConfigError
        (key ``resume-from``) if the directory or its checkpoint is missing or
        unreadable.
    """
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise ConfigError(
            "resume-from", f"no {CHECKPOINT} in '{run_dir}' (is it a run directory?)"
        )
    try:
        payload: dict[str, Any] = torch.load(path, weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError("resume-from", f"cannot read {path}: {exc}") from exc
    for key in ("round", "arrays", "strategy", "rng", "results", "config"):
        if key not in payload:
            raise ConfigError("resume-from", f"{path} has no '{key}' entry")
    return payload


def check_resumable(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse to resume when the run configs differ beyond the allowed keys.

    Raises
    ------
    ConfigError
        Naming the first differing key and both values.
    """
    for key in sorted(set(saved) | set(current)):
        if key in IGNORED_ON_RESUME:
            continue
        if saved.get(key) != current.get(key):
            raise ConfigError(
                key,
                f"the checkpoint was made with {saved.get(key)!r}, this run has "
                f"{current.get(key)!r}; a resumed run must use the same settings",
            )
