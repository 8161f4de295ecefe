"""A Flower run as the controller on :3333 drives it: the curl workflow (``/start``, ``/status``,
``/finish``, ``/emulated/reset``), the dashboard's live view and a scenario's events.

``FlowerSession`` is what ``controller.web.app.create_app`` and ``controller.web.live.LiveFeed``
read of a run (as ``controller.run.experiment.Experiment`` is for the built-in algorithms):
phases ``ready -> running -> finished`` (or ``failed``, ``reset``); ``/start`` starts the
SuperLink and the SuperNodes and submits the app, the run finishes by itself when Flower's run
ends. Rounds are the SuperLink's (the node that reports them); a SuperNode's state is its
processes': running, then crashed (a scenario's crash), failed (it ended by itself) or done.
A scenario's ``at_round`` event fires when Flower begins that round, whichever node it names:
every SuperNode takes part in every round.
"""
from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable, Iterable, Optional

from controller.model.scenario import Timeline
from controller.model.topology import Link
from controller.results.rates import LinkRates
from controller.run.nodes import NodeState
from controller.run.recording import NoWatcher, RunWatcher
from controller.run.timeline import RunTimeline
from worker.api.errors import AuthError, ConfigError, TestbedError

MONITOR_S = 1.0
ACCURACY_KEYS = ("acc", "accuracy")  # a metric name ending in one of these is the dashboard's accuracy
LOSS_KEYS = ("loss",)


class NoNodeKeys:
    """Flower's processes sign nothing to the controller: ``/print`` and ``/log`` are refused."""

    def verify(self, *args: Any) -> str:
        raise AuthError("this is a Flower run: its nodes report through Flower, not /print or /log")


class FlowerNodes(dict):
    """Every node's state, by name (what the live view and /status read)."""

    def metrics_rows(self) -> list[dict[str, Any]]:
        return []  # Flower's metrics are the SuperLink's: metrics.csv of the run folder

    def status(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"nodes": [asdict(n) for n in self.values()],
                "failed": sum(n.state == "failed" for n in self.values())}


class Membership:
    """Deaths seen (rows as ``controller.run.membership``'s: t, node, type, why)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []


def pick(values: dict[str, float], keys: tuple[str, ...]) -> Optional[float]:
    """The first metric whose name ends with one of ``keys`` (an evaluation's first)."""
    names = sorted(values, key=lambda k: (not k.startswith("eval"), k))
    for name in names:
        if name.lower().endswith(keys):
            return values[name]
    return None


class FlowerSession:
    """One Flower run behind the controller's REST API."""

    def __init__(self, flower: Any, timeline: Optional[Timeline] = None) -> None:
        """``flower``: the run's ``controller.flower.flow.FlowerRun``."""
        spec = flower.spec
        s = spec.structure
        self.flower = flower
        self.progress = flower.progress
        self.run_id, self.algorithm = flower.run_id, "flower"
        self.workdir = spec.options.workdir
        self.run_dir = flower.run_dir
        self.topology = spec.topology
        self.structure: dict[str, dict[str, Any]] = {
            s.superlink: {"role": "flwr_superlink"}, **{n: {"role": "flwr_supernode"} for n in s.supernodes}}
        self.rates = LinkRates.of_topology(spec.topology)
        self.nodes = FlowerNodes({n: NodeState(n) for n in self.structure})
        self.membership = Membership()
        self.timeline = RunTimeline(self)
        self.scenario_timeline = timeline
        self.scenario: Any = None  # a ScenarioRunner once deployed (with a scenario)
        self.replay = None  # a scenario's trace steps replay on the scenario's own
        self.phase, self.ended, self.error = "created", "", ""
        self.t_start: Optional[float] = None
        self.t_start_monotonic: Optional[float] = None
        self.node_token = secrets.token_urlsafe(24)
        self.keys = NoNodeKeys()
        self.live: RunWatcher = NoWatcher()
        self.summary: Optional[dict[str, Any]] = None
        self._lock = threading.Lock()
        flower.on_round_start = self._round_started
        flower.on_round = self._round_done
        flower.describe_nodes = self._describe_nodes

    @property
    def telemetry(self) -> Any:
        return self.flower.recording.telemetry

    # deploy and start ------------------------------------------------------------------------------
    def deploy(self) -> None:
        """The nodes and links and every Flower home; the scenario checked against them."""
        self.phase = "deploying"
        try:
            ips = self.flower.deploy()
            for name, node in self.nodes.items():
                node.ip, node.shaping_verified = ips[name], True  # (the deploy read every node's shaping back)
            if self.scenario_timeline is not None:
                from controller.run.scenario_runner import ScenarioRunner

                self.scenario = ScenarioRunner(self.scenario_timeline, self.flower.worker, ips, self.progress,
                                               experiment=self)
        except BaseException as e:
            self.phase, self.error = "failed", str(e)
            raise
        self.phase = "ready"
        self.progress(f"ready: {len(self.nodes)} nodes; run id {self.run_id}")

    def start(self) -> dict[str, Any]:
        """The SuperLink and SuperNodes, the app submitted; the run then goes on by itself."""
        with self._lock:
            if self.phase != "ready":
                raise ConfigError(f"the experiment is {self.phase}; /start needs it ready")
            self.phase = "running"
        try:
            submitted = self.flower.begin()
        except BaseException as e:
            self.error = e.message if isinstance(e, TestbedError) else str(e)
            self.finish("failed")
            raise
        self.t_start, self.t_start_monotonic = self.flower.record["started_at"], self.flower.t0
        for node in self.nodes.values():  # (every Flower process of the node started: SuperLink, SuperNodes)
            node.state, node.started_at, node.up = "running", self.t_start, True
        if self.scenario is not None:
            self.scenario.start(self.flower.t0)
        threading.Thread(target=self._follow, args=(submitted,), name="edgetb-flower", daemon=True).start()
        threading.Thread(target=self._monitor, name="edgetb-flower-monitor", daemon=True).start()
        return {"version": 1, "run_id": self.run_id, "started": list(self.nodes)}

    def _follow(self, submitted: dict[str, Any]) -> None:
        try:
            how, detail = self.flower.follow(submitted, self.flower.spec.options.timeout_s)
        except TestbedError as e:
            how, detail = "failed", e.message
        if how != "finished" and not self.flower.stopping.is_set():  # (else /finish or a reset stopped it)
            self.error = detail
            self.finish(how, detail)

    def _monitor(self) -> None:
        """While the run goes on: each SuperNode's processes watched, the live view sampled."""
        while self.phase == "running":
            try:
                self._check_nodes()
                self.timeline.catch_up()
                self.live.sample()
            except Exception:  # noqa: BLE001 - the monitor outlives one bad answer
                pass
            time.sleep(MONITOR_S)

    def _check_nodes(self) -> None:
        if self.flower.stopping.is_set():
            return  # (the processes are being stopped: not deaths)
        ended = self.flower.ended_ids()  # (one listing for every node: 50 SuperNodes are 150 processes)
        for name, node in self.nodes.items():
            if node.state != "running" or name == self.flower.spec.structure.superlink:
                continue
            for program, record in self.flower.programs_of(name):
                if program.name == "supernode" and record["id"] in ended:
                    self._died(node, f"its {program.name} ended")
                    break

    def _died(self, node: NodeState, detail: str) -> None:
        node.up = False
        if node.expected_death:
            node.state, node.detail = node.expected_death, detail
            self.membership.rows.append({"t": time.time(), "node": node.name, "type": "died",
                                         "why": node.expected_death})
        else:
            node.state, node.detail = "failed", detail
        self.progress(f"{node.name}: {node.state}: {detail}")

    # what Flower reports ---------------------------------------------------------------------------
    def _round_started(self, r: int) -> None:
        if self.scenario is not None:
            for name in self.nodes:
                self.scenario.on_round(name, r)

    def _describe_nodes(self) -> str:
        """``4 SuperNodes running, 1 crashed``: the SuperNodes by state."""
        counts: dict[str, int] = {}
        for name, node in self.nodes.items():
            if name != self.flower.spec.structure.superlink:
                counts[node.state] = counts.get(node.state, 0) + 1
        running = counts.pop("running", 0)
        return ", ".join([f"{running} SuperNodes running", *(f"{n} {state}" for state, n in sorted(counts.items()))])

    def _round_done(self, r: int, values: dict[str, float]) -> None:
        node = self.nodes[self.flower.spec.structure.superlink]
        node.round = node.rounds = r
        node.accuracy, node.loss = pick(values, ACCURACY_KEYS), pick(values, LOSS_KEYS)
        for n in self.nodes.values():
            if n.state == "running":
                n.round = r
        self.live.report(node.name, r, node.accuracy, node.loss, None)

    # a scenario's hooks ----------------------------------------------------------------------------
    def expect_death(self, name: str, why: str) -> None:
        if name not in self.nodes:
            raise ConfigError(f"no node {name!r} in this run")
        self.nodes[name].expected_death = why

    def replace_node(self, name: str) -> dict[str, Any]:
        """A dead SuperNode's processes started again; it registers with the SuperLink anew."""
        node = self.nodes.get(name)
        if node is None or name == self.flower.spec.structure.superlink:
            raise ConfigError(f"replace_node({name!r}): not a SuperNode of this run")
        if self.phase != "running" or node.state == "running":
            raise ConfigError(f"replace_node({name!r}): the run is {self.phase}, the node {node.state}")
        node.lives.append({"started_at": node.started_at, "ended": node.state, "ended_at": time.time()})
        self.flower.restart(name)
        node.state, node.expected_death, node.detail, node.started_at = "running", "", "", time.time()
        node.up = True
        self.membership.rows.append({"t": time.time(), "node": name, "type": "replaced", "why": "replaced"})
        return {"node": name, "lives": len(node.lives) + 1}

    def links_reshaped(self, links: Iterable[Link]) -> None:
        start = self.t_start_monotonic
        t_s = 0.0 if start is None else time.monotonic() - start
        for link in links:
            self.topology.links[(link.src, link.dst)] = link
            self.rates.set((link.src, link.dst), link.shape.rate_bps, t_s)

    # finish and reset ------------------------------------------------------------------------------
    def finish(self, how: str = "finished", detail: str = "") -> dict[str, Any]:
        """Stop every Flower process, write the run folder (once); the summary."""
        with self._lock:
            if self.summary is not None:
                return self.summary
            if self.phase not in ("running", "ready", "failed"):
                raise ConfigError(f"the experiment is {self.phase}; /finish needs it running")
            self.flower.stopping.set()
            if self.scenario is not None:
                self.scenario.stop()
            if self.t_start is not None or how == "failed":
                self._write(how, detail)
            for node in self.nodes.values():
                node.up = False  # (its Flower processes are stopped)
                if node.state == "running":
                    node.state = "done" if how == "completed" else how
            self.ended = how
            self.phase = "finished" if how in ("completed", "finished") else "failed"
            r = self.flower.reader
            self.summary = {"version": 1, "run_id": self.run_id, "ended": how, "detail": detail,
                            "rounds": len(r.rounds), "num_rounds": r.num_rounds, "run_dir": self.run_dir,
                            "metrics": f"{self.run_dir}/metrics.csv"}
        self.timeline.catch_up()
        return self.summary

    def _write(self, how: str, detail: str) -> None:
        from controller.results.run_dir import TIMELINE_JSON

        self.flower.close(how, detail)
        if self.scenario is not None:
            self.scenario.write(self.flower.out, flows_timeout_s=5.0)
        self.flower.out.write_json(TIMELINE_JSON, self.timeline.entries())

    def close(self, how: str) -> None:
        """The run folder written if the run started and is not written yet (Ctrl-C, a signal)."""
        if self.phase == "running":
            try:
                self.finish(how)
            except TestbedError as e:
                self.progress(f"could not write the results: {e.message}")

    def reset(self) -> dict[str, Any]:
        """Write the run folder (a run under way is stopped first), then remove the testbed."""
        self.close("reset")
        result = self.flower.worker.reset()
        self.phase = "reset" if self.phase != "failed" else self.phase
        return result

    # what the REST API also serves -----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        r = self.flower.reader
        return {"version": 1, "run_id": self.run_id, "phase": self.phase, "ended": self.ended or None,
                "error": self.error, "algorithm": self.algorithm, "run_dir": self.run_dir,
                "started_at": self.t_start, "round": max(r.rounds, default=0), "num_rounds": r.num_rounds,
                **self.nodes.status()}

    def push_dataset_confs(self) -> dict[str, Any]:
        return {"version": 1, "note": "a Flower run: each SuperNode's shard path is in its node config"}

    def push_structure_confs(self) -> dict[str, Any]:
        return {"version": 1, "note": "a Flower run: the app's structure is flwr_structure.json"}

    def update_tc(self, file: str) -> dict[str, Any]:
        raise ConfigError("a Flower run changes links through a scenario's link events or POST /api/link")

    def update_link(self, src: str, dst: str, bw: str) -> dict[str, Any]:
        """Link ``src -> dst`` re-shaped in place to rate ``bw`` (the dashboard's control)."""
        from controller.model.topology import with_rate
        from controller.run import live_links
        from controller.workers import deploy

        link = self.topology.links.get((src, dst)) if isinstance(src, str) and isinstance(dst, str) else None
        if link is None:
            raise ConfigError(f"no link {str(src)[:20]}->{str(dst)[:20]} in this run")
        changed = live_links.nodes_only(self.topology)
        changed.links[(src, dst)] = with_rate(link, bw, "the link change")
        result = deploy.merge_links(changed, self.flower.worker, self.flower.ips)
        self.links_reshaped(changed.links.values())
        self.timeline.link_changed(src, dst, changed.links[(src, dst)].shape)
        return result

    def on_print(self, name: str, data: Any) -> None:
        raise AuthError("a Flower run takes no /print")

    def on_log(self, name: str, body: bytes) -> dict[str, Any]:
        raise AuthError("a Flower run takes no /log")


def serve_auto(session: FlowerSession, timeout_s: float, progress: Callable[[str], None]) -> int:
    """``--auto`` under the controller: start, wait for Flower's run to end, the summary; the
    exit code."""
    import gevent

    from worker.serving import run_blocking

    try:
        run_blocking(session.start)
    except TestbedError as e:
        progress(f"error: {e.message}")
        return 1
    deadline = time.monotonic() + timeout_s + 30.0  # (the follower's own deadline comes first)
    while session.phase == "running" and time.monotonic() < deadline:
        gevent.sleep(0.5)
    summary = run_blocking(session.finish, "timeout") if session.summary is None else session.summary
    return 0 if summary["ended"] == "completed" else 1
