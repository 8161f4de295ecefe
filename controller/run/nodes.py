"""A run's nodes: their states, the signed client that calls them, their processes, their confs.

``Nodes`` is a mapping of node name -> ``NodeState`` (what the controller knows of each node)
with the node I/O of the run beside it: the signed HTTP calls (answers read raw and capped,
within a deadline), starting a node's process and waiting until it answers, stopping the running
nodes, collecting their logs. ``NodeConfs`` are the generated confs pushed to the nodes.

While hundreds of nodes start on a few cores, asking each of them over HTTP again and again costs
the starting nodes the CPU they need; a connect that is refused costs both sides next to nothing,
so ``listening`` probes every waiting node with many connects in flight and ``/health`` is asked
only of the ones that accept.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import selectors
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from json import dumps as dumps_json
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional


from controller.model.topology import Topology
from controller.results.run_dir import NodeFileError, node_file_path, read_node_file, read_node_file_tail
from controller.run import node_auth
from controller.run.progress import Report, clip
from controller.workers import deploy
from controller.workers.api import Worker
from dml_app.models.contract import FRAMEWORKS
from dml_app.models.make import kind_of
from dml_app.runtime import http
from dml_app.runtime.compute import NODE_ENV
from dml_app.runtime.events import parse_events
from dml_app.wire import bounded_json
from worker.api.errors import ConfigError, NotFound, TestbedError, TestbedTimeout
from worker.api.protocol import PRELOAD_ENV

NODE_PORT = 4444
# one thread per numeric library and two malloc arenas per node: hundreds of nodes share two cores
MAX_LOG_BYTES = 64 * 1024 * 1024
LOG_FETCH_S = 120.0  # the longest a node's log may take to arrive when asked for (64 MiB at 4.5 Mbit/s)
NODE_ANSWER_BYTES = 1024 * 1024  # a node's answer to /health, /conf/*, /start ...: read no further
STOP_GRACE_S = 20.0  # how long finish waits for stopped nodes' last events
CALL_THREADS = 16  # concurrent calls to nodes when stopping or collecting
READY_POLL_S = 0.3  # between probes of the nodes not answering yet
START_THREADS = 4  # node processes started at once (each waits for its fork by the worker)
ENDED_TAIL_BYTES = 8192  # how much of a node's events file is read to see whether it has ended
PROBE_BATCH = 256  # connects in flight at once (well under the default limit of 1,024 descriptors)


class TextEnum(str, Enum):
    """A str enum whose text is its value, in f-strings as in JSON (StrEnum, on Python 3.9)."""

    def __str__(self) -> str:
        return str(self.value)


class State(TextEnum):
    """A node's state; an expected death's why (``crashed``, ``revoked``...) is an ending too."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"
    TIMEOUT = "timeout"
    LOST = "lost"


SETTLED = (State.DONE, State.STOPPED, State.FAILED, State.TIMEOUT, State.LOST)
UNSETTLED = (State.PENDING, State.RUNNING)  # every other state is an ending (expected deaths end as their why)


MAX_REFUSAL_CHARS = 600  # of a node's error message, printed


def refusal(answer: bytes) -> str:
    """The message of a node's error answer (``{"error", "message"}``), printable and bounded: a
    node's bytes reach the terminal only so."""
    try:
        doc = bounded_json.loads(answer[:64 * 1024])
        text = str(doc.get("message") or doc.get("error")) if isinstance(doc, dict) else str(doc)
    except ValueError:
        text = answer[:MAX_REFUSAL_CHARS * 4].decode(errors="replace")
    return clip(text, MAX_REFUSAL_CHARS)


@dataclass
class NodeState:
    name: str
    ip: str = ""
    process_id: str = ""
    pid: int = 0
    up: bool = False
    dataset_conf: bool = False
    structure_conf: bool = False
    shaping_verified: bool = False
    state: str = State.PENDING  # a State (pending, running, then one of SETTLED), or an expected death's why
    round: int = 0
    rounds: int = 0
    accuracy: Optional[float] = None  # local
    global_accuracy: Optional[float] = None  # on the global test set, when the role evaluates one
    loss: Optional[float] = None
    bytes_sent: int = 0  # model bytes the node reported sending, summed over its rounds
    log_received: bool = False
    stopped_by: str = ""  # why the controller asked it to stop: its ending once it does
    detail: str = ""
    expected_death: str = ""  # why it is about to die (crashed, revoked...): its ending once it does
    lives: list = field(default_factory=list)  # earlier lives: {"pid", "started_at", "ended", "ended_at"}
    started_at: Optional[float] = None  # this life's start
    monitors: dict = field(default_factory=dict)  # the last adaptation monitors it reported (strategy, gns...)
    heard_at: Optional[float] = None  # when (monotonic) its last /print came: one heard from lately is not polled

    @property
    def settled(self) -> bool:
        return self.state not in UNSETTLED

    @property
    def life_ending(self) -> str:
        """How this life ended (its state, with the why of a failure)."""
        return life_ending(self.state, self.detail)

    @property
    def ending(self) -> str:
        """How the node ended, every life: ``revoked, replaced, done``."""
        return ", replaced, ".join([*(life["ended"] for life in self.lives), self.life_ending])

    def take(self, report: Report) -> None:
        """What a /print said: its round, accuracies, loss and the round's model bytes."""
        self.heard_at = time.monotonic()
        if report.round is not None:
            self.round = report.round
        if report.accuracy is not None:
            self.accuracy = float(report.accuracy)
        if report.global_accuracy is not None:
            self.global_accuracy = float(report.global_accuracy)
        if report.loss is not None:
            self.loss = float(report.loss)
        if report.round is not None and report.bytes_sent is not None:
            self.bytes_sent += int(report.bytes_sent)  # the round's bytes
        self.monitors.update(report.monitors)

    def settle_from_events(self, body: bytes) -> None:
        """Settled when its events (JSON lines) say it ended: done, or failed and why."""
        ended, detail = None, ""
        for event in parse_events(body.decode(errors="replace").splitlines()):
            if event["type"] in (State.DONE, State.FAILED):
                ended, detail = event["type"], clip(str(event.get("detail", "")))
        if ended and self.state in UNSETTLED:
            self.state = self.stopped_by if ended == State.DONE and self.stopped_by else State(ended)
            self.detail = "" if ended == State.DONE else (detail or "the node reported a failure")


def ended_by(body: bytes) -> Optional[str]:
    """``done`` or ``failed`` when a complete line of ``body`` (JSON lines) is an event of that
    type (a node may still note failed sends after its end), else None. Only lines that name
    such a type are parsed."""
    end = body.rfind(b"\n")  # what follows the last newline may be half written
    if end < 0:
        return None
    for marker in (b'"type":"done"', b'"type":"failed"', b'"type": "done"', b'"type": "failed"'):
        at = body.rfind(marker, 0, end)
        while at >= 0:
            line = body[body.rfind(b"\n", 0, at) + 1:body.find(b"\n", at)]
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and event.get("type") in (State.DONE, State.FAILED):
                return str(event["type"])
            at = body.rfind(marker, 0, at)
    return None


def life_ending(state: str, detail: str) -> str:
    return f"failed: {detail}" if state == State.FAILED and detail else str(state)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def check_encoding(name: str, path: str, headers: Mapping[str, str]) -> None:
    """Node answers are read raw: a compressed one (a bomb, decoded) is refused (``headers``:
    the answer's, lower-case names)."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ConfigError(f"node {name} answered {path} with Content-Encoding {encoding[:40]!r}: "
                          "only identity is accepted")


class Nodes(Mapping[str, NodeState]):
    """The nodes of run ``run_id`` (one per entry of ``structure``) on ``worker``, answering on
    ``port``; calls to them are signed with ``auth`` (each node's own secret)."""

    def __init__(self, workdir: str, worker: Worker, structure: Mapping[str, Mapping[str, Any]],
                 run_id: Optional[str] = None, port: int = NODE_PORT,
                 auth: Optional[node_auth.RunKeys] = None) -> None:
        self.workdir = os.path.realpath(workdir)
        self.worker = worker
        self.run_id = run_id or new_run_id()
        self.port = port
        self.auth = auth or node_auth.RunKeys()
        self.controller_url = ""  # what nodes call back (set at deploy)
        self.states = {n: NodeState(n, rounds=int(c.get("sync", 0))) for n, c in structure.items()}
        # a Keras or torch model: the hosts' zygotes import its framework once, for every node they fork
        self.preload = {n: FRAMEWORKS[kind].module for n, c in structure.items()
                        if (kind := kind_of(c.get("model") or {})) in FRAMEWORKS}
        self._sizes: dict[str, int] = {}  # each local node's events file, its size when last read

    @property
    def reads_local_logs(self) -> bool:
        """The nodes' events files are on this machine: the controller reads them there, and
        the nodes do not upload them."""
        return bool(getattr(self.worker, "is_local", False))

    def __getitem__(self, name: str) -> NodeState:
        return self.states[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def node(self, name: str) -> NodeState:
        """Node ``name``, or NotFound naming the run's nodes."""
        if name not in self.states:
            raise NotFound(f"no node {name!r} in this run (nodes: {', '.join(sorted(self.states)[:20])})")
        return self.states[name]

    def state_of_each(self) -> dict[str, str]:
        return {n.name: n.state for n in self.states.values()}

    def waiting_on(self) -> list[str]:
        """The nodes the run still waits for: not settled, and not about to die."""
        return [n.name for n in self.states.values() if not n.settled and not n.expected_death]

    def exited(self) -> list[tuple[NodeState, Any]]:
        """The running nodes whose process has exited, each with its return code (none when the
        worker cannot say which processes run)."""
        try:
            procs = {p["id"]: p for p in self.worker.processes()["processes"]}
        except TestbedError:
            return []
        return [(n, procs[n.process_id].get("returncode")) for n in self.states.values()
                if n.state == State.RUNNING and n.process_id in procs and not procs[n.process_id]["running"]]

    def unfinished(self) -> list[str]:
        """The nodes whose last life ended other than ``done`` (an expected death is not one)."""
        return [n.name for n in self.states.values() if n.state in SETTLED and n.state != State.DONE]

    def metrics_rows(self) -> list[dict[str, Any]]:
        """Each node's last reported round, accuracy, loss and model bytes."""
        return [{"name": n.name, "round": n.round, "accuracy": n.accuracy, "loss": n.loss, "bytes_sent": n.bytes_sent,
                 **n.monitors} for n in self.states.values()]

    def status(self) -> dict[str, Any]:
        """Every node's state and ending, and how many are done, failed, settled (for /status)."""
        nodes = self.states.values()
        return {"nodes": [{**asdict(n), "ending": n.ending if n.settled else None} for n in nodes],
                "done": sum(n.state == State.DONE for n in nodes),
                "failed": sum(n.state == State.FAILED for n in nodes),
                "settled": sum(n.settled for n in nodes)}

    # the signed client ------------------------------------------------------------------------
    def url(self, name: str, path: str) -> str:
        return f"http://{self.states[name].ip}:{self.port}{path}"

    def call(self, name: str, method: str, path: str, timeout_s: float, limit: int = NODE_ANSWER_BYTES,
             deadline_s: Optional[float] = None, json: Any = None) -> tuple[int, bytes]:
        """(status, body) of a signed call to a node (``json``: its body), the body read raw,
        ``limit`` bytes at most (ConfigError beyond it, or when the node compressed it), all of it
        within ``deadline_s`` (default ``timeout_s``) of the request (TestbedTimeout: a trickle
        holds nothing). A connection that fails is a ``ConnectionError``. Written with the nodes'
        own light client: at a thousand nodes the controller makes thousands of these calls to
        start a run, and ``requests`` cost about six times its CPU a call."""
        body = None if json is None else dumps_json(json).encode()
        answer_headers: dict[str, str] = {}
        allowed_s = timeout_s if deadline_s is None else deadline_s
        try:
            status, answer = http.request(
                method, self.url(name, path), body, timeout_s=timeout_s, max_answer_bytes=limit,
                headers=lambda: self.auth.headers_for(name, method, path, body or b""),
                answer_headers=answer_headers, answer_deadline_s=allowed_s)
        except http.AnswerTooLarge:
            raise ConfigError(f"node {name}'s answer to {path} is larger than {limit} bytes") from None
        except http.AnswerTooSlow:
            raise TestbedTimeout(f"node {name}'s answer to {path} took longer than {allowed_s:g}s") from None
        check_encoding(name, path, answer_headers)
        return status, answer

    def health(self, name: str) -> Optional[dict[str, Any]]:
        """The node's /health answer; None when it does not answer one."""
        try:
            _, body = self.call(name, "GET", "/health", 2)
            health = bounded_json.loads(body)
        except (OSError, ValueError, TestbedError):
            return None
        return health if isinstance(health, dict) else None

    def post(self, name: str, path: str, body: Any) -> dict[str, Any]:
        """POST ``body`` to the node; its JSON answer (ConfigError when refused, TestbedError when silent)."""
        try:
            status, answer = self.call(name, "POST", path, 30, json=body)
        except (OSError, TestbedTimeout) as e:
            raise TestbedError(f"node {name} did not answer {path}: {e}") from None
        if status >= 400:
            raise ConfigError(f"node {name} refused {path}: {refusal(answer)}")
        try:
            return bounded_json.loads(answer)
        except ValueError:
            raise ConfigError(f"node {name} answered {path} with no JSON") from None

    def each(self, fn: Callable[[str], Any], names: list[str]) -> list[Any]:
        """``fn`` over ``names``, a few at a time (hundreds of nodes: not one after another)."""
        if len(names) <= 1:
            return [fn(n) for n in names]
        with ThreadPoolExecutor(max_workers=min(CALL_THREADS, len(names))) as pool:
            return list(pool.map(fn, names))

    def fetch_log(self, name: str) -> Optional[bytes]:
        """A node's events, asked for (None when it does not answer); a node that sends them
        slower than ``LOG_FETCH_S`` in all is refused (a trickle would hold the finish)."""
        try:
            status, body = self.call(name, "GET", "/log", 10, MAX_LOG_BYTES, deadline_s=LOG_FETCH_S)
        except OSError:
            return None
        return body if status < 400 else None

    # this machine's view of the nodes ----------------------------------------------------------
    def local_log(self, name: str, problems: dict[str, list[str]]) -> Optional[bytes]:
        """The events a node wrote on this machine's disk (a node that died cannot be asked):
        read as ``run_dir.read_node_file`` reads what a node wrote (a FIFO, a link, another's
        file are refused, and are the node's problem, added to ``problems``)."""
        try:
            return read_node_file(self.workdir, name, f"{self.run_id}.jsonl", MAX_LOG_BYTES, self.uid(name))
        except FileNotFoundError:
            return None
        except NodeFileError as e:
            said = problems.setdefault(name, [])
            if f"its events on disk: {e.message}" not in said:  # (the monitor reads it as it grows)
                said.append(f"its events on disk: {e.message}")
            return None

    def ended_here(self, problems: dict[str, list[str]]) -> list[tuple[str, bytes]]:
        """The running nodes of this machine whose own events file has a ``done`` or ``failed``
        event: (name, the events), read without asking the node (at a thousand nodes on a
        few cores, a node that has finished waits many seconds for the CPU to upload them). A
        file is read again only when it has grown."""
        if not self.reads_local_logs:
            return []
        ended = []
        for node in self.states.values():
            if node.state != State.RUNNING or node.log_received:
                continue
            try:
                size = os.lstat(node_file_path(self.workdir, node.name, f"{self.run_id}.jsonl")).st_size
            except OSError:
                continue
            if size == self._sizes.get(node.name, 0):
                continue
            self._sizes[node.name] = size
            node.heard_at = time.monotonic()  # a growing file: the node is alive
            try:  # its end is among its last lines: the whole file is read only then
                tail = read_node_file_tail(self.workdir, node.name, f"{self.run_id}.jsonl", ENDED_TAIL_BYTES,
                                           self.uid(node.name))
            except (OSError, NodeFileError):
                tail = b""  # (read in full below, where a refusal is the node's problem)
            if tail and not ended_by(tail):
                continue
            body = self.local_log(node.name, problems)
            if body is not None and ended_by(body):
                ended.append((node.name, body))
        return ended

    def uid(self, name: str) -> Optional[int]:
        """The node's uid on this machine (its files must be its own); None when not known here."""
        from worker.host import WorkerHost

        if not isinstance(self.worker, WorkerHost):
            return None
        try:
            return int(self.worker.runtime.identity(name).uid)
        except (AttributeError, TestbedError):
            return None

    def uids(self) -> dict[str, int]:
        return {name: uid for name in self.states if (uid := self.uid(name)) is not None}

    # processes ------------------------------------------------------------------------------------
    def start_process(self, name: str) -> None:
        """Start node ``name``'s process (its own secret in its environment)."""
        started = self.worker.start_node(name, {"version": 1, "args": [
            "--name", name, "--port", str(self.port), "--controller", self.controller_url,
            "--run-id", self.run_id], "env": NODE_ENV | self.auth.env_for(name) |
            ({PRELOAD_ENV: self.preload[name]} if name in self.preload else {})})
        node = self.states[name]
        node.process_id, node.pid, node.started_at = started["id"], started["pid"], time.time()

    def start_all(self, progress: Callable[[str], None]) -> None:
        """Start every node's process: the first alone (a mistake common to all is said once),
        the others' hand-offs overlapping."""
        names = list(self.states)
        progress(f"starting {len(names)} node processes")
        started = time.monotonic()
        self.start_process(names[0])
        with ThreadPoolExecutor(max_workers=START_THREADS) as pool:
            list(pool.map(self.start_process, names[1:]))
        progress(f"started {len(names)} node processes in {time.monotonic() - started:.1f} s; "
                 "waiting for each to answer")

    def wait_ready(self, timeout_s: float) -> None:
        """Until every node answers /health (TestbedTimeout naming the others after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        waiting = set(self.states)
        while waiting:  # /health only of the ones that take a connection: the rest need the CPU to start
            open_ports = listening([(n, self.states[n].ip, self.port) for n in sorted(waiting)])
            names = sorted(open_ports)
            for name, health in zip(names, self.each(self.health, names) if names else []):
                if health is not None:
                    self.states[name].up = True
                    waiting.discard(name)
            if waiting and time.monotonic() > deadline:
                raise TestbedTimeout(f"nodes did not answer within {timeout_s:g}s: {', '.join(sorted(waiting))}")
            if waiting:
                time.sleep(READY_POLL_S)

    def wait_answer(self, name: str, timeout_s: float, what: str = "node") -> None:
        """Until node ``name`` answers /health (TestbedTimeout after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.health(name) is None:
            if time.monotonic() > deadline:
                raise TestbedTimeout(f"{what} {name} did not answer within {timeout_s:g}s")
            time.sleep(0.2)

    def stop_process(self, name: str) -> None:
        """Make sure the node's current process is gone (and its record cleared)."""
        node = self.states[name]
        if not node.process_id:
            return
        try:
            self.worker.stop_process(name, node.process_id)
        except NotFound:
            pass

    # the run's end ----------------------------------------------------------------------------
    def stop_running(self, how: str, pull_log: Callable[[str], None], progress: Callable[[str], None]) -> None:
        """Ask the running nodes to stop after their round, and wait up to ``STOP_GRACE_S`` for
        their last events (``pull_log`` takes the log of one that says it ended)."""
        running = [n for n in self.states.values() if n.state == State.RUNNING]
        if not running:
            return
        progress(f"stopping {len(running)} running nodes ({how})")

        def stop(name: str) -> None:
            self.states[name].stopped_by = State.TIMEOUT if how == "timeout" else State.STOPPED
            try:
                self.call(name, "POST", "/stop", 5)
            except (OSError, TestbedError):
                pass

        self.each(stop, [n.name for n in running])
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            waiting = [n.name for n in self.states.values() if n.state == State.RUNNING and not n.expected_death]
            if not waiting:
                break
            for name, health in zip(waiting, self.each(self.health, waiting)):
                if health and health.get("state") in (State.DONE, State.FAILED):
                    try:
                        pull_log(name)
                    except TestbedError as e:
                        self.states[name].state, self.states[name].detail = State.FAILED, clip(e.message)
            time.sleep(0.5)

    def collect_logs(self, store: Callable[[str, bytes], None], problems: dict[str, list[str]],
                     attempt: Callable[[str, Callable[[], None]], None]) -> None:
        """Every log not uploaded yet: asked of its node, else read from this machine's disk,
        then ``store``d; each node's collection runs under ``attempt(name, fn)`` (what fails is
        that node's problem)."""
        def collect_one(name: str) -> None:
            node = self.states[name]
            if node.log_received:
                return
            body = self.local_log(name, problems) if self.reads_local_logs else None  # its file is here
            try:
                if body is None and node.up:
                    body = self.fetch_log(name)
            except TestbedError as e:
                node.state, node.detail = State.FAILED, clip(e.message)
            if body is not None:
                store(name, body)

        self.each(lambda name: attempt(name, lambda: collect_one(name)), list(self.states))

    def settle_rest(self, how: str) -> None:
        """The ending of every node not settled yet."""
        for node in self.states.values():
            if node.settled:
                continue
            if node.expected_death:  # stopped before the death it expected
                node.state = node.expected_death
            elif not node.log_received:
                node.state, node.detail = State.LOST, node.detail or "its log could not be collected"
            elif how == "timeout":
                node.state = State.TIMEOUT
            else:
                node.state = State.STOPPED


class NodeConfs:
    """Each node's generated confs: ``given`` (node -> {"structure", "dataset"}, from memory),
    else read from ``dml_file/conf`` (confs made by dml_tool)."""

    def __init__(self, nodes: Nodes, topology: Topology, given: Optional[dict[str, dict[str, Any]]] = None) -> None:
        self.nodes = nodes
        self.topology = topology
        self.given = given or {}

    def get(self, name: str, kind: str) -> dict[str, Any]:
        """Node ``name``'s ``kind`` conf (a copy: pushing adapts it); ConfigError when there is none."""
        if kind in self.given.get(name, {}):
            return json.loads(json.dumps(self.given[name][kind]))
        path = os.path.join(self.nodes.workdir, "dml_file", "conf", f"{name}_{kind}.json")
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no {kind} conf for node {name} ({path}): run dml_tool first") from None

    def datasets(self) -> dict[str, Any]:
        """Every node's dataset conf ({} for a node that has none)."""
        out: dict[str, Any] = {}
        for name in self.nodes:
            try:
                out[name] = self.get(name, "dataset")
            except ConfigError:
                out[name] = {}
        return out

    def structures(self) -> dict[str, dict[str, Any]]:
        """Every node's structure conf as pushed: keys, sample counts and peer addresses added."""
        nodes = self.nodes
        confs = {name: self.get(name, "structure") for name in nodes}
        nodes.auth.complete_structure_confs(confs, lambda n: self.get(n, "dataset"))
        for name, conf in confs.items():
            unknown = [p for p in conf.get("connect", {}) if p not in nodes]
            if unknown:
                raise ConfigError(f"structure conf of {name} connects to nodes not in this run: {unknown}")
            conf["connect"] = {p: f"{nodes[p].ip}:{nodes.port}" for p in conf.get("connect", {})}
            links = self.topology.links  # each linked peer's rate (its share under access links): a send
            conf["link_bps"] = {p: deploy.shared_rate_bps(self.topology, name, p)  # too slow for it is given up early
                                for p in conf["connect"] if (name, p) in links}
            conf["upload_log"] = not nodes.reads_local_logs
        return confs


def listening(addresses: Iterable[tuple[str, str, int]], timeout_s: float = 0.5) -> set[str]:
    """The names of ``(name, ip, port)`` whose port accepted a TCP connection within ``timeout_s``
    (many connects in flight at once, no HTTP)."""
    todo = list(addresses)
    found: set[str] = set()
    for start in range(0, len(todo), PROBE_BATCH):
        found |= _probe_batch(todo[start:start + PROBE_BATCH], timeout_s)
    return found


def _probe_batch(addresses: list[tuple[str, str, int]], timeout_s: float) -> set[str]:
    found: set[str] = set()
    with selectors.DefaultSelector() as sel:
        try:
            for name, ip, port in addresses:
                sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                code = sock.connect_ex((ip, port))
                if code == 0:
                    found.add(name)
                    sock.close()
                elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                    sel.register(sock, selectors.EVENT_WRITE, name)
                else:
                    sock.close()
            while sel.get_map():
                ready = sel.select(timeout_s)
                if not ready:
                    break
                for key, _ in ready:
                    sock = key.fileobj
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:  # type: ignore[union-attr]
                        found.add(key.data)
                    sel.unregister(sock)
                    sock.close()  # type: ignore[union-attr]
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
    return found
