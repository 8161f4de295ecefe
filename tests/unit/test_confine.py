"""A node's bounds as data: default limits, rlimits, the seccomp program per machine, and the
``pids`` field from nodes.json to the worker's request (the kernel side: tests/security)."""
import json
import resource
import struct

import pytest

from controller.model.topology import Topology, load_nodes
from controller.workers.deploy import node_requests
from worker.api.errors import CapabilityError, ConfigError, TopologyError
from worker.confinement import confine
from worker.nodes.runtime import NodeSpec


def test_default_memory_is_at_most_half_the_host(tmp_path):
    small = tmp_path / "meminfo"
    small.write_text("MemTotal:        2097152 kB\nMemFree:  1 kB\n")
    assert confine.default_mem_bytes(str(small)) == 1 << 30
    small.write_text("MemTotal:        67108864 kB\n")
    assert confine.default_mem_bytes(str(small)) == confine.DEFAULT_MEM_BYTES
    assert confine.default_mem_bytes(str(tmp_path / "absent")) == confine.DEFAULT_MEM_BYTES


def test_rlimits_follow_the_nodes_pids_limit():
    limits = {which: (soft, hard) for which, soft, hard in confine.node_rlimits(300)}
    assert limits[resource.RLIMIT_NPROC] == (300, 300)
    assert limits[resource.RLIMIT_CORE] == (0, 0)
    assert limits[resource.RLIMIT_NOFILE] == (confine.NOFILE, confine.NOFILE)
    assert limits[resource.RLIMIT_FSIZE] == (confine.FSIZE_BYTES, confine.FSIZE_BYTES)
    assert dict((w, s) for w, s, _ in confine.node_rlimits())[resource.RLIMIT_NPROC] == confine.DEFAULT_PIDS_MAX
    assert {u["name"]: u["soft"] for u in confine.docker_ulimits(300)} == {
        "nproc": 300, "nofile": confine.NOFILE, "fsize": confine.FSIZE_BYTES, "core": 0}


def _decode(program: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]


@pytest.mark.parametrize("machine", ["x86_64", "aarch64", "arm"])
def test_the_filter_checks_the_abi_first_and_every_jump_lands_inside(machine):
    code = _decode(confine.filter_program(machine))
    assert code[0] == (0x20, 0, 0, 4)  # load seccomp_data.arch
    assert code[1][0] == 0x15 and code[1][3] == confine.AUDIT_ARCH[machine]
    kill = 1 + code[1][2] + 1  # where a foreign ABI goes
    assert code[kill] == (0x06, 0, 0, confine.RET_KILL_PROCESS)
    for pc, (op, jt, jf, _) in enumerate(code):
        if op & 0x07 == 0x05:  # a jump
            assert pc + 1 + max(jt, jf) < len(code)
    assert code[-1][0] == 0x06  # the program ends by returning
    numbers = {k for op, _, _, k in code if op == 0x15}
    assert {confine.SYSCALLS[machine][name] for name in confine.DENIED} <= numbers
    x32 = [k for op, _, _, k in code if op == 0x35]
    assert x32 == ([confine.X32_SYSCALL_BIT] if machine == "x86_64" else [])


@pytest.mark.parametrize("machine,pointer,abi", [("x86_64", 8, "x86_64"), ("aarch64", 8, "aarch64"),
                                                 ("aarch64", 4, "arm"), ("armv7l", 4, "arm"), ("x86_64", 4, "i386")])
def test_the_abi_is_the_processs_not_the_kernels(monkeypatch, machine, pointer, abi):
    monkeypatch.setattr(confine.os, "uname", lambda: type("U", (), {"machine": machine})())
    monkeypatch.setattr(confine.struct, "calcsize", lambda fmt: pointer)
    assert confine.process_abi() == abi


def test_an_unknown_machine_starts_no_node():
    with pytest.raises(CapabilityError, match=r"riscv64.*known: x86_64, aarch64, arm.*none is started"):
        confine.filter_program("riscv64")


def test_pids_from_nodes_json_to_the_workers_request(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"nodes": [{"name": "a", "pids": 200}, {"name": "b"}]}))
    topo = load_nodes(str(path))
    assert (topo.nodes["a"].pids_max, topo.nodes["b"].pids_max) == (200, None)
    assert Topology.from_dict(json.loads(json.dumps(topo.to_dict()))).nodes == topo.nodes
    body = node_requests(topo)["nodes"]
    assert body[0]["pids_max"] == 200 and "pids_max" not in body[1]
    assert NodeSpec.from_dict(body[0]).pids_max == 200


@pytest.mark.parametrize("entry,says", [
    ({"name": "a", "pids": 4}, "'pids'"),
    ({"name": "a", "pids": "many"}, "'pids'"),
    ({"name": "pi", "kind": "physical", "ip": "10.0.0.9", "pids": 100}, "'pids'.*physical"),
])
def test_a_bad_pids_names_the_node_and_field(tmp_path, entry, says):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"nodes": [entry]}))
    with pytest.raises(TopologyError, match=says) as info:
        load_nodes(str(path))
    assert "nodes.json" in str(info.value) and repr(entry["name"]) in str(info.value)


@pytest.mark.parametrize("value", [8, True, 1.5, 10**9])
def test_the_worker_refuses_a_bad_pids_max(value):
    with pytest.raises(ConfigError, match="pids_max"):
        NodeSpec.from_dict({"name": "a", "pids_max": value})
