"""One reader of the small text files a user puts beside links.json or a scenario: recorded
traces (``controller.model.traces``: Mahimahi, throughput logs, ``time_s,rate`` rows) and
availability files (``controller.model.availability``: ``node,t_on_s,t_off_s`` rows).

``read_capped`` reads at most a size, ``decode`` takes UTF-8 only, ``rows`` gives a CSV's rows
with their line numbers (blank lines skipped, ``#`` comments where allowed), its header checked.
Every error names the file and, past the reading, the line.
"""
from __future__ import annotations

import csv
import io
from typing import Callable, Iterator, Optional, Sequence

from worker.api.errors import ConfigError


def _size(n_bytes: int) -> str:
    return f"{n_bytes >> 20} MiB" if n_bytes % (1 << 20) == 0 else f"{n_bytes} bytes"


def read_capped(path: str, max_bytes: int, what: str) -> bytes:
    """The bytes of ``path`` (``what`` it is, for the error: "the trace"), at most ``max_bytes``."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{path}: larger than {_size(max_bytes)}")
    return data


def decode(data: bytes, source: str, expected: str = "") -> str:
    """``data`` as UTF-8 text; ``expected``: what the file should be, said in the error."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (byte {e.start})"
                          + (f"; expected {expected}" if expected else "")) from None


def line_place(source: str) -> Callable[[int], str]:
    """``"x.csv, line 3"``: how an error names a line."""
    return lambda n: f"{source}, line {n}"


def rows(text: str, source: str, header: Sequence[str], header_required: bool = True, comments: bool = False,
         place: Optional[Callable[[int], str]] = None) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells stripped) of each row of CSV ``text`` with ``len(header)`` cells;
    the first line is ``header`` (``header_required``) or may be (then skipped); blank lines
    and, with ``comments``, lines starting with ``#`` are skipped. ``place(line)`` starts an
    error (default ``"<source>, line <n>"``)."""
    where = place or line_place(source)
    names = ",".join(header)
    reader = csv.reader(io.StringIO(text))
    first = True
    for cells in reader:
        n = reader.line_num
        stripped = [c.strip() for c in cells]
        if first:
            first = False
            if tuple(stripped) == tuple(header):
                continue
            if header_required:
                raise ConfigError(f"{where(n)}: expected the header {names}, got {','.join(cells)!r}")
        if not any(stripped) or (comments and stripped[0].startswith("#")):
            continue
        if len(stripped) != len(header):
            raise ConfigError(f"{where(n)}: expected {len(header)} fields ({names}), got {len(stripped)}")
        yield n, stripped
    if first and header_required:
        raise ConfigError(f"{where(1)}: expected the header {names}, got ''")
