"""``centred-clip``: centred clipping (Karimireddy, He and Jaggi, 2021) run
to its fixed point.

The aggregate ``v`` satisfies ``sum_i s_i clip_tau(u_i - v) = 0``, each
client's deviation from the centre clipped at ``tau`` (``clip-ratio`` times
the round's lower-median distance to the geometric median, or
``clip-norm``). In the span of the updates that is a convex combination
whose weights are ``s_i min(1, tau / ||u_i - v||)``, normalised
(:func:`~fedlr.robust.estimators.centred_clip_weights`). With
``bucket-size`` ``b > 1`` the clients are first averaged in random buckets
of ``b`` (Karimireddy, He and Jaggi, 2022, for non-IID clients), drawn from
the operating system's secure source so that no client can know its bucket,
and the buckets are clipped. A record is scaled by its clip factor at the
record's own fixed point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fedlr.randomness import secure_generator
from fedlr.robust.estimators import bucket_matrix, centred_clip_weights
from fedlr.robust.registration import (
    RobustConfig,
    RuleResult,
    gram_records,
    gram_rule,
    register_rule,
)

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate


def _choose(
    kept: list[ClientUpdate],
    weights: torch.Tensor,
    gram: torch.Tensor,
    config: RobustConfig,
) -> RuleResult:
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
    return RuleResult(kept, alpha * total, reasons, clipped=len(reasons))


def _records(gram: torch.Tensor, config: RobustConfig) -> tuple[list[float], str]:
    ones = [1.0] * len(gram)
    _, tau, clip = centred_clip_weights(gram, ones, ratio=config.clip_ratio)
    return [float(c) for c in clip], f"farther than {tau:.4g} from the centre"


def _startup(config: RobustConfig) -> str:
    bound = (
        f"{config.clip_norm:g}"
        if config.clip_norm
        else f"{config.clip_ratio:g} x the median distance to the geometric median"
    )
    buckets = f", buckets of {config.bucket_size}" if config.bucket_size > 1 else ""
    return f"centred clipping at {bound}{buckets}"


def _settings(config: RobustConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "clip_norm": config.clip_norm
        or (
            "median distance"
            if config.clip_ratio == 1.0
            else f"{config.clip_ratio:g} x median distance"
        )
    }
    if config.bucket_size > 1:
        out["bucket_size"] = config.bucket_size
    return out


register_rule(
    "centred-clip",
    summary="centred clipping (Karimireddy, He and Jaggi, 2021) at its fixed "
    "point: the aggregate `v` with `sum_i s_i clip_tau(u_i - v) = 0`, each "
    "client's distance to the centre clipped at `tau` (`clip-ratio` times the "
    "round's lower-median distance to the geometric median, or `clip-norm`); "
    "in the updates' span these are the weights `s_i min(1, tau / ‖u_i − v‖)`, "
    "normalised, found by reweighting from the geometric median. With "
    "`bucket-size = b > 1` the clients are first averaged in random buckets of "
    "`b` (Karimireddy, He and Jaggi, 2022), the permutation drawn from the OS's "
    "secure source every round",
    defends="a minority whose pull is bounded by its weight share times `tau`, "
    "however far it is; nobody within `tau` of the centre: the plain weighted "
    "mean. Its share comes from the claimed weights: use it with "
    "`max-weight-ratio`",
    startup=_startup,
    apply=gram_rule(_choose),
    records=gram_records(_records),
    settings=_settings,
    clipping=True,
)
