"""Robust aggregation: norm clipping, geometric median, client trimming, weight caps.

Every fedlr method combines its clients' replies as a weighted function of
their updates. This module changes *which* updates go in and *with what
weight*, in the method's own update space, before the method's kernel runs.

Each rule is a plug-in (:mod:`fedlr.robust.registration`): one module of
:mod:`fedlr.robust.builtin_rules` (or of a user's ``extensions``) declares its
name, options, description, start-up line, its step in the method's update
space and how it bounds records; this module loads them and runs the
registered rule. ``docs/robust/<rule>.md`` describes each one.

Each extra record a method aggregates (``space.records``: FOT's sketches,
FedLEASE's router, SCAFFOLD-LoRA's control delta) is bounded by the same rule
in its own space (:class:`~fedlr.robust.spaces.RecordSpace`): clipped at
``clip-ratio`` times the round's median norm of that record, moved towards its
reference by its geometric-median share, trimmed, centred-clipped or, by the
selection rules, set to its reference; the client's arrays keep what the rule
gave them.

With any rule, ``max-client-weight`` caps each client's share of the
total weight (water-filling), so no claimed example count buys the model.

Before any of these, and whatever the rule (``none`` included), the
update-size screen (:func:`screen_sizes`, ``screen-ratio``, default
:data:`DEFAULT_SCREEN_RATIO`) drops a reply whose update norm is more than
``screen-ratio`` times the round's median update norm and larger than the
current state's norm: a boosted or overflowing reply never reaches the kernel.

The update space is the method's (:class:`UpdateSpace`): for the LoRA family
the change of each adapted layer's product ``B_i A_i - B A`` (computed from
the factors' r x r Gram blocks, never a dense d_out x d_in matrix,
:class:`ProductSpace`), for every other family the change of the arrays the
client sends (:class:`ParameterSpace`, optionally mapped, e.g. FOT's
projection off the protected bases); for clients at their own LoRA ranks the
scaled product change against the factors each was sent
(:class:`RankedProductSpace`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

import fedlr.robust.builtin_rules as builtin_rules
from fedlr.discovery import import_submodules
from fedlr.robust.estimators import cap_shares
from fedlr.robust.registration import (
    CLIP_REFERENCES,
    ROBUST_AUTO,
    RobustConfig,
    registered_rules,
    rule_named,
)
from fedlr.robust.spaces import UpdateSpace

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate

__all__ = [
    "CLIP_REFERENCES",
    "ROBUST_AUTO",
    "RobustConfig",
    "RobustOutcome",
    "registered_rules",
    "robust_aggregate",
    "rule_named",
]

import_submodules(builtin_rules)  # fedlr's own rules register


@dataclass
class RobustOutcome:
    """What :func:`robust_aggregate` did to a round's updates.

    Attributes
    ----------
    updates : list of ClientUpdate
        The updates to aggregate (trimmed ones removed, clipped ones moved,
        ``weight`` set).
    reasons : list of str
        One line per clipped, trimmed or capped client, naming its node.
    metrics : dict of str to float
        ``robust-clipped``, ``robust-trimmed``, ``robust-capped`` and
        ``robust-max-share`` (the largest weight share after the rule).
    """

    updates: list[ClientUpdate]
    reasons: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def robust_aggregate(
    updates: Sequence[ClientUpdate],
    space: UpdateSpace,
    config: RobustConfig,
) -> RobustOutcome:
    """Apply ``config``'s rule and weight cap to a round's validated updates.

    Parameters
    ----------
    updates : sequence of ClientUpdate
        Validated updates, ``weight`` = ``num_examples``.
    space : UpdateSpace
        The method's update space for this round.
    config : RobustConfig

    Returns
    -------
    RobustOutcome
        The updates to aggregate, with ``weight`` scaled so that the total
        stays ``sum num_examples`` of the kept clients.
    """
    kept = list(updates)
    reasons: list[str] = []
    metrics = {
        "robust-clipped": 0.0,
        "robust-trimmed": 0.0,
        "robust-capped": 0.0,
    }
    if not kept:
        return RobustOutcome(kept, reasons, metrics)
    weights = torch.as_tensor([u.weight for u in kept], dtype=torch.float64)
    if config.max_weight_ratio > 0 and len(kept) > 1:
        weights, ratio_reasons = _cap_at_median(kept, weights, config.max_weight_ratio)
        reasons += ratio_reasons
        metrics["robust-capped"] += len(ratio_reasons)
    # each record in its own space, over every update the rule sees (a rule
    # that leaves clients out must not leave too few to judge the records)
    kept, record_reasons = _robust_records(kept, space, config)
    reasons += record_reasons
    if space.records:
        metrics["robust-records-moved"] = float(len(record_reasons))
    rule = rule_named(config.rule)
    if rule.apply is not None:
        done = rule.apply(kept, weights, space, config)
        kept, weights = done.updates, done.weights
        reasons += done.reasons
        metrics["robust-clipped"] = float(done.clipped)
        metrics["robust-trimmed"] = float(done.trimmed)
    total = float(weights.sum())
    shares = weights / total
    if config.max_client_weight < 1.0:
        shares, cap_reasons = _cap(kept, weights, config.max_client_weight)
        reasons += cap_reasons
        metrics["robust-capped"] += len(cap_reasons)
    metrics["robust-max-share"] = float(shares.max())
    new = [
        replace(u, weight=float(s) * total) for u, s in zip(kept, shares, strict=True)
    ]
    return RobustOutcome(new, reasons, metrics)


def _robust_records(
    updates: list[ClientUpdate], space: UpdateSpace, config: RobustConfig
) -> tuple[list[ClientUpdate], list[str]]:
    """Each extra record of ``space.records`` bounded by the rule, in its own
    space: moved towards its reference by the factor the rule's ``records``
    gives it (a reason per record moved, naming its node)."""
    out = list(updates)
    reasons: list[str] = []
    rule = rule_named(config.rule)
    for record in space.records:
        if rule.records is None or not out:
            break
        if not all(record.name in u.extras for u in out):
            continue
        factors, why = rule.records(out, record, config)
        for i, g in enumerate(factors):
            if g < 1.0:
                out[i] = record.shrink(out[i], g)
                reasons.append(
                    f"node {out[i].node_id}: record '{record.name}' moved towards "
                    f"its reference by {g:.4g} ({why[i]})"
                )
    return out, reasons


def _cap_at_median(
    kept: list[ClientUpdate], weights: torch.Tensor, ratio: float
) -> tuple[torch.Tensor, list[str]]:
    """Each weight capped at ``ratio`` times the round's lower median weight,
    the total then restored (shares change, the sum of weights does not).

    The lower median (the ``ceil(k / 2)``-th smallest) of the claimed
    weights: a client that claims more cannot raise it, so one claimant of
    ``k >= 3`` weighs at most ``ratio`` honest median clients.
    """
    ordered = sorted(float(w) for w in weights)
    bound = ratio * ordered[(len(ordered) - 1) // 2]
    capped = weights.clamp(max=bound)
    reasons = [
        f"node {update.node_id}: weight {float(w):.6g} capped at {bound:.6g} "
        f"(max-weight-ratio {ratio:g} x the round's median weight)"
        for update, w in zip(kept, weights, strict=True)
        if float(w) > bound * (1 + 1e-12)
    ]
    return capped * (float(weights.sum()) / float(capped.sum())), reasons


def _cap(
    kept: list[ClientUpdate], weights: torch.Tensor, max_client_weight: float
) -> tuple[torch.Tensor, list[str]]:
    """The shares of ``weights`` capped at ``max_client_weight``; a reason per
    capped node."""
    shares = weights / float(weights.sum())
    capped = cap_shares(weights.tolist(), max_client_weight)
    reasons = [
        f"node {update.node_id}: weight share {float(before):.4g} capped "
        f"at {float(after):.4g} (max-client-weight)"
        for update, before, after in zip(kept, shares, capped, strict=True)
        if float(after) < float(before) - 1e-12
    ]
    return capped, reasons
