"""One DML experiment on a deployed testbed, as an explicit state machine.

    deploying -> ready -> running -> finished
            \\-> failed (deploy failed, or every node failed)

``status()`` reports the phase, each node's readiness (process up, confs
received, shaping verified) and its round progress: readiness is a state to
poll, not a console line to wait for. Results land in
``dml_file/log/<run id>/``: the nodes' events, the resolved topology and confs,
metrics.csv and plots.
"""
from __future__ import annotations

import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import requests

from controller import deploy, results
from controller.agent_client import Worker
from controller.topology import Topology, load_links
from worker.errors import ConfigError, NotFound, TestbedError, TestbedTimeout

NODE_PORT = 4444
# one BLAS thread and two malloc arenas per node: hundreds of nodes share two cores
NODE_ENV = {"OPENBLAS_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
MAX_LOG_BYTES = 64 * 1024 * 1024
HEALTH_POLL_S = 10.0  # how often the monitor asks running nodes how they are


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
    state: str = "pending"  # pending, running, done, failed
    round: int = 0
    rounds: int = 0
    accuracy: Optional[float] = None
    log_received: bool = False
    detail: str = ""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


class Experiment:
    """Deploys, drives and collects one run."""

    def __init__(self, workdir: str, topology: Topology, worker: Worker, structure: dict[str, dict[str, Any]],
                 run_id: Optional[str] = None, controller_port: int = 3333, node_port: int = NODE_PORT,
                 progress: Callable[[str], None] = print, open_network: bool = False) -> None:
        self.open_network = open_network  # True: unlinked nodes reach each other (EdgeTB's network)
        self.workdir = os.path.realpath(workdir)
        self.topology = topology
        self.worker = worker
        self.structure = structure
        self.run_id = run_id or new_run_id()
        self.run_dir = os.path.join(self.workdir, "dml_file", "log", self.run_id)
        self.controller_port = controller_port
        self.node_port = node_port
        self.progress = progress
        self.node_token = secrets.token_urlsafe(24)
        self.nodes = {n: NodeState(n, rounds=int(c.get("sync", 0))) for n, c in structure.items()}
        self.phase = "created"
        self.error = ""
        self.t_start: Optional[float] = None
        self.summary: Optional[dict[str, Any]] = None
        self._lock = threading.RLock()
        self._finish_lock = threading.Lock()
        self._monitor: Optional[threading.Thread] = None
        self._session = requests.Session()
        self._session.headers["Authorization"] = f"Bearer {self.node_token}"

    # deploy -----------------------------------------------------------------------------------
    def deploy(self, ready_timeout_s: Optional[float] = None) -> None:
        """Bring up the network, start a node process per participant, wait until all answer
        (by default 30 s plus 0.5 s per node: hundreds of processes start on a few cores)."""
        self.phase = "deploying"
        try:
            result = deploy.deploy(self.topology, self.worker, self.progress, open_network=self.open_network)
            controller = f"http://{self.worker.status()['bridge_ip']}:{self.controller_port}"
            for name, node in self.nodes.items():
                node.ip = result["ips"][name]
                node.shaping_verified = True
            self.progress(f"starting {len(self.nodes)} node processes")
            for name, node in self.nodes.items():
                started = self.worker.start_node(name, {"version": 1, "args": [
                    "--name", name, "--port", str(self.node_port), "--controller", controller,
                    "--run-id", self.run_id], "env": NODE_ENV | {"EDGETB_NODE_TOKEN": self.node_token}})
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
            return self._session.get(self._node_url(name, "/health"), timeout=2).json()
        except (requests.RequestException, ValueError):
            return None

    def _post(self, name: str, path: str, body: Any) -> dict[str, Any]:
        try:
            resp = self._session.post(self._node_url(name, path), json=body, timeout=30)
        except requests.RequestException as e:
            raise TestbedError(f"node {name} did not answer {path}: {e}") from None
        if resp.status_code >= 400:
            raise ConfigError(f"node {name} refused {path}: {resp.text[:300]}")
        return resp.json()

    # confs and start ----------------------------------------------------------------------------
    def _require(self, *phases: str) -> None:
        if self.phase not in phases:
            raise ConfigError(f"the experiment is {self.phase}; this needs it {' or '.join(phases)}")

    def _read_conf(self, name: str, kind: str) -> dict[str, Any]:
        path = os.path.join(self.workdir, "dml_file", "conf", f"{name}_{kind}.json")
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no {kind} conf for node {name} ({path}): run dml_tool first") from None

    def push_dataset_confs(self) -> dict[str, Any]:
        self._require("ready")
        for name, node in self.nodes.items():
            self._post(name, "/conf/dataset", self._read_conf(name, "dataset"))
            node.dataset_conf = True
        return {"pushed": sorted(self.nodes)}

    def push_structure_confs(self) -> dict[str, Any]:
        self._require("ready")
        for name, node in self.nodes.items():
            conf = self._read_conf(name, "structure")
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
            self.t_start = time.time()
            for name, node in self.nodes.items():
                self._post(name, "/start", {})
                node.state = "running"
            self.phase = "running"
            self._monitor = threading.Thread(target=self._watch, name="edgetb-monitor", daemon=True)
            self._monitor.start()
        self.progress(f"running: {len(self.nodes)} nodes started")
        return {"phase": self.phase, "run_id": self.run_id}

    # what nodes tell us --------------------------------------------------------------------------
    def on_print(self, data: Any) -> None:
        if not isinstance(data, dict) or data.get("node") not in self.nodes:
            raise NotFound(f"/print from an unknown node: {str(data)[:100]}")
        node = self.nodes[data["node"]]
        if isinstance(data.get("round"), int):
            node.round = data["round"]
        if isinstance(data.get("accuracy"), (int, float)):
            node.accuracy = float(data["accuracy"])
        self.progress(f"{node.name}: {str(data.get('msg', ''))[:200]}")

    def on_log(self, name: str, body: bytes) -> dict[str, Any]:
        """A node's events upload (JSON lines); a done or failed event settles the node."""
        if name not in self.nodes:
            raise NotFound(f"log upload from an unknown node {name!r}")
        if len(body) > MAX_LOG_BYTES:
            raise ConfigError(f"log of {name} is larger than {MAX_LOG_BYTES} bytes")
        self._store_log(name, body)
        ended = None
        for line in body.decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("type") in ("done", "failed"):
                ended = event["type"]
        node = self.nodes[name]
        if ended and node.state == "running":
            node.state = ended
            node.detail = "" if ended == "done" else "the node reported a failure"
        self._check_all_settled()
        return {"stored": True}

    def _store_log(self, name: str, body: bytes) -> None:
        events_dir = os.path.join(self.run_dir, "events")
        os.makedirs(events_dir, exist_ok=True)
        with open(os.path.join(events_dir, f"{name}.jsonl"), "wb") as f:
            f.write(body)
        self.nodes[name].log_received = True

    def _watch(self) -> None:
        """Mark nodes whose process died as failed, and every ``HEALTH_POLL_S`` ask the
        running ones how they are (pulling the log of one that ended but could not
        upload it), so that neither a lost node nor a lost upload hangs the run."""
        polled = time.monotonic()
        while self.phase == "running":
            try:
                procs = {p["id"]: p for p in self.worker.processes()["processes"]}
            except TestbedError:
                procs = {}
            for node in self.nodes.values():
                proc = procs.get(node.process_id)
                if node.state == "running" and proc is not None and not proc["running"]:
                    node.state, node.detail = "failed", f"process exited (code {proc.get('returncode')})"
                    self.progress(f"{node.name}: failed: {node.detail}")
            if time.monotonic() - polled >= HEALTH_POLL_S:
                polled = time.monotonic()
                for node in [n for n in self.nodes.values() if n.state == "running"]:
                    health = self._health(node.name)
                    if health and health.get("state") in ("done", "failed") and self.phase == "running":
                        self._pull_log(node.name)
            self._check_all_settled()
            time.sleep(1.0)

    def _fetch_log(self, name: str) -> Optional[bytes]:
        """A node's events, asked for (None when it does not answer)."""
        try:
            resp = self._session.get(self._node_url(name, "/log"), timeout=10)
            resp.raise_for_status()
        except requests.RequestException:
            return None
        return resp.content

    def _pull_log(self, name: str) -> None:
        body = self._fetch_log(name)
        if body is not None:
            self.on_log(name, body)

    def _check_all_settled(self) -> None:
        if self.phase == "running" and all(n.state in ("done", "failed") for n in self.nodes.values()):
            threading.Thread(target=self.finish, name="edgetb-finish", daemon=True).start()

    # finish and reset -----------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Collect every log (pulling what did not arrive), write results. Safe to call twice."""
        with self._finish_lock:
            if self.summary is not None:
                return self.summary
            self._require("running", "ready")
            for name, node in self.nodes.items():
                if node.state == "running":
                    try:
                        self._session.post(self._node_url(name, "/stop"), timeout=5)
                    except requests.RequestException:
                        pass
                if not node.log_received and node.up:
                    body = self._fetch_log(name)
                    if body is not None:
                        self._store_log(name, body)
                    else:
                        node.detail = node.detail or "its log could not be collected"
            os.makedirs(self.run_dir, exist_ok=True)
            self._write_json("topology.json", self.topology.to_dict())
            self._write_json("confs.json", {n: {"structure": self.structure[n]} for n in self.nodes})
            built = results.build(self.run_dir, self.t_start or time.time())
            self.summary = {"run_id": self.run_id, "run_dir": self.run_dir, **built}
            self._write_json("summary.json", self.summary)
            self.phase = "finished"
        self.progress(f"finished: results in {self.run_dir}")
        return self.summary

    def _write_json(self, name: str, data: Any) -> None:
        with open(os.path.join(self.run_dir, name), "w") as f:
            json.dump(data, f, indent=1)

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

    def reset(self) -> dict[str, Any]:
        self.phase = "reset" if self.phase != "failed" else self.phase
        return self.worker.reset()

    def status(self) -> dict[str, Any]:
        return {"version": 1, "run_id": self.run_id, "phase": self.phase, "error": self.error,
                "run_dir": self.run_dir, "started_at": self.t_start,
                "nodes": [asdict(n) for n in self.nodes.values()],
                "done": sum(n.state == "done" for n in self.nodes.values()),
                "failed": sum(n.state == "failed" for n in self.nodes.values())}
