"""Node-side pure logic: the weights format (never pickle), the numpy model, path confinement, events."""
import json
import os
import struct
import time

import numpy as np
import pytest

from dml_app.models.numpy.mlp import NumpyMLP
from dml_app.runtime.events import EventLog, read_events
from dml_app.runtime.http import HttpError
from dml_app.wire import weights


def test_weights_round_trip_keeps_dtype_shape_and_meta():
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1.5], dtype=np.float64),
              np.zeros((0, 3), dtype=np.float32), np.array(7, dtype=np.int64)]
    got, meta = weights.decode(weights.encode(arrays, {"from": "n1", "round": 3}))
    assert meta == {"from": "n1", "round": 3}
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


META = {"format": "edgetb-weights", "version": "2", "meta": "{}"}


def _message(tensors: dict, payload: bytes = b"", meta: dict | None = META) -> bytes:
    header = {**({"__metadata__": meta} if meta is not None else {}), **tensors}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def _f32(n: int, start: int = 0) -> dict:
    return {"dtype": "F32", "shape": [n], "data_offsets": [start, start + 4 * n]}


@pytest.mark.parametrize("data,problem", [
    (b"", "shorter"),
    (struct.pack("<Q", 10**9) + b"{}", "does not fit"),
    (_message({}, meta={**META, "version": "1"}), "version"),
    (_message({}, meta=None), "version"),
    (_message({"0000": {"dtype": "O", "shape": [1], "data_offsets": [0, 8]}}, b"x" * 8), "bad spec"),
    (_message({"0000": _f32(1000)}, b"x" * 8), "past the end"),
    (_message({"0000": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "not allowed"),
    (_message({"0000": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"x" * 4), "do not hold"),
    (_message({"0000": _f32(2), "0001": _f32(2, 4)}, b"x" * 12), "overlaps"),
    (_message({"0000": _f32(1), "0002": _f32(1, 4)}, b"x" * 8), "named 0000"),
    (_message({}, b"extra"), "unexpected bytes"),
    (_message({}, meta={**META, "meta": "{nope"}), "meta is not"),
    (struct.pack("<Q", 3) + b"abc", "not JSON"),
    (__import__("pickle").dumps([np.zeros(3)]), "header"),
])
def test_weights_reject_malformed_and_pickled_input(data, problem):
    with pytest.raises(weights.WeightsFormatError, match=problem):
        weights.decode(data)


def test_object_arrays_cannot_be_sent():
    with pytest.raises(weights.WeightsFormatError):
        weights.encode([np.array([{"a": 1}], dtype=object)])


def test_mlp_learns_separable_data_and_round_trips_weights():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 5)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    model = NumpyMLP([5, 16, 2], learning_rate=0.02, seed=1)
    before = model.evaluate(x, y)[1]
    model.train(x, y, epochs=20, batch_size=32)
    loss, acc = model.evaluate(x, y)
    assert acc > 0.95 and acc > before
    other = NumpyMLP([5, 16, 2], seed=2)
    other.set_weights(model.get_weights())
    assert other.evaluate(x, y)[1] == acc
    with pytest.raises(ValueError, match="shape"):
        other.set_weights([w.T for w in model.get_weights()])


def test_same_seed_same_start():
    a, b = NumpyMLP([4, 8, 3], seed=5), NumpyMLP([4, 8, 3], seed=5)
    assert all(np.array_equal(p, q) for p, q in zip(a.get_weights(), b.get_weights()))


def test_confined_paths(tmp_path):
    from dml_app.node import confined

    (tmp_path / "dataset").mkdir()
    assert confined(str(tmp_path), "dataset/a.npz") == str(tmp_path / "dataset" / "a.npz")
    for bad in ("../etc/passwd", "/etc/passwd", "dataset/../../x"):
        with pytest.raises(HttpError):
            confined(str(tmp_path), bad)


def test_event_log_lines(tmp_path):
    log = EventLog(str(tmp_path / "e.jsonl"), "run1", "n1")
    log.write("round", round=1, accuracy=0.5)
    log.write("done", rounds=1)
    with open(tmp_path / "e.jsonl", "a") as f:
        f.write('{"torn": ')
    events = read_events(str(tmp_path / "e.jsonl"))
    assert [e["type"] for e in events] == ["round", "done"]
    assert events[0]["run_id"] == "run1" and events[0]["node"] == "n1" and events[0]["v"] == 1


def test_one_reader_parses_event_lines():
    from dml_app.runtime.events import MAX_LINE_BYTES, parse_events

    long = '{"type": "round", "pad": "%s"}' % ("x" * MAX_LINE_BYTES)
    lines = ['{"type": "started"}', "not json", "[1, 2]", '{"no": "type"}', long, '{"type": "done", "t": 1.5}\n',
             '{"type": "torn']
    assert parse_events(lines) == [{"type": "started"}, {"type": "done", "t": 1.5}]
    assert parse_events([]) == []


def test_rng_is_seeded_and_well_shaped():
    from dml_app.models.numpy.rand import Rng

    a, b = Rng(7), Rng(7)
    assert np.array_equal(a.standard_normal((3, 4)), b.standard_normal((3, 4)))
    normal = Rng(1).standard_normal(200_000)
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 1) < 0.01
    uniform = Rng(2).uniform(100_000)
    assert uniform.min() >= 0 and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.01
    order = Rng(3).permutation(1000)
    assert sorted(order.tolist()) == list(range(1000)) and order.tolist() != list(range(1000))


def test_node_process_keeps_numpy_random_and_ssl_out():
    """The node's startup imports stay slim (each MiB counts at 500 nodes per host)."""
    import subprocess
    import sys as _sys

    code = ("import runpy, sys; sys.argv = ['dml_app.node', '--help']\n"
            "try:\n    runpy.run_module('dml_app.node', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('numpy.random', 'ssl', '_hashlib', 'importlib.metadata') if m in sys.modules))")
    out = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip().splitlines()[-1] == "[]"


# roles that survive: peers that die and come back ------------------------------------------------
def _role_ctx(tmp_path, name: str, conf: dict):
    from dml_app.models.make import make_model
    from dml_app.roles.base import Context

    model = make_model({"hidden": [3], "seed": 0}, input_shape=2, n_classes=3)
    data = (np.zeros((4, 2)), np.array([0, 1, 2, 0]), np.zeros((2, 2)), np.array([0, 1]))
    return Context(name, model, data, conf, {}, EventLog(str(tmp_path / f"{name}.jsonl"), "r", name),
                   lambda *a, **k: None)


def test_peer_health_backs_off_doubling_and_takes_a_peer_back():
    from dml_app.roles.shared import PeerHealth

    now = [100.0]
    health = PeerHealth(clock=lambda: now[0], first_s=2, most_s=5)
    assert health.failed("a") == (True, 2) and health.usable(["a", "b"]) == ["b"]
    now[0] += 2
    assert health.usable(["a", "b"]) == ["a", "b"]  # tried again once its back-off ends
    assert health.failed("a") == (False, 4) and health.failed("a") == (False, 5)  # doubling, capped
    assert health.is_down("a") and health.alive("a") and not health.alive("a")
    assert health.usable(["a"]) == ["a"]


def test_a_send_may_take_its_time_at_the_link_rate_plus_a_margin(tmp_path):
    from dml_app.roles import base
    from dml_app.roles.base import Role

    role = Role(_role_ctx(tmp_path, "n1", {"connect": {"n2": "x:1", "n3": "y:1"}, "forward": {"n4": "n2"},
                                           "link_bps": {"n2": 1_000_000, "n3": 0}}))
    assert role.send_timeout_s("n2", 125_000) == pytest.approx(base.SEND_BASE_S + base.SEND_MARGIN * 1.0)
    assert role.send_timeout_s("n4", 125_000) == role.send_timeout_s("n2", 125_000)  # its next hop's link
    assert role.send_timeout_s("n3", 125_000) == base.DEFAULT_SEND_TIMEOUT_S  # no rate known


def test_gossip_skips_a_dead_peer_and_uses_it_again_once_it_answers(tmp_path):
    from dml_app.roles.gossip import GossipRole

    role = GossipRole(_role_ctx(tmp_path, "n1", {"connect": {"n2": "x:1", "n3": "y:1"}, "sync": 1}))
    dead, tried = {"n2"}, []

    def post_weights_answer(peer, round_no):
        tried.append(peer)
        return None if peer in dead else {}

    role.post_weights_answer = post_weights_answer
    for r in range(1, 5):
        role.send(r)
    assert tried.count("n2") == 1, tried  # dropped at its first failure, skipped in its back-off
    dead.clear()
    role.health._down["n2"] = (0.0, 2.0)  # its back-off is over
    role.rng.shuffle = lambda peers: peers.sort()  # n2 first
    role.send(5)
    kinds = [(e["type"], e["peer"]) for e in read_events(role.ctx.events.path)]
    assert ("peer_dropped", "n2") in kinds and ("peer_rejoined", "n2") in kinds
    assert not role.health.is_down("n2")


def test_fl_picks_from_live_trainers_while_they_are_enough():
    from dml_app.roles.fl import candidates

    assert candidates(["a", "b", "c"], ["a", "c"], 2) == ["a", "c"]
    assert candidates(["a", "b", "c"], ["a"], 2) == ["a", "b", "c"]  # too few: the dropped are tried too


def test_etree_round_closes_at_its_deadline_with_a_quorum_and_skips_a_silent_child(tmp_path):
    import threading
    import time

    from dml_app.roles.etree import ETreeRole
    from dml_app.runtime.http import Request
    from dml_app.wire import weights as wire

    conf = {"positions": [{"layer": 2, "parent": None, "children": ["c1", "c2", "c3"], "sync": 2,
                           "deadline_s": 0.6, "quorum": 0.5}], "sync": 2}
    agg = ETreeRole(_role_ctx(tmp_path, "agg", conf))

    def post_weights(peer, path, round_no, weights=None, meta=None, timeout_s=None, retries=1):
        if peer == "c2":
            return True  # taken, never answered
        body = wire.encode(weights, {"layer": 1, "samples": 10, "ask": meta["ask"]})
        threading.Thread(target=agg.on_update, args=(Request("POST", "/etree/update", {}, body, wire.CONTENT_TYPE,
                                                             sender=peer, hop=peer),)).start()
        return True

    agg.post_weights = post_weights
    started = time.monotonic()
    agg.run()
    first, second = [e for e in read_events(agg.ctx.events.path) if e["type"] == "round"]
    assert 0.5 <= first["t_end"] - first["t_start"] < 2.0 and time.monotonic() - started < 3.0
    assert first["closed"] == "quorum" and first["missing"] == ["c2"] and first["received_models"] == 2
    assert second["skipped"] == ["c2"] and second["closed"] == "all"  # in its back-off: not asked
    kinds = [e["type"] for e in read_events(agg.ctx.events.path)]
    assert "peer_dropped" in kinds and "quorum_round" in kinds


def test_etree_round_without_a_quorum_keeps_its_model(tmp_path):
    from dml_app.roles.etree import ETreeRole

    conf = {"positions": [{"layer": 2, "parent": None, "children": ["c1", "c2"], "sync": 1, "deadline_s": 0.2,
                           "quorum": 1.0}], "sync": 1}
    agg = ETreeRole(_role_ctx(tmp_path, "agg", conf))
    agg.post_weights = lambda peer, *a, **k: peer == "c1"  # c1 takes the model and never answers; c2 is gone
    before = agg.ctx.model.get_weights()
    agg.run()
    assert all(np.array_equal(a, b) for a, b in zip(before, agg.ctx.model.get_weights()))
    failed = [e for e in read_events(agg.ctx.events.path) if e["type"] == "round_failed"]
    assert failed and "0 of 2" in failed[0]["detail"]


# the controller's side: deaths expected, replacements ----------------------------------------------
class _Worker:
    def __init__(self) -> None:
        self.running: dict[str, bool] = {}
        self.started: list[str] = []
        self.stopped: list[str] = []

    def processes(self) -> dict:
        return {"processes": [{"id": i, "running": up, "returncode": None if up else -9}
                              for i, up in self.running.items()]}

    def start_node(self, name: str, body: dict) -> dict:
        proc = f"{name}-{len(self.started) + 1}"
        self.started.append(proc)
        self.running[proc] = True
        return {"id": proc, "pid": 1000 + len(self.started)}

    def stop_process(self, name: str, proc: str) -> dict:
        self.stopped.append(proc)
        return {}


def _experiment(tmp_path, monkeypatch):
    from controller.run.experiment import Experiment
    from controller.run.nodes import Nodes
    from controller.model.topology import Topology

    topo = Topology()
    for name in ("n1", "n2"):
        topo.add_node(name)
    worker = _Worker()
    structure = {"n1": {"sync": 3}, "n2": {"sync": 3}}
    exp = Experiment(topo, Nodes(str(tmp_path), worker, structure), structure, progress=lambda m: None)
    exp.nodes.controller_url = "http://c"
    for name in exp.nodes:
        exp.nodes.start_process(name)
        exp.nodes[name].state = "running"
    exp.phase = "running"
    finishes = []
    monkeypatch.setattr(exp, "finish", lambda how="finished": finishes.append(how))
    return exp, worker, finishes


def test_an_expected_death_is_the_nodes_ending_and_the_run_does_not_wait_for_it(tmp_path, monkeypatch):
    from worker.api.errors import ConfigError, NotFound

    exp, worker, finishes = _experiment(tmp_path, monkeypatch)
    for bad in ("crashed; rm -rf", "", "running", "x" * 61, "crashed\x1b[2J"):
        with pytest.raises(ConfigError, match="a few words"):
            exp.expect_death("n1", bad)
    with pytest.raises(NotFound, match="no node 'n9'"):
        exp.expect_death("n9", "crashed")
    exp.expect_death("n1", "crashed  by the scenario")  # (as the scenario runner says it)
    assert exp.waiting_on() == ["n2"] and exp.nodes["n1"].state == "running"
    worker.running[exp.nodes["n1"].process_id] = False
    exp.check_nodes(poll_health=False)
    assert exp.nodes["n1"].state == "crashed by the scenario" and exp.nodes["n1"].ending == "crashed by the scenario"
    assert not finishes  # n2 still runs
    exp.nodes["n2"].state = "done"
    exp.check_all_settled()
    for _ in range(50):
        if finishes:
            break
        import time
        time.sleep(0.02)
    assert finishes == ["completed"]
    assert [e["type"] for e in exp.membership.rows] == ["death_expected", "node_died"]


def test_an_unexpected_death_is_still_a_failure(tmp_path, monkeypatch):
    exp, worker, _ = _experiment(tmp_path, monkeypatch)
    worker.running[exp.nodes["n2"].process_id] = False
    exp.check_nodes(poll_health=False)
    assert exp.nodes["n2"].state == "failed" and "process exited" in exp.nodes["n2"].detail


def test_a_replaced_node_gets_its_confs_and_its_ending_shows_both_lives(tmp_path, monkeypatch):
    from worker.api.errors import ConfigError

    exp, worker, _ = _experiment(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="the node is running"):
        exp.replace_node("n1")
    calls = []
    monkeypatch.setattr(exp.nodes, "health", lambda name: {"state": "waiting"})
    monkeypatch.setattr(exp.confs, "get", lambda name, kind: {"shard": "s.npz"})
    monkeypatch.setattr(exp.confs, "structures", lambda: {"n1": {"role": "ring"}, "n2": {"role": "ring"}})
    monkeypatch.setattr(exp.nodes, "post", lambda name, path, body: calls.append((name, path, body)) or {})
    first = exp.nodes["n1"].process_id
    exp.expect_death("n1", "revoked")
    worker.running[first] = False
    exp.check_nodes(poll_health=False)
    life = exp.replace_node("n1")
    assert life["life"] == 2 and life["lives"][0]["ended"] == "revoked"
    assert worker.stopped == [first] and exp.nodes["n1"].process_id != first
    assert [p for _, p, _ in calls] == ["/conf/dataset", "/conf/structure", "/prepare", "/start"]
    assert calls[1][2] == {"role": "ring", "life": 2}  # a replacement knows it is one
    node = exp.nodes["n1"]
    assert node.state == "running" and not node.expected_death and "n1" in exp.waiting_on()
    node.state = "done"
    assert node.ending == "revoked, replaced, done"
    lives = exp.lives()
    assert [life["ended"] for life in lives["nodes"]["n1"]] == ["revoked", "done"]
    assert [e["type"] for e in lives["events"]] == ["death_expected", "node_died", "node_replaced"]
    exp._finishing = True
    with pytest.raises(ConfigError, match="finishing"):
        exp.replace_node("n2")


def test_membership_rows_merge_the_nodes_and_the_controllers_changes_in_time_order():
    from controller.results.run_dir import csv_bytes
    from controller.results.tables import MEMBERSHIP_COLUMNS, membership_rows

    events = {"n1": [{"type": "round", "t": 1.0, "round": 1},
                     {"type": "peer_dropped", "t": 3.0, "round": 2, "peer": "n3", "retry_in_s": 2.0}],
              "n2": [{"type": "ring_formed", "t": 5.0, "round": 3, "members": ["n1", "n2"], "dropped": ["n3"]}]}
    rows = membership_rows(events, [{"t": 2.0, "node": "n3", "type": "node_died", "why": "crashed"}])
    assert [(r["node"], r["event"], r["peer"]) for r in rows] == [
        ("controller", "node_died", "n3"), ("n1", "peer_dropped", "n3"), ("n2", "ring_formed", "")]
    assert json.loads(rows[2]["detail"]) == {"members": ["n1", "n2"], "dropped": ["n3"]}
    assert csv_bytes(MEMBERSHIP_COLUMNS, rows).decode().splitlines()[0] == "t,node,event,peer,round,detail"


def test_the_progress_line_counts_nodes_that_died_as_expected():
    from controller.run.progress import Progress

    line = Progress({"a": 3, "b": 3, "c": 3}, lambda m: None).line({"a": "running", "b": "crashed", "c": "done"})
    assert "1 running, 1 done, 1 crashed" in line


def test_the_compute_thread_runs_off_the_event_loop_and_in_order():
    """A node's training runs on a thread of its own: the event loop serves meanwhile, and the
    calls keep their order (one thread)."""
    import threading
    import time

    import gevent

    from dml_app.runtime.compute import ComputeThread

    compute, ran, ticks = ComputeThread(), [], []

    def train(i: int) -> int:
        time.sleep(0.3)  # the real sleep: a call that holds its thread
        ran.append((i, threading.get_ident()))
        return i * 2

    ticker = gevent.spawn(lambda: [ticks.append(gevent.sleep(0.02)) for _ in range(10)])
    assert [compute.run(train, 1), compute.run(train, 2)] == [2, 4]
    assert len(ticks) == 10  # the loop went on while the calls held their thread
    ticker.join()
    assert [i for i, _ in ran] == [1, 2] and {t for _, t in ran} != {threading.get_ident()}


def test_every_role_is_told_to_start_at_one_moment(tmp_path, monkeypatch):
    from controller.run.experiment import MAX_START_SPREAD_S, start_spread_s

    assert start_spread_s(0.0) > 0 and start_spread_s(2.0) > 2.0 and start_spread_s(1e6) == MAX_START_SPREAD_S
    exp, _, _ = _experiment(tmp_path, monkeypatch)
    exp.phase = "ready"
    for name in exp.nodes:
        exp.nodes[name].state, exp.nodes[name].dataset_conf, exp.nodes[name].structure_conf = "up", True, True
    exp._pass_s = 1.0  # a pass of light calls to every node took a second
    calls = []

    def post(name, path, body):
        calls.append((time.monotonic(), path, body))
        time.sleep(0.1)
        return {}
    monkeypatch.setattr(exp.nodes, "post", post)
    monkeypatch.setattr(exp.recording, "start_captures", lambda: None)
    monkeypatch.setattr(exp.recording, "start_telemetry", lambda out, rates: None)
    monkeypatch.setattr(exp, "watch", lambda: None)
    exp.start()
    starts = [(t + body["start_in_s"]) for t, path, body in calls if path == "/start"]
    assert len(starts) == 2 and all(0 < body["start_in_s"] <= start_spread_s(1.0)
                                    for _, path, body in calls if path == "/start")
    assert max(starts) - min(starts) < 0.05  # the same moment, whenever each call went


@pytest.mark.parametrize("delay", [-1, 61, True, "1", None])
def test_a_node_refuses_a_start_delay_out_of_bounds(tmp_path, delay):
    from dml_app.node import NodeService
    from dml_app.runtime.http import Request

    node = NodeService("n1", "http://c", "r1", str(tmp_path), 4444)
    body = json.dumps({"start_in_s": delay}).encode()
    with pytest.raises(HttpError, match="start_in_s"):
        node.start(Request("POST", "/start", {}, body, "application/json"))
    assert node.state == "waiting"
