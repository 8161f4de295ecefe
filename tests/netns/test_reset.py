"""Reset removes exactly what carries the testbed id: with a state file, after a crash, and not other testbeds."""
import os
import subprocess
import sys

from tests.netns.conftest import links


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _full_testbed(host):
    a, b = host.create_nodes({"version": 1, "nodes": [{"name": "a", "cpu": 0.5, "mem_bytes": 64 * 2**20},
                                                      {"name": "b"}]})["nodes"]
    host.set_links(links(("a", "b", b["ip"], 10**7), ("b", "a", a["ip"], 10**7)))
    proc = host.start_process("a", {"version": 1, "argv": [sys.executable, "-c", "import time; time.sleep(600)"]})
    return proc


def test_reset_removes_everything(host):
    proc = _full_testbed(host)
    left = host.runtime.leftovers()
    assert left["netns"] and left["links"] and left["cgroups"]
    host.reset()
    assert not any(host.runtime.leftovers().values())
    assert not _pid_alive(proc["pid"])
    gone = subprocess.run(["ip", "netns", "exec", host.runtime.names.netns("a"), "tc", "qdisc"], capture_output=True)
    assert gone.returncode != 0
    assert host.status()["nodes"] == []
    host.reset()  # a second reset is harmless


def test_reset_after_a_crash_works_without_the_state_file(make_host, tmp_path):
    first = make_host()
    proc = _full_testbed(first)
    # the state file is lost: a new worker with an empty state dir and the same id
    fresh = make_host(first.testbed_id, str(first.runtime.subnet), str(tmp_path / "empty"))
    fresh.reset()
    assert not any(fresh.runtime.leftovers().values())
    assert not _pid_alive(proc["pid"])


def test_reset_leaves_other_testbeds_alone(make_host):
    x, y = make_host(), make_host()
    _full_testbed(x)
    ya, yb = y.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    y.set_links(links(("a", "b", yb["ip"], 10**7)))
    x.reset()
    assert not any(x.runtime.leftovers().values())
    assert len(y.status()["nodes"]) == 2 and y.shaping("a")["verified"]
    ping = y.exec("a", {"version": 1, "argv": [sys.executable, "-c",
                                               f"import socket; s = socket.create_connection(('{yb['ip']}', 9), 2)"]})
    # nothing listens on port 9: a refused connection proves the packet reached b and came back
    assert "ConnectionRefusedError" in ping["stderr"], ping
