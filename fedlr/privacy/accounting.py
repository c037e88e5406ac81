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

from fedlr.errors import ConfigError
from fedlr.privacy.backend import opacus_api

if TYPE_CHECKING:
    from opacus.accountants.accountant import IAccountant

__all__ = ["PRV_MIN_SIGMA", "History", "epsilon", "noise_multiplier_for"]

PRV_MIN_SIGMA = 0.3
"""Below this noise multiplier the PRV accountant's discretisation needs
more memory than a node has; ``epsilon`` then reports RDP's (looser, still an
upper bound) value."""

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

    Raises
    ------
    ConfigError
        Inputs outside the accountant's domain (delta not in (0, 1), a noise
        multiplier <= 0, a sampling rate not in (0, 1]): refused rather than
        turned into a meaningless (say, negative) epsilon.
    """
    steps = tuple((float(s), float(q), int(n)) for s, q, n in history if n > 0)
    if not math.isfinite(delta) or not 0.0 < delta < 1.0:
        raise ConfigError("dp-delta", f"must be in (0, 1) to account, got {delta}")
    for sigma, rate, _ in steps:
        if not (math.isfinite(sigma) and sigma > 0 and 0.0 < rate <= 1.0):
            raise ConfigError(
                "dp-noise-multiplier",
                f"the accountant needs a noise multiplier > 0 and a sampling rate "
                f"in (0, 1]; got {sigma} and {rate}",
            )
    if not steps:
        return 0.0
    return _epsilon(steps, float(delta), kind)


@lru_cache(maxsize=1024)
def _epsilon(
    history: tuple[tuple[float, float, int], ...], delta: float, kind: str
) -> float:
    """:func:`epsilon`, cached: a node checks its budget with the history it
    then reports, and RDP orders at small ``sigma`` take a while."""
    if kind == "prv" and min(s for s, _, _ in history) < PRV_MIN_SIGMA:
        kind = "rdp"  # PRV's grid explodes at tiny sigma; RDP stays an upper bound
    with warnings.catch_warnings():
        # RDP: "optimal order is the largest alpha" for tiny epsilons; the
        # bound stays valid, only looser.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)  # PRV's log(0) at q = 1
        try:
            value = float(_accountant(kind, history).get_epsilon(delta=delta))
        except (MemoryError, OverflowError, ValueError, RuntimeError):
            if kind != "prv":
                raise
            value = float(_accountant("rdp", history).get_epsilon(delta=delta))
    # epsilon is never negative (a numerical artefact near 0 is reported as 0)
    return max(value, 0.0) if math.isfinite(value) else math.inf


@lru_cache(maxsize=256)
def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    kind: str = "prv",
) -> float:
    """The smallest ``sigma`` (to 1 %) with which ``steps`` steps at
    ``sample_rate`` spend at most ``target_epsilon`` by accountant ``kind``.

    RDP: Opacus's search (tolerance 0.01 in epsilon). PRV: a bisection
    between :data:`PRV_MIN_SIGMA` and RDP's sigma (RDP's epsilon bounds PRV's
    from above, so RDP's sigma already meets the target); where RDP's sigma
    is below :data:`PRV_MIN_SIGMA` (a huge target), RDP's is returned.
    Cached: a node asks for the same value every round.

    Raises
    ------
    ConfigError
        Naming ``dp-epsilon`` (and the delta), where no noise multiplier
        Opacus searches reaches the target.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            rdp = float(
                opacus_api().get_noise_multiplier(
                    target_epsilon=target_epsilon,
                    target_delta=delta,
                    sample_rate=sample_rate,
                    steps=steps,
                    accountant="rdp",
                )
            )
        except ValueError as exc:  # Opacus: "The privacy budget is too low."
            raise ConfigError(
                "dp-epsilon",
                f"{target_epsilon:g} at delta {delta:g} over {steps} steps at "
                f"sample rate {sample_rate:g}: no noise multiplier reaches it "
                f"(Opacus: {exc}); raise dp-epsilon or delta, or plan fewer steps",
            ) from None
    if kind != "prv" or rdp <= PRV_MIN_SIGMA:
        return rdp
    low, high = PRV_MIN_SIGMA, rdp
    history = lambda sigma: [(sigma, sample_rate, steps)]  # noqa: E731
    if epsilon(history(low), delta, "prv") <= target_epsilon:
        return low
    while high - low > 0.01 * high:
        middle = 0.5 * (low + high)
        if epsilon(history(middle), delta, "prv") <= target_epsilon:
            high = middle
        else:
            low = middle
    return high
