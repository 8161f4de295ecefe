"""Reset removes exactly what carries the testbed id: with a state file, after a crash, and not other testbeds."""
import subprocess
import sys
import time

from tests.netns.conftest import NETNS, assert_no_leftovers, links, nodes_body
from worker.host import WorkerHost

pytestmark = NETNS

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _full_testbed(host: WorkerHost) -> list[int]:
    """Nodes with limits, shaping both ways, and a running process in each; returns their pids."""
    a, b = host.create_nodes(nodes_body({"name": "a", "cpu": 0.5, "mem_bytes": 64 * 2**20}, "b"))["nodes"]
    shaped = host.set_links(links(("a", "b", b["ip"], 10**7), ("b", "a", a["ip"], 2 * 10**7)))
    assert all(n["verified"] for n in shaped["nodes"])
    pids = [host.start_process(n, {"version": 1, "argv": SLEEPER})["pid"] for n in ("a", "b")]
    assert all(_pid_alive(p) for p in pids)
    left = host.runtime.leftovers()
    assert left["netns"] and left["links"] and left["cgroups"], left
    assert left["iptables"] or not host.store.read().get("iptables"), left
    return pids


def _tc_in(netns: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "show", "dev", "eth0"],
                          capture_output=True, text=True)


def test_reset_removes_everything(host):
    pids = _full_testbed(host)
    namespaces = [host.runtime.names.netns(n) for n in ("a", "b")]
    assert all(_tc_in(ns).returncode == 0 and "htb" in _tc_in(ns).stdout for ns in namespaces)

    removed = host.reset()
    assert removed["removed"]["nodes"] == 2, removed
    assert_no_leftovers(host)
    for pid in pids:
        assert _wait_gone(pid), f"process {pid} survived the reset"
    for ns in namespaces:
        gone = _tc_in(ns)
        assert gone.returncode != 0, f"tc still answers in {ns}: {gone.stdout}"
    status = host.status()
    assert status["nodes"] == [] and status["processes_running"] == 0 and status["bridge"] is None
    assert host.processes()["processes"] == []

    again = host.reset()  # a second reset is harmless
    assert again["removed"]["nodes"] == 0, again
    assert_no_leftovers(host)


def test_reset_after_a_crash_works_without_the_state_file(make_host, tmp_path):
    first = make_host()
    pids = _full_testbed(first)
    # the worker crashed and its state file is lost: a new worker, empty state dir, same id and subnet
    empty = tmp_path / "empty"
    fresh = make_host(first.testbed_id, str(first.runtime.subnet), str(empty))
    assert fresh.status()["nodes"] == []  # it knows nothing of the nodes...
    assert sorted(fresh.runtime.leftovers()["netns"]) == sorted(first.runtime.leftovers()["netns"])  # ...they exist

    removed = fresh.reset()
    assert removed["removed"]["nodes"] == 2, removed
    assert_no_leftovers(fresh)
    for pid in pids:
        assert _wait_gone(pid), f"process {pid} survived the reset"
    for node in ("a", "b"):
        assert _tc_in(fresh.runtime.names.netns(node)).returncode != 0


def test_reset_leaves_other_testbeds_alone(make_host):
    x, y = make_host(), make_host()
    assert x.testbed_id != y.testbed_id
    x_pids = _full_testbed(x)
    ya, yb = y.create_nodes(nodes_body({"name": "a", "cpu": 0.5}, "b"))["nodes"]
    y.set_links(links(("a", "b", yb["ip"], 10**7)))
    y_pid = y.start_process("b", {"version": 1, "argv": SLEEPER})["pid"]
    y_before = y.runtime.leftovers()

    x.reset()
    assert_no_leftovers(x)
    assert all(_wait_gone(p) for p in x_pids)

    assert y.runtime.leftovers() == y_before, "resetting x changed y's resources"
    assert _pid_alive(y_pid)
    assert len(y.status()["nodes"]) == 2 and y.shaping("a")["verified"] is True
    # y still passes traffic: a TCP connection from a to a closed port of b is refused by b's kernel
    probe = y.exec("a", {"version": 1, "timeout_s": 10, "argv": [
        sys.executable, "-c",
        f"import socket\ntry:\n    socket.create_connection(('{yb['ip']}', 9), 3)\n"
        f"except ConnectionRefusedError:\n    print('refused')\n"]})
    assert probe["returncode"] == 0 and probe["stdout"].strip() == "refused", probe
    ip = y.exec("b", {"version": 1, "argv": ["ip", "-br", "addr", "show", "eth0"]})
    assert yb["ip"] in ip["stdout"], ip
