"""The differential-privacy settings of a run, checked once.

Two independent mechanisms (:doc:`docs/privacy.md <privacy>`):

* :class:`DpSgdSettings`, sample-level DP-SGD on every client: per-sample
  gradient clipping to ``dp-max-grad-norm`` and Gaussian noise of standard
  deviation ``dp-noise-multiplier * dp-max-grad-norm`` on each step's sum, over
  Poisson-sampled batches (:mod:`fedlr.privacy.dp_sgd`);
* :class:`ClientDpSettings`, client-level DP on the server: each client's
  update clipped to ``client-dp-clip`` and Gaussian noise added to the
  fixed-denominator mean (:mod:`fedlr.privacy.client_dp`).

Nothing here imports Opacus or Flower; the run config
(:class:`fedlr.config.run.RunConfig`) builds these from its keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedlr.errors import ConfigError

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_DELTA",
    "ClientDpSettings",
    "DpSgdSettings",
    "PrivacyConfig",
    "default_delta",
]

ACCOUNTANTS = ("prv", "rdp")
"""Values of ``dp-accountant``: Opacus's RDP or PRV accountant."""

DEFAULT_DELTA = 1e-5
"""The largest delta chosen when ``dp-delta`` / ``client-dp-delta`` is 0."""


def default_delta(population: int) -> float:
    """``min(1e-5, 1 / (10 n))``: a delta well below ``1 / n``.

    ``n`` is the number of records protected: a client's training examples
    (DP-SGD) or the federation's nodes (client-level DP).
    """
    return min(DEFAULT_DELTA, 1.0 / (10.0 * max(int(population), 1)))


def _finite_at_least_zero(value: float, key: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(key, f"must be finite and >= 0, got {value}")


def _accountant(value: str) -> None:
    if value not in ACCOUNTANTS:
        raise ConfigError(
            "dp-accountant", f"must be one of {list(ACCOUNTANTS)}, got {value!r}"
        )


def _delta(value: float, key: str) -> None:
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise ConfigError(
            key, f"must be in [0, 1) (0: min(1e-5, 1/(10 n))), got {value}"
        )


@dataclass(frozen=True)
class DpSgdSettings:
    """Sample-level DP-SGD on the clients.

    Attributes
    ----------
    max_grad_norm : float
        ``C``: every example's gradient is clipped to this L2 norm (> 0).
    noise_multiplier : float
        ``sigma``: the noise's standard deviation is ``sigma * C``; 0 derives
        it from ``epsilon`` (Opacus's ``get_noise_multiplier`` for the planned
        ``rounds`` x local steps at the client's sampling rate).
    epsilon : float
        The client's budget; 0: none (``noise_multiplier`` must be set). A
        client refuses a round that would spend more
        (:class:`~fedlr.errors.PrivacyBudgetError`).
    delta : float
        0: ``min(1e-5, 1 / (10 n))``, ``n`` the client's examples.
    accountant : {"prv", "rdp"}
        Opacus's PRV accountant (tight, the default) or RDP (an upper bound).
    rounds : int
        Rounds the budget is planned for (the run's ``num-server-rounds``).
    reproducible : bool
        Ask the nodes for noise and batches drawn from the run seed
        (``reproducible-noise``, a simulation option: the epsilon is then no
        guarantee). A node honours it only if its own node config allows it
        (``dp-allow-reproducible-noise``).
    """

    max_grad_norm: float
    noise_multiplier: float = 0.0
    epsilon: float = 0.0
    delta: float = 0.0
    accountant: str = "prv"
    rounds: int = 1
    reproducible: bool = False

    def __post_init__(self) -> None:
        for value, key in (
            (self.max_grad_norm, "dp-max-grad-norm"),
            (self.noise_multiplier, "dp-noise-multiplier"),
            (self.epsilon, "dp-epsilon"),
        ):
            _finite_at_least_zero(value, key)
        _delta(self.delta, "dp-delta")
        _accountant(self.accountant)
        if self.max_grad_norm <= 0:
            raise ConfigError(
                "dp-max-grad-norm", f"must be > 0 for DP-SGD, got {self.max_grad_norm}"
            )
        if self.noise_multiplier <= 0 and self.epsilon <= 0:
            raise ConfigError(
                "dp-max-grad-norm",
                "DP-SGD needs noise: set dp-noise-multiplier > 0 or a budget "
                "dp-epsilon > 0 (the multiplier is then derived from it)",
            )
        if self.rounds < 1:
            raise ConfigError("num-server-rounds", f"must be >= 1, got {self.rounds}")

    def instruction(self) -> dict[str, Any]:
        """The ConfigRecord values a train instruction carries."""
        return {
            "dp-max-grad-norm": float(self.max_grad_norm),
            "dp-noise-multiplier": float(self.noise_multiplier),
            "dp-epsilon": float(self.epsilon),
            "dp-delta": float(self.delta),
            "dp-accountant": self.accountant,
            "dp-rounds": int(self.rounds),
            "dp-reproducible-noise": bool(self.reproducible),
        }


@dataclass(frozen=True)
class ClientDpSettings:
    """Client-level DP on the server (DP-FedAvg with fixed clipping).

    Attributes
    ----------
    clip : float
        ``C``: each client's update (the change of the arrays it sends) is
        clipped to this L2 norm (> 0).
    noise_multiplier : float
        ``z``: the mean's noise has standard deviation ``z C / m``, ``m`` the
        number of clients sent an instruction in the round (> 0).
    delta : float
        0: ``min(1e-5, 1 / (10 N))``, ``N`` the federation's nodes.
    seed : int
        Seed of the noise (with the round) when ``reproducible``; otherwise
        unused: the noise comes from an OS-seeded generator.
    reproducible : bool
        Draw the noise from ``seed`` and the round (``reproducible-noise``, a
        simulation option: every party that knows the seed can subtract it,
        so the epsilon is no guarantee).
    accountant : {"prv", "rdp"}
        Opacus's accountant of the reported epsilon.
    """

    clip: float
    noise_multiplier: float
    delta: float = 0.0
    seed: int = 0
    reproducible: bool = False
    accountant: str = "prv"

    def __post_init__(self) -> None:
        _finite_at_least_zero(self.clip, "client-dp-clip")
        _finite_at_least_zero(self.noise_multiplier, "client-dp-noise-multiplier")
        _delta(self.delta, "client-dp-delta")
        if self.clip <= 0:
            raise ConfigError(
                "client-dp-clip", f"must be > 0 for client-level DP, got {self.clip}"
            )
        if self.noise_multiplier <= 0:
            raise ConfigError(
                "client-dp-noise-multiplier",
                f"must be > 0 with client-dp-clip (clipping alone is not DP), got "
                f"{self.noise_multiplier}",
            )


@dataclass(frozen=True)
class PrivacyConfig:
    """A strategy's privacy settings: either mechanism, both, or none."""

    dp_sgd: DpSgdSettings | None = None
    client_dp: ClientDpSettings | None = None

    @property
    def active(self) -> bool:
        return self.dp_sgd is not None or self.client_dp is not None

    @property
    def reproducible(self) -> bool:
        """Whether a mechanism draws its noise from the run seed (its epsilon
        is then no guarantee)."""
        return any(
            m is not None and m.reproducible for m in (self.dp_sgd, self.client_dp)
        )

    @classmethod
    def from_values(
        cls,
        *,
        dp_max_grad_norm: float = 0.0,
        dp_noise_multiplier: float = 0.0,
        dp_epsilon: float = 0.0,
        dp_delta: float = 0.0,
        dp_accountant: str = "prv",
        rounds: int = 1,
        client_dp_clip: float = 0.0,
        client_dp_noise_multiplier: float = 0.0,
        client_dp_delta: float = 0.0,
        seed: int = 0,
        reproducible_noise: bool = False,
    ) -> PrivacyConfig:
        """The settings of the run-config keys (0 switches a mechanism off).

        Raises
        ------
        ConfigError
            A noise or budget key without its clip key (or the reverse), or
            a value out of range, naming the key.
        """
        for value, key in (
            (dp_max_grad_norm, "dp-max-grad-norm"),
            (dp_noise_multiplier, "dp-noise-multiplier"),
            (dp_epsilon, "dp-epsilon"),
            (client_dp_clip, "client-dp-clip"),
            (client_dp_noise_multiplier, "client-dp-noise-multiplier"),
        ):
            _finite_at_least_zero(value, key)
        _delta(dp_delta, "dp-delta")
        _delta(client_dp_delta, "client-dp-delta")
        _accountant(dp_accountant)
        dp_sgd = None
        if dp_max_grad_norm > 0:
            dp_sgd = DpSgdSettings(
                max_grad_norm=dp_max_grad_norm,
                noise_multiplier=dp_noise_multiplier,
                epsilon=dp_epsilon,
                delta=dp_delta,
                accountant=dp_accountant,
                rounds=rounds,
                reproducible=reproducible_noise,
            )
        elif dp_noise_multiplier != 0 or dp_epsilon != 0:
            raise ConfigError(
                "dp-max-grad-norm",
                "dp-noise-multiplier / dp-epsilon need the per-sample clip "
                "dp-max-grad-norm > 0 (DP-SGD is off while it is 0)",
            )
        client_dp = None
        if client_dp_clip > 0:
            client_dp = ClientDpSettings(
                clip=client_dp_clip,
                noise_multiplier=client_dp_noise_multiplier,
                delta=client_dp_delta,
                seed=seed,
                reproducible=reproducible_noise,
                accountant=dp_accountant,
            )
        elif client_dp_noise_multiplier != 0:
            raise ConfigError(
                "client-dp-clip",
                "client-dp-noise-multiplier needs client-dp-clip > 0 (client-level "
                "DP is off while it is 0)",
            )
        return cls(dp_sgd=dp_sgd, client_dp=client_dp)
