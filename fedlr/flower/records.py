"""Adapter state <-> ``ArrayRecord``, and typed access to a message's records.

The typed accessors (:func:`array_record`, :func:`config_record`,
:func:`config_int`, :func:`config_float`, :func:`config_str`) narrow Flower's
union-typed values and raise :class:`~fedlr.errors.RecordMissingError` or
:class:`~fedlr.errors.RecordTypeError`, naming the record or key and what was
found, when the message does not follow the protocol.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterable, Mapping
from typing import BinaryIO, TypeVar, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedlr.errors import RecordMissingError, RecordTypeError

__all__ = [
    "array_record",
    "config_float",
    "config_int",
    "config_record",
    "config_str",
    "read_npy_header",
    "record_nbytes",
    "record_to_state",
    "record_views",
    "state_to_record",
    "wire_tensor",
]

_Record = TypeVar("_Record", ArrayRecord, ConfigRecord, MetricRecord)


def wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous, in a dtype an ``ArrayRecord`` holds.

    Flower serialises arrays through numpy, which has no bfloat16: a
    bfloat16 tensor (a ``precision = "bfloat16"`` base weight) travels as
    float32, which holds it exactly; a node casts it back when it loads it
    into its bfloat16 parameter.
    """
    out = tensor.detach().to("cpu")
    if out.dtype == torch.bfloat16:
        out = out.to(torch.float32)
    return out.contiguous()


def state_to_record(
    state: Mapping[str, torch.Tensor], keys: Iterable[str] | None = None
) -> ArrayRecord:
    """Pack tensors (all, or those named in ``keys``, in that order).

    bfloat16 tensors travel as float32 (:func:`wire_tensor`).
    """
    selected = list(state) if keys is None else list(keys)
    missing = [k for k in selected if k not in state]
    if missing:
        raise KeyError(f"state has no tensors for keys {missing[:5]}")
    return ArrayRecord({k: wire_tensor(state[k]) for k in selected})


def record_to_state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Unpack an ``ArrayRecord`` into CPU tensors (dtype preserved)."""
    return dict(record.to_torch_state_dict())


def read_npy_header(stream: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype of the ``.npy`` bytes at ``stream``.

    How Flower serialises an ``Array`` (``stype = "numpy.ndarray"``). Leaves
    ``stream`` at the first data byte. Raises what numpy raises for bytes
    that are not a ``.npy`` header.
    """
    version = np.lib.format.read_magic(stream)
    read = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
    )
    shape, fortran, descr = read(stream)
    return tuple(shape), bool(fortran), np.dtype(descr)


def record_views(record: ArrayRecord, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read-only CPU tensors over the payloads of ``record``'s ``keys``, no copy.

    For reading the server's own arrays (checksums, sizes) without
    :func:`record_to_state`'s copy of every payload: at LLM sizes that copy
    is seconds per call. The tensors share memory with the immutable
    ``bytes`` of each ``Array``: never write to them. Arrays not serialised
    as ``numpy.ndarray`` are decoded with a copy. Not for untrusted replies
    (:func:`fedlr.wire.protocol.decode_array` checks those).
    """
    return {key: _payload_view(record[key]) for key in keys}


def _payload_view(array: Array) -> torch.Tensor:
    if array.stype != "numpy.ndarray":
        return torch.from_numpy(array.numpy())
    stream = io.BytesIO(array.data)
    shape, fortran, dtype = read_npy_header(stream)
    flat = np.frombuffer(array.data, dtype=dtype, offset=stream.tell())
    with warnings.catch_warnings():  # the bytes are immutable; we only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(flat.reshape(shape, order="F" if fortran else "C"))


def record_nbytes(record: ArrayRecord) -> int:
    """Payload bytes of the arrays in ``record`` (what travels on the wire)."""
    return sum(len(array.data) for array in record.values())


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def _names(keys: Iterable[str], limit: int = 8) -> str:
    names = [f"'{k}'" for k in keys]
    if not names:
        return "none"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _record(content: RecordDict, name: str, kind: type[_Record]) -> _Record:
    if name not in content:
        raise RecordMissingError(
            name,
            f"message has no {kind.__name__} '{name}' (records: {_names(content)})",
        )
    record = content[name]
    if not isinstance(record, kind):
        raise RecordTypeError(
            name,
            f"record '{name}' is {_a(type(record).__name__)}, "
            f"expected {_a(kind.__name__)}",
        )
    return record


def array_record(content: RecordDict, name: str = "arrays") -> ArrayRecord:
    """The ``ArrayRecord`` called ``name`` in a message's content.

    Parameters
    ----------
    content : RecordDict
        The message's content.
    name : str, default "arrays"
        The record's name.

    Returns
    -------
    ArrayRecord

    Raises
    ------
    RecordMissingError
        ``content`` has no record called ``name``.
    RecordTypeError
        The record called ``name`` is not an ``ArrayRecord``.
    """
    return _record(content, name, ArrayRecord)


def config_record(content: RecordDict, name: str = "config") -> ConfigRecord:
    """The ``ConfigRecord`` called ``name`` in a message's content.

    Parameters
    ----------
    content : RecordDict
        The message's content.
    name : str, default "config"
        The record's name.

    Returns
    -------
    ConfigRecord

    Raises
    ------
    RecordMissingError
        ``content`` has no record called ``name``.
    RecordTypeError
        The record called ``name`` is not a ``ConfigRecord``.
    """
    return _record(content, name, ConfigRecord)


def _config_value(
    config: ConfigRecord,
    key: str,
    default: object,
    accepted: tuple[type, ...],
    expected: str,
) -> object:
    """``config[key]`` if it is of an ``accepted`` type (never ``bool``), else raise.

    The one lookup behind :func:`config_int`, :func:`config_float` and
    :func:`config_str`.

    Returns ``default`` when the key is absent and ``default`` is not None.
    """
    if key not in config:
        if default is None:
            raise RecordMissingError(
                key, f"config key '{key}' is missing (keys: {_names(config)})"
            )
        return default
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, accepted):
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        raise RecordTypeError(
            key,
            f"config key '{key}' is {type(value).__name__} ({shown}), "
            f"expected {expected}",
        )
    return value


def config_int(config: ConfigRecord, key: str, default: int | None = None) -> int:
    """The integer ``config[key]``, or ``default`` when the key is absent.

    ``bool`` values are refused (``True`` is not a step count or a seed), and
    so are floats, even integral ones: the server sends Python ints.

    Parameters
    ----------
    config : ConfigRecord
        The round's ConfigRecord.
    key : str
        The key.
    default : int, optional
        Returned when ``key`` is absent; without it the key is required.

    Returns
    -------
    int

    Raises
    ------
    RecordMissingError
        ``key`` is absent and there is no default.
    RecordTypeError
        The value is not an ``int`` (or is a ``bool``).
    """
    return cast(int, _config_value(config, key, default, (int,), "an integer"))


def config_float(config: ConfigRecord, key: str, default: float | None = None) -> float:
    """The number ``config[key]`` as a float, or ``default`` when the key is absent.

    Ints are accepted (and converted); ``bool`` values are refused.

    Parameters
    ----------
    config : ConfigRecord
        The round's ConfigRecord.
    key : str
        The key.
    default : float, optional
        Returned (as a float) when ``key`` is absent; without it the key is
        required.

    Returns
    -------
    float

    Raises
    ------
    RecordMissingError
        ``key`` is absent and there is no default.
    RecordTypeError
        The value is neither an ``int`` nor a ``float`` (or is a ``bool``).
    """
    number = _config_value(config, key, default, (int, float), "a number")
    return float(cast(float, number))


def config_str(config: ConfigRecord, key: str, default: str | None = None) -> str:
    """The string ``config[key]``, or ``default`` when the key is absent.

    Parameters
    ----------
    config : ConfigRecord
        The round's ConfigRecord.
    key : str
        The key.
    default : str, optional
        Returned when ``key`` is absent; without it the key is required.

    Returns
    -------
    str

    Raises
    ------
    RecordMissingError
        ``key`` is absent and there is no default.
    RecordTypeError
        The value is not a ``str``.
    """
    return cast(str, _config_value(config, key, default, (str,), "a string"))
