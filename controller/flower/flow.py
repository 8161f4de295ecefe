"""What ``flwr_run.py`` does: check the Flower app and its Python, deploy the nodes and links,
start the SuperLink and the SuperNodes as the nodes' own programs, submit the app with Flower's
CLI, follow its run to its end, write the run folder (Flower's per-round metrics in
``metrics.csv``, every Flower process's log, the telemetry) and remove everything. The controller
serves the run on ``--port`` meanwhile (``controller.flower.session``): with ``--auto`` all of it
in one go, else step by step through ``/start``, ``/finish`` and ``/emulated/reset``.

``controller.runner`` takes the experiment directory and the testbed id, handles signals and
removes the testbed as for the other run scripts, and hands the run to ``run``; the Flower processes are ``exec`` programs
(``controller.workers.programs``): same confinement, same records, stopped by ``down``.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

from controller.flower import metrics, plan
from controller.flower.structure import FlowerStructure, load as load_structure, node_pythons
from controller.model.scenario import Timeline
from controller.model.spec import RunOptions
from controller.model.topology import Topology, load_links, load_nodes
from controller.workers import programs
from controller.workers.api import Worker
from worker.api.errors import ConfigError, NotFound, TestbedError, TestbedTimeout

SUPERLINK_READY_S = 120.0  # for the SuperLink to serve; then for every SuperNode to register (plus REGISTER_S each)
REGISTER_S = 5.0  # (each SuperNode loads flwr: about 3 s of CPU, 50 SuperNodes on 2 cores take minutes)
STALL_S = 90.0  # past that wait, it goes on while a SuperNode registered within this time
POLL_S = 0.25
LAST_LINES = 8  # of the run's log, said when it failed
EXIT_CODE_WAIT_S = 2.0  # an ended process whose exit code the worker does not report yet: asked again this long
FLEET_UP = "Starting the SuperLink Fleet HTTP API"
NODE_UP = "Activated node_id"
READ_LOG_PIECES = ("import json, sqlite3, sys\n"  # run in the SuperLink's node, as the node: its database's log pieces
                   "db = sqlite3.connect(sys.argv[1])\n"
                   "for t, text in db.execute('SELECT timestamp, log FROM task_logs ORDER BY timestamp'):\n"
                   "    print(json.dumps([t, text]))\n")
MAKE_HOME = ("import os, sys\n"  # run in the node, as the node: its Flower home, and the CLI config
             "os.makedirs(sys.argv[1], mode=0o700, exist_ok=True)\n"
             "if len(sys.argv) > 2:\n"
             "    open(os.path.join(sys.argv[1], 'config.toml'), 'w').write(sys.argv[2])\n")


@dataclass
class FlowerSpec:
    """A Flower run checked and resolved before anything is made."""

    options: RunOptions
    topology: Topology
    structure: FlowerStructure
    shards: dict[str, str]  # SuperNode -> its shard's absolute path (a dataset given)
    timeline: Optional[Timeline] = None  # a scenario's, resolved
    dataset: Optional[dict[str, Any]] = None  # the dataset settings (``controller.confs.confs.load_dataset``)


def prepare(options: RunOptions) -> FlowerSpec:
    """Every file checked, the shards written; nothing made on the network."""
    o, path = options, options.path
    if o.hosts or o.runtime != "netns":
        raise ConfigError("flwr_run.py runs Flower on network-namespace nodes of this host; --hosts and "
                          "--runtime docker are not supported for Flower runs yet")
    topology = o.topology
    if topology is None:
        from controller.calibration import host_kernel_s

        declared = load_nodes(path(o.nodes), host_kernel_s) if o.nodes else None
        topology = load_links(path(o.links), declared, nodes_declared=declared is not None)
    structure = load_structure(path(o.structure), topology, o.workdir)
    node_pythons(structure, topology)
    from controller.flower.probe import check_loads

    check_loads(structure.app, structure.python)  # a broken app is refused here, before any node is made
    shards: dict[str, str] = {}
    settings = None
    if o.dataset:
        from controller.confs.confs import dataset_confs, load_dataset

        settings = load_dataset(path(o.dataset))
        confs = dataset_confs(settings, list(structure.supernodes), o.workdir)
        shards = {n: os.path.join(o.workdir, c["shard"]) for n, c in confs.items()}
    timeline = None
    if o.scenario:
        from controller.model.scenario import load_scenario

        timeline = load_scenario(path(o.scenario), topology)
    return FlowerSpec(options, topology, structure, shards, timeline, settings)


def check(options: RunOptions) -> str:
    """``--check``: ``prepare`` only; what was checked."""
    spec = prepare(options)
    return (f"app {spec.structure.app_name}, SuperLink {spec.structure.superlink}, "
            f"{len(spec.structure.supernodes)} SuperNodes, {len(spec.topology.links)} links")


def run(options: RunOptions, run_id: str, found: Any, owned: Any, remove_stale: Callable[[Worker], None],
        progress: Callable[[str], None], serve: Callable[[Any, Worker], Any]) -> int:
    """The Flower run once ``controller.runner`` holds the experiment directory and the testbed id
    (``found``: what held it before; ``owned``: what this process made, which the runner removes
    at the end, whatever happens; ``remove_stale``: what a dead holder left, removed; ``serve``:
    the controller's servers of the run (started; None when they cannot listen, said already))."""
    from controller.workers.connect import connect
    from controller.workers.deploy import refusal
    from worker.host import REPO_ROOT

    try:
        spec = prepare(options)
        worker = connect(options.testbed_id, options.subnet, runtime=options.runtime, workdir=options.workdir,
                         code_root=REPO_ROOT)
        refused = refusal(spec.topology, worker)
        if refused is not None:
            print(f"error: {refused[1]}", file=sys.stderr)
            return refused[0]
        if found.state == "stale":
            remove_stale(worker)
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    from controller.flower.session import FlowerSession, serve_auto

    flower = FlowerRun(spec, worker, run_id, progress)
    session = FlowerSession(flower, spec.timeline)
    owned.created(worker)
    server = serve(session, worker)  # the controller on --port: the REST API and the dashboard
    if server is None:
        return 2
    if hasattr(session.live, "models"):  # the dashboard names the app, not a built-in model
        session.live.models = [f"{spec.structure.app_name} · flower"]
    try:
        session.deploy()
        progress(f"dashboard: http://localhost:{options.port}/ (live while the run goes on; stored runs too)")
        if spec.timeline is not None:
            progress(f"scenario {options.scenario}: {len(spec.timeline.steps)} steps, applied from /start")
        if options.auto:
            import gevent

            runner = gevent.spawn(serve_auto, session, options.timeout_s, progress)
            runner.link(lambda g: server.stop(timeout=1))
            server.serve_forever()
            return runner.value if runner.dead and runner.value is not None else 1
        progress(f"controller on :{options.port}, testbed {options.testbed_id}, run {run_id}. Next: "
                 f"curl localhost:{options.port}/start ; curl localhost:{options.port}/status ; "
                 f"curl localhost:{options.port}/finish ; curl localhost:{options.port}/emulated/reset")
        server.serve_forever()
        return 0 if session.ended in ("", "completed", "finished", "reset") else 1
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        if session.summary is None and session.phase in ("running", "failed"):
            try:
                session.finish("failed", e.message)
            except TestbedError as again:
                progress(f"could not write the results: {again.message}")
        return 1
    except KeyboardInterrupt:
        session.close("interrupted")
        raise


class FlowerRun:
    """One Flower run on deployed nodes: its programs, its log, its run folder
    (``controller.flower.session.FlowerSession`` drives it: deploy, begin, follow, close)."""

    def __init__(self, spec: FlowerSpec, worker: Worker, run_id: str, progress: Callable[[str], None]) -> None:
        from controller.model.telemetry_conf import TelemetryConf
        from controller.results.run_dir import RunDir, describe
        from controller.run.recording import Recording
        from worker.host import REPO_ROOT

        self.spec, self.worker, self.run_id, self.progress = spec, worker, run_id, progress
        o = spec.options
        self.run_dir = os.path.join(o.workdir, "dml_file", "log", run_id)
        self.out = RunDir(self.run_dir)
        s = spec.structure
        self.record = describe(run_id, "flower", o.testbed_id, REPO_ROOT, {}, spec.dataset)
        self.record["flower"] = {"app": os.path.relpath(s.app, o.workdir), "app_name": s.app_name,
                                 "superlink": s.superlink, "supernodes": list(s.supernodes), "python": s.python,
                                 "flwr": flwr_version(s.python), "run_config": s.run_config}
        conf = TelemetryConf(period_ms=o.telemetry_period_ms or TelemetryConf().period_ms, enabled=o.telemetry)
        self.recording = Recording(worker, conf, [], progress)
        self.started: list[tuple[plan.Program, dict[str, Any]]] = []
        self.reader = metrics.RoundReader()
        self.t0 = 0.0
        self.closed = False
        self.ips: dict[str, str] = {}
        self.stopping = threading.Event()  # set: follow returns (a /finish, a reset)
        self.on_round_start: Callable[[int], None] = lambda r: None  # Flower began round r
        self.on_round: Callable[[int, dict[str, float]], None] = lambda r, values: None  # its metrics, once read
        self.describe_nodes: Callable[[], str] = lambda: ""  # the SuperNodes' states, for the progress line
        self._reported: set[int] = set()

    def deploy(self) -> dict[str, str]:
        """The nodes and links, the run folder's inputs, every Flower home; the nodes' addresses."""
        from controller.results.run_dir import TOPOLOGY_JSON, copy_inputs, topology_doc
        from controller.workers import deploy

        o, s = self.spec.options, self.spec.structure
        result = deploy.deploy(self.spec.topology, self.worker, self.progress, open_network=o.open_network,
                               replays=bool(self.spec.timeline and self.spec.timeline.replays))
        self.ips = result["ips"]
        self.record["flower"]["uids"] = node_uids(self.worker, [s.superlink, *s.supernodes])
        self.out.write_json(TOPOLOGY_JSON, topology_doc(self.spec.topology, self.ips))
        copy_inputs(self.out, {r: p for r, p in o.inputs.items() if r in ("links", "nodes", "structure", "dataset")})
        self._make_homes(self.ips[s.superlink])
        return self.ips

    def begin(self) -> dict[str, Any]:
        """The telemetry, the SuperLink and SuperNodes (until every SuperNode registered), then
        the app submitted: the record of ``flwr run``."""
        from controller.results.rates import LinkRates

        o, s = self.spec.options, self.spec.structure
        weight = plan.superlink_cpu_weight()  # (a bad setting said before anything starts)
        problem = self.recording.start_telemetry(self.out, LinkRates.of_topology(self.spec.topology))
        if problem is not None:
            self.record["telemetry"] = problem
        self.record["started_at"] = time.time()
        self.t0 = time.monotonic()
        self.recording.run_from(self.t0)
        superlink, *rest = plan.servers(s, o.workdir, self.run_id, self.ips, self.spec.shards, weight)
        self._start(superlink)  # serving first: SuperNodes that find no SuperLink wait ever longer to try again
        self._wait_for_superlink(0, SUPERLINK_READY_S)
        for program in rest:  # the SuperNodes register first: their SuperExecs would share the CPU meanwhile
            if program.name == "supernode":
                self._start(program)
        self._wait_for_superlink(len(s.supernodes), SUPERLINK_READY_S + REGISTER_S * len(s.supernodes))
        for program in rest:
            if program.name != "supernode":
                self._start(program)
        self.progress(f"Flower: SuperLink in {s.superlink} ({self.ips[s.superlink]}:{plan.SUPERLINK_PORT}), "
                      f"{len(s.supernodes)} SuperNodes registered; submitting {s.app_name}")
        return self._start(plan.submit(s, o.workdir, self.run_id))

    def programs_of(self, node: str) -> list[tuple[plan.Program, dict[str, Any]]]:
        """The Flower processes started in ``node``."""
        return [(p, r) for p, r in self.started if p.node == node]

    def restart(self, node: str) -> None:
        """A SuperNode's processes started again (a replacement of a crashed SuperNode)."""
        o = self.spec.options
        for program in plan.servers(self.spec.structure, o.workdir, self.run_id, self.ips, self.spec.shards):
            if program.node == node:
                self._start(program)

    # programs ------------------------------------------------------------------------------------
    def _make_homes(self, superlink_ip: str) -> None:
        """Every Flower home, made by its node; the SuperLink's with the CLI config."""
        s, workdir = self.spec.structure, self.spec.options.workdir
        for node in (s.superlink, *s.supernodes):
            argv = ["python3", "-c", MAKE_HOME, plan.flwr_home(workdir, node, self.run_id)]
            if node == s.superlink:
                argv.append(plan.cli_config(superlink_ip))
            done = programs.run(self.worker, node, argv, timeout_s=30.0)
            if done["returncode"] != 0:
                raise TestbedError(f"node {node}: could not make its Flower home: {done['stderr'][-300:]}")

    def _start(self, program: plan.Program) -> dict[str, Any]:
        if self.worker.is_local and program.env.get("EDGETB_FORK"):  # (plan.FORKED_ENV)
            # by this process's worker, not a supervisor of its own: one Flower fork server for the
            # run's programs (a supervisor's worker would start one for each)
            from worker.api.protocol import API_VERSION

            record = self.worker.start_process(program.node, {"version": API_VERSION, "argv": list(program.argv),
                                                              "env": dict(program.env)})
        else:
            record = programs.start(self.worker, program.node, list(program.argv), program.env)
        self.started.append((program, record))
        return record

    def _log_of(self, record: dict[str, Any], reader: Optional[programs.LogReader] = None) -> str:
        """What the process wrote (from ``reader``'s offset, which it moves on), read from its node
        directly (no listing of every process, which also saves the records, for each read)."""
        reader = reader or programs.LogReader()
        pieces = []
        while True:
            piece = self.worker.process_log(record["node"], record["id"], reader.offset)
            if not piece["data_b64"]:
                return "".join(pieces) + ("" if piece.get("running") else reader.end())
            pieces.append(reader.feed(piece))

    def _ended(self, record: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The process's record once it has ended (None while it runs)."""
        current = programs.find(self.worker, record["id"])
        return None if current.get("running", current.get("state") == "running") else current

    def _exit_code(self, record: dict[str, Any], ended: dict[str, Any]) -> Optional[int]:
        """The exit code of an ended process, read again for up to ``EXIT_CODE_WAIT_S`` while
        the worker does not know it yet (None: never known)."""
        deadline = time.monotonic() + EXIT_CODE_WAIT_S
        while ended.get("returncode") is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            try:
                ended = programs.find(self.worker, record["id"])
            except NotFound:
                break
        return ended.get("returncode")

    def ended_ids(self) -> set[str]:
        """The ids of the started processes that run no more (ended, or stopped and forgotten),
        from one listing of the worker's processes however many were started."""
        running = {rec["id"] for rec in programs.processes(self.worker)
                   if rec.get("running", rec.get("state") == "running")}
        return {record["id"] for _, record in self.started} - running

    def _wait_for_superlink(self, supernodes: int, wait_s: float) -> None:
        """Until the SuperLink serves and ``supernodes`` SuperNodes registered (TestbedError: a
        Flower process ended, or the wait took over ``wait_s`` and no SuperNode registered in the
        last ``STALL_S``, with its last lines)."""
        superlink = self.started[0][1]
        t0 = time.monotonic()
        deadline = t0 + wait_s
        reader, text, seen = programs.LogReader(), "", 0
        while True:
            text += self._log_of(superlink, reader)
            if FLEET_UP in text and text.count(NODE_UP) >= supernodes:
                return
            if text.count(NODE_UP) > seen:  # (on a loaded host, registrations still coming extend the wait)
                seen = text.count(NODE_UP)
                deadline = max(deadline, time.monotonic() + STALL_S)
            ended = self.ended_ids()
            for program, record in self.started:
                if record["id"] in ended:
                    raise TestbedError(f"the Flower {program.name} in {program.node} ended before the run started; "
                                       f"its last lines:\n{tail(self._log_of(record))}")
            if time.monotonic() > deadline:
                raise TestbedTimeout(f"the SuperLink in {self.spec.structure.superlink} saw {text.count(NODE_UP)} of {supernodes} "
                                     f"SuperNodes within {time.monotonic() - t0:.0f} s; its last lines:\n{tail(text)}")
            time.sleep(POLL_S)

    def follow(self, submitted: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        """Flower's run log read as it comes, rounds reported, until ``flwr run`` ends; how the
        run ended and why."""
        reader = programs.LogReader()
        deadline = time.monotonic() + timeout_s
        pending = ""
        last: collections.deque[str] = collections.deque(maxlen=LAST_LINES)  # (said when the run failed)
        while True:
            text = "".join(programs.follow(self.worker, submitted["id"], keep_following=False, reader=reader))
            lines = (pending + text).split("\n")
            pending = lines.pop()
            last.extend(line for line in lines if line.strip())
            for line in lines:
                before = self.reader.round
                self.reader.feed(line, time.monotonic() - self.t0)
                if self.reader.round != before:
                    if before is not None and before in self.reader.rounds:
                        self._report(before)  # a round is reported once the next begins (or the run ends)
                    self.on_round_start(self.reader.round)  # type: ignore[arg-type]
            ended = self._ended(submitted)
            if ended is not None and not text:
                if pending:
                    self.reader.feed(pending, time.monotonic() - self.t0)
                self._report_last()
                code = self._exit_code(submitted, ended)
                done, planned = len(self.reader.rounds), self.reader.num_rounds
                all_rounds = done and (planned is None or max(self.reader.rounds) >= planned)
                if code is None and all_rounds and self.reader.finished:  # (its exit code lost: Flower's log)
                    self.progress(f"'flwr run' ended with no exit code known after all {done} rounds and the "
                                  "strategy's summary: judged by its log")
                    code = 0
                if code == 0 and all_rounds:
                    if self.reader.nothing_trained():
                        return "failed", ("every ClientApp failed in every round (Flower's log: 'Received 0 "
                                          "results'): the SuperNodes' logs in the run folder's flower/ say why")
                    return "completed", ""
                # (flwr 1.42's 'flwr run --stream' also ends with 0 when the SuperLink ends the run early)
                said = tail("\n".join([*last, pending]), LAST_LINES)
                return "failed", (f"'flwr run' ended with code {code} after {done} of {planned or '?'} rounds; "
                                  f"its last lines (all of them: flower/{self.started[0][0].node}-run.log "
                                  f"in the run folder):\n{said}")
            for program, record in self.started[:1]:
                if self._ended(record) is not None:
                    return "failed", f"the SuperLink in {program.node} ended during the run"
            if self.stopping.is_set():
                return "finished", "stopped before Flower's run ended"
            if time.monotonic() > deadline:
                self.progress(f"the Flower run did not end within {timeout_s:g} s: stopping it")
                return "timeout", f"not ended within {timeout_s:g} s"
            time.sleep(POLL_S)

    def _keep_and_stop(self, started: tuple[plan.Program, dict[str, Any]], ended: set[str]) -> None:
        """A Flower process's log into the run folder, then the process stopped unless it is in
        ``ended`` (a stopped process's record and log are gone)."""
        program, record = started
        reader, text = programs.LogReader(), ""
        try:
            text = self._log_of(record, reader)
        except TestbedError as e:
            self.progress(f"the log of the Flower {program.name} in {program.node} is lost: {e.message}")
        try:
            if record["id"] not in ended:  # (straight to its node: no listing of every process first)
                answer = self.worker.stop_process(record["node"], record["id"], log_offset=reader.offset)
                if answer.get("log"):  # what it wrote as it stopped
                    text += reader.feed(answer["log"]) + reader.end()
        except TestbedError as e:
            self.progress(f"could not stop the Flower {program.name} in {program.node}: {e.message}")
        self.out.write_bytes(f"flower/{program.node}-{program.name}.log", text.encode())

    def _report_last(self) -> None:
        if self.reader.round in self.reader.rounds and self.reader.round not in self._reported:
            self._report(self.reader.round)

    def _report(self, r: int) -> None:
        self._reported.add(r)
        values = {k: v for section in self.reader.rounds[r].values() for k, v in section.items()}
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(values.items()))
        failed = self.reader.failed(r)
        shown += f" · {failed} ClientApp replies failed" if failed else ""
        nodes = self.describe_nodes()
        self.progress(f"Flower round {r}/{self.reader.num_rounds or '?'}{' · ' + nodes if nodes else ''}"
                      f"{' · ' + moved(self.recording.telemetry) if self.recording.telemetry else ''}: {shown}")
        self.on_round(r, values)

    # the run folder ------------------------------------------------------------------------------
    def close(self, how: str, detail: str) -> None:
        """Stop every Flower process, write the run folder (once)."""
        if self.closed:
            return
        self.closed = True
        from controller.results.run_dir import METRICS_CSV, RUN_JSON, csv_bytes

        self._report_last()
        t = time.monotonic()
        ended = self.ended_ids()
        with ThreadPoolExecutor(max_workers=len(self.started) or 1) as pool:  # each stop may wait its grace period
            list(pool.map(lambda p: self._keep_and_stop(p, ended), self.started))
        self.progress(f"stopped {len(self.started)} Flower processes in {time.monotonic() - t:.1f} s")
        telemetry = self.recording.finish_telemetry()
        if telemetry is not None:
            self.record["telemetry"] = telemetry
        self._flower_times()
        columns, rows = metrics.rows(self.reader, self.run_id, self.spec.structure.superlink)
        self.out.write_bytes(METRICS_CSV, csv_bytes(columns, rows))
        self.record.update(ended=how, ended_at=time.time(), detail=detail,
                           rounds=len(self.reader.rounds), num_rounds=self.reader.num_rounds)
        self.out.write_json(RUN_JSON, self.record)
        self.progress(f"finished ({how}{': ' + detail if detail else ''}): {len(rows)} rounds in "
                      f"{os.path.join(self.run_dir, METRICS_CSV)}")


    def _flower_times(self) -> None:
        """The rounds' times from the SuperLink's own records (its database's log pieces, read in
        its node, as the node); the times the log was read here when they cannot be had."""
        s, o = self.spec.structure, self.spec.options
        if not self.reader.rounds or not self.record.get("started_at"):
            return
        database = plan.database(s, o.workdir, self.run_id)
        if database is None:  # (its state was in memory)
            self.record["flower"]["time_s"] = "the log as read by edgetb"
            return
        try:
            done = programs.run(self.worker, s.superlink, ["python3", "-c", READ_LOG_PIECES, database], timeout_s=30.0)
            pieces = [(float(t), str(text)) for t, text in map(json.loads, done["stdout"].splitlines())] \
                if done["returncode"] == 0 else []
        except (TestbedError, ValueError, TypeError) as e:
            self.progress(f"Flower's round times not read from its database ({e}); the times the log was read instead")
            return
        times = metrics.times_from_pieces(pieces, self.record["started_at"])
        if set(times) >= set(self.reader.rounds):
            self.reader.times = {r: times[r] for r in self.reader.rounds}
            self.record["flower"]["time_s"] = "the SuperLink's stored log pieces"
        else:
            self.record["flower"]["time_s"] = "the log as read by edgetb"


def moved(telemetry: Any) -> str:
    """The bytes every link carried so far, as the telemetry last read them: ``12.3 MB moved``."""
    total = sum((v.get("tx_bytes") or 0) for v in dict(telemetry.latest_links).values())
    return f"{total / 1e6:.1f} MB moved"


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(metrics.ANSI.sub("", text).rstrip("\n").split("\n")[-lines:])


def flwr_version(python: str) -> Optional[str]:
    """The flwr version installed in the environment ``python`` (None: not found)."""
    import glob

    found = sorted(glob.glob(os.path.join(python, "lib", "python3*", "site-packages", "flwr-*.dist-info")))
    return os.path.basename(found[-1])[len("flwr-"):-len(".dist-info")] if found else None


def node_uids(worker: Worker, names: list[str]) -> dict[str, int]:
    """The nodes' uids on this host (those known here)."""
    uids = {}
    for name in names:
        try:
            uids[name] = int(worker.runtime.identity(name).uid)  # type: ignore[attr-defined]  (a WorkerHost)
        except (AttributeError, TestbedError):
            pass
    return uids
