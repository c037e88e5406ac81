"""The wire protocol between fedlr's strategies and ClientApps, in one place.

The common round's record names, ConfigRecord keys and MetricRecord keys are
constants here; strategies, fedlr's own ClientApps and the public client
helpers (:mod:`fedlr.client.round`) all import them from this module, so a key is
written once. A key or record that only one method's client feature reads or
writes is named in that feature's module and declared on the feature
(:class:`fedlr.client.features.ClientFeature`: its keys with their bounds, its
records, its node state), e.g. ``proximal-mu`` in
:mod:`fedlr.strategies.fedprox_lora`, ``scaffold-delta`` in
:mod:`fedlr.strategies.scaffold_lora`, ``prune-gamma`` in :mod:`fedlr.client.pruning`.
The helpers encode and decode the few structured values (role lists) and
validate the arrays of any named ArrayRecord a reply carries (shapes, dtype,
finiteness) on the server's drop path.

Instruction (server -> client), one ``RecordDict`` per sampled node:

==========================  ==================================================
record / key                content
==========================  ==================================================
ArrayRecord ``arrays``      the global arrays the method sends, keyed as the
                            adapter layout
ArrayRecord ``personal``    a node's own factors (Global SVD), optional
ArrayRecord ``bases``       FOT's per-layer bases, optional
ArrayRecord ``base-delta``  FedEx: the base-weight changes the node missed, in
                            factored form, instead of the base weights in
                            ``arrays`` (:mod:`fedlr.wire.downlink`), optional
ConfigRecord ``config``     ``server-round``, ``lr``, ``local-steps``,
                            ``batch-size``, ``train-roles``, the keys below
                            and the client features' own keys
==========================  ==================================================

Reply (client -> server):

==========================  ==================================================
ArrayRecord ``arrays``      exactly the arrays of ``train-roles``
ArrayRecord (extra)         ``eigen``, ``sketches`` when the method asks for
                            them; a client feature's own records
MetricRecord ``metrics``    ``num-examples`` (the client's weight),
                            ``train-loss``, FedEx's ``base-held``, HetLoRA's
                            ``rank-pruned`` and any metrics of the user's own
==========================  ==================================================

docs/architecture.md ("The record contract") has the full table;
docs/reliability.md lists every key a node checks and every feature's
records (generated, :mod:`fedlr.configdoc.features`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedlr.adapters.roles import Role
from fedlr.errors import ProtocolError
from fedlr.flower.records import read_npy_header

__all__ = [
    "ARRAYS",
    "BASES",
    "BASE_CHECK",
    "BASE_DELTA",
    "BASE_FINGERPRINT",
    "BASE_FINGERPRINT_KEYS",
    "BASE_HELD",
    "BASE_STATE",
    "BASE_VERSION",
    "BATCH_SIZE",
    "CONFIG",
    "EIGEN",
    "EIGEN_KEYS",
    "EXACT_MATCH",
    "GPSE_EXAMPLES",
    "GPSE_TASK",
    "HELPER_METRICS",
    "KEEP_ROLES",
    "LEADING_RANK",
    "LOCAL_STEPS",
    "LORA_ALPHA",
    "LORA_RANK",
    "LR",
    "MAX_HEADER_BYTES",
    "METRICS",
    "NUM_EXAMPLES",
    "PARTITION_ID",
    "PERPLEXITY",
    "PERSONAL",
    "PERSONAL_LOADED",
    "PERSONAL_SPLIT",
    "PROJECTION_RANK",
    "PROJECTION_SEED",
    "QRMIX_STAGE",
    "RANK_PRUNED",
    "SERVER_ROUND",
    "SKETCHES",
    "SKETCH_DIM",
    "TASK",
    "TASK_EVAL_METRICS",
    "TASK_ROUND",
    "TRAIN_LOSS",
    "TRAIN_LOSS_ALIASES",
    "TRAIN_ROLES",
    "decode_array",
    "decode_roles",
    "encode_roles",
    "gpse_fraction_key",
    "train_loss_of",
    "validate_arrays",
]

# ------------------------------------------------------------------ records
ARRAYS = "arrays"
"""ArrayRecord of the global arrays (instruction) or the trained ones (reply)."""
CONFIG = "config"
"""ConfigRecord of the round's settings."""
METRICS = "metrics"
"""MetricRecord of a reply."""
PERSONAL = "personal"
"""ArrayRecord of a node's own factors (instruction; a client's kept state)."""
EIGEN = "eigen"
"""QR-Mix stage-2 reply ArrayRecord of the client's Hessian eigenpairs."""
EIGEN_KEYS = ("vectors", "values", "delta")
"""Keys of the ``eigen`` record."""
SKETCHES = "sketches"
"""FOT reply ArrayRecord of GPSE activation sketches, keyed by layer."""
BASES = "bases"
"""FOT instruction ArrayRecord of the current bases, keyed by layer."""
BASE_DELTA = "base-delta"
"""FedEx instruction ArrayRecord: the base-weight changes a node missed, in
factored form (:mod:`fedlr.wire.downlink`), sent instead of the dense base weights."""
BASE_STATE = "fedlr-base"
"""Name under which a client keeps its base weights (an ArrayRecord) and
their version (a ConfigRecord) in ``context.state``."""

# ------------------------------------------------------------ config keys
SERVER_ROUND = "server-round"
LR = "lr"
LOCAL_STEPS = "local-steps"
LOCAL_OPTIMIZER = "local-optimizer"
"""The local solver, one of :data:`OPTIMIZERS` (sent by scaffold-lora)."""
OPTIMIZERS = ("adamw", "sgd")
"""The local solvers :func:`fedlr.client.train.train_steps` builds:
``torch.optim.AdamW`` (every method's default) and plain ``torch.optim.SGD``
(no momentum; SCAFFOLD's setting, scaffold-lora's default)."""
BATCH_SIZE = "batch-size"
TRAIN_ROLES = "train-roles"
"""Comma-separated :class:`~fedlr.adapters.Role` values the client trains and
sends back (:func:`encode_roles`)."""
KEEP_ROLES = "keep-roles"
"""Roles the client trains but keeps in its own state (FedSA-LoRA's ``B``)."""
LORA_RANK = "lora-rank"
"""The adapter's rank this round (FedSpec grows it)."""
LORA_ALPHA = "lora-alpha"
"""The LoRA alpha the strategy's arrays assume at ``lora-rank``: a client that
rebuilds its adapter uses this alpha, so that ``alpha / r`` is the scaling the
server aggregated for."""
PERSONAL_SPLIT = "personal-split"
"""Train and evaluate on the client's own train and held-out parts."""
PROJECTION_SEED = "projection-seed"
"""VeRA family: seed of the frozen shared projections."""
PROJECTION_RANK = "projection-rank"
"""VeRA family: rank of the frozen shared projections."""
TASK = "task"
"""Continual learning: the current task."""
TASK_ROUND = "task-round"
"""Continual learning: the round's position within the current task."""
GPSE_TASK = "gpse-task"
"""FOT: the task whose activation sketches the client sends (-1: none)."""
SKETCH_DIM = "sketch-dim"
"""FOT: columns of the random projection of the activations."""
QRMIX_STAGE = "qrmix-stage"
"""QR-Mix: 1 (FedAvg warm-up) or 2 (head from the clients' eigenpairs)."""
BASE_VERSION = "base-version"
"""FedEx: the version of the base weights this instruction carries (dense in
``arrays``, or reached from the node's stored ones by ``base-delta``); -1:
keep no copy (the server expects changes not to pay: nodes are sampled too
rarely, or a change is not smaller than the weights)."""
BASE_CHECK = "base-check"
"""FedEx: per base key (layout order), a checksum of the base weights at
``base-version`` (:func:`fedlr.wire.downlink.checksum`)."""
BASE_FINGERPRINT = "base-fingerprint"
"""Plug-in use: per key of :data:`BASE_FINGERPRINT_KEYS`, a few seeded random
probes ``u^T W v`` of the frozen weight as the server's model was built
(:mod:`fedlr.wire.fingerprint`); a node whose model differs refuses the round."""
BASE_FINGERPRINT_KEYS = "base-fingerprint-keys"
"""The layout keys :data:`BASE_FINGERPRINT` covers, in its order."""
LEADING_RANK = "leading-rank"
"""Heterogeneous ranks: the global ``A``, ``B`` may be wider than the node's
rank ``r``; keep their leading ``r`` components scaled by
``sqrt(r / r_received)``."""

# ------------------------------------------------------------ metric keys
NUM_EXAMPLES = "num-examples"
"""The client's weight: a positive integer."""
PERPLEXITY = "perplexity"
"""Evaluate reply metric of the causal-LM task: exp of the response loss."""
EXACT_MATCH = "exact-match"
"""Evaluate reply metric of the causal-LM task: share of exact greedy answers."""
TASK_EVAL_METRICS = (PERPLEXITY, EXACT_MATCH)
"""Evaluate reply metrics besides ``accuracy`` and ``loss`` that personalised
strategies average over clients (finite numbers only)."""
TRAIN_LOSS = "train-loss"
TRAIN_LOSS_ALIASES = (TRAIN_LOSS, "train_loss")
"""Accepted spellings of the training loss (Flower's examples use
``train_loss``)."""
PARTITION_ID = "partition-id"
PERSONAL_LOADED = "personal-loaded"
GPSE_EXAMPLES = "gpse-examples"
"""FOT reply metric: examples behind the sketches."""
BASE_HELD = "base-held"
"""FedEx reply metric: the ``base-version`` the node now keeps in its state
(a node that sends it is sent factored changes from then on)."""
RANK_PRUNED = "rank-pruned"
"""HetLoRA reply metric with ``prune-gamma`` < 1
(:data:`fedlr.client.pruning.PRUNE_GAMMA`): 1 if the node pruned its rank
after this round's training (the reply is at the lower rank), else 0."""

_WIRE_DTYPES = {"float16": 2, "float32": 4, "float64": 8}
"""The dtypes a reply's arrays may declare on the wire, with their item sizes
(numpy's ``.npy`` format, Flower's ``numpy.ndarray`` serialisation; numpy has
no bfloat16)."""

MAX_HEADER_BYTES = 4096
"""Bytes an array's ``.npy`` header may take beyond its data: a reply array
whose payload exceeds ``items * itemsize + MAX_HEADER_BYTES`` is refused
before it is decoded."""


def gpse_fraction_key(layer: str) -> str:
    """FOT reply metric holding the residual energy fraction ``r_l`` of ``layer``."""
    return f"gpse-fraction.{layer}"


def encode_roles(roles: Iterable[Role]) -> str:
    """``"lora_A,lora_B,head"``: the ConfigRecord value of a role list."""
    return ",".join(role.value for role in roles)


def decode_roles(
    config: ConfigRecord | Mapping[str, object],
    key: str = TRAIN_ROLES,
    default: Sequence[Role] = (),
) -> tuple[Role, ...]:
    """The roles a ConfigRecord names under ``key`` (``default`` if absent).

    Raises
    ------
    ProtocolError
        If the value is not a string or names an unknown role.
    """
    if key not in config:
        return tuple(default)
    raw = config[key]
    if not isinstance(raw, str):
        raise ProtocolError(f"ConfigRecord '{key}' must be a string, got {raw!r}")
    roles: list[Role] = []
    for name in raw.split(","):
        if not name:
            continue
        try:
            roles.append(Role(name))
        except ValueError:
            known = ", ".join(r.value for r in Role)
            raise ProtocolError(
                f"ConfigRecord '{key}' = '{raw}' names an unknown role '{name}' "
                f"(known: {known})"
            ) from None
    return tuple(roles)


def train_loss_of(metrics: Mapping[str, object]) -> float:
    """The training loss a reply reports under any accepted spelling, else NaN."""
    for key in TRAIN_LOSS_ALIASES:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return math.nan


@contextmanager
def _undecodable(where: str) -> Iterator[None]:
    """Turn any error of reading ``.npy`` bytes into a ProtocolError."""
    try:
        yield
    except Exception as exc:  # a malformed .npy raises many kinds of error
        raise ProtocolError(
            f"{where} does not decode: {type(exc).__name__}: {exc}"
        ) from None


def decode_array(array: object, shape: tuple[int, ...], *, where: str) -> torch.Tensor:
    """Decode one untrusted reply array, checking everything before decoding it.

    In order, without materialising anything the sender did not prove the
    size of: the object is a Flower ``Array`` serialised as ``numpy.ndarray``;
    its declared dtype is float16/32/64 and its declared shape is ``shape``;
    its payload is no larger than ``shape``'s items times the item size plus
    :data:`MAX_HEADER_BYTES` and no smaller than the items; the ``.npy``
    header (read alone) states the same shape and a native-byte-order float
    dtype of that name. Only then is the array loaded (never with pickle),
    and the result must be finite.

    Parameters
    ----------
    array : object
        A value of a reply's ``ArrayRecord``.
    shape : tuple of int
        The shape the protocol expects.
    where : str
        ``"'arrays' 'layer.lora_A'"``: names the array in messages.

    Returns
    -------
    torch.Tensor
        A CPU tensor of the declared dtype and ``shape``.

    Raises
    ------
    ProtocolError
        Naming ``where`` and the first problem found.
    """
    if not isinstance(array, Array):
        raise ProtocolError(f"{where} is a {type(array).__name__}, not an Array")
    if array.stype != "numpy.ndarray":
        raise ProtocolError(
            f"{where} has serialisation '{array.stype}', expected 'numpy.ndarray'"
        )
    declared = tuple(array.shape)
    if declared != tuple(shape):
        raise ProtocolError(f"{where} has shape {declared}, expected {tuple(shape)}")
    itemsize = _WIRE_DTYPES.get(str(array.dtype))
    if itemsize is None:
        raise ProtocolError(
            f"{where} has dtype {array.dtype!r}, expected one of {sorted(_WIRE_DTYPES)}"
        )
    data = array.data
    if not isinstance(data, bytes):
        raise ProtocolError(f"{where} has a {type(data).__name__} payload, not bytes")
    payload = math.prod(shape) * itemsize
    if not payload <= len(data) <= payload + MAX_HEADER_BYTES:
        raise ProtocolError(
            f"{where} carries {len(data)} bytes; a {array.dtype} array of shape "
            f"{tuple(shape)} takes {payload} plus a header of at most "
            f"{MAX_HEADER_BYTES}"
        )
    stream = io.BytesIO(data)
    with _undecodable(where):
        header_shape, _, dtype = read_npy_header(stream)
    if (
        tuple(header_shape) != tuple(shape)
        or dtype.name != str(array.dtype)
        or not dtype.isnative
    ):
        raise ProtocolError(
            f"{where}'s payload holds {dtype.str} {tuple(header_shape)}, not the "
            f"declared native {array.dtype} {tuple(shape)}"
        )
    stream.seek(0)
    with _undecodable(where):
        values = np.load(stream, allow_pickle=False)
    if values.shape != tuple(shape) or values.dtype != dtype:
        raise ProtocolError(f"{where} decodes to {values.dtype} {values.shape}")
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if not bool(torch.isfinite(tensor).all()):
        raise ProtocolError(f"{where} contains NaN or Inf")
    return tensor


def validate_arrays(
    record: ArrayRecord,
    expected: Mapping[str, tuple[int, ...]],
    *,
    name: str = ARRAYS,
    hint: str = "",
) -> dict[str, torch.Tensor]:
    """Check ``record`` against ``expected`` keys and shapes, then decode it.

    Keys are compared first; each array is then decoded by
    :func:`decode_array`, which refuses a wrong declared shape or dtype, an
    oversized or undersized payload, a payload whose header disagrees with
    the declaration, bytes that do not decode, and NaN or Inf.

    Parameters
    ----------
    record : ArrayRecord
    expected : mapping of str to tuple of int
        Every key the record must carry, and its shape.
    name : str
        The record's name, for the messages.
    hint : str
        Appended to a wrong-keys message (e.g. what ``train-roles`` asked for).

    Returns
    -------
    dict of str to torch.Tensor
        The decoded arrays.

    Raises
    ------
    ProtocolError
        Naming the record and the first problem: missing or unexpected keys
        (up to three of each), then :func:`decode_array`'s.
    """
    keys = set(record.keys())
    if keys != set(expected):
        missing = sorted(set(expected) - keys)
        extra = sorted(keys - set(expected))
        message = (
            f"'{name}' has wrong keys: {len(missing)} missing {missing[:3]}, "
            f"{len(extra)} unexpected {extra[:3]}"
        )
        raise ProtocolError(message + (f"; {hint}" if hint else ""))
    return {
        key: decode_array(record[key], tuple(expected[key]), where=f"'{name}' '{key}'")
        for key in record
    }


HELPER_METRICS = (
    PARTITION_ID,
    PERSONAL_LOADED,
    PROJECTION_SEED,
    PROJECTION_RANK,
    BASE_HELD,
    RANK_PRUNED,
)
"""Reply metrics fedlr's client helpers write that are ids or flags, not
measurements: left out of what ``train_metrics_aggr_fn`` /
``evaluate_metrics_aggr_fn`` average (a mean partition id means nothing). The
strategies read them from each reply; the counts that matter are in fedlr's
own round metrics (``personal-clients``, ``pruned-clients``)."""
