"""Recorded traces on links: links.json's ``trace`` (each file read once, confined, refused
naming file and line), a replay's rate over time (loop, offset, time scale, the floor), and the
replay by ticks: one ``set_rates`` request a tick with only the rates that changed, a constant
rate ending a link's trace. Fixture files are written here; the worker is a recorder."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from controller.model import traces
from controller.model.scenario import resolve
from controller.model.topology import load_links
from controller.model.traces import MIN_REPLAY_RATE_BPS, Replay, Trace, floor_bps
from controller.run.scenario_runner import ScenarioRunner
from controller.run.trace_replay import TracedLink, TraceReplay, due, tick_grid
from worker.api import bodies
from worker.api.errors import ConfigError, ShapingError, TopologyError
from tests.unit.fake_netlink import CountingSockets

PACKET_BPS = 1500 * 8 * 10  # one Mahimahi packet in a 100 ms bin


def write_links(tmp_path, links: dict, name: str = "links.json") -> str:
    (tmp_path / "traces").mkdir(exist_ok=True)
    (tmp_path / "traces" / "cell.down").write_text("0\n0\n150\n160\n350\n")  # 2, 2, 0, 1 packets a bin
    path = tmp_path / name
    path.write_text(json.dumps(links))
    return str(path)


def traced(offset_s: float = 0, **more) -> dict:
    return {"file": "traces/cell.down", "format": "mahimahi", "offset_s": offset_s, **more}


def test_links_json_traces_are_read_once_and_deployed_at_their_first_rate(tmp_path, monkeypatch):
    reads = []
    real = traces.read_trace
    monkeypatch.setattr(traces, "read_trace", lambda *a, **k: reads.append(a) or real(*a, **k))
    path = write_links(tmp_path, {f"n{i}": [{"dest": "hub", "trace": traced(offset_s=0.1 * (i % 4))}]
                                  for i in range(50)} | {"hub": [{"dest": "n0", "bw": "5mbit"}]})
    topo = load_links(path)
    assert len(reads) == 1 and len(topo.traces) == 50 and ("hub", "n0") not in topo.traces
    assert topo.links[("n0", "hub")].shape.rate_bps == 2 * PACKET_BPS  # the first bin's rate
    assert topo.links[("n2", "hub")].shape.rate_bps == 120_000  # from 0.2 s: an empty bin (a packet a bin)
    assert topo.links[("hub", "n0")].shape.rate_bps == 5_000_000
    assert topo.copy().traces == topo.traces


@pytest.mark.parametrize("link,words", [
    ({"dest": "b"}, ["link 0 (to 'b')", "needs 'bw'", "or 'trace'"]),
    ({"dest": "b", "bw": "1mbit", "trace": traced()}, ["needs 'bw'", "one of them"]),
    ({"dest": "b", "trace": {**traced(), "file": "../outside.down"}}, ["trace, field 'file'", "outside the directory"]),
    ({"dest": "b", "trace": {**traced(), "file": "traces/none.down"}}, ["trace:", "none.down", "cannot read"]),
    ({"dest": "b", "trace": {**traced(), "format": "pcap"}}, ["field 'format'", "'pcap'"]),
    ({"dest": "b", "trace": {**traced(), "bin_ms": 0}}, ["field 'bin_ms'"]),
    ({"dest": "b", "trace": {**traced(), "time_scale": -1}}, ["field 'time_scale'"]),
    ({"dest": "b", "trace": {**traced(), "speed": 2}}, ["field 'speed'", "unknown field"]),
    ({"dest": "b", "trace": {**traced(), "loop": False, "offset_s": 5}}, ["offset_s", "past the end"]),
    ({"dest": "b", "trace": {**traced(), "file": "traces/back.down"}}, ["back.down, line 3", "time goes back"]),
])
def test_bad_traced_links_are_refused_naming_file_link_and_line(tmp_path, link, words):
    path = write_links(tmp_path, {"a": [link]})
    (tmp_path / "traces" / "back.down").write_text("0\n20\n10\n")
    (tmp_path.parent / "outside.down").write_text("0\n")
    with pytest.raises(TopologyError) as info:
        load_links(path)
    message = str(info.value)
    assert message.startswith(f"{path}: node 'a', link 0"), message
    for word in words:
        assert word in message, (word, message)


def test_a_trace_file_linked_out_of_the_directory_is_refused(tmp_path):
    secret = tmp_path.parent / f"{tmp_path.name}-secret.down"
    secret.write_text("0\n")
    path = write_links(tmp_path, {"a": [{"dest": "b", "trace": {**traced(), "file": "traces/link.down"}}]})
    os.symlink(secret, tmp_path / "traces" / "link.down")
    with pytest.raises(TopologyError, match="outside the directory"):
        load_links(path)


def replay(rates_mbit, bin_s=0.1, **kw) -> Replay:
    return Replay(Trace("t", bin_s, np.array([int(r * 1e6) for r in rates_mbit])), "t", "csv", **kw)


def test_a_replay_loops_shifts_stretches_and_never_stops_a_link():
    r = replay([1, 2, 0, 4])
    assert [r.rate_at(t / 10 + 1e-6) for t in range(9)] == [10**6, 2 * 10**6, 120_000, 4 * 10**6] * 2 + [10**6]
    once = replay([1, 2, 0, 4], loop=False, offset_s=0.1, time_scale=2)
    assert [once.rate_at(t / 10 + 1e-6) for t in range(0, 12, 2)] == [2 * 10**6, 60_000,
                                                                      4 * 10**6, 4 * 10**6, 4 * 10**6, 4 * 10**6]
    assert "from 0.5 s (looped: 0.1 s in)" in replay([1, 2, 0, 4], offset_s=0.5).describe()
    assert "x2 slower" in once.describe() and "x4 faster" in replay([1], time_scale=0.25).describe()
    assert r.floor_bps == 120_000 and once.floor_bps == 60_000  # one 1,500-byte packet a bin (a stretched one: 0.2 s)
    assert floor_bps(0.01) == 120_000 and floor_bps(10.0) == MIN_REPLAY_RATE_BPS  # (10 ms bins: a packet in 100 ms)
    slow = replay([0.064, 0.002, 0, 0.2])  # under a packet a bin: the floor, as a gap (HTB's debt would stall a flow)
    assert [slow.rate_at(t / 10 + 1e-6) for t in range(4)] == [120_000, 120_000, 120_000, 200_000]
    assert replay([0.064, 0.002], bin_s=1.0).rate_at(0.5) == 64_000  # longer bins: a slow link as recorded
    assert replay([0.064, 0.002], bin_s=1.0).rate_at(1.5) == 12_000
    assert once.tick_s == pytest.approx(0.2) and once.end_s == pytest.approx(0.4) and r.end_s == float("inf")
    assert r.rates_bps(2) == [1_724_000, 1_836_000]  # (3 x 1 + 3 x 2 + 2 x 0.12 + 2 x 4) / 10 Mbit/s, ...


def test_due_sends_only_what_changed_and_ticks_sit_on_a_grid():
    a = TracedLink("a", "b", replay([1, 1, 2]))
    b = TracedLink("b", "a", replay([3, 4, 4]), start_s=0.1)
    assert due([a, b], 0.0, {}) == {("a", "b"): 10**6, ("b", "a"): 3 * 10**6}
    assert due([a, b], 0.1, {("a", "b"): 10**6, ("b", "a"): 3 * 10**6}) == {}
    assert due([a, b], 0.2, {("a", "b"): 10**6, ("b", "a"): 3 * 10**6}) == {("a", "b"): 2 * 10**6,
                                                                             ("b", "a"): 4 * 10**6}
    assert tick_grid(0.0, 0.1) == 0.0 and tick_grid(0.30000000001, 0.1) == pytest.approx(0.3)
    assert tick_grid(0.31, 0.1) == pytest.approx(0.4)


class RateWorker:
    """Records set_rates and set_links; refuses a rate when told to."""

    def __init__(self):
        self.calls = []
        self.refuse = None

    def set_rates(self, body):
        bodies.checked(bodies.SET_RATES, body)  # what the worker would check
        if self.refuse:
            raise ShapingError(self.refuse)
        self.calls.append(("set_rates", {(r["src"], r["dst"]): r["rate_bps"] for r in body["rates"]}))
        return {"links": len(body["rates"])}

    def set_links(self, body, merge=False):
        self.calls.append(("set_links", [(l["src"], l["dst"]) for l in body["links"]]))
        self.access = body.get("access")
        return {"nodes": []}

    def capabilities(self):
        return {"netem": False}

    def fault(self, body):
        return {"results": []}


def test_one_request_a_tick_with_the_changed_rates_and_rows_with_skew():
    worker, now = RateWorker(), [0.0]
    changes = []
    replayer = TraceReplay(worker, clock=lambda: now[0], on_change=lambda r, t: changes.append((r, t)),
                           progress=lambda _: None)
    replayer.t0 = 0.0
    replayer.add([TracedLink("a", "b", replay([1, 1, 2])), TracedLink("c", "d", replay([5, 6, 6]))])
    for k in range(3):
        now[0] = k / 10 + 0.004  # the worker answered 4 ms after the tick
        replayer.tick(k / 10)
    assert [c[1] for c in worker.calls] == [{("a", "b"): 10**6, ("c", "d"): 5 * 10**6}, {("c", "d"): 6 * 10**6},
                                            {("a", "b"): 2 * 10**6}]
    assert [(r["changed"], r["links"], r["skew_ms"], r["outcome"]) for r in replayer.rows] == [
        (2, 2, 4.0, "applied"), (1, 2, 4.0, "applied"), (1, 2, 4.0, "applied")]
    assert changes[1] == ({("c", "d"): 6 * 10**6}, pytest.approx(0.104))
    assert replayer.end([("c", "d"), ("x", "y")]) == [("c", "d")]
    worker.refuse = "no such class"
    replayer.tick(0.3)  # a ← back to 1 Mbit/s (looped): refused, recorded, retried next tick
    assert replayer.rows[-1]["outcome"] == "failed: no such class" and replayer.last[("a", "b")] == 2 * 10**6
    worker.refuse = None
    replayer.tick(0.4)
    assert worker.calls[-1] == ("set_rates", {("a", "b"): 10**6})
    assert replayer.csv_text().splitlines()[0] == "planned_s,applied_s,skew_ms,links,changed,outcome"


def test_the_replay_thread_ticks_each_bin_until_stopped():
    import time

    worker = RateWorker()
    replayer = TraceReplay(worker, progress=lambda _: None)
    replayer.add([TracedLink("a", "b", replay([1, 2] * 20, bin_s=0.05))])
    replayer.start()
    time.sleep(0.5)
    replayer.stop()
    ticks = [r["planned_s"] for r in replayer.rows]
    assert 6 <= len(ticks) <= 11, ticks  # one a 50 ms bin (a slow machine may skip a late one)
    assert all(round(t / 0.05, 6).is_integer() for t in ticks)
    assert len({tuple(c[1].values()) for c in worker.calls}) == 2  # 1 and 2 Mbit/s, in turn


def test_a_scenario_trace_starts_a_replay_and_a_link_event_ends_it(tmp_path):
    path = write_links(tmp_path, {"n1": [{"dest": "n2", "bw": "10mbit"}], "n2": [{"dest": "n1", "bw": "10mbit"}]})
    topo = load_links(path)
    doc = {"events": [{"at": 0, "trace": {"src": "n1", "dst": "n2", "file": "traces/cell.down",
                                          "format": "mahimahi", "both_ways": True}},
                      {"at": 1, "link": {"src": "n1", "dst": "n2", "bw": "3mbit"}}]}
    timeline = resolve(doc, topo, str(tmp_path / "scenario.json"), str(tmp_path))
    worker = RateWorker()
    runner = ScenarioRunner(timeline, worker, {"n1": "10.0.0.1", "n2": "10.0.0.2"}, progress=lambda _: None)
    runner.t0 = 0.0
    runner.replay.t0 = 0.0
    trace_step, link_step = timeline.steps
    runner.apply_step(trace_step)
    assert worker.calls == [("set_rates", {("n1", "n2"): 2 * PACKET_BPS, ("n2", "n1"): 2 * PACKET_BPS})]
    assert set(runner.replay.links) == {("n1", "n2"), ("n2", "n1")}
    runner.apply_step(link_step)
    assert set(runner.replay.links) == {("n2", "n1")} and worker.calls[-1] == ("set_links", [("n1", "n2")])
    with pytest.raises(ConfigError, match="needs a scenario file"):
        resolve(doc, topo)


def test_a_trace_whose_first_rate_is_refused_is_not_replayed():
    worker = RateWorker()
    worker.refuse = "no shaped link a->b on this host"
    replayer = TraceReplay(worker, clock=lambda: 0.0, progress=lambda _: None)
    replayer.t0 = 0.0
    with pytest.raises(ShapingError, match="no shaped link"):
        replayer.add([TracedLink("a", "b", replay([1, 2]))], apply_now=True)
    assert replayer.links == {} and replayer.tick(0.1) == {}


def test_set_rates_bodies_are_checked():
    with pytest.raises(ConfigError, match="rate_bps"):
        bodies.checked(bodies.SET_RATES, {"version": 1, "rates": [{"src": "a", "dst": "b", "rate_bps": 0}]})
    with pytest.raises(ConfigError, match="unknown field"):
        bodies.checked(bodies.SET_RATES, {"version": 1, "rates": [{"src": "a", "dst": "b", "rate_bps": 8,
                                                                   "jitter_ms": 1}]})
    with pytest.raises(ConfigError, match=r"rates\[0\], field 'loss_pct': must be a number in \[0, 100\]"):
        bodies.checked(bodies.SET_RATES, {"version": 1, "rates": [{"src": "a", "dst": "b", "rate_bps": 8,
                                                                   "delay_ms": 1, "loss_pct": 101}]})


def test_nodes_json_access_links_replay_a_trace(tmp_path):
    from controller.model.topology import load_nodes

    write_links(tmp_path, {})
    nodes = {"defaults": {"downlink": {"trace": traced()}},
             "nodes": [{"name": "t1", "uplink": {"trace": traced(offset_s=0.2)}}, {"name": "t2", "uplink": "5mbit"}]}
    (tmp_path / "nodes.json").write_text(json.dumps(nodes))
    topo = load_nodes(str(tmp_path / "nodes.json"))
    assert topo.nodes["t1"].uplink_bps == 120_000 and topo.nodes["t2"].uplink_bps == 5_000_000
    assert topo.nodes["t2"].downlink_bps == 2 * PACKET_BPS
    assert sorted(topo.access_traces) == [("t1", "downlink"), ("t1", "uplink"), ("t2", "downlink")]
    nodes["nodes"][1]["uplink"] = {"trace": {**traced(), "file": "traces/none.down"}}
    (tmp_path / "nodes.json").write_text(json.dumps(nodes))
    with pytest.raises(TopologyError, match=r"nodes.json: node 't2', field 'uplink', trace: .*none.down"):
        load_nodes(str(tmp_path / "nodes.json"))


def test_a_replay_changing_its_rate_more_often_than_every_10_ms_is_refused(tmp_path):
    for trace, words in (({"bin_ms": 5}, "bins of 5 ms at time_scale 1 change the rate every 5 ms"),
                         ({"time_scale": 0.05}, "bins of 100 ms at time_scale 0.05 change the rate every 5 ms")):
        path = write_links(tmp_path, {"n1": [{"dest": "n2", "trace": traced(**trace)}]})
        with pytest.raises(TopologyError, match=f"bin_ms.*{words}; a replay changes it at most every 10 ms"):
            load_links(path)
    assert load_links(write_links(tmp_path, {"n1": [{"dest": "n2", "trace": traced(bin_ms=10)}]})).traces


def test_the_nodes_of_a_replay_hand_their_interface_one_frame_at_a_time(tmp_path):
    from controller.model.topology import Topology
    from controller.workers.deploy import node_requests
    from worker.nodes.runtime import NodeSpec, new_specs

    plain = Topology()
    plain.add_node("n1")
    plain.add_node("pi", "physical", ip="10.254.0.9")
    assert [n.get("gso_max_bytes") for n in node_requests(plain)["nodes"]] == [None, None]
    # a scenario's trace event (replays) or a traced link: emulated nodes only
    assert [n.get("gso_max_bytes") for n in node_requests(plain, replays=True)["nodes"]] == [1514, None]
    topo = load_links(write_links(tmp_path, {"n1": [{"dest": "n2", "trace": traced()}], "n2": [{"dest": "n1", "bw": "5mbit"}]}))
    assert topo.replays_traces and [n["gso_max_bytes"] for n in node_requests(topo)["nodes"]] == [1514, 1514]
    spec = NodeSpec.from_dict({"name": "n1", "gso_max_bytes": 1514})
    with pytest.raises(ConfigError, match="gso_max_bytes"):
        NodeSpec.from_dict({"name": "n1", "gso_max_bytes": 100})
    with pytest.raises(ConfigError, match="exists with gso_max_bytes None, not 1514; reset"):
        new_specs({"nodes": {"n1": {"cpu": None, "mem_bytes": None}}}, [spec])


def test_access_rates_go_in_one_merging_links_update_and_an_access_event_ends_them():
    worker = RateWorker()
    replayer = TraceReplay(worker, clock=lambda: 0.0, progress=lambda _: None)
    replayer.t0 = 0.0
    replayer.add([TracedLink("a", "b", replay([1, 2])), TracedLink("t1", "", replay([3, 4]), side="uplink"),
                  TracedLink("t1", "", replay([5, 6]), side="downlink")])
    replayer.tick(0.0)
    assert worker.calls == [("set_rates", {("a", "b"): 10**6}), ("set_links", [])]
    assert worker.access == {"t1": {"uplink_bps": 3 * 10**6, "downlink_bps": 5 * 10**6}}
    assert ("t1", "@uplink") in replayer.last and replayer.last[("t1", "@downlink")] == 5 * 10**6
    assert replayer.end([("t1", "@uplink")]) == [("t1", "@uplink")]


def test_a_foreground_replay_ends_at_its_time_or_when_every_tick_fails():
    from controller.run.trace_replay import STOP_AFTER_FAILED_TICKS, replay_in_foreground

    class Recorder:
        def __init__(self, fail: bool) -> None:
            self.fail, self.bodies = fail, []

        def set_rates(self, body):
            self.bodies.append(body)
            if self.fail and len(self.bodies) > 1:
                raise ShapingError("no such namespace")

    rates = Replay(Trace("fixture", 0.01, np.array([10**6, 2 * 10**6])), "fixture", "csv")
    said: list[str] = []
    worker = Recorder(fail=False)
    done = replay_in_foreground(worker, [TracedLink("a", "b", rates)], seconds=0.2, progress=said.append, sleep_s=0.01)
    assert 10 <= len(done.rows) <= 25 and all(r["outcome"] == "applied" for r in done.rows), done.rows
    assert len(worker.bodies) >= 10 and "stopped (the time given)" in said[-1] and "ticks" in said[-1]
    said.clear()
    failing = Recorder(fail=True)
    done = replay_in_foreground(failing, [TracedLink("a", "b", rates)], seconds=30, progress=said.append, sleep_s=0.01)
    assert done.now_s() < 5 and len(done.rows) >= STOP_AFTER_FAILED_TICKS
    assert f"stopped ({STOP_AFTER_FAILED_TICKS} ticks in a row failed (failed: no such namespace))" in said[-1], said


def test_the_python_api_adds_a_link_that_replays_a_recording(tmp_path):
    from controller.model.spec import RunOptions, RunSpec
    from controller.testbed import Testbed

    write_links(tmp_path, {})
    tb = Testbed(workdir=str(tmp_path))
    for name in ("n1", "n2", "n3"):
        tb.add_emulated_node(name)
    tb.add_link("n1", "n2", trace=traced())
    tb.add_link("n1", "n3", trace=traced(0.1, loop=False))
    tb.add_link("n2", "n1", bw=5_000_000, loss=0.5)
    assert tb.topology.links[("n1", "n2")].shape.rate_bps == 2 * PACKET_BPS  # deployed at its first rate
    assert tb.topology.links[("n2", "n1")].shape.rate_bps == 5_000_000 and ("n2", "n1") not in tb.topology.traces
    assert tb._trace_files.files_read == 1  # one file, two links
    assert tb.topology.traces[("n1", "n3")].rate_at(0.0) == 2 * PACKET_BPS and not tb.topology.traces[("n1", "n3")].loop
    with pytest.raises(TopologyError, match=r"Testbed: add_link\('n3', 'n1'\): .*needs 'bw' .* or 'trace'"):
        tb.add_link("n3", "n1", bw="1mbit", trace=traced())
    with pytest.raises(TopologyError, match=r"add_link\('n3', 'n1'\).*trace.*outside the directory"):
        tb.add_link("n3", "n1", trace={"file": "../x.down", "format": "mahimahi"})
    with pytest.raises(TopologyError, match="duplicate link n1 -> n2"):
        tb.add_link("n1", "n2", bw="1mbit")
    assert set(tb.topology.links) == {("n1", "n2"), ("n1", "n3"), ("n2", "n1")}  # nothing half-added
    spec = RunSpec(RunOptions(workdir=str(tmp_path)), tb.topology, {}, {}, None, {}, None, None, None)
    assert spec.inputs["user:traces/cell.down"] == str(tmp_path / "traces" / "cell.down")  # copied into inputs/


def test_urgent_raises_the_threads_priority_for_the_block_only():
    import os
    import threading

    from worker.shaping.rates import URGENT_NICE, urgent

    seen: dict[str, int] = {}

    def run() -> None:
        tid = threading.get_native_id()
        seen["before"] = os.getpriority(os.PRIO_PROCESS, tid)
        with urgent():
            seen["inside"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["process"] = os.getpriority(os.PRIO_PROCESS, os.getpid())  # (the main thread's: untouched)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["after"] == seen["before"] and seen["process"] == os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() == 0:
        assert seen["inside"] == min(seen["before"], URGENT_NICE)
    else:  # not allowed: as it was
        assert seen["inside"] == seen["before"]


def test_a_recording_with_delay_is_refused_on_an_access_link_and_in_a_scenario_event(tmp_path):
    from controller.model.scenario import load_scenario
    from controller.model.topology import load_nodes
    from worker.api.errors import ConfigError, TopologyError

    (tmp_path / "walk.csv").write_text("time_s,rate,delay_ms,loss_pct\n0,8mbit,40,0\n1,4mbit,5,0\n")
    (tmp_path / "nodes.json").write_text('{"nodes": [{"name": "a", "uplink": {"trace": {"file": "walk.csv", '
                                         '"format": "csv"}}}]}')
    with pytest.raises(TopologyError, match="walk.csv has delay_ms or loss_pct columns, and an access link"):
        load_nodes(str(tmp_path / "nodes.json"))
    (tmp_path / "links.json").write_text('{"a": [{"dest": "b", "bw": "10mbit"}]}')
    (tmp_path / "scenario.json").write_text('{"events": [{"at": 1, "trace": {"src": "a", "dst": "b", '
                                            '"file": "walk.csv", "format": "csv"}}]}')
    with pytest.raises(ConfigError, match="and a scenario trace event replays only the rate"):
        load_scenario(str(tmp_path / "scenario.json"), load_links(str(tmp_path / "links.json")))


def test_a_recordings_delay_and_loss_deploy_the_link_with_netem_and_travel_with_its_rate(tmp_path):
    (tmp_path / "d.csv").write_text("time_s,rate,delay_ms,loss_pct\n0,4mbit,40,0\n0.1,4mbit,10,5\n0.2,2mbit,10,5\n")
    path = tmp_path / "links.json"
    path.write_text(json.dumps({"a": [{"dest": "b", "trace": {"file": "d.csv", "format": "csv"}}]}))
    topo = load_links(str(path))
    shape = topo.links[("a", "b")].shape
    assert (shape.rate_bps, shape.delay_ms, shape.loss_pct, shape.needs_netem) == (4_000_000, 40.0, 0.0, True)
    path.write_text(json.dumps({"a": [{"dest": "b", "delay": "5ms", "trace": {"file": "d.csv", "format": "csv"}}]}))
    with pytest.raises(TopologyError, match="'delay' with a trace whose recording has delay_ms or loss_pct columns"):
        load_links(str(path))
    sent = []

    class Worker:
        def set_rates(self, body):
            sent.append(bodies.checked(bodies.SET_RATES, body)["rates"])

    replayer = TraceReplay(Worker(), clock=lambda: 0.0, progress=lambda _: None)
    replayer.t0 = 0.0
    replayer.add(TracedLink(s, d, r) for (s, d), r in topo.traces.items())
    for k in range(3):
        replayer.tick(k / 10)
    assert sent == [[{"src": "a", "dst": "b", "rate_bps": 4_000_000, "delay_ms": 40.0, "loss_pct": 0.0}],
                    [{"src": "a", "dst": "b", "rate_bps": 4_000_000, "delay_ms": 10.0, "loss_pct": 5.0}],
                    [{"src": "a", "dst": "b", "rate_bps": 2_000_000, "delay_ms": 10.0, "loss_pct": 5.0}]]


def test_rate_messages_change_the_netem_leaf_only_when_delay_or_loss_or_rate_change():
    from worker.shaping.rates import rate_messages

    plan = {"ifname": "eth0", "rules": [{"dest": "b", "minor": 16, "shape": {"rate_bps": 10**6, "delay_ms": 40.0,
                                                                             "jitter_ms": 0.0, "loss_pct": 0.0}},
                                        {"dest": "c", "minor": 17, "shape": {"rate_bps": 10**6}}]}
    assert rate_messages(3, plan, {"b": 10**6}, {"b": (40.0, 0.0)}) == ([], [])  # nothing new
    msgs, what = rate_messages(3, plan, {"b": 10**6}, {"b": (10.0, 5.0)})
    assert len(msgs) == 1 and what == ["delay and loss of the link to b (10 ms, 5 %)"]  # the leaf, not the class
    msgs, what = rate_messages(3, plan, {"b": 2 * 10**6, "c": 2 * 10**6})
    assert len(msgs) == 3 and what[0] == what[1] == "rate of the link to b (2000000 bit/s)"  # class + leaf's limit


def test_the_replayed_delay_and_loss_are_kept_written_and_shown_in_the_link_view(tmp_path):
    """What the dashboard's link view shows: the delay and loss applied, live and from the run folder."""
    from controller.run.experiment import Experiment
    from controller.run.nodes import Nodes
    from controller.run.trace_replay import TRACE_NETEM_CSV, stored_netem
    from controller.web import run_view
    from controller.web.live import LiveFeed
    from tests.unit.test_dashboard import _stored_run, _telemetry

    (tmp_path / "d.csv").write_text("time_s,rate,delay_ms,loss_pct\n0,4mbit,40,0\n0.1,4mbit,10,5\n0.2,2mbit,10,5\n")
    (tmp_path / "links.json").write_text(json.dumps({"a": [{"dest": "b", "trace": {"file": "d.csv", "format": "csv"}}]}))
    topo = load_links(str(tmp_path / "links.json"))
    now = [0.0]

    class Worker:
        def set_rates(self, body):
            bodies.checked(bodies.SET_RATES, body)

    replayer = TraceReplay(Worker(), clock=lambda: now[0], progress=lambda _: None)
    replayer.t0 = 0.0
    replayer.add(TracedLink(s, d, r) for (s, d), r in topo.traces.items())
    for k in range(3):
        now[0] = k / 10 + 0.004  # applied 4 ms late
        replayer.tick(k / 10)
    # the third tick changed the rate only: no new delay/loss row
    assert [(t, k, d, l) for t, k, d, l in replayer.netem_changes] == [(0.004, ("a", "b"), 40.0, 0.0),
                                                                       (0.104, ("a", "b"), 10.0, 5.0)]
    assert replayer.netem_over(("a", "b"), [0.0, 0.05, 0.2]) == {"delay_ms": [None, 40.0, 10.0],
                                                                 "loss_pct": [None, 0.0, 5.0]}
    assert replayer.netem_over(("b", "a"), [0.0]) is None  # never replayed a recording's delay
    now[0] = 0.5
    assert replayer.end([("a", "b")]) == [("a", "b")]
    assert replayer.netem_over(("a", "b"), [0.6])["delay_ms"] == [None]  # the trace ended: not the recording's

    class Out:
        def write_bytes(self, name, data):
            (tmp_path / name).write_bytes(data)

    replayer.write(Out())
    text = (tmp_path / TRACE_NETEM_CSV).read_text()
    assert text.splitlines()[0] == "t_s,src,dst,delay_ms,loss_pct" and text.splitlines()[-1] == "0.5,a,b,,"
    assert stored_netem(text, ("a", "b"), [0.1, 0.2, 1.0]) == {"delay_ms": [40.0, 10.0, None],
                                                                "loss_pct": [0.0, 5.0, None]}
    assert stored_netem(text, ("a", "c"), [0.1]) is None
    # the stored link view: a run folder with the file beside its telemetry
    _, run = _stored_run(tmp_path / "stored")
    (run / TRACE_NETEM_CSV).write_text("t_s,src,dst,delay_ms,loss_pct\n0,a,b,40,0\n3,a,b,10,5\n")
    link = run_view.stored_link_series(str(run), "a", "b")
    assert [link["delay_ms"][link["t_s"].index(t)] for t in (1.0, 3.0, 11.0)] == [40.0, 10.0, 10.0]
    assert link["loss_pct"][link["t_s"].index(4.0)] == 5.0
    assert "delay_ms" not in run_view.stored_link_series(str(run), "b", "c")
    # the live link view: the delay and loss at each sample, as the run's replay applied them
    structure = {"a": {"sync": 3, "role": "gossip"}, "b": {"sync": 3, "role": "gossip"}}
    exp = Experiment(topo, Nodes(str(tmp_path), None, structure), structure, progress=lambda line: None)
    exp.live = feed = LiveFeed(exp)
    exp.phase, exp.t_start_monotonic = "running", 0.0
    exp.replay.t0 = 0.0
    exp.replay.worker = Worker()
    exp.replay.clock = lambda: now[0]
    now[0] = 0.0
    exp.replay.add(TracedLink(s, d, r) for (s, d), r in topo.traces.items())
    for k in range(3):
        now[0] = k / 10
        exp.replay.tick(k / 10)
        exp.telemetry = _telemetry(k / 10, 1000 * k, 0)
        feed.clock = lambda k=k: k / 10
        feed.sample()
    series = feed.link_series("a", "b")
    assert series["delay_ms"] == [40.0, 10.0, 10.0] and series["loss_pct"] == [0.0, 5.0, 5.0]


def test_a_worker_schedule_picks_each_links_bin_and_refuses_bad_ones_naming_the_link():
    from worker.shaping.schedule import MAX_BINS, LinkSchedule, check

    held = LinkSchedule("a", "b", (10, 20, 30), bin_ms=100)
    looped = LinkSchedule("a", "c", (10, 20), bin_ms=50, loop=True, offset_s=0.05)
    assert [held.index_at(t) for t in (0.0, 0.099, 0.1, 0.25, 9.0)] == [0, 0, 1, 2, 2]  # the last bin held
    assert [looped.index_at(t) for t in (0.0, 0.05, 0.1, 0.15)] == [1, 0, 1, 0]  # from its offset, looped
    check([held, looped])
    for bad, words in [([held, held], "listed twice"), ([LinkSchedule("a", "b", ())], "no bins"),
                       ([LinkSchedule("a", "b", (10,), bin_ms=1)], "bin_ms 1 under 10"),
                       ([LinkSchedule("a", "b", (4,))], "at least 8 bit/s"),
                       ([LinkSchedule("a", "b", (10, 20), netem=((1.0, 0.0),))], "1 delay/loss bins for 2"),
                       ([LinkSchedule("a", "b", (10,) * (MAX_BINS + 1))], "more than")]:
        with pytest.raises(ConfigError, match=words):
            check(bad)


def test_a_worker_schedule_sends_a_bin_only_when_its_values_change_one_batch_per_node(one_node_plan):
    from worker.shaping.schedule import LinkSchedule, ScheduleClock

    sockets, plan = CountingSockets(), one_node_plan
    batches = sockets.batches
    links = [LinkSchedule("a", "b", (10**6, 10**6, 2 * 10**6)), LinkSchedule("a", "c", (10**6, 3 * 10**6, 3 * 10**6))]
    clock = ScheduleClock(links, {"a": ("ns-a", plan)}, start=0.0, sockets=sockets, clock=lambda: 0.0)
    assert clock.applied == [0, 0]  # the first bins are the stored plan's (deployed at them): not sent again
    assert [clock.tick(t) for t in (0.0, 0.1, 0.2)] == [0, 1, 1]  # an equal next bin is not sent again
    assert batches == [1, 1] and clock.applied == [2, 1]
    with pytest.raises(ConfigError, match="no shaped link a->z"):
        ScheduleClock([LinkSchedule("a", "z", (10**6,))], {"a": ("ns-a", plan)}, start=0.0, sockets=sockets)


class ScheduleWorker:
    """A worker with the schedule routes (pure logic: what TraceReplay sends; netns tests run the clock)."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.calls = refuse, []

    def schedule_start(self, body):
        self.calls.append(("start", body))
        if self.refuse:
            raise ConfigError("schedule: links[0] (a->b): bin_ms 5 under 10")
        return {"version": 1, "links": len(body["links"])}

    def schedule_end(self, body):
        self.calls.append(("end", body))
        return {"version": 1, "running": True, "ended": body["links"]}

    def schedule_stop(self):
        self.calls.append(("stop", None))
        return {"version": 1, "running": True, "links": 1, "applied": [],
                "rows": [{"planned_s": 0.0, "applied_s": 0.0004, "skew_ms": 0.4, "links": 1, "changed": 1,
                          "outcome": "applied", "host": "h1"}]}

    def set_rates(self, body):
        self.calls.append(("set_rates", body))
        return {"version": 1, "links": len(body["rates"])}

    def set_links(self, body, merge=False):
        self.calls.append(("set_links", body))
        return {"version": 1}


def test_links_traced_from_the_start_go_to_the_hosts_clock_once_with_their_bins():
    worker = ScheduleWorker()
    said = []
    replayer = TraceReplay(worker, progress=said.append)
    r = replay([2, 6, 4], offset_s=0.2, time_scale=2.0, loop=False)
    replayer.add([TracedLink("a", "b", r), TracedLink("n", "", replay([1, 2]), side="uplink")])
    replayer.start()
    try:
        (kind, body), = [c for c in worker.calls if c[0] == "start"]
        (link,) = body["links"]  # not the access link: the controller ticks it
        assert link == {"src": "a", "dst": "b", "rates_bps": [2_000_000, 6_000_000, 4_000_000], "netem": None,
                        "bin_ms": 200, "loop": False, "offset_s": 0.4}
        assert abs(body["start_wall_s"] - time.time()) < 1
        assert set(replayer.handed) == {("a", "b")} and set(replayer.links) == {("n", "@uplink")}
        assert replayer.end([("a", "b")]) == [("a", "b")]
        assert ("end", {"version": 1, "links": [{"src": "a", "dst": "b"}]}) in worker.calls
    finally:
        replayer.stop()
    assert worker.calls[-1][0] == "stop" and any(r["skew_ms"] == 0.4 for r in replayer.rows)  # the host's row
    assert not any("host" in r for r in replayer.rows)
    assert not said


def test_a_host_that_refuses_the_schedule_leaves_the_links_to_the_controllers_ticks():
    worker = ScheduleWorker(refuse=True)
    said = []
    replayer = TraceReplay(worker, progress=said.append)
    replayer.add([TracedLink("a", "b", replay([2, 6]))])
    replayer.start()
    time.sleep(0.25)
    replayer.stop()
    assert not replayer.handed and ("a", "b") in replayer.links
    assert any(c[0] == "set_rates" for c in worker.calls) and not any(c[0] == "stop" for c in worker.calls)
    assert "the controller ticks it" in said[0]
