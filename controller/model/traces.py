"""Recorded link traces: a recording read into the rate a link replays, bin by bin.

Formats (``read_trace(path, fmt, bin_ms)``):

- ``mahimahi``: Mahimahi's delivery-opportunity traces (``.up``/``.down``): one line per chance to
  deliver one 1,500-byte packet, its time in ms from the start (lines may repeat a time: several
  packets in one ms). The trace lasts until its last time; a bin's rate is its opportunities'
  bits over the bin.
- ``hsdpa`` and ``ghent4g``: per-interval throughput logs, one line per interval, columns apart
  by white space: the HSDPA logs of Riiser et al. (3G, Norway) and the 4G/LTE logs of van der
  Hooft et al. (Ghent). Both give, 1-based, the ms since the start of the recording in column 2,
  the bytes received since the last line in column 5 and the ms since the last line in column 6:
  the rate of the interval that ends at that line. ``throughput_format`` makes another such
  format from its column numbers.
- ``csv``: ``time_s,rate`` rows (a header row allowed), a rate with its unit (``2mbit``, as
  links.json's ``bw``): the rate from that time to the next row's; the last row lasts one bin.

Each is read into a ``Trace``: the time-weighted mean rate of each ``bin_ms`` bin (a bin that no
interval covers has rate 0). Errors name the file and the line, before anything is created.

A link replays a trace as a ``Replay`` (``TRACE_SCHEMA``: links.json's ``"trace"`` object, and
a scenario's ``trace`` event): the trace shifted by ``offset_s``, stretched by ``time_scale``,
looped or not, never below ``floor_bps``: one packet (a Mahimahi delivery opportunity) a bin, or
a ``FLOOR_WINDOW_S`` when bins are shorter (120 kbit/s at most). HTB charges a packet in full at
its class's rate as it leaves, and a later, higher rate does not pay that debt sooner (a real
link would deliver the packet as soon as its rate rose); at the floor, a packet sent in a gap
is paid within about a bin. So the nodes of an experiment that replays traces are handed packets
of one frame at most (``REPLAY_GSO_MAX_BYTES``, the node's ``gso_max_bytes``): one 64 KB segment
at 8 kbit/s would be a minute's debt. A recording of slower links wants longer bins (1 s: 12
kbit/s). A replay's rate changes at most every ``MIN_TICK_MS``. ``TraceFiles`` reads each file
(in a format, at a bin) once however many links replay it, and only inside its directory.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from controller.model import csv_file
from controller.model.units import human_rate, parse_rate_bps
from worker.api.errors import ConfigError
from worker.api.schema import MAX_SECONDS, Field, Place, Schema

MAHIMAHI_PACKET_BYTES = 1500
MAX_TRACE_LINES = 10_000_000  # a day of a 1 Gbit/s Mahimahi trace is about 7 M lines per minute: cap the read
MAX_TRACE_BYTES = 256 << 20
MAX_BINS = 10_000_000
MIN_BIN_MS, MAX_BIN_MS = 1, 3_600_000
MIN_REPLAY_RATE_BPS = 8_000  # the least rate a link replays, whatever its bin (a link must have a rate)
FLOOR_WINDOW_S = 0.1  # a bin of nothing delivered lets one packet through in this long (or in a longer bin)
NOTHING_DELIVERED = re.compile(r"\s*(0+\.?0*|\.0+)\s*([A-Za-z]*)\s*")  # a csv rate of 0: an outage
MIN_TICK_MS = 10  # a replay's rate changes at most this often (a bin, stretched by time_scale)
REPLAY_GSO_MAX_BYTES = 1514  # one full Ethernet frame: the largest packet a replaying node's stack hands its interface
MAX_TIME_SCALE = 1000.0
MIN_REPLAY_DELAY_MS = 0.001  # a bin of no delay and no loss keeps a netem leaf: 1 us of delay


def floor_bps(tick_s: float) -> int:
    """The least rate a replay whose bins last ``tick_s`` replays: one 1,500-byte packet a bin (or
    a ``FLOOR_WINDOW_S``, for shorter bins), never below ``MIN_REPLAY_RATE_BPS``."""
    return max(MIN_REPLAY_RATE_BPS, math.ceil(MAHIMAHI_PACKET_BYTES * 8 / max(tick_s, FLOOR_WINDOW_S) - 1e-6))


@dataclass(frozen=True)
class ThroughputColumns:
    """Where a per-interval throughput log keeps its numbers (1-based column numbers)."""

    elapsed_ms: int  # ms from the start of the recording, at the end of the interval
    bytes: int  # bytes received in the interval
    interval_ms: int  # the interval's length


THROUGHPUT_FORMATS = {"hsdpa": ThroughputColumns(2, 5, 6), "ghent4g": ThroughputColumns(2, 5, 6)}
FORMATS = ("mahimahi", *THROUGHPUT_FORMATS, "csv")


@dataclass(frozen=True)
class Trace:
    """A recording as rates by bin: ``rates_bps[k]`` holds from ``k * bin_s`` to ``(k + 1) * bin_s``."""

    source: str
    bin_s: float
    rates_bps: np.ndarray
    delays_ms: Optional[np.ndarray] = None  # a CSV's delay_ms column, by bin (needs sch_netem)
    losses_pct: Optional[np.ndarray] = None  # its loss_pct column

    @property
    def duration_s(self) -> float:
        return self.bin_s * len(self.rates_bps)

    def bin_at(self, t_s: float, loop: bool = True, offset_s: float = 0.0, time_scale: float = 1.0) -> int:
        """The bin at ``t_s`` seconds of the replay: the trace shifted by ``offset_s`` (its time at
        the replay's start), stretched by ``time_scale`` (2: a recorded second lasts two), from the
        start again at its end (``loop``) or holding its last bin."""
        k = math.floor((t_s / time_scale + offset_s) / self.bin_s)
        return k % len(self.rates_bps) if loop else min(max(k, 0), len(self.rates_bps) - 1)

    def rate_at(self, t_s: float, loop: bool = True, offset_s: float = 0.0, time_scale: float = 1.0) -> int:
        """The rate at ``t_s`` seconds of the replay (``bin_at``)."""
        return int(self.rates_bps[self.bin_at(t_s, loop, offset_s, time_scale)])


def read_trace(path: str, fmt: str, bin_ms: int = 100, columns: Optional[ThroughputColumns] = None) -> Trace:
    """The trace of file ``path`` in format ``fmt`` (``FORMATS``; ``columns``: another throughput
    log's), binned at ``bin_ms``."""
    if fmt not in FORMATS and columns is None:
        raise ConfigError(f"{path}: unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    if not isinstance(bin_ms, int) or not MIN_BIN_MS <= bin_ms <= MAX_BIN_MS:
        raise ConfigError(f"{path}: bin_ms must be an integer in [{MIN_BIN_MS}, {MAX_BIN_MS}], got {bin_ms!r}")
    lines = _lines(path)
    if fmt == "mahimahi":
        return mahimahi(lines, bin_ms, path)
    if fmt == "csv":
        return rate_rows(lines, bin_ms, path)
    return throughput_log(lines, columns or THROUGHPUT_FORMATS[fmt], bin_ms, path)


def _lines(path: str) -> list[str]:
    lines = csv_file.decode(csv_file.read_capped(path, MAX_TRACE_BYTES, "the trace"), path).splitlines()
    if len(lines) > MAX_TRACE_LINES:
        raise ConfigError(f"{path}: more than {MAX_TRACE_LINES} lines")
    return lines


def _numbers(lines: Sequence[str], path: str, parse: Callable[[list[str], int], tuple]) -> list[tuple]:
    """``parse(fields, line number)`` of every line that is not blank or a ``#`` comment."""
    out = [parse(line.split(), n) for n, line in enumerate(lines, 1) if line.strip() and not line.lstrip().startswith("#")]
    if not out:
        raise ConfigError(f"{path}: the trace is empty")
    return out


def _number(text: str, what: str, where: str, integer: bool = False) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise ConfigError(f"{where}: {what} {text!r} is not {'an integer' if integer else 'a number'}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: {what} must be a finite number >= 0, got {text!r}")
    return value


def mahimahi(lines: Sequence[str], bin_ms: int, path: str) -> Trace:
    """Mahimahi delivery opportunities (ms, one 1,500-byte packet each) as rates by bin."""
    def parse(fields: list[str], n: int) -> tuple:
        if len(fields) != 1:
            raise ConfigError(f"{path}, line {n}: expected one time in ms, got {len(fields)} fields")
        return (_number(fields[0], "the time", f"{path}, line {n}", integer=True), n)

    rows = _numbers(lines, path, parse)
    times = np.array([t for t, _ in rows], dtype=np.int64)
    back = np.flatnonzero(np.diff(times) < 0)
    if len(back):
        raise ConfigError(f"{path}, line {rows[back[0] + 1][1]}: time goes back "
                          f"({times[back[0] + 1]} ms after {times[back[0]]} ms)")
    n_bins = max(1, math.ceil(int(times[-1]) / bin_ms))
    _check_bins(n_bins, path)
    counts = np.bincount(np.minimum(times // bin_ms, n_bins - 1), minlength=n_bins)
    rates = counts * (MAHIMAHI_PACKET_BYTES * 8) / (bin_ms / 1000)
    return Trace(path, bin_ms / 1000, np.round(rates).astype(np.int64))


def throughput_log(lines: Sequence[str], columns: ThroughputColumns, bin_ms: int, path: str) -> Trace:
    """A per-interval throughput log (``columns`` say where its numbers are) as rates by bin."""
    need = max(columns.elapsed_ms, columns.bytes, columns.interval_ms)

    def parse(fields: list[str], n: int) -> tuple:
        where = f"{path}, line {n}"
        if len(fields) < need:
            raise ConfigError(f"{where}: {len(fields)} columns, the format reads column {need}")
        end = _number(fields[columns.elapsed_ms - 1], f"column {columns.elapsed_ms} (ms since the start)", where)
        size = _number(fields[columns.bytes - 1], f"column {columns.bytes} (bytes)", where)
        span = _number(fields[columns.interval_ms - 1], f"column {columns.interval_ms} (ms of the interval)", where)
        if span <= 0:
            raise ConfigError(f"{where}: column {columns.interval_ms} (ms of the interval) must be > 0, got {span:g}")
        return end, size, span, n

    rows = _numbers(lines, path, parse)
    for (end0, *_), (end1, _, _, n) in zip(rows, rows[1:]):
        if end1 < end0:
            raise ConfigError(f"{path}, line {n}: time goes back ({end1:g} ms after {end0:g} ms)")
    origin = rows[0][0] - rows[0][2]
    ends = np.array([r[0] for r in rows]) - origin
    starts = np.maximum(ends - np.array([r[2] for r in rows]), np.concatenate([[0.0], ends[:-1]]))  # (overlaps clipped)
    rates = np.array([r[1] * 8 / (r[2] / 1000) for r in rows])
    return Trace(path, bin_ms / 1000, binned(starts / 1000, ends / 1000, rates, bin_ms / 1000, path))


CSV_HEADER = ("time_s", "rate")
NETEM_COLUMNS = ("delay_ms", "loss_pct")  # optional after rate, named in the header: they need sch_netem
CSV_HEADERS = [CSV_HEADER, (*CSV_HEADER, "delay_ms"), (*CSV_HEADER, "loss_pct"), (*CSV_HEADER, *NETEM_COLUMNS)]
MAX_TRACE_DELAY_MS = 60_000.0


def _csv_header(lines: Sequence[str], path: str) -> tuple[str, ...]:
    """The columns of a trace CSV: its header's, when its first line names ``time_s`` first."""
    first = next((line for line in lines if line.strip()), "")
    cells = tuple(c.strip() for c in first.split(","))
    if cells[0] != "time_s":
        return CSV_HEADER
    if cells not in CSV_HEADERS:
        n = next(i for i, line in enumerate(lines, 1) if line.strip())
        raise ConfigError(f"{path}, line {n}: the header must be time_s,rate with delay_ms and/or loss_pct after "
                          f"it, got {first.strip()!r}")
    return cells


def rate_rows(lines: Sequence[str], bin_ms: int, path: str) -> Trace:
    """``time_s,rate`` rows (a header row allowed; with it, ``delay_ms`` and ``loss_pct`` columns
    may follow) as rates (delays, losses) by bin: each row holds until the next row's time."""
    header = _csv_header(lines, path)
    rows = []
    for n, cells in csv_file.rows("\n".join(lines), path, header, header_required=header != CSV_HEADER,
                                  comments=True):
        where = f"{path}, line {n}"
        t = _number(cells[0], "time_s", where)
        try:
            zero = NOTHING_DELIVERED.fullmatch(cells[1])
            rate = parse_rate_bps(cells[1]) if zero is None else 0
            if zero is not None and zero.group(2):
                try:
                    parse_rate_bps(f"1{zero.group(2)}")  # (the unit is one)
                except ConfigError:
                    raise ConfigError(f"rate {cells[1]!r}: unknown unit {zero.group(2)!r} (as links.json's "
                                      "bw: 2mbit, 500kbit)") from None
        except ConfigError as e:
            raise ConfigError(f"{where}: {e.message}") from None
        extra = {name: _number(text, name, where) for name, text in zip(header[2:], cells[2:])}
        if extra.get("delay_ms", 0) > MAX_TRACE_DELAY_MS or extra.get("loss_pct", 0) > 100:
            raise ConfigError(f"{where}: delay_ms must be at most {MAX_TRACE_DELAY_MS:g} and loss_pct at most 100, "
                              f"got {', '.join(cells[2:])}")
        rows.append((t, rate, n, extra))
    if not rows:
        raise ConfigError(f"{path}: the trace is empty")
    for (t0, *_), (t1, _, n, _) in zip(rows, rows[1:]):
        if t1 < t0:
            raise ConfigError(f"{path}, line {n}: time_s goes back ({t1:g} after {t0:g})")
    starts = np.array([r[0] for r in rows])
    ends = np.concatenate([starts[1:], [starts[-1] + bin_ms / 1000]])

    def column(values: list[float], integer: bool) -> np.ndarray:
        return binned(starts, ends, np.array(values, dtype=float), bin_ms / 1000, path, integer)

    netem = {name: column([r[3][name] for r in rows], False) if name in header else None for name in NETEM_COLUMNS}
    return Trace(path, bin_ms / 1000, column([r[1] for r in rows], True), netem["delay_ms"], netem["loss_pct"])


def binned(starts_s: np.ndarray, ends_s: np.ndarray, rates_bps: np.ndarray, bin_s: float, path: str,
           integer: bool = True) -> np.ndarray:
    """The time-weighted mean rate of each bin of ``bin_s`` from 0 to the last end, given rates
    that hold from ``starts_s`` to ``ends_s`` (a bin part no interval covers counts as rate 0);
    rounded to integers, or (a delay, a loss) to 3 decimals."""
    n_bins = max(1, math.ceil(round(float(ends_s[-1]) / bin_s, 9)))
    _check_bins(n_bins, path)
    edges = np.arange(n_bins + 1) * bin_s
    # bits delivered by time t, as a piecewise-linear function sampled at the bin edges
    knots = np.concatenate([[0.0], np.ravel(np.column_stack([starts_s, ends_s]))])
    bits = np.concatenate([[0.0], np.ravel(np.column_stack([np.zeros(len(starts_s)), rates_bps * (ends_s - starts_s)]))])
    cumulative = np.interp(edges, knots, np.cumsum(bits))
    means = np.diff(cumulative) / bin_s
    return np.round(means).astype(np.int64) if integer else np.maximum(np.round(means, 3), 0.0)


def _check_bins(n_bins: int, path: str) -> None:
    if n_bins > MAX_BINS:
        raise ConfigError(f"{path}: {n_bins} bins, more than {MAX_BINS}: use a larger bin_ms")


def throughput_format(elapsed_ms: int, bytes_column: int, interval_ms: int) -> ThroughputColumns:
    """A throughput log's columns (1-based), checked."""
    cols = (elapsed_ms, bytes_column, interval_ms)
    if not all(isinstance(c, int) and 1 <= c <= 64 for c in cols) or len(set(cols)) != 3:
        raise ConfigError(f"a throughput log's columns must be three different numbers in [1, 64], got {cols}")
    return ThroughputColumns(*cols)


TRACE_SCHEMA = Schema({
    "file": Field(str, "the recording, relative to the file that names it (and inside its directory)",
                  required=True, max_len=255),
    "format": Field(str, "mahimahi (a .up or .down delivery trace), hsdpa or ghent4g (per-interval throughput "
                         "logs), or csv (time_s,rate rows)", required=True, choices=FORMATS),
    "bin_ms": Field(int, "the recording is replayed as its mean rate over bins of this many ms", default=100,
                    low=MIN_BIN_MS, high=MAX_BIN_MS),
    "time_scale": Field(float, "2: a recorded second lasts two", default=1.0, low=0, low_open=True,
                        high=MAX_TIME_SCALE),
    "loop": Field(bool, "from the start again at the recording's end (false: its last bin holds)", default=True),
    "offset_s": Field(float, "where in the recording the replay starts, in seconds", default=0.0, low=0,
                      high=MAX_SECONDS)})


@dataclass(frozen=True)
class Replay:
    """How one link replays a ``Trace``: ``rate_at(t_s)`` is its rate ``t_s`` seconds after its
    replay started."""

    trace: Trace
    file: str  # as the user named it
    fmt: str
    loop: bool = True
    offset_s: float = 0.0
    time_scale: float = 1.0

    @property
    def tick_s(self) -> float:
        """How often its rate may change: one bin of the recording, stretched."""
        return self.trace.bin_s * self.time_scale

    @property
    def end_s(self) -> float:
        """When a replay that does not loop reaches its last bin (inf when it loops)."""
        if self.loop:
            return math.inf
        return max(0.0, (self.trace.duration_s - self.trace.bin_s - self.offset_s) * self.time_scale)

    @property
    def floor_bps(self) -> int:
        """The least rate it replays: a bin of nothing delivered (120 kbit/s at 100 ms bins or shorter)."""
        return floor_bps(self.tick_s)

    def replayed(self, rate_bps: float) -> int:
        """The rate a bin of ``rate_bps`` replays at: at least the floor (one packet a bin)."""
        return max(int(rate_bps), self.floor_bps)

    def rate_at(self, t_s: float) -> int:
        return self.replayed(self.trace.rate_at(t_s, self.loop, self.offset_s, self.time_scale))

    @property
    def needs_netem(self) -> bool:
        """Its recording has a delay or a loss column: the link needs a netem leaf throughout."""
        return self.trace.delays_ms is not None or self.trace.losses_pct is not None

    def netem_at(self, t_s: float) -> Optional[tuple[float, float]]:
        """(delay in ms, loss in %) at ``t_s`` when the recording has them (a column it lacks: 0),
        the delay never below ``MIN_REPLAY_DELAY_MS`` (so the link keeps its netem leaf); else None."""
        if not self.needs_netem:
            return None
        k = self.trace.bin_at(t_s, self.loop, self.offset_s, self.time_scale)
        delays, losses = self.trace.delays_ms, self.trace.losses_pct
        return (max(float(delays[k]) if delays is not None else 0.0, MIN_REPLAY_DELAY_MS),
                float(losses[k]) if losses is not None else 0.0)

    def rates_bps(self, seconds: int) -> list[int]:
        """The mean replayed rate of each of its first ``seconds`` seconds (what --dry-run shows)."""
        per_s = max(1, round(1 / self.tick_s)) if self.tick_s < 1 else 1
        return [round(sum(self.rate_at(s + (k + 0.5) / per_s) for k in range(per_s)) / per_s) for s in range(seconds)]

    def describe(self) -> str:
        rates = self.trace.rates_bps
        return (f"{self.file} ({self.fmt}, {self.trace.bin_s * 1000:g} ms bins, {self.trace.duration_s:g} s, "
                f"mean {human_rate(float(np.mean(rates)))}, max {human_rate(float(np.max(rates)))}"
                + (f", from {self.offset_s:g} s" if self.offset_s else "")
                + (f" (looped: {self.offset_s % self.trace.duration_s:g} s in)"
                   if self.offset_s >= self.trace.duration_s else "")
                + (f", x{self.time_scale:g} slower" if self.time_scale > 1 else "")
                + (f", x{1 / self.time_scale:.3g} faster" if self.time_scale < 1 else "")
                + "".join(f", {what} mean {float(np.mean(values)):.3g} {unit}" for what, values, unit in
                          (("delay", self.trace.delays_ms, "ms"), ("loss", self.trace.losses_pct, "%"))
                          if values is not None)
                + (", looped" if self.loop else ", once") + ")")


DRY_RUN_SECONDS = 10


def replay_lines(replay: Replay, seconds: int = DRY_RUN_SECONDS) -> list[str]:
    """The replayed rate, second by second, for people (``--dry-run``)."""
    n = max(1, min(seconds, math.ceil(replay.trace.duration_s * replay.time_scale)))
    rates = replay.rates_bps(n)
    return [f"rate by second from its start (Mbit/s): {', '.join(f'{r / 1e6:.2f}' for r in rates)}"
            + (" ..." if n < replay.trace.duration_s * replay.time_scale or replay.loop else "")]


def trace_path(file: str, base_dir: str, place: Place) -> str:
    """The real path of trace ``file`` inside ``base_dir`` (the directory of the file naming it);
    a path that leads out of it (``..``, an absolute path, a symbolic link) is refused."""
    root = os.path.realpath(base_dir)
    path = os.path.realpath(os.path.join(root, file))
    if os.path.commonpath([root, path]) != root:
        raise ConfigError(f"{place.field('file')}: {file!r} is outside the directory {root}")
    return path


class TraceFiles:
    """The traces that the links of one file replay, each (file, format, bin) read once."""

    def __init__(self, base_dir: str) -> None:
        self.base_dir = base_dir
        self._read: dict[tuple[str, str, int], Trace] = {}

    def replay(self, value: object, place: Place, error: type = ConfigError, loop: bool = True,
               rate_only: Optional[str] = None) -> Replay:
        """The ``Replay`` a trace object (``TRACE_SCHEMA``) at ``place`` asks for; errors of type
        ``error`` name the place, the file and its line. ``loop``: the default of ``loop``;
        ``rate_only``: what replays only the rate ("an access link"): delay and loss columns refused."""
        raw = dict(value) if isinstance(value, dict) else value
        if isinstance(raw, dict) and "loop" not in raw:
            raw["loop"] = loop
        v = TRACE_SCHEMA.validate(raw, place, error)
        try:
            path = trace_path(v["file"], self.base_dir, place)
            key = (path, v["format"], v["bin_ms"])
            if key not in self._read:
                self._read[key] = read_trace(path, v["format"], v["bin_ms"])
        except ConfigError as e:
            raise error(e.message if e.message.startswith(str(place)) else f"{place}: {e.message}") from None
        trace = self._read[key]
        if not v["loop"] and v["offset_s"] >= trace.duration_s:
            raise error(f"{place.field('offset_s')}: {v['offset_s']:g} s is past the end of {v['file']} "
                        f"({trace.duration_s:g} s)")
        replay = Replay(trace, v["file"], v["format"], v["loop"], v["offset_s"], v["time_scale"])
        if replay.tick_s * 1000 < MIN_TICK_MS - 1e-9:
            raise error(f"{place.field('bin_ms')}: bins of {v['bin_ms']} ms at time_scale {v['time_scale']:g} change "
                        f"the rate every {replay.tick_s * 1000:g} ms; a replay changes it at most every "
                        f"{MIN_TICK_MS} ms")
        if rate_only and replay.needs_netem:
            raise error(f"{place.field('file')}: {v['file']} has delay_ms or loss_pct columns, and {rate_only} "
                        f"replays only the rate: a link of links.json replays them")
        return replay

    @property
    def files_read(self) -> int:
        return len(self._read)


TRACE_INPUT = "user:"  # (``controller.model.spec.USER_INPUT``): copied into inputs/ under its relative path


def trace_inputs(replays: Iterable[Replay], workdir: str) -> dict[str, str]:
    """The recordings ``replays`` read, as a run's inputs (role -> path): each under its path
    relative to ``workdir`` (``inputs/traces/bus.down``), or ``traces/<name>`` when it lies
    outside it; each file once."""
    root = os.path.realpath(workdir)
    out: dict[str, str] = {}
    for replay in replays:
        path = replay.trace.source
        rel = os.path.relpath(path, root)
        if rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
            rel = f"traces/{os.path.basename(path)}"
        out[f"{TRACE_INPUT}{rel}"] = path
    return out
