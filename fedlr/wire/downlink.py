"""The factored FedEx downlink: base-weight changes as low-rank factors.

FedEx-LoRA and VeRA-FedEx fold each round's residual into the frozen base
weights, so the base weights change every round. Sent dense, they dominate the
traffic (7.38 MB down against 0.30 MB up per client on the default run). But
one round's change has low rank:

* FedEx-LoRA: ``s (sum_i w_i B_i A_i - B_bar A_bar)`` has rank at most
  ``(k - 1) r`` (it equals ``s sum_i w_i (B_i - B_bar)(A_i - A_bar)``);
* VeRA-FedEx: ``s (B o M) A`` with the shared projections ``A`` (r, d_in) and
  ``B`` (d_out, r), ``o`` the elementwise product and
  ``M = sum_i w_i b_i d_i^T - b_bar d_bar^T`` (d_out x r, rank at most
  ``k - 1``), so only ``M``'s factors travel.

A ``Conv1D`` layer (GPT-2; peft's ``fan_in_fan_out``) stores ``W0`` as
(d_in, d_out), so its change is the transpose. A FedEx-LoRA change is then
sent as the swapped pair ``(right^T, left^T)`` of kind :data:`LOWRANK` (still
``W += left @ right`` on the stored weight); a VeRA change cannot be swapped
(its projections ``B``, ``A`` are fixed), so it carries ``transposed=True``,
written in its ArrayRecord keys as the kind ``vera-t``
(:data:`TRANSPOSED_SUFFIX`): ``W += ((B o (left @ right)) @ A)^T``.

The server recompresses the sum by a factored SVD (:func:`lowrank_delta`,
:func:`vera_delta`): what is sent is the SVD of the aggregate, never a
client's own factors. Singular values below the float32 rounding of the
stacked factors (``eps32 ||left||_F ||right||_F``) are dropped.

Versions. The server numbers the base weights it publishes
(:class:`~fedlr.round.ledger.BaseLedger`). A node that keeps the base
weights of version ``v``
(:func:`receive_base`, in ``context.state``) and said so (reply metric
``base-held``) is sent the changes ``v+1 .. t`` (ArrayRecord ``base-delta``)
instead of the dense weights, when they are smaller; a node the server knows
nothing about, or one that missed more changes than the dense weights weigh,
is sent the dense weights. Both sides apply a change with the same function
(:meth:`BaseDelta.apply`: float64 accumulation, rounded to the base's dtype),
so the node's base weights are the server's. Each instruction carries a
checksum of the base weights it leads to (``base-check``,
:func:`checksum`); a node whose result differs by more than
``CHECK_TOLERANCE`` of the weights' norm raises
:class:`~fedlr.errors.BaseOutOfSyncError`, the server drops that reply and
sends the node dense weights the next time it is sampled.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedlr.errors import BaseOutOfSyncError, ShapeMismatchError
from fedlr.flower.records import config_int, record_to_state, state_to_record
from fedlr.linalg.svd import factored_svd
from fedlr.linalg.vera import lambda_stacks
from fedlr.wire import protocol

__all__ = [
    "CHECK_TOLERANCE",
    "LOWRANK",
    "TRANSPOSED_SUFFIX",
    "VERA",
    "BaseDelta",
    "checksum",
    "decode_steps",
    "encode_steps",
    "lowrank_delta",
    "receive_base",
    "vera_delta",
]

LOWRANK = "lowrank"
"""``W <- W + left @ right``; left (d_out, q), right (q, d_in)."""
VERA = "vera"
"""``W <- W + (B o (left @ right)) @ A``; left (d_out, q), right (q, r), with
the layer's shared projections ``B`` (d_out, r) and ``A`` (r, d_in)."""
_KINDS = (LOWRANK, VERA)
TRANSPOSED_SUFFIX = "-t"
"""Appended to the kind in a ``base-delta`` key (``vera-t``) for a change that
is applied transposed (:attr:`BaseDelta.transposed`)."""

CHECK_TOLERANCE = 1e-5
"""A node's base weight ``W`` passes the checksum when
``|checksum(W) - expected| <= CHECK_TOLERANCE * ||W||_F``. The checksum of a
difference ``E`` has size about ``||E||_F``, so drifts above about this
fraction of the weights' norm are caught."""

_VERSION_RECORD = f"{protocol.BASE_STATE}-version"
"""The ConfigRecord in ``context.state`` with the stored base weights' version."""

_F32_EPS = float(torch.finfo(torch.float32).eps)

Projections = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``projections(d_out, d_in) -> (A[:, :d_in], B[:d_out])`` of a VeRA layer."""


@dataclass(frozen=True)
class BaseDelta:
    """One layer's change of base weight, in factored form.

    Attributes
    ----------
    kind : str
        :data:`LOWRANK` or :data:`VERA`.
    left : (d_out, q) torch.Tensor
    right : (q, d_in) or (q, r) torch.Tensor
        ``q`` is the change's rank (0 for no change).
    transposed : bool, default False
        The base weight is stored (d_in, d_out) (a ``Conv1D``): the change
        above is added transposed. Used for :data:`VERA` changes; a
        :data:`LOWRANK` change of such a layer is sent as the swapped pair
        instead, which needs no flag.
    """

    kind: str
    left: torch.Tensor
    right: torch.Tensor
    transposed: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown base-delta kind {self.kind!r}")
        if (
            self.left.ndim != 2
            or self.right.ndim != 2
            or self.left.shape[1] != self.right.shape[0]
        ):
            raise ShapeMismatchError(
                f"base-delta factors {tuple(self.left.shape)} and "
                f"{tuple(self.right.shape)} do not multiply"
            )

    @property
    def rank(self) -> int:
        """``q``."""
        return int(self.left.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the two factors on the wire."""
        return sum(t.numel() * t.element_size() for t in (self.left, self.right))

    def apply(
        self, base: torch.Tensor, projections: Projections | None = None
    ) -> torch.Tensor:
        """``base`` plus the change, accumulated in float64, in ``base``'s dtype.

        The server and the nodes call this same function on the same inputs.

        Raises
        ------
        ShapeMismatchError
            If the factors do not fit ``base`` (or the projections).
        ValueError
            If a VeRA change is applied without ``projections``.
        """
        d_out, d_in = (int(n) for n in base.shape)
        if self.transposed:
            d_out, d_in = d_in, d_out
        stored = f"{tuple(int(n) for n in base.shape)}" + (
            " (applied transposed)" if self.transposed else ""
        )
        left = self.left.to(torch.float64)
        right = self.right.to(torch.float64)
        if left.shape[0] != d_out:
            raise ShapeMismatchError(
                f"base-delta left factor {tuple(left.shape)} does not fit a base "
                f"weight of shape {stored}"
            )
        if self.kind == LOWRANK:
            if right.shape[1] != d_in:
                raise ShapeMismatchError(
                    f"base-delta right factor {tuple(right.shape)} does not fit a "
                    f"base weight of shape {stored}"
                )
            change = left @ right
        else:
            if projections is None:
                raise ValueError("a VeRA base-delta needs the layer's projections")
            a, b = projections(d_out, d_in)
            if tuple(b.shape) != (d_out, right.shape[1]) or a.shape[1] != d_in:
                raise ShapeMismatchError(
                    f"base-delta factors {tuple(left.shape)}, {tuple(right.shape)} "
                    f"do not fit the projections A {tuple(a.shape)}, "
                    f"B {tuple(b.shape)}"
                )
            change = (b.to(torch.float64) * (left @ right)) @ a.to(torch.float64)
        if self.transposed:
            change = change.T
        return (base.to(torch.float64) + change).to(base.dtype)


def _recompress(
    left: torch.Tensor, right: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scaling * left @ right`` as ``(U S scaling, V^T)`` at its numerical rank.

    Singular values at or below ``eps32 ||left||_F ||right||_F`` (the float32
    rounding of the factors' product) are dropped.
    """
    left = left.to(torch.float64)
    right = right.to(torch.float64)
    svd = factored_svd(left, right)
    scale = float(torch.linalg.matrix_norm(left)) * float(
        torch.linalg.matrix_norm(right)
    )
    keep = int((svd.s > _F32_EPS * scale).sum())
    return svd.u[:, :keep] * (svd.s[:keep] * scaling), svd.vh[:keep]


def _smaller(delta: BaseDelta, d_out: int, d_in: int, itemsize: int) -> bool:
    return delta.nbytes < d_out * d_in * itemsize


def lowrank_delta(
    left: torch.Tensor,
    right: torch.Tensor,
    scaling: float,
    *,
    dtype: torch.dtype = torch.float32,
) -> BaseDelta | None:
    """FedEx-LoRA's change ``scaling * left @ right``, recompressed.

    Parameters
    ----------
    left : (d_out, p) torch.Tensor
    right : (p, d_in) torch.Tensor
        Stacked factors of the residual
        (:class:`fedlr.linalg.StackedResidual`).
    scaling : float
        The LoRA scaling ``alpha / r``.
    dtype : torch.dtype, default float32
        The factors' dtype on the wire (the base weights').

    Returns
    -------
    BaseDelta or None
        ``None`` when the factors would not be smaller than the dense weight.
    """
    d_out, d_in = int(left.shape[0]), int(right.shape[1])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if left.shape[1] * (d_out + d_in) >= d_out * d_in * 2:
        return None  # even at half the stacked rank it would not pay
    u, vh = _recompress(left, right, scaling)
    delta = BaseDelta(LOWRANK, u.to(dtype).contiguous(), vh.to(dtype).contiguous())
    return delta if _smaller(delta, d_out, d_in, itemsize) else None


def vera_delta(
    lambda_bs: Sequence[torch.Tensor],
    lambda_ds: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    scaling: float,
    d_in: int,
    *,
    dtype: torch.dtype = torch.float32,
    transposed: bool = False,
) -> BaseDelta | None:
    """VeRA-FedEx's change ``scaling (B o M) A``: the factors of ``M``.

    ``M = sum_i w_i b_i d_i^T - b_bar d_bar^T`` (d_out x r), from the stacked
    ``[w_1 b_1, ..., w_k b_k, -b_bar]`` and ``[d_1, ..., d_k, d_bar]``.

    Parameters
    ----------
    lambda_bs : k tensors of shape (d_out,)
    lambda_ds : k tensors of shape (r,)
    weights : (k,) sequence of float
        Normalised internally.
    scaling : float
        The adapter's scaling times the fold's step (``fedex-lr``).
    d_in : int
        The layer's input size (to compare with the dense weight).
    dtype : torch.dtype, default float32
    transposed : bool, default False
        The layer stores ``W0`` as (d_in, d_out) (a ``Conv1D``): the change is
        marked :attr:`BaseDelta.transposed`.

    Returns
    -------
    BaseDelta or None
        ``None`` when the factors would not be smaller than the dense weight.
    """
    left, right = lambda_stacks(lambda_bs, lambda_ds, weights)
    u, vh = _recompress(left, right, scaling)
    delta = BaseDelta(
        VERA, u.to(dtype).contiguous(), vh.to(dtype).contiguous(), transposed
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    return delta if _smaller(delta, int(left.shape[0]), d_in, itemsize) else None


_CHUNK_ROWS = 1024
"""Rows of a weight converted to float64 at a time by :func:`checksum`."""


def checksum(key: str, weight: torch.Tensor) -> float:
    """``u^T W v`` in float64, ``u``, ``v`` standard normal vectors seeded by ``key``.

    Tolerant of rounding (compare with :data:`CHECK_TOLERANCE` times
    ``||W||_F``), unlike a hash of the bytes: for a difference ``E`` the
    checksums differ by ``u^T E v``, whose mean square is ``||E||_F^2``.
    ``O(d_out d_in)`` time, ``O(d_out + d_in)`` memory besides one float64
    block of :data:`_CHUNK_ROWS` rows.
    """
    w = weight.detach().to("cpu")
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    u = torch.randn(int(w.shape[0]), generator=generator, dtype=torch.float64)
    v = torch.randn(int(w.shape[1]), generator=generator, dtype=torch.float64)
    total = 0.0
    for start in range(0, int(w.shape[0]), _CHUNK_ROWS):
        block = w[start : start + _CHUNK_ROWS].to(torch.float64)
        total += float(u[start : start + _CHUNK_ROWS] @ (block @ v))
    return total


def _matches(key: str, weight: torch.Tensor, expected: float) -> bool:
    norm = float(torch.linalg.vector_norm(weight.detach(), dtype=torch.float64))
    return abs(checksum(key, weight) - expected) <= CHECK_TOLERANCE * max(norm, 1e-30)


# ------------------------------------------------------------------ records
def encode_steps(steps: Sequence[tuple[int, Mapping[str, BaseDelta]]]) -> ArrayRecord:
    """The ArrayRecord ``base-delta`` of consecutive changes.

    Keys are ``<version>:<kind>:<base key>:left`` and ``...:right``, where
    ``version`` is the version the change leads to and ``kind`` ends in
    :data:`TRANSPOSED_SUFFIX` for a transposed change.
    """
    arrays: dict[str, torch.Tensor] = {}
    for version, deltas in steps:
        for key, delta in deltas.items():
            kind = delta.kind + (TRANSPOSED_SUFFIX if delta.transposed else "")
            prefix = f"{version}:{kind}:{key}"
            arrays[f"{prefix}:left"] = delta.left
            arrays[f"{prefix}:right"] = delta.right
    return state_to_record(arrays)


def decode_steps(record: ArrayRecord) -> dict[int, dict[str, BaseDelta]]:
    """The changes of an ArrayRecord ``base-delta``, by the version they lead to.

    Raises
    ------
    ProtocolError
        If a key is malformed or a change lacks a factor.
    """
    parts: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in record_to_state(record).items():
        try:
            version_text, kind, rest = name.split(":", 2)
            key, side = rest.rsplit(":", 1)
            version = int(version_text)
        except ValueError:
            raise BaseOutOfSyncError(f"malformed base-delta key {name!r}") from None
        if kind.removesuffix(TRANSPOSED_SUFFIX) not in _KINDS or side not in (
            "left",
            "right",
        ):
            raise BaseOutOfSyncError(f"malformed base-delta key {name!r}")
        parts.setdefault((version, kind, key), {})[side] = tensor
    steps: dict[int, dict[str, BaseDelta]] = {}
    for (version, kind, key), sides in parts.items():
        if set(sides) != {"left", "right"}:
            raise BaseOutOfSyncError(f"base-delta {version}:{key} lacks a factor")
        steps.setdefault(version, {})[key] = BaseDelta(
            kind.removesuffix(TRANSPOSED_SUFFIX),
            sides["left"],
            sides["right"],
            kind.endswith(TRANSPOSED_SUFFIX),
        )
    return steps


# ------------------------------------------------------------------ client
def receive_base(
    received: Mapping[str, torch.Tensor],
    content: RecordDict,
    config: ConfigRecord,
    state: RecordDict,
    keys: Sequence[str],
    projections: Projections | None = None,
) -> tuple[dict[str, torch.Tensor], int] | None:
    """A node's base weights for this instruction, and their version.

    Dense base weights in ``received`` are taken as they are; otherwise the
    node's stored ones (``state``, i.e. ``context.state``) are brought to
    ``base-version`` by the instruction's ``base-delta`` changes (those it
    does not hold yet) and checked against ``base-check``. Either way they
    are stored back in ``state``.

    Parameters
    ----------
    received : mapping of str to torch.Tensor
        The instruction's ``arrays``.
    content : RecordDict
        The instruction.
    config : ConfigRecord
        The instruction's ConfigRecord.
    state : RecordDict
        The node's ``context.state``.
    keys : sequence of str
        The model's base-weight keys (layout order).
    projections : callable, optional
        A VeRA model's shared projections, for :data:`VERA` changes.

    Returns
    -------
    (dict of str to torch.Tensor, int) or None
        ``None`` when the instruction carries no ``base-version`` (the
        server sends dense base weights every round, or none).

    Raises
    ------
    BaseOutOfSyncError
        If the node cannot reach ``base-version`` (it keeps no base weights,
        or older ones than the changes start from) or the result fails the
        checksum.
    """
    if protocol.BASE_VERSION not in config or not keys:
        return None
    target = config_int(config, protocol.BASE_VERSION)
    if target < 0:  # the server expects changes not to pay: keep no copy
        for name in (protocol.BASE_STATE, _VERSION_RECORD):
            if name in state:
                del state[name]
        return None
    if all(key in received for key in keys):
        base = {key: received[key] for key in keys}
        _store(state, base, target)
        return base, target
    stored = state.array_records.get(protocol.BASE_STATE)
    meta = state.config_records.get(_VERSION_RECORD)
    if stored is None or meta is None:
        raise BaseOutOfSyncError(
            f"the server sent changes to base weights version {target}, but this "
            "node keeps no base weights (its state was lost); it is sent the "
            "dense weights next time"
        )
    base = record_to_state(stored)
    held = config_int(meta, "version")
    steps = (
        decode_steps(content.array_records[protocol.BASE_DELTA])
        if protocol.BASE_DELTA in content.array_records
        else {}
    )
    held = _apply_steps(base, held, steps, keys, projections)
    if held != target:
        raise BaseOutOfSyncError(
            f"this node keeps base weights version {held}, the round needs {target}"
        )
    _check_sum(base, keys, config.get(protocol.BASE_CHECK), target)
    _store(state, base, target)
    return base, target


def _apply_steps(
    base: dict[str, torch.Tensor],
    held: int,
    steps: Mapping[int, Mapping[str, BaseDelta]],
    keys: Sequence[str],
    projections: Projections | None,
) -> int:
    """Apply to ``base`` (version ``held``) the changes of ``steps`` it does
    not hold yet, in order; the version it reaches."""
    for version in sorted(steps):
        if version <= held:
            continue
        if version != held + 1:
            raise BaseOutOfSyncError(
                f"this node keeps base weights version {held}; the changes sent "
                f"start at {min(steps) - 1}"
            )
        deltas = steps[version]
        if set(deltas) != set(keys):
            raise BaseOutOfSyncError(
                f"base-delta {version} changes {sorted(deltas)}, not the model's "
                f"base weights {list(keys)}"
            )
        for key, delta in deltas.items():
            base[key] = delta.apply(base[key], projections)
        held = version
    return held


def _check_sum(
    base: Mapping[str, torch.Tensor], keys: Sequence[str], expected: object, target: int
) -> None:
    """Refuse base weights that fail the instruction's ``base-check`` sums."""
    if isinstance(expected, list) and len(expected) == len(keys):
        bad = [
            key
            for key, value in zip(keys, expected, strict=True)
            if not _matches(key, base[key], float(cast(float, value)))
        ]
        if bad:
            raise BaseOutOfSyncError(
                f"base weights version {target} fail the checksum on {bad}; "
                "this node's copy drifted from the server's"
            )


def _store(state: RecordDict, base: Mapping[str, torch.Tensor], version: int) -> None:
    state[protocol.BASE_STATE] = state_to_record(base)
    state[_VERSION_RECORD] = ConfigRecord({"version": int(version)})
