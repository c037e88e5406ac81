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
the Gaussian mechanism with noise multiplier ``z``. ``m`` is counted when the
instructions go out (the round's ``instructed``,
:class:`fedlr.round.value.Round`), so a reply that is lost,
fails validation or is dropped by the update-size screen counts as a zero
update and never shrinks the denominator. Under client-level DP the screen
judges each update on its own (``ReplyChecks.screen_update_sizes``: against
``screen-ratio`` times the published global state's norm), so one client's
reply cannot decide whether another's is kept.

The rounds compose as subsampled Gaussian mechanisms: round ``t`` releases
one ``(z, q_t = m_t / N_t, 1)`` (``N_t`` the nodes the round sampled from),
kept per round in a :class:`ClientDpLedger` (in the strategy's
``state_dict`` under :data:`CLIENT_DP_STATE`, so a resumed run keeps it, and
recorded before the kernel runs, so a rejected round still counts).
``epsilon`` at ``delta`` (``client-dp-delta``; 0: ``min(1e-5, 1 / (10 N))``)
of the whole history, by the ``dp-accountant`` (Opacus's PRV or RDP), is
reported per round as ``client-dp-epsilon``. Flower samples ``m`` nodes
uniformly without replacement; the accountant treats it as Poisson sampling
at the same rate, as DP-FedAvg's analysis does.

The noise comes from :func:`~fedlr.randomness.secure_generator` (OS
seeded): nobody who knows the run config can recompute and subtract it. With
``reproducible-noise`` it comes from the run seed and the round instead
(:func:`~fedlr.randomness.seeded_generator`), the round's metrics
carry ``client-dp-reproducible = 1`` and the epsilon is no guarantee.

Where this is well-defined: the *sum-only* methods (the registry's
``sum_only`` trait), whose aggregate is a linear function (a mean) of the
arrays the clients send, followed by post-processing. The clipping space is
then the space of those arrays; the LoRA family's product space
``B_i A_i - B A`` (robust ``norm-clip``) does not bound the mean of the
factors, so it cannot calibrate the noise. Methods whose aggregate is not a
mean of the sent arrays (FedEx-LoRA's residual ``mean(B_i A_i) - B A``,
FedSpec's SVD of the mean of products, FlexLoRA, VeRA-FedEx) are refused with
:class:`~fedlr.errors.PrivacyUnsupportedError`, and so are methods whose
replies carry extra records (SCAFFOLD's control deltas, FOT's sketches would
travel un-noised): both when the run config is resolved
(:func:`check_privacy`, from the registration's ``sum_only`` and the records
its client features and handler declare), and again per round for a reply
that carries one anyway (:func:`privatize`).

The noise is added to every update (``x_i + xi`` for one draw ``xi``), so a
kernel that averages them with equal weights gets ``mean + xi`` exactly.
Values computed from the replies without noise (``train-loss``, the gaps,
client counts) are outside the epsilon
(:func:`fedlr.runs.results.privacy_summary` names them in ``summary.json``).

References
----------
.. [1] McMahan et al., "Learning Differentially Private Recurrent Language
   Models", ICLR 2018.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fedlr.errors import CheckpointError, PrivacyUnsupportedError
from fedlr.privacy.accounting import History, epsilon
from fedlr.privacy.settings import ClientDpSettings, PrivacyConfig, default_delta
from fedlr.randomness import secure_generator, seeded_generator
from fedlr.robust.spaces import ParameterSpace
from fedlr.wire.updates import ClientUpdate

__all__ = [
    "CLIENT_DP_EPSILON",
    "CLIENT_DP_REPRODUCIBLE",
    "CLIENT_DP_STATE",
    "DP_EPSILON",
    "ClientDpLedger",
    "clip_to_fixed_mean",
    "gaussian_noise",
    "keep_ledger",
    "largest_spent",
    "noise_generator",
    "privatize",
]

CLIENT_DP_EPSILON = "client-dp-epsilon"
"""Round metric and results column: the run's client-level ``epsilon`` so far."""
CLIENT_DP_REPRODUCIBLE = "client-dp-reproducible"
"""Round metric: 1 when the round's noise came from the run seed
(``reproducible-noise``: the epsilon is no guarantee), else 0."""
CLIENT_DP_STATE = "client-dp-history"
"""Key of the :class:`ClientDpLedger`'s history in a strategy's ``state_dict``."""
DP_EPSILON = "dp-epsilon"
"""Round metric and results column: the largest DP-SGD ``epsilon`` a client of
the round reported (``dp-epsilon-spent``)."""
_SPENT = "dp-epsilon-spent"
_STREAM = 0xC11E
"""Tags client-level DP's seeded stream (``reproducible-noise``) apart from
the other streams of the same seed and round."""


def clip_to_fixed_mean(
    updates: Sequence[ClientUpdate],
    space: ParameterSpace,
    clip: float,
    denominator: int,
) -> tuple[list[ClientUpdate], int]:
    """Steps 1 and 2: clipped updates whose equal-weight mean is
    ``x + sum_i clip(u_i) / denominator``.

    Each update is moved to ``x + (k / W) clip(u_i)`` (``k`` updates, ``W`` =
    ``denominator`` >= ``k``) and given weight 1, so its share of the mean,
    ``clip(u_i) / W``, has norm at most ``clip / W`` whatever its
    ``num-examples``. A clipped update whose norm the cast back to its dtype
    left above ``clip`` is shrunk once more (``clip`` holds as measured).

    Returns
    -------
    updates : list of ClientUpdate
    clipped : int
        How many updates had a norm above ``clip`` (or not finite).

    Raises
    ------
    PrivacyUnsupportedError
        If ``denominator`` is smaller than the number of updates.
    """
    k = len(updates)
    if denominator < k:
        raise PrivacyUnsupportedError(
            f"client-dp-clip: {k} updates but a denominator of {denominator}; the "
            "denominator is the number of nodes sent an instruction"
        )
    scale = k / denominator if denominator else 0.0
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
        bounded = space.shrink(update, factor)
        after = space.norm(bounded)
        if after > clip:  # rounding in the update's dtype
            factor *= clip / after * (1.0 - 1e-6)
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


def noise_generator(settings: ClientDpSettings, server_round: int) -> torch.Generator:
    """The generator of round ``server_round``'s noise.

    :func:`~fedlr.randomness.secure_generator` (OS-seeded: nobody
    can replay it), or with ``settings.reproducible`` a generator of the run
    seed, the round and this mechanism's stream tag (the same noise in every
    run of the seed: anyone who knows it can subtract the noise).
    """
    if settings.reproducible:
        return seeded_generator([settings.seed, server_round, _STREAM])
    return secure_generator()


class ClientDpLedger:
    """The server's client-level DP releases: one ``(z, q, 1)`` per round.

    A round's entry is recorded when its noise is drawn, before the kernel
    runs: a round rejected afterwards (its state rolled back) still counts,
    which is conservative. :meth:`state` / :meth:`load` carry it through a
    checkpoint (:func:`keep_ledger`).
    """

    def __init__(self) -> None:
        self.history: History = []

    @classmethod
    def of(cls, privacy: PrivacyConfig) -> ClientDpLedger | None:
        """A new ledger when client-level DP is on, else ``None``."""
        return cls() if privacy.client_dp is not None else None

    def record(self, noise_multiplier: float, sample_rate: float) -> None:
        """Add one release."""
        self.history.append((float(noise_multiplier), float(sample_rate), 1))

    def epsilon(self, delta: float, kind: str) -> float:
        """``epsilon`` of every release so far at ``delta`` (accountant ``kind``)."""
        return epsilon(self.history, delta, kind)

    def state(self) -> list[list[float]]:
        """The history as JSON-like lists."""
        return [[z, q, float(n)] for z, q, n in self.history]

    def load(self, saved: Any) -> None:
        """Restore :meth:`state`'s value.

        Raises
        ------
        CheckpointError
            If an entry is not ``[z > 0, q in (0, 1], steps >= 1]``.
        """
        history: History = []
        for entry in list(saved):
            z, q, n = (float(v) for v in entry)
            if not (z > 0 and 0 < q <= 1 and n >= 1 and n == int(n)):
                raise CheckpointError(
                    f"'{CLIENT_DP_STATE}': entry {list(entry)} is not "
                    "[noise multiplier > 0, sample rate in (0, 1], steps >= 1]"
                )
            history.append((z, q, int(n)))
        self.history = history


def keep_ledger(cls: type) -> None:
    """Make ``cls``'s own ``state_dict`` / ``load_state_dict`` carry the
    strategy's ``client_dp_ledger`` (under :data:`CLIENT_DP_STATE`).

    Applied to every strategy class (``FedLRStrategy.__init_subclass__``), so
    a method that overrides them without calling ``super()`` keeps the
    history too. Without client-level DP nothing changes: the key is neither
    written nor accepted (a checkpoint that carries it is refused by the
    method's own loader, as any unknown key is).
    """
    for name, wrap in (("state_dict", _saving), ("load_state_dict", _loading)):
        method = vars(cls).get(name)
        if method is not None and not hasattr(method, "_keeps_ledger"):
            setattr(cls, name, wrap(method))


def _saving(method: Callable[[Any], dict[str, Any]]) -> Callable[..., Any]:
    @functools.wraps(method)
    def state_dict(self: Any) -> dict[str, Any]:
        state = method(self)
        ledger = getattr(self, "client_dp_ledger", None)
        if ledger is None:
            return state
        return {**state, CLIENT_DP_STATE: ledger.state()}

    state_dict._keeps_ledger = True  # type: ignore[attr-defined]
    return state_dict


def _loading(method: Callable[[Any, Mapping[str, Any]], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def load_state_dict(self: Any, state: Mapping[str, Any]) -> None:
        ledger = getattr(self, "client_dp_ledger", None)
        if ledger is None or getattr(self, "_loading_ledger", False):
            method(self, state)  # an inner (super()) call, or no client DP
            return
        rest = dict(state)
        if CLIENT_DP_STATE not in rest:
            raise CheckpointError(
                f"the strategy state has no '{CLIENT_DP_STATE}' (client-level DP's "
                "releases so far): the epsilon of a resumed run would leave out "
                "the rounds before it; resume from a checkpoint of this fedlr"
            )
        saved = rest.pop(CLIENT_DP_STATE)
        self._loading_ledger = True
        try:
            method(self, rest)
        finally:
            self._loading_ledger = False
        ledger.load(saved)

    load_state_dict._keeps_ledger = True  # type: ignore[attr-defined]
    return load_state_dict


def privatize(
    updates: Sequence[ClientUpdate],
    current: Mapping[str, torch.Tensor],
    keys: Sequence[str],
    settings: ClientDpSettings,
    *,
    sent: int | None,
    population: int,
    server_round: int,
    ledger: ClientDpLedger,
) -> tuple[list[ClientUpdate], dict[str, float]]:
    """Clip, fix the denominator, add the noise (steps 1-3 of the module).

    Parameters
    ----------
    updates : sequence of ClientUpdate
        The round's validated (and screened) replies.
    current : mapping of str to torch.Tensor
        The round's global state.
    keys : sequence of str
        The arrays a reply carries (the mean that gets the noise).
    settings : ClientDpSettings
    sent : int or None
        ``m``: nodes sent an instruction this round, counted before any
        reply was screened (``None``: not recorded, refused).
    population : int
        ``N``: nodes the round sampled from (``q = m / N``).
    server_round : int
        Seeds the noise with ``settings.seed`` when ``settings.reproducible``.
    ledger : ClientDpLedger
        The run's releases; this round's ``(z, m / N, 1)`` is added.

    Returns
    -------
    updates : list of ClientUpdate
        Weight 1 each; their mean is the noised fixed-denominator mean.
    metrics : dict of str to float
        ``client-dp-clipped``, ``client-dp-sent`` (``m``),
        ``client-dp-noise-std``, ``client-dp-epsilon`` (of the whole
        history) and ``client-dp-reproducible``.

    Raises
    ------
    PrivacyUnsupportedError
        If a reply carries extra records, or ``sent`` is unknown or smaller
        than the number of replies.
    """
    denominator = _checked_sent(updates, sent, server_round)
    space = ParameterSpace(current, list(keys))
    clipped, count = clip_to_fixed_mean(updates, space, settings.clip, denominator)
    std = settings.noise_multiplier * settings.clip / denominator
    shapes = (
        {key: tuple(clipped[0].arrays[key].shape) for key in keys} if clipped else {}
    )
    noise = gaussian_noise(shapes, std, noise_generator(settings, server_round))
    noised = [_plus(u, noise) for u in clipped]
    nodes = max(int(population), denominator)
    ledger.record(settings.noise_multiplier, denominator / nodes)
    delta = settings.delta or default_delta(nodes)
    return noised, {
        "client-dp-clipped": float(count),
        "client-dp-sent": float(denominator),
        "client-dp-noise-std": std,
        CLIENT_DP_EPSILON: ledger.epsilon(delta, settings.accountant),
        CLIENT_DP_REPRODUCIBLE: 1.0 if settings.reproducible else 0.0,
    }


def _checked_sent(
    updates: Sequence[ClientUpdate], sent: int | None, server_round: int
) -> int:
    """``m``, the noise's denominator: refuses replies with extra records
    (not clipped or noised) and an unknown number of nodes sent an
    instruction."""
    extras = sorted({name for u in updates for name in u.extras})
    if extras:
        raise PrivacyUnsupportedError(
            f"client-dp-clip: the replies carry extra records {extras}, which "
            "client-level DP does not clip or noise; use a method without them"
        )
    if sent is None or sent < 1:
        raise PrivacyUnsupportedError(
            f"client-dp-clip: round {server_round}: the number of nodes sent an "
            f"instruction is unknown ({sent}); the noise is calibrated to it, so "
            "aggregate only replies to instructions of configure_train"
        )
    return int(sent)


def _plus(update: ClientUpdate, noise: Mapping[str, torch.Tensor]) -> ClientUpdate:
    """``update`` with ``noise`` added to its arrays (in float64, cast back)."""
    arrays = update.arrays
    return dataclasses.replace(
        update,
        arrays={
            **arrays,
            **{
                k: (arrays[k].to(torch.float64) + xi).to(arrays[k].dtype)
                for k, xi in noise.items()
            },
        },
    )


def largest_spent(updates: Sequence[ClientUpdate]) -> float | None:
    """The largest ``dp-epsilon-spent`` the replies report (DP-SGD), if any."""
    spent = [u.metrics[_SPENT] for u in updates if _SPENT in u.metrics]
    return max(spent) if spent else None
