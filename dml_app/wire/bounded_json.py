"""JSON from others (nodes, peers, callers) parsed in time linear in its size, nesting bounded.

Python's parser recurses once per ``[`` or ``{``: a line of a few thousand brackets
raises ``RecursionError``, which no ``except ValueError`` catches. ``loads`` measures
the nesting first (brackets inside strings do not count) and refuses a document
deeper than ``MAX_DEPTH`` with a ``ValueError``, as it refuses any malformed one.

The measure is linear on any input and has no per-token loop: escapes are removed, then
(numpy) a running count of quotes says which bytes are inside strings and a cumulative sum
over the other brackets is the depth: 1 MiB of any shape in tens of ms.
"""
from __future__ import annotations

import json
from typing import Any, Union

import numpy as np

MAX_DEPTH = 64  # events, headers and confs nest a few levels
_OPENS = np.zeros(256, dtype=np.int32)
_OPENS[[ord("["), ord("{")]] = 1
_OPENS[[ord("]"), ord("}")]] = -1


class JSONDepthError(ValueError):
    """A document nested deeper than allowed."""


def _raw(data: Union[str, bytes, bytearray, memoryview]) -> bytes:
    return data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)


def depth(data: Union[str, bytes]) -> int:
    """The deepest nesting of arrays and objects in ``data`` (0 for a scalar)."""
    # escapes go first, pairwise from the left as JSON reads them (each \\ pair, then each \"); outside a
    # string a backslash ends the parse, so what this changes after one is never parsed anyway
    unescaped = _raw(data).replace(b"\\\\", b"").replace(b'\\"', b"")
    if not unescaped:
        return 0
    chars = np.frombuffer(unescaped, dtype=np.uint8)
    inside = np.cumsum(chars == ord('"'), dtype=np.int32) & 1  # odd quotes so far: within a string
    level = np.cumsum(_OPENS[chars] * (1 - inside))
    return max(0, int(level.max()))


def loads(data: Union[str, bytes], max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` of ``data``, refused (``JSONDepthError``, a ``ValueError``) when nested
    deeper than ``max_depth``."""
    if not isinstance(data, (str, bytes, bytearray)):
        raise TypeError(f"the JSON object must be str or bytes, not {type(data).__name__}")
    brackets = (b"[", b"{") if isinstance(data, (bytes, bytearray)) else ("[", "{")
    opened = data.count(brackets[0]) + data.count(brackets[1])  # type: ignore[arg-type]
    if opened > max_depth and depth(data) > max_depth:  # fewer brackets than that: shallow enough
        raise JSONDepthError(f"nested deeper than {max_depth} levels")
    return json.loads(data)


def loads_line(line: Union[str, bytes], max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """``loads`` of one line of a file others write, refused (``ValueError``) when longer than
    ``max_bytes``."""
    if len(line) > max_bytes:
        raise ValueError(f"a line of {len(line)} bytes (at most {max_bytes})")
    return loads(line, max_depth)
