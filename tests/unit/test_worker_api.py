"""The worker API declared once (worker.api.protocol): the agent's routes, its limits and
idempotent calls, the client's calls and the cluster's forwarding all come from the table;
every worker implements the whole Worker interface; runs are typed (RunOptions -> RunSpec)."""
from __future__ import annotations

import os
from typing import Any

import pytest

from controller.model.spec import RunOptions
from controller.workers.agent_client import AgentClient
from controller.workers.api import Worker
from controller.workers.cluster import Cluster
from worker.agent import REQUEST_LIMITS, create_app
from worker.api.errors import ConfigError, NotFound, TestbedError
from worker.api.protocol import OPERATIONS, SMALL_REQUEST_BYTES, check_version
from worker.host import WorkerHost

TOKEN = "t" * 32


class _Host:
    testbed_id = "0"


def test_the_agent_serves_every_operation_of_the_table_and_nothing_else():
    app = create_app(_Host(), TOKEN)  # type: ignore[arg-type]
    served = {(rule.endpoint, method, rule.rule) for rule in app.url_map.iter_rules() if rule.endpoint != "static"
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    assert served == {(op.name, op.method, op.path) for op in OPERATIONS.values()}


class _Untouchable:
    """A host no call may reach: every attribute read fails the test."""

    testbed_id = "0"

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"an unauthenticated call reached the host's {name}")


def test_every_operation_but_health_needs_the_token():
    client = create_app(_Untouchable(), TOKEN).test_client()  # type: ignore[arg-type]
    for op in OPERATIONS.values():
        if op.name == "health":
            continue
        path = op.path.replace("<name>", "n1").replace("<proc_id>", "p1")
        for headers in ({}, {"Authorization": "Bearer " + "x" * 32}):
            body = {"json": {"version": 1}} if op.method in ("POST", "PUT", "PATCH") else {}
            answer = client.open(path, method=op.method, headers=headers, **body)
            assert answer.status_code == 401, (op.name, headers, answer.status_code)


def test_limits_and_idempotent_calls_come_from_the_table():
    assert REQUEST_LIMITS == {"create_nodes": 16 << 20, "set_links": 16 << 20, "merge_links": 16 << 20,
                              "set_rates": 16 << 20, "schedule_start": 16 << 20, "schedule_end": 1 << 20,
                              "sync": 16 << 20, "set_routes": 1 << 20, "exec": 1 << 20, "start_process": 1 << 20,
                              "start_node": 1 << 20}
    assert all(op.limit_bytes == SMALL_REQUEST_BYTES for name, op in OPERATIONS.items() if name not in REQUEST_LIMITS)
    # the state-changing calls a client may repeat, as before the table
    idempotent = {(op.method, op.path) for op in OPERATIONS.values() if op.idempotent}
    assert {(m, p) for m, p in idempotent if m != "GET"} == {
        ("PUT", "/links"), ("PATCH", "/links"), ("DELETE", "/links"), ("PATCH", "/links/rates"), ("PUT", "/routes"),
        ("PUT", "/links/schedule"), ("PATCH", "/links/schedule"),
        ("POST", "/nodes"),
        ("PUT", "/fabric"),
        ("POST", "/swarm/probe"),
        ("POST", "/sync"), ("POST", "/reset"), ("POST", "/telemetry/stop"),
        ("DELETE", "/nodes/<name>/processes/<proc_id>"), ("DELETE", "/nodes/<name>/capture"),
        ("DELETE", "/nodes/<name>/capture.pcap")}
    assert all(op.idempotent for op in OPERATIONS.values() if op.method == "GET")
    assert not any(op.idempotent for op in OPERATIONS.values() if op.name in ("fault", "exec", "start_process",
                                                                            "start_node", "telemetry_start"))


def test_paths_take_one_segment_per_parameter():
    stop = OPERATIONS["stop_process"]
    assert stop.params == ("name", "proc_id") and stop.per_node
    assert stop.url_path(name="n1", proc_id="ab12") == "/nodes/n1/processes/ab12"
    assert stop.url_path(name="n1", proc_id="a b") == "/nodes/n1/processes/a%20b"
    for bad in ("..", "a/b", "", "-x"):
        with pytest.raises(ConfigError, match="is not a node name"):
            OPERATIONS["shaping"].url_path(name=bad)
    with pytest.raises(ConfigError, match="not a valid proc_id"):
        stop.url_path(name="n1", proc_id="..")
    assert not OPERATIONS["set_links"].per_node and OPERATIONS["set_links"].params == ()


def test_check_version():
    assert check_version({"version": 1, "x": 2}) == {"version": 1, "x": 2}
    with pytest.raises(ConfigError, match="request version must be 1, got 2"):
        check_version({"version": 2})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        check_version([1])


def _members(protocol: type) -> set[str]:
    return {n for n in dir(protocol) if not n.startswith("_")}


@pytest.mark.parametrize("cls", [WorkerHost, AgentClient, Cluster])
def test_every_worker_implements_the_whole_interface(cls):
    missing = {n for n in _members(Worker) if not hasattr(cls, n) and n not in cls.__annotations__}
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
    # and every operation of the table (PATCH /links is set_links with merge)
    ops = {op.name for op in OPERATIONS.values()} - {"merge_links", "health"}
    assert ops <= _members(Worker) and all(hasattr(cls, n) for n in ops)
    assert cls.is_local is (cls is WorkerHost)


def test_the_client_calls_each_operation_by_the_table():
    client = AgentClient("http://127.0.0.1:9", TOKEN)
    calls: list[tuple[Any, ...]] = []
    client._call = lambda method, path, body=None, params=None, idempotent=None: (  # type: ignore[method-assign]
        calls.append((method, path, body, params, idempotent)) or {})
    client.set_links({"version": 1}, merge=True)
    client.stop_process("n1", "p1")
    client.exec("n1", {"argv": ["true"]})
    client.telemetry_read(5, 10)
    client.process_log("n1", "p1", 7)
    client.reset()
    assert calls == [("PATCH", "/links", {"version": 1}, None, True),
                     ("DELETE", "/nodes/n1/processes/p1", None, None, True),
                     ("POST", "/nodes/n1/exec", {"argv": ["true"]}, None, False),
                     ("GET", "/telemetry", None, {"cursor": "5", "limit": "10"}, True),
                     ("GET", "/nodes/n1/processes/p1/log", None, {"offset": "7"}, True),
                     ("POST", "/reset", {"version": 1}, None, True)]
    with pytest.raises(ConfigError, match="is not a node name"):
        client.start_capture("../x", {})
    assert client.workers == {"127.0.0.1": client} and client.is_local is False


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args)) or {"version": 1}


def test_the_agent_calls_the_host_as_the_table_says():
    class Host(_Recorder):
        testbed_id = "0"

    host = Host()
    client = create_app(host, TOKEN).test_client()  # type: ignore[arg-type]
    special = {"merge_links": ("set_links", "body", True), "clear_links": ("clear_links", None),
               "telemetry_read": ("telemetry_read", 0, None), "process_log": ("process_log", "n1", "p1", 0, None),
               "stop_process": ("stop_process", "n1", "p1", 5.0, None)}
    for op in OPERATIONS.values():
        host.calls.clear()
        body = {"version": 1, "op": op.name}
        path = op.url_path(**{p: "n1" if p == "name" else "p1" for p in op.params})
        sent = {"json": body} if op.method in ("POST", "PUT", "PATCH") else {}
        answer = client.open(path, method=op.method, headers={"Authorization": f"Bearer {TOKEN}"}, **sent)
        assert answer.status_code == op.status, (op.name, answer.get_json())
        name, *args = special.get(op.name, (op.name, *("n1", "p1")[:len(op.params)], *(["body"] if op.body else [])))
        expected = [] if op.name == "health" else [(name, tuple(body if a == "body" else a for a in args))]
        assert host.calls == expected, op.name
    assert client.get("/health").get_json() == {"version": 1, "ok": True, "testbed_id": "0"}


def test_the_cluster_sends_per_node_operations_to_the_node_host():
    from controller.model.hosts import Hosts

    a, b = _Recorder(), _Recorder()
    cluster = Cluster(Hosts(hosts={}), {"n1": "a", "n2": "b"}, {"a": a, "b": b}, a, "10.0.0.1")  # type: ignore
    for op in OPERATIONS.values():
        if op.per_node:
            assert getattr(Cluster, op.name).__name__ == op.name
    cluster.exec("n2", {"argv": ["true"]})
    cluster.stop_process("n1", "p1")
    cluster.capture_chunks("n2")
    assert a.calls == [("stop_process", ("n1", "p1"))]
    assert b.calls == [("exec", ("n2", {"argv": ["true"]})), ("capture_chunks", ("n2",))]
    with pytest.raises(NotFound, match="no node 'n3'"):
        cluster.shaping("n3")
    assert cluster.is_local is False and cluster.workers == {"a": a, "b": b}


def test_run_options_name_their_inputs():
    options = RunOptions(workdir="/w", nodes="nodes.json", scenario="s.json")
    assert options.inputs == {"links": "/w/links.json", "nodes": "/w/nodes.json", "structure": "/w/gl_structure.json",
                              "dataset": "/w/gl_dataset.json", "scenario": "/w/s.json"}


def test_the_command_line_parses_into_run_options(tmp_path):
    from controller.runner import parse_options

    options = parse_options(["--workdir", str(tmp_path), "--auto", "--timeout", "60", "--listen", "10.0.0.5",
                             "--no-telemetry", "--capture", "n1,n2", "--id", "t1", "-s", "fl_structure.json"],
                            "fl", "x_structure.json", "fl_dataset.json")
    assert options == RunOptions(algorithm="fl", workdir=os.path.realpath(tmp_path), structure="fl_structure.json",
                                 dataset="fl_dataset.json", listen=("10.0.0.5",), testbed_id="t1", auto=True,
                                 timeout_s=60.0, telemetry=False, capture="n1,n2",
                                 subnet=options.subnet)  # $EDGETB_SUBNET or the default


def test_the_testbed_api_builds_run_options_without_a_command_line(tmp_path, monkeypatch):
    import controller.runner as runner
    from controller.testbed import Testbed

    (tmp_path / "links.json").write_text('{"n1": [{"dest": "n2", "bw": "5mbit"}], "n2": []}')
    seen: list[RunOptions] = []
    monkeypatch.setattr(runner, "run", lambda options, experiments=None: seen.append(options) or 2)
    tb = Testbed(workdir=str(tmp_path), port=3999, testbed_id="t2", algorithm="fl", capture=["n1", "n2"],
                 telemetry_period_ms=50, open_network=True)
    tb.add_emulator("local", runtime="docker")
    tb.add_emulated_node("n1")
    tb.add_emulated_node("n2")
    tb.load_link("links.json")
    with pytest.raises(ConfigError, match="exit code 2"):
        tb.start(auto=True)
    (options,) = seen
    assert options.topology is tb.topology and options.runtime == "docker" and options.hosts is None
    assert (options.algorithm, options.port, options.testbed_id, options.auto, options.open_network) == \
        ("fl", 3999, "t2", True, True)
    assert (options.capture, options.telemetry_period_ms, options.telemetry) == ("n1,n2", 50, True)


def test_a_garbled_tls_record_is_retried_on_idempotent_calls_only():
    import ssl

    import requests

    class Answer:
        status_code = 200

        def json(self):
            return {"version": 1, "ok": True}

    def garbled() -> requests.exceptions.SSLError:
        error = ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC] decryption failed or bad record mac")
        error.reason = "DECRYPTION_FAILED_OR_BAD_RECORD_MAC"
        return requests.exceptions.SSLError(error)

    client = AgentClient("https://192.0.2.1:3334", TOKEN, fingerprint="ab" * 32, tries=3, backoff_s=0)
    outcomes = [garbled(), Answer()]
    calls: list[str] = []

    def request(method, url, **kw):
        calls.append(method)
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    client.session.request = request  # type: ignore[method-assign]
    assert client.set_fabric({"version": 1})["ok"] and calls == ["PUT", "PUT"]  # idempotent: tried again
    outcomes[:] = [garbled(), Answer()]
    with pytest.raises(TestbedError, match="DECRYPTION_FAILED_OR_BAD_RECORD_MAC"):
        client.start_process("n1", {"version": 1, "argv": ["true"]})  # not idempotent: said at once


def test_the_checkout_s_root_is_defined_once_for_the_worker_and_the_controller():
    import worker
    import worker.host

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert worker.REPO_ROOT == root and worker.host.REPO_ROOT is worker.REPO_ROOT
