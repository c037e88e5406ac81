"""Client-level differential privacy on the server (DP-FedAvg, fixed clipping).

Client-level DP [1]_ protects a whole client: whatever one client's data, the
published global model changes little in distribution. Each round, for the
``m`` nodes sent an instruction (``m`` is fixed before any reply, so it is a
data-independent denominator):

1. every reply's update ``u_i = x_i - x`` (the change of the arrays it sends
   against the round's global arrays) is clipped to L2 norm ``C``
   (``client-dp-clip``): ``u_i <- u_i min(1, C / ||u_i||)``;
2. the method aggregates the unweighted, fixed-denominator mean
   ``x + sum_i u_i / m`` (``num-examples`` weighting would let a client's
   claimed count scale its influence past ``C / m``; a dropped node counts
   as a zero update);
3. Gaussian noise ``N(0, (z C / m)^2)`` per entry (``z``,
   ``client-dp-noise-multiplier``) is added to that mean, before the method's
   post-processing (FedSVD's SVD, FedAvgM's momentum).

The sensitivity of ``sum_i u_i / m`` to one client is ``C / m``, so step 3 is
the Gaussian mechanism with noise multiplier ``z``. The rounds compose as the
subsampled Gaussian mechanism with sampling rate ``q = m / N`` (``N`` the
federation's nodes), accounted by Opacus's RDP accountant; ``epsilon`` at
``delta`` (``client-dp-delta``; 0: ``min(1e-5, 1 / (10 N))``) is reported per
round as ``client-dp-epsilon``. Flower samples ``m`` nodes uniformly without
replacement; the accountant treats it as Poisson sampling at the same rate,
as DP-FedAvg's analysis does.

Where this is well-defined: the *sum-only* methods (the registry's
``sum_only`` trait), whose aggregate is a linear function (a mean) of the
arrays the clients send, followed by post-processing. The clipping space is
then the space of those arrays; the LoRA family's product space
``B_i A_i - B A`` (robust ``norm-clip``) does not bound the mean of the
factors, so it cannot calibrate the noise. Methods whose aggregate is not a
mean of the sent arrays (FedEx-LoRA's residual ``mean(B_i A_i) - B A``,
FedSpec's SVD of the mean of products, FlexLoRA, VeRA-FedEx) are refused with
:class:`~fedlr.errors.PrivacyUnsupportedError`, and so are replies with extra
records (SCAFFOLD's control deltas would travel un-noised).

The noise is added to every update (``x_i + xi`` for one draw ``xi``), so a
kernel that averages them with equal weights gets ``mean + xi`` exactly.

References
----------
.. [1] McMahan et al., "Learning Differentially Private Recurrent Language
   Models", ICLR 2018.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from fedlr.errors import ConfigError, PrivacyUnsupportedError
from fedlr.privacy.accounting import epsilon
from fedlr.privacy.settings import ClientDpSettings, PrivacyConfig, default_delta
from fedlr.robust import ParameterSpace, RobustConfig
from fedlr.updates import ClientUpdate

__all__ = [
    "CLIENT_DP_EPSILON",
    "DP_EPSILON",
    "check_privacy",
    "check_robust",
    "client_level_epsilon",
    "clip_to_fixed_mean",
    "gaussian_noise",
    "largest_spent",
    "noise_generator",
    "privatize",
]

CLIENT_DP_EPSILON = "client-dp-epsilon"
"""Round metric and results column: the run's client-level ``epsilon`` so far."""
DP_EPSILON = "dp-epsilon"
"""Round metric and results column: the largest DP-SGD ``epsilon`` a client of
the round reported (``dp-epsilon-spent``)."""
_SPENT = "dp-epsilon-spent"


def check_privacy(
    method: str,
    sum_only: bool,
    payload: str,
    privacy: PrivacyConfig,
    training_changes: Sequence[str] = (),
) -> None:
    """Refuse a privacy mechanism the method cannot have.

    ``training_changes`` are what the method's client features add to local
    training under its options
    (:meth:`fedlr.features.ClientFeature.training_change`).

    Raises
    ------
    PrivacyUnsupportedError
        DP-SGD for a method that does not train LoRA adapters or whose
        clients change the loss or the gradients; client-level DP for a
        method that is not sum-only.
    """
    if privacy.dp_sgd is not None and payload != "lora":
        raise PrivacyUnsupportedError(
            f"dp-max-grad-norm: DP-SGD serves methods that train LoRA adapters; "
            f"method '{method}' trains a '{payload}' payload (no per-example "
            "gradient sampler for its layers); use a LoRA method or set "
            "dp-max-grad-norm = 0"
        )
    if privacy.dp_sgd is not None and training_changes:
        raise PrivacyUnsupportedError(
            f"dp-max-grad-norm: DP-SGD clips each example's gradient of the loss "
            f"alone; method '{method}' adds {' and '.join(training_changes)}, "
            "which that clipping would not bound; set dp-max-grad-norm = 0 or "
            "switch the feature off"
        )
    if privacy.client_dp is not None and not sum_only:
        raise PrivacyUnsupportedError(
            f"client-dp-clip: client-level DP needs an aggregate that is a mean of "
            f"the clients' arrays (a sum-only method); method '{method}' combines "
            "each client's factors non-linearly, so clipping the sent arrays does "
            "not bound its sensitivity; use fedavg-lora, ffa-lora, fedsvd, "
            "fedavg-vera, ... or set client-dp-clip = 0"
        )


def check_robust(privacy: PrivacyConfig, robust: RobustConfig) -> None:
    """Client-level DP and a robust rule do not combine (both set the weights).

    Raises
    ------
    ConfigError
        (key ``client-dp-clip``) if both are on.
    """
    if privacy.client_dp is not None and robust.active:
        raise ConfigError(
            "client-dp-clip",
            f"client-level DP weighs every client equally and clips them itself; "
            f"robust '{robust.rule}' (or max-client-weight < 1) would re-weigh or "
            "drop clients by their updates, which the privacy analysis does not "
            "cover; use robust = none",
        )


def clip_to_fixed_mean(
    updates: Sequence[ClientUpdate],
    space: ParameterSpace,
    clip: float,
    denominator: int,
) -> tuple[list[ClientUpdate], int]:
    """Steps 1 and 2: clipped updates whose equal-weight mean is
    ``x + sum_i clip(u_i) / denominator``.

    Each update is moved to ``x + (m / W) clip(u_i)`` (``m`` updates, ``W`` =
    ``denominator`` >= ``m``) and given weight 1.

    Returns
    -------
    updates : list of ClientUpdate
    clipped : int
        How many updates had a norm above ``clip``.
    """
    m = len(updates)
    scale = m / denominator
    out: list[ClientUpdate] = []
    clipped = 0
    for update in updates:
        norm = space.norm(update)
        factor = 1.0
        if not math.isfinite(norm):
            factor = 0.0
            clipped += 1
        elif norm > clip:
            factor = clip / norm
            clipped += 1
        moved = space.shrink(update, factor * scale)
        out.append(
            dataclasses.replace(
                moved, weight=1.0, clip_factor=update.clip_factor * factor * scale
            )
        )
    return out, clipped


def gaussian_noise(
    shapes: Mapping[str, tuple[int, ...]], std: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """``N(0, std^2)`` per entry of every key (float64, keys in sorted order)."""
    return {
        key: torch.randn(
            tuple(shapes[key]), generator=generator, dtype=torch.float64
        ).mul_(std)
        for key in sorted(shapes)
    }


def noise_generator(seed: int, server_round: int) -> torch.Generator:
    """The generator of round ``server_round``'s noise (a function of the run
    seed and the round only, so a resumed run draws the same noise)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + server_round * 7_919 + 17)


def client_level_epsilon(
    noise_multiplier: float, sample_rate: float, rounds: int, delta: float
) -> float:
    """``epsilon`` of ``rounds`` subsampled Gaussian releases (Opacus RDP)."""
    return epsilon([(noise_multiplier, sample_rate, rounds)], delta, "rdp")


def privatize(
    updates: Sequence[ClientUpdate],
    current: Mapping[str, torch.Tensor],
    keys: Sequence[str],
    settings: ClientDpSettings,
    *,
    sent: int,
    population: int,
    server_round: int,
) -> tuple[list[ClientUpdate], dict[str, float]]:
    """Clip, fix the denominator, add the noise (steps 1-3 of the module).

    Parameters
    ----------
    updates : sequence of ClientUpdate
        The round's validated replies.
    current : mapping of str to torch.Tensor
        The round's global state.
    keys : sequence of str
        The arrays a reply carries (the mean that gets the noise).
    settings : ClientDpSettings
    sent : int
        ``m``: nodes sent an instruction this round (at least the replies).
    population : int
        ``N``: nodes the round sampled from.
    server_round : int
        Seeds the noise with ``settings.seed``; the number of releases so far.

    Returns
    -------
    updates : list of ClientUpdate
        Weight 1 each; their mean is the noised fixed-denominator mean.
    metrics : dict of str to float
        ``client-dp-clipped``, ``client-dp-noise-std`` and ``client-dp-epsilon``.

    Raises
    ------
    PrivacyUnsupportedError
        If a reply carries extra records.
    """
    extras = sorted({name for u in updates for name in u.extras})
    if extras:
        raise PrivacyUnsupportedError(
            f"client-dp-clip: the replies carry extra records {extras}, which "
            "client-level DP does not clip or noise; use a method without them"
        )
    denominator = max(int(sent), len(updates), 1)
    space = ParameterSpace(current, list(keys))
    clipped, count = clip_to_fixed_mean(updates, space, settings.clip, denominator)
    std = settings.noise_multiplier * settings.clip / denominator
    generator = noise_generator(settings.seed, server_round)
    shapes = (
        {key: tuple(clipped[0].arrays[key].shape) for key in keys} if clipped else {}
    )
    noise = gaussian_noise(shapes, std, generator)
    noised = [
        dataclasses.replace(
            u,
            arrays={
                **u.arrays,
                **{
                    k: (u.arrays[k].to(torch.float64) + xi).to(u.arrays[k].dtype)
                    for k, xi in noise.items()
                },
            },
        )
        for u in clipped
    ]
    nodes = max(int(population), denominator)
    delta = settings.delta or default_delta(nodes)
    spent = client_level_epsilon(
        settings.noise_multiplier, denominator / nodes, server_round, delta
    )
    return noised, {
        "client-dp-clipped": float(count),
        "client-dp-noise-std": std,
        CLIENT_DP_EPSILON: spent,
    }


def largest_spent(updates: Sequence[ClientUpdate]) -> float | None:
    """The largest ``dp-epsilon-spent`` the replies report (DP-SGD), if any."""
    spent = [u.metrics[_SPENT] for u in updates if _SPENT in u.metrics]
    return max(spent) if spent else None
