"""The worker's smaller parts, as pure logic: host-wide records, link-free directories, the
shaping service's request parsing, cgroup limit changes, the telemetry holder, exec output, the
runtimes' one interface."""
import json
import os
import subprocess

import pytest

from worker.api import bodies
from worker.api.errors import ConfigError, NodeRuntimeError, NotFound
from worker.confinement.cgroups import Cgroups
from worker.host import API_VERSION, versioned
from worker.kernel import dirs
from worker.nodes.docker import DockerRuntime
from worker.nodes.docker_exec import Sink
from worker.nodes.netns import NetnsRuntime
from worker.nodes.physical import PhysicalRuntime
from worker.nodes.runtime import ForkableRuntime, Runtime
from worker.observe.sampling import Telemetry
from worker.shaping import links
from worker.state import StateStore, host_record, host_run_dir, read_host_json, write_json_atomic


def test_host_record_reads_its_default_then_what_was_written(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETB_RUN_DIR", str(tmp_path / "run"))
    assert host_run_dir() == str(tmp_path / "run")
    with host_record("things") as record:
        assert record.path == str(tmp_path / "run" / "things.json")
        assert record.read({"none": True}) == {"none": True}
        record.write({"b": 1, "a": [2]})
    with host_record("things") as record:
        assert record.read({}) == {"b": 1, "a": [2]}
    assert (tmp_path / "run" / "things.lock").exists()
    assert oct(os.stat(tmp_path / "run").st_mode & 0o777) == "0o700"


def test_a_damaged_host_record_is_an_error_saying_what_to_do(tmp_path):
    path = tmp_path / "uids.json"
    path.write_text("{not json")
    with pytest.raises(NodeRuntimeError, match="uids.json is not valid JSON: remove it"):
        read_host_json(str(path), {})


def test_json_is_replaced_whole_with_sorted_keys(tmp_path):
    path = str(tmp_path / "doc.json")
    write_json_atomic(path, {"z": 1, "a": 2})
    assert open(path).read() == json.dumps({"a": 2, "z": 1})
    assert not os.path.exists(path + ".tmp")
    store = StateStore("t", str(tmp_path / "state"))  # the state document is written the same way
    with store.locked() as state:
        state["nodes"]["a"] = {"ip": "10.0.0.2"}
    assert json.loads(open(store.path).read())["nodes"] == {"a": {"ip": "10.0.0.2"}}


def test_open_dir_makes_a_directory_and_never_follows_a_link(tmp_path):
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = dirs.open_dir("made", top, 0o700)
        os.close(fd)
        assert (tmp_path / "made").is_dir() and oct((tmp_path / "made").stat().st_mode & 0o777) == "0o700"
        with pytest.raises(FileNotFoundError):
            dirs.open_dir("absent", top)  # without a mode nothing is made
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", tmp_path / "link")
        (tmp_path / "file").write_text("")
        for name in ("link", "file"):
            with pytest.raises(OSError) as caught:
                dirs.open_dir(name, top, 0o755)
            assert dirs.not_a_dir(caught.value)
    finally:
        os.close(top)


STATE = {"nodes": {"a": {"netns": "n-a"}, "b": {"netns": "n-b"}}}


def checked(**fields):
    """A set_links body as the facade hands it over: checked by its schema."""
    return bodies.SET_LINKS.validate({"version": 1, "links": [], **fields}, bodies.REQUEST)


def test_unshaped_and_access_maps_are_checked():
    body = checked(unshaped={"a": [{"dst": "b", "dst_ip": "10.0.0.3"}]})
    assert links.parse_unshaped(body["unshaped"], STATE) == {"a": [("b", "10.0.0.3")]}
    with pytest.raises(NotFound, match="unshaped: no node 'x'"):
        links.parse_unshaped(checked(unshaped={"x": []})["unshaped"], STATE)
    with pytest.raises(ConfigError, match="IPv4 address"):
        checked(unshaped={"a": [{"dst": "b", "dst_ip": "b"}]})
    with pytest.raises(ConfigError, match="missing field 'dst_ip'"):
        checked(unshaped={"a": [{"dst": "b"}]})
    body = checked(access={"a": {"uplink_bps": 8000, "downlink_bps": None}})
    assert links.parse_access(body["access"], STATE) == {"a": {"uplink_bps": 8000, "downlink_bps": None}}
    with pytest.raises(NotFound, match="access: no node 'x'"):
        links.parse_access(checked(access={"x": {}})["access"], STATE)
    with pytest.raises(ConfigError, match="unknown field"):
        checked(access={"a": {"up": 1}})
    for bad in (True, 7, 1.5, "1mbit"):
        with pytest.raises(ConfigError, match=r"access.*uplink_bps"):
            checked(access={"a": {"uplink_bps": bad}})


def test_peer_ips_and_ifname():
    assert links.peer_ips(None) == set()
    assert links.ifname({"ifname": "veth7"}) == "veth7"
    assert links.ifname({}) == "eth0"


def test_in_parallel_keeps_results_and_errors_apart():
    def shape(item: str) -> str:
        if item == "bad":
            raise NotFound("bad node")
        return item.upper()

    results, failed = links.in_parallel(shape, ["a", "bad", "b"])
    assert results == ["A", "B"] and list(failed) == ["bad"] and failed["bad"].message == "bad node"


def test_answers_carry_the_api_version_first():
    assert list(versioned({"nodes": []})) == ["version", "nodes"]
    assert versioned({})["version"] == API_VERSION


def test_set_limits_lifts_the_v1_swap_limit_and_writes_the_new_limits(tmp_path):
    for controller in ("cpu", "memory"):
        (tmp_path / controller).mkdir()
    groups = Cgroups("edgetb-t", str(tmp_path))
    assert groups.version == 1 and groups.bases() == [str(tmp_path / c / "edgetb-t") for c in ("cpu", "memory")]
    groups.create("a", 1.0, 256 << 20)
    memsw = tmp_path / "memory" / "edgetb-t" / "a" / "memory.memsw.limit_in_bytes"
    assert memsw.read_text() == str(256 << 20)
    groups.set_limits("a", 0.5, 512 << 20)
    assert (tmp_path / "cpu" / "edgetb-t" / "a" / "cpu.cfs_quota_us").read_text() == "50000"
    assert (tmp_path / "memory" / "edgetb-t" / "a" / "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert memsw.read_text() == str(512 << 20)


def test_telemetry_holder_before_any_sampler(tmp_path):
    telemetry = Telemetry(StateStore("t", str(tmp_path)), runtime=None)
    with pytest.raises(NotFound, match="telemetry is not started"):
        telemetry.read()
    assert telemetry.stop() == {"stopped": False}


def test_exec_output_goes_where_popen_would_send_it(tmp_path):
    piped = Sink(subprocess.PIPE, 1)
    piped.write(b"one ")
    piped.write(b"two")
    assert piped.value() == b"one two"
    dropped = Sink(subprocess.DEVNULL, 1)
    dropped.write(b"gone")
    assert dropped.value() is None
    with open(tmp_path / "log", "wb") as f:
        to_file = Sink(f, 1)
        to_file.write(b"logged")
        to_file.close()
    assert (tmp_path / "log").read_bytes() == b"logged"
    with pytest.raises(ConfigError, match="unsupported output target"):
        Sink("somewhere", 1)


def test_every_runtime_is_a_runtime_and_only_netns_nodes_are_forked_into(tmp_path):
    """Each runtime has every member of ``Runtime`` (made without touching the kernel or an
    engine); the zygote's extra needs are netns's alone; no neighbour entries but netns's."""
    store = StateStore("t", str(tmp_path))
    runtimes = {"netns": NetnsRuntime(store), "docker": DockerRuntime(store, workdir=str(tmp_path)),
                "physical": PhysicalRuntime(store)}
    for kind, runtime in runtimes.items():
        assert isinstance(runtime, Runtime) and runtime.kind == kind
        assert isinstance(runtime, ForkableRuntime) == (kind == "netns")
    assert runtimes["docker"].cgroups is None and runtimes["physical"].cgroups is None
    assert runtimes["netns"].cgroups is not None
    assert runtimes["docker"].set_neighbours({"a": ["10.0.0.3"]}) == 0
    assert runtimes["physical"].set_neighbours({"a": ["10.0.0.3"]}) == 0
