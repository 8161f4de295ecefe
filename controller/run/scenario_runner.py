"""Plays a resolved scenario (``controller.model.scenario.Timeline``) against a running testbed.

Time steps fire ``at_s`` seconds after the run's ``/start`` (``start(t0)``); round steps once
their node reports the round (``on_round``, fed by the experiment's round events), ``at_s``
after that. Every step is applied through the worker (``set_links`` in place for bandwidth,
``fault`` for drops, signals, the freezer, limits and flows, a merging links update for access links)
and recorded as a row of ``scenario.csv``: planned_s, applied_s (when the worker confirmed
it, seconds since the start), skew_ms, event, target, detail, outcome.

A timed pause or limits change is prepared ``PREPARE_LEAD_S`` ahead (the worker makes the
node's groups and moves its processes in, which can wait for the kernel), so that at its time
only the change itself is applied; a preparation is best effort and is not a row.

A crash or a revocation is announced to the experiment first (``expect_death``) so the run
records the death as the scenario's event, not a failure; a replacement goes through the
experiment's ``replace_node`` in a run, else (no run) the worker starts the node's processes
again.
"""
from __future__ import annotations

import gc
import heapq
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Iterable, Optional, Protocol

from controller.model.scenario import Step, StepKind, Timeline
from controller.model.topology import Link
from controller.results.run_dir import SCENARIO_CSV, SCENARIO_FLOWS_JSON, csv_bytes
from controller.run.trace_replay import TracedLink, TraceReplay, access_key
from controller.workers import deploy
from worker.api.errors import CapabilityError, ConfigError, TestbedError
from worker.api.faults import (Background, BackgroundResult, Drop, Fault, Freeze, IperfServer, Kill, Limits, Prepare,
                               PreparedKind, Restart, Terminate, Thaw, Undrop)
from worker.api.shape import Shape

CSV_FIELDS = ("planned_s", "applied_s", "skew_ms", "event", "target", "detail", "outcome")
FLOW_PORT_BASE = 5301
APPLY_THREADS = 8
PREPARE_LEAD_S = 1.0  # a pause or a limits change is made ready this long before its time
PREPARED_KINDS: dict[StepKind, PreparedKind] = {"pause": "freeze", "limits": "limits"}  # what the worker prepares


class RunHooks(Protocol):
    """What a scenario tells the run it plays in (``controller.run.experiment.Experiment``)."""

    def expect_death(self, name: str, why: str) -> None: ...
    def replace_node(self, name: str) -> Any: ...
    def links_reshaped(self, links: Iterable[Link]) -> None: ...

    @property
    def replay(self) -> TraceReplay: ...


class ScenarioRunner:
    """The timeline of one run; ``ips`` maps every node to its address. Without a run
    (``experiment`` None: ``edgetb scenario`` on a network brought up by ``edgetb up``), a
    replacement starts the node's processes again through the worker."""

    def __init__(self, timeline: Timeline, worker: Any, ips: dict[str, str], progress: Callable[[str], None] = print,
                 experiment: Optional[RunHooks] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeline = timeline
        self.worker = worker
        self.ips = ips
        self.progress = progress
        self.experiment = experiment
        self.clock = clock
        self.rows: list[dict[str, Any]] = []
        self.flows: dict[str, str] = {}  # key -> source node
        self.blocked: dict[str, list[list[str]]] = {}  # the link-down and partition steps in force: key -> groups
        self.paused: set[str] = set()  # the nodes a pause step froze (until their resume)
        self.t0: Optional[float] = None
        self.t0_wall: float = 0.0
        self._heap: list[tuple[float, int, float, Step, bool]] = []  # due, order, planned_s, step, prepare
        self._seq = itertools.count()
        self._rounds = timeline.by_round()
        self._fired: set[tuple[str, int]] = set()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: Optional[threading.Thread] = None
        self._pending = 0
        self._pool = ThreadPoolExecutor(max_workers=APPLY_THREADS, thread_name_prefix="edgetb-scenario-apply")
        self._chains: dict[str, Future] = {}  # the last step handed to the pool, by target
        # a trace step replays on the run's replay (with links.json's traced links), else on its own
        shared = getattr(experiment, "replay", None)
        self.replay: TraceReplay = shared if shared is not None else TraceReplay(worker, clock, progress=progress)
        self._own_replay = shared is None
        self.handlers: dict[StepKind, Callable[[dict[str, Any]], Optional[str]]] = {
            "link": self._link,
            "block": self._block,
            "unblock": self._unblock,
            "loss": self._loss,
            "crash": self._crash,
            "revoke": self._revoke,
            "pause": self._pause,
            "resume": self._resume,
            "limits": self._limits,
            "replace": self._replace,
            "background": self._background,
            "access": self._access,
            "trace": self._trace,
        }
        self._check_capabilities()

    def _check_capabilities(self) -> None:
        """Refuse, before anything starts, what this testbed cannot apply."""
        if any(s.kind == "link" and {"delay_ms", "jitter_ms", "loss_pct"} & set(s.params) for s in self.timeline.steps):
            caps = self.worker.capabilities()
            if not caps.get("netem"):
                raise CapabilityError(f"{self.timeline.source}: a link event sets delay, jitter or loss, which need "
                                      "sch_netem, not in this kernel (a 'loss' event works: iptables statistic)")
        missing = sorted({n for s in self.timeline.steps for n in _nodes_of(s) if n not in self.ips})
        if missing:
            raise ConfigError(f"{self.timeline.source}: nodes not in the running testbed: {', '.join(missing)}")

    # the clock -------------------------------------------------------------------------------
    def start(self, t0: Optional[float] = None) -> None:
        """Start the timeline; ``t0`` is the monotonic time of ``/start`` (default: now)."""
        self.t0 = self.clock() if t0 is None else t0
        self.t0_wall = time.time() - (self.clock() - self.t0)
        with self._cond:
            for step in self.timeline.timed():
                self._push(step, step.at_s)
                if step.kind in PREPARED_KINDS:
                    self._push(step, max(0.0, step.at_s - PREPARE_LEAD_S), prepare=True)
        # what exists now lives through the run: out of the collector's way, a full collection
        # scans only newer objects (it paused a step by 13-21 ms in a 100-node benchmark)
        gc.freeze()
        if self._own_replay:
            self.replay.start(self.t0)
        self._thread = threading.Thread(target=self._loop, name="edgetb-scenario", daemon=True)
        self._thread.start()

    def _push(self, step: Step, planned_s: float, prepare: bool = False) -> None:
        heapq.heappush(self._heap, (self.t0 + planned_s, next(self._seq), planned_s, step, prepare))  # type: ignore[operator]
        self._pending += 1
        self._cond.notify_all()

    def on_round(self, node: str, round_no: int) -> None:
        """Node ``node`` reported round ``round_no``: its round steps (this round or an earlier
        one it skipped) are scheduled from now."""
        if self.t0 is None:
            return
        now_s = self.clock() - self.t0
        with self._cond:
            for (name, r), steps in self._rounds.items():
                if name == node and r <= round_no and (name, r) not in self._fired:
                    self._fired.add((name, r))
                    for step in steps:
                        self._push(step, now_s + step.at_s)

    def _loop(self) -> None:
        """Pop each step when due and hand it to the pool: steps on different targets apply in
        parallel (a slow one delays no other), steps on one target in their order."""
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > self.clock()):
                    wait = self._heap[0][0] - self.clock() if self._heap else None
                    self._cond.wait(timeout=wait)
                if self._stopped:
                    return
                due, _, planned_s, step, prepare = heapq.heappop(self._heap)
            before = self._chains.get(step.target)
            self._chains[step.target] = self._pool.submit(self._apply_after, before, step, planned_s, prepare)

    def _apply_after(self, before: Optional[Future], step: Step, planned_s: float, prepare: bool = False) -> None:
        if before is not None:
            wait_futures([before])
        try:
            if prepare:
                self._prepare(step)
            else:
                self._apply(step, planned_s)
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Wait until every scheduled step is applied (round steps not triggered yet do not count)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=left)
        return not self._pending

    @property
    def last_at_s(self) -> float:
        return max((s.at_s for s in self.timeline.timed()), default=0.0)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._pool.shutdown(wait=True)
        if self._own_replay:
            self.replay.stop()

    # applying ---------------------------------------------------------------------------------
    def _apply(self, step: Step, planned_s: float) -> None:
        try:
            detail = self.apply_step(step)
            outcome = "applied" if detail is None else detail
        except TestbedError as e:
            outcome = f"failed: {e.message}"
        applied_s = self.clock() - self.t0  # type: ignore[operator]
        row = {"planned_s": round(planned_s, 4), "applied_s": round(applied_s, 4),
               "skew_ms": round((applied_s - planned_s) * 1000, 2), "event": step.kind, "target": step.target,
               "detail": step.detail, "outcome": outcome}
        self.rows.append(row)
        self.progress(f"scenario {applied_s:8.3f}s  {step.kind:<10} {step.target:<16} {step.detail}"
                      + ("" if outcome == "applied" else f"  [{outcome}]"))

    def _prepare(self, step: Step) -> None:
        try:
            self._faults(Prepare(step.params["node"], for_=PREPARED_KINDS[step.kind]))
        except TestbedError:
            pass  # the step itself does all of it at its time, only later

    def _faults(self, *faults: Fault) -> dict[str, Any]:
        """One ``POST /faults`` request (``worker.api.faults``): the worker's answer."""
        return self.worker.fault({"version": 1, "faults": [f.to_dict() for f in faults]})

    def apply_step(self, step: Step) -> Optional[str]:
        """Apply one step now; returns None, or a note for the outcome column."""
        apply = self.handlers.get(step.kind)
        if apply is None:
            raise ConfigError(f"unknown step kind {step.kind!r}")
        return apply(step.params)

    # one method per step kind (the table ``_steps``); ``p`` is the step's params ----------------
    def _link(self, p: dict[str, Any]) -> None:
        links = []
        for (src, dst), base in zip(p["pairs"], p["base"]):
            shape = dict(base)
            if p["rate_bps"] is not None:
                shape["rate_bps"] = p["rate_bps"]
                shape.update({k: p[k] for k in ("delay_ms", "jitter_ms", "loss_pct") if k in p})
            links.append({"src": src, "dst": dst, "dst_ip": self.ips[dst], "shape": shape})
        self.replay.end(p["pairs"])  # a constant rate on a link ends the trace on it
        self.worker.set_links({"version": 1, "links": links}, merge=True)
        if self.experiment is not None:  # the run's topology and rates follow
            self.experiment.links_reshaped([Link(link["src"], link["dst"], Shape.from_dict(link["shape"])) for link in links])
        return None

    def _trace(self, p: dict[str, Any]) -> None:
        """The links replay the trace from now, their first rate at once."""
        start_s = self.replay.now_s()
        self.replay.add([TracedLink(src, dst, p["replay"], start_s) for src, dst in p["pairs"]], apply_now=True)

    def _block(self, p: dict[str, Any]) -> None:
        """Each group's nodes drop what the other groups send."""
        faults = []
        for i, group in enumerate(p["groups"]):
            others = [self.ips[n] for j, g in enumerate(p["groups"]) if j != i for n in g]
            faults += [Drop(node, key=p["key"], src_ips=others, percent=100) for node in group]
        self._faults(*faults)
        self.blocked[p["key"]] = p["groups"]

    def _unblock(self, p: dict[str, Any]) -> None:
        self._faults(*(Undrop(node, key=p["key"]) for group in p["groups"] for node in group))
        self.blocked.pop(p["key"], None)

    def _loss(self, p: dict[str, Any]) -> None:
        by_dst: dict[str, list[str]] = {}  # dropped where they arrive: a loss on the wire
        for src, dst in p["flows"]:
            by_dst.setdefault(dst, []).append(self.ips[src])
        self._faults(*(Drop(dst, key=p["key"], src_ips=ips, percent=p["percent"]) for dst, ips in by_dst.items()))

    def _crash(self, p: dict[str, Any]) -> None:
        self._expect_death(p["node"], "crashed by the scenario")
        self._faults(Kill(p["node"]))

    def _revoke(self, p: dict[str, Any]) -> None:
        self._expect_death(p["node"], "revoked by the scenario")
        self._faults(Terminate(p["node"], notice_s=p["notice_s"]))

    def _pause(self, p: dict[str, Any]) -> None:
        self._faults(Freeze(p["node"]))
        self.paused.add(p["node"])

    def _resume(self, p: dict[str, Any]) -> None:
        self._faults(Thaw(p["node"]))
        self.paused.discard(p["node"])

    def _limits(self, p: dict[str, Any]) -> None:
        self._faults(Limits(**p))  # {"node", "cpu"} or {"node", "mem_bytes"}: the other one is kept

    def _replace(self, p: dict[str, Any]) -> Optional[str]:
        if self.experiment is not None:
            self.experiment.replace_node(p["node"])
            return None
        started = self._faults(Restart(p["node"]))
        count = sum(len(r.get("started", [])) for r in started["results"])
        return "applied" if count else "applied: no process to start again"

    def _background(self, p: dict[str, Any]) -> None:
        port = FLOW_PORT_BASE + int(p["key"][1:]) % 1000
        self._faults(IperfServer(p["dst"], key=p["key"], port=port))
        self._faults(Background(p["src"], key=p["key"], dst_ip=self.ips[p["dst"]], port=port, rate_bps=p["rate_bps"],
                                duration_s=p["duration_s"], on_s=p["on_s"], off_s=p["off_s"],
                                protocol=p["protocol"]))
        self.flows[p["key"]] = p["src"]
        return None

    def _access(self, p: dict[str, Any]) -> None:
        """The node's access links in place: a merging links update (see WorkerHost.set_links)."""
        sides = {f"{k}_bps": p[k] for k in ("uplink", "downlink") if k in p}
        self.replay.end(access_key(p["node"], k) for k in ("uplink", "downlink") if k in p)  # ends their traces
        deploy.set_access(self.worker, p["node"], sides)
        return None

    def _expect_death(self, node: str, why: str) -> None:
        if self.experiment is not None:
            self.experiment.expect_death(node, why)

    # results ---------------------------------------------------------------------------------------
    def wait_flows(self, timeout_s: float) -> dict[str, dict[str, Any]]:
        """Each background flow's record (runs, samples) once it ended, or as it is at the timeout."""
        deadline = time.monotonic() + timeout_s
        out: dict[str, dict[str, Any]] = {}
        for key, src in self.flows.items():
            while True:
                res = self._faults(BackgroundResult(src, key=key))["results"][0]
                if res["done"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            out[key] = res
        return out

    def csv_text(self) -> str:
        """``scenario.csv``: the rows in the order they were applied."""
        return csv_bytes(list(CSV_FIELDS), sorted(self.rows, key=lambda r: r["applied_s"])).decode()

    def write(self, out: Any, flows_timeout_s: float = 0.0) -> None:
        """``scenario.csv`` (and ``scenario_flows.json`` when there were flows) into the run folder."""
        out.write_bytes(SCENARIO_CSV, self.csv_text().encode())
        if self.flows:
            try:
                out.write_json(SCENARIO_FLOWS_JSON, self.wait_flows(flows_timeout_s))
            except TestbedError as e:
                self.progress(f"scenario: background flows not recorded: {e.message}")


def _nodes_of(step: Step) -> list[str]:
    p = step.params
    names = [n for g in p.get("groups", []) for n in g] + [n for pair in p.get("pairs", []) for n in pair]
    names += [n for pair in p.get("flows", []) for n in pair]
    names += [p[k] for k in ("node", "src", "dst") if isinstance(p.get(k), str)]
    return names
