"""The parts of a run's state machine: phases and node states, the node client's probe, a
node's reports and events, membership, the results pipeline, the live view's narrow source."""
from __future__ import annotations

import json
import os
import math
import socket
import threading
from types import SimpleNamespace

import pytest

from controller.model.topology import Topology
from controller.results.finish import Analysis, RunResults, write_record, write_results
from controller.results.rates import LinkRates
from controller.results.run_dir import RunDir
from controller.run.experiment import Phase
from controller.run.membership import Membership, check_why
from controller.run.nodes import NodeConfs, Nodes, NodeState, State, ended_by, listening
from controller.run.progress import read_report
from controller.run.timeline import RunTimeline
from controller.web.live import LiveFeed
from worker.api.errors import ConfigError, NotFound
from worker.api.shape import Shape


class _Worker:
    def __init__(self) -> None:
        self.procs: dict[str, dict] = {}

    def processes(self) -> dict:
        return {"processes": list(self.procs.values())}


def _nodes(tmp_path, worker=None) -> Nodes:
    return Nodes(str(tmp_path), worker, {"n1": {"sync": 3}, "n2": {"sync": 2}}, run_id="r1")


def test_phases_and_states_are_the_strings_of_the_http_answers_and_files():
    assert json.dumps({"phase": Phase.RUNNING, "state": State.DONE}) == '{"phase": "running", "state": "done"}'
    assert f"{Phase.FINISHED} {State.LOST}" == "finished lost" and Phase.READY == "ready"
    assert [p.value for p in Phase] == ["created", "deploying", "ready", "running", "finished", "failed", "reset"]
    node = NodeState("n1", state=State.FAILED, detail="boom")
    assert node.settled and node.ending == "failed: boom"
    assert not NodeState("n2", state=State.RUNNING).settled and NodeState("n3", state="crashed").settled


def test_nodes_are_a_mapping_with_their_counts(tmp_path):
    worker = _Worker()
    nodes = _nodes(tmp_path, worker)
    assert list(nodes) == ["n1", "n2"] and len(nodes) == 2 and nodes["n2"].rounds == 2 and "n1" in nodes
    with pytest.raises(NotFound, match="no node 'n9' in this run"):
        nodes.node("n9")
    nodes["n1"].state, nodes["n1"].process_id = State.RUNNING, "p1"
    nodes["n2"].state, nodes["n2"].detail = State.FAILED, "why"
    worker.procs["p1"] = {"id": "p1", "running": False, "returncode": 3}
    assert nodes.exited() == [(nodes["n1"], 3)]
    assert nodes.waiting_on() == ["n1"] and nodes.unfinished() == ["n2"]
    status = nodes.status()
    assert (status["done"], status["failed"], status["settled"]) == (0, 1, 1)
    assert status["nodes"][1]["ending"] == "failed: why" and status["nodes"][0]["ending"] is None
    assert nodes.metrics_rows()[0] == {"name": "n1", "round": 0, "accuracy": None, "loss": None, "bytes_sent": 0}


def test_the_probe_finds_the_listening_ports_only():
    server = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        found = listening([("up", "127.0.0.1", server.getsockname()[1]), ("down", "127.0.0.1", closed_port)])
    finally:
        server.close()
    assert found == {"up"}


def test_a_report_is_checked_and_its_numbers_finite():
    report = read_report("n1", {"round": 2, "accuracy": 0.5, "global_accuracy": math.nan, "loss": 1,
                                "bytes_sent": 10, "msg": "ok\x1b[2J"}, 3, set())
    assert report.best_accuracy == 0.5 and report.global_accuracy is None and report.msg == "ok"
    node = NodeState("n1")
    node.take(report)
    node.take(report)
    assert (node.round, node.accuracy, node.loss, node.bytes_sent) == (2, 0.5, 1.0, 20)
    with pytest.raises(ConfigError, match="round 4 is not one of this run's"):
        read_report("n1", {"round": 4}, 3, set())
    with pytest.raises(ConfigError, match="layer 2 is not one of the node's"):
        read_report("n1", {"round": 1, "layer": 2}, 3, {1})


def test_a_nodes_events_settle_it():
    node = NodeState("n1", state=State.RUNNING)
    node.settle_from_events(b'not json\n{"type":"failed","detail":"oom"}\n')
    assert node.state == State.FAILED and node.detail == "oom"
    stopped = NodeState("n2", state=State.RUNNING, stopped_by=State.STOPPED)
    stopped.settle_from_events(b'{"type":"done"}\n')
    assert stopped.state == "stopped" and stopped.ending == "stopped"


def test_a_file_being_written_says_its_node_ended_by_a_complete_done_or_failed_line():
    assert ended_by(b'{"type":"round"}\n{"type":"done","rounds":3}\n{"type":"send_failed"}\n') == "done"
    assert ended_by(b'{"type":"round"}\n{"type":"done"') is None  # half written
    assert ended_by(b'{"type":"failed", "detail": "x"}\n\n') == "failed"
    assert ended_by(b'{"type":"round","x":{"type":"done"}}\n') is None  # not the event's own type
    assert ended_by(b'{"type":"done"\n{"type":"round"}\n') is None  # a broken line
    assert ended_by(b"") is None and ended_by(b"[1]\n") is None


def test_the_controller_reads_the_events_of_its_own_machines_nodes_once_they_end(tmp_path):
    """A local node's events come from its file when they end in done or failed; a file is read
    again only when it grew; a link in the node's place is refused and is the node's problem."""
    worker = SimpleNamespace(is_local=True)
    nodes = Nodes(str(tmp_path), worker, {"n1": {"sync": 3}, "n2": {"sync": 2}, "n3": {"sync": 1}}, run_id="r1")
    for n in nodes.values():
        n.state = State.RUNNING
    for name in ("n1", "n2", "n3"):
        (tmp_path / "dml_file" / "node" / name).mkdir(parents=True)
    f1 = tmp_path / "dml_file" / "node" / "n1" / "r1.jsonl"
    f1.write_bytes(b'{"type":"round","round":1}\n')
    (tmp_path / "dml_file" / "node" / "n2" / "r1.jsonl").write_bytes(b'{"type":"failed","detail":"x"}\n')
    (tmp_path / "outside.jsonl").write_bytes(b'{"type":"done"}\n')
    (tmp_path / "dml_file" / "node" / "n3" / "r1.jsonl").symlink_to(tmp_path / "outside.jsonl")
    problems: dict = {}
    assert nodes.ended_here(problems) == [("n2", b'{"type":"failed","detail":"x"}\n')]
    assert "symbolic link" in problems["n3"][0]
    f1.write_bytes(f1.read_bytes() + b'{"type":"done","rounds":3}\n')
    assert [name for name, _ in nodes.ended_here(problems)] == ["n1"]  # n2 did not grow since
    assert nodes.ended_here(problems) == []
    (tmp_path / "outside-longer.jsonl").write_bytes(b'{"type":"done"}\n')
    os.unlink(tmp_path / "dml_file" / "node" / "n3" / "r1.jsonl")  # another link: read again, refused again
    (tmp_path / "dml_file" / "node" / "n3" / "r1.jsonl").symlink_to(tmp_path / "outside-longer.jsonl")
    assert nodes.ended_here(problems) == [] and len(problems["n3"]) == 1  # said once
    assert len(problems["n3"]) == 1
    remote = Nodes(str(tmp_path), SimpleNamespace(is_local=False), {"n1": {"sync": 3}}, run_id="r1")
    remote["n1"].state = State.RUNNING
    assert remote.ended_here({}) == [] and not remote.reads_local_logs


def test_membership_records_deaths_and_lives(tmp_path):
    nodes = _nodes(tmp_path)
    lines: list[str] = []
    members = Membership(nodes, NodeConfs(nodes, Topology()), threading.RLock(), lines.append)
    assert check_why("n1", " revoked   by the scenario ") == "revoked by the scenario"
    with pytest.raises(ConfigError, match="a few words"):
        check_why("n1", "done")
    node = nodes["n1"]
    node.state = State.RUNNING
    members.expect(node, "crashed")
    members.died(node)
    assert node.state == "crashed" and lines == ["n1: crashed (expected); the run goes on without it"]
    assert members.claim("n1") == "crashed" and node.state == State.PENDING
    with pytest.raises(ConfigError, match="being started already"):
        members.claim("n1")
    lives = members.lives()
    assert [e["type"] for e in lives["events"]] == ["death_expected", "node_died"]
    assert lives["nodes"]["n2"] == [{"pid": 0, "started_at": None, "ended": None}]


def test_the_results_pipeline_writes_its_files_from_explicit_inputs(tmp_path):
    run_dir = tmp_path / "dml_file" / "log" / "r1"
    out = RunDir(str(run_dir))
    (run_dir / "events").mkdir()
    (run_dir / "events" / "n1.jsonl").write_text(
        '{"v":1,"type":"round","node":"n1","run_id":"r1","t":1.0,"round":1,"accuracy":0.5}\n'
        '{"v":1,"type":"done","node":"n1","run_id":"r1","t":2.0}\n')
    problems: dict = {}
    run = RunResults(out, str(run_dir), str(tmp_path), "r1", "gossip", {"n1": {"sync": 1}}, "completed",
                     {"n1": "done"}, t_start=0.0, lives={"version": 1, "events": [], "nodes": {}},
                     timeline=[{"seq": 1, "t_s": 0.0, "kind": "done", "target": "n1", "detail": ""}],
                     membership=[{"t": 1.5, "node": "n1", "type": "node_died", "why": "crashed"}])
    summary = write_results(run, problems, progress=lambda m: None)
    assert json.loads((run_dir / "confs.json").read_text()) == {"n1": {"structure": {"sync": 1}}}
    assert json.loads((run_dir / "timeline.json").read_text())["entries"][0]["target"] == "n1"
    membership = (run_dir / "membership.csv").read_text().splitlines()
    assert membership[0] == "t,node,event,peer,round,detail"
    assert len(membership) == 2 and "node_died" in membership[1] and "crashed" in membership[1], membership
    assert json.loads((run_dir / "lives.json").read_text()) == {"version": 1, "events": [], "nodes": {}}
    assert summary["ended"] == "completed" and summary["endings"] == {"n1": "done"} and "analysis" in summary
    assert json.loads((run_dir / "summary.json").read_text())["run_id"] == "r1"
    record: dict = {"run_id": "r1"}
    write_record(out, record, "completed", "", {"n1": "done"}, problems)
    assert json.loads((run_dir / "run.json").read_text())["nodes"] == {"n1": "done"}


def test_the_analysis_runs_in_a_process_of_its_own_and_says_why_it_failed(tmp_path):
    said: list[str] = []
    analysis = Analysis(str(tmp_path / "no-run"), said.append)
    assert analysis.proc.pid != os.getpid()
    got = analysis.result()
    assert "not a run folder" in got["error"] and any("not a run folder" in line for line in said), (got, said)
    analysis.stop()  # (ended already: nothing to do)


def test_the_live_view_reads_only_its_narrow_source(tmp_path):
    topo = Topology()
    for name in ("a", "b"):
        topo.add_node(name)
    nodes = Nodes(str(tmp_path), None, {"a": {"sync": 2}, "b": {"sync": 2}})
    source = SimpleNamespace(run_id="r1", algorithm="gossip", topology=topo, structure={"a": {"role": "gossip"}},
                             nodes=nodes, membership=SimpleNamespace(rows=[]), phase=Phase.RUNNING, ended="",
                             t_start=1000.0, t_start_monotonic=0.0, telemetry=None, scenario=None,
                             rates=LinkRates.of_topology(topo))
    source.timeline = RunTimeline(source, clock=lambda: 1.0)
    feed = LiveFeed(source, clock=lambda: 1.0)
    nodes["a"].state = State.RUNNING
    feed.sample()
    source.timeline.catch_up()  # (the run's monitor, each second)
    nodes["a"].state, nodes["a"].detail = State.FAILED, "oom"
    view = feed.view()
    assert view["phase"] == "running" and view["nodes"][0]["role"] == "gossip"
    assert view["timeline"] == [{"seq": 1, "t_s": 1.0, "kind": "failed", "target": "a", "detail": "oom"}]


def test_the_run_s_timeline_is_its_own_record(tmp_path):
    nodes = Nodes(str(tmp_path), None, {"a": {"sync": 2}, "b": {"sync": 2}})
    membership, scenario = SimpleNamespace(rows=[]), SimpleNamespace(rows=[])
    run = SimpleNamespace(nodes=nodes, membership=membership, scenario=scenario, t_start=1000.0, t_start_monotonic=50.0)
    clock = [52.5]
    timeline = RunTimeline(run, clock=lambda: clock[0])
    nodes["a"].state = nodes["b"].state = State.RUNNING
    assert timeline.entries() == []  # the states as they start: no entry
    nodes["a"].state, nodes["a"].detail = State.FAILED, "oom"
    membership.rows.append({"t": 1001.25, "node": "b", "type": "node_died", "why": "crashed"})
    scenario.rows.append({"applied_s": 2.0, "event": "crash", "target": "b", "detail": "SIGKILL", "outcome": "applied"})
    scenario.rows.append({"applied_s": 2.1, "event": "pause", "target": "a", "detail": "frozen", "outcome": "failed"})
    timeline.link_changed("a", "b", Shape(rate_bps=2_000_000, delay_ms=5))
    assert [(e["seq"], e["t_s"], e["kind"], e["target"], e["detail"]) for e in timeline.entries()] == [
        (1, 2.5, "link", "a->b", "2mbit delay 5ms"), (2, 2.5, "failed", "a", "oom"),
        (3, 1.25, "node_died", "b", "crashed"), (4, 2.0, "crash", "b", "SIGKILL"),
        (5, 2.1, "pause", "a", "frozen [failed]")]
    assert [e["seq"] for e in timeline.entries(after_seq=3)] == [4, 5]
    assert timeline.entries() == timeline.entries()  # each change once
    assert timeline.node_event("a", {"type": "policy_decision", "t": 1003.0, "round": 2, "action": {}}) is True
    assert timeline.entries()[-1]["t_s"] == 3.0 and timeline.entries()[-1]["kind"] == "policy_decision"
