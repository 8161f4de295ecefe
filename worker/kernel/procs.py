"""Telling a started process from a later one that reused its pid, and stopping it."""
from __future__ import annotations

import os
import signal
from typing import Any, Optional


def start_ticks(pid: int) -> Optional[int]:
    """A live process's start time in clock ticks (None when gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def kill_group(record: dict[str, Any]) -> None:
    """SIGKILL a recorded process's group, if its pid still names the process that was started."""
    if record.get("start_ticks") is None or start_ticks(record["pid"]) != record["start_ticks"]:
        return
    try:
        os.killpg(record["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass
