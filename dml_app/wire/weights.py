"""Model weights on the wire, in the safetensors layout: never pickle.

A message is a safetensors buffer (the format of the ``safetensors`` package,
loadable by the ecosystem's tools): an 8-byte little-endian header length,
a UTF-8 JSON header padded with spaces to 8 bytes, then the arrays' bytes (C
order, little-endian)::

    {"__metadata__": {"format": "edgetb-weights", "version": "2", "meta": "{\\"from\\": \\"n1\\", ...}"},
     "0000": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 8192]}, "0001": ...}

Arrays are keyed by their position (``0000``, ``0001``, ...), optionally
followed by a dot and the array's name by layer (``0003.batch_normalization/moving_mean``:
characters ``[A-Za-z0-9_./-]``, at most 96), so other tools see what each
array is; the position alone decides the order. ``meta`` (a small
JSON object: sender, round, samples...) travels as one JSON string, since
safetensors metadata holds strings only. This module reads and writes the
layout with numpy alone: a node does not import the ``safetensors`` package
(its extension would add about 0.9 MiB to every node's memory; see
BENCHMARKS.md). Only plain numeric dtypes are accepted, and every size and
offset is checked against the buffer before any array is made.
"""
from __future__ import annotations

import json
import math
import re
import struct
from typing import Any, Sequence

import numpy as np

from dml_app.wire import bounded_json

WIRE_VERSION = 2
FORMAT = "edgetb-weights"
ALLOWED_DTYPES = {"<f4": "F32", "<f8": "F64", "<f2": "F16", "<i4": "I32", "<i8": "I64", "|u1": "U8", "|i1": "I8"}
NUMPY_DTYPES = {name: np.dtype(code) for code, name in ALLOWED_DTYPES.items()}
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAYS = 4096
CONTENT_TYPE = "application/x-edgetb-weights"
MAX_NAME_CHARS = 96
_KEY = re.compile(r"([0-9]{4})(?:\.([A-Za-z0-9_./-]{1,%d}))?" % MAX_NAME_CHARS)
_NOT_NAME = re.compile(r"[^A-Za-z0-9_./-]")


class WeightsFormatError(ValueError):
    """The bytes are not a valid weights message."""


def _name(i: int) -> str:
    return f"{i:04d}"


def sanitised(name: str) -> str:
    """``name`` as a key suffix: characters outside ``[A-Za-z0-9_./-]`` become ``_``, at most 96."""
    return _NOT_NAME.sub("_", str(name))[:MAX_NAME_CHARS] or "_"


def encode(arrays: Sequence[np.ndarray], meta: dict[str, Any] | None = None,
           names: Sequence[str] | None = None) -> bytes:
    """Pack arrays (and a small JSON-able ``meta``) into one safetensors buffer; with ``names``
    (one per array, e.g. a model's ``weight_names()``) the keys are ``f"{i:04d}.{name}"``."""
    if len(arrays) > MAX_ARRAYS:
        raise WeightsFormatError(f"{len(arrays)} arrays, at most {MAX_ARRAYS} can be sent")
    if names is not None and len(names) != len(arrays):
        raise WeightsFormatError(f"{len(names)} names for {len(arrays)} arrays")
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "version": str(WIRE_VERSION),
                                               "meta": json.dumps(meta or {}, separators=(",", ":"))}}
    buffers: list[np.ndarray] = []
    offset = 0
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype.str not in ALLOWED_DTYPES:
            raise WeightsFormatError(f"dtype {a.dtype.str} cannot be sent")
        key = _name(i) if names is None else f"{_name(i)}.{sanitised(names[i])}"
        header[key] = {"dtype": ALLOWED_DTYPES[a.dtype.str], "shape": list(a.shape),
                       "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        buffers.append(a.reshape(-1).view(np.uint8))  # a view: the one copy is the join below
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return b"".join([struct.pack("<Q", len(raw)), raw, *buffers])


def decode(data: bytes) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Unpack a buffer made by ``encode``; anything malformed raises WeightsFormatError."""
    arrays, meta, _ = decode_named(data)
    return arrays, meta


def _keys_in_order(header: dict[str, Any]) -> tuple[list[str], list[str | None]]:
    """The header's keys ordered by their index, and each array's name (None when unnamed);
    the indices must be exactly 0000, 0001, ... (no gap, no duplicate)."""
    by_index: dict[int, str] = {}
    for key in header if len(header) <= MAX_ARRAYS else ():
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        index = int(match.group(1)) if match else -1
        if index < 0 or index in by_index:
            by_index = {}
            break
        by_index[index] = key
    if len(header) > MAX_ARRAYS or set(by_index) != set(range(len(header))):
        raise WeightsFormatError(f"arrays must be named 0000.. in order (optionally 0000.<name>), at most "
                                 f"{MAX_ARRAYS}; got {sorted(header)[:5]}")
    keys = [by_index[i] for i in range(len(header))]
    return keys, [_KEY.fullmatch(k).group(2) for k in keys]


def decode_named(data: bytes) -> tuple[list[np.ndarray], dict[str, Any], list[str | None]]:
    """``decode``, with each array's name from its key (None for a plain ``0000`` key)."""
    view = memoryview(data)
    if len(view) < 8:
        raise WeightsFormatError("message shorter than its length prefix")
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(view):
        raise WeightsFormatError(f"header length {hlen} does not fit the message")
    try:
        header = bounded_json.loads(bytes(view[8:8 + hlen]))
    except ValueError as e:
        raise WeightsFormatError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WeightsFormatError("header is not a JSON object")
    info = header.pop("__metadata__", None)
    if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("version") != str(WIRE_VERSION):
        version = info.get("version") if isinstance(info, dict) else None
        raise WeightsFormatError(f"not an {FORMAT} message of version {WIRE_VERSION} (version {version!r})")
    keys, names = _keys_in_order(header)
    base, size = 8 + hlen, len(view) - 8 - hlen
    specs = []
    for i in range(len(header)):
        spec = header[keys[i]]
        try:
            dtype = NUMPY_DTYPES[spec["dtype"]]
            shape = tuple(spec["shape"])
            start, end = spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsFormatError(f"array {i} has a bad spec: {spec!r}") from None
        if not all(type(d) is int and d >= 0 for d in (*shape, start, end)):
            raise WeightsFormatError(f"array {i}: shape {list(shape)} or offsets [{start}, {end}] not allowed")
        nbytes = math.prod(shape) * dtype.itemsize
        if end - start != nbytes:
            raise WeightsFormatError(f"array {i}: offsets [{start}, {end}] do not hold shape {list(shape)}")
        if end > size:
            raise WeightsFormatError(f"array {i} runs past the end of the message")
        specs.append((start, end, dtype, shape))
    covered = 0  # the data must be covered exactly, without holes or overlaps (as the format demands)
    for start, end, _, _ in sorted(specs, key=lambda s: (s[0], s[1])):
        if start != covered:
            raise WeightsFormatError(f"array data overlaps or leaves a hole at byte {covered}")
        covered = end
    if covered != size:
        raise WeightsFormatError(f"{size - covered} unexpected bytes after the arrays")
    arrays = [np.frombuffer(view[base + start:base + end], dtype=dtype).reshape(shape).copy()
              for start, end, dtype, shape in specs]
    try:
        meta = bounded_json.loads(info.get("meta", "{}"))
    except (TypeError, ValueError):
        raise WeightsFormatError("meta is not a JSON string") from None
    return arrays, meta if isinstance(meta, dict) else {}, names


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
