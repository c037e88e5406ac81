"""Secure aggregation (SecAgg+) settings, eligibility and error bound.

fedlr runs Flower's SecAgg+ protocol [1]_ (its masking, Shamir shares and
quantisation: ``flwr.client.mod.secaggplus_mod`` on the nodes, the stages
driven by :mod:`fedlr.server_apps.secagg`) for the train round's arrays of
methods whose server needs only sums (the registry trait ``sum_only``).
This module is the Flower-free part: the settings and their checks, the
refusal of other methods, how a reply's arrays become one flat vector of
summands and back, and the bound on what the quantisation costs.

What a client contributes
-------------------------
Client ``i`` with ``n_i`` examples and weight scale ``s`` (the largest
``num-examples`` the server accepts, ``n_i <= s``) masks one vector of

* ``y_i = (n_i / s) x_i`` for every array of the reply's main ArrayRecord
  (``arrays``: the factors, the head), whose server mean is weighted by
  examples; the server divides the secure sum by ``W = sum_i n_i / s``
  (``num-examples`` travels in plain, as in Flower's SecAgg+);
* ``y_i = x_i`` for every array of an extra record (SCAFFOLD's control
  deltas, GPSE's activation sketches), which sum-only methods reduce by an
  unweighted sum or mean; the server divides the secure sum by ``k``.

Error bound
-----------
Each entry is clipped to ``[-c, c]`` (``c = secagg-clipping-range``) and
stochastically rounded to one of ``T + 1`` levels (``T =
secagg-quantization-range``), a step of ``2c / T``. Every client's rounding
error is below one step, so with ``k`` clients and no entry clipped
(``|y_i| <= c``),

    |published mean - exact weighted mean|
        <= (2 c k / T + 4 k c 2**-52) / W + u / (1 - u) |published mean|

per entry, ``W = sum_i n_i / s`` (``= k`` when all clients hold ``s``
examples: the first term is then ``2c / T``, 3.8e-6 at the defaults), and
``2 c / T`` plus the same float terms for the extra records' means. The
second term is the float64 arithmetic of quantising, summing and
dequantising values up to ``k c`` (below 1e-12 at the documented settings);
the third is the cast of the float64 mean to the arrays' dtype, ``u =
2**-24`` for float32 (round to nearest moves ``m`` by at most ``u |m|``, and
``|m| <= |p| / (1 - u)``). It dominates where ``T`` is large against the
entries: at ``c = 8``, ``T = 2**30`` the quantiser's term is 1.5e-8 and the
cast of an entry near 2 up to 1.2e-7. The sums live modulo ``2**32``: ``k T
< 2**32`` (at most 1023 clients per round at the default ``T = 2**22``).

References
----------
.. [1] Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
   Overhead", CCS 2020.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from numpy.typing import NDArray

from fedlr.errors import ConfigError, ProtocolError, SecureAggregationError

__all__ = [
    "CHECK_HISTORY",
    "CHECK_WINDOW",
    "FIXED_POINT",
    "MODULUS_RANGE",
    "SCALAR_BITS",
    "AggregateCheck",
    "SecAggSettings",
    "SecureScalars",
    "Summand",
    "check_eligible",
    "clip_update",
    "flatten_summands",
    "mean_error_bound",
    "new_signing_key",
    "rounding_bound",
    "sign_survivors",
    "survivor_statement",
    "unflatten_sums",
    "verify_survivors",
]

MODULUS_RANGE = 2**32
"""Masks and sums live modulo this (Flower's default ``modulus_range``)."""


def _check_shares(shares: float, threshold: float) -> None:
    """``secagg-num-shares`` and ``secagg-reconstruction-threshold``: each a
    fraction in (0, 1] or a whole number, the threshold above half of the
    shares and below them."""
    if not (math.isfinite(shares) and shares > 0):
        raise ConfigError("secagg-num-shares", f"must be > 0, got {shares}")
    if shares > 1 and (shares != int(shares) or shares < 3):
        raise ConfigError(
            "secagg-num-shares",
            f"must be a fraction in (0, 1] or a whole number >= 3, got {shares}",
        )
    if not (math.isfinite(threshold) and threshold > 0):
        raise ConfigError(
            "secagg-reconstruction-threshold", f"must be > 0, got {threshold}"
        )
    if threshold > 1 and (threshold != int(threshold) or threshold < 2):
        raise ConfigError(
            "secagg-reconstruction-threshold",
            f"must be a fraction in (0, 1] or a whole number >= 2, got {threshold}",
        )
    if threshold > 1 and shares > 1 and threshold >= shares:
        raise ConfigError(
            "secagg-reconstruction-threshold",
            f"must be below secagg-num-shares ({int(shares)}), got {int(threshold)}",
        )
    if threshold > 1 and shares > 1 and 2 * threshold <= shares:
        raise ConfigError(
            "secagg-reconstruction-threshold",
            f"must be above half of secagg-num-shares ({int(shares)}), "
            f"got {int(threshold)}",
        )


@dataclass(frozen=True)
class SecAggSettings:
    """The SecAgg+ parameters of a run (``secagg-*`` keys).

    Attributes
    ----------
    num_shares : float
        Shares each client's secrets are split into: a fraction in (0, 1] of
        the round's sampled clients (1: every client, i.e. SecAgg), or a
        whole number of neighbours ``>= 3``.
    reconstruction_threshold : float
        Shares needed to reconstruct a secret, as a fraction in (0, 1] of
        ``num_shares`` (at least 2), or a whole number ``>= 2`` below a whole
        ``num_shares``. Higher: more privacy against colluding clients, fewer
        dropouts tolerated.
    clipping_range : float
        ``c``: each summand entry is clipped to ``[-c, c]`` (> 0).
    quantization_range : int
        ``T``: levels of the quantiser (>= 2, below ``2**32``).
    check_ratio : float
        The aggregate check (:class:`AggregateCheck`): a round whose update
        norm exceeds this times the median of the last accepted rounds'
        update norms is rejected (``0``: no check).
    check_first_ratio : float
        The aggregate check with no accepted round yet: the update norm
        against this times the current global arrays' norm (``0``: no
        check until a round is accepted).
    client_clip : float
        The node's clip before masking: the update of the weighted record
        (its arrays minus the ones received) is scaled down to at most this
        times the received arrays' norm (``0``: no clip).
    """

    num_shares: float = 1.0
    reconstruction_threshold: float = 0.6
    clipping_range: float = 8.0
    quantization_range: int = 2**22
    check_ratio: float = 4.0
    check_first_ratio: float = 0.5
    client_clip: float = 1.0

    def __post_init__(self) -> None:
        _check_shares(self.num_shares, self.reconstruction_threshold)
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise ConfigError(
                "secagg-clipping-range",
                f"must be finite and > 0, got {self.clipping_range}",
            )
        if not 2 <= self.quantization_range < MODULUS_RANGE:
            raise ConfigError(
                "secagg-quantization-range",
                f"must be in [2, 2**32), got {self.quantization_range}",
            )
        for key, value in (
            ("secagg-check-ratio", self.check_ratio),
            ("secagg-check-first-ratio", self.check_first_ratio),
            ("secagg-client-clip", self.client_clip),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(key, f"must be finite and >= 0, got {value}")
        if 0 < self.check_ratio <= 1:
            raise ConfigError(
                "secagg-check-ratio",
                f"must be 0 (off) or above 1, got {self.check_ratio}: at or "
                "below 1 it rejects every round larger than the median",
            )

    @property
    def max_clients(self) -> int:
        """Most clients a round's sum holds without wrapping modulo ``2**32``."""
        return (MODULUS_RANGE - 1) // self.quantization_range

    def shares_and_threshold(self, clients: int) -> tuple[int, int]:
        """``(num_shares, threshold)`` for a round of ``clients`` sampled nodes.

        Flower's ``SecAggPlusWorkflow`` rules: a fractional ``num_shares`` is
        rounded to an odd count (all clients when that is 2 or fewer), a
        fractional threshold is a share of it, at least 2 and above half of
        the shares (``t > n / 2``, SecAgg+'s security parameter, which the
        nodes' guard :mod:`fedlr.client_apps.secagg_guard` enforces).

        Raises
        ------
        SecureAggregationError
            Fewer than 2 clients, more than :attr:`max_clients`, more shares
            than clients, or a whole threshold not above half the shares.
        """
        if clients < 2:
            raise SecureAggregationError(
                f"a secure round needs at least 2 clients, got {clients}: the sum "
                "of one client is its update"
            )
        if clients > self.max_clients:
            raise SecureAggregationError(
                f"{clients} clients overflow the sum modulo 2**32 at "
                f"secagg-quantization-range {self.quantization_range} (at most "
                f"{self.max_clients}); lower secagg-quantization-range"
            )
        if self.num_shares <= 1:
            shares = round(self.num_shares * clients)
            if shares < clients and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = clients
        else:
            shares = int(self.num_shares)
        if shares > clients:
            raise SecureAggregationError(
                f"secagg-num-shares {shares} exceeds the round's {clients} clients"
            )
        if shares != clients and shares % 2 == 0:
            shares += 1  # SecAgg+ neighbourhoods are symmetric: an odd count
        majority = shares // 2 + 1  # t > n / 2: the nodes' guard refuses less
        if self.reconstruction_threshold <= 1:
            threshold = max(round(self.reconstruction_threshold * shares), majority, 2)
        else:
            threshold = int(self.reconstruction_threshold)
        if not max(majority, 2) <= threshold <= shares:
            raise SecureAggregationError(
                f"secagg-reconstruction-threshold {threshold} must be above half "
                f"of the round's {shares} shares and at most {shares}: the nodes "
                "refuse a threshold that a minority of neighbours could reach"
            )
        return shares, threshold

    def step(self) -> float:
        """The quantiser's step ``2c / T``."""
        return 2.0 * self.clipping_range / self.quantization_range


CHECK_WINDOW = 3
"""Accepted rounds whose update norms the aggregate check takes the median of."""
CHECK_HISTORY = "secagg-check-history"
"""The checkpoint entry (under ``extra``) that keeps :attr:`AggregateCheck.history`."""


@dataclass
class AggregateCheck:
    """The server's check of a secure round's aggregate update.

    Under SecAgg+ the server sees only the sum, so no reply can be screened
    and no robust rule can act; what it can check is the round's result.
    The update norm ``d = ||new - current||_F`` (over every array of the
    global state, in float64) is compared with

    * ``ratio x`` the median of the last :data:`CHECK_WINDOW` accepted
      rounds' update norms, once a round was accepted (the history is
      checkpointed: a resumed run goes on with it);
    * ``first_ratio x ||current||_F`` before (round 1).

    A round above the bound is rejected (the caller keeps the previous
    global arrays); an accepted round's norm joins the history. With
    ``||current|| = 0`` and no history there is nothing to compare with:
    the round is accepted.

    Attributes
    ----------
    ratio : float
        ``secagg-check-ratio`` (``0``: no check).
    first_ratio : float
        ``secagg-check-first-ratio`` (``0``: none before a round is accepted).
    history : list of float
        The accepted rounds' update norms, oldest first.
    last_ratio : float
        The last checked round's ``d`` over its reference (the median, or
        ``||current||``); NaN when nothing was compared.
    pending : str or None
        A rejection the exchange found before the aggregate existed (a sum
        that does not unmask: :meth:`reject`); the next :meth:`check`
        returns it whatever the ratios, also with the check off.
    """

    ratio: float = 4.0
    first_ratio: float = 0.5
    history: list[float] = field(default_factory=list)
    last_ratio: float = math.nan
    pending: str | None = None

    def reject(self, reason: str) -> None:
        """Reject the round being aggregated with ``reason``."""
        self.pending = reason

    def check(
        self,
        new: Mapping[str, NDArray[np.floating] | object],
        current: Mapping[str, NDArray[np.floating] | object],
    ) -> str | None:
        """The rejection of the round whose result is ``new``, or ``None``.

        ``new`` and ``current`` map names to arrays or tensors (anything
        ``np.asarray`` reads). On ``None`` the round's norm is recorded.
        """
        self.last_ratio = math.nan
        if self.pending is not None:
            reason, self.pending = self.pending, None
            return reason
        change = _norm(_f64(new[k]) - _f64(current[k]) for k in new if k in current)
        if self.history:
            reference = float(np.median(self.history[-CHECK_WINDOW:]))
            limit, option = self.ratio, "secagg-check-ratio"
            what = (
                f"the median {reference:.4g} of the last "
                f"{min(len(self.history), CHECK_WINDOW)} accepted rounds' update norms"
            )
        else:
            reference = _norm(current.values())
            limit, option = self.first_ratio, "secagg-check-first-ratio"
            what = f"the current global norm {reference:.4g}"
        if limit > 0 and reference > 0:
            self.last_ratio = change / reference
            if not change <= limit * reference:  # NaN fails too
                return (
                    f"secure-aggregation check: the aggregate update norm "
                    f"{change:.4g} exceeds {option} {limit:g} x {what} (the "
                    "server cannot see which client; see reliability.md, What "
                    "secure aggregation costs in robustness)"
                )
        self.history.append(change)
        del self.history[:-CHECK_WINDOW]
        return None


def _f64(value: object) -> NDArray[np.float64]:
    """An array or a CPU tensor as float64 NumPy."""
    detach = getattr(value, "detach", None)
    if detach is not None:
        value = detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def _norm(arrays: Iterable[object]) -> float:
    """The Frobenius norm of the arrays (or CPU tensors) together, in float64."""
    return math.sqrt(sum(float(np.sum(_f64(a) ** 2)) for a in arrays))


def clip_update(
    arrays: Mapping[str, NDArray[np.floating]],
    received: Mapping[str, NDArray[np.floating]],
    ratio: float,
) -> tuple[dict[str, NDArray[np.floating]], float]:
    """The node's clip before masking (``secagg-client-clip``).

    The update ``u = arrays - received`` (keys of both, in float64) is
    scaled to at most ``ratio x ||received||_F``; keys without a received
    array are left as they are.

    Returns
    -------
    arrays : dict
        ``received + g u`` (each in its own dtype) with ``g = min(1, bound /
        ||u||)``; the input itself when nothing was cut (``g = 1``, no
        rounding), ``ratio = 0`` or ``||received|| = 0``.
    factor : float
        ``g``.

    Raises
    ------
    ProtocolError
        If the update is not finite: the node does not mask it.
    """
    shared = [k for k in sorted(arrays) if k in received]
    base = _norm(received[k] for k in shared)
    update = {k: _f64(arrays[k]) - _f64(received[k]) for k in shared}
    norm = _norm(update.values())
    if not math.isfinite(norm):
        raise ProtocolError(
            "the update is not finite: the node does not mask it (a faulty "
            "client's reply is left out of the round)"
        )
    if ratio <= 0 or base <= 0 or norm <= ratio * base:
        return dict(arrays), 1.0
    factor = ratio * base / norm
    out = dict(arrays)
    for k in shared:
        clipped = _f64(received[k]) + factor * update[k]
        out[k] = clipped.astype(np.asarray(arrays[k]).dtype)
    return out, factor


def _unit_roundoff(dtype: np.dtype[Any]) -> float:
    """``u = eps / 2`` of a floating dtype (``2**-24`` for float32), else 0."""
    return float(np.finfo(dtype).eps) / 2.0 if dtype.kind == "f" else 0.0


def rounding_bound(published: Iterable[NDArray[Any]]) -> float:
    """The cast of the float64 mean to each array's dtype: ``u / (1 - u) x
    max |p|`` over the published arrays ``p`` (per entry it is ``u / (1 - u)
    x |p_j|``: round to nearest moves ``m`` by at most ``u |m|`` and
    ``|m| <= |p| / (1 - u)``)."""
    worst = 0.0
    for array in published:
        u = _unit_roundoff(array.dtype)
        if u and array.size:
            worst = max(worst, u / (1.0 - u) * float(np.max(np.abs(array))))
    return worst


def mean_error_bound(
    settings: SecAggSettings,
    weights: Sequence[float],
    published: Iterable[NDArray[Any]] = (),
) -> float:
    """Bound on ``|published secure mean - exact weighted mean|`` per entry.

    Parameters
    ----------
    settings : SecAggSettings
    weights : (k,) sequence of float
        Each client's relative weight ``n_i / s`` (in (0, 1]).
    published : iterable of arrays, optional
        The published means in their own dtypes (float32 for adapter
        factors): their cast from float64 adds :func:`rounding_bound`.

    Returns
    -------
    float
        ``(2 c k / T + 4 k c 2**-52) / W + u / (1 - u) max |p|``,
        ``W = sum(weights)``, ``u`` the unit roundoff of the arrays' dtype
        (``2**-24`` for float32); valid when no entry was clipped. The first
        term is the quantiser's (each client's stochastic rounding moves its
        summand by less than one step ``2c / T``), the second the float64
        arithmetic of quantising, summing and dequantising values up to
        ``k c``, the third the cast of the mean to float32.
    """
    total = float(sum(weights))
    if not weights or total <= 0:
        raise ValueError(f"weights must be positive, got {list(weights)}")
    k, c = len(weights), settings.clipping_range
    arithmetic = 4.0 * k * c * 2.0**-52
    return (settings.step() * k + arithmetic) / total + rounding_bound(published)


def check_eligible(
    method: str,
    sum_only: bool,
    eligible: Iterable[str],
    *,
    robust: str = "none",
    max_client_weight: float = 1.0,
    max_weight_ratio: float = 0.0,
    asynchronous: bool = False,
) -> None:
    """Refuse secure aggregation for a method or setting that needs single replies.

    ``asynchronous``: the method runs in fedlr's asynchronous loop, which has
    no SecAgg+ exchange (a synchronous round over the sampled nodes), however
    little of each reply its step reads (FedBuff's buffered sum).

    Raises
    ------
    SecureAggregationError
        If the method's aggregation is not sum-only or runs asynchronously,
        or a robust rule or weight cap (which read each client's update) is on.
    """
    names = ", ".join(sorted(eligible))
    if asynchronous:
        raise SecureAggregationError(
            f"{method} runs asynchronously, and fedlr's SecAgg+ exchange is a "
            "synchronous round over the sampled nodes: secure-aggregation is for the "
            f"synchronous sum-only methods: {names}"
        )
    if not sum_only:
        raise SecureAggregationError(
            f"{method} needs each client's arrays: secure-aggregation is for "
            f"sum-only methods: {names}"
        )
    if robust != "none" or max_client_weight < 1.0 or max_weight_ratio > 0:
        raise SecureAggregationError(
            f"robust aggregation (robust={robust}, max-client-weight="
            f"{max_client_weight}, max-weight-ratio={max_weight_ratio:g}) reads "
            "each client's update, which secure-aggregation hides: set "
            "robust=none, max-client-weight=1.0 and max-weight-ratio=0"
        )


@dataclass(frozen=True)
class Summand:
    """One array of a reply in the masked vector: where it goes, its shape."""

    record: str
    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def name(self) -> str:
        """``record/key``."""
        return f"{self.record}/{self.key}"


def flatten_summands(
    records: Mapping[str, Mapping[str, NDArray[np.floating]]],
    *,
    weighted: str,
    weight: float,
) -> tuple[list[Summand], list[NDArray[np.float64]]]:
    """A reply's arrays as the summands of its masked vector.

    Records in name order, keys in name order; the arrays of record
    ``weighted`` are multiplied by ``weight`` (``n_i / s``), the others are
    sent as they are. Both sides order alike, so the server checks a reply's
    manifest against the one it expects.

    Returns
    -------
    manifest : list of Summand
    values : list of float64 arrays, in the manifest's order
    """
    manifest: list[Summand] = []
    values: list[NDArray[np.float64]] = []
    for record in sorted(records):
        factor = weight if record == weighted else 1.0
        arrays = records[record]
        for key in sorted(arrays):
            array = np.asarray(arrays[key])
            manifest.append(Summand(record, key, tuple(array.shape), str(array.dtype)))
            values.append(array.astype(np.float64) * factor)
    return manifest, values


def unflatten_sums(
    manifest: Sequence[Summand],
    sums: Sequence[NDArray[np.float64]],
    *,
    weighted: str,
    total_weight: float,
    clients: int,
) -> dict[str, dict[str, NDArray[np.floating]]]:
    """The secure sums as the means a strategy aggregates, by record and key.

    The ``weighted`` record's sums are divided by ``total_weight`` (``W``: the
    weighted mean), the others' by ``clients`` (the unweighted mean; ``k``
    copies of it sum to the sum). Each array gets its manifest dtype back.

    Raises
    ------
    ValueError
        If ``sums`` and ``manifest`` differ in length or shape.
    """
    if len(manifest) != len(sums):
        raise ValueError(f"{len(sums)} sums for {len(manifest)} summands")
    out: dict[str, dict[str, NDArray[np.floating]]] = {}
    for summand, total in zip(manifest, sums, strict=True):
        if tuple(total.shape) != summand.shape:
            raise ValueError(
                f"sum of '{summand.name}' has shape {tuple(total.shape)}, "
                f"expected {summand.shape}"
            )
        divisor = total_weight if summand.record == weighted else float(clients)
        mean = np.asarray(total, dtype=np.float64) / divisor
        out.setdefault(summand.record, {})[summand.key] = mean.astype(summand.dtype)
    return out


FIXED_POINT = 10**6
"""A weighted scalar (a loss, a residual fraction) is summed as
``round(value * weight * FIXED_POINT)``."""
SCALAR_BITS = 48
"""Each secure scalar is summed as an integer below ``2**48``."""


@dataclass(frozen=True)
class SecureScalars:
    """Per-client scalars summed, exactly, inside the masked vector.

    Under secure aggregation a client's metrics travel inside the secure sum
    or not at all. Each scalar is a non-negative integer (a count, or a
    weighted value in fixed point: ``round(v * w * FIXED_POINT)``) written in
    ``digits`` base-``base`` digits; digit ``d`` is the summand ``d c / base``
    (inside the clipping range ``[-c, c]``, a whole number of quantiser steps
    when ``2 base`` divides ``T``). With ``k`` clients and ``base <= T /
    (8 k)`` the quantiser's error on a digit sum is below ``1/4`` digit, so
    rounding gives every digit sum, and so every scalar's sum, exactly.

    Attributes
    ----------
    keys : tuple of str
        The scalars, in the order of the summand.
    weights : tuple of str
        Per key: the key whose value weighs it (its sum is then a weighted
        mean's numerator), or ``""`` for a count summed as it is.
    base : int
        The digit base, a power of two.
    clipping_range : float
        ``c`` of the round.
    """

    keys: tuple[str, ...]
    weights: tuple[str, ...]
    base: int
    clipping_range: float

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.weights):
            raise SecureAggregationError(
                f"{len(self.keys)} secure scalars but {len(self.weights)} weights"
            )
        if self.base < 2 or self.base & (self.base - 1):
            raise SecureAggregationError(
                f"the secure scalars' base must be a power of two >= 2, got {self.base}"
            )
        unknown = sorted({w for w in self.weights if w} - set(self.keys))
        if unknown:
            raise SecureAggregationError(
                f"secure scalars weighted by keys that are not summed: {unknown}"
            )

    @classmethod
    def for_round(
        cls,
        settings: SecAggSettings,
        clients: int,
        weights: Mapping[str, str],
    ) -> SecureScalars:
        """The round's scalars ``{key: weight key}`` at the largest exact base.

        Raises
        ------
        SecureAggregationError
            If ``T < 16 k``: the quantiser cannot sum whole digits exactly.
        """
        room = settings.quantization_range // (8 * max(clients, 1))
        if room < 2:
            raise SecureAggregationError(
                f"secagg-quantization-range {settings.quantization_range} is too "
                f"small to sum the metrics of {clients} clients exactly (needs "
                f">= {16 * clients})"
            )
        base = 1 << min(room.bit_length() - 1, 16)
        return cls(
            tuple(weights), tuple(weights.values()), base, settings.clipping_range
        )

    @property
    def digits(self) -> int:
        """Digits per scalar: ``ceil(SCALAR_BITS / log2(base))``."""
        return -(-SCALAR_BITS // (self.base.bit_length() - 1))

    @property
    def size(self) -> int:
        """Entries of the summand."""
        return len(self.keys) * self.digits

    def integers(self, values: Mapping[str, float]) -> list[int]:
        """A client's scalars as integers (a missing, negative or non-finite
        value counts as 0; a value above ``2**48`` as the largest)."""
        top = (1 << SCALAR_BITS) - 1
        out = []
        for key, weight in zip(self.keys, self.weights, strict=True):
            value = float(values.get(key, 0.0))
            if weight:
                value *= float(values.get(weight, 0.0)) * FIXED_POINT
            out.append(round(value) if math.isfinite(value) and value > 0 else 0)
        return [min(v, top) for v in out]

    def encode(self, values: Mapping[str, float]) -> NDArray[np.float64]:
        """A client's summand: every scalar's digits, times ``c / base``."""
        digits = []
        for number in self.integers(values):
            for _ in range(self.digits):
                digits.append(number % self.base)
                number //= self.base
        unit = self.clipping_range / self.base
        return np.asarray(digits, dtype=np.float64) * unit

    def decode(self, total: NDArray[np.float64]) -> dict[str, int]:
        """The scalars' exact sums from the summand's (dequantised) sum.

        Raises
        ------
        SecureAggregationError
            If the sum has another size or a digit sum is off a whole digit by
            more than the quantiser allows (a mask left in, a garbled vector).
        """
        flat = np.asarray(total, dtype=np.float64).reshape(-1)
        if flat.size != self.size:
            raise SecureAggregationError(
                f"the secure scalars' sum has {flat.size} entries, expected {self.size}"
            )
        counts = flat * (self.base / self.clipping_range)
        whole = np.rint(counts)
        if not np.all(np.isfinite(counts)) or np.any(np.abs(counts - whole) > 0.25):
            raise SecureAggregationError(
                "the secure scalars' sum is not whole digits: a mask was not removed"
            )
        out: dict[str, int] = {}
        for i, key in enumerate(self.keys):
            part = whole[i * self.digits : (i + 1) * self.digits]
            out[key] = sum(int(d) * self.base**j for j, d in enumerate(part))
        return out

    def means(self, sums: Mapping[str, int]) -> dict[str, float]:
        """Counts as summed; weighted scalars as their weighted means (NaN
        when their weights sum to 0)."""
        out: dict[str, float] = {}
        for key, weight in zip(self.keys, self.weights, strict=True):
            if not weight:
                out[key] = float(sums[key])
            elif sums[weight] > 0:
                out[key] = sums[key] / (FIXED_POINT * sums[weight])
            else:
                out[key] = math.nan
        return out


# ----------------------------------------------------------- consistency round
def new_signing_key() -> tuple[bytes, bytes]:
    """A fresh Ed25519 key pair for one SecAgg+ session: ``(private, public)``,
    32 raw bytes each."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return private, public


def survivor_statement(run_id: int, session: str, survivors: Iterable[int]) -> bytes:
    """The bytes a survivor signs in the consistency round: the run, the
    session (the round's group id) and the sorted survivor set ``U3``."""
    ids = ",".join(str(n) for n in sorted(survivors))
    return f"fedlr-secagg-survivors|{run_id}|{session}|{ids}".encode()


def sign_survivors(private: bytes, statement: bytes) -> bytes:
    """The node's Ed25519 signature of ``statement``."""
    return Ed25519PrivateKey.from_private_bytes(private).sign(statement)


def verify_survivors(public: bytes, statement: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the holder of ``public``'s over ``statement``
    (a malformed key or signature is not valid)."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, statement)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
