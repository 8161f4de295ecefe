"""Availability traces: when each node is there, as a CSV, turned into leave/return steps (pure).

The file (beside the scenario, ``node,t_on_s,t_off_s``, one row per interval in which the node
is available; an empty ``t_off_s``: until the run's end)::

    node,t_on_s,t_off_s
    n1,0,120
    n1,300,
    n2,60,90

A node leaves at the run's start when its first interval starts later, at every ``t_off_s`` and
returns at the next ``t_on_s``. A scenario event ``{"at": 0, "availability": {"file": ...}}``
turns it into steps: ``mode`` ``pause`` (the node's processes frozen, then thawed) or ``crash``
(killed, then replaced by a fresh process, as a revocation's replacement); ``time_scale``
multiplies the file's times. With ``"clients": "pick"`` the ``node`` column names trace
clients instead (FedScale's client ids, say): each of the event's ``nodes`` (default: every
node of the topology) plays a client drawn without replacement from the scenario's seed.

Refused with the file and line named: a missing or wrong header, a bad number, an interval that
ends before it starts, two intervals of one node that overlap, an unknown node, a file that is
a pickle (convert it to this CSV first).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Optional

from controller.model import csv_file
from worker.api.errors import ConfigError

HEADER = ("node", "t_on_s", "t_off_s")
MAX_ROWS = 1_000_000
MAX_FILE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Interval:
    """One row: ``name`` is available from ``on_s`` to ``off_s`` (None: the end); ``line`` its line."""

    name: str
    on_s: float
    off_s: Optional[float]
    line: int


def _seconds(text: str, where: str, column: str, allow_empty: bool) -> Optional[float]:
    text = text.strip()
    if not text and allow_empty:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}, column {column!r}: expected seconds (a number >= 0), got {text!r}")
    return value


def parse_csv(data: bytes, source: str) -> list[Interval]:
    """The intervals of an availability file's bytes; ``source`` (its path) starts every error."""
    if data[:1] == b"\x80" or data[:2] in (b"(d", b"(l", b"}q", b"]q"):
        raise ConfigError(f"{source}: looks like a Python pickle, not a CSV; convert it to "
                          f"{','.join(HEADER)} rows first (never unpickled here)")
    text = csv_file.decode(data, source, f"a CSV {','.join(HEADER)}")
    out = []
    for i, row in csv_file.rows(text, source, HEADER, place=lambda n: f"{source}: line {n}"):
        where = f"{source}: line {i}"
        name = row[0].strip()
        if not name:
            raise ConfigError(f"{where}, column 'node': empty")
        on = _seconds(row[1], where, "t_on_s", False)
        off = _seconds(row[2], where, "t_off_s", True)
        assert on is not None
        if off is not None and off <= on:
            raise ConfigError(f"{where}: the interval goes backwards or is empty: t_off_s {off:g} <= t_on_s {on:g}")
        out.append(Interval(name, on, off, i))
        if len(out) > MAX_ROWS:
            raise ConfigError(f"{source}: more than {MAX_ROWS} rows")
    by_name: dict[str, list[Interval]] = {}
    for iv in out:
        by_name.setdefault(iv.name, []).append(iv)
    for name, ivs in by_name.items():
        ivs.sort(key=lambda v: v.on_s)
        for a, b in zip(ivs, ivs[1:]):
            if a.off_s is None or b.on_s < a.off_s:
                raise ConfigError(f"{source}: line {b.line}: {name!r}'s interval from {b.on_s:g} s overlaps the one of "
                                  f"line {a.line} ({a.on_s:g} s to "
                                  f"{'the end' if a.off_s is None else f'{a.off_s:g} s'})")
    return out


def read_csv(path: str) -> list[Interval]:
    """``parse_csv`` of the file at ``path`` (at most ``MAX_FILE_BYTES``)."""
    data = csv_file.read_capped(path, MAX_FILE_BYTES, "the availability file")
    return parse_csv(data, path)


def by_name(intervals: Iterable[Interval]) -> dict[str, list[Interval]]:
    """Name -> its intervals by start, names in the file's order."""
    out: dict[str, list[Interval]] = {}
    for iv in intervals:
        out.setdefault(iv.name, []).append(iv)
    return {k: sorted(v, key=lambda x: x.on_s) for k, v in out.items()}


def pick_clients(clients: list[str], nodes: list[str], rng: random.Random, source: str) -> dict[str, str]:
    """Node -> the trace client it plays, drawn without replacement."""
    if len(clients) < len(nodes):
        raise ConfigError(f"{source}: {len(clients)} clients for {len(nodes)} nodes: each node plays one client")
    return dict(zip(nodes, rng.sample(clients, len(nodes))))


def leave_return_s(intervals: list[Interval], time_scale: float) -> list[tuple[float, str]]:
    """A node's changes, (seconds, "leave" or "return"), in order: it is there at 0 only when an
    interval starts at 0; gone after the last interval's end."""
    if not intervals:
        return [(0.0, "leave")]
    changes: list[tuple[float, str]] = [(0.0, "leave")] if intervals[0].on_s > 0 else []
    for i, iv in enumerate(intervals):
        if changes:  # after a leave
            changes.append((iv.on_s * time_scale, "return"))
        if iv.off_s is None:
            break
        changes.append((iv.off_s * time_scale, "leave"))
    # two adjacent intervals (one ends where the next starts): no leave and return at the same time
    out: list[tuple[float, str]] = []
    for t, what in changes:
        if out and what == "return" and out[-1] == (t, "leave"):
            out.pop()
            continue
        out.append((t, what))
    return out
