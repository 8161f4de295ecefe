"""Text from nodes on its way to the operator's terminal: no escape sequences, no controls."""
from __future__ import annotations

import re
from typing import Any

# terminal escape sequences (CSI, OSC, two-character escapes), then every other C0 and C1
# control but tab, and DEL
ESCAPE_SEQUENCES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]"
                              r"|\x9b[0-?]*[ -/]*[@-~]")
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(value: Any) -> Any:
    """``value`` with escape sequences and control characters removed from every string in it."""
    if isinstance(value, str):
        return CONTROL_CHARS.sub("", ESCAPE_SEQUENCES.sub("", value))
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


def clip(text: str, limit: int = 200) -> str:
    """``text`` made printable and cut to ``limit`` characters."""
    return printable(text)[:limit]
