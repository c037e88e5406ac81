"""``norm-clip``: a client whose update norm exceeds the bound is moved
towards the current global state until its norm is the bound (Sun et al.,
2019, norm bounding).

The bound is ``clip-norm``, or with ``clip-norm = 0`` ``clip-ratio`` times
the round's median update norm (``clip-reference = "server"``: the norm of
the server's own update). Each extra record that the method lets the rule
clip (``by_norm_clip``) is clipped at ``clip-ratio`` times the round's median
norm of that record; a record that follows its arrays (SCAFFOLD-LoRA's control
delta) is clipped so after it followed them (:func:`clip_record`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from fedlr.robust.registration import RobustConfig, RuleResult, register_rule
from fedlr.robust.screen import record_norm
from fedlr.robust.spaces import RecordSpace, UpdateSpace

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate


def _reference(config: RobustConfig, server: str, median: str) -> str:
    """What the bound is, with ``clip-norm = 0``: a multiple of ``median``
    or, with ``clip-reference = "server"``, of ``server``."""
    ref = server if config.clip_reference == "server" else median
    return ref if config.clip_ratio == 1.0 else f"{config.clip_ratio:g} x {ref}"


def _startup(config: RobustConfig) -> str:
    return "norm-clip at " + (
        f"{config.clip_norm:g}"
        if config.clip_norm
        else _reference(
            config,
            "the norm of the server's own update",
            "the round's median update norm",
        )
    )


def _settings(config: RobustConfig) -> dict[str, Any]:
    return {
        "clip_norm": config.clip_norm or _reference(config, "server update", "median")
    }


def _apply(
    updates: list[ClientUpdate],
    weights: torch.Tensor,
    space: UpdateSpace,
    config: RobustConfig,
) -> RuleResult:
    """Each update above the bound moved onto it (by bisection where the
    space's norm is not linear in the move); a reason per clipped client."""
    bound = config.clip_norm
    norms = [space.norm(u) for u in updates]
    if bound <= 0:
        finite = [n for n in norms if math.isfinite(n)] or [0.0]
        bound = config.clip_ratio * float(
            torch.tensor(finite, dtype=torch.float64).median()
        )
    out: list[ClientUpdate] = []
    reasons: list[str] = []
    for update, norm in zip(updates, norms, strict=True):
        if norm <= bound * (1 + 1e-9) or norm == 0:
            out.append(update)
            continue
        if not math.isfinite(norm):
            factor, moved = 0.0, space.shrink(update, 0.0)
        elif space.linear:
            factor = bound / norm
            moved = space.shrink(update, factor)
            if space.norm(moved) > bound * (1 + 1e-9):  # rounded in float32
                factor, moved = _bisect(update, space, bound, norm)
        else:
            factor, moved = _bisect(update, space, bound, norm)
        out.append(replace(moved, clip_factor=update.clip_factor * factor))
        reasons.append(
            f"node {update.node_id}: update norm {norm:.4g} clipped to "
            f"{space.norm(moved):.4g} (clip-norm {bound:.4g}, factor {factor:.4g})"
        )
    return RuleResult(out, weights, reasons, clipped=len(reasons))


def _bisect(
    update: ClientUpdate, space: UpdateSpace, bound: float, norm: float
) -> tuple[float, ClientUpdate]:
    """The largest factor found whose moved update has norm <= ``bound``."""
    lo, hi = 0.0, min(1.0, 2 * bound / norm)
    best = space.shrink(update, lo)
    hi_update = space.shrink(update, hi)
    if space.norm(hi_update) <= bound:
        return hi, hi_update
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        moved = space.shrink(update, mid)
        if space.norm(moved) <= bound:
            lo, best = mid, moved
        else:
            hi = mid
    return lo, best


def _records(
    updates: list[ClientUpdate], record: RecordSpace, config: RobustConfig
) -> tuple[list[float], list[str]]:
    """``min(1, tau / ||r_i||)``, ``tau`` ``clip-ratio`` times the round's
    median norm of the record (a record the method clips itself, after
    moving it with the arrays, is left to it)."""
    if not record.by_norm_clip:
        return [1.0] * len(updates), [""] * len(updates)
    norms = [record.norm(u) for u in updates]
    tau = config.clip_ratio * float(torch.tensor(norms, dtype=torch.float64).median())
    factors = [tau / n if n > tau * (1 + 1e-9) else 1.0 for n in norms]
    return factors, [f"norm {n:.4g} above {tau:.4g}" for n in norms]


def clip_record(
    updates: list[ClientUpdate], name: str, ratio: float
) -> tuple[list[ClientUpdate], list[str]]:
    """Each update's record ``name`` clipped at ``ratio`` times the round's
    median norm of that record (a record that is an update and has followed
    its clipped arrays, :meth:`~fedlr.round.replies.Replies.clips_record`); the
    factor applied is kept in :attr:`ClientUpdate.record_factors`.
    """
    norms = [record_norm(u.extras[name]) for u in updates]
    if not norms:
        return updates, []
    bound = ratio * float(torch.tensor(norms, dtype=torch.float64).median())
    out: list[ClientUpdate] = []
    reasons: list[str] = []
    for update, norm in zip(updates, norms, strict=True):
        if norm <= bound * (1 + 1e-9) or norm == 0:
            out.append(update)
            continue
        g = bound / norm
        record = {
            k: (v.double() * g).to(v.dtype) for k, v in update.extras[name].items()
        }
        out.append(
            replace(
                update,
                extras={**update.extras, name: record},
                record_factors={**update.record_factors, name: g},
            )
        )
        reasons.append(
            f"node {update.node_id}: record '{name}' norm {norm:.4g} clipped to "
            f"{bound:.4g} ({ratio:g} x the round's median of that record)"
        )
    return out, reasons


register_rule(
    "norm-clip",
    summary="a client whose update norm exceeds `clip-norm` (0: the round's "
    "median norm) is moved towards the current global state until its norm is "
    "the bound (by bisection for products)",
    defends="boosted updates (Sun et al., 2019); a bounded attacker still pulls "
    "by up to the bound",
    startup=_startup,
    apply=_apply,
    records=_records,
    followed_records=lambda updates, name, config: clip_record(
        updates, name, config.clip_ratio
    ),
    settings=_settings,
    clipping=True,
)
