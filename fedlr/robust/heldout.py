"""The held-out check: leave out a reply that makes the server's model worse.

The norm screen and the robust rules look at the replies' sizes and
directions; a client that sends the negated honest mean at a typical norm
passes them all (docs/results/robustness.md). The held-out check looks at
what a reply does to the model instead, on validation examples the server
holds and the clients never see (the loss-based rejection of Fang et al.
[1]_, applied leave-one-out): with ``L(S)`` the validation loss of the model
the method publishes from the replies ``S``,

    i* = argmin_i L(S - {i}),   left out when   L(S) - L(S - {i*}) > margin,

and again on what is left, while at least 3 replies remain and fewer than
half of the round's replies were left out. Every ``L`` goes through the
method's own ``aggregate_updates`` (its state restored after each try), so
the check sees the model the round would publish, whatever the method
(FedEx-LoRA's fold, FedSVD's re-factorisation, a server optimiser).

What it assumes: the server holds validation examples from the task's
distribution (here the last ``heldout-check-examples`` of the held-out
split, left out of the reported evaluation), and it sees every reply (not
under SecAgg+). What it costs: ``n + 1`` aggregations and validation passes
per round of ``n`` replies (``2n`` more for each reply left out). A client
whose honest update pulls the validation loss up by more than the margin is
left out too: the margin is the price of that (docs/reliability.md).

References
----------
.. [1] Fang, Cao, Jia, Gong, "Local Model Poisoning Attacks to
   Byzantine-Robust Federated Learning", USENIX Security 2020 (LFR).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fedlr.errors import ConfigError

__all__ = [
    "HELDOUT_COLUMNS",
    "HeldOutCheck",
    "check_heldout_method",
    "leave_one_out",
]

HELDOUT_PAYLOADS = ("lora",)
"""Payload kinds whose server plan holds validation examples for the check."""
HELDOUT_COLUMNS = ("heldout-loss", "heldout-left-out")
"""``results.csv`` columns of a run with the check: the validation loss of
what the round aggregated, and how many replies the check left out."""


@dataclass(frozen=True)
class HeldOutCheck:
    """The held-out check of a strategy (set by its server plan).

    Attributes
    ----------
    loss : callable
        ``loss(state) -> float``: the mean validation loss of the model the
        published arrays ``state`` describe.
    margin : float
        ``heldout-check-margin``, >= 0.
    examples : int
        How many validation examples ``loss`` reads (for the start-up line).
    """

    loss: Callable[[Mapping[str, torch.Tensor]], float]
    margin: float
    examples: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ConfigError(
                "heldout-check-margin", f"must be finite and >= 0, got {self.margin}"
            )


def leave_one_out(
    loss_all: float, loss_without: Sequence[float], margin: float
) -> int | None:
    """The reply to leave out, or ``None``.

    Parameters
    ----------
    loss_all : float
        ``L(S)``; a non-finite value counts as ``+inf``.
    loss_without : sequence of float
        ``L(S - {i})`` for each reply ``i``; non-finite values never win.
    margin : float

    Returns
    -------
    int or None
        ``argmin_i L(S - {i})`` (the first on ties) when ``L(S)`` exceeds it
        by more than ``margin``.
    """
    finite = [(v, i) for i, v in enumerate(loss_without) if math.isfinite(v)]
    if not finite:
        return None
    best, index = min(finite)
    full = loss_all if math.isfinite(loss_all) else math.inf
    return index if full - best > margin else None


def check_heldout_method(
    method: str,
    payload: str,
    personalised: bool,
    *,
    secure_aggregation: bool,
    client_dp: bool,
) -> None:
    """Refuse, at configuration, a run whose server cannot make the check.

    Raises
    ------
    ConfigError
        (key ``heldout-check``) under SecAgg+ (the server sees only the sum),
        with client-level DP (which clips and noises a sum whose members must
        not depend on the other clients' updates, as for a robust rule), for
        a personalised method (no one global model to validate) or a payload
        kind whose server plan holds no validation examples.
    """
    if secure_aggregation:
        raise ConfigError(
            "heldout-check",
            "tries each reply out of the round, but under SecAgg+ the server sees "
            "only their sum; turn one of them off",
        )
    if client_dp:
        raise ConfigError(
            "heldout-check",
            "chooses which updates enter the sum from all of them, which "
            "client-level DP's sensitivity (one clipped update) does not cover; "
            "turn one of them off",
        )
    if personalised:
        raise ConfigError(
            "heldout-check",
            f"method '{method}' is personalised: there is no one global model "
            "to validate on the server's examples",
        )
    if payload not in HELDOUT_PAYLOADS:
        raise ConfigError(
            "heldout-check",
            f"method '{method}' sends '{payload}' payloads; the check needs a "
            f"server with validation examples ({', '.join(HELDOUT_PAYLOADS)} "
            "methods)",
        )
