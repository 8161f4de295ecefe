"""Scenario files: the bad ones refused with the file, the event and the field named (nothing
started); draws seeded and stable; the runner's dispatch to the worker as data."""
import json
import random

import pytest

from controller.model.scenario import cdf_inverse, load_scenario, resolve
from controller.model.topology import Topology
from controller.run.scenario_runner import ScenarioRunner
from worker import faults
from worker.api.errors import CapabilityError, ConfigError
from worker.api.faults import parse_fault, parse_faults


def topology() -> Topology:
    topo = Topology()
    for i in range(1, 8):
        topo.add_node(f"n{i}", cpu=0.5 if i == 7 else None)
    for a in topo.nodes:
        for b in topo.nodes:
            if a != b and not {a, b} == {"n6", "n7"}:
                topo.add_link(a, b, "10mbit")
    return topo


ISSUE_EXAMPLE = {"seed": 1, "time_scale": 1.0, "events": [
    {"at": 20, "link": {"src": "n1", "dst": "n2", "bw": "1mbit", "both_ways": True}},
    {"at": 30, "link_down": ["n3", "n4"], "for": 20},
    {"at": 40, "partition": [["n1", "n2", "n3"], ["n4", "n5", "n6"]], "for": 15},
    {"at": 0, "loss": {"src": "n1", "dst": "*", "percent": 1}},
    {"at_round": {"node": "n1", "round": 5}, "crash": "n5"},
    {"at": 10, "pause": "n6", "for": 5},
    {"at": 0, "cpu": {"node": "n7", "cores": 0.2}},
    {"at": 0, "revocation": {"nodes": ["n2", "n3"], "lifetime": {"exponential": {"rate_per_min": 0.00033254}},
                             "notice_s": 2, "replace_after_s": {"uniform": [80, 95]}}},
    {"at": 5, "background": {"src": "n1", "dst": "n2", "rate": "5mbit", "on_s": 1, "off_s": 1, "for": 30}},
    {"at": 0, "trace": {"src": "n1", "dst": "n2", "file": "bw_trace.csv"}}]}


def ev(**fields):
    return {"events": [fields]}


# (id, scenario document, substrings the message must hold)
BAD = [
    ("not an object", [1, 2], ["expected a JSON object"]),
    ("no events", {"seed": 1}, ["missing field 'events'"]),
    ("top-level typo", {"events": [], "sed": 1}, ["'sed'", "did you mean 'seed'"]),
    ("negative seed", {"seed": -1, "events": []}, ["field 'seed'"]),
    ("zero time_scale", {"time_scale": 0, "events": []}, ["field 'time_scale'"]),
    ("event not an object", {"events": ["crash n1"]}, ["events[0]", "expected an event object"]),
    ("no trigger", ev(crash="n1"), ["events[0]", "exactly one trigger"]),
    ("two triggers", ev(at=1, at_round={"node": "n1", "round": 1}, crash="n1"), ["events[0]", "exactly one trigger"]),
    ("no kind", ev(at=1), ["events[0]", "exactly one event kind"]),
    ("two kinds", ev(at=1, crash="n1", pause="n2"), ["events[0]", "crash, pause"]),
    ("kind typo", ev(at=1, crsh="n1"), ["events[0]", "'crsh'", "did you mean 'crash'"]),
    ("negative time", ev(at=-1, crash="n1"), ["events[0]", "field 'at'", "-1"]),
    ("time as string", ev(at="10s", crash="n1"), ["events[0]", "field 'at'", "'10s'"]),
    ("time too far", ev(at=10**9, crash="n1"), ["events[0]", "field 'at'"]),
    ("unknown node", ev(at=1, crash="n9"), ["events[0]", "unknown node 'n9'"]),
    ("node typo", ev(at=1, pause="nn1"), ["events[0]", "'nn1'", "did you mean 'n1'"]),
    ("round of unknown node", ev(at_round={"node": "x", "round": 2}, crash="n1"), ["at_round", "unknown node 'x'"]),
    ("round zero", ev(at_round={"node": "n1", "round": 0}, crash="n1"), ["at_round", "field 'round'"]),
    ("link unit typo", ev(at=1, link={"src": "n1", "dst": "n2", "bw": "1mbitt"}), ["link", "field 'bw'", "unit"]),
    ("link without bw", ev(at=1, link={"src": "n1", "dst": "n2"}), ["link", "missing field 'bw'"]),
    ("link not in topology", ev(at=1, link={"src": "n6", "dst": "n7", "bw": "1mbit"}), ["no link n6 -> n7"]),
    ("link field typo", ev(at=1, link={"src": "n1", "dst": "n2", "bw": "1mbit", "both_way": True}),
     ["'both_way'", "did you mean 'both_ways'"]),
    ("link delay unit", ev(at=1, link={"src": "n1", "dst": "n2", "bw": "1mbit", "delay": "5"}), ["field 'delay'"]),
    ("link loss unit", ev(at=1, link={"src": "n1", "dst": "n2", "bw": "1mbit", "loss": "5"}), ["field 'loss'", "%"]),
    ("link loss too high", ev(at=1, link={"src": "n1", "dst": "n2", "bw": "1mbit", "loss": "101%"}), ["field 'loss'"]),
    ("link_down one node", ev(at=1, link_down=["n1"]), ["field 'link_down'", "at least 2"]),
    ("link_down same node", ev(at=1, link_down=["n1", "n1"]), ["twice"]),
    ("partition overlap", ev(at=1, partition=[["n1", "n2"], ["n2", "n3"]]), ["'n2' is in two groups"]),
    ("partition one group", ev(at=1, partition=[["n1", "n2"]]), ["field 'partition'", "at least 2"]),
    ("loss above 100", ev(at=1, loss={"src": "n1", "dst": "n2", "percent": 120}), ["field 'percent'", "120"]),
    ("loss as string", ev(at=1, loss={"src": "n1", "dst": "n2", "percent": "1%"}), ["field 'percent'"]),
    ("loss to itself", ev(at=1, loss={"src": "n1", "dst": "n1", "percent": 1}), ["two different nodes"]),
    ("for zero", ev(at=1, pause="n1", **{"for": 0}), ["field 'for'"]),
    ("for on a crash", ev(at=1, crash="n1", **{"for": 5}), ["crash event cannot be undone"]),
    ("cpu zero", ev(at=1, cpu={"node": "n1", "cores": 0}), ["field 'cores'"]),
    ("memory unit", ev(at=1, memory={"node": "n1", "mem": "12X"}), ["field 'mem'"]),
    ("memory too small", ev(at=1, memory={"node": "n1", "mem": "1M"}), ["field 'mem'", "at least 4M"]),
    ("revocation no nodes", ev(at=0, revocation={"nodes": [], "lifetime": {"at": []}}), ["field 'nodes'"]),
    ("revocation model typo", ev(at=0, revocation={"nodes": ["n1"], "lifetime": {"exponentail": {}}}),
     ["lifetime", "did you mean 'exponential'"]),
    ("revocation two models", ev(at=0, revocation={"nodes": ["n1"], "lifetime": {"at": [1], "cdf": [[1, 1]]}}),
     ["lifetime", "exactly one"]),
    ("revocation rate zero", ev(at=0, revocation={"nodes": ["n1"], "lifetime": {"exponential": {"rate_per_min": 0}}}),
     ["field 'rate_per_min'"]),
    ("revocation at count", ev(at=0, revocation={"nodes": ["n1", "n2"], "lifetime": {"at": [5]}}),
     ["field 'at'", "at least 2"]),
    ("cdf not ending at 1", ev(at=0, revocation={"nodes": ["n1"], "lifetime": {"cdf": [[10, 0.5]]}}),
     ["last fraction must be 1"]),
    ("cdf going back", ev(at=0, revocation={"nodes": ["n1"], "lifetime": {"cdf": [[10, 0.5], [5, 1]]}}),
     ["row 1", "minutes must increase"]),
    ("uniform reversed", ev(at=0, revocation={"nodes": ["n1"], "lifetime": {"at": [5]},
                                               "replace_after_s": {"uniform": [95, 80]}}), ["a <= b"]),
    ("notice negative", ev(at=0, revocation={"nodes": ["n1"], "lifetime": {"at": [5]}, "notice_s": -2}),
     ["field 'notice_s'"]),
    ("background on without off", ev(at=0, background={"src": "n1", "dst": "n2", "rate": "1mbit", "on_s": 1,
                                                      "for": 5}), ["on_s and off_s go together"]),
    ("background no for", ev(at=0, background={"src": "n1", "dst": "n2", "rate": "1mbit"}), ["missing field 'for'"]),
    ("background protocol", ev(at=0, background={"src": "n1", "dst": "n2", "rate": "1mbit", "for": 5,
                                                 "protocol": "sctp"}), ["field 'protocol'", "'sctp'"]),
    ("trace outside", ev(at=0, trace={"src": "n1", "dst": "n2", "file": "../../etc/passwd"}),
     ["is outside the directory"]),
    ("trace missing", ev(at=0, trace={"src": "n1", "dst": "n2", "file": "nope.csv"}), ["nope.csv", "cannot read"]),
    ("access nothing", ev(at=0, access={"node": "n1"}), ["needs an uplink, a downlink or both"]),
    ("access unit", ev(at=0, access={"node": "n1", "uplink": "3 furlongs"}), ["field 'uplink'"]),
]

BAD_TRACES = [
    ("going back", "time_s,rate\n0,1mbit\n2,2mbit\n1,3mbit\n", ["line 4", "goes back"]),
    ("bad rate", "0,1mbit\n1,fast\n", ["line 2", "'fast'"]),
    ("three columns", "0,1mbit,x\n", ["line 1", "fields (time_s,rate), got 3"]),
    ("bad time", "soon,1mbit\n", ["line 1", "'soon'"]),
    ("empty", "time_s,rate\n", ["the trace is empty"]),
]


def write(tmp_path, doc, name="scenario.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("doc,needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_scenario_refused_with_file_and_place(tmp_path, doc, needles):
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError) as info:
        load_scenario(path, topology())
    message = str(info.value)
    assert message.startswith(path + ":"), message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("text,needles", [b[1:] for b in BAD_TRACES], ids=[b[0] for b in BAD_TRACES])
def test_bad_trace_refused(tmp_path, text, needles):
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_scenario(write(tmp_path, ev(at=0, trace={"src": "n1", "dst": "n2", "file": "t.csv"})), topology())
    for needle in ["events[0]", "t.csv", *needles]:
        assert needle in str(info.value), (needle, str(info.value))


def test_invalid_json_and_duplicate_keys(tmp_path):
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        load_scenario(write(tmp_path, "{'events': []}"), topology())
    with pytest.raises(ConfigError, match="'at' appears twice"):
        load_scenario(write(tmp_path, '{"events": [{"at": 1, "at": 2, "crash": "n1"}]}'), topology())


class RecordingWorker:
    """Records every call; answers like a worker."""

    def __init__(self, netem: bool = False) -> None:
        self.calls = []
        self.netem = netem

    def capabilities(self):
        return {"netem": self.netem}

    def set_links(self, body, merge=False):
        self.calls.append(("set_links", body, merge))
        return {"version": 1, "nodes": []}

    def fault(self, body):
        parse_faults(body["faults"])  # what a worker accepts
        self.calls.append(("fault", body["faults"]))
        return {"version": 1, "results": [{"started": ["p1"]} for _ in body["faults"]]}


def ips():
    return {f"n{i}": f"10.9.0.{i + 1}" for i in range(1, 8)}


def test_bad_scenario_starts_nothing(tmp_path):
    worker = RecordingWorker()
    with pytest.raises(ConfigError):
        timeline = load_scenario(write(tmp_path, ev(at=1, crash="n9")), topology())
        ScenarioRunner(timeline, worker, ips()).start()
    assert worker.calls == []


def test_delay_refused_without_netem_before_anything_starts():
    timeline = resolve(ev(at=1, link={"src": "n1", "dst": "n2", "bw": "1mbit", "delay": "20ms"}), topology())
    worker = RecordingWorker(netem=False)
    with pytest.raises(CapabilityError, match="sch_netem"):
        ScenarioRunner(timeline, worker, ips())
    assert worker.calls == []


@pytest.mark.parametrize("link", [{"delay": "20ms"}, {"loss": "5%"}])
def test_netem_link_events_refused_without_netem_and_sent_with_it(link):
    timeline = resolve(ev(at=1, link={"src": "n1", "dst": "n2", "bw": "1mbit", **link}, **{"for": 2}), topology())
    with pytest.raises(CapabilityError, match="sch_netem"):
        ScenarioRunner(timeline, RecordingWorker(netem=False), ips())
    worker = RecordingWorker(netem=True)
    runner = ScenarioRunner(timeline, worker, ips())
    change, undo = timeline.steps
    runner.apply_step(change)
    runner.apply_step(undo)
    shapes = [call[1]["links"][0]["shape"] for call in worker.calls if call[0] == "set_links"]
    base = {"rate_bps": 10**7, "delay_ms": 0.0, "jitter_ms": 0.0, "loss_pct": 0.0, "queue_pkts": None}
    key, value = ("delay_ms", 20.0) if "delay" in link else ("loss_pct", 5.0)
    assert shapes == [{**base, "rate_bps": 10**6, key: value}, base]


def test_issue_example_resolves_and_dry_run_is_seeded_and_stable(tmp_path):
    (tmp_path / "bw_trace.csv").write_text("time_s,rate\n0,10mbit\n1.5,2mbit\n3,5mbit\n")
    path = write(tmp_path, ISSUE_EXAMPLE)
    first = load_scenario(path, topology()).render()
    assert first == load_scenario(path, topology()).render()
    other = dict(ISSUE_EXAMPLE, seed=2, time_scale=1 / 60)
    changed = load_scenario(write(tmp_path, other, "other.json"), topology()).render()
    assert [l for l in first if "revoke" in l] != [l for l in changed if "revoke" in l]
    text = "\n".join(first)
    assert any("n3 drew a lifetime" in line and "not revoked" in line for line in first)  # rate 3.3e-4/min
    for needle in ("block      n3<->n4", "unblock    n1,n2,n3|n4,n5,n6", "round 5 of n1", "crash      n5",
                   "replays bw_trace.csv (csv, 100 ms bins", "cpu 0.2 cores", "on 1s / off 1s for 30s", "1%"):
        assert needle in text, needle


def test_every_event_kind_has_its_rule_in_the_table():
    from controller.model.scenario import EVENTS, KINDS, STEP_KINDS, UNDOABLE

    assert tuple(EVENTS) == KINDS  # the table, in the order the messages list the kinds
    assert UNDOABLE == ("link", "link_down", "partition", "loss", "pause", "cpu", "memory")
    examples = {"link": {"src": "n1", "dst": "n2", "bw": "1mbit"}, "link_down": ["n1", "n2"],
                "partition": [["n1"], ["n2"]], "loss": {"src": "n1", "dst": "n2", "percent": 1}, "crash": "n1",
                "pause": "n1", "resume": "n1", "cpu": {"node": "n1", "cores": 1}, "memory": {"node": "n1", "mem": "64M"},
                "access": {"node": "n1", "uplink": "1mbit"}}
    for kind, value in examples.items():
        steps = resolve({"events": [{"at": 1, kind: value, **({"for": 2} if kind in UNDOABLE else {})}]},
                        topology()).steps
        assert [s.at_s for s in steps] == ([1, 3] if kind in UNDOABLE else [1]), kind
        assert all(s.kind in STEP_KINDS and s.event == 0 for s in steps), kind
    with pytest.raises(ConfigError, match=r"a crash event cannot be undone; 'for' is for link, link_down, "):
        resolve(ev(at=1, crash="n1", **{"for": 2}), topology())


def test_revocation_draws_follow_the_model_and_time_scale():
    doc = {"seed": 7, "time_scale": 1 / 60, "events": [
        {"at": 10, "revocation": {"nodes": [f"n{i}" for i in range(1, 8)],
                                  "lifetime": {"exponential": {"rate_per_min": 0.5}}, "notice_s": 2,
                                  "replace_after_s": {"uniform": [80, 95]}}}]}
    steps = resolve(doc, topology()).steps
    rng = random.Random(7)
    for i in range(7):
        life = rng.expovariate(0.5) * 60 / 60
        delay = rng.uniform(80, 95)
        revoke, replace = steps[2 * i], steps[2 * i + 1]
        assert revoke.kind == "revoke" and revoke.at_s == pytest.approx(10 + life)
        assert replace.kind == "replace" and replace.at_s == pytest.approx(10 + life + 2 + delay)
        assert 80 <= replace.at_s - revoke.at_s - 2 <= 95


def test_explicit_lifetimes_are_not_scaled():
    doc = {"time_scale": 0.001, "events": [{"at": 1, "revocation": {"nodes": ["n1", "n2"],
                                                                    "lifetime": {"at": [5, 9]}}}]}
    assert [s.at_s for s in resolve(doc, topology()).steps] == [6, 10]


def test_cdf_inverse_interpolates():
    rows = [[10, 0.5], [20, 1.0]]
    assert cdf_inverse(rows, 0.25) == pytest.approx(5)
    assert cdf_inverse(rows, 0.75) == pytest.approx(15)
    assert cdf_inverse(rows, 1.0) == pytest.approx(20)


def test_runner_dispatch_as_worker_calls():
    doc = {"events": [
        {"at": 0, "link": {"src": "n1", "dst": "n2", "bw": "1mbit", "both_ways": True}},
        {"at": 0, "partition": [["n1"], ["n2", "n3"]]},
        {"at": 0, "loss": {"src": "n1", "dst": "n2", "percent": 5}},
        {"at": 0, "crash": "n4"},
        {"at": 0, "memory": {"node": "n7", "mem": "64M"}},
        {"at": 0, "revocation": {"nodes": ["n5"], "lifetime": {"at": [0]}, "notice_s": 1,
                                 "replace_after_s": {"fixed": 0}}}]}
    timeline = resolve(doc, topology())
    worker = RecordingWorker()
    deaths, replaced, reshaped = [], [], []

    class Exp:  # the run the scenario plays in
        def expect_death(self, name, why):
            deaths.append((name, why, len(worker.calls)))

        def replace_node(self, name):
            replaced.append(name)

        def links_reshaped(self, links):
            reshaped.extend((link.src, link.dst, link.shape.rate_bps) for link in links)

    runner = ScenarioRunner(timeline, worker, ips(), progress=lambda _: None, experiment=Exp())
    for step in timeline.steps:
        runner.apply_step(step)
    assert replaced == ["n5"] and reshaped == [("n1", "n2", 1_000_000), ("n2", "n1", 1_000_000)]
    bare = ScenarioRunner(timeline, worker, ips(), progress=lambda _: None)  # no run: edgetb scenario
    bare.apply_step(timeline.steps[-1])
    link, block, loss, crash, memory, revoke, replace = worker.calls
    assert link == ("set_links", {"version": 1, "links": [
        {"src": "n1", "dst": "n2", "dst_ip": "10.9.0.3", "shape": {**_shape(), "rate_bps": 1_000_000}},
        {"src": "n2", "dst": "n1", "dst_ip": "10.9.0.2", "shape": {**_shape(), "rate_bps": 1_000_000}}]}, True)
    assert block[1] == [{"kind": "drop", "node": "n1", "key": "e1", "src_ips": ["10.9.0.3", "10.9.0.4"],
                         "percent": 100},
                        {"kind": "drop", "node": "n2", "key": "e1", "src_ips": ["10.9.0.2"], "percent": 100},
                        {"kind": "drop", "node": "n3", "key": "e1", "src_ips": ["10.9.0.2"], "percent": 100}]
    assert loss[1] == [{"kind": "drop", "node": "n2", "key": "e2", "src_ips": ["10.9.0.2"], "percent": 5.0}]
    assert crash[1] == [{"kind": "kill", "node": "n4"}]
    assert memory[1] == [{"kind": "limits", "node": "n7", "mem_bytes": 64 * 1024 * 1024}]
    assert revoke[1] == [{"kind": "terminate", "node": "n5", "notice_s": 1.0}]
    assert replace[1] == [{"kind": "restart", "node": "n5"}]
    assert [(n, c) for n, _, c in deaths] == [("n4", 3), ("n5", 5)]  # announced before the kill


def _shape():
    return topology().links[("n1", "n2")].shape.to_dict()


def test_access_event_is_a_merging_links_update_in_bits_per_second():
    timeline = resolve(ev(at=0, access={"node": "n1", "uplink": "2mbit", "downlink": "1mbps"}), topology())
    worker = RecordingWorker()
    runner = ScenarioRunner(timeline, worker, ips(), progress=lambda _: None)
    runner.apply_step(timeline.steps[0])
    assert worker.calls == [("set_links", {"version": 1, "links": [],
                                           "access": {"n1": {"uplink_bps": 2 * 10**6, "downlink_bps": 8 * 10**6}}},
                             True)]


def test_round_trigger_fires_once_from_the_round_on():
    timeline = resolve({"events": [{"at_round": {"node": "n1", "round": 3}, "pause": "n2", "for": 0.05},
                                   {"at": 0.01, "crash": "n3"}]}, topology())
    worker = RecordingWorker()
    runner = ScenarioRunner(timeline, worker, ips(), progress=lambda _: None)
    runner.start()
    runner.on_round("n1", 2)
    assert runner.wait(5)
    assert [r["event"] for r in runner.rows] == ["crash"]
    runner.on_round("n1", 4)  # round 3 skipped: fires on the first round past it
    runner.on_round("n1", 5)
    assert runner.wait(5)
    runner.stop()
    assert [r["event"] for r in runner.rows] == ["crash", "pause", "resume"]
    pause, resume = runner.rows[1:]
    assert resume["planned_s"] == pytest.approx(pause["planned_s"] + 0.05)
    csv_lines = runner.csv_text().splitlines()
    assert csv_lines[0] == "planned_s,applied_s,skew_ms,event,target,detail,outcome" and len(csv_lines) == 4


def test_worker_fault_validation():
    with pytest.raises(ConfigError, match="src_ips"):
        parse_fault({"kind": "drop", "node": "a", "key": "e1", "src_ips": ["1.2.3.4; reboot"]})
    with pytest.raises(ConfigError, match="key"):
        parse_fault({"kind": "drop", "node": "a", "key": "E 1", "src_ips": ["1.2.3.4"]})
    with pytest.raises(ConfigError, match="field 'argv': unknown field"):
        parse_fault({"kind": "kill", "node": "a", "argv": ["sh"]})
    with pytest.raises(ConfigError, match="kind"):
        parse_fault({"kind": "format_disk", "node": "a"})
    lines = faults.drop_lines("tb1", "e3", ["10.0.0.2"], 10)
    assert lines[1] == ("-A INPUT -s 10.0.0.2/32 -m comment --comment edgetb-tb1-scn-e3 -m statistic --mode random "
                        "--probability 0.100000 -j DROP")
    saved = "\n".join(["*filter", lines[1], lines[1].replace("e3", "e30"), "-A INPUT -j ACCEPT", "COMMIT"])
    assert faults.delete_lines(saved, "tb1", "e3") == ["*filter", "-D" + lines[1][2:], "COMMIT", ""]
    assert len(faults.delete_lines(saved, "tb1")) == 5  # every scenario rule, not the others


def test_effects_speed_before_after_and_recovery(tmp_path):
    from controller.results import tables

    # n1 does a round every 2 s all along; n2 every 2 s until revoked at 20 s, replaced at 30 s, first round at 33 s
    rows = [{"node": "n1", "time_s": float(t)} for t in range(2, 61, 2)]
    rows += [{"node": "n2", "time_s": float(t)} for t in range(2, 20, 2)] + \
            [{"node": "n2", "time_s": float(t)} for t in range(33, 61, 2)]
    applied = [{"planned_s": 20.0, "applied_s": 20.0, "event": "revoke", "target": "n2"},
               {"planned_s": 30.0, "applied_s": 30.0, "event": "replace", "target": "n2"}]
    revoke, replace = tables.scenario_effects(rows, applied, window_s=10)
    assert revoke["recovery_s"] == 13.0 and replace["recovery_s"] is None
    assert revoke["rounds_per_min_before"] == 30.0  # both nodes, a round per 2 s
    assert revoke["rounds_per_min_after"] == 15.0   # n2 gone: half the rounds per node
    (tmp_path / "scenario.csv").write_text(
        "planned_s,applied_s,skew_ms,event,target,detail,outcome\n"
        "20,20.004,4,revoke,n2,x,applied\n30,30.001,1,replace,n2,x,applied\n40,40.2,200,crash,n1,x,failed: gone\n")
    got = tables.read_scenario(str(tmp_path))
    assert [(e["event"], e["applied_s"]) for e in got] == [("revoke", 20.004), ("replace", 30.001)]


def test_agent_faults_route_is_authenticated_and_checks_its_body():
    from worker.agent import create_app

    class Host:
        testbed_id = "t1"
        seen = []

        def fault(self, body):
            from worker.api.protocol import check_version

            check_version(body)
            self.seen.append(body)
            return {"version": 1, "results": []}

    token = "x" * 32
    client = create_app(Host(), token).test_client()
    body = {"version": 1, "faults": [{"kind": "kill", "node": "n1"}]}
    assert client.post("/faults", json=body).status_code == 401
    assert client.post("/faults", json=body, headers={"Authorization": "Bearer " + "y" * 32}).status_code == 401
    assert Host.seen == []
    resp = client.post("/faults", json={"faults": []}, headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 400 and "version" in resp.get_json()["error"] + str(resp.get_json().get("detail"))
    assert client.post("/faults", json=body, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert Host.seen == [body]


def test_pause_and_limits_are_prepared_ahead_and_are_not_rows():
    timeline = resolve({"events": [{"at": 1.2, "pause": "n2", "for": 0.05},
                                   {"at": 0.3, "cpu": {"node": "n3", "cores": 0.5}},
                                   {"at": 0.2, "crash": "n4"}]}, topology())
    worker = RecordingWorker()
    runner = ScenarioRunner(timeline, worker, ips(), progress=lambda _: None)
    runner.start()
    assert runner.wait(5)
    runner.stop()
    faults_sent = [f for kind, *rest in worker.calls if kind == "fault" for f in rest[0]]
    prepares = [f for f in faults_sent if f["kind"] == "prepare"]
    assert sorted((f["node"], f["for"]) for f in prepares) == [("n2", "freeze"), ("n3", "limits")]
    order = [(f["kind"], f["node"]) for f in faults_sent]
    assert order.index(("prepare", "n2")) < order.index(("freeze", "n2"))  # same target: in order
    assert order.index(("prepare", "n3")) < order.index(("limits", "n3"))
    assert sorted(r["event"] for r in runner.rows) == ["crash", "limits", "pause", "resume"]


def test_a_failed_preparation_leaves_the_step_to_do_it_all():
    class OldWorker(RecordingWorker):  # an agent that does not know 'prepare'
        def fault(self, body):
            if body["faults"][0]["kind"] == "prepare":
                raise ConfigError("faults[0]: needs 'kind'")
            return super().fault(body)

    timeline = resolve({"events": [{"at": 0.05, "pause": "n2"}]}, topology())
    runner = ScenarioRunner(timeline, OldWorker(), ips(), progress=lambda _: None)
    runner.start()
    assert runner.wait(5)
    runner.stop()
    assert [(r["event"], r["outcome"]) for r in runner.rows] == [("pause", "applied")]


def test_prepare_fault_names_what_it_prepares():
    assert parse_fault({"kind": "prepare", "node": "a", "for": "freeze"}).to_dict()["for"] == "freeze"
    with pytest.raises(ConfigError, match="field 'for': 'reboot' is not one of 'freeze', 'limits'"):
        parse_fault({"kind": "prepare", "node": "a", "for": "reboot"})
    with pytest.raises(ConfigError, match="missing field 'for'"):
        parse_fault({"kind": "prepare", "node": "a"})


def test_a_link_step_moves_the_runs_topology_and_rates(tmp_path):
    from controller.run.experiment import Experiment
    from controller.run.nodes import Nodes

    topo = topology()
    structure = {"n1": {"sync": 1}, "n2": {"sync": 1}}
    exp = Experiment(topo, Nodes(str(tmp_path), None, structure), structure, progress=lambda _: None)
    exp.t_start_monotonic = 0.0  # started long ago: the change is at "now"
    timeline = resolve(ev(at=0, link={"src": "n1", "dst": "n2", "bw": "1mbit"}, **{"for": 2}), topo)
    runner = ScenarioRunner(timeline, RecordingWorker(), ips(), progress=lambda _: None, experiment=exp)
    change, undo = timeline.steps
    runner.apply_step(change)
    assert exp.topology.links[("n1", "n2")].shape.rate_bps == 1_000_000 == exp.rates.now(("n1", "n2"))
    assert exp.rates.at(("n1", "n2"), 0.0) == 10_000_000  # from the start until the step
    runner.apply_step(undo)
    assert exp.topology.links[("n1", "n2")].shape.rate_bps == 10_000_000 == exp.rates.now(("n1", "n2"))
    assert [rate for _, rate in exp.rates.steps(("n1", "n2"))] == [10_000_000, 1_000_000, 10_000_000]


def test_a_recorded_trace_is_one_step_replayed_bin_by_bin_from_its_offset(tmp_path):
    from controller.run.trace_replay import TracedLink

    (tmp_path / "cell.down").write_text("0\n0\n150\n160\n350\n")  # packets at these ms
    trace = {"src": "n1", "dst": "n2", "file": "cell.down", "format": "mahimahi", "bin_ms": 100}
    timeline = load_scenario(write(tmp_path, ev(at=3, trace=trace)), topology())
    (step,) = timeline.steps
    assert (step.at_s, step.kind, step.params["pairs"]) == (3, "trace", [("n1", "n2")])
    assert timeline.replays == [step.params["replay"]]  # (its nodes are made with one-frame segments)
    link = TracedLink("n1", "n2", step.params["replay"], start_s=3.0)
    packet_bps = 1500 * 8 * 10  # one packet a 100 ms bin
    # bins: 0-100 ms 2 packets, 100-200 ms 2, 200-300 ms none (the floor), 300-400 ms 1, then it holds
    assert [link.rate_at(3 + k / 10) for k in range(6)] == [2 * packet_bps] * 2 + [packet_bps] * 4  # (the trickle: a packet a bin)
    shifted = load_scenario(write(tmp_path, ev(at=0, trace={**trace, "offset_s": 0.2, "loop": True})), topology())
    link = TracedLink("n1", "n2", shifted.steps[0].params["replay"])
    assert [link.rate_at(k / 10) for k in range(5)] == [packet_bps, packet_bps, 2 * packet_bps, 2 * packet_bps, packet_bps]
    (tmp_path / "bad.down").write_text("0\n20\n10\n")
    with pytest.raises(ConfigError, match=r"events\[0\], trace: .*bad.down, line 3: time goes back"):
        load_scenario(write(tmp_path, ev(at=0, trace={**trace, "file": "bad.down"})), topology())
    with pytest.raises(ConfigError, match=r"offset_s.*past the end of cell.down"):
        load_scenario(write(tmp_path, ev(at=0, trace={**trace, "offset_s": 9})), topology())