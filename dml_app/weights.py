"""Model weights on the wire: a JSON header and the raw array buffers, never pickle.

Layout: 4-byte big-endian header length, the UTF-8 JSON header, then each
array's bytes (C order, little-endian) one after another::

    {"version": 1, "meta": {...}, "arrays": [{"dtype": "<f4", "shape": [64, 32]}, ...]}

Only plain numeric dtypes are accepted, and sizes are checked against the
buffer before any array is made.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Sequence

import numpy as np

WIRE_VERSION = 1
ALLOWED_DTYPES = {"<f4", "<f8", "<f2", "<i4", "<i8", "|u1", "|i1"}
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAYS = 4096
CONTENT_TYPE = "application/x-edgetb-weights"


class WeightsFormatError(ValueError):
    """The bytes are not a valid weights message."""


def encode(arrays: Sequence[np.ndarray], meta: dict[str, Any] | None = None) -> bytes:
    """Pack arrays (and a small JSON-able ``meta``) into one buffer."""
    specs, buffers = [], []
    for a in arrays:
        a = np.asarray(a)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        dtype = a.dtype.str
        if dtype not in ALLOWED_DTYPES:
            raise WeightsFormatError(f"dtype {dtype} cannot be sent")
        specs.append({"dtype": dtype, "shape": list(a.shape)})
        buffers.append(a.tobytes())
    header = json.dumps({"version": WIRE_VERSION, "meta": meta or {}, "arrays": specs}).encode()
    return struct.pack(">I", len(header)) + header + b"".join(buffers)


def decode(data: bytes) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Unpack a buffer made by ``encode``; anything malformed raises WeightsFormatError."""
    view = memoryview(data)
    if len(view) < 4:
        raise WeightsFormatError("message shorter than its length prefix")
    (hlen,) = struct.unpack(">I", view[:4])
    if hlen > MAX_HEADER_BYTES or 4 + hlen > len(view):
        raise WeightsFormatError(f"header length {hlen} does not fit the message")
    try:
        header = json.loads(bytes(view[4:4 + hlen]))
    except ValueError as e:
        raise WeightsFormatError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("version") != WIRE_VERSION:
        raise WeightsFormatError(f"unsupported weights version {header.get('version') if isinstance(header, dict) else header!r}")
    specs = header.get("arrays")
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise WeightsFormatError("header has no valid array list")
    arrays, offset = [], 4 + hlen
    for i, spec in enumerate(specs):
        try:
            dtype = np.dtype(spec["dtype"])
            shape = tuple(int(d) for d in spec["shape"])
        except (KeyError, TypeError, ValueError):
            raise WeightsFormatError(f"array {i} has a bad spec: {spec!r}") from None
        if spec["dtype"] not in ALLOWED_DTYPES or any(d < 0 for d in shape):
            raise WeightsFormatError(f"array {i}: dtype {spec['dtype']!r} or shape {shape} not allowed")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + size > len(view):
            raise WeightsFormatError(f"array {i} runs past the end of the message")
        arrays.append(np.frombuffer(view[offset:offset + size], dtype=dtype).reshape(shape).copy())
        offset += size
    if offset != len(view):
        raise WeightsFormatError(f"{len(view) - offset} unexpected bytes after the arrays")
    meta = header.get("meta")
    return arrays, meta if isinstance(meta, dict) else {}


Spec = list[tuple[tuple[int, ...], str]]  # per array: (shape, dtype string such as "<f4")


def spec_of(arrays: Sequence[np.ndarray]) -> Spec:
    """What a message for a model with these arrays must look like."""
    return [(tuple(int(d) for d in np.shape(a)), np.asarray(a).dtype.str) for a in arrays]


def problem(arrays: Sequence[np.ndarray], spec: Spec) -> str | None:
    """Why ``arrays`` cannot stand for a model of ``spec`` (layer count, shapes, dtypes,
    finite values), or None when they can."""
    if len(arrays) != len(spec):
        return f"{len(arrays)} arrays where the model has {len(spec)}"
    for i, (a, (shape, dtype)) in enumerate(zip(arrays, spec)):
        if tuple(a.shape) != tuple(shape):
            return f"array {i} has shape {list(a.shape)}, the model's is {list(shape)}"
        if a.dtype.str != dtype:
            return f"array {i} has dtype {a.dtype.str}, the model's is {dtype}"
        if a.dtype.kind == "f" and not bool(np.isfinite(a).all()):
            return f"array {i} holds NaN or infinite values"
    return None


def body_limit(spec: Spec) -> int:
    """The largest weights message a model of ``spec`` needs: its arrays as float64
    (ring partial sums), twice over, plus a header."""
    elements = sum(int(np.prod(shape, dtype=np.int64)) for shape, _ in spec)
    return 2 * 8 * elements + 64 * 1024 + 64 * len(spec)
