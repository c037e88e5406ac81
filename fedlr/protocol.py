"""The wire protocol between fedlr's strategies and ClientApps, in one place.

Every record name, ConfigRecord key and MetricRecord key that crosses the
network is a constant here; strategies, fedlr's own ClientApps and the public
client helpers (:mod:`fedlr.client`) all import them from this module, so a
key is written once. The helpers encode and decode the few structured values
(role lists) and validate the arrays of any named ArrayRecord a reply carries
(shapes, dtype, finiteness) on the server's drop path.

Instruction (server -> client), one ``RecordDict`` per sampled node:

==========================  ==================================================
record / key                content
==========================  ==================================================
ArrayRecord ``arrays``      the global arrays the method sends, keyed as the
                            adapter layout
ArrayRecord ``personal``    a node's own factors (Global SVD), optional
ArrayRecord ``bases``       FOT's per-layer bases, optional
ConfigRecord ``config``     ``server-round``, ``lr``, ``local-steps``,
                            ``batch-size``, ``train-roles`` and the method's
                            own keys below
==========================  ==================================================

Reply (client -> server):

==========================  ==================================================
ArrayRecord ``arrays``      exactly the arrays of ``train-roles``
ArrayRecord (extra)         ``personal-gram``, ``eigen``, ``sketches`` when the
                            method asks for them
MetricRecord ``metrics``    ``num-examples`` (the client's weight),
                            ``train-loss`` and any metrics of the user's own
==========================  ==================================================

docs/architecture.md ("The record contract") has the full table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedlr.adapters.roles import Role
from fedlr.errors import ProtocolError
from fedlr.flower.records import record_to_state

__all__ = [
    "ARRAYS",
    "BASES",
    "BATCH_SIZE",
    "CLIENT_SVD",
    "CONFIG",
    "EIGEN",
    "EIGEN_KEYS",
    "FLOAT_DTYPES",
    "GPSE_EXAMPLES",
    "GPSE_TASK",
    "KEEP_ROLES",
    "LOCAL_STEPS",
    "LORA_ALPHA",
    "LORA_RANK",
    "LR",
    "METRICS",
    "NUM_EXAMPLES",
    "PARTITION_ID",
    "PERSONAL",
    "PERSONAL_GRAM",
    "PERSONAL_LOADED",
    "PERSONAL_SPLIT",
    "PROJECTION_RANK",
    "PROJECTION_SEED",
    "PROXIMAL_MU",
    "QRMIX_STAGE",
    "SERVER_ROUND",
    "SKETCHES",
    "SKETCH_DIM",
    "TASK",
    "TASK_ROUND",
    "TRAIN_LOSS",
    "TRAIN_LOSS_ALIASES",
    "TRAIN_ROLES",
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
PERSONAL_GRAM = "personal-gram"
"""Reply ArrayRecord of ``B^T B`` (r x r) per layer, keyed by the ``B`` key."""
EIGEN = "eigen"
"""QR-Mix stage-2 reply ArrayRecord of the client's Hessian eigenpairs."""
EIGEN_KEYS = ("vectors", "values", "delta")
"""Keys of the ``eigen`` record."""
SKETCHES = "sketches"
"""FOT reply ArrayRecord of GPSE activation sketches, keyed by layer."""
BASES = "bases"
"""FOT instruction ArrayRecord of the current bases, keyed by layer."""

# ------------------------------------------------------------ config keys
SERVER_ROUND = "server-round"
LR = "lr"
LOCAL_STEPS = "local-steps"
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
CLIENT_SVD = "client-svd"
"""Local SVD: the client re-factors ``(B, A)`` as balanced singular factors."""
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
PROXIMAL_MU = "proximal-mu"
"""FedProx: weight ``mu`` of the clients' proximal term
``(mu / 2) ||theta - theta_global||^2`` over the trained parameters."""

# ------------------------------------------------------------ metric keys
NUM_EXAMPLES = "num-examples"
"""The client's weight: a positive integer."""
TRAIN_LOSS = "train-loss"
TRAIN_LOSS_ALIASES = (TRAIN_LOSS, "train_loss")
"""Accepted spellings of the training loss (Flower's examples use
``train_loss``)."""
PARTITION_ID = "partition-id"
PERSONAL_LOADED = "personal-loaded"
GPSE_EXAMPLES = "gpse-examples"
"""FOT reply metric: examples behind the sketches."""

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Dtypes a reply's arrays may have."""


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


def validate_arrays(
    record: ArrayRecord,
    expected: Mapping[str, tuple[int, ...]],
    *,
    name: str = ARRAYS,
    hint: str = "",
) -> dict[str, torch.Tensor]:
    """Decode ``record`` and check it against ``expected`` keys and shapes.

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
        (up to three of each), a wrong shape, a non-floating dtype, NaN or Inf.
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
    arrays = record_to_state(record)
    for key, tensor in arrays.items():
        if tuple(tensor.shape) != tuple(expected[key]):
            raise ProtocolError(
                f"'{name}' '{key}' has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[key])}"
            )
        if tensor.dtype not in FLOAT_DTYPES:
            raise ProtocolError(
                f"'{name}' '{key}' has dtype {tensor.dtype}, expected floating point"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(f"'{name}' '{key}' contains NaN or Inf")
    return arrays
