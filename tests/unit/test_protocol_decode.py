"""``fedlr.wire.protocol.decode_array``: legitimate encodings pass, checks first."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from flwr.app import Array

from fedlr.errors import ProtocolError
from fedlr.wire.protocol import MAX_HEADER_BYTES, decode_array


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("order", ["C", "F"])
def test_every_float_dtype_and_memory_order_decodes_exactly(dtype, order):
    values = np.asarray(
        np.random.default_rng(0).standard_normal((5, 3)), dtype=dtype, order=order
    )
    tensor = decode_array(Array(values), (5, 3), where="x")
    assert tensor.dtype == torch.from_numpy(values.copy()).dtype
    assert np.array_equal(tensor.numpy(), values)


def test_the_header_is_read_without_loading_the_payload(monkeypatch):
    """A header that disagrees is refused before ``np.load`` ever runs."""
    buffer = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)}
    np.lib.format.write_array_header_1_0(buffer, header)
    data = buffer.getvalue() + b"\0" * 60
    forged = Array(dtype="float32", shape=(3, 5), stype="numpy.ndarray", data=data)

    def no_load(*args, **kwargs):
        raise AssertionError("np.load ran on a refused array")

    monkeypatch.setattr(np, "load", no_load)
    with pytest.raises(ProtocolError, match=r"payload holds <f4 \(1000000, 1000000\)"):
        decode_array(forged, (3, 5), where="x")


def test_the_size_bound_is_the_array_plus_the_header_allowance():
    values = np.zeros((4, 4), dtype=np.float32)
    good = Array(values)
    extra = MAX_HEADER_BYTES + 64 - (len(good.data) - values.nbytes) + 1
    padded = Array(
        dtype="float32",
        shape=(4, 4),
        stype="numpy.ndarray",
        data=good.data + b"\0" * extra,
    )
    with pytest.raises(ProtocolError, match="carries"):
        decode_array(padded, (4, 4), where="x")
