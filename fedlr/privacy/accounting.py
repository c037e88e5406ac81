"""Privacy accounting through Opacus's accountants.

A mechanism's history is a list of ``(noise_multiplier, sample_rate, steps)``
entries, the form Opacus's accountants keep (``accountant.history``): ``steps``
applications of the subsampled Gaussian mechanism with noise multiplier
``sigma`` and sampling rate ``q``. fedlr keeps the history (a client's in its
``context.state``, the server's per round) and asks Opacus for ``epsilon`` at
a ``delta``; nothing here keeps state of its own.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from fedlr.privacy.backend import opacus_api

if TYPE_CHECKING:
    from opacus.accountants.accountant import IAccountant

__all__ = ["History", "epsilon", "noise_multiplier_for"]

History = list[tuple[float, float, int]]
"""``[(noise_multiplier, sample_rate, steps), ...]``."""


def _accountant(kind: str, history: Sequence[tuple[float, float, int]]) -> IAccountant:
    api = opacus_api()
    accountant: IAccountant = (
        api.RDPAccountant() if kind == "rdp" else api.PRVAccountant()
    )
    accountant.history = [(float(s), float(q), int(n)) for s, q, n in history if n > 0]
    return accountant


def epsilon(
    history: Sequence[tuple[float, float, int]], delta: float, kind: str = "rdp"
) -> float:
    """The ``epsilon`` spent by ``history`` at ``delta`` (0 for no steps).

    Parameters
    ----------
    history : sequence of (float, float, int)
        ``(noise_multiplier, sample_rate, steps)`` entries, in order.
    delta : float
        In (0, 1).
    kind : {"rdp", "prv"}
        Opacus's RDP accountant (Mironov et al. 2019, the subsampled Gaussian)
        or its PRV accountant (Gopi et al. 2021, tighter).
    """
    if not any(n > 0 for _, _, n in history):
        return 0.0
    steps = tuple((float(s), float(q), int(n)) for s, q, n in history if n > 0)
    return _epsilon(steps, float(delta), kind)


@lru_cache(maxsize=1024)
def _epsilon(
    history: tuple[tuple[float, float, int], ...], delta: float, kind: str
) -> float:
    """:func:`epsilon`, cached: a node checks its budget with the history it
    then reports, and RDP orders at small ``sigma`` take a while."""
    with warnings.catch_warnings():
        # RDP: "optimal order is the largest alpha" for tiny epsilons; the
        # bound stays valid, only looser.
        warnings.simplefilter("ignore", UserWarning)
        value = float(_accountant(kind, history).get_epsilon(delta=delta))
    return value if math.isfinite(value) else math.inf


@lru_cache(maxsize=256)
def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    kind: str = "rdp",
) -> float:
    """The smallest ``sigma`` (Opacus's search, tolerance 0.01) with which
    ``steps`` steps at ``sample_rate`` spend at most ``target_epsilon``.

    Cached: a node asks for the same value every round, and the search takes
    seconds.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(
            opacus_api().get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=kind,
            )
        )
