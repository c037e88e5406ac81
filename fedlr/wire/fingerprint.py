"""Fingerprints of the frozen weights every node's model must share.

A plug-in user builds the model on the server and on every node. Federated
LoRA and VeRA only make sense if those models are the same where nothing
travels: the frozen base weight ``W0`` of every adapted layer, and adapter
factors that a method never sends (FFA-LoRA's frozen ``A``). A model built
with another seed or from another checkpoint trains against another ``W0``
(or ``A``) without any error: the server aggregates updates that belong to
different models.

The strategy's ``for_model`` fingerprints its model; every instruction carries
the fingerprint (``base-fingerprint`` and ``base-fingerprint-keys`` in the
ConfigRecord); :func:`fedlr.apply_round` and ``strategy.load_into`` compare
the model they are given and raise :class:`~fedlr.errors.BaseMismatchError`,
naming the layer, when it differs.

What is fingerprinted is the model *as built*: the values fedlr remembers
when it first sees the module (:func:`fedlr.adapters.plugin.initial_state`),
not the weights of the current round. FedEx-LoRA and VeRA-FedEx fold the
residual into ``W0`` every round, so the current base weights legitimately
differ from the built ones; their node follows the server's
``base-version`` through the dense weights or the checked ``base-delta``
changes (:func:`fedlr.wire.downlink.receive_base`, its own ``base-check``). Both
sides fingerprint version 0, the model they built, which must agree for
every method.

A fingerprint is :data:`PROBES` numbers per weight, ``u_p^T W v_p`` summed
in float64 with standard normal ``u_p``, ``v_p`` seeded by the key (the
``base-check`` idea of :func:`fedlr.wire.downlink.checksum`, with several probes).
For a difference ``E`` the probes differ by ``u_p^T E v_p``, whose mean square
is ``||E||_F^2``, so the root mean square of the probe differences estimates
``||E||_F``. A weight passes when that estimate is at most
:data:`TOLERANCE` times its norm: half-precision rounding of the same weights
(``||E|| ~ 0.2 %`` for bfloat16) passes, another seed (``||E|| ~ 140 %``) or
another checkpoint does not. Cost: one pass over each fingerprinted weight,
``O(d_out d_in)`` time, computed once per model object.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch

from fedlr.adapters.plugin import initial_state
from fedlr.adapters.roles import AdaptedModel, Role, RoleLayout
from fedlr.errors import BaseMismatchError, ProtocolError
from fedlr.wire import protocol

__all__ = [
    "PROBES",
    "TOLERANCE",
    "BaseFingerprint",
    "check_instruction",
    "check_model",
    "fingerprint_roles",
    "model_fingerprint",
    "probe",
]

PROBES = 4
"""Random probes ``u_p^T W v_p`` per fingerprinted weight."""

TOLERANCE = 1e-2
"""A weight matches when the RMS of its probe differences is at most this
times its Frobenius norm (about 1 % of the weight; bfloat16 rounding is
about 0.2 %)."""

_CHUNK_ROWS = 1024
"""Rows of a weight converted to float64 at a time."""

_FACTOR_ROLES = tuple(r for r in Role if r not in (Role.BASE, Role.HEAD))
"""The adapter-factor roles: every role but the frozen base and the head."""

_CACHE: WeakKeyDictionary[torch.nn.Module, dict[str, tuple[float, ...]]] = (
    WeakKeyDictionary()
)
"""Per torch module: each fingerprinted key's probes of its built value."""


@dataclass(frozen=True)
class BaseFingerprint:
    """The fingerprint of a model's frozen weights.

    Attributes
    ----------
    keys : tuple of str
        Layout keys (base weights, then never-sent factors), in layout order.
    values : tuple of float
        :data:`PROBES` values per key, key after key.
    """

    keys: tuple[str, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.values) != PROBES * len(self.keys):
            raise ProtocolError(
                f"'{protocol.BASE_FINGERPRINT}' holds {len(self.values)} values, "
                f"expected {PROBES} per key of '{protocol.BASE_FINGERPRINT_KEYS}' "
                f"({len(self.keys)} keys)"
            )

    def of(self, key: str) -> tuple[float, ...]:
        """The probes of ``key``."""
        i = self.keys.index(key)
        return self.values[PROBES * i : PROBES * (i + 1)]

    def config(self) -> dict[str, Any]:
        """The ConfigRecord entries of the fingerprint."""
        return {
            protocol.BASE_FINGERPRINT: list(self.values),
            protocol.BASE_FINGERPRINT_KEYS: list(self.keys),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BaseFingerprint | None:
        """The fingerprint an instruction's ConfigRecord carries, if any.

        Raises
        ------
        ProtocolError
            If only one of the two entries is there, or they do not fit.
        """
        has = (
            protocol.BASE_FINGERPRINT in config,
            protocol.BASE_FINGERPRINT_KEYS in config,
        )
        if not any(has):
            return None
        if not all(has):
            raise ProtocolError(
                f"'{protocol.BASE_FINGERPRINT}' and "
                f"'{protocol.BASE_FINGERPRINT_KEYS}' come together; got one"
            )
        values, keys = (
            config[protocol.BASE_FINGERPRINT],
            config[protocol.BASE_FINGERPRINT_KEYS],
        )
        if not isinstance(values, list) or not isinstance(keys, list):
            raise ProtocolError(
                f"'{protocol.BASE_FINGERPRINT}' and "
                f"'{protocol.BASE_FINGERPRINT_KEYS}' must be lists"
            )
        return cls(tuple(str(k) for k in keys), tuple(float(v) for v in values))


def fingerprint_roles(
    layout: RoleLayout,
    send_roles: Iterable[Role],
    train_roles: Iterable[Role],
    keep_roles: Iterable[Role] = (),
) -> tuple[Role, ...]:
    """The roles whose tensors every node must have built alike.

    ``Role.BASE``, plus each adapter-factor role of ``layout`` that the
    strategy neither sends, nor has trained or kept by the nodes: the
    factors a node keeps from its own initialisation and the server assumes
    to be its own (FFA-LoRA's ``A``). The head is never included (it is sent
    where declared).
    """
    moving = {*send_roles, *train_roles, *keep_roles}
    present = {role for role, _, _ in layout.entries()}
    frozen = tuple(r for r in _FACTOR_ROLES if r in present and r not in moving)
    return (Role.BASE, *frozen)


def probe(key: str, weight: torch.Tensor) -> tuple[float, ...]:
    """:data:`PROBES` values ``u_p^T W v_p`` of ``weight`` (float64).

    ``u_p``, ``v_p`` are standard normal, seeded by ``key``; a vector (a 1-D
    weight) is probed as one row. ``O(numel)`` time, one block of
    :data:`_CHUNK_ROWS` rows converted at a time.

    Parameters
    ----------
    key : str
    weight : (d_out, d_in) or (d,) torch.Tensor

    Returns
    -------
    tuple of float
    """
    w = weight.detach().to("cpu")
    w = w.reshape(1, -1) if w.ndim < 2 else w.reshape(int(w.shape[0]), -1)
    rows, cols = int(w.shape[0]), int(w.shape[1])
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    u = torch.randn(rows, PROBES, generator=generator, dtype=torch.float64)
    v = torch.randn(cols, PROBES, generator=generator, dtype=torch.float64)
    # W v_p in float32 (float64 for a float64 weight; about 1e-6 relative,
    # far below TOLERANCE, twice as fast), the sums over rows in float64.
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    v_w = v.to(dtype)
    total = torch.zeros(PROBES, dtype=torch.float64)
    for start in range(0, rows, _CHUNK_ROWS):
        block = w[start : start + _CHUNK_ROWS].to(dtype)
        total += ((block @ v_w).to(torch.float64) * u[start : start + _CHUNK_ROWS]).sum(
            dim=0
        )
    return tuple(float(x) for x in total)


def _built_probes(
    view: AdaptedModel, keys: Sequence[str]
) -> dict[str, tuple[float, ...]]:
    """Probes of ``keys`` at the model's built values (cached per module).

    Raises
    ------
    BaseMismatchError
        If the model has no tensor of that key and shape (another
        architecture).
    """
    cached = _CACHE.setdefault(view.model, {})
    missing = [k for k in keys if k not in cached]
    if missing:
        built = initial_state(view)
        absent = [k for k in missing if k not in built]
        if absent:
            raise BaseMismatchError(
                f"the model has no frozen weight {absent[:3]} that the server's "
                "model has (another architecture or other target modules?); "
                "build every node's model and the server's the same way"
            )
        for key in missing:
            cached[key] = probe(key, built[key])
    return {k: cached[k] for k in keys}


def model_fingerprint(view: AdaptedModel, roles: Iterable[Role]) -> BaseFingerprint:
    """The fingerprint of ``view``'s built tensors with ``roles``.

    Parameters
    ----------
    view : AdaptedModel
        The model seen by role (:func:`fedlr.adapters.plugin.adapted`).
    roles : iterable of Role
        Usually :func:`fingerprint_roles`.

    Returns
    -------
    BaseFingerprint
    """
    keys = tuple(view.layout.keys(*tuple(roles)))
    probes = _built_probes(view, keys)
    return BaseFingerprint(keys, tuple(x for k in keys for x in probes[k]))


def check_model(
    expected: BaseFingerprint | None, view: AdaptedModel, *, what: str
) -> None:
    """``view``'s built tensors match ``expected`` (no check when ``None``).

    Raises
    ------
    BaseMismatchError
        Naming the first layer whose weight differs, by how much of its
        norm, and what to check.
    """
    if expected is None or not expected.keys:
        return
    got = _built_probes(view, expected.keys)
    built: dict[str, torch.Tensor] | None = None
    for key in expected.keys:
        diff = [a - b for a, b in zip(got[key], expected.of(key), strict=True)]
        rms = math.sqrt(sum(d * d for d in diff) / PROBES)
        if rms == 0.0:
            continue
        if built is None:
            built = initial_state(view)
        norm = float(torch.linalg.vector_norm(built[key].detach(), dtype=torch.float64))
        if rms <= TOLERANCE * max(norm, 1e-30):
            continue
        layer = _layer_of(view.layout, key)
        raise BaseMismatchError(
            f"{what}: the frozen weight '{key}' (layer '{layer}') differs from "
            f"the server's model by about {rms / max(norm, 1e-30):.3g} "
            "of its norm: built with another seed or checkpoint? Build the "
            "server's model and every node's the same way (same seed before "
            "building, same checkpoint, same target modules)"
        )


def check_instruction(view: AdaptedModel, config: Mapping[str, Any]) -> None:
    """A node's model matches the fingerprint its instruction carries.

    Instructions without ``base-fingerprint`` (fedlr's own apps, strategies
    not built by ``for_model``) are not checked.

    Raises
    ------
    BaseMismatchError
        If the model's built frozen weights differ from the server's.
    ProtocolError
        If the fingerprint entries are malformed.
    """
    check_model(BaseFingerprint.from_config(config), view, what="this node's model")


def _layer_of(layout: RoleLayout, key: str) -> str:
    """The module path of the layer that holds ``key`` (``key`` if unknown)."""
    for module in getattr(layout, "modules", ()):
        if key in {
            getattr(module, name, None) for name in ("base_key", "a_key", "b_key")
        }:
            return str(module.name)
    return key
