"""The update-size screen: a reply far larger than the round's median is dropped.

Whatever the robust rule (``none`` included), :func:`screen_sizes`
(``screen-ratio``, default :data:`DEFAULT_SCREEN_RATIO`) drops a reply whose
update norm is more than ``screen-ratio`` times the round's median update
norm and larger than the current state's norm: a boosted or overflowing reply
never reaches the kernel. :func:`screen_record_sizes` does the same for each
extra record a method's replies carry (SCAFFOLD-LoRA's control delta, FedSA's
personal gram, QR-Mix's eigenpairs, FOT's sketches), against the round's
median of that record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from fedlr.robust.spaces import UpdateSpace

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate

__all__ = [
    "DEFAULT_SCREEN_RATIO",
    "ScreenOutcome",
    "record_norm",
    "screen_record_sizes",
    "screen_sizes",
]


DEFAULT_SCREEN_RATIO = 20.0
"""The default ``screen-ratio``: a reply whose update is more than 20 times
the round's median update (and larger than the current model) is dropped.
Honest rounds of the committed configurations measured at most 2.3 times the
median, 3.6 times the smallest update (docs/reliability.md, "The default
update-size screen")."""


@dataclass
class ScreenOutcome:
    """What :func:`screen_sizes` did to a round's updates.

    Attributes
    ----------
    updates : list of ClientUpdate
        The updates kept, in their order.
    reasons : list of (int, str)
        ``(node, reason)`` for each update dropped.
    ratios : list of float
        Each update's norm over the round's reference scale (``inf`` for a
        non-finite norm), in the order of the updates given.
    bound : float
        The norm above which an update was dropped (``inf``: none could be).
    """

    updates: list[ClientUpdate]
    reasons: list[tuple[int, str]] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    bound: float = math.inf


def screen_sizes(
    updates: Sequence[ClientUpdate], space: UpdateSpace, ratio: float
) -> ScreenOutcome:
    """Drop updates far larger than the round's median update.

    Every update's norm ``n_i`` is measured in the method's update space
    (``space``). The round's scale ``m`` is the lower median of the norms
    (the ``ceil(k / 2)``-th smallest: with two clients, the smaller one, so
    one attacker of two cannot set it); with one client it is the norm of
    the current global state itself, measured in the same space (the update
    that would zero every array the client sends). An update is dropped if

        ``n_i > max(ratio * m, ||current||)``   or ``n_i`` is not finite:

    the current state's norm is the floor, so an update no larger than the
    model it changes is never dropped, whatever the round's median (a round
    in which most clients barely moved). ``ratio`` <= 0 turns the screen
    off; a zero bound (a zero scale and a zero current state: nothing to
    compare with) keeps every finite update.

    Parameters
    ----------
    updates : sequence of ClientUpdate
        The round's validated updates.
    space : UpdateSpace
        The method's update space for this round.
    ratio : float
        The ``screen-ratio``.

    Returns
    -------
    ScreenOutcome
    """
    kept = list(updates)
    if ratio <= 0 or not kept:
        return ScreenOutcome(kept)
    norms = [space.norm(u) for u in kept]
    zero = replace(
        kept[0], arrays={k: torch.zeros_like(v) for k, v in kept[0].arrays.items()}
    )
    state = space.norm(zero)
    if not math.isfinite(state):
        state = 0.0
    scale = _lower_median(norms) if len(kept) > 1 else state
    what = "the round's median update" if len(kept) > 1 else "the current state"

    def reason(norm: float, r: float) -> str:
        if not math.isfinite(norm):
            return f"update norm {norm} is not finite (screen-ratio {ratio:g})"
        return (
            f"update norm {norm:.4g} is {r:.3g} x {what} ({scale:.4g}), above "
            f"screen-ratio {ratio:g} (and the current state's norm {state:.4g})"
        )

    return _keep_within(kept, norms, scale, max(ratio * scale, state), reason)


def _lower_median(norms: Sequence[float]) -> float:
    """The ``ceil(k / 2)``-th smallest norm (non-finite ones count as largest);
    0 when that one is not finite (most not finite: none to compare with)."""
    ordered = sorted(n if math.isfinite(n) else math.inf for n in norms)
    scale = ordered[(len(ordered) - 1) // 2]
    return scale if math.isfinite(scale) else 0.0


def _keep_within(
    updates: list[ClientUpdate],
    norms: Sequence[float],
    scale: float,
    bound: float,
    reason: Callable[[float, float], str],
) -> ScreenOutcome:
    """Keep each update whose norm is finite and at most ``bound`` (a zero
    bound keeps every finite one); ``reason(norm, ratio)`` names a drop."""
    ratios = [n / scale if scale > 0 else math.inf for n in norms]
    out: list[ClientUpdate] = []
    reasons: list[tuple[int, str]] = []
    for update, norm, r in zip(updates, norms, ratios, strict=True):
        if math.isfinite(norm) and (bound <= 0 or norm <= bound):
            out.append(update)
        else:
            reasons.append((update.node_id, reason(norm, r)))
    return ScreenOutcome(out, reasons, ratios, bound)


def record_norm(record: dict[str, torch.Tensor]) -> float:
    """The Frobenius norm of an extra record (all its arrays), in float64."""
    total = 0.0
    for value in record.values():
        total += float(value.double().square().sum())
    return math.sqrt(total)


def screen_record_sizes(
    updates: Sequence[ClientUpdate], name: str, ratio: float, floor: float
) -> ScreenOutcome:
    """Drop updates whose extra record ``name`` is far larger than the round's.

    The record's own size screen, as :func:`screen_sizes` is the arrays': a
    reply whose record norm ``n_i`` (:func:`record_norm`) exceeds

        ``max(ratio * m, floor)``   (``m``: the lower median of the round's
        norms of that record; with one reply, ``floor`` alone)

    or is not finite is dropped. ``floor`` is what the method holds for the
    record (SCAFFOLD-LoRA: the norm of its control variate), so a round in
    which most clients barely moved it cannot drop an ordinary reply;
    ``ratio`` <= 0 turns the screen off, and a zero bound keeps every finite
    record.
    """
    kept = list(updates)
    if ratio <= 0 or not kept:
        return ScreenOutcome(kept)
    norms = [record_norm(u.extras[name]) for u in kept]
    scale = _lower_median(norms) if len(kept) > 1 else 0.0

    def reason(norm: float, r: float) -> str:
        if not math.isfinite(norm):
            return f"record '{name}' norm {norm} is not finite"
        return (
            f"record '{name}' norm {norm:.4g} is {r:.3g} x the round's median "
            f"of that record ({scale:.4g}), above screen-ratio {ratio:g} (and "
            f"the method's floor {floor:.4g})"
        )

    return _keep_within(kept, norms, scale, max(ratio * scale, floor), reason)
