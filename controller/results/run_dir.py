"""The run folder: its file names, writing beneath it safely, the one CSV writer, reading it back.

Writing. The controller runs as root, and parts of the experiment directory may be reachable
by nodes. ``RunDir`` holds an open descriptor of the run directory and makes every file and
subdirectory relative to it (``openat`` semantics): no path component is resolved through a
symbolic link (``O_NOFOLLOW`` on each step), and every file is written to a temporary name and
renamed into place, so a reader never sees half a file; ``open_stream`` does the same for a
gzip-compressed CSV file written as rows come (the telemetry). ``csv_bytes`` is the CSV
writer of every table of the folder. ``read_node_file`` reads, just as carefully, a file a
node wrote in its own directory.

Reading. ``read_run_events`` reads the nodes' events (``events/<node>.jsonl``) and
``finite_number`` a number or a CSV cell, ``read_json`` a document, the way every reader of the
folder does.

What makes a run folder describe itself: ``run.json``, ``inputs/`` and ``topology.json``.

``run.json`` says what ran, from which code, where, when and how it ended::

    {"version": 1, "run_id": "...", "algorithm": "gossip", "command": [...], "cwd": "...",
     "code_revision": "v0.1-12-gabc1234", "python": "3.11.7", "numpy": "1.26.4", "host": "...",
     "testbed_id": "0", "started_at": ..., "ended_at": ..., "ended": "completed", "detail": "",
     "seeds": {"dataset": 0, "nodes": {"n1": 3}}, "network": "isolated", "nodes": {"n1": "done", ...},
     "models": [{"kind": "torch", "label": "lenet5 · torch", "model": {"kind": "torch", "name": "lenet5", ...},
                 "nodes": ["n1", ...]}]}

``models`` holds each distinct model entry of the run as its nodes have it (only the keys the
entry gave and the kind, inferred or not; a user file by its path in the experiment directory).

``telemetry`` holds the sampling settings and, once the run ended, what sampling cost:
``period_ms``, ``sampler_cpu_s`` (CPU seconds of every host's sampler thread),
``collector_cpu_s`` (the controller's pulls and CSV writing) and per host its sampler's CPU
share of one core, samples taken, samples lost (ring overwritten before a pull) and late.

``ended`` is ``running`` while the run goes on, then one of ``completed`` (every
node settled by itself), ``finished`` (``/finish`` before that), ``timeout``,
``interrupted`` (Ctrl-C, SIGTERM, SIGHUP), ``reset`` (``/emulated/reset``) or
``failed``. ``network`` is ``isolated`` (no link, no path) or ``open`` (``--open-network``).
``inputs/`` holds the files the user wrote, verbatim.
"""
from __future__ import annotations

import csv
import errno
import glob
import gzip
import io
import json
import logging
import math
import os
import platform
import secrets
import socket
import stat
import subprocess
import sys
from typing import Any, Callable, Iterable, Optional

from controller.model.spec import USER_INPUT
from controller.model.topology import Topology
from dml_app.models.make import kind_of
from dml_app.runtime.events import read_events
from dml_app.runtime.usercode import shown
from worker.api.errors import ConfigError, TestbedError

# file names ----------------------------------------------------------------------------------------
RUN_JSON = "run.json"
TOPOLOGY_JSON = "topology.json"
SUMMARY_JSON = "summary.json"
CONFS_JSON = "confs.json"
LIVES_JSON = "lives.json"
TIMELINE_JSON = "timeline.json"
METRICS_CSV = "metrics.csv"
TRAFFIC_CSV = "traffic.csv"
MEMBERSHIP_CSV = "membership.csv"
SCENARIO_CSV = "scenario.csv"
SCENARIO_EFFECTS_CSV = "scenario_effects.csv"
SCENARIO_FLOWS_JSON = "scenario_flows.json"
EVENTS_DIR = "events"  # events/<node>.jsonl: what each node uploaded
INPUTS_DIR = "inputs"  # the files the user wrote, verbatim
TELEMETRY_DIR = "telemetry"  # links, nodes, hosts and rates .csv.gz; pcap/<node>.pcap
PCAP_DIR = "telemetry/pcap"
ANALYSIS_DIR = "analysis"

RUN_VERSION = 1
MAX_INPUT_BYTES = 64 * 1024 * 1024
ENDINGS = ("completed", "finished", "timeout", "interrupted", "reset", "failed")
GZIP_LEVEL = 3  # of a stream; 6 compresses a fifth better at a third more CPU
log = logging.getLogger("edgetb.results")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _components(relative: str) -> list[str]:
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"{relative!r} is not a plain path inside the run directory")
    return parts


class RunDir:
    """A directory the controller writes results into; made (mode 0755) if absent."""

    def __init__(self, path: str) -> None:
        parent, name = os.path.split(os.path.abspath(path))
        parent = os.path.realpath(parent)  # the run directory itself must not be a link
        self.path = os.path.join(parent, name)
        os.makedirs(parent, exist_ok=True)
        parent_fd = os.open(parent, _DIR_FLAGS)
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=parent_fd)
            except FileExistsError:
                pass
            self.fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as e:
            raise ConfigError(f"cannot use {self.path} as a run directory: {e.strerror} "
                              "(it must be a real directory, not a link)") from None
        finally:
            os.close(parent_fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _dir_of(self, relative: str) -> tuple[int, str]:
        """(an open descriptor of the file's directory, the file's name): subdirectories are
        made as needed, never through a link. The caller closes the descriptor."""
        parts = _components(relative)
        fd = os.dup(self.fd)
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"cannot write {relative} in {self.path}: {e.strerror}") from None
        return fd, parts[-1]

    def write_bytes(self, relative: str, data: bytes, durable: bool = True) -> str:
        """Write ``data`` to ``relative`` atomically; returns the file's path."""
        return self.write_chunks(relative, (data,), durable)

    def write_chunks(self, relative: str, chunks: Iterable[bytes], durable: bool = True) -> str:
        """Write the pieces ``chunks`` yields to ``relative`` atomically (a large file streamed
        without holding it whole); an error while reading them leaves no file. ``durable``:
        synced to disk before it takes the name (not for a copy whose source stays)."""
        fd, name = self._dir_of(relative)
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
            try:
                for data in chunks:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(out, view):]
                if durable:
                    os.fsync(out)
            finally:
                os.close(out)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            raise ConfigError(f"cannot write {relative} in {self.path}: {e.strerror}") from None
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        return os.path.join(self.path, relative)

    def write_text(self, relative: str, text: str) -> str:
        return self.write_bytes(relative, text.encode())

    def write_json(self, relative: str, data: Any) -> str:
        return self.write_text(relative, json.dumps(data, indent=1, default=str) + "\n")

    def open_stream(self, relative: str, header: str) -> "CsvStream":
        """A gzip-compressed CSV file at ``relative`` written as rows come (``header``: its first line)."""
        return CsvStream(self, relative, header)

    def read_bytes(self, relative: str, limit: int) -> bytes:
        """A file beneath the run directory, refused when it is a link or over ``limit`` bytes."""
        fd, name = self._dir_of(relative)
        try:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        with os.fdopen(f, "rb") as src:
            data = src.read(limit + 1)
        if len(data) > limit:
            raise ConfigError(f"{relative} in {self.path} is larger than {limit} bytes")
        return data


Writer = Callable[[str, bytes], Any]  # writes bytes to a path relative to the run directory


def local_writer(run_dir: str) -> Writer:
    """A Writer into ``run_dir`` (``RunDir``: atomic, no link followed). A caller holding the
    run directory open passes its own Writer instead."""
    return RunDir(run_dir).write_bytes


class CsvStream:
    """One gzip-compressed CSV file written as rows come, beneath the run folder (no link
    followed), under a hidden name until ``close`` renames it into place (``discard``: never)."""

    def __init__(self, out: RunDir, relative: str, header: str) -> None:
        self.relative = relative
        self.dir_fd, self.name = out._dir_of(relative)
        self.partial = f".{self.name}.partial"
        try:
            os.unlink(self.partial, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=self.dir_fd)
        self.raw = os.fdopen(fd, "wb")
        self.file = gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=self.raw, mtime=0)
        self.file.write(header.encode() + b"\n")
        self.rows = 0

    def write(self, text: str, rows: int) -> None:
        """``rows`` lines (``text``, each ending in a newline)."""
        if rows:
            self.file.write(text.encode())
            self.rows += rows

    def discard(self) -> None:
        self.file.close()
        self.raw.close()
        try:
            os.unlink(self.partial, dir_fd=self.dir_fd)
        except OSError:
            pass
        os.close(self.dir_fd)

    def close(self) -> None:
        if self.raw.closed:
            return
        self.file.close()
        self.raw.flush()
        os.fsync(self.raw.fileno())
        self.raw.close()
        os.rename(self.partial, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        os.close(self.dir_fd)


# CSV -----------------------------------------------------------------------------------------------
def csv_bytes(columns: list[str], rows: Iterable[dict[str, Any]], cell: Optional[Callable[[Any], Any]] = None
              ) -> bytes:
    """A CSV table: the header ``columns``, then each row's values of those columns (others
    ignored), each as ``cell(value)`` (default: as it is; None and a missing value are empty)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for r in rows:
        writer.writerow([r.get(c) for c in columns] if cell is None else [cell(r.get(c)) for c in columns])
    return out.getvalue().encode()


def short_cell(value: Any) -> str:
    """A value with floats to six significant digits (integral ones from 1e15 whole); a
    non-finite float is empty (the analysis tables)."""
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        return f"{value:.6g}" if abs(value) < 1e15 else f"{value:.0f}"
    return str(value)


def csv_fields(values: Iterable[Any]) -> str:
    """Plain fields (names and numbers, which need no quoting) joined as in a CSV line; None is empty."""
    return ",".join("" if v is None else str(v) for v in values)


def finite_number(value: Any, cells: bool = True) -> Optional[float]:
    """``value`` as a finite number, else None: a number as it is (an int stays an int), a CSV
    cell (a string) parsed unless not ``cells``; a bool, NaN, an infinity, an int past a float's
    range, an empty cell or anything else is None. The one parser of numbers others wrote."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return value if math.isfinite(value) else None
        except OverflowError:  # an int too large for a float
            return None
    if cells and isinstance(value, (str, bytes)):
        try:
            number = float(value)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def finite_float(value: Any) -> Optional[float]:
    """``finite_number`` as a float."""
    number = finite_number(value)
    return None if number is None else float(number)


# problems and events -------------------------------------------------------------------------------
Problems = dict[str, list[str]]  # who (a node, or "run") -> what went wrong while its results were written
RUN = "run"


def attempt(problems: Problems, who: str, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
    """``fn()``; whatever it raises is recorded as ``who``'s problem with ``what`` (a file, a
    step) and ``default`` returned, so that one bad node or file never stops the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded, and the run's other results are written
        log.warning("%s: %s failed", who, what, exc_info=True)
        message = e.message if isinstance(e, TestbedError) else f"{type(e).__name__}: {e}"
        problems.setdefault(who, []).append(f"{what}: {message}"[:500])
        return default


def read_json(path: str) -> Optional[Any]:
    """The JSON document at ``path`` (a file of the run folder); None when it is absent, a
    ``ConfigError`` naming it when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not JSON: {e}") from None


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object at ``path``, else {} (absent, unreadable, not JSON or not an object)."""
    try:
        doc = read_json(path)
    except (OSError, ConfigError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_run_events(run_dir: str, problems: Optional[Problems] = None) -> dict[str, list[dict[str, Any]]]:
    """Each node's events (``events/<node>.jsonl``, ``dml_app.runtime.events.read_events``), by node
    name. With ``problems``, a file that cannot be read counts as no events and is that node's
    problem there; without, what it raises is raised."""
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, EVENTS_DIR, "*.jsonl"))):
        node = os.path.basename(path)[: -len(".jsonl")]
        if problems is None:
            out[node] = read_events(path)
        else:
            out[node] = attempt(problems, node, f"{EVENTS_DIR}/{node}.jsonl", lambda p=path: read_events(p), [])
    return out


# files nodes wrote --------------------------------------------------------------------------------
class NodeFileError(ConfigError):
    """A file in a node's own directory that the controller refuses to read."""


def node_file_path(workdir: str, node: str, name: str) -> str:
    return os.path.join(workdir, "dml_file", "node", node, name)


def read_node_file(workdir: str, node: str, name: str, limit: int, uid: Optional[int] = None) -> bytes:
    """``<workdir>/dml_file/node/<node>/<name>``, a file the node wrote, so untrusted: every
    step opened without following a link, the file opened non-blocking (a FIFO or a device
    answers at once) and read only when it is a regular file with one link, owned by ``uid``
    (the node's, when known), of at most ``limit`` bytes. ``FileNotFoundError`` when it is
    absent; ``NodeFileError`` naming the file and the reason otherwise."""
    path, src, size = _open_node_file(workdir, node, name, uid)
    with src:
        if size > limit:
            raise NodeFileError(f"{path}: {size} bytes, more than the {limit} allowed")
        data = src.read(limit + 1)
    if len(data) > limit:
        raise NodeFileError(f"{path}: more than the {limit} bytes allowed")
    return data


def read_node_file_tail(workdir: str, node: str, name: str, tail: int, uid: Optional[int] = None) -> bytes:
    """The last ``tail`` bytes (at most) of the node's file, opened and checked as
    ``read_node_file`` does."""
    _, src, size = _open_node_file(workdir, node, name, uid)
    with src:
        src.seek(max(0, size - tail))
        return src.read(tail)


def _open_node_file(workdir: str, node: str, name: str, uid: Optional[int]) -> tuple[str, Any, int]:
    """(its path, the open file, its size) of a node's file that passed ``read_node_file``'s checks."""
    path = node_file_path(workdir, node, name)
    parts = ["dml_file", "node", node, name]
    if any(p in ("", ".", "..") or "/" in p for p in parts):
        raise NodeFileError(f"{path}: not a plain path beneath the experiment directory")
    try:
        fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts[:-1]:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NodeFileError(f"{path}: a symbolic link on the way; refused") from None
        raise NodeFileError(f"{path}: cannot be opened: {e.strerror}") from None
    src = os.fdopen(f, "rb")
    try:
        st = os.fstat(src.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise NodeFileError(f"{path}: not a regular file; refused")
        if st.st_nlink != 1:
            raise NodeFileError(f"{path}: {st.st_nlink} links to the file; refused")
        if uid is not None and st.st_uid != uid:
            raise NodeFileError(f"{path}: owned by uid {st.st_uid}, not the node's {uid}; refused")
    except BaseException:
        src.close()
        raise
    return path, src, st.st_size


# run.json, inputs/, topology.json ----------------------------------------------------------------
def code_revision(code_root: str) -> str:
    """``git describe`` of the code, else the installed package's version."""
    try:
        out = subprocess.run(["git", "-C", code_root, "describe", "--always", "--dirty", "--tags"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from importlib.metadata import version

        return f"edgetb {version('edgetb')}"
    except Exception:  # noqa: BLE001 - not installed: say so rather than fail a run
        return "unknown"


def seeds(structure: dict[str, dict[str, Any]], dataset: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Every seed the run used: the dataset split's and each node's model seed."""
    return {"dataset": (dataset or {}).get("seed"),
            "nodes": {n: c["model"]["seed"] for n, c in structure.items() if "seed" in c.get("model", {})}}


def models(structure: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distinct model entry of ``structure`` (the nodes' structure confs): its kind, a short
    label (the built-in's name or the user's file, and the kind), the entry and its nodes."""
    found: dict[str, dict[str, Any]] = {}
    for node, conf in structure.items():
        entry = dict(conf.get("model") or {})
        if entry.get("module"):
            entry["module"] = shown(str(entry["module"]))
        kind = kind_of(entry)
        entry = {"kind": kind, **{k: v for k, v in entry.items() if k != "kind"}}
        key = json.dumps(entry, sort_keys=True)
        if key not in found:
            what = entry.get("module") or entry.get("name") or "mlp"
            found[key] = {"kind": kind, "label": f"{what} · {kind}", "model": entry, "nodes": []}
        found[key]["nodes"].append(node)
    return list(found.values())


def describe(run_id: str, algorithm: str, testbed_id: str, code_root: str, structure: dict[str, dict[str, Any]],
             dataset: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The fields of run.json known when the run is deployed."""
    import numpy

    return {"version": RUN_VERSION, "run_id": run_id, "algorithm": algorithm, "command": list(sys.argv),
            "cwd": os.getcwd(), "code_revision": code_revision(code_root), "python": platform.python_version(),
            "numpy": numpy.__version__, "host": socket.gethostname(), "testbed_id": testbed_id,
            "started_at": None, "ended_at": None, "ended": "running", "detail": "",
            "seeds": seeds(structure, dataset), "nodes": {}, "models": models(structure)}


def copy_inputs(run_dir: RunDir, inputs: dict[str, str]) -> list[str]:
    """Copy the user's files (role -> path) into ``inputs/`` under their own names, verbatim (the
    user's code, ``user:<relative path>``, under its path in the experiment directory)."""
    written = []
    for role, path in sorted(inputs.items()):
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_INPUT_BYTES + 1)
        except OSError:
            continue  # generated by the API, not a file the user wrote
        if len(data) > MAX_INPUT_BYTES:
            continue
        name = role[len(USER_INPUT):] if role.startswith(USER_INPUT) else os.path.basename(path)
        written.append(run_dir.write_bytes(f"{INPUTS_DIR}/{name}", data))
    return written


def topology_doc(topology: Topology, ips: dict[str, str]) -> dict[str, Any]:
    """The deployed network: each node's IP, host and kind; each link's shape with its rate in bit/s."""
    doc = topology.to_dict()
    for node in doc["nodes"]:
        node["ip"] = ips.get(node["name"]) or node.get("ip")
    for link in doc["links"]:
        link["rate_bps"] = link["shape"].get("rate_bps")
    return doc
