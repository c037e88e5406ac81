"""Privacy refused at configuration: what a method cannot have, read from its
registration (its payload kind, ``sum_only``, its client features' traits
and the extra records its replies carry), before any node trains.

:func:`check_privacy` refuses client-level DP for a method that is not
sum-only or whose replies carry records the server sees, and DP-SGD beside a
gradient transform or a loss term that reads the data; :func:`check_robust`
refuses client-level DP beside a robust rule. Both paths to a strategy make
the same refusal before any node trains: :func:`fedlr.strategies.registry.resolve`
for a run config, and the strategy's constructor for a plug-in user
(:class:`PrivacyTraits`, which each registration attaches to its strategy
class).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedlr.client_apps.gate import trains_with_dp_sgd
from fedlr.errors import ConfigError, PrivacyUnsupportedError
from fedlr.privacy.settings import PrivacyConfig
from fedlr.robust.rules import RobustConfig

if TYPE_CHECKING:
    from fedlr.client.features import ClientFeature, Record

__all__ = [
    "PrivacyTraits",
    "check_privacy",
    "check_robust",
    "dp_sgd_conflict",
    "reply_records",
]


@dataclass(frozen=True)
class PrivacyTraits:
    """What :func:`check_privacy` reads of a method's registration.

    :func:`fedlr.strategies.registration.register_method` attaches one to
    the strategy class it registers (``privacy_traits``), so that the
    strategy's constructor makes the run config's refusal too: a plug-in
    user who builds ``ScaffoldLoRA(layout=..., privacy=...)`` with
    client-level DP is refused there, before any instruction goes out, not
    in the first round after the clients trained.

    Attributes
    ----------
    method : str
        The registered name.
    sum_only : bool
        The registration's ``sum_only``.
    payload : str
        The payload kind's name.
    features : tuple of ClientFeature subclasses
        The method's client features.
    records : tuple of Record
        Extra reply records no feature declares.
    """

    method: str
    sum_only: bool
    payload: str
    features: tuple[type[ClientFeature], ...] = ()
    records: tuple[Record, ...] = ()

    def check(self, privacy: PrivacyConfig, options: Any = None) -> None:
        """:func:`check_privacy` for this method under ``privacy``.

        Raises
        ------
        PrivacyUnsupportedError
            As :func:`check_privacy`.
        """
        check_privacy(
            self.method,
            self.sum_only,
            self.payload,
            privacy,
            self.features,
            options,
            self.records,
        )


def check_privacy(
    method: str,
    sum_only: bool,
    payload: str,
    privacy: PrivacyConfig,
    features: Sequence[type[ClientFeature]] = (),
    options: Any = None,
    records: Sequence[Record] = (),
) -> None:
    """Refuse, at configuration, a privacy mechanism the method cannot have.

    Read from the method's registration: its payload kind, its ``sum_only``
    trait, its client features' traits
    (:class:`fedlr.client.features.ClientFeature`: what each adds to local training
    under ``options``, whether a loss term reads the data, the extra records
    its replies carry) and the extra records the method's own client handler
    sends (``records``: FOT's sketches, QR-Mix's eigenpairs).

    Parameters
    ----------
    method : str
    sum_only : bool
    payload : str
        The payload kind's name.
    privacy : PrivacyConfig
    features : sequence of ClientFeature subclasses
        The method's client features.
    options : Options, optional
        The method's options (a feature's training change may depend on them:
        FedProx's ``proximal-mu`` = 0 adds none).
    records : sequence of Record
        Extra reply records no feature declares.

    Raises
    ------
    PrivacyUnsupportedError
        DP-SGD for a method whose payload kind has no DP-SGD
        (:data:`fedlr.client_apps.gate.ACCESS`), whose own replies carry
        records computed from the data (``records``), or whose
        clients transform the gradients or add a loss term that reads the
        data (a term that does not is added after the clipping and noise);
        client-level DP for a method that is not sum-only, or whose replies
        carry extra records (which it would neither clip nor noise). Each
        message names the method, the feature or record, and the reason.
    """
    if privacy.dp_sgd is not None and not trains_with_dp_sgd(payload):
        raise PrivacyUnsupportedError(
            f"dp-max-grad-norm: DP-SGD serves the payloads with a per-example "
            f"gradient sampler (LoRA adapters, the vision models); method "
            f"'{method}' trains a '{payload}' payload (no per-example "
            "gradient sampler for its layers); use a LoRA method or set "
            "dp-max-grad-norm = 0"
        )
    if privacy.dp_sgd is not None and records:
        listed = "; ".join(f"'{r.name}' ({r.holds.replace('`', '')})" for r in records)
        raise PrivacyUnsupportedError(
            f"dp-max-grad-norm: method '{method}' replies with records computed "
            f"from the node's data beside the trained weights: {listed}. DP-SGD "
            "noises the training only, so these would leave un-noised; use "
            "a method without them or set dp-max-grad-norm = 0"
        )
    if privacy.dp_sgd is not None:
        unbounded = [
            text for f in features if (text := dp_sgd_conflict(f, options)) is not None
        ]
        if unbounded:
            raise PrivacyUnsupportedError(
                "dp-max-grad-norm: DP-SGD clips each example's gradient of the "
                f"loss alone; method '{method}' adds {' and '.join(unbounded)}, "
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
    if privacy.client_dp is not None:
        sent = reply_records(features, records)
        if sent:
            listed = "; ".join(
                f"'{r.name}' ({who}: {r.holds.replace('`', '')})" for who, r in sent
            )
            raise PrivacyUnsupportedError(
                f"client-dp-clip: method '{method}' replies with extra records "
                f"beside its arrays: {listed}. Client-level DP clips and noises "
                "the arrays only, so these would reach the server as sent, "
                "outside the epsilon; use a method without extra records or set "
                "client-dp-clip = 0"
            )


def dp_sgd_conflict(feature: type[ClientFeature], options: Any) -> str | None:
    """What ``feature`` adds to local training that DP-SGD cannot serve, or
    ``None``.

    A feature's training change
    (:meth:`~fedlr.client.features.ClientFeature.training_change`)
    is served when it is only a loss term that reads no data
    (:attr:`~fedlr.client.features.ClientFeature.loss_reads_data` ``False``): DP-SGD
    adds its gradient after the per-example clipping and noise
    (:mod:`fedlr.privacy.dp_sgd`). A gradient transform, or a loss term that
    reads the data, is not: the clipping would not bound it.
    """
    change = feature.training_change(options)
    if change is None:
        return None
    if feature.changes_gradients():
        return change
    if feature.adds_loss() and feature.loss_reads_data:
        return f"{change}, a loss term that reads the data ({feature.__name__})"
    return None


def reply_records(
    features: Sequence[type[ClientFeature]], records: Sequence[Record] = ()
) -> list[tuple[str, Record]]:
    """The extra records a method's replies may carry, each with who sends it:
    its client features' (:attr:`~fedlr.client.features.ClientFeature.sends`) and
    ``records`` (the method's own client handler's)."""
    sent = [(f.__name__, r) for f in features for r in f.sends]
    return sent + [("the method's client", r) for r in records]


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
