"""A node's process is an unprivileged stranger on its host: attacks from inside a node fail,
and the node still reads its data and writes its own directory."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.netns.conftest import nodes_body
from tests.security.conftest import SECURITY
from worker.confinement import privilege, uids
from worker.host import WorkerHost
from worker.kernel import nsfs

pytestmark = SECURITY
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(host: WorkerHost, node: str, code: str, timeout_s: float = 30) -> dict:
    """Run Python ``code`` in ``node``; its last stdout line parsed as JSON."""
    out = host.exec(node, {"version": 1, "argv": [sys.executable, "-c", textwrap.dedent(code)], "timeout_s": timeout_s})
    assert out["returncode"] == 0, out
    return json.loads(out["stdout"].strip().splitlines()[-1])


def status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def node_pids(host: WorkerHost, node: str) -> list[int]:
    """The node's own processes (its uid) in its network namespace, as the host sees them."""
    uid = host.runtime.identity(node).uid
    found = []
    for pid in nsfs.pids_in(host.runtime.node(node)["netns"]):
        try:
            if int(status_fields(pid)["Uid"].split()[0]) == uid:
                found.append(pid)
        except (OSError, KeyError):
            pass
    return found


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.05)


def test_node_runs_as_its_own_uid_without_capabilities(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b"))
    procs = {n: host.start_process(n, {"version": 1, "argv": [sys.executable, "-c", "import time; time.sleep(60)"]})
             for n in ("a", "b")}
    idents = {n: host.runtime.identity(n) for n in ("a", "b")}
    assert idents["a"].uid != idents["b"].uid and min(idents["a"].uid, idents["b"].uid) >= uids.NODE_UID_BASE
    for n in ("a", "b"):
        wait_for(lambda: node_pids(host, n), what=f"a process of node {n}")
        for pid in node_pids(host, n):
            fields = status_fields(pid)
            assert fields["Uid"].split() == [str(idents[n].uid)] * 4
            assert fields["Gid"].split() == [str(idents[n].gid)] * 4
            assert fields["Groups"].strip() == ""
            for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(fields[cap], 16) == 0, (cap, fields[cap])
            assert fields["NoNewPrivs"].strip() == "1"
        assert host.processes()["processes"] and procs[n]["running"]


def test_node_cannot_read_the_workers_secrets(host: WorkerHost, monkeypatch) -> None:
    monkeypatch.setenv("EDGETB_TOKEN", "agent-secret-0123456789")
    monkeypatch.setenv("EDGETB_TOKEN_FILE", "/somewhere")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    host.create_nodes(nodes_body("a"))
    secret = os.path.join(host.store.dir, "token")
    with open(secret, "w") as f:
        f.write("state-secret\n")
    me = os.getpid()
    seen = run_py(host, "a", f"""
        import json, os
        def attempt(fn):
            try:
                return repr(fn())[:80]
            except OSError as e:
                return type(e).__name__
        print(json.dumps({{
            "environ_of_starter": attempt(lambda: open("/proc/{me}/environ", "rb").read()),
            "environ_of_host_init": attempt(lambda: open("/proc/1/environ", "rb").read()),
            "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
            "self": os.getpid(),
            "token": attempt(lambda: open({secret!r}).read()),
            "state_dir": attempt(lambda: os.listdir({host.store.dir!r})),
            "state_root": attempt(lambda: os.listdir({os.path.dirname(host.store.dir)!r})),
            "env": dict(os.environ),
        }}))""")
    assert seen["environ_of_starter"] in ("FileNotFoundError", "PermissionError")
    assert "agent-secret" not in seen["environ_of_host_init"]
    if privilege.per_mount_proc():  # its own /proc, hidepid=invisible: only its own processes
        assert seen["environ_of_starter"] == "FileNotFoundError"
        assert seen["pids"] == [seen["self"]]
    assert seen["token"] in ("FileNotFoundError", "PermissionError")
    # the state directory shows nothing but the experiment directory inside it (no state, token, logs)
    assert seen["state_dir"] in ("['work']", "FileNotFoundError", "PermissionError")
    assert seen["state_root"] in (f"[{host.testbed_id!r}]", "FileNotFoundError", "PermissionError")
    assert not [k for k in seen["env"] if k.startswith("EDGETB_TOKEN") or "SECRET" in k], seen["env"]
    assert seen["env"]["HOME"] == uids.node_dir(host.workdir, "a")


def test_node_cannot_enter_other_namespaces_nor_reach_host_loopback(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        other = nsfs.netns_path(host.runtime.node("b")["netns"])
        seen = run_py(host, "a", f"""
            import ctypes, json, os, socket, subprocess
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open({other!r}, os.O_RDONLY)
            rc = libc.setns(fd, 0x40000000)
            err = ctypes.get_errno()
            s = socket.socket(); s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {port})); reached = True
            except OSError:
                reached = False
            ns = subprocess.run(["nsenter", "--net={other}", "true"], capture_output=True, text=True)
            unshare = libc.unshare(0x40000000)
            print(json.dumps({{"setns": rc, "errno": err, "reached": reached, "nsenter": ns.returncode,
                              "unshare": unshare}}))""")
        # EPERM: no CAP_SYS_ADMIN; or EINVAL: the node's view has no namespace handles under
        # /run/netns at all (only the empty files they were mounted on)
        assert seen["setns"] == -1 and seen["errno"] in (1, 22)
        assert seen["nsenter"] != 0
        assert seen["unshare"] == -1
        assert not seen["reached"]  # the host's 127.0.0.1 is not the node's
    finally:
        listener.close()


def test_node_writes_only_its_own_directory(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b"))
    os.makedirs(os.path.join(host.workdir, "dataset"), exist_ok=True)
    with open(os.path.join(host.workdir, "dataset", "shard.txt"), "w") as f:
        f.write("shard-bytes")
    b_dir = uids.node_dir(host.workdir, "b")
    host.exec("b", {"version": 1, "argv": ["touch", os.path.join(b_dir, "mine")]})
    with open(os.path.join(host.workdir, "dml_file", "hosts.json"), "w") as f:
        f.write('{"token": "x"}')
    seen = run_py(host, "a", f"""
        import json, os
        home = os.environ["HOME"]
        def attempt(fn):
            try:
                fn(); return "ok"
            except OSError as e:
                return type(e).__name__
        def write(path):
            with open(path, "w") as f:
                f.write("x")
        print(json.dumps({{
            "own": attempt(lambda: write(os.path.join(home, "events.jsonl"))),
            "read_shard": open({os.path.join(host.workdir, "dataset", "shard.txt")!r}).read(),
            "other_node": attempt(lambda: write({os.path.join(b_dir, "forged")!r})),
            "other_listing": attempt(lambda: os.listdir({b_dir!r})),
            "nodes_seen": os.listdir(os.path.dirname(home)),
            "hosts_json": attempt(lambda: open({os.path.join(host.workdir, "dml_file", "hosts.json")!r}).read()),
            "workdir": attempt(lambda: write({os.path.join(host.workdir, "planted")!r})),
            "dataset": attempt(lambda: write({os.path.join(host.workdir, "dataset", "planted")!r})),
        }}))""")
    assert seen["own"] == "ok" and seen["read_shard"] == "shard-bytes"
    assert seen["other_node"] != "ok" and seen["other_listing"] != "ok"
    assert seen["nodes_seen"] == ["a"]
    assert seen["hosts_json"] != "ok"
    assert seen["workdir"] != "ok" and seen["dataset"] != "ok"
    a_dir = uids.node_dir(host.workdir, "a")
    st = os.stat(a_dir)
    assert (st.st_uid, st.st_mode & 0o777) == (host.runtime.identity("a").uid, 0o700)
    assert os.stat(os.path.join(a_dir, "events.jsonl")).st_uid == host.runtime.identity("a").uid
    assert not os.path.exists(os.path.join(b_dir, "forged"))
    assert os.path.exists(os.path.join(b_dir, "mine"))


def test_node_dir_planted_as_a_link_is_refused(host: WorkerHost, tmp_path) -> None:
    host.create_nodes(nodes_body("a"))
    node_root = os.path.join(host.workdir, "dml_file", "node")
    os.makedirs(node_root, exist_ok=True)
    target = tmp_path / "outside"
    target.mkdir()
    os.symlink(str(target), os.path.join(node_root, "a"))
    from worker.api.errors import ConfigError

    with pytest.raises(ConfigError, match="is a link or a file, not a directory"):
        host.exec("a", {"version": 1, "argv": ["true"]})
    assert os.stat(target).st_uid == 0  # not handed to the node


STARTER = """
import sys, time
from concurrent.futures import ThreadPoolExecutor
from worker.host import WorkerHost
tb, subnet, state = sys.argv[1:4]
host = WorkerHost(tb, subnet, state_root=state)
with ThreadPoolExecutor(max_workers=1) as pool:  # started from a thread that then ends
    proc = pool.submit(host.start_process, "a", {"version": 1, "argv": ["sleep", "600"]}).result()
print(proc["pid"], flush=True)
time.sleep(600)
"""


def test_node_dies_with_the_process_that_started_it(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a"))
    starter = subprocess.Popen([sys.executable, "-c", STARTER, host.testbed_id, str(host.runtime.subnet),
                                os.path.dirname(host.store.dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        launcher = int(starter.stdout.readline())
        wait_for(lambda: node_pids(host, "a"), what="the node's process")
        pids = node_pids(host, "a") + [launcher]
        time.sleep(0.5)  # the thread that started it has ended: the node must still live
        assert all(privilege_alive(p) for p in pids), pids
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        wait_for(lambda: not any(privilege_alive(p) for p in pids), timeout_s=10,
                 what=f"death of node processes {pids} after kill -9 of their starter")
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()


def privilege_alive(pid: int) -> bool:
    from worker.kernel.procs import start_ticks

    return start_ticks(pid) is not None


def test_unreadable_code_gets_a_clear_error(host: WorkerHost, tmp_path) -> None:
    host.create_nodes(nodes_body("a"))
    closed = tmp_path / "closed"
    (closed / "dml_app").mkdir(parents=True)
    os.chmod(closed / "dml_app", 0o700)
    host.code_root = str(closed)
    from worker.api.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cannot read .*dml_app.*mode 0700"):
        host.exec("a", {"version": 1, "argv": ["true"]})


def test_start_process_in_unknown_node_creates_no_log(host: WorkerHost) -> None:
    from worker.api.errors import NotFound

    host.create_nodes(nodes_body("a"))
    with pytest.raises(NotFound):
        host.start_process("../../x", {"version": 1, "argv": ["true"]})
    assert os.listdir(host.store.logs_dir()) == []


def test_physical_node_runs_unprivileged_too(tmp_path) -> None:
    from tests.netns.conftest import new_testbed_id

    host = WorkerHost(new_testbed_id(), state_root=str(tmp_path / "state"), runtime="physical",
                      workdir=str(tmp_path / "work"))
    try:
        host.create_nodes({"version": 1, "nodes": [{"name": "dev", "ip": "127.0.0.1"}]})
        seen = run_py(host, "dev", f"""
            import json, os
            status = dict(l.rstrip("\\n").split(":\\t", 1) for l in open("/proc/self/status") if ":\\t" in l)
            def attempt(fn):
                try:
                    return repr(fn())
                except OSError as e:
                    return type(e).__name__
            print(json.dumps({{"uid": os.getuid(), "cap": status["CapEff"], "bnd": status["CapBnd"],
                              "state": attempt(lambda: os.listdir({host.store.dir!r})),
                              "pids": len([p for p in os.listdir("/proc") if p.isdigit()])}}))""")
        assert seen["uid"] == host.runtime.identity("dev").uid >= uids.NODE_UID_BASE
        assert int(seen["cap"], 16) == 0 and int(seen["bnd"], 16) == 0
        assert seen["state"] in ("['work']", "FileNotFoundError", "PermissionError")
        if privilege.per_mount_proc():
            assert seen["pids"] == 1
    finally:
        host.reset()


def test_dml_node_serves_reads_its_shard_and_writes_its_events(host: WorkerHost) -> None:
    import requests

    host.create_nodes(nodes_body("a"))
    os.makedirs(os.path.join(host.workdir, "dataset", "d"), exist_ok=True)
    with open(os.path.join(host.workdir, "dataset", "d", "a.npz"), "wb") as f:
        f.write(b"not read until prepare")
    from controller.run.node_auth import RunKeys

    keys = RunKeys()
    host.start_node("a", {"version": 1, "args": ["--name", "a", "--controller", "http://127.0.0.1:9", "--run-id",
                                                 "r1", "--port", "4444"], "env": keys.env_for("a")})
    url = f"http://{host.runtime.node('a')['ip']}:4444"
    session = requests.Session()
    session.auth = keys.signer(lambda: {f"{host.runtime.node('a')['ip']}:4444": "a"})

    def healthy() -> bool:
        try:
            return requests.get(f"{url}/health", timeout=1).ok
        except requests.RequestException:
            return False

    wait_for(healthy, timeout_s=30, what="the node's /health")
    ok = session.post(f"{url}/conf/dataset", json={"shard": "dataset/d/a.npz"}, timeout=5)
    assert ok.status_code == 200, ok.text
    missing = session.post(f"{url}/conf/dataset", json={"shard": "dataset/d/b.npz"}, timeout=5)
    assert missing.status_code == 400
    events = os.path.join(uids.node_dir(host.workdir, "a"), "r1.jsonl")
    assert os.stat(events).st_uid == host.runtime.identity("a").uid


def test_node_has_private_tmp_and_ipc(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b"))
    tag = os.urandom(4).hex()
    seen = run_py(host, "a", f"""
        import json, os
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            with open(os.path.join(d, "from-a-{tag}"), "w") as f:
                f.write("x")
        ns = {{kind: os.stat(f"/proc/self/ns/{{kind}}").st_ino for kind in ("ipc", "mnt")}}
        print(json.dumps(ns))""")
    assert seen["ipc"] != os.stat("/proc/self/ns/ipc").st_ino
    assert seen["mnt"] != os.stat("/proc/self/ns/mnt").st_ino
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(os.path.join(d, f"from-a-{tag}")), d
    other = run_py(host, "b", f"""
        import json, os
        places = ("/tmp", "/var/tmp", "/dev/shm")
        print(json.dumps([os.path.exists(os.path.join(d, "from-a-{tag}")) for d in places]))""")
    assert other == [False, False, False]


def test_unprivileged_node_can_still_ping(host: WorkerHost) -> None:
    with open("/proc/sys/net/ipv4/ping_group_range") as f:
        host_range = f.read()
    host.create_nodes(nodes_body("a", "b"))
    b_ip = host.runtime.node("b")["ip"]
    seen = run_py(host, "a", f"""
        import json, socket, struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)  # no CAP_NET_RAW needed
        s.settimeout(5)
        s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"edgetb", ({b_ip!r}, 0))
        data, addr = s.recvfrom(1024)
        print(json.dumps({{"type": data[0], "from": addr[0]}}))""")
    assert seen == {"type": 0, "from": b_ip}  # an echo reply from b
    with open("/proc/sys/net/ipv4/ping_group_range") as f:
        assert f.read() == host_range  # the host's own setting is left alone


def test_a_kernel_that_cannot_hide_pids_is_said_loudly(host: WorkerHost, monkeypatch) -> None:
    """Before Linux 5.8 a node's /proc would be the host's: node creation says so, and the
    bring-up prints it as a warning (here the kernel's answer is replaced, the rest is real)."""
    from controller.model.topology import Topology
    from controller.workers import deploy

    assert "warnings" not in host.create_nodes(nodes_body("a"))
    host.reset()
    monkeypatch.setattr(privilege, "per_mount_proc", lambda: False)
    made = host.create_nodes(nodes_body("b"))
    assert len(made["warnings"]) == 1 and "/proc" in made["warnings"][0] and "5.8" in made["warnings"][0]
    pids = run_py(host, "b", "import json, os; print(json.dumps(sorted(int(p) for p in os.listdir('/proc') "
                             "if p.isdigit())))")
    assert len(pids) > 1  # what the warning says: the host's processes are in view
    host.reset()
    printed: list[str] = []
    topology = Topology()
    topology.add_node("c")
    topology.add_node("d")
    topology.add_symmetric_link("c", "d", "20mbit")
    deploy.deploy(topology, host, printed.append)
    assert [line for line in printed if line.startswith("warning: this kernel")], printed
