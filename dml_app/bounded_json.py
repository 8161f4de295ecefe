"""JSON from others (nodes, peers) parsed with its nesting bounded.

Python's parser recurses once per ``[`` or ``{``: a line of a few thousand brackets
raises ``RecursionError``, which no ``except ValueError`` catches. ``loads`` measures
the nesting first (brackets inside strings do not count) and refuses a document
deeper than ``MAX_DEPTH`` with a ``ValueError``, as it refuses any malformed one.
"""
from __future__ import annotations

import json
import re
from typing import Any, Union

MAX_DEPTH = 64  # events, headers and confs nest a few levels
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class JSONDepthError(ValueError):
    """A document nested deeper than allowed."""


def depth(data: Union[str, bytes]) -> int:
    """The deepest nesting of arrays and objects in ``data`` (0 for a scalar)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    deepest = level = 0
    for m in _TOKENS.finditer(raw):
        token = m.group()
        if token in (b"[", b"{"):
            level += 1
            deepest = max(deepest, level)
        elif token in (b"]", b"}"):
            level -= 1
    return deepest


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
