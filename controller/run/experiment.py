"""One DML experiment on a deployed testbed, as an explicit state machine.

    deploying -> ready -> running -> finished
            \\-> failed (deploy failed)

``status()`` reports the phase, each node's readiness (process up, confs
received, shaping verified) and its round progress: readiness is a state to
poll, not a console line to wait for. Results land in
``dml_file/log/<run id>/``: the nodes' events, ``run.json`` (what ran and how it
ended), ``inputs/``, the resolved topology and confs, metrics.csv and plots.

However a run ends (every node done, ``/finish`` mid-run, a timeout, Ctrl-C,
``/emulated/reset``, a node that dies), ``finish`` stops the nodes still
running, waits a little for their last events, collects every log once and
builds every result file from those same events; each node gets its ending:
``done``, ``stopped``, ``failed: <why>``, ``timeout`` or ``lost`` (no log).

Nodes may die on purpose (a scenario's crash or revocation): ``expect_death`` says
so first, and the node's death is then its ending (``crashed``, ``revoked``...),
not a failure, and the run does not wait for it. ``replace_node`` starts a dead
node's role again (same namespace and links, its confs pushed again) so that it
rejoins the running experiment; its ending lists every life
(``revoked, replaced, done``) and ``lives.json`` in the run folder when each began
and ended.
"""
from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional

import requests
import urllib3

from controller.workers import deploy

from controller.results import evaluate, tables
from controller.results import run_dir as run_folder

from controller.run import node_auth, probe
from controller.workers.api import Worker
from controller.web.live import LiveFeed
from controller.run.progress import Progress
from controller.results.run_dir import NodeFileError, RunDir, read_node_file
from controller.telemetry.collector import Collector
from controller.results.rates import FROM_START, LinkRates
from controller.model.telemetry_conf import TelemetryConf
from controller.run.terminal import clip
from controller.model.topology import Link, Topology, links_from_data, load_links
from dml_app import bounded_json
from dml_app.compute import THREAD_ENV
from worker.api.errors import ConfigError, NotFound, TestbedError, TestbedTimeout

NODE_PORT = 4444
# one thread per numeric library and two malloc arenas per node: hundreds of nodes share two cores
NODE_ENV = {**THREAD_ENV, "MALLOC_ARENA_MAX": "2"}
MAX_LOG_BYTES = 64 * 1024 * 1024
LOG_FETCH_S = 120.0  # the longest a node's log may take to arrive when asked for (64 MiB at 4.5 Mbit/s)
LOG_CHUNK_BYTES = 1 << 20
NODE_ANSWER_BYTES = 1024 * 1024  # a node's answer to /health, /conf/*, /start ...: read no further
HEALTH_POLL_S = 10.0  # how often the monitor asks running nodes how they are
STOP_GRACE_S = 20.0  # how long finish waits for stopped nodes' last events
CALL_THREADS = 16  # concurrent calls to nodes when stopping or collecting
READY_POLL_S = 0.3  # between probes of the nodes not answering yet
START_THREADS = 4  # node processes started at once (each waits for its fork by the worker)
SETTLED = ("done", "stopped", "failed", "timeout", "lost")
UNSETTLED = ("pending", "running")  # every other state is an ending (expected deaths end as their why)
REPLACE_READY_S = 60.0  # how long a replaced node's process may take to answer
MAX_WHY_CHARS = 60  # an expected death's why: the node's ending
log = logging.getLogger("edgetb.controller")


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
    state: str = "pending"  # pending, running, then one of SETTLED
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

    @property
    def settled(self) -> bool:
        return self.state not in UNSETTLED

    @property
    def life_ending(self) -> str:
        """How this life ended (its state, with the why of a failure)."""
        return _life_ending(self.state, self.detail)

    @property
    def ending(self) -> str:
        """How the node ended, every life: ``revoked, replaced, done``."""
        return ", replaced, ".join([*(life["ended"] for life in self.lives), self.life_ending])


def _life_ending(state: str, detail: str) -> str:
    return f"failed: {detail}" if state == "failed" and detail else state


def round_bounds(structure: dict[str, dict[str, Any]]) -> tuple[int, dict[str, set[int]]]:
    """(the highest round any node of the run can report, each node's E-tree layers): a round
    is at most the run's ``sync``; an E-tree layer's rounds at most the product of the syncs of
    the layers above it (each parent round asks its children once per child round)."""
    layers = {n: {int(p["layer"]) for p in c.get("positions", [])} for n, c in structure.items()}
    per_layer: dict[int, int] = {}
    for conf in structure.values():
        for pos in conf.get("positions", []):
            per_layer[int(pos["layer"])] = max(per_layer.get(int(pos["layer"]), 1), int(pos.get("sync", 1)))
    highest = max([int(c.get("sync", 0) or 0) for c in structure.values()] + [1])
    product = math.prod(sync for layer, sync in per_layer.items() if layer > 1)
    return max(highest, product), layers


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _check_encoding(name: str, path: str, resp: requests.Response) -> None:
    """Node answers are read raw: a compressed one (a bomb, decoded) is refused."""
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ConfigError(f"node {name} answered {path} with Content-Encoding {encoding[:40]!r}: "
                          "only identity is accepted")


class Experiment:
    """Deploys, drives and collects one run."""

    def __init__(self, workdir: str, topology: Topology, worker: Worker, structure: dict[str, dict[str, Any]],
                 run_id: Optional[str] = None, controller_port: int = 3333, node_port: int = NODE_PORT,
                 progress: Callable[[str], None] = print, algorithm: str = "gossip",
                 node_confs: Optional[dict[str, dict[str, Any]]] = None, inputs: Optional[dict[str, str]] = None,
                 dataset: Optional[dict[str, Any]] = None, testbed_id: str = "0", verbose: bool = False,
                 open_network: bool = False, telemetry_conf: Optional[TelemetryConf] = None,
                 capture: Optional[list[str] | str] = None) -> None:
        """``node_confs`` maps each node to its generated ``structure`` and ``dataset`` confs (pushed
        from memory; read from ``dml_file/conf`` when absent); ``inputs`` the user's files by role
        (links, nodes, structure, dataset, hosts), copied into the run folder; ``verbose`` prints
        every node's round lines besides the aggregate; ``open_network``: unlinked nodes reach each
        other (EdgeTB's network) instead of no link, no path; ``telemetry_conf`` what is sampled
        during the run (controller.telemetry.collector; default: every link, node and host each 100 ms) and
        captured (``capture`` overrides its list: ``"all"`` or names), into
        ``telemetry/pcap/<node>.pcap`` of the run folder."""
        self.open_network = open_network
        self.workdir = os.path.realpath(workdir)
        self.topology = topology
        self.rates = LinkRates.of_topology(topology)  # every link's configured rate over the run
        self.worker = worker
        self.structure = structure
        self.algorithm = algorithm
        self.node_confs = node_confs or {}
        self.inputs = inputs or {}
        self.dataset = dataset
        self.run_id = run_id or new_run_id()
        self.run_dir = os.path.join(self.workdir, "dml_file", "log", self.run_id)
        self.controller_port = controller_port
        self.node_port = node_port
        self.progress = progress
        self.verbose = verbose
        self.node_token = secrets.token_urlsafe(24)
        self.nodes = {n: NodeState(n, rounds=int(c.get("sync", 0))) for n, c in structure.items()}
        conf = telemetry_conf or TelemetryConf()
        self.capture = (capture_list(capture, list(self.nodes)) if capture is not None
                        else conf.capture_nodes(list(self.nodes)))
        self.capturing: list[str] = []  # the nodes whose capture was started
        self.rounds = Progress({n: s.rounds for n, s in self.nodes.items()}, progress)
        self.max_round, self.layers = round_bounds(structure)  # what a /print may report
        self.phase = "created"
        self.ended = ""  # how the run ended (run_folder.ENDINGS)
        self.error = ""
        self.t_start: Optional[float] = None
        self.t_start_monotonic: Optional[float] = None
        self.summary: Optional[dict[str, Any]] = None
        self.record = run_folder.describe(self.run_id, algorithm, testbed_id, _code_root(), structure, dataset)
        self.record["network"] = "open" if open_network else "isolated"  # unlinked pairs: reachable or dropped
        self.telemetry_conf = telemetry_conf or TelemetryConf()
        self.telemetry: Optional[Collector] = None  # pulls the hosts' samplers while the run goes on
        self.record["telemetry"] = self.telemetry_conf.to_dict()
        self._out: Optional[RunDir] = None
        self.scenario: Any = None  # a controller.run.scenario_runner.ScenarioRunner: started with the run
        self._collecting = False  # set once finish collects: later uploads change nothing
        self._finishing = False  # a finish of the settled run was started (once)
        self._lock = threading.RLock()
        self._finish_lock = threading.Lock()
        self._monitor: Optional[threading.Thread] = None
        self._controller_url = ""  # what nodes call back (set by deploy)
        self.membership: list[dict[str, Any]] = []  # deaths expected and seen, replacements
        self.problems: tables.Problems = {}  # what went wrong while the results were written, by node or "run"
        self.keys = node_auth.RunKeys()  # each node's own secret, pair keys; signs calls to nodes
        self._session = requests.Session()
        self._session.headers["Accept-Encoding"] = "identity"  # a node's answer is never decompressed
        self._session.auth = self.keys.signer(lambda: {f"{n.ip}:{self.node_port}": n.name for n in self.nodes.values()})
        self.live = LiveFeed(self)  # what the dashboard shows

    @property
    def out(self) -> RunDir:
        """The run folder, opened once (results are written beneath it without following links)."""
        if self._out is None:
            self._out = RunDir(self.run_dir)
        return self._out

    # deploy -----------------------------------------------------------------------------------
    def deploy(self, ready_timeout_s: Optional[float] = None) -> None:
        """Bring up the network, start a node process per participant, wait until all answer
        (by default 30 s plus 1 s per node: hundreds of processes start on a few cores)."""
        self.phase = "deploying"
        try:
            result = deploy.deploy(self.topology, self.worker, self.progress, open_network=self.open_network)
            controller = f"http://{result['bridge_ip']}:{self.controller_port}"
            for name, node in self.nodes.items():
                node.ip = result["ips"][name]
                node.shaping_verified = True
            self.out.write_json("topology.json", run_folder.topology_doc(self.topology, result["ips"]))
            run_folder.copy_inputs(self.out, self.inputs)
            self._write_record()
            self.progress(f"starting {len(self.nodes)} node processes")
            self._controller_url = controller
            names = list(self.nodes)
            started = time.monotonic()
            self._start_process(names[0])  # the first alone: a mistake common to all is said once
            with ThreadPoolExecutor(max_workers=START_THREADS) as pool:  # the others' hand-offs overlap
                list(pool.map(self._start_process, names[1:]))
            self.progress(f"started {len(names)} node processes in {time.monotonic() - started:.1f} s; "
                          "waiting for each to answer")
            self._wait_ready(ready_timeout_s or 30 + 1.0 * len(self.nodes))
        except BaseException as e:
            self.phase, self.error = "failed", str(e)
            raise
        self.phase = "ready"
        self.progress(f"ready: {len(self.nodes)} nodes answer; run id {self.run_id}")

    def _start_process(self, name: str) -> None:
        """Start node ``name``'s process (its own secret in its environment)."""
        started = self.worker.start_node(name, {"version": 1, "args": [
            "--name", name, "--port", str(self.node_port), "--controller", self._controller_url,
            "--run-id", self.run_id], "env": NODE_ENV | self.keys.env_for(name)})
        node = self.nodes[name]
        node.process_id, node.pid, node.started_at = started["id"], started["pid"], time.time()

    def sync_code(self) -> None:
        """Hosts other than this one fetch the code and shards from the controller (so it must
        be serving): a step before ``deploy`` when the worker is a cluster."""
        if self.worker.is_local:
            return  # its nodes run this process's code
        try:
            self.worker.sync_code(f"http://{self.worker.status()['bridge_ip']}:{self.controller_port}",
                                  self.node_token, self.progress)
        except BaseException as e:
            self.phase, self.error = "failed", str(e)
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.nodes)
        while waiting:  # /health only of the ones that take a connection: the rest need the CPU to start
            open_ports = probe.listening([(n, self.nodes[n].ip, self.node_port) for n in sorted(waiting)])
            names = sorted(open_ports)
            for name, health in zip(names, self._each_node(self._health, names) if names else []):
                if health is not None:
                    self.nodes[name].up = True
                    waiting.discard(name)
            if waiting and time.monotonic() > deadline:
                raise TestbedTimeout(f"nodes did not answer within {timeout_s:g}s: {', '.join(sorted(waiting))}")
            if waiting:
                time.sleep(READY_POLL_S)

    def _node_url(self, name: str, path: str) -> str:
        return f"http://{self.nodes[name].ip}:{self.node_port}{path}"

    def _node_call(self, name: str, method: str, path: str, timeout_s: float, limit: int = NODE_ANSWER_BYTES,
                   deadline_s: Optional[float] = None, **kw: Any) -> tuple[int, bytes]:
        """(status, body) of a call to a node, the body read raw, ``limit`` bytes at most
        (ConfigError beyond it, or when the node compressed it), all of it within ``deadline_s``
        (default ``timeout_s``) of the answer's start (TestbedTimeout: a trickle holds nothing).
        A connection that fails mid-answer is a ``requests.ConnectionError``."""
        allowed_s = timeout_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + allowed_s
        chunks, size = [], 0
        try:
            with self._session.request(method, self._node_url(name, path), timeout=timeout_s, stream=True,
                                       **kw) as resp:
                _check_encoding(name, path, resp)
                read = getattr(resp.raw, "read1", resp.raw.read)  # read1: what has arrived, not a full chunk
                while chunk := read(min(LOG_CHUNK_BYTES, limit + 1), decode_content=False):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise ConfigError(f"node {name}'s answer to {path} is larger than {limit} bytes")
                    if time.monotonic() > deadline:
                        raise TestbedTimeout(f"node {name}'s answer to {path} took longer than {allowed_s:g}s")
                return resp.status_code, b"".join(chunks)
        except urllib3.exceptions.HTTPError as e:  # a read that timed out or broke after the headers
            raise requests.ConnectionError(f"node {name}, {path}: {e}") from None

    def _health(self, name: str) -> Optional[dict[str, Any]]:
        try:
            _, body = self._node_call(name, "GET", "/health", 2)
            health = bounded_json.loads(body)
        except (requests.RequestException, OSError, ValueError, TestbedError):
            return None
        return health if isinstance(health, dict) else None

    def _post(self, name: str, path: str, body: Any) -> dict[str, Any]:
        try:
            status, answer = self._node_call(name, "POST", path, 30, json=body)
        except (requests.RequestException, OSError, TestbedTimeout) as e:
            raise TestbedError(f"node {name} did not answer {path}: {e}") from None
        if status >= 400:
            raise ConfigError(f"node {name} refused {path}: {answer[:300].decode(errors='replace')}")
        try:
            return bounded_json.loads(answer)
        except ValueError:
            raise ConfigError(f"node {name} answered {path} with no JSON") from None

    def _each_node(self, fn: Callable[[str], Any], names: list[str]) -> list[Any]:
        """``fn`` over ``names``, a few at a time (hundreds of nodes: not one after another)."""
        if len(names) <= 1:
            return [fn(n) for n in names]
        with ThreadPoolExecutor(max_workers=min(CALL_THREADS, len(names))) as pool:
            return list(pool.map(fn, names))

    # confs and start ----------------------------------------------------------------------------
    def _require(self, *phases: str) -> None:
        if self.phase not in phases:
            raise ConfigError(f"the experiment is {self.phase}; this needs it {' or '.join(phases)}")

    def _conf(self, name: str, kind: str) -> dict[str, Any]:
        """A node's generated conf: from memory, else from ``dml_file/conf`` (confs made by dml_tool)."""
        if kind in self.node_confs.get(name, {}):
            return json.loads(json.dumps(self.node_confs[name][kind]))  # a copy: pushing adapts it
        path = os.path.join(self.workdir, "dml_file", "conf", f"{name}_{kind}.json")
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no {kind} conf for node {name} ({path}): run dml_tool first") from None

    def push_dataset_confs(self) -> dict[str, Any]:
        self._require("ready")
        for name, node in self.nodes.items():
            self._post(name, "/conf/dataset", self._conf(name, "dataset"))
            node.dataset_conf = True
        return {"pushed": sorted(self.nodes)}

    def _structure_confs(self) -> dict[str, dict[str, Any]]:
        """Every node's structure conf as pushed: keys, sample counts and peer addresses added."""
        confs = {name: self._conf(name, "structure") for name in self.nodes}
        self.keys.complete_structure_confs(confs, lambda n: self._conf(n, "dataset"))
        for name, conf in confs.items():
            unknown = [p for p in conf.get("connect", {}) if p not in self.nodes]
            if unknown:
                raise ConfigError(f"structure conf of {name} connects to nodes not in this run: {unknown}")
            conf["connect"] = {p: f"{self.nodes[p].ip}:{self.node_port}" for p in conf.get("connect", {})}
            links = self.topology.links  # each linked peer's rate (its share under access links): a send
            conf["link_bps"] = {p: deploy.shared_rate_bps(self.topology, name, p)  # too slow for it is given up early
                                for p in conf["connect"] if (name, p) in links}
        return confs

    def push_structure_confs(self) -> dict[str, Any]:
        self._require("ready")
        confs = self._structure_confs()
        for name, node in self.nodes.items():
            self._post(name, "/conf/structure", confs[name])
            node.structure_conf = True
        return {"pushed": sorted(self.nodes)}

    def start(self) -> dict[str, Any]:
        """Push any conf not pushed yet, then start every node's role."""
        with self._lock:
            if self.phase == "running":
                return {"phase": self.phase, "run_id": self.run_id}
            self._require("ready")
            if not all(n.dataset_conf for n in self.nodes.values()):
                self.push_dataset_confs()
            if not all(n.structure_conf for n in self.nodes.values()):
                self.push_structure_confs()
            for name in self.nodes:  # every role built before any starts: round 1 is not set-up
                self._post(name, "/prepare", {})
            self._start_captures()
            self._start_telemetry()
            self.t_start = time.time()
            t0 = self.t_start_monotonic = time.monotonic()
            if self.telemetry is not None:
                self.telemetry.mark_start(t0)
                self.telemetry.run_in_thread()
            self.record["started_at"] = self.t_start
            for name, node in self.nodes.items():
                self._post(name, "/start", {})
                node.state = "running"
            self.phase = "running"
            if self.scenario is not None:
                self.scenario.start(t0)
            self._write_record()
            self._monitor = threading.Thread(target=self._watch, name="edgetb-monitor", daemon=True)
            self._monitor.start()
        self.progress(f"running: {len(self.nodes)} nodes started")
        return {"phase": self.phase, "run_id": self.run_id}

    def _start_telemetry(self) -> None:
        """Start every host's sampler (the run goes on without telemetry if a host cannot)."""
        if not self.telemetry_conf.enabled:
            return
        collector = Collector(self.worker, self.telemetry_conf, self.out, self.rates)
        try:
            collector.start()
        except (TestbedError, OSError) as e:
            collector.abandon()
            message = e.message if isinstance(e, TestbedError) else str(e)
            self.record["telemetry"] = {**self.telemetry_conf.to_dict(), "problem": message}
            self.progress(f"telemetry not sampled: {message}")
            return
        self.telemetry = collector

    def _finish_telemetry(self) -> None:
        """The last pull, the samplers stopped, the CSV files closed; the summary in run.json."""
        if self.telemetry is None:
            return
        try:
            summary = self.telemetry.finish()
        except Exception as e:  # noqa: BLE001 - the run's own results come first
            log.exception("telemetry could not be finished")
            summary = {"problem": str(e)}
        self.record["telemetry"] = {**self.telemetry_conf.to_dict(), **summary}

    # what nodes tell us --------------------------------------------------------------------------
    def on_print(self, name: str, data: Any) -> None:
        """A progress line from node ``name`` (as its signature proved)."""
        if name not in self.nodes or not isinstance(data, dict):
            raise NotFound(f"/print from an unknown node, or not a JSON object: {clip(str(data), 100)}")
        node = self.nodes[name]

        def number(key: str) -> Optional[float]:
            """A finite number of the message (NaN and infinities are dropped)."""
            value = data.get(key)
            ok = isinstance(value, float) and math.isfinite(value) or isinstance(value, int) and not isinstance(
                value, bool) and abs(value) < 2 ** 63
            return value if ok else None  # type: ignore[return-value]

        self._check_round(name, data)
        if isinstance(data.get("round"), int) and not isinstance(data["round"], bool):
            node.round = data["round"]
            accuracy = number("global_accuracy")
            accuracy = number("accuracy") if accuracy is None else accuracy
            layer = data.get("layer") if isinstance(data.get("layer"), int) else None
            self.rounds.report(node.name, node.round, accuracy, layer, int(number("bytes_sent") or 0))
            loss = number("global_loss")
            self.live.report(node.name, node.round, accuracy, number("loss") if loss is None else loss, layer)
            if self.scenario is not None:
                self.scenario.on_round(node.name, node.round)
        if number("accuracy") is not None:
            node.accuracy = float(number("accuracy"))  # type: ignore[arg-type]
        if number("global_accuracy") is not None:
            node.global_accuracy = float(number("global_accuracy"))  # type: ignore[arg-type]
        if number("loss") is not None:
            node.loss = float(number("loss"))  # type: ignore[arg-type]
        if isinstance(data.get("round"), int) and number("bytes_sent") is not None:
            node.bytes_sent += int(number("bytes_sent"))  # type: ignore[arg-type]  # the round's bytes
        if self.verbose:
            self.progress(f"{node.name}: {clip(str(data.get('msg', '')))}")

    def _check_round(self, name: str, data: dict[str, Any]) -> None:
        """ConfigError unless a /print's ``round`` is one of the run's (0 .. ``max_round``) and its
        ``layer``, when given, one of the node's E-tree layers: each is a series the controller keeps."""
        round_no, layer = data.get("round"), data.get("layer")
        if isinstance(round_no, bool) or not isinstance(round_no, (int, type(None))):
            raise ConfigError(f"/print from {name}: 'round' must be a whole number, got {clip(str(round_no), 40)}")
        if round_no is not None and not 0 <= round_no <= self.max_round:
            raise ConfigError(f"/print from {name}: round {clip(str(round_no), 40)} is not one of this run's "
                              f"(0 to {self.max_round})")
        if layer is not None and (isinstance(layer, bool) or layer not in self.layers.get(name, set())):
            raise ConfigError(f"/print from {name}: layer {clip(str(layer), 40)} is not one of the node's "
                              f"({', '.join(map(str, sorted(self.layers.get(name, set())))) or 'none'})")

    def on_log(self, name: str, body: bytes) -> dict[str, Any]:
        """A node's events upload (JSON lines; ``name`` as its signature proved); a done or
        failed event settles the node. Once the run's results are being written, an upload
        changes nothing."""
        if name not in self.nodes:
            raise NotFound(f"log upload from an unknown node {name!r}")
        if len(body) > MAX_LOG_BYTES:
            raise ConfigError(f"log of {name} is larger than {MAX_LOG_BYTES} bytes")
        with self._lock:
            if self._collecting:
                return {"stored": False, "detail": "the run's results are written already"}
            self._store_log(name, body)
            self._settle_from_events(name, body)
        self._check_all_settled()
        return {"stored": True}

    def _settle_from_events(self, name: str, body: bytes) -> None:
        """Mark ``name`` settled when its events say it ended (done, or failed and why)."""
        ended, detail = None, ""
        for line in body.decode(errors="replace").splitlines():
            try:
                event = bounded_json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("type") in ("done", "failed"):
                ended, detail = event["type"], clip(str(event.get("detail", "")))
        node = self.nodes[name]
        if ended and node.state in ("running", "pending"):
            node.state = node.stopped_by if ended == "done" and node.stopped_by else ended
            node.detail = "" if ended == "done" else (detail or "the node reported a failure")

    def _store_log(self, name: str, body: bytes) -> None:
        self.out.write_bytes(f"events/{name}.jsonl", body)
        self.nodes[name].log_received = True

    def _watch(self) -> None:
        """Mark nodes whose process died as failed, and every ``HEALTH_POLL_S`` ask the
        running ones how they are (pulling the log of one that ended but could not
        upload it), so that neither a lost node nor a lost upload hangs the run. A
        problem with one node marks that node; nothing stops the monitor but the run's end."""
        polled = time.monotonic()
        while self.phase == "running":
            try:
                due = time.monotonic() - polled >= HEALTH_POLL_S
                self._watch_once(due)
                if due:
                    polled = time.monotonic()
                self.rounds.tick(self._states())
                self.live.sample()
                self._check_all_settled()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one bad answer
                log.exception("run monitor: an error, carrying on")
            time.sleep(1.0)

    def _watch_once(self, poll_health: bool) -> None:
        try:
            procs = {p["id"]: p for p in self.worker.processes()["processes"]}
        except TestbedError:
            procs = {}
        for node in self.nodes.values():
            proc = procs.get(node.process_id)
            if node.state == "running" and proc is not None and not proc["running"]:
                if node.expected_death:
                    self._died(node)
                else:
                    node.state, node.detail = "failed", f"process exited (code {proc.get('returncode')})"
                    self.progress(f"{node.name}: failed: {node.detail}")
        if poll_health:
            for node in [n for n in self.nodes.values() if n.state == "running" and not n.expected_death]:
                try:
                    health = self._health(node.name)
                    if health and health.get("state") in ("done", "failed") and self.phase == "running":
                        self._pull_log(node.name)
                except TestbedError as e:
                    node.state, node.detail = "failed", clip(e.message)
                    self.progress(f"{node.name}: failed: {node.detail}")

    def _waiting_on(self) -> list[str]:
        """The nodes the run still waits for: running, and not about to die."""
        return [n.name for n in self.nodes.values() if not n.settled and not n.expected_death]

    def _died(self, node: NodeState) -> None:
        """``node``'s process is gone, as expected: that is its ending (until a replacement)."""
        with self._lock:
            if node.state != "running":
                return
            node.state, node.detail = node.expected_death, ""
        self._membership(node.name, "node_died", why=node.expected_death, pid=node.pid)
        self.progress(f"{node.name}: {node.expected_death} (expected); the run goes on without it")

    def _membership(self, name: str, kind: str, **fields: Any) -> None:
        """A membership change seen by the controller (``lives.json`` at the end)."""
        with self._lock:
            self.membership.append({"t": time.time(), "node": name, "type": kind, **fields})

    # node death and replacement ----------------------------------------------------------------
    def expect_death(self, name: str, why: str) -> None:
        """Node ``name`` is about to be killed or revoked on purpose: once its process is gone
        its ending is ``why`` (``crashed``, ``revoked``...), and the run does not wait for it."""
        node = self._node(name)
        why = " ".join(str(why).split())
        if (not why or len(why) > MAX_WHY_CHARS or why in UNSETTLED + SETTLED
                or not all(c.isalnum() or c in " -_." for c in why)):
            raise ConfigError(f"expect_death({name!r}): the why must be a few words like 'crashed' or 'revoked by "
                              f"the scenario' (letters, digits, spaces, - _ .; at most {MAX_WHY_CHARS}; not an "
                              f"ending such as {', '.join(SETTLED)}), not "
                              f"{clip(why, 80)!r}")
        with self._lock:
            if self.phase != "running":
                raise ConfigError(f"expect_death({name!r}): the experiment is {self.phase}, not running")
            node.expected_death = why
        self._membership(name, "death_expected", why=why, pid=node.pid)
        self._check_all_settled()

    def replace_node(self, name: str) -> dict[str, Any]:
        """Start dead node ``name``'s role again: a new process in the same namespace with the
        same links, its dataset and structure confs pushed (from memory, as deploy does), then
        started so that it rejoins the running experiment. Returns the new life's account."""
        node = self._node(name)
        with self._lock:
            if self.phase != "running" or self._finishing:
                raise ConfigError(f"replace_node({name!r}): the experiment is {self.phase}"
                                  f"{' and finishing' if self._finishing else ''}; a node rejoins a running one")
            if node.state == "running" and not node.expected_death:
                raise ConfigError(f"replace_node({name!r}): the node is running; expect_death and kill it first")
            if node.state == "pending":
                raise ConfigError(f"replace_node({name!r}): the node is being started already")
            old_state = node.state
            node.state = "pending"  # the run waits for the new life from now on
        try:
            self._stop_old_process(node)
            if old_state == "running":  # its death was expected, the monitor had not seen it yet
                old_state = node.expected_death
            node.lives.append({"pid": node.pid, "started_at": node.started_at,
                               "ended": _life_ending(old_state, node.detail), "ended_at": time.time()})
            node.expected_death, node.detail, node.stopped_by, node.log_received = "", "", "", False
            node.dataset_conf = node.structure_conf = False
            self._start_process(name)
            deadline = time.monotonic() + REPLACE_READY_S
            while self._health(name) is None:
                if time.monotonic() > deadline:
                    raise TestbedTimeout(f"replaced node {name} did not answer within {REPLACE_READY_S:g}s")
                time.sleep(0.2)
            self._post(name, "/conf/dataset", self._conf(name, "dataset"))
            node.dataset_conf = True
            # (life > 1: a role that keeps a membership, the ring, joins it before it leads anything)
            self._post(name, "/conf/structure", {**self._structure_confs()[name], "life": len(node.lives) + 1})
            node.structure_conf = True
            self._post(name, "/prepare", {})
            self._post(name, "/start", {})
        except BaseException as e:
            node.state, node.detail = "failed", clip(f"replacement failed: {e}")
            self._membership(name, "replace_failed", detail=node.detail)
            self._check_all_settled()
            raise
        node.state = "running"
        life = len(node.lives) + 1
        self._membership(name, "node_replaced", pid=node.pid, life=life)
        self.progress(f"{name}: replaced (life {life}), rejoining the run")
        return {"node": name, "pid": node.pid, "life": life, "lives": [*node.lives]}

    def lives(self) -> dict[str, Any]:
        """Every node's lives (earlier ones, then the current) and the membership changes the
        controller saw (``death_expected``, ``node_died``, ``node_replaced``, ``replace_failed``)."""
        with self._lock:
            return {"version": 1, "events": [*self.membership], "nodes": {
                n.name: [*n.lives, {"pid": n.pid, "started_at": n.started_at,
                                    "ended": n.life_ending if n.settled else None}] for n in self.nodes.values()}}

    def _node(self, name: str) -> NodeState:
        if name not in self.nodes:
            raise NotFound(f"no node {name!r} in this run (nodes: {', '.join(sorted(self.nodes)[:20])})")
        return self.nodes[name]

    def _stop_old_process(self, node: NodeState) -> None:
        """Make sure the old life is gone (and its record cleared) before a new one starts."""
        if not node.process_id:
            return
        try:
            self.worker.stop_process(node.name, node.process_id)
        except NotFound:
            pass

    def _states(self) -> dict[str, str]:
        return {n.name: n.state for n in self.nodes.values()}

    def _fetch_log(self, name: str) -> Optional[bytes]:
        """A node's events, asked for (None when it does not answer); a node that sends them
        slower than ``LOG_FETCH_S`` in all is refused (a trickle would hold the finish)."""
        try:
            status, body = self._node_call(name, "GET", "/log", 10, MAX_LOG_BYTES, deadline_s=LOG_FETCH_S)
        except (requests.RequestException, OSError):
            return None
        return body if status < 400 else None

    def _local_log(self, name: str) -> Optional[bytes]:
        """The events a node wrote on this machine's disk (a node that died cannot be asked):
        read as ``run_dir.read_node_file`` reads what a node wrote (a FIFO, a link, another's
        file are refused, and are the node's problem)."""
        try:
            return read_node_file(self.workdir, name, f"{self.run_id}.jsonl", MAX_LOG_BYTES, self._node_uid(name))
        except FileNotFoundError:
            return None
        except NodeFileError as e:
            self.problems.setdefault(name, []).append(f"its events on disk: {e.message}")
            return None

    def _node_uid(self, name: str) -> Optional[int]:
        """The node's uid on this machine (its files must be its own); None when not known here."""
        from worker.host import WorkerHost

        if not isinstance(self.worker, WorkerHost):
            return None
        try:
            return int(self.worker.runtime.identity(name).uid)
        except (AttributeError, TestbedError):
            return None

    def _node_uids(self) -> dict[str, int]:
        return {name: uid for name in self.nodes if (uid := self._node_uid(name)) is not None}

    def _pull_log(self, name: str) -> None:
        body = self._fetch_log(name)
        if body is not None:
            self.on_log(name, body)

    def _check_all_settled(self) -> None:
        with self._lock:
            if self._finishing or self.phase != "running" or self._waiting_on():
                return
            self._finishing = True
        threading.Thread(target=self.finish, args=("completed",), name="edgetb-finish", daemon=True).start()

    # finish and reset -----------------------------------------------------------------------------
    def finish(self, how: str = "finished") -> dict[str, Any]:
        """Stop what still runs, collect every log once, write every result from those same
        events. ``how`` the run ended (run_folder.ENDINGS). Safe to call twice."""
        with self._finish_lock:
            if self.summary is not None:
                return self.summary
            self._require("running", "ready")
            with self._lock:
                self._finishing = True  # no replacement starts from now on
            if how == "completed" and self._waiting_on():
                how = "finished"
            if self.scenario is not None:
                self._step("stopping the scenario", self.scenario.stop)
            if self.phase == "running":
                self._step("stopping the nodes", lambda: self._stop_nodes(how))
            self._finish_telemetry()
            with self._lock:
                self._collecting = True
            if self.scenario is not None:
                self._step("scenario.csv", lambda: self.scenario.write(self.out, flows_timeout_s=5.0))
            self._collect_logs()
            self._settle_rest(how)
            captured = self._step("captures", self._collect_captures, {})
            self.ended = how
            self._step("confs.json", lambda: self._write_json(
                "confs.json", {n: {"structure": self.structure[n]} for n in self.nodes}))
            self._step("lives.json", lambda: self._write_json("lives.json", self.lives()))
            self._step("timeline.json", lambda: self._write_json(
                "timeline.json", {"version": 1, "entries": self.live.timeline_now()}))
            self._step("membership.csv", lambda: self.out.write_bytes("membership.csv", tables.csv_bytes(
                tables.MEMBERSHIP_COLUMNS, tables.membership_rows(tables.read_run_events(self.run_dir, {}),
                                                                    self.membership))))
            endings = {n.name: n.ending for n in self.nodes.values()}
            dataset_confs: dict[str, Any] = {}
            for n in self.nodes:
                try:
                    dataset_confs[n] = self._conf(n, "dataset")
                except ConfigError:
                    dataset_confs[n] = {}
            final = self._step("models", lambda: evaluate.final_models(
                self.workdir, self.run_dir, self.run_id, self.structure, dataset_confs, write=self.out.write_bytes,
                uids=self._node_uids()), {})
            built = self._step("metrics and plots", lambda: tables.build(
                self.run_dir, self.t_start or time.time(), self.algorithm, endings, final, write=self.out.write_bytes,
                problems=self.problems), {"algorithm": self.algorithm, "nodes": [], "plots": [], "models": []})
            for row in built.get("nodes", []):
                node = self.nodes.get(row.get("node"))
                if node is not None:
                    node.round = int(row.get("rounds", node.round))
            self.summary = {"run_id": self.run_id, "run_dir": self.run_dir, "ended": how, "endings": endings,
                            **built}
            if captured:
                self.summary["captures"] = captured
            self.summary["problems"] = self.problems
            self._step("summary.json", lambda: self._write_json("summary.json", self.summary))
            self.summary["analysis"] = self._analyze()
            self._step("summary.json", lambda: self._write_json("summary.json", self.summary))
            self.record.update(ended=how, ended_at=time.time(), detail=self.error, nodes=endings)
            if self.problems:
                self.record["problems"] = self.problems
            self._step("run.json", self._write_record)
            self.phase = "finished"
        self.rounds.tick(self._states(), force=True)
        self.progress(f"finished ({how}): results in {self.run_dir}")
        return self.summary

    def _step(self, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        """One step of writing the results: a failure is the run's problem, and the rest goes on."""
        return tables.attempt(self.problems, tables.RUN, what, fn, default)

    # captures and analysis ------------------------------------------------------------------------
    def _start_captures(self) -> None:
        """Start the captures asked for (before any role starts)."""
        if not self.capture:
            return
        self.progress(f"capturing the egress of {len(self.capture)} nodes")
        for name in self.capture:
            self.worker.start_capture(name, {"version": 1})
            self.capturing.append(name)

    def _collect_captures(self) -> dict[str, Any]:
        """Stop every capture, copy its file into ``telemetry/pcap/<node>.pcap`` and remove the
        worker's; a capture that cannot be had is recorded, never fatal to the run's other files."""
        out: dict[str, Any] = {}
        for name in list(self.capturing):
            try:
                stopped = self.worker.stop_capture(name)
                self.out.write_chunks(f"telemetry/pcap/{name}.pcap", self.worker.capture_chunks(name))
                out[name] = {"bytes": stopped.get("bytes"), "kernel_drops": stopped.get("kernel_drops")}
                self.worker.remove_capture(name)  # the run folder has it now
            except Exception as e:  # noqa: BLE001 - one capture never stops the others
                out[name] = {"error": e.message if isinstance(e, TestbedError) else f"{type(e).__name__}: {e}"}
            self.capturing.remove(name)
        return out

    def _analyze(self) -> dict[str, Any]:
        """The run's analysis (``controller.results.analysis``) into ``analysis/``; a failure is recorded."""
        try:
            from controller.results.analysis import analyze

            done = analyze(self.run_dir, progress=self.progress, write=self.out.write_bytes)
            return {"dir": os.path.join(self.run_dir, "analysis"), "seconds": done["seconds"],
                    "missing": done["missing"], "fidelity_ok": done["fidelity"]["ok"]}
        except Exception as e:  # noqa: BLE001 - the run's other files stand without it
            log.exception("analysis of %s failed", self.run_id)
            return {"error": f"{type(e).__name__}: {e}"}

    def _stop_nodes(self, how: str) -> None:
        """Ask the running nodes to stop after their round, and wait up to ``STOP_GRACE_S`` for
        their last events."""
        running = [n for n in self.nodes.values() if n.state == "running"]
        if not running:
            return
        self.progress(f"stopping {len(running)} running nodes ({how})")

        def stop(name: str) -> None:
            self.nodes[name].stopped_by = "timeout" if how == "timeout" else "stopped"
            try:
                self._node_call(name, "POST", "/stop", 5)
            except (requests.RequestException, OSError, TestbedError):
                pass

        self._each_node(stop, [n.name for n in running])
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            waiting = [n.name for n in self.nodes.values() if n.state == "running" and not n.expected_death]
            if not waiting:
                break
            for name, health in zip(waiting, self._each_node(self._health, waiting)):
                if health and health.get("state") in ("done", "failed"):
                    try:
                        self._pull_log(name)
                    except TestbedError as e:
                        self.nodes[name].state, self.nodes[name].detail = "failed", clip(e.message)
            time.sleep(0.5)

    def _collect_logs(self) -> None:
        """Every log not uploaded yet: asked of its node, else read from this machine's disk;
        what fails is that node's problem."""
        def collect(name: str) -> None:
            tables.attempt(self.problems, name, "its events", lambda: collect_one(name))

        def collect_one(name: str) -> None:
            node = self.nodes[name]
            if node.log_received:
                return
            try:
                body = self._fetch_log(name) if node.up else None
            except TestbedError as e:
                node.state, node.detail = "failed", clip(e.message)
                body = None
            if body is None and self._is_local():
                body = self._local_log(name)
            if body is not None:
                self._store_log(name, body)
                self._settle_from_events(name, body)

        self._each_node(collect, list(self.nodes))

    def _is_local(self) -> bool:
        return self.worker.is_local  # a WorkerHost of this machine

    def _settle_rest(self, how: str) -> None:
        """The ending of every node not settled yet."""
        for node in self.nodes.values():
            if node.settled:
                continue
            if node.expected_death:  # stopped before the death it expected
                node.state = node.expected_death
            elif not node.log_received:
                node.state, node.detail = "lost", node.detail or "its log could not be collected"
            elif how == "timeout":
                node.state = "timeout"
            else:
                node.state = "stopped"

    def _write_json(self, name: str, data: Any) -> None:
        self.out.write_json(name, data)

    def _write_record(self) -> None:
        self.out.write_json("run.json", self.record)

    def update_tc(self, file: str) -> dict[str, Any]:
        """Re-shape, in place, the links listed in ``file`` (inside the experiment dir); other links keep theirs."""
        root = self.workdir
        path = os.path.realpath(os.path.join(root, file))
        if os.path.commonpath([root, path]) != root:
            raise ConfigError(f"{file!r} is outside the experiment directory {root}")
        return self._update_links(lambda declared: load_links(path, declared, nodes_declared=True))

    def update_link(self, src: str, dst: str, bw: str) -> dict[str, Any]:
        """Change the rate of link ``src -> dst`` in place (the dashboard's control); its delay,
        jitter, loss and queue stay."""
        link = self.topology.links.get((src, dst)) if isinstance(src, str) and isinstance(dst, str) else None
        if link is None:
            raise NotFound(f"no link {clip(str(src), 20)}->{clip(str(dst), 20)} in this run")
        entry: dict[str, Any] = {"dest": dst, "bw": bw}
        shape = link.shape
        if shape.delay_ms:
            entry["delay"] = f"{shape.delay_ms:g}ms"
        if shape.jitter_ms:
            entry["jitter"] = f"{shape.jitter_ms:g}ms"
        if shape.loss_pct:
            entry["loss"] = f"{shape.loss_pct:g}%"
        if shape.queue_pkts:
            entry["queue"] = shape.queue_pkts
        return self._update_links(lambda declared: links_from_data({src: [entry]}, "the link change", declared,
                                                                   nodes_declared=True))

    def _update_links(self, read: Callable[[Topology], Topology]) -> dict[str, Any]:
        declared = Topology()
        for node in self.topology.nodes.values():
            declared.add_node(node.name, node.kind, node.host, node.cpu, node.mem_bytes, node.ip,
                              uplink=node.uplink_bps, downlink=node.downlink_bps, pids=node.pids_max)
        changed = read(declared)
        deploy.check_capabilities(changed, self.worker.capabilities())
        ips = {n.name: n.ip for n in self.nodes.values()}
        ips.update({n["name"]: n["ip"] for n in self.worker.status()["nodes"]})
        result = deploy.merge_links(changed, self.worker, ips)
        self.links_reshaped(changed.links.values())
        for link in changed.links.values():
            self.live.link_changed(link.src, link.dst, link.shape)
        return result

    def links_reshaped(self, links: Iterable[Link]) -> None:
        """``links`` were re-shaped in place just now (the worker confirmed): the topology and
        the run's rates follow (/update/tc, /update/link and a scenario's link steps)."""
        start = self.t_start_monotonic
        t_s = FROM_START if start is None else time.monotonic() - start
        for link in links:
            self.topology.links[(link.src, link.dst)] = link
            self.rates.set((link.src, link.dst), link.shape.rate_bps, t_s)

    def close(self, how: str) -> None:
        """Write the run folder if the run was started and is not written yet (Ctrl-C, a signal)."""
        if self.phase == "running" or (self.phase == "ready" and self.t_start is not None):
            try:
                self.finish(how)
            except TestbedError as e:
                self.progress(f"could not write the results: {e.message}")

    def reset(self) -> dict[str, Any]:
        """Write the run folder (a run under way is stopped first), then remove the testbed.
        A reset that fails raises, and the testbed's phase stays as it was."""
        self.close("reset")
        result = self.worker.reset()
        self.phase = "reset" if self.phase != "failed" else self.phase
        return result

    def unfinished(self) -> list[str]:
        """The nodes whose last life did not finish: not ``done``, and not a death the run was
        told to expect (a scenario's crash or revocation, replaced or not)."""
        return [n.name for n in self.nodes.values() if n.state in SETTLED and n.state != "done"]

    def metrics_nodes(self) -> list[dict[str, Any]]:
        """Each node's last reported round, accuracy, loss and model bytes (for /metrics)."""
        return [{"name": n.name, "round": n.round, "accuracy": n.accuracy, "loss": n.loss, "bytes_sent": n.bytes_sent}
                for n in self.nodes.values()]

    def status(self) -> dict[str, Any]:
        nodes = [{**asdict(n), "ending": n.ending if n.settled else None} for n in self.nodes.values()]
        return {"version": 1, "run_id": self.run_id, "phase": self.phase, "ended": self.ended or None,
                "error": self.error, "algorithm": self.algorithm, "run_dir": self.run_dir,
                "started_at": self.t_start, "nodes": nodes,
                "done": sum(n.state == "done" for n in self.nodes.values()),
                "failed": sum(n.state == "failed" for n in self.nodes.values()),
                "settled": sum(n.settled for n in self.nodes.values())}


def capture_list(capture: Optional[list[str] | str], nodes: list[str]) -> list[str]:
    """The nodes to capture: none, ``"all"``, or names of this run's nodes (an unknown one is refused)."""
    if not capture:
        return []
    if capture == "all":
        return list(nodes)
    if isinstance(capture, str) or not isinstance(capture, list) or not all(isinstance(n, str) for n in capture):
        raise ConfigError(f"capture must be \"all\" or a list of node names, not {capture!r}")
    unknown = [n for n in capture if n not in nodes]
    if unknown:
        raise ConfigError(f"capture: no node {', '.join(repr(n) for n in unknown)} in this run")
    return list(dict.fromkeys(capture))


def _code_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
