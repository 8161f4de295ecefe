"""One DML experiment on a deployed testbed, as an explicit state machine.

    created -> deploying -> ready -> running -> finished -> reset
                     \\-> failed (deploy failed)

``status()`` reports the phase, each node's readiness (process up, confs
received, shaping verified) and its round progress: readiness is a state to
poll, not a console line to wait for. Results land in
``dml_file/log/<run id>/``: the nodes' events, ``run.json`` (what ran and how it
ended), ``inputs/``, the resolved topology and confs, metrics.csv and plots
(``controller.results.finish``).

However a run ends (every node done, ``/finish`` mid-run, a timeout, Ctrl-C,
``/emulated/reset``, a node that dies), ``finish`` stops the nodes still
running, waits a little for their last events, collects every log once and
builds every result file from those same events; each node gets its ending:
``done``, ``stopped``, ``failed: <why>``, ``timeout`` or ``lost`` (no log).

Nodes may die on purpose (a scenario's crash or revocation): ``expect_death`` says
so first (``controller.run.membership``), and the run does not wait for them;
``replace_node`` starts a dead node's role again so that it rejoins the run.

The experiment is given its ``Nodes`` (``controller.run.nodes``: their states and the
signed client that calls them); it records its timeline (``controller.run.timeline``); the
live view (``live``) is attached by whoever serves it.
"""
from __future__ import annotations

import dataclasses

import logging
import math
import os
import secrets
import threading
import time
from typing import Any, Callable, Iterable, Optional

from controller.model.telemetry_conf import TelemetryConf
from controller.model.topology import Link, Topology, load_links, with_rate
from controller.results import finish as results
from controller.results import run_dir as run_folder
from controller.results.rates import FROM_START, LinkRates
from controller.results.run_dir import RunDir
from controller.run import live_links
from controller.run.membership import Membership, check_why
from controller.run.nodes import MAX_LOG_BYTES, NodeConfs, Nodes, State, TextEnum
from controller.run.progress import Progress, clip, read_report, round_bounds
from controller.run.recording import NoWatcher, Recording, RunWatcher, capture_list
from controller.run.scenario_runner import ScenarioRunner
from controller.run.trace_replay import TracedLink, TraceReplay, traced_links
from controller.run.timeline import RunTimeline
from controller.telemetry.collector import Collector
from controller.workers import deploy
from worker.api.errors import ConfigError, NotFound, TestbedError
from worker.host import REPO_ROOT

HEALTH_POLL_S = 10.0  # how often the monitor asks running nodes how they are
MAX_DECISIONS = 16  # policy decisions one progress report may bring to the live timeline
START_SPREAD = 1.5  # calls to idle nodes go at a light pass's pace: this much of one, for a start's calls
START_MARGIN_S = 0.2
MAX_START_SPREAD_S = 30.0  # (a node takes at most 60)


def start_spread_s(pass_s: float) -> float:
    """How long after the first ``/start`` call every role begins: time for the calls to reach
    every node (about a pass of light calls), bounded."""
    return min(MAX_START_SPREAD_S, START_SPREAD * pass_s + START_MARGIN_S)
log = logging.getLogger("edgetb.controller")


class Phase(TextEnum):
    """Where the run is (``status()["phase"]``)."""

    CREATED = "created"
    DEPLOYING = "deploying"
    READY = "ready"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    RESET = "reset"


class Experiment:
    """Deploys, drives and collects one run of ``nodes``."""

    def __init__(self, topology: Topology, nodes: Nodes, structure: dict[str, dict[str, Any]],
                 controller_port: int = 3333, progress: Callable[[str], None] = print, algorithm: str = "gossip",
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
        self.nodes = nodes
        self.workdir, self.worker, self.run_id, self.keys = nodes.workdir, nodes.worker, nodes.run_id, nodes.auth
        self.topology = topology
        self.rates = LinkRates.of_topology(topology)  # every link's configured rate over the run
        self.structure = structure
        self.algorithm = algorithm
        self.confs = NodeConfs(nodes, topology, node_confs)
        self.inputs = inputs or {}
        self.dataset = dataset
        self.run_dir = os.path.join(self.workdir, "dml_file", "log", self.run_id)
        self.controller_port = controller_port
        self.progress = progress
        self.verbose = verbose
        self.node_token = secrets.token_urlsafe(24)
        conf = telemetry_conf or TelemetryConf()
        self.recording = Recording(nodes.worker, conf, capture_list(capture, list(nodes), conf), progress)
        self.rounds = Progress({n: s.rounds for n, s in nodes.items()}, progress)
        self.max_round, self.layers = round_bounds(structure)  # what a /print may report
        self.phase = Phase.CREATED
        self.ended = ""  # how the run ended (run_folder.ENDINGS)
        self.error = ""
        self.t_start: Optional[float] = None
        self.t_start_monotonic: Optional[float] = None
        self.summary: Optional[dict[str, Any]] = None
        self.record = run_folder.describe(self.run_id, algorithm, testbed_id, REPO_ROOT, structure, dataset)
        self.record["network"] = "open" if open_network else "isolated"  # unlinked pairs: reachable or dropped
        self.record["telemetry"] = conf.to_dict()
        devices = {n.name: n.device for n in topology.nodes.values() if n.device}
        if devices:  # device classes: each node's class, slowdown and effective slowdown
            self.record["devices"] = devices
        self._out: Optional[RunDir] = None
        self.scenario: Optional[ScenarioRunner] = None  # the run's timeline of steps: started with the run
        # recorded traces, replayed bin by bin from the start (links.json's, a scenario's, a live file's)
        self.replay = TraceReplay(self.worker, on_change=self._rates_replayed, progress=progress)
        self.live: RunWatcher = NoWatcher()  # what the dashboard shows: attached by whoever serves it
        self._collecting = False  # set once finish collects: later uploads change nothing
        self._finishing = False  # a finish of the settled run was started (once)
        self._lock = threading.RLock()
        self._storing = 0  # node logs being written now (outside the lock); finish waits for them
        self._stored = threading.Condition(self._lock)
        self._finish_lock = threading.Lock()
        self._monitor: Optional[threading.Thread] = None
        self._health: Optional[threading.Thread] = None  # a pass of /health calls in flight
        self.membership = Membership(nodes, self.confs, self._lock, progress)  # deaths expected and seen, replacements
        self.timeline = RunTimeline(self)  # what happened when: timeline.json, and what the dashboard shows
        self.problems: run_folder.Problems = {}  # what went wrong while the results were written, by node or "run"
        self._pass_s: Optional[float] = None  # the quickest pass of one light call to every node

    @property
    def out(self) -> RunDir:
        """The run folder, opened once (results are written beneath it without following links)."""
        if self._out is None:
            self._out = RunDir(self.run_dir)
        return self._out

    @property
    def telemetry(self) -> Optional[Collector]:
        """The collector pulling the hosts' samplers while the run goes on (None: not sampled)."""
        return self.recording.telemetry

    @telemetry.setter
    def telemetry(self, collector: Optional[Collector]) -> None:
        self.recording.telemetry = collector

    # deploy -----------------------------------------------------------------------------------
    def deploy(self, ready_timeout_s: Optional[float] = None) -> None:
        """Bring up the network, start a node process per participant, wait until all answer
        (by default 30 s plus 1 s per node: hundreds of processes start on a few cores)."""
        self.phase = Phase.DEPLOYING
        try:
            result = deploy.deploy(self.topology, self.worker, self.progress, open_network=self.open_network,
                                   replays=bool(self.scenario and self.scenario.timeline.replays))
            for name, node in self.nodes.items():
                node.ip = result["ips"][name]
                node.shaping_verified = True
            self.out.write_json(run_folder.TOPOLOGY_JSON, run_folder.topology_doc(self.topology, result["ips"]))
            run_folder.copy_inputs(self.out, self.inputs)
            self._write_record()
            self.nodes.controller_url = f"http://{result['bridge_ip']}:{self.controller_port}"
            self.nodes.start_all(self.progress)
            self.nodes.wait_ready(ready_timeout_s or 30 + 1.0 * len(self.nodes))
        except BaseException as e:
            self.phase, self.error = Phase.FAILED, str(e)
            raise
        self.phase = Phase.READY
        self.progress(f"ready: {len(self.nodes)} nodes answer; run id {self.run_id}")

    def sync_code(self) -> None:
        """Hosts other than this one fetch the code and shards from the controller (so it must
        be serving): a step before ``deploy`` when the worker is a cluster."""
        if self.worker.is_local:
            return  # its nodes run this process's code
        try:
            self.worker.sync_code(f"http://{self.worker.status()['bridge_ip']}:{self.controller_port}",
                                  self.node_token, self.progress)
        except BaseException as e:
            self.phase, self.error = Phase.FAILED, str(e)
            raise

    # confs and start ----------------------------------------------------------------------------
    def _require(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise ConfigError(f"the experiment is {self.phase}; this needs it {' or '.join(phases)}")

    def push_dataset_confs(self) -> dict[str, Any]:
        self._require(Phase.READY)
        return self._push("dataset", {name: self.confs.get(name, "dataset") for name in self.nodes})

    def push_structure_confs(self) -> dict[str, Any]:
        self._require(Phase.READY)
        return self._push("structure", self.confs.structures())

    def _push(self, kind: str, confs: dict[str, Any]) -> dict[str, Any]:
        """Every node's ``kind`` conf, to all nodes at once; each marked pushed when it took it."""
        def push(name: str) -> None:
            self.nodes.post(name, f"/conf/{kind}", confs[name])
            setattr(self.nodes[name], f"{kind}_conf", True)

        t = time.monotonic()
        self.nodes.each(push, list(self.nodes))
        self._pass_s = min(self._pass_s or math.inf, time.monotonic() - t)
        return {"pushed": sorted(self.nodes)}

    def start(self) -> dict[str, Any]:
        """Push any conf not pushed yet, then start every node's role."""
        with self._lock:
            if self.phase == Phase.RUNNING:
                return {"phase": self.phase, "run_id": self.run_id}
            self._require(Phase.READY)
            if not all(n.dataset_conf for n in self.nodes.values()):
                self.push_dataset_confs()
            if not all(n.structure_conf for n in self.nodes.values()):
                self.push_structure_confs()
            names = list(self.nodes)  # every role built before any starts: round 1 is not set-up
            t = time.monotonic()
            self.nodes.each(lambda n: self.nodes.post(n, "/prepare", {}), names)
            built_s = time.monotonic() - t
            self.recording.start_captures()
            problem = self.recording.start_telemetry(self.out, self.rates)
            if problem is not None:
                self.record["telemetry"] = problem
            self.t_start = time.time()
            t0 = self.t_start_monotonic = time.monotonic()
            self.recording.run_from(t0)
            self.record["started_at"] = self.t_start
            # every role at one moment: a node started first would otherwise run rounds, alone, and
            # take the CPU the calls starting the others need (1,000 nodes: 45 s instead of 3)
            at = t0 + start_spread_s(self._pass_s if self._pass_s is not None else built_s)

            def start(name: str) -> None:
                self.nodes.post(name, "/start", {"start_in_s": round(max(0.0, at - time.monotonic()), 3)})
                self.nodes[name].state = State.RUNNING

            self.nodes.each(start, names)
            late_s = time.monotonic() - at
            how = (f"roles built in {built_s:.1f} s, all begun together {at - t0:.1f} s after the first start call"
                   + (f", which the last call missed by {late_s:.1f} s" if late_s > 0 else ""))
            self.phase = Phase.RUNNING
            self.replay.add(traced_links(self.topology))
            self.replay.start(t0)
            if self.scenario is not None:
                self.scenario.start(t0)
            self._write_record()
            self._monitor = threading.Thread(target=self.watch, name="edgetb-monitor", daemon=True)
            self._monitor.start()
        self.progress(f"running: {len(self.nodes)} nodes started ({how})")
        return {"phase": self.phase, "run_id": self.run_id}

    # what nodes tell us --------------------------------------------------------------------------
    def on_print(self, name: str, data: Any) -> None:
        """A progress line from node ``name`` (as its signature proved)."""
        if name not in self.nodes or not isinstance(data, dict):
            raise NotFound(f"/print from an unknown node, or not a JSON object: {clip(str(data), 100)}")
        report = read_report(name, data, self.max_round, self.layers.get(name, set()))
        self.nodes[name].take(report)
        decisions = data.get("decisions")
        for d in decisions[:MAX_DECISIONS] if isinstance(decisions, list) else []:
            if isinstance(d, dict):  # (adaptation_events keeps what it can read of it)
                self.timeline.node_event(name, {**d, "type": "policy_decision"})
        if report.round is not None:
            self.rounds.report(name, report.round, report.best_accuracy, report.layer, int(report.bytes_sent or 0))
            self.live.report(name, report.round, report.best_accuracy, report.best_loss, report.layer)
            if self.scenario is not None:
                self.scenario.on_round(name, report.round)
        if self.verbose:
            self.progress(f"{name}: {report.msg}")

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
            self._storing += 1
        try:  # each node's own file, written outside the lock: a thousand uploads do not queue
            self._store_log(name, body)
        finally:
            with self._lock:
                self._storing -= 1
                self._stored.notify_all()
        self.check_all_settled()
        return {"stored": True}

    def _stop_taking_logs(self) -> None:
        """From now on an upload changes nothing; those begun before are written first."""
        with self._lock:
            self._collecting = True
            while self._storing:
                self._stored.wait()

    def _store_log(self, name: str, body: bytes) -> None:
        """The node's events into ``events/<name>.jsonl`` (a copy: the node keeps its own file, so
        not synced to disk one by one); the node settles when they say it ended."""
        self.out.write_bytes(f"events/{name}.jsonl", body, durable=False)
        self.nodes[name].log_received = True
        self.nodes[name].settle_from_events(body)

    def _pull_log(self, name: str) -> None:
        body = self.nodes.fetch_log(name)
        if body is not None:
            self.on_log(name, body)

    # the monitor ---------------------------------------------------------------------------------
    def watch(self) -> None:
        """While the run goes on: take the events of this machine's nodes that ended from their
        own files, mark nodes whose process died as failed, and every ``HEALTH_POLL_S`` ask the
        running ones how they are (pulling the log of one that ended but could not upload it),
        so that neither a lost node nor a lost upload hangs the run. A problem with one node
        marks that node; nothing stops the monitor but the run's end."""
        polled = time.monotonic()
        while self.phase == Phase.RUNNING:
            try:
                for name, body in self.nodes.ended_here(self.problems):
                    self.on_log(name, body)
                due = time.monotonic() - polled >= HEALTH_POLL_S
                self.check_nodes(due)
                if due:
                    polled = time.monotonic()
                self.rounds.tick(self.nodes.state_of_each())
                self.timeline.catch_up()
                self.live.sample()
                self.check_all_settled()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one bad answer
                log.exception("run monitor: an error, carrying on")
            time.sleep(1.0)

    def check_nodes(self, poll_health: bool) -> None:
        """One pass of the monitor: dead processes (an expected death, else a failure); with
        ``poll_health``, the /health of the running nodes not heard from (a /print, their events
        file growing) for ``HEALTH_POLL_S``, asked in a thread of their own, a few at a time: at
        a thousand nodes on two cores the first round alone is longer than that, and those calls
        one after another held up the monitor for a minute."""
        for node, code in self.nodes.exited():
            if node.expected_death:
                self.membership.died(node)
            else:
                node.state, node.detail = State.FAILED, f"process exited (code {code})"
                self.progress(f"{node.name}: failed: {node.detail}")
        if not poll_health or (self._health is not None and self._health.is_alive()):
            return
        quiet_since = time.monotonic() - HEALTH_POLL_S
        quiet = [n.name for n in self.nodes.values() if n.state == State.RUNNING and not n.expected_death
                 and (n.heard_at is None or n.heard_at < quiet_since)]
        if quiet:
            self._health = threading.Thread(target=self.nodes.each, args=(self._ask_health, quiet),
                                            name="edgetb-health", daemon=True)
            self._health.start()

    def _ask_health(self, name: str) -> None:
        """How running node ``name`` is: its log pulled once it says it ended."""
        node = self.nodes[name]
        if node.state != State.RUNNING or self.phase != Phase.RUNNING:
            return
        try:
            health = self.nodes.health(name)
            if health is not None:
                node.heard_at = time.monotonic()
            if health and health.get("state") in (State.DONE, State.FAILED) and self.phase == Phase.RUNNING:
                self._pull_log(name)
        except TestbedError as e:
            node.state, node.detail = State.FAILED, clip(e.message)
            self.progress(f"{node.name}: failed: {node.detail}")

    def waiting_on(self) -> list[str]:
        """The nodes the run still waits for: running, and not about to die."""
        return self.nodes.waiting_on()

    def check_all_settled(self) -> None:
        """Finish the run (``completed``, in a thread) once it waits for no node."""
        with self._lock:
            if self._finishing or self.phase != Phase.RUNNING or self.waiting_on():
                return
            self._finishing = True
        threading.Thread(target=self.finish, args=("completed",), name="edgetb-finish", daemon=True).start()

    # node death and replacement ----------------------------------------------------------------
    def expect_death(self, name: str, why: str) -> None:
        """Node ``name`` is about to be killed or revoked on purpose: once its process is gone
        its ending is ``why`` (``crashed``, ``revoked``...), and the run does not wait for it."""
        node = self.nodes.node(name)
        why = check_why(name, why)
        with self._lock:
            if self.phase != Phase.RUNNING:
                raise ConfigError(f"expect_death({name!r}): the experiment is {self.phase}, not running")
            self.membership.expect(node, why)
        self.check_all_settled()

    def replace_node(self, name: str) -> dict[str, Any]:
        """Start dead node ``name``'s role again (``Membership.replace``) so that it rejoins the
        running experiment. Returns the new life's account."""
        self.nodes.node(name)
        with self._lock:
            if self.phase != Phase.RUNNING or self._finishing:
                raise ConfigError(f"replace_node({name!r}): the experiment is {self.phase}"
                                  f"{' and finishing' if self._finishing else ''}; a node rejoins a running one")
            old_state = self.membership.claim(name)
        try:
            return self.membership.replace(name, old_state)
        except BaseException:
            self.check_all_settled()
            raise

    def lives(self) -> dict[str, Any]:
        """Every node's lives and the membership changes the controller saw (``lives.json``)."""
        return self.membership.lives()

    # finish and reset -----------------------------------------------------------------------------
    def finish(self, how: str = "finished") -> dict[str, Any]:
        """Stop what still runs, collect every log once, write every result from those same
        events. ``how`` the run ended (run_folder.ENDINGS). Safe to call twice."""
        with self._finish_lock:
            if self.summary is not None:
                return self.summary
            self._require(Phase.RUNNING, Phase.READY)
            with self._lock:
                self._finishing = True  # no replacement starts from now on
            if how == "completed" and self.waiting_on():
                how = "finished"
            if self.scenario is not None:
                self._step("stopping the scenario", self.scenario.stop)
            self._step("stopping the trace replay", self.replay.stop)
            if self.phase == Phase.RUNNING:
                self._step("stopping the nodes", lambda: self.nodes.stop_running(how, self._pull_log, self.progress))
            telemetry = self.recording.finish_telemetry()
            if telemetry is not None:
                self.record["telemetry"] = telemetry
            self._stop_taking_logs()
            if self.scenario is not None:
                self._step("scenario.csv", lambda: self.scenario.write(self.out, flows_timeout_s=5.0))
            self._step("trace_ticks.csv", lambda: self.replay.write(self.out))
            self.nodes.collect_logs(self._store_log, self.problems, lambda name, fn: run_folder.attempt(
                self.problems, name, "its events", fn))
            self.nodes.settle_rest(how)
            captured = self._step("captures", lambda: self.recording.collect_captures(self.out), {})
            self.ended = how
            endings = {n.name: n.ending for n in self.nodes.values()}
            run = results.RunResults(
                self.out, self.run_dir, self.workdir, self.run_id, self.algorithm, self.structure, how, endings,
                t_start=self.t_start, dataset_confs=self.confs.datasets(), membership=self.membership.rows,
                uids=self._step("node uids", self.nodes.uids, {}),
                lives=self._step(run_folder.LIVES_JSON, self.lives, {}),
                timeline=self._step(run_folder.TIMELINE_JSON, self.timeline.entries), captured=captured)
            self.summary = results.write_results(run, self.problems, self.progress)
            for row in self.summary.get("nodes", []):
                node = self.nodes.get(row.get("node"))
                if node is not None:
                    node.round = int(row.get("rounds", node.round))
            results.write_record(self.out, self.record, how, self.error, endings, self.problems)
            self.phase = Phase.FINISHED
        self.rounds.tick(self.nodes.state_of_each(), force=True)
        self.progress(f"finished ({how}): results in {self.run_dir}")
        return self.summary

    def _step(self, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        """One step of writing the results: a failure is the run's problem, and the rest goes on."""
        return run_folder.attempt(self.problems, run_folder.RUN, what, fn, default)

    def _write_record(self) -> None:
        self.out.write_json(run_folder.RUN_JSON, self.record)

    # live link changes ----------------------------------------------------------------------------
    def update_tc(self, file: str) -> dict[str, Any]:
        """Re-shape, in place, the links listed in ``file`` (inside the experiment dir); other links keep theirs."""
        path = live_links.links_file(self.workdir, file)
        return self._update_links(lambda declared: load_links(path, declared, nodes_declared=True))

    def update_link(self, src: str, dst: str, bw: str) -> dict[str, Any]:
        """Change the rate of link ``src -> dst`` in place (the dashboard's control); its delay,
        jitter, loss and queue stay."""
        link = self.topology.links.get((src, dst)) if isinstance(src, str) and isinstance(dst, str) else None
        if link is None:
            raise NotFound(f"no link {clip(str(src), 20)}->{clip(str(dst), 20)} in this run")

        def changed(declared: Topology) -> Topology:
            declared.links[(src, dst)] = with_rate(link, bw, "the link change")
            return declared

        return self._update_links(changed)

    def _update_links(self, read: Callable[[Topology], Topology]) -> dict[str, Any]:
        changed = read(live_links.nodes_only(self.topology))
        deploy.check_capabilities(changed, self.worker.capabilities())
        ips = {n.name: n.ip for n in self.nodes.values()}
        ips.update({n["name"]: n["ip"] for n in self.worker.status()["nodes"]})
        self.replay.end(changed.links)  # a constant rate set on a traced link ends its trace
        result = deploy.merge_links(changed, self.worker, ips)
        self.links_reshaped(changed.links.values())
        if self.phase == Phase.RUNNING and changed.traces:  # a live file's traces replay from now
            start_s = self.replay.now_s()
            self.replay.add(TracedLink(s, d, r, start_s) for (s, d), r in changed.traces.items())
        for link in changed.links.values():
            self.timeline.link_changed(link.src, link.dst, link.shape)
        return result

    def links_reshaped(self, links: Iterable[Link]) -> None:
        """``links`` were re-shaped in place just now (the worker confirmed): the topology and
        the run's rates follow (/update/tc, /update/link and a scenario's link steps)."""
        start = self.t_start_monotonic
        t_s = FROM_START if start is None else time.monotonic() - start
        for link in links:
            self.topology.links[(link.src, link.dst)] = link
            self.rates.set((link.src, link.dst), link.shape.rate_bps, t_s)

    def _rates_replayed(self, rates: dict[tuple[str, str], int], t_s: float) -> None:
        """The trace replay changed ``rates`` at ``t_s`` (seconds since the start)."""
        for key, rate in rates.items():
            if key[1].startswith("@"):  # a node's access link
                setattr(self.topology.nodes[key[0]], f"{key[1][1:]}_bps", rate)
                continue
            link = self.topology.links.get(key)
            if link is not None:
                self.topology.links[key] = Link(link.src, link.dst, dataclasses.replace(link.shape, rate_bps=rate))
            self.rates.set(key, rate, t_s)

    def close(self, how: str) -> None:
        """Write the run folder if the run was started and is not written yet (Ctrl-C, a signal)."""
        if self.phase == Phase.RUNNING or (self.phase == Phase.READY and self.t_start is not None):
            try:
                self.finish(how)
            except TestbedError as e:
                self.progress(f"could not write the results: {e.message}")

    def reset(self) -> dict[str, Any]:
        """Write the run folder (a run under way is stopped first), then remove the testbed.
        A reset that fails raises, and the testbed's phase stays as it was."""
        self.close("reset")
        result = self.worker.reset()
        self.phase = Phase.RESET if self.phase != Phase.FAILED else self.phase
        return result

    def status(self) -> dict[str, Any]:
        return {"version": 1, "run_id": self.run_id, "phase": self.phase, "ended": self.ended or None,
                "error": self.error, "algorithm": self.algorithm, "run_dir": self.run_dir,
                "started_at": self.t_start, **self.nodes.status()}
