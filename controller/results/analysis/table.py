"""Reading the sampler's CSV files fast: numeric columns with numpy's C parser, names as codes.

The collector writes them gzip-compressed (``links.csv.gz``); runs from before that have plain
``links.csv``. ``table_path`` finds either, ``open_text`` opens either as text.

A 10-minute run of 1,466 links sampled at 10 Hz is ~9 million rows; ``csv`` in Python
would take a minute. A large file is cut at line ends into pieces parsed by a few worker
processes at once; each file is read as columns, rows grouped by their key (a link's
``src,dst``, a node's name) and sorted by time within each group.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import os
import tempfile
import warnings
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from worker.api.errors import ConfigError

PARALLEL_ABOVE_BYTES = 32 << 20
TEXT_WIDTH = 32  # a number read as text first (times, CPU seconds)
NAME_WIDTH = 32  # names longer than this are read the slower, general way
FLOAT_COLUMNS = frozenset({"time_s", "cpu_s"})  # every other counter is an integer
MAX_WORKERS = 4
MAX_PLAIN_BYTES = 16 << 30  # a telemetry table decompressed (10 hours at EdgeTB's size: about 5 GB)
PLAIN_PER_GZIP = 20  # room asked of /dev/shm for a table: this many times its compressed size


@dataclass
class Counters:
    """Samples of cumulative counters, grouped by key: ``times[key]`` and ``values[key][column]``."""
    keys: list[tuple[str, ...]]
    times: dict[tuple[str, ...], np.ndarray]
    values: dict[tuple[str, ...], dict[str, np.ndarray]]
    sampled_every_s: Optional[float] = None  # the sampler's period, where the run says it

    def period_s(self) -> float:
        """The sampling period: as the run says, else the most common gap between two rows of a
        series, to the millisecond (an unchanged series has rows a second apart, a changing one
        a period apart)."""
        if self.sampled_every_s is None:
            gaps = [np.diff(t) for t in list(self.times.values())[:200] if t.size > 1]
            ms = np.round(np.concatenate(gaps) * 1000).astype(np.int64) if gaps else np.zeros(0, np.int64)
            ms = ms[ms > 0]
            self.sampled_every_s = float(np.bincount(ms).argmax()) / 1000 if ms.size else 0.0
        return self.sampled_every_s

    def span_s(self) -> tuple[float, float]:
        starts = [t[0] for t in self.times.values() if t.size]
        ends = [t[-1] for t in self.times.values() if t.size]
        return (float(min(starts)), float(max(ends))) if starts else (0.0, 0.0)


def _to_float(text: np.ndarray) -> np.ndarray:
    """Numbers written as text: converted once per run of equal values (a sample's time repeats
    on each of its rows), else all at once."""
    if text.size == 0:
        return np.zeros(0)
    change = np.flatnonzero(text[1:] != text[:-1]) + 1
    if change.size * 4 < text.size:
        starts = np.concatenate(([0], change))
        values = text[starts].astype(np.float64)
        return np.repeat(values, np.diff(np.append(starts, text.size)))
    return text.astype(np.float64)


def _load(body: bytes, numeric: list[int], named: list[int], integers: list[bool]
          ) -> tuple[np.ndarray, list[np.ndarray]]:
    """One pass of numpy's parser over ``body``: counters as integers where ``integers`` says
    so (parsing floats is the slow part), other numbers as text converted after; names as
    fixed-width bytes (ValueError when a name may not fit)."""
    fields = [(f"v{i}", "i8" if integer else f"S{TEXT_WIDTH}") for i, integer in enumerate(integers)]
    fields += [(f"k{j}", f"S{NAME_WIDTH}") for j in range(len(named))]
    with warnings.catch_warnings():  # a blank line: numpy says it is not counted as a row
        warnings.simplefilter("ignore", UserWarning)
        rec = np.loadtxt(io.BytesIO(body), delimiter=",", usecols=numeric + named, dtype=np.dtype(fields), ndmin=1)
    nums = np.empty((rec.size, len(numeric)))
    for i, integer in enumerate(integers):
        nums[:, i] = rec[f"v{i}"] if integer else _to_float(np.ascontiguousarray(rec[f"v{i}"]))
    names = []
    for j in range(len(named)):
        column = np.ascontiguousarray(rec[f"k{j}"])
        if column.size and column.view(np.uint8).reshape(column.size, NAME_WIDTH)[:, -1].any():
            raise ValueError(f"a name of {NAME_WIDTH} bytes or more")
        names.append(column)
    return nums, names


def _parse(path: str, start: int, end: int, numeric: list[int], named: list[int], out: Optional[tuple] = None,
           integers: Optional[list[bool]] = None) -> tuple[Optional[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Rows of the byte range [start, end) of ``path`` (whole lines): the numeric columns, and
    per named column its codes into its own sorted labels. ``integers`` says which numeric
    columns hold integers (tried first; any other form falls back to parsing every number as
    a float). With ``out`` (a shared file, its row count, this piece's first row and its rows)
    the numbers and codes are written there instead of returned (no copy of hundreds of MB
    through a pipe)."""
    with open(path, "rb") as f:
        f.seek(start)
        body = f.read(end - start)
    if not body.strip():
        return np.zeros((0, len(numeric))), [np.zeros(0, np.int64)] * len(named), [np.zeros(0, "S1")] * len(named)
    try:
        try:
            nums, names = _load(body, numeric, named, integers or [False] * len(numeric))
        except ValueError:  # counters written as floats, or long names: the general way
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                nums = np.loadtxt(io.BytesIO(body), delimiter=",", usecols=numeric, dtype=np.float64, ndmin=2)
                both = np.loadtxt(io.BytesIO(body), delimiter=",", usecols=named, dtype=bytes, ndmin=2)
            names = [both[:, j] for j in range(len(named))]
    except ValueError as e:
        raise ConfigError(f"{path}: not a table of numbers and names: {e}") from None
    codes, labels = [], []
    for j in range(len(named)):
        lab, inv = _unique_names(names[j])
        codes.append(inv)
        labels.append(lab)
    if out is None:
        return nums, codes, labels
    shared, total_rows, first_row, rows = out
    if nums.shape[0] != rows:  # blank or comment lines: the caller reads the file in one piece instead
        raise ValueError(f"{rows} lines held {nums.shape[0]} rows")
    n_num, n_named = len(numeric), len(named)
    shared_nums = np.memmap(shared, np.float64, "r+", 0, (total_rows, n_num))
    shared_codes = np.memmap(shared, np.int32, "r+", total_rows * n_num * 8, (total_rows, n_named))
    shared_nums[first_row:first_row + rows] = nums
    for j in range(n_named):
        shared_codes[first_row:first_row + rows, j] = codes[j]
    shared_nums.flush()
    shared_codes.flush()
    del shared_nums, shared_codes
    return None, [np.zeros(0, np.int32)] * len(named), labels


def _unique_names(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct names of a byte-string column and each row's index among them. Names
    of up to 8 bytes are compared as integers (sorting millions of strings is slow)."""
    width = column.dtype.itemsize
    if width > 8 and column.size and not column.view(np.uint8).reshape(column.size, width)[:, 8:].any():
        column = np.ascontiguousarray(column.view(np.uint8).reshape(column.size, width)[:, :8]).view("S8").ravel()
        width = 8
    if width <= 8:
        padded = column.astype("S8")
        as_int = padded.view(">u8")  # big-endian: integer order is the names' byte order
        distinct, inv = np.unique(as_int, return_inverse=True)
        return distinct.astype(">u8").view("S8"), inv.ravel().astype(np.int32)
    lab, inv = np.unique(column, return_inverse=True)
    return lab, inv.ravel().astype(np.int32)


def _pieces(path: str, start: int, size: int, n: int) -> list[tuple[int, int]]:
    """[start, size) cut into about ``n`` byte ranges, each ending at a line end."""
    bounds = [start]
    with open(path, "rb") as f:
        for k in range(1, n):
            f.seek(start + (size - start) * k // n)
            f.readline()
            at = f.tell()
            if bounds[-1] < at < size:
                bounds.append(at)
    bounds.append(size)
    return list(zip(bounds[:-1], bounds[1:]))


def _parse_parallel(path: str, start: int, size: int, numeric: list[int], named: list[int], workers: int,
                    integers: Optional[list[bool]] = None) -> tuple[np.ndarray, list[np.ndarray], list[tuple[int, Any]]]:
    """The pieces of the file parsed by worker processes into one shared file (in memory)."""
    import multiprocessing
    import tempfile

    ranges = _pieces(path, start, size, workers)
    firsts, total = [], 0
    with open(path, "rb") as f:
        for a, b in ranges:
            f.seek(a)
            chunk = f.read(b - a)
            firsts.append(total)
            total += chunk.count(b"\n") + (1 if chunk and not chunk.endswith(b"\n") else 0)
    n_num, n_named = len(numeric), len(named)
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where there is one
    with tempfile.NamedTemporaryFile(prefix="edgetb-analysis-", dir=where) as shared:
        shared.truncate(max(1, total * (n_num * 8 + n_named * 4)))
        with ProcessPoolExecutor(len(ranges), mp_context=multiprocessing.get_context("spawn")) as pool:
            jobs = [(path, a, b, numeric, named, (shared.name, total, first, last - first), integers)
                    for (a, b), first, last in zip(ranges, firsts, firsts[1:] + [total])]
            results = list(pool.map(_parse, *zip(*jobs)))
        nums = np.array(np.memmap(shared.name, np.float64, "r", 0, (total, n_num)))
        codes = np.array(np.memmap(shared.name, np.int32, "r", total * n_num * 8, (total, n_named)))
    blocks = [codes[first:(firsts[i + 1] if i + 1 < len(firsts) else total)] for i, first in enumerate(firsts)]
    return nums, blocks, list(zip(firsts, results))


def _block_size(key: np.ndarray, times: np.ndarray) -> Optional[int]:
    """K when the rows come as the sampler writes them: one block per sample holding every one of
    K keys in the same order, times rising (each key's rows are then every K-th row, no sort
    needed); None when they do not."""
    n = key.size
    first = key[0]
    k = int(np.argmax(key[1:] == first)) + 1 if (key[1:] == first).any() else n
    if n % k or np.unique(key[:k]).size != k:
        return None
    blocks = key.reshape(-1, k)
    if not (blocks == blocks[0]).all():
        return None
    t = times.reshape(-1, k)
    if not (t[1:] >= t[:-1]).all():
        return None
    return k


def table_path(folder: str, stem: str) -> Optional[str]:
    """``folder/stem.csv.gz``, else ``folder/stem.csv`` (a run from before compression), else None."""
    for name in (f"{stem}.csv.gz", f"{stem}.csv"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def open_text(path: str) -> Any:
    """A table file opened as text, decompressed when its name ends in ``.gz``."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", newline="", encoding="utf-8")
    return open(path, newline="", encoding="utf-8")


def _scratch_dir(compressed_bytes: int) -> Optional[str]:
    """/dev/shm (memory) where it has room for ``PLAIN_PER_GZIP`` times the compressed size, else
    the default temporary directory."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize > PLAIN_PER_GZIP * compressed_bytes else None


@contextlib.contextmanager
def _plain_copy(path: str) -> Any:
    """A decompressed copy of the gzip file ``path`` (``MAX_PLAIN_BYTES`` at most: a file from
    elsewhere may be a gzip bomb), removed after."""
    where = _scratch_dir(os.path.getsize(path))
    with tempfile.NamedTemporaryFile(prefix="edgetb-table-", suffix=".csv", dir=where) as plain:
        written = 0
        try:
            with gzip.open(path, "rb") as src:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    if written > MAX_PLAIN_BYTES:
                        raise ConfigError(f"{path}: decompresses to more than {MAX_PLAIN_BYTES >> 30} GiB")
                    plain.write(chunk)
        except (OSError, EOFError, zlib.error) as e:
            raise ConfigError(f"{path}: not a complete gzip file: {e}") from None
        plain.flush()
        yield plain.name


def read_counters(path: str, key_columns: list[str], value_columns: list[str]) -> Counters:
    """The file at ``path`` (a header line, then ``time_s``, the key columns and the counters),
    gzip-compressed when its name ends in ``.gz``."""
    if not path.endswith(".gz"):
        return _read_plain(path, key_columns, value_columns)
    with _plain_copy(path) as plain:
        try:
            return _read_plain(plain, key_columns, value_columns)
        except ConfigError as e:
            raise ConfigError(e.message.replace(plain, path)) from None


def _read_plain(path: str, key_columns: list[str], value_columns: list[str]) -> Counters:
    with open(path, "rb") as f:
        header_line = f.readline()
        body_start = f.tell()
    size = os.path.getsize(path)
    header = header_line.decode(errors="replace").strip().split(",")
    missing = [c for c in ["time_s", *key_columns, *value_columns] if c not in header]
    if missing:
        raise ConfigError(f"{path}: no column {', '.join(missing)} (its header: {','.join(header)})")
    numeric = [header.index(c) for c in ["time_s", *value_columns]]
    integers = [c not in FLOAT_COLUMNS for c in ["time_s", *value_columns]]
    named = [header.index(c) for c in key_columns]
    workers = min(MAX_WORKERS, os.cpu_count() or 1)
    parallel = None
    if size - body_start > PARALLEL_ABOVE_BYTES and workers > 1:
        try:
            parallel = _parse_parallel(path, body_start, size, numeric, named, workers, integers)
        except Exception:  # noqa: BLE001 - irregular lines or no worker processes: one piece, with its own errors
            parallel = None
    if parallel is not None:
        nums, local_codes, parts = parallel
    else:
        one = _parse(path, body_start, size, numeric, named, integers=integers)
        nums, local_codes, parts = one[0], [np.stack(one[1], axis=1) if one[1] else None], [(0, one)]
    if nums is None or nums.shape[0] == 0:
        return Counters([], {}, {})
    labels, codes = [], []
    for j in range(len(named)):
        lab = np.unique(np.concatenate([p[1][2][j] for p in parts]))
        labels.append(lab)
        code = np.empty(nums.shape[0], np.int64)
        for (first, part), block in zip(parts, local_codes):
            local = block[:, j]
            code[first:first + local.size] = np.searchsorted(lab, part[2][j])[local]
        codes.append(code)
    key = codes[0].astype(np.int64)
    for j in range(1, len(named)):
        key = key * len(labels[j]) + codes[j]
    k = _block_size(key, nums[:, 0])
    if k is not None:
        groups = [(int(key[i]), nums[i::k]) for i in range(k)]
    else:  # rows in any order: sorted by key, then time
        order = np.lexsort((nums[:, 0], key))
        key, nums = key[order], nums[order]
        present, starts = np.unique(key, return_index=True)
        ends = np.append(starts[1:], key.size)
        groups = [(int(k), nums[a:b]) for k, a, b in zip(present, starts, ends)]
    keys: list[tuple[str, ...]] = []
    out_t: dict[tuple[str, ...], np.ndarray] = {}
    out_v: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
    for k, rows in sorted(groups, key=lambda g: g[0]):
        parts_k, rest = [], k
        for j in reversed(range(len(named))):
            rest, c = divmod(rest, len(labels[j]))
            parts_k.append(bytes(labels[j][c]).decode(errors="replace"))
        name = tuple(reversed(parts_k))
        keys.append(name)
        out_t[name] = rows[:, 0]
        out_v[name] = {c: rows[:, i + 1] for i, c in enumerate(value_columns)}
    return Counters(keys, out_t, out_v)
