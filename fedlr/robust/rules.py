"""Robust aggregation: norm clipping, geometric median, client trimming, weight caps.

Every fedlr method combines its clients' replies as a weighted function of
their updates. This module changes *which* updates go in and *with what
weight*, in the method's own update space, before the method's kernel runs:

``norm-clip``
    A client whose update norm exceeds ``clip-norm`` (0: the round's median
    update norm) is moved towards the current global state until its norm is
    the bound (Sun et al., 2019, norm bounding). Defends against boosted
    (scaled) updates; a bounded attacker still pulls the model.
``median``
    The weights become those of the (unweighted) geometric median of the
    updates (Weiszfeld's algorithm on the updates' Gram matrix): the method
    aggregates a convex combination of the clients that *is* the geometric
    median of their updates, whatever example counts they claim. Breakdown
    point 1/2.
``trimmed-mean``
    The ``trim-fraction`` of clients farthest from the geometric median (at
    least one when ``k >= 3``, never half) are left out and the others keep
    their weights: a client-level trimmed mean, which, unlike a
    coordinate-wise one, is defined for factor pairs whose coordinates are
    only meaningful together.
``centred-clip``
    Centred clipping (Karimireddy, He and Jaggi, 2021) run to its fixed
    point: the aggregate ``v`` satisfies ``sum_i s_i clip_tau(u_i - v) = 0``,
    each client's deviation from the centre clipped at ``tau`` (``clip-ratio``
    times the round's lower-median distance to the geometric median, or
    ``clip-norm``). In the span of the updates that is a convex combination
    whose weights are ``s_i min(1, tau / ||u_i - v||)``, normalised. With
    ``bucket-size`` ``b > 1`` the clients are first averaged in random
    buckets of ``b`` (Karimireddy, He and Jaggi, 2022, for non-IID clients),
    drawn from the operating system's secure source so that no client can
    know its bucket, and the buckets are clipped.

Each extra record a method aggregates (``space.records``: FOT's sketches,
FedLEASE's router, SCAFFOLD-LoRA's control delta) is bounded by the same rule
in its own space (:class:`~fedlr.robust.spaces.RecordSpace`): clipped at
``clip-ratio`` times the round's median norm of that record, moved towards its
reference by its geometric-median share, trimmed, or centred-clipped; the
client's arrays keep what the rule gave them.

and, with any rule, ``max-client-weight`` caps each client's share of the
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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from fedlr.errors import ConfigError
from fedlr.randomness import secure_generator
from fedlr.robust.estimators import (
    bucket_matrix,
    cap_shares,
    centred_clip_weights,
    distances,
    geometric_median_weights,
)
from fedlr.robust.spaces import RecordSpace, UpdateSpace

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate

__all__ = [
    "CLIPPING_RULES",
    "CLIP_REFERENCES",
    "ROBUST_AUTO",
    "ROBUST_RULES",
    "RobustConfig",
    "RobustOutcome",
    "robust_aggregate",
]

ROBUST_RULES = ("none", "norm-clip", "trimmed-mean", "median", "centred-clip")
"""The robust rules (:class:`RobustConfig`)."""
ROBUST_AUTO = "auto"
"""The ``robust`` run-config key's default besides the rules: the rule the
method's run can take, chosen at configuration
(:func:`fedlr.strategies.registry.resolve`)."""
CLIPPING_RULES = ("norm-clip", "centred-clip")
"""The rules with a bound (``clip-norm``, ``clip-ratio``, ``clip-reference``)."""
CLIP_REFERENCES = ("median", "server")
"""Values of the ``clip-reference`` run-config key."""

_NEGLIGIBLE_SHARE = 1e-6
"""``median``: a client whose geometric-median weight is below this share is
left out rather than kept at a tiny weight (a method whose aggregate is not
linear in the client's arrays, e.g. a product of two of them, would still feel
a huge update through a tiny weight)."""


@dataclass(frozen=True)
class RobustConfig:
    """The robust-aggregation options of a strategy.

    Parameters
    ----------
    rule : {"none", "norm-clip", "trimmed-mean", "median", "centred-clip"}
    clip_norm : float, default 0.0
        ``norm-clip``'s bound on a client's update norm (``centred-clip``'s
        on a client's distance to the centre); 0 uses the round's median.
    trim_fraction : float, default 0.2
        ``trimmed-mean``: share of the clients left out, in [0, 0.5).
    max_client_weight : float, default 1.0
        Cap on any client's share of the total weight, in (0, 1]; 1 is no cap.
    clip_ratio : float, default 1.0
        ``norm-clip`` with ``clip_norm`` 0: the bound is this multiple of the
        round's median update norm (``centred-clip``: of the median distance
        to the geometric median), > 0.
    max_weight_ratio : float, default 0.0
        Cap on any client's weight at this multiple of the round's median
        weight (its claimed example count), >= 0; 0 is no cap. Unlike
        ``max_client_weight`` it does not depend on how many clients reply.
    bucket_size : int, default 1
        ``centred-clip``: clients averaged per random bucket before clipping,
        >= 1; 1 is no bucketing.
    clip_reference : {"median", "server"}, default "median"
        What ``clip_ratio`` multiplies when ``clip_norm`` is 0: the round's
        median (norm or distance), or the norm of the server's own update
        (:mod:`fedlr.robust.server_update`; the protection step sets the
        round's ``clip_norm`` from it, the normalisation of FLTrust).

    Raises
    ------
    ConfigError
        Naming the run-config key of a bad value.
    """

    rule: str = "none"
    clip_norm: float = 0.0
    trim_fraction: float = 0.2
    max_client_weight: float = 1.0
    clip_ratio: float = 1.0
    max_weight_ratio: float = 0.0
    bucket_size: int = 1
    clip_reference: str = "median"

    def __post_init__(self) -> None:
        if self.rule not in ROBUST_RULES:
            raise ConfigError(
                "robust", f"must be one of {list(ROBUST_RULES)}, got {self.rule!r}"
            )
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
            raise ConfigError("clip-norm", f"must be >= 0, got {self.clip_norm}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ConfigError(
                "trim-fraction", f"must be in [0, 0.5), got {self.trim_fraction}"
            )
        if not (math.isfinite(self.clip_ratio) and self.clip_ratio > 0):
            raise ConfigError("clip-ratio", f"must be > 0, got {self.clip_ratio}")
        if not (math.isfinite(self.max_weight_ratio) and self.max_weight_ratio >= 0):
            raise ConfigError(
                "max-weight-ratio", f"must be >= 0, got {self.max_weight_ratio}"
            )
        if isinstance(self.bucket_size, bool) or not (
            isinstance(self.bucket_size, int) and self.bucket_size >= 1
        ):
            raise ConfigError(
                "bucket-size", f"must be an integer >= 1, got {self.bucket_size!r}"
            )
        if self.clip_reference not in CLIP_REFERENCES:
            raise ConfigError(
                "clip-reference",
                f"must be one of {list(CLIP_REFERENCES)}, got {self.clip_reference!r}",
            )
        if self.clip_reference == "server" and self.rule not in CLIPPING_RULES:
            raise ConfigError(
                "clip-reference",
                f"'server' sets a clipping rule's bound ({', '.join(CLIPPING_RULES)}); "
                f"robust is {self.rule!r}",
            )
        if not 0.0 < self.max_client_weight <= 1.0:
            raise ConfigError(
                "max-client-weight",
                f"must be in (0, 1], got {self.max_client_weight}",
            )

    @property
    def active(self) -> bool:
        """Whether aggregation differs from the method's plain weighted one."""
        return (
            self.rule != "none"
            or self.max_client_weight < 1.0
            or self.max_weight_ratio > 0
        )


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


def _centred_clip(
    kept: list[ClientUpdate],
    weights: torch.Tensor,
    gram: torch.Tensor,
    config: RobustConfig,
) -> tuple[torch.Tensor, list[str]]:
    """The weights of ``centred-clip`` (with its buckets; without, each client
    is its own bucket), at the round's total weight, and a reason per client
    whose share fell (clipped, or in a clipped bucket)."""
    total = weights.sum()
    plain = weights / total
    if config.bucket_size > 1:
        mix = bucket_matrix(weights, config.bucket_size, secure_generator())
    else:
        mix = torch.eye(len(kept), dtype=torch.float64)
    members = (mix > 0).to(torch.float64)
    beta, tau, factors = centred_clip_weights(
        mix @ gram.to(torch.float64) @ mix.T,
        (members @ weights.to(torch.float64)).tolist(),
        ratio=config.clip_ratio,
        bound=config.clip_norm,
    )
    alpha = mix.T @ beta
    clipped = (members.T @ (factors < 1).to(torch.float64)) > 0
    reasons = [
        f"node {update.node_id}: weight share {float(before):.4g} -> "
        f"{float(after):.4g} (farther than {tau:.4g} from the centre"
        + (", in its bucket)" if config.bucket_size > 1 else ")")
        for update, before, after, out in zip(kept, plain, alpha, clipped, strict=True)
        if bool(out)
    ]
    return alpha * total, reasons


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
    if config.rule == "norm-clip":
        kept, clip_reasons = _clip(kept, space, config.clip_norm, config.clip_ratio)
        reasons += clip_reasons
        metrics["robust-clipped"] = float(len(clip_reasons))
    elif config.rule in ("median", "trimmed-mean", "centred-clip") and len(kept) > 1:
        kept, weights, excluded = _finite_only(kept, weights, space)
        reasons += excluded
        metrics["robust-trimmed"] = float(len(excluded))
        if len(kept) > 1 and config.rule == "centred-clip":
            gram = space.gram(kept)
            weights, clip_reasons = _centred_clip(kept, weights, gram, config)
            reasons += clip_reasons
            metrics["robust-clipped"] = float(len(clip_reasons))
        elif len(kept) > 1:
            gram = space.gram(kept)
            # Unweighted: a client's claimed example count must not move the
            # median (cap weights with max-client-weight).
            alpha = geometric_median_weights(gram, [1.0] * len(kept))
            if config.rule == "median":
                kept, weights, median_reasons, left_out = _median(kept, weights, alpha)
                reasons += median_reasons
                metrics["robust-trimmed"] += float(left_out)
            else:
                trimmed_reasons, keep_idx = _trim(kept, gram, alpha, config)
                reasons += trimmed_reasons
                kept = [kept[i] for i in keep_idx]
                weights = weights[keep_idx]
                metrics["robust-trimmed"] += float(len(trimmed_reasons))
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
    space: moved towards its reference by the factor :func:`_record_factors`
    gives it (a reason per record moved, naming its node)."""
    out = list(updates)
    reasons: list[str] = []
    for record in space.records:
        if not out or not all(record.name in u.extras for u in out):
            continue
        if config.rule == "norm-clip" and not record.by_norm_clip:
            continue  # the method clips it after moving it with the arrays
        factors, why = _record_factors(out, record, config)
        for i, g in enumerate(factors):
            if g < 1.0:
                out[i] = record.shrink(out[i], g)
                reasons.append(
                    f"node {out[i].node_id}: record '{record.name}' moved towards "
                    f"its reference by {g:.4g} ({why[i]})"
                )
    return out, reasons


def _record_factors(
    updates: list[ClientUpdate], record: RecordSpace, config: RobustConfig
) -> tuple[list[float], list[str]]:
    """The factor ``g_i`` (1: untouched) the rule gives each update's record
    in the record's own space, and why.

    ``norm-clip``: ``min(1, tau / ||r_i||)``, ``tau`` ``clip-ratio`` times the
    round's median norm of that record; ``median``: ``k alpha_i`` where the
    geometric median's weight ``alpha_i`` is below half a plain share
    (``1 / 2k``: far from the median), else 1; ``trimmed-mean``: 0 for the
    ``trim-fraction`` farthest from the geometric median; ``centred-clip``:
    the clip factor at the centred-clipping fixed point. Non-finite norms
    were dropped by the screen; a round whose records do not meet that is
    left as it is.
    """
    k = len(updates)
    ones = [1.0] * k
    why = [""] * k
    if config.rule == "norm-clip":
        norms = [record.norm(u) for u in updates]
        tau = config.clip_ratio * float(
            torch.tensor(norms, dtype=torch.float64).median()
        )
        factors = [tau / n if n > tau * (1 + 1e-9) else 1.0 for n in norms]
        return factors, [f"norm {n:.4g} above {tau:.4g}" for n in norms]
    if k < 2 or config.rule not in ("median", "trimmed-mean", "centred-clip"):
        return ones, why
    gram = record.gram(updates)
    if not bool(torch.isfinite(gram).all()):
        return ones, why
    if config.rule == "centred-clip":
        _, tau, clip = centred_clip_weights(gram, ones, ratio=config.clip_ratio)
        return [float(c) for c in clip], [f"farther than {tau:.4g} from the centre"] * k
    alpha = geometric_median_weights(gram, ones)
    if config.rule == "median":
        factors = [float(k * a) if float(k * a) < 0.5 else 1.0 for a in alpha]
        return factors, ["far from the record's geometric median"] * k
    dist = distances(gram, alpha)
    n_trim = min(math.ceil(config.trim_fraction * k - 1e-9), (k - 1) // 2)
    order = sorted(range(k), key=lambda i: (-float(dist[i]), i))
    trimmed = set(order[:n_trim])
    factors = [0.0 if i in trimmed else 1.0 for i in range(k)]
    return factors, [f"among the {n_trim} farthest from the record's median"] * k


def _median(
    kept: list[ClientUpdate], weights: torch.Tensor, alpha: torch.Tensor
) -> tuple[list[ClientUpdate], torch.Tensor, list[str], int]:
    """The geometric median's weights ``alpha`` applied: updates with a
    negligible share left out, the rest weighted by ``alpha`` at the round's
    total weight. Returns the kept updates, their weights, the reasons and
    the number left out."""
    plain = weights / weights.sum()
    negligible = alpha < _NEGLIGIBLE_SHARE
    reasons = []
    for update, before, after, out in zip(kept, plain, alpha, negligible, strict=True):
        if bool(out):
            reasons.append(
                f"node {update.node_id}: left out (weight share "
                f"{float(after):.3g} at the geometric median)"
            )
        elif float(after) < 0.5 / len(kept):
            reasons.append(
                f"node {update.node_id}: weight share {float(before):.4g} "
                f"-> {float(after):.4g} (far from the geometric median)"
            )
    total_before = weights.sum()
    keep_idx = [i for i in range(len(kept)) if not bool(negligible[i])]
    alpha = alpha[keep_idx]
    weights = alpha / alpha.sum() * total_before
    return [kept[i] for i in keep_idx], weights, reasons, int(negligible.sum())


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


def _finite_only(
    updates: list[ClientUpdate], weights: torch.Tensor, space: UpdateSpace
) -> tuple[list[ClientUpdate], torch.Tensor, list[str]]:
    """Leave out updates whose norm is not finite in float64 (nothing to rank)."""
    norms = [space.norm(u) for u in updates]
    keep = [i for i, n in enumerate(norms) if math.isfinite(n)]
    reasons = [
        f"node {updates[i].node_id}: left out (update norm {norms[i]} is not finite)"
        for i in range(len(updates))
        if i not in keep
    ]
    if not keep:  # nothing finite to rank: keep all, the round check decides
        return updates, weights, []
    return [updates[i] for i in keep], weights[keep], reasons


def _trim(
    updates: list[ClientUpdate],
    gram: torch.Tensor,
    alpha: torch.Tensor,
    config: RobustConfig,
) -> tuple[list[str], list[int]]:
    """Reasons for, and the indices kept after, trimming the farthest clients."""
    dist = distances(gram, alpha)
    k = len(updates)
    n_trim = min(math.ceil(config.trim_fraction * k - 1e-9), (k - 1) // 2)
    order = sorted(range(k), key=lambda i: (-float(dist[i]), i))
    trimmed = set(order[:n_trim])
    reasons = [
        f"node {updates[i].node_id}: trimmed (distance {float(dist[i]):.4g} from "
        f"the geometric median, among the {n_trim} farthest)"
        for i in sorted(trimmed)
    ]
    return reasons, [i for i in range(k) if i not in trimmed]


def _clip(
    updates: list[ClientUpdate], space: UpdateSpace, bound: float, ratio: float = 1.0
) -> tuple[list[ClientUpdate], list[str]]:
    norms = [space.norm(u) for u in updates]
    if bound <= 0:
        finite = [n for n in norms if math.isfinite(n)] or [0.0]
        bound = ratio * float(torch.tensor(finite, dtype=torch.float64).median())
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
    return out, reasons


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
