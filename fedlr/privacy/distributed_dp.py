"""Distributed client-level DP under SecAgg+: the Skellam mechanism.

With ``secure-aggregation`` and ``client-dp-clip = C > 0`` on a sum-only
method, the server cannot clip what it cannot see, so each client does the
work of :mod:`fedlr.privacy.client_dp` itself [1]_ [2]_:

1. its update ``u_i = x_i - x`` (the arrays it sends minus the round's global
   arrays it received) is clipped to L2 norm ``C`` (jointly over the arrays);
2. Skellam noise ``N_1 - N_2`` (``N_j ~ Poisson(mu)``, variance ``2 mu`` in
   units of the quantiser's step ``s = 2c / T``) is drawn per entry and added
   as ``k s`` in float space, before Flower's stochastic quantisation: with
   the level grid ``-c + j s``, ``quantise(y + k s) = quantise(y) + k``
   whenever nothing is clipped, so the noise lands on SecAgg+'s integer ring
   without forking Flower's mod;
3. the server unmasks only the noised sum ``S`` and publishes
   ``x + S / m`` (``m`` the nodes sent an instruction, fixed before any
   reply; a dropped node is a zero update).

``mu`` is set so that ``t`` survivors (SecAgg+'s reconstruction threshold:
no round finishes with fewer) already give the sum the noise of central DP:
``2 t mu s^2 = (z C)^2``. With ``k >= t`` survivors the sum's noise std is
``sqrt(k / t) z C``: up to ``sqrt(m / t)`` more than central DP when no node
drops (the price of not trusting the dropouts' noise to arrive), and the
round's epsilon is computed from the actual ``k``.

Accounting (no subsampling amplification: ``q = 1``, conservative; Flower's
sampling without replacement is not Poisson sampling and the Skellam bound
below is not composed with an amplification theorem here): round ``t`` is
the Skellam mechanism of total variance ``V_t = 2 k_t mu`` whose RDP of
integer order ``alpha`` is at most ([2]_, Theorem 3.5, with ``V = 2 mu``)

    alpha D2^2 / (2 V) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 V^2), 3 D1 / (2 V)),

``D2 = C / s + sqrt(d)`` (the L2 sensitivity in integer units: stochastic
rounding moves each of the ``d`` entries by less than one step) and
``D1 = min(sqrt(d) D2, D2^2)`` (integer vectors). Rounds compose by adding
RDP; ``epsilon = min_alpha RDP(alpha) + log(1 / delta) / (alpha - 1)``.

Clipping at the quantiser's range ``c`` would break the analysis:
:func:`check_range` refuses a ``c`` below ``C + 12 sigma_i`` (``sigma_i`` a
client's noise std in float units), and the nodes count what the range cut
(``secagg-clipped``).

References
----------
.. [1] Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism
   for Federated Learning with Secure Aggregation", ICML 2021.
.. [2] Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially
   Private Federated Learning", NeurIPS 2021.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from fedlr.errors import ConfigError, PrivacyUnsupportedError
from fedlr.privacy.client_dp import (
    CLIENT_DP_EPSILON,
    CLIENT_DP_REPRODUCIBLE,
    ClientDpLedger,
)
from fedlr.privacy.secagg import rounding_bound
from fedlr.privacy.settings import ClientDpSettings, default_delta
from fedlr.randomness import os_seed

__all__ = [
    "DP_CLIPPED",
    "ORDERS",
    "RANGE_SIGMAS",
    "check_range",
    "check_secure",
    "client_mu",
    "clip_update",
    "noise_generator",
    "publish",
    "sensitivities",
    "skellam",
    "skellam_epsilon",
    "skellam_rdp",
]

DP_CLIPPED = "client-dp-clipped"
"""Secure scalar and round metric: the clients whose update was clipped."""
RANGE_SIGMAS = 12.0
"""The quantiser's range must hold ``C`` plus this many client noise stds."""
ORDERS = (*range(2, 257), 384, 512, 768, 1024, 2048, 4096)
"""Integer RDP orders the epsilon is minimised over."""
_STREAM = 0xD15C
"""Tags the nodes' seeded stream (``reproducible-noise``)."""


def client_mu(
    noise_multiplier: float, clip: float, step: float, threshold: int
) -> float:
    """Each client's Poisson parameter: ``t`` clients' Skellam noise sums to
    variance ``(z C / s)^2`` (integer units), the noise of central DP."""
    if not (noise_multiplier > 0 and clip > 0 and step > 0 and threshold >= 1):
        raise PrivacyUnsupportedError(
            f"distributed client DP needs z > 0, C > 0, a step > 0 and a "
            f"threshold >= 1; got z={noise_multiplier}, C={clip}, step={step}, "
            f"t={threshold}"
        )
    return (noise_multiplier * clip / step) ** 2 / (2.0 * threshold)


def check_range(
    clipping_range: float, clip: float, noise_multiplier: float, threshold: int
) -> None:
    """Refuse a quantiser range ``c`` that would clip the noised summands.

    Raises
    ------
    ConfigError
        (key ``secagg-clipping-range``) if ``c < C + 12 z C / sqrt(t)``.
    """
    sigma = noise_multiplier * clip / math.sqrt(threshold)
    need = clip + RANGE_SIGMAS * sigma
    if clipping_range < need:
        raise ConfigError(
            "secagg-clipping-range",
            f"distributed client DP adds noise of std {sigma:.3g} per client to "
            f"updates of norm <= {clip:g}; the range {clipping_range:g} must be at "
            f"least C + {RANGE_SIGMAS:g} std = {need:.3g}, or the quantiser clips "
            "the noise and the analysis breaks",
        )


def check_secure(
    settings: ClientDpSettings,
    clipping_range: float,
    threshold: int,
    extra_records: Mapping[str, object],
) -> None:
    """Refuse distributed client DP where the clients cannot clip everything.

    Raises
    ------
    PrivacyUnsupportedError
        If the replies carry extra records (the clients clip the main one).
    ConfigError
        From :func:`check_range`.
    """
    if extra_records:
        raise PrivacyUnsupportedError(
            f"client-dp-clip with secure-aggregation: the replies carry extra "
            f"records {sorted(extra_records)}, which the clients would not clip; "
            "use a method without them"
        )
    check_range(clipping_range, settings.clip, settings.noise_multiplier, threshold)


def noise_generator(
    reproducible: bool, seed: int, server_round: int, partition: int
) -> np.random.Generator:
    """The node's noise generator: OS-seeded, or with ``reproducible`` the
    run seed, round and partition (anyone who knows them can subtract it)."""
    if reproducible:
        return np.random.default_rng([seed, server_round, partition, _STREAM])
    return np.random.default_rng(os_seed())


def skellam(
    shape: tuple[int, ...], mu: float, generator: np.random.Generator
) -> NDArray[np.int64]:
    """Symmetric Skellam draws ``N_1 - N_2``, ``N_j ~ Poisson(mu)`` (var ``2 mu``)."""
    first = generator.poisson(mu, shape).astype(np.int64)
    return first - generator.poisson(mu, shape).astype(np.int64)


def clip_update(
    update: Sequence[NDArray[np.float64]], clip: float
) -> tuple[list[NDArray[np.float64]], bool]:
    """``update`` scaled to L2 norm at most ``clip`` (jointly); whether it was
    cut. A non-finite update becomes 0."""
    norm = math.sqrt(sum(float(np.sum(np.square(a))) for a in update))
    if not math.isfinite(norm):
        return [np.zeros_like(a) for a in update], True
    factor = min(1.0, clip / norm) * (1.0 - 1e-12) if norm > clip else 1.0
    return [a * factor for a in update], norm > clip


def sensitivities(clip: float, step: float, dim: int) -> tuple[float, float]:
    """``(D2, D1)`` of one client's rounded, clipped update in integer units."""
    l2 = clip / step + math.sqrt(dim)
    return l2, min(math.sqrt(dim) * l2, l2 * l2)


def skellam_rdp(alpha: float, variance: float, l2: float, l1: float) -> float:
    """The Skellam mechanism's RDP bound at order ``alpha`` (module doc)."""
    first = alpha * l2**2 / (2.0 * variance)
    second = ((2.0 * alpha - 1.0) * l2**2 + 6.0 * l1) / (4.0 * variance**2)
    return first + min(second, 3.0 * l1 / (2.0 * variance))


def skellam_epsilon(
    rounds: Sequence[tuple[float, float, float]], delta: float
) -> float:
    """``epsilon`` at ``delta`` of the composed rounds ``(V, D2, D1)``.

    Raises
    ------
    PrivacyUnsupportedError
        If ``delta`` is not in (0, 1) or a variance is not > 0.
    """
    if not 0 < delta < 1:
        raise PrivacyUnsupportedError(f"delta must be in (0, 1), got {delta}")
    if any(not v > 0 for v, _, _ in rounds):
        raise PrivacyUnsupportedError(f"a round's noise variance is not > 0: {rounds}")
    if not rounds:
        return 0.0
    return min(
        sum(skellam_rdp(a, v, l2, l1) for v, l2, l1 in rounds)
        + math.log(1.0 / delta) / (a - 1)
        for a in ORDERS
    )


def publish(
    base: Mapping[str, NDArray[np.floating]],
    keys: Sequence[tuple[str, str]],
    sums: Sequence[NDArray[np.float64]],
    *,
    settings: ClientDpSettings,
    ledger: ClientDpLedger | None,
    step: float,
    survivors: tuple[int, int, int],
    population: int,
) -> tuple[dict[str, NDArray[np.floating]], dict[str, float]]:
    """The server's release: ``x + S / m`` per key, and the round's metrics.

    Parameters
    ----------
    base : mapping of str to array
        ``x``, the round's global arrays (what the nodes received).
    keys : sequence of (key, dtype)
        The summed arrays in ``sums``' order.
    sums : sequence of float64 arrays
        ``S``: the unmasked, dequantised sums of the noised clipped updates.
    settings : ClientDpSettings
    ledger : ClientDpLedger
        This round's ``(sqrt(V) / D2, 1, 1)`` is added; the epsilon is of
        its whole history.
    step : float
        The quantiser's step ``s``.
    survivors : (k, t, m)
        Nodes in the sum, SecAgg+'s threshold, nodes sent an instruction.
    population : int
        Nodes the round sampled from (the default delta).

    Raises
    ------
    PrivacyUnsupportedError
        If there is no ledger, or a summed key has no global array of its
        shape.
    """
    k, threshold, sent = survivors
    if ledger is None:
        raise PrivacyUnsupportedError("distributed client DP needs the ledger")
    means: dict[str, NDArray[np.floating]] = {}
    for (key, dtype), total in zip(keys, sums, strict=True):
        if key not in base or base[key].shape != total.shape:
            raise PrivacyUnsupportedError(
                f"distributed client DP: no global array '{key}' of shape "
                f"{tuple(total.shape)} to add the mean update to"
            )
        mean = np.asarray(base[key], np.float64) + np.asarray(total, np.float64) / sent
        means[key] = mean.astype(dtype)
    mu = client_mu(settings.noise_multiplier, settings.clip, step, threshold)
    variance = 2.0 * k * mu
    l2, l1 = sensitivities(settings.clip, step, sum(int(t.size) for t in sums))
    ledger.record(math.sqrt(variance) / l2, 1.0)
    rounds = [((z * l2) ** 2, l2, l1) for z, _, _ in ledger.history]
    delta = settings.delta or default_delta(max(population, sent))
    return means, {
        CLIENT_DP_EPSILON: skellam_epsilon(rounds, delta),
        "client-dp-noise-std": math.sqrt(variance) * step / sent,
        "client-dp-sent": float(sent),
        CLIENT_DP_REPRODUCIBLE: 1.0 if settings.reproducible else 0.0,
        "secagg-bound": k * step / sent + rounding_bound(means.values()),
    }
