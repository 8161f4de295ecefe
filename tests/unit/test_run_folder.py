"""The run folder's writer (no links followed, atomic) and the aggregate progress line."""
from __future__ import annotations

import json

import pytest

from controller.model.topology import Topology
from controller.results.run_dir import RunDir, seeds, topology_doc
from controller.run.progress import Progress
from worker.api.errors import ConfigError


def test_files_land_atomically_beneath_the_run_dir(tmp_path):
    out = RunDir(str(tmp_path / "log" / "run1"))
    out.write_json("summary.json", {"a": 1})
    out.write_bytes("events/n1.jsonl", b"{}\n")
    out.write_bytes("plots/p.png", b"png")
    assert json.loads((tmp_path / "log/run1/summary.json").read_text()) == {"a": 1}
    assert (tmp_path / "log/run1/events/n1.jsonl").read_bytes() == b"{}\n"
    assert (tmp_path / "log/run1/plots/p.png").read_bytes() == b"png"
    assert not [p for p in (tmp_path / "log/run1").rglob(".*.tmp")]


def test_a_planted_link_is_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "events").symlink_to(outside)  # a node planted it
    (run / "summary.json").symlink_to(outside / "passwd")
    out = RunDir(str(run))
    with pytest.raises(ConfigError, match="events/n1.jsonl"):
        out.write_bytes("events/n1.jsonl", b"x")
    out.write_json("summary.json", {"ok": True})  # replaces the link itself, not its target
    assert not (outside / "passwd").exists() and not list(outside.iterdir())
    assert not (run / "summary.json").is_symlink()
    with pytest.raises(ConfigError):
        out.read_bytes("events/n1.jsonl", 100)


def test_a_run_dir_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    RunDir(str(tmp_path / "log"))  # fine: a fresh directory
    with pytest.raises(ConfigError, match="not a link"):
        RunDir(str(tmp_path / "run"))
    RunDir(str(tmp_path / "log")).close()


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a//b", "a/./b", ""])
def test_paths_must_stay_inside(tmp_path, bad):
    with pytest.raises(ConfigError):
        RunDir(str(tmp_path / "r")).write_bytes(bad, b"x")


def test_progress_says_one_aggregate_line_per_round_or_period():
    said: list[str] = []
    now = [0.0]
    p = Progress({"n1": 20, "n2": 20}, said.append, clock=lambda: now[0])
    states = {"n1": "running", "n2": "running"}
    assert p.tick(states) is None  # nothing new
    p.report("n1", 1, 0.5, bytes_sent=1_000_000)
    p.report("n2", 1, 0.7, bytes_sent=500_000)
    line = p.tick(states)
    assert line == "round 1/20 · 2 running · accuracy mean 0.600 min 0.500 · 1.5 MB moved"
    p.report("n1", 1, 0.6)
    assert p.tick(states) is None  # same round, within the period
    now[0] = 6.0
    assert "accuracy mean 0.650" in p.tick(states)
    p.report("n1", 2, 0.9)
    assert p.tick({"n1": "done", "n2": "failed"}).startswith("round 1-2/20 · 1 done, 1 failed")
    assert len(said) == 3


def test_progress_counts_etree_rounds_per_layer():
    p = Progress({"a": 5, "b": 25, "c": 25}, lambda s: None)
    p.report("a", 3, 0.8, layer=2)
    p.report("b", 14, 0.7, layer=1)
    p.report("c", 15, 0.75, layer=1)
    assert p.line({"a": "running"}).startswith("layer 1 round 14-15, layer 2 round 3 · 1 running")


def test_run_record_names_each_model_by_its_kind_and_its_own_keys():
    from controller.results.run_dir import models

    structure = {"n1": {"model": {"kind": "torch", "name": "lenet5", "seed": 0}},
                 "n2": {"model": {"kind": "torch", "name": "lenet5", "seed": 0}},
                 "n3": {"model": {"module": "dml_user/nns/torch_cnn.py", "kind": "torch", "filters": 8}},
                 "n4": {"model": {"kind": "tf", "name": "lenet5"}}, "n5": {}}
    assert models(structure) == [
        {"kind": "torch", "label": "lenet5 · torch", "model": {"kind": "torch", "name": "lenet5", "seed": 0},
         "nodes": ["n1", "n2"]},
        {"kind": "torch", "label": "nns/torch_cnn.py · torch",  # (the user's path, not the staged copy's)
         "model": {"kind": "torch", "module": "nns/torch_cnn.py", "filters": 8}, "nodes": ["n3"]},
        {"kind": "keras", "label": "lenet5 · keras", "model": {"kind": "keras", "name": "lenet5"}, "nodes": ["n4"]},
        {"kind": "numpy", "label": "mlp · numpy", "model": {"kind": "numpy"}, "nodes": ["n5"]}]


def test_run_record_names_seeds_and_rates():
    assert seeds({"n1": {"model": {"seed": 3}}, "n2": {"model": {}}}, {"seed": 0}) == {"dataset": 0,
                                                                                     "nodes": {"n1": 3}}
    topo = Topology()
    topo.add_node("n1")
    topo.add_node("n2")
    topo.add_link("n1", "n2", "10mbps")
    doc = topology_doc(topo, {"n1": "10.1.0.2", "n2": "10.1.0.3"})
    assert [n["ip"] for n in doc["nodes"]] == ["10.1.0.2", "10.1.0.3"]
    assert doc["links"][0]["rate_bps"] == 80_000_000


class _Worker:
    """A worker whose processes all run (the monitor's view of the host)."""

    is_local = False

    def processes(self) -> dict:
        return {"processes": []}


def _experiment(tmp_path):
    from controller.run.experiment import Experiment
    from controller.run.nodes import Nodes

    topo = Topology()
    for name in ("n1", "n2"):
        topo.add_node(name)
    structure = {"n1": {"sync": 3}, "n2": {"sync": 3}}
    exp = Experiment(topo, Nodes(str(tmp_path), _Worker(), structure), structure, progress=lambda m: None)
    exp.phase = "running"
    for node in exp.nodes.values():
        node.state, node.up = "running", True
    return exp


def test_an_oversized_log_fails_its_node_and_the_monitor_goes_on(tmp_path, monkeypatch):
    from controller.run import nodes

    exp = _experiment(tmp_path)
    monkeypatch.setattr(exp.nodes, "health", lambda name: {"state": "done"})

    def fetch(name: str):
        if name == "n1":
            raise ConfigError(f"log of n1 is larger than {nodes.MAX_LOG_BYTES} bytes")
        return b'{"v":1,"type":"done","node":"n2","run_id":"r","t":0}\n'

    monkeypatch.setattr(exp.nodes, "fetch_log", fetch)
    monkeypatch.setattr(exp, "check_all_settled", lambda: None)
    exp.check_nodes(poll_health=True)
    exp._health.join(timeout=10)
    assert exp.nodes["n1"].state == "failed" and "larger than" in exp.nodes["n1"].detail
    assert exp.nodes["n2"].state == "done"


def test_the_monitor_polls_only_the_nodes_it_has_not_heard_from_lately(tmp_path, monkeypatch):
    import time

    from controller.run.experiment import HEALTH_POLL_S

    exp = _experiment(tmp_path)
    polled = []
    monkeypatch.setattr(exp.nodes, "health", lambda name: polled.append(name) or {"state": "running"})
    exp.nodes["n1"].heard_at = time.monotonic()  # a /print just now
    exp.nodes["n2"].heard_at = time.monotonic() - HEALTH_POLL_S - 1
    exp.check_nodes(poll_health=True)
    exp._health.join(timeout=10)
    assert polled == ["n2"] and exp.nodes["n2"].heard_at > time.monotonic() - 5  # it answered
    exp.check_nodes(poll_health=True)
    assert exp._health.join(timeout=10) is None and polled == ["n2"]  # heard from just now


def test_slow_health_calls_do_not_hold_up_the_monitor(tmp_path, monkeypatch):
    """The /health calls of a pass run in a thread of their own; no second pass starts while
    one is in flight (at a thousand nodes, calls one after another held the monitor a minute)."""
    import threading
    import time

    exp = _experiment(tmp_path)
    release, polled = threading.Event(), []
    monkeypatch.setattr(exp.nodes, "health", lambda name: polled.append(name) or release.wait(10) and None)
    started = time.monotonic()
    exp.check_nodes(poll_health=True)
    exp.check_nodes(poll_health=True)
    assert time.monotonic() - started < 1.0
    release.set()
    exp._health.join(timeout=10)
    assert sorted(polled) == ["n1", "n2"]


def test_the_monitor_loop_outlives_an_unexpected_error(tmp_path, monkeypatch):
    exp = _experiment(tmp_path)
    calls = []

    def boom(poll_health: bool) -> None:
        calls.append(poll_health)
        if len(calls) == 1:
            raise RuntimeError("a bug in one pass")
        exp.phase = "finished"  # the second pass ends the run

    monkeypatch.setattr(exp, "check_nodes", boom)
    monkeypatch.setattr("controller.run.experiment.time.sleep", lambda s: None)
    exp.watch()
    assert len(calls) == 2


def test_a_node_trickling_its_log_is_given_up_after_the_deadline(tmp_path, monkeypatch):
    """A node answering /log one byte at a time (each within the socket timeout) held the
    finish for as long as it liked; now the whole log must arrive within LOG_FETCH_S."""
    import socket
    import threading
    import time

    from controller.run import nodes
    from worker.api.errors import TestbedTimeout

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nContent-Length: 40\r\n\r\n")
        while not stop.is_set():
            try:
                conn.sendall(b"{")
            except OSError:
                break
            time.sleep(0.2)
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    monkeypatch.setattr(nodes, "LOG_FETCH_S", 1.5)
    exp = _experiment(tmp_path)
    exp.nodes["n1"].ip, exp.nodes.port = "127.0.0.1", listener.getsockname()[1]
    started = time.monotonic()
    try:
        with pytest.raises(TestbedTimeout, match="n1's answer to /log took longer than 1.5s"):
            exp.nodes.fetch_log("n1")
    finally:
        stop.set()
        listener.close()
    assert time.monotonic() - started < 5


def test_csv_bytes_is_the_one_writer_of_the_folders_tables():
    from controller.results.run_dir import csv_bytes, short_cell

    rows = [{"a": 1, "b": None, "c": 0.5, "extra": "ignored"}, {"a": "x,y", "c": float("nan")}]
    assert csv_bytes(["a", "b", "c"], rows) == b'a,b,c\n1,,0.5\n"x,y",,nan\n'
    assert csv_bytes(["a", "b", "c"], rows, cell=short_cell) == b'a,b,c\n1,,0.5\n"x,y",,\n'
    assert [short_cell(v) for v in (1 / 3, 2e15, None, 7, float("inf"))] == ["0.333333", "2000000000000000", "", "7", ""]


def test_finite_number_keeps_numbers_and_parses_cells():
    from controller.results.run_dir import finite_float, finite_number

    assert [finite_number(v) for v in (3, 0.5, "2.5", " 4 ", "", "x", None, True, float("nan"), "inf", [1])] == \
        [3, 0.5, 2.5, 4.0, None, None, None, None, None, None, None]
    assert isinstance(finite_number(3), int) and finite_float(3) == 3.0 and isinstance(finite_float(3), float)
    # what a node wrote in JSON: a string is no number there; nor is an int no float can hold
    assert [finite_number(v, cells=False) for v in (3, 0.5, "2.5", b"1", True, float("inf"))] == \
        [3, 0.5, None, None, None, None]
    assert finite_number(10 ** 400) is None and finite_number(2 ** 70) == 2 ** 70


def test_a_stream_is_hidden_until_closed_and_discarded_without_a_trace(tmp_path):
    import gzip

    out = RunDir(str(tmp_path / "run"))
    stream = out.open_stream("telemetry/x.csv.gz", "t,v")
    stream.write("0,1\n1,2\n", 2)
    assert not (tmp_path / "run/telemetry/x.csv.gz").exists()
    assert (tmp_path / "run/telemetry/.x.csv.gz.partial").exists()
    stream.close()
    assert gzip.open(tmp_path / "run/telemetry/x.csv.gz", "rt").read() == "t,v\n0,1\n1,2\n" and stream.rows == 2
    gone = out.open_stream("telemetry/y.csv.gz", "t")
    gone.discard()
    assert sorted(p.name for p in (tmp_path / "run/telemetry").iterdir()) == ["x.csv.gz"]


def test_the_run_events_are_read_once_for_every_reader(tmp_path):
    from controller.results.run_dir import read_run_events

    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "a.jsonl").write_text('{"v": 1, "type": "started", "t": 1.0, "role": "gossip"}\n')
    (tmp_path / "events" / "b.jsonl").mkdir()  # cannot be read
    problems: dict = {}
    events = read_run_events(str(tmp_path), problems)
    assert events["a"][0]["role"] == "gossip" and events["b"] == [] and list(problems) == ["b"]
    with pytest.raises(OSError):
        read_run_events(str(tmp_path))


def test_json_documents_of_the_folder_are_read_strictly_or_as_an_object(tmp_path):
    from controller.results.run_dir import read_json, read_json_object

    (tmp_path / "run.json").write_text('{"run_id": "r1"}')
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1]")
    assert read_json(str(tmp_path / "run.json")) == {"run_id": "r1"} and read_json(str(tmp_path / "none.json")) is None
    with pytest.raises(ConfigError, match="bad.json: not JSON"):
        read_json(str(tmp_path / "bad.json"))
    assert [read_json_object(str(tmp_path / n)) for n in ("run.json", "bad.json", "list.json", "none.json")] == \
        [{"run_id": "r1"}, {}, {}, {}]


def test_uploads_are_written_side_by_side_and_finish_waits_for_those_begun(tmp_path, monkeypatch):
    """A thousand nodes ending at once upload their logs together: one slow write does not hold
    the others (they were written one at a time under the run's lock), and collecting the
    results waits for the writes already begun, then refuses later uploads."""
    import threading

    exp = _experiment(tmp_path)
    monkeypatch.setattr(exp, "check_all_settled", lambda: None)
    slow_started, release = threading.Event(), threading.Event()
    real_write = exp.out.write_bytes

    def write(relative, data, durable=True):
        assert durable is False  # a copy of the node's own file: not synced one by one
        if relative == "events/n1.jsonl":
            slow_started.set()
            release.wait(10)
        return real_write(relative, data, durable)

    monkeypatch.setattr(exp.out, "write_bytes", write)
    done = b'{"v":1,"type":"done","node":"%s","run_id":"r","t":0}\n'
    slow = threading.Thread(target=exp.on_log, args=("n1", done % b"n1"))
    slow.start()
    assert slow_started.wait(10)
    assert exp.on_log("n2", done % b"n2") == {"stored": True}  # not behind n1's write
    assert exp.nodes["n2"].state == "done" and exp.nodes["n1"].state == "running"
    collecting = threading.Thread(target=exp._stop_taking_logs)
    collecting.start()
    collecting.join(0.3)
    assert collecting.is_alive()  # waits for n1's write
    release.set()
    collecting.join(10)
    slow.join(10)
    assert not collecting.is_alive() and exp.nodes["n1"].state == "done"
    assert exp.on_log("n2", done % b"n2")["stored"] is False
