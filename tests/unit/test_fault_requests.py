"""The fault requests (worker.api.faults): one class per kind, one row per kind on each side."""
import pytest

from controller.model.scenario import STEP_KINDS, Timeline
from controller.run.scenario_runner import ScenarioRunner
from worker.api.errors import ConfigError
from worker.api.faults import (FAULTS, KINDS, Background, BackgroundResult, Clear, Drop, Freeze, IperfServer, Kill,
                               Limits, Prepare, Restart, Terminate, Thaw, Undrop, parse_fault, parse_faults)
from worker.faults import Faults

ONE_OF_EACH = [
    Drop("n1", key="e1", src_ips=["10.0.0.2", "10.0.0.3"], percent=5.0),
    Undrop("n1", key="e1"),
    Kill("n1"),
    Terminate("n1", notice_s=2.0),
    Freeze("n1"),
    Thaw("n1"),
    Limits("n1", cpu=0.5),
    Restart("n1"),
    IperfServer("n2", key="e4", port=5304),
    Background("n1", key="e4", dst_ip="10.0.0.3", port=5304, rate_bps=10**6, duration_s=5.0, on_s=1.0, off_s=2.0,
               protocol="udp"),
    BackgroundResult("n1", key="e4"),
    Clear("n1"),
    Prepare("n1", for_="limits"),
]


def test_every_kind_is_one_class_and_one_worker_row():
    assert tuple(FAULTS) == KINDS
    assert sorted(f.kind for f in ONE_OF_EACH) == sorted(KINDS)

    class Host:
        testbed_id = "t1"

    assert set(Faults(Host()).handlers) == set(KINDS)


def test_every_step_kind_is_one_runner_row():
    class Worker:
        def capabilities(self):
            return {}

    runner = ScenarioRunner(Timeline([], 0, 1.0), Worker(), {}, progress=lambda _: None)
    try:
        assert set(runner.handlers) == set(STEP_KINDS)
    finally:
        runner.stop()


@pytest.mark.parametrize("fault", ONE_OF_EACH, ids=lambda f: f.kind)
def test_wire_round_trip(fault):
    data = fault.to_dict()
    assert data["kind"] == fault.kind and data["node"] == fault.node
    assert parse_fault(data) == fault


def test_limits_keeps_what_it_leaves_out():
    assert Limits("n1", mem_bytes=64 << 20).to_dict() == {"kind": "limits", "node": "n1", "mem_bytes": 64 << 20}
    assert parse_fault({"kind": "limits", "node": "n1", "cpu": None}).to_dict() == {"kind": "limits", "node": "n1",
                                                                                   "cpu": None}
    with pytest.raises(ConfigError, match="faults\\[0\\]: limits needs 'cpu' or 'mem_bytes'"):
        parse_faults([{"kind": "limits", "node": "n1"}])
    with pytest.raises(ConfigError, match="field 'mem_bytes': must be an integer >= 4194304 or null"):
        parse_fault({"kind": "limits", "node": "n1", "mem_bytes": 1024})


@pytest.mark.parametrize("data,says", [
    ({"kind": "background", "node": "a", "key": "e1", "dst_ip": "10.0.0.2", "port": 5301, "rate_bps": 1,
      "duration_s": 5, "on_s": 1}, "on_s and off_s go together"),
    ({"kind": "background", "node": "a", "key": "e1", "dst_ip": "10.0.0.2; ls", "port": 5301, "rate_bps": 1,
      "duration_s": 5}, "field 'dst_ip': '10.0.0.2; ls' is not an IPv4 address"),
    ({"kind": "background", "node": "a", "key": "e1", "dst_ip": "10.0.0.2", "port": 80, "rate_bps": 1,
      "duration_s": 5}, "field 'port': must be an integer in \\[1024, 65535\\]"),
    ({"kind": "background", "node": "a", "key": "e1", "dst_ip": "10.0.0.2", "port": 5301, "rate_bps": 1,
      "duration_s": 5, "protocol": "sctp"}, "field 'protocol': 'sctp' is not one of 'tcp', 'udp'"),
    ({"kind": "terminate", "node": "a", "notice_s": -1}, "field 'notice_s': must be a number in \\[0, 3600\\]"),
    ({"kind": "drop", "node": "a", "key": "e1", "src_ips": []}, "field 'src_ips': must hold at least 1"),
    ({"kind": "drop", "node": "a", "key": "e1", "src_ips": ["10.0.0.2"], "percent": 101}, "field 'percent'"),
    ({"kind": "undrop", "node": "a"}, "missing field 'key'"),
    ({"kind": "kill"}, "missing field 'node'"),
    ({"node": "a"}, "missing field 'kind' \\(one of drop, undrop"),
    ({"kind": "kil", "node": "a"}, "did you mean 'kill'"),
    ("kill", "expected an object"),
])
def test_bad_faults_name_the_field(data, says):
    with pytest.raises(ConfigError, match=says):
        parse_fault(data, "faults[0]")


@pytest.mark.parametrize("faults,says", [
    (None, "field 'faults': expected a list"),
    ([], "field 'faults': must hold at least 1 items"),
    ([{"kind": "kill", "node": "a"}, {"kind": "kill", "node": 3}], "faults\\[1\\]: field 'node': expected a string"),
])
def test_a_request_is_checked_whole(faults, says):
    with pytest.raises(ConfigError, match=says):
        parse_faults(faults)
