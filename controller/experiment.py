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
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import requests

from controller import deploy, evaluate, node_auth, results, run_record
from controller.agent_client import Worker
from controller.progress import Progress
from controller.safe_fs import RunDir
from controller.terminal import clip
from controller.topology import Topology, load_links
from worker.errors import ConfigError, NotFound, TestbedError, TestbedTimeout

NODE_PORT = 4444
# one BLAS thread and two malloc arenas per node: hundreds of nodes share two cores
NODE_ENV = {"OPENBLAS_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
MAX_LOG_BYTES = 64 * 1024 * 1024
HEALTH_POLL_S = 10.0  # how often the monitor asks running nodes how they are
STOP_GRACE_S = 20.0  # how long finish waits for stopped nodes' last events
CALL_THREADS = 16  # concurrent calls to nodes when stopping or collecting
SETTLED = ("done", "stopped", "failed", "timeout", "lost")
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
    accuracy: Optional[float] = None
    log_received: bool = False
    stopped_by: str = ""  # why the controller asked it to stop: its ending once it does
    detail: str = ""

    @property
    def ending(self) -> str:
        return f"failed: {self.detail}" if self.state == "failed" and self.detail else self.state


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


class Experiment:
    """Deploys, drives and collects one run."""

    def __init__(self, workdir: str, topology: Topology, worker: Worker, structure: dict[str, dict[str, Any]],
                 run_id: Optional[str] = None, controller_port: int = 3333, node_port: int = NODE_PORT,
                 progress: Callable[[str], None] = print, algorithm: str = "gossip",
                 node_confs: Optional[dict[str, dict[str, Any]]] = None, inputs: Optional[dict[str, str]] = None,
                 dataset: Optional[dict[str, Any]] = None, testbed_id: str = "0", verbose: bool = False,
                 open_network: bool = False, capture: Optional[list[str] | str] = None) -> None:
        """``node_confs`` maps each node to its generated ``structure`` and ``dataset`` confs (pushed
        from memory; read from ``dml_file/conf`` when absent); ``inputs`` the user's files by role
        (links, nodes, structure, dataset, hosts), copied into the run folder; ``verbose`` prints
        every node's round lines besides the aggregate; ``open_network``: unlinked nodes reach each
        other (EdgeTB's network) instead of no link, no path; ``capture``: the nodes whose egress
        is captured (``"all"`` or names), into ``telemetry/pcap/<node>.pcap`` of the run folder."""
        self.open_network = open_network
        self.workdir = os.path.realpath(workdir)
        self.topology = topology
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
        self.capture = capture_list(capture, list(self.nodes))
        self.capturing: list[str] = []  # the nodes whose capture was started
        self.rounds = Progress({n: s.rounds for n, s in self.nodes.items()}, progress)
        self.phase = "created"
        self.ended = ""  # how the run ended (run_record.ENDINGS)
        self.error = ""
        self.t_start: Optional[float] = None
        self.summary: Optional[dict[str, Any]] = None
        self.record = run_record.describe(self.run_id, algorithm, testbed_id, _code_root(), structure, dataset)
        self.record["network"] = "open" if open_network else "isolated"  # unlinked pairs: reachable or dropped
        self._out: Optional[RunDir] = None
        self._collecting = False  # set once finish collects: later uploads change nothing
        self._finishing = False  # a finish of the settled run was started (once)
        self._lock = threading.RLock()
        self._finish_lock = threading.Lock()
        self._monitor: Optional[threading.Thread] = None
        self.keys = node_auth.RunKeys()  # each node's own secret, pair keys; signs calls to nodes
        self._session = requests.Session()
        self._session.auth = self.keys.signer(lambda: {f"{n.ip}:{self.node_port}": n.name for n in self.nodes.values()})

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
            self.out.write_json("topology.json", run_record.topology_doc(self.topology, result["ips"]))
            run_record.copy_inputs(self.out, self.inputs)
            self._write_record()
            self.progress(f"starting {len(self.nodes)} node processes")
            for name, node in self.nodes.items():
                started = self.worker.start_node(name, {"version": 1, "args": [
                    "--name", name, "--port", str(self.node_port), "--controller", controller,
                    "--run-id", self.run_id], "env": NODE_ENV | self.keys.env_for(name)})
                node.process_id, node.pid = started["id"], started["pid"]
            self._wait_ready(ready_timeout_s or 30 + 1.0 * len(self.nodes))
        except BaseException as e:
            self.phase, self.error = "failed", str(e)
            raise
        self.phase = "ready"
        self.progress(f"ready: {len(self.nodes)} nodes answer; run id {self.run_id}")

    def sync_code(self) -> None:
        """Hosts other than this one fetch the code and shards from the controller (so it must
        be serving): a step before ``deploy`` when the worker is a cluster."""
        sync = getattr(self.worker, "sync_code", None)
        if sync is not None:
            try:
                sync(f"http://{self.worker.status()['bridge_ip']}:{self.controller_port}", self.node_token,
                     self.progress)
            except BaseException as e:
                self.phase, self.error = "failed", str(e)
                raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.nodes)
        while waiting:
            for name in sorted(waiting):
                if self._health(name) is not None:
                    self.nodes[name].up = True
                    waiting.discard(name)
            if waiting and time.monotonic() > deadline:
                raise TestbedTimeout(f"nodes did not answer within {timeout_s:g}s: {', '.join(sorted(waiting))}")
            if waiting:
                time.sleep(0.2)

    def _node_url(self, name: str, path: str) -> str:
        return f"http://{self.nodes[name].ip}:{self.node_port}{path}"

    def _health(self, name: str) -> Optional[dict[str, Any]]:
        try:
            health = self._session.get(self._node_url(name, "/health"), timeout=2).json()
        except (requests.RequestException, ValueError):
            return None
        return health if isinstance(health, dict) else None

    def _post(self, name: str, path: str, body: Any) -> dict[str, Any]:
        try:
            resp = self._session.post(self._node_url(name, path), json=body, timeout=30)
        except requests.RequestException as e:
            raise TestbedError(f"node {name} did not answer {path}: {e}") from None
        if resp.status_code >= 400:
            raise ConfigError(f"node {name} refused {path}: {resp.text[:300]}")
        return resp.json()

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

    def push_structure_confs(self) -> dict[str, Any]:
        self._require("ready")
        confs = {name: self._conf(name, "structure") for name in self.nodes}
        self.keys.complete_structure_confs(confs, lambda n: self._conf(n, "dataset"))
        for name, node in self.nodes.items():
            conf = confs[name]
            unknown = [p for p in conf.get("connect", {}) if p not in self.nodes]
            if unknown:
                raise ConfigError(f"structure conf of {name} connects to nodes not in this run: {unknown}")
            conf["connect"] = {p: f"{self.nodes[p].ip}:{self.node_port}" for p in conf.get("connect", {})}
            self._post(name, "/conf/structure", conf)
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
            self.t_start = time.time()
            self.record["started_at"] = self.t_start
            for name, node in self.nodes.items():
                self._post(name, "/start", {})
                node.state = "running"
            self.phase = "running"
            self._write_record()
            self._monitor = threading.Thread(target=self._watch, name="edgetb-monitor", daemon=True)
            self._monitor.start()
        self.progress(f"running: {len(self.nodes)} nodes started")
        return {"phase": self.phase, "run_id": self.run_id}

    # what nodes tell us --------------------------------------------------------------------------
    def on_print(self, name: str, data: Any) -> None:
        """A progress line from node ``name`` (as its signature proved)."""
        if name not in self.nodes or not isinstance(data, dict):
            raise NotFound(f"/print from an unknown node, or not a JSON object: {clip(str(data), 100)}")
        node = self.nodes[name]
        number = lambda key: data[key] if isinstance(data.get(key), (int, float)) and not isinstance(  # noqa: E731
            data.get(key), bool) else None
        if isinstance(data.get("round"), int) and not isinstance(data["round"], bool):
            node.round = data["round"]
            accuracy = number("global_accuracy")
            accuracy = number("accuracy") if accuracy is None else accuracy
            layer = data.get("layer") if isinstance(data.get("layer"), int) else None
            self.rounds.report(node.name, node.round, accuracy, layer, int(number("bytes_sent") or 0))
        if number("accuracy") is not None:
            node.accuracy = float(number("accuracy"))  # type: ignore[arg-type]
        if self.verbose:
            self.progress(f"{node.name}: {clip(str(data.get('msg', '')))}")

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
                event = json.loads(line)
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
                node.state, node.detail = "failed", f"process exited (code {proc.get('returncode')})"
                self.progress(f"{node.name}: failed: {node.detail}")
        if poll_health:
            for node in [n for n in self.nodes.values() if n.state == "running"]:
                try:
                    health = self._health(node.name)
                    if health and health.get("state") in ("done", "failed") and self.phase == "running":
                        self._pull_log(node.name)
                except TestbedError as e:
                    node.state, node.detail = "failed", clip(e.message)
                    self.progress(f"{node.name}: failed: {node.detail}")

    def _states(self) -> dict[str, str]:
        return {n.name: n.state for n in self.nodes.values()}

    def _fetch_log(self, name: str) -> Optional[bytes]:
        """A node's events, asked for (None when it does not answer)."""
        try:
            with self._session.get(self._node_url(name, "/log"), timeout=10, stream=True) as resp:
                resp.raise_for_status()
                body = resp.raw.read(MAX_LOG_BYTES + 1, decode_content=True)
        except (requests.RequestException, OSError):
            return None
        if len(body) > MAX_LOG_BYTES:
            raise ConfigError(f"log of {name} is larger than {MAX_LOG_BYTES} bytes")
        return body

    def _local_log(self, name: str) -> Optional[bytes]:
        """The events a node wrote on this machine's disk (a node that died cannot be asked)."""
        path = os.path.join(self.workdir, "dml_file", "node", name, f"{self.run_id}.jsonl")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            body = f.read(MAX_LOG_BYTES + 1)
        return body if len(body) <= MAX_LOG_BYTES else None

    def _pull_log(self, name: str) -> None:
        body = self._fetch_log(name)
        if body is not None:
            self.on_log(name, body)

    def _check_all_settled(self) -> None:
        with self._lock:
            if self._finishing or self.phase != "running" or any(n.state not in SETTLED for n in self.nodes.values()):
                return
            self._finishing = True
        threading.Thread(target=self.finish, args=("completed",), name="edgetb-finish", daemon=True).start()

    # finish and reset -----------------------------------------------------------------------------
    def finish(self, how: str = "finished") -> dict[str, Any]:
        """Stop what still runs, collect every log once, write every result from those same
        events. ``how`` the run ended (run_record.ENDINGS). Safe to call twice."""
        with self._finish_lock:
            if self.summary is not None:
                return self.summary
            self._require("running", "ready")
            if how == "completed" and any(n.state not in SETTLED for n in self.nodes.values()):
                how = "finished"
            if self.phase == "running":
                self._stop_nodes(how)
            with self._lock:
                self._collecting = True
            self._collect_logs()
            self._settle_rest(how)
            captured = self._collect_captures()
            self.ended = how
            self._write_json("confs.json", {n: {"structure": self.structure[n]} for n in self.nodes})
            endings = {n.name: n.ending for n in self.nodes.values()}
            dataset_confs: dict[str, Any] = {}
            for n in self.nodes:
                try:
                    dataset_confs[n] = self._conf(n, "dataset")
                except ConfigError:
                    dataset_confs[n] = {}
            final = evaluate.final_models(self.workdir, self.run_dir, self.run_id, self.structure, dataset_confs,
                                          write=self.out.write_bytes)
            built = results.build(self.run_dir, self.t_start or time.time(), self.algorithm, endings, final,
                                  write=self.out.write_bytes)
            for row in built.get("nodes", []):
                node = self.nodes.get(row.get("node"))
                if node is not None:
                    node.round = int(row.get("rounds", node.round))
            self.summary = {"run_id": self.run_id, "run_dir": self.run_dir, "ended": how, "endings": endings,
                            **built}
            if captured:
                self.summary["captures"] = captured
            self._write_json("summary.json", self.summary)
            self.summary["analysis"] = self._analyze()
            self._write_json("summary.json", self.summary)
            self.record.update(ended=how, ended_at=time.time(), detail=self.error, nodes=endings)
            self._write_record()
            self.phase = "finished"
        self.rounds.tick(self._states(), force=True)
        self.progress(f"finished ({how}): results in {self.run_dir}")
        return self.summary

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
            except TestbedError as e:
                out[name] = {"error": e.message}
            self.capturing.remove(name)
        return out

    def _analyze(self) -> dict[str, Any]:
        """The run's analysis (``controller.analysis``) into ``analysis/``; a failure is recorded."""
        try:
            from controller.analysis import analyze

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
                self._session.post(self._node_url(name, "/stop"), timeout=5)
            except requests.RequestException:
                pass

        self._each_node(stop, [n.name for n in running])
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            waiting = [n.name for n in self.nodes.values() if n.state == "running"]
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
        """Every log not uploaded yet: asked of its node, else read from this machine's disk."""
        def collect(name: str) -> None:
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
        return getattr(self.worker, "store", None) is not None  # a WorkerHost of this machine

    def _settle_rest(self, how: str) -> None:
        """The ending of every node not settled yet."""
        for node in self.nodes.values():
            if node.state in SETTLED:
                continue
            if not node.log_received:
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
        declared = Topology()
        for node in self.topology.nodes.values():
            declared.add_node(node.name, node.kind, node.host, node.cpu, node.mem_bytes, node.ip)
        changed = load_links(path, declared, nodes_declared=True)
        deploy.check_capabilities(changed, self.worker.capabilities())
        ips = {n.name: n.ip for n in self.nodes.values()}
        ips.update({n["name"]: n["ip"] for n in self.worker.status()["nodes"]})
        result = deploy.merge_links(changed, self.worker, ips)
        for (src, dst), link in changed.links.items():
            self.topology.links[(src, dst)] = link
        return result

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

    def status(self) -> dict[str, Any]:
        nodes = [{**asdict(n), "ending": n.ending if n.state in SETTLED else None} for n in self.nodes.values()]
        return {"version": 1, "run_id": self.run_id, "phase": self.phase, "ended": self.ended or None,
                "error": self.error, "algorithm": self.algorithm, "run_dir": self.run_dir,
                "started_at": self.t_start, "nodes": nodes,
                "done": sum(n.state == "done" for n in self.nodes.values()),
                "failed": sum(n.state == "failed" for n in self.nodes.values()),
                "settled": sum(n.state in SETTLED for n in self.nodes.values())}


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
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
