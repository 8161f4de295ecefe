"""Exact names, safe routes, shared host settings restored by the last user, and the plans
behind least-privilege nodes (the pure parts run anywhere; the rest on a real host)."""
from __future__ import annotations

import ipaddress
import os
import threading

import pytest

from tests.netns.conftest import nodes_body, root_skip_reason
from worker import routes
from worker.api.errors import ConfigError
from worker.confinement import cgroups, fsview, privilege, uids
from worker.kernel import nsfs
from worker.nodes.runtime import Naming, NodeSpec
from worker.routes import Route, overlaps, parse_routes
from worker.state import read_host_json

pytestmark = pytest.mark.security
needs_root = pytest.mark.skipif(root_skip_reason() is not None, reason=root_skip_reason() or "")


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """The host-wide counters in a directory of the test's own."""
    monkeypatch.setenv("EDGETB_RUN_DIR", str(tmp_path / "run"))
    return tmp_path / "run"


# names ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["n1\n", "n1\r", " n1", "n1 ", "n1/x", "../n1", "", "-n1", "n" * 16, "n1\x00"])
def test_bad_node_names_are_refused(name):
    with pytest.raises(ConfigError):
        NodeSpec.from_dict({"name": name})


@pytest.mark.parametrize("tb", ["8\n", "abc\n", "ABC", "abcdef", "", "a-b"])
def test_bad_testbed_ids_are_refused(tb):
    with pytest.raises(ConfigError):
        Naming(tb)


def test_link_names_match_exactly():
    names = Naming("t1")
    assert names.owns_link("etb-t1-br") and names.owns_link("etb-t1-12")
    assert not names.owns_link("etb-t1-br\n") and not names.owns_link("etb-t1-12x") and not names.owns_link("etb-t12-1")


def test_no_module_checks_names_with_match_and_dollar():
    """``re.match`` with ``$`` accepts a trailing newline: names are checked with ``fullmatch``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    offenders = []
    for package in ("worker", "controller", "dml_app", "dml_tool"):
        for dirpath, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        for no, line in enumerate(f, 1):
                            if "re.match(" in line or ("_RE.match(" in line) or "_re.match(" in line:
                                offenders.append(f"{name}:{no}: {line.strip()}")
    assert not offenders, offenders


@needs_root
def test_node_with_trailing_newline_creates_nothing(host):
    with pytest.raises(ConfigError):
        host.create_nodes(nodes_body("n1\n"))
    assert not [n for n in nsfs.list_netns() if host.runtime.names.owns_netns(n)]
    assert host.store.read()["nodes"] == {}


# routes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("subnet", ["0.0.0.0/0", "0.0.0.0/1", "10.0.0.0/7", "128.0.0.0/1", "127.0.0.0/8",
                                    "169.254.0.0/16", "224.0.0.0/8", "240.0.0.0/8"])
def test_default_wide_and_special_routes_are_refused(subnet):
    with pytest.raises(ConfigError, match=subnet.split("/")[0]):
        parse_routes({"routes": [{"subnet": subnet, "via": "10.254.0.2"}]})


def test_wide_peers_are_refused():
    with pytest.raises(ConfigError, match="default route"):
        parse_routes({"routes": [], "peers": ["0.0.0.0/0"]})


def test_node_subnets_are_accepted():
    routes_, peers = parse_routes({"routes": [{"subnet": "10.78.0.0/16", "via": "10.254.0.2"}],
                                   "peers": ["10.254.0.0/24"]})
    assert routes_ == [Route("10.78.0.0/16", "10.254.0.2")] and peers == ["10.254.0.0/24"]


def test_overlapping_routes_are_named():
    taken = {"192.168.1.0/24": "interface eth0", "10.77.0.0/16": "interface etb-0-br"}
    assert "etb-0-br" in overlaps([Route("10.77.128.0/17", "192.168.1.9")], taken)
    assert "eth0" in overlaps([Route("192.168.0.0/16", "192.168.1.9")], taken)
    assert overlaps([Route("10.78.0.0/16", "192.168.1.9")], taken) is None


@needs_root
def test_default_route_and_own_subnet_refused_on_a_real_host(host):
    host.create_nodes(nodes_body("a"))
    default = os.popen("ip -4 route show default").read()
    with pytest.raises(ConfigError, match="default route"):
        host.set_routes({"version": 1, "routes": [{"subnet": "0.0.0.0/0", "via": host.runtime.node_ip(0)}]})
    with pytest.raises(ConfigError, match="overlaps"):  # its own bridge's subnet
        sub = ipaddress.IPv4Network(str(host.runtime.subnet))
        host.set_routes({"version": 1, "routes": [{"subnet": str(next(sub.subnets(1))),
                                                   "via": host.runtime.node_ip(0)}]})
    assert os.popen("ip -4 route show default").read() == default  # others' testbeds may come and go
    assert f"via {host.runtime.node_ip(0)}" not in os.popen("ip -4 route show").read()


class FakeForwarding:
    def __init__(self, value: str) -> None:
        self.value, self.writes = value, []

    def read(self) -> str:
        return self.value

    def write(self, value: str) -> None:
        self.value = value
        self.writes.append(value)


def test_ip_forward_is_restored_by_the_last_testbed_only(run_dir, monkeypatch):
    fwd = FakeForwarding("0")
    monkeypatch.setattr(routes, "_read_forwarding", fwd.read)
    monkeypatch.setattr(routes, "_write_forwarding", fwd.write)
    routes.hold_forwarding("ta")
    routes.hold_forwarding("tb")
    routes.hold_forwarding("ta")  # idempotent
    assert fwd.value == "1"
    routes.release_forwarding("ta")
    assert fwd.value == "1"  # tb still forwards
    routes.release_forwarding("ta")
    assert fwd.value == "1"
    routes.release_forwarding("tb")
    assert fwd.value == "0" and fwd.writes == ["1", "0"]
    fwd.value = "1"  # a host that forwarded before: left forwarding
    routes.hold_forwarding("tc")
    routes.release_forwarding("tc")
    assert fwd.value == "1"


def test_ip_forward_count_is_safe_across_threads(run_dir, monkeypatch):
    fwd = FakeForwarding("0")
    monkeypatch.setattr(routes, "_read_forwarding", fwd.read)
    monkeypatch.setattr(routes, "_write_forwarding", fwd.write)
    ids = [f"t{i}" for i in range(20)]
    threads = [threading.Thread(target=routes.hold_forwarding, args=(t,)) for t in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    threads = [threading.Thread(target=routes.release_forwarding, args=(t,)) for t in ids[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fwd.value == "1"
    routes.release_forwarding(ids[0])
    assert fwd.value == "0"


# cgroup v2 delegation ---------------------------------------------------------------------------------
def test_cgroup_v2_subtree_control_restored_when_the_last_group_goes(tmp_path, run_dir):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("io\n")
    cgroups.enable_v2_controllers(str(root))
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"  # what was written
    (root / "cgroup.subtree_control").write_text("cpu io memory pids\n")  # what the kernel shows
    (root / "edgetb-ta").mkdir()
    (root / "edgetb-tb").mkdir()
    cgroups.enable_v2_controllers(str(root))  # already on: nothing more recorded
    (root / "edgetb-ta").rmdir()
    cgroups.restore_v2_controllers(str(root))
    assert (root / "cgroup.subtree_control").read_text() == "cpu io memory pids\n"  # tb still there
    (root / "edgetb-tb").rmdir()
    cgroups.restore_v2_controllers(str(root))
    assert (root / "cgroup.subtree_control").read_text() == "-pids"  # the last write: -cpu, -memory, then -pids
    assert read_host_json(str(run_dir / "cgroup2.json"), None) == {}


def test_cgroup_v2_controllers_enabled_before_are_left(tmp_path, run_dir):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    cgroups.enable_v2_controllers(str(root))
    cgroups.restore_v2_controllers(str(root))
    assert (root / "cgroup.subtree_control").read_text() == "cpu memory\n"


# probe namespaces -------------------------------------------------------------------------------------
@needs_root
def test_throwaway_namespace_leaves_nothing(tmp_path):
    import socket

    home = os.stat("/proc/thread-self/ns/net").st_ino
    before = nsfs.list_netns()
    with pytest.raises(RuntimeError):
        with nsfs.throwaway():
            inside = os.stat("/proc/thread-self/ns/net").st_ino
            sock = socket.socket()
            raise RuntimeError("a probe failing half-way")
    sock.close()
    assert inside != home and os.stat("/proc/thread-self/ns/net").st_ino == home
    assert nsfs.list_netns() == before


# the plans behind least-privilege nodes ------------------------------------------------------------------
def test_view_covers_closed_directories_and_binds_back_what_a_node_needs():
    closed = {"/root", "/var/lib/edgetb/t1", "/tmp/pytest-of-root"}
    view = fsview.View(read=("/root/.pyenv/versions/3.11", "/usr/lib/python3", "/var/lib/edgetb/t1/work"),
                          write=("/var/lib/edgetb/t1/work/dml_file/node/n1",),
                          hide=("/var/lib/edgetb", "/var/lib/edgetb/t1/work/dml_file", "/missing"),
                          private=("/tmp",), home=None)
    ops = fsview.plan_view(view, traversable=lambda p: p not in closed, exists=lambda p: p != "/missing")
    assert [(o.kind, o.path, o.writable) for o in ops] == [
        ("cover", "/root", False),
        ("private", "/tmp", False),
        ("cover", "/var/lib/edgetb", False),
        ("cover", "/var/lib/edgetb/t1", False),
        ("bind", "/root/.pyenv/versions/3.11", False),
        ("bind", "/var/lib/edgetb/t1/work", False),
        ("cover", "/var/lib/edgetb/t1/work/dml_file", False),
        ("bind", "/var/lib/edgetb/t1/work/dml_file/node/n1", True),
    ]  # /usr/lib/python3 is open to all: shown as it is, no mount


def test_uid_blocks_are_distinct_and_released(run_dir):
    bases = {tb: uids.uid_base(tb) for tb in ("ta", "tb", "tc")}
    assert len(set(bases.values())) == 3
    assert all(uids.NODE_UID_BASE <= b < 2 ** 31 - uids.UID_SLOT for b in bases.values())
    assert uids.uid_base("ta") == bases["ta"]  # stable
    assert uids.Identity.of_node("ta", 5).uid == bases["ta"] + 5
    uids.release_uid_base("ta")
    assert "ta" not in read_host_json(str(run_dir / "uids.json"), {})
    with pytest.raises(ConfigError):
        uids.Identity.of_node("tb", uids.UID_SLOT)


def test_child_env_is_an_allow_list(monkeypatch):
    from worker.nodes.processes import child_env

    monkeypatch.setenv("EDGETB_TOKEN", "t" * 20)
    monkeypatch.setenv("EDGETB_TOKEN_FILE", "/x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("LD_PRELOAD", "/evil.so")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    env = child_env({"EDGETB_NODE_TOKEN": "node"})
    assert set(env) <= {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LC_ALL", "EDGETB_NODE_TOKEN"} | {
        k for k in os.environ if k.startswith("LC_")}
    assert env["EDGETB_NODE_TOKEN"] == "node" and env["LC_ALL"] == "C.UTF-8" and "PATH" in env


def test_docker_nodes_run_unprivileged_with_only_their_own_directory_writable(tmp_path, run_dir):
    pytest.importorskip("docker")
    from worker.nodes.docker import NODE_ROOT, DockerRuntime
    from worker.state import StateStore

    code, work = tmp_path / "code root", tmp_path / "closed" / "work dir"
    (work / "dataset").mkdir(parents=True)
    rt = DockerRuntime(StateStore("tq", str(tmp_path / "state")), "10.231.0.0/16", image="edgetb-node:test",
                       code_root=str(code), workdir=str(work))
    rec = {"name": "n1", "index": 3, "container": "etb-tq-n1", "cpu": 0.5, "mem_bytes": 64 << 20}
    ident = uids.Identity.of_node("tq", 3)
    create, host = rt.container_config(rec, ident)
    assert create["user"] == f"{ident.uid}:{ident.gid}" and ident.uid != 0
    assert host["cap_drop"] == ["ALL"] and host["security_opt"] == ["no-new-privileges"]
    # the node sees its files at paths of its own, whatever the host's (closed parents, spaces)
    mounts = {m["Target"]: (m["Source"], m["ReadOnly"]) for m in host["mounts"]}
    assert mounts == {f"{NODE_ROOT}/dml_app": (str(code / "dml_app"), True),
                      f"{NODE_ROOT}/dataset": (str(work / "dataset"), True),
                      f"{NODE_ROOT}/dml_user": (str(work / "dml_user"), True),  # the user's code, staged
                      f"{NODE_ROOT}/dml_file/node/n1": (str(work / "dml_file" / "node" / "n1"), False)}
    assert all(m["Type"] == "bind" for m in host["mounts"]) and "binds" not in host
    assert create["working_dir"] == NODE_ROOT and create["environment"]["PYTHONPATH"] == NODE_ROOT
    assert create["environment"]["HOME"] == f"{NODE_ROOT}/dml_file/node/n1"


def test_worker_host_gives_docker_no_writable_dml_file(tmp_path, run_dir):
    pytest.importorskip("docker")
    from worker.host import WorkerHost

    host = WorkerHost("tq", "10.231.0.0/16", state_root=str(tmp_path / "state"), runtime="docker",
                      workdir=str(tmp_path / "work"))
    assert all(not m.writable for m in host.runtime.mounts()), host.runtime.mounts()
    assert [m.writable for m in host.runtime.mounts("n1")] == [False, False, False, True]
