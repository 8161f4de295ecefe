"""A node forked by the zygote is the same unprivileged stranger as a node started with ``exec``:
its own uid without capabilities, ``no_new_privs``, its own mount and IPC namespaces and a
``/proc`` of its own, no descriptor of the zygote's, no secret of the host's, and no other
node's secret anywhere in its memory (nor in the zygote's)."""
from __future__ import annotations

import os
import re
import time

from controller.run.node_auth import RunKeys
from dml_app.runtime import auth
from dml_app.runtime.compute import NODE_ENV
from tests.netns.conftest import nodes_body
from tests.security.conftest import SECURITY
from tests.security.test_node_privilege import status_fields, wait_for
from worker.confinement import privilege
from worker.host import WorkerHost

pytestmark = SECURITY
PORT = 4444


def start(host: WorkerHost, node: str, keys: RunKeys) -> dict:
    return host.start_node(node, {"version": 1, "args": ["--name", node, "--controller", "http://127.0.0.1:9",
                                                         "--run-id", "r1", "--port", str(PORT)],
                                  "env": keys.env_for(node)})


def answers(host: WorkerHost, node: str) -> bool:
    import requests

    try:
        return requests.get(f"http://{host.runtime.node(node)['ip']}:{PORT}/health", timeout=1).ok
    except requests.RequestException:
        return False


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)


def memory_holds(pid: int, needles: list[bytes]) -> list[bytes]:
    """Which of ``needles`` appear anywhere in the process's readable memory (read as root)."""
    found = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if "r" not in fields[1] or (len(fields) > 5 and fields[5] in ("[vvar]", "[vsyscall]")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except (OSError, OverflowError, ValueError):
                continue
            found.update(n for n in needles if n in chunk)
    return sorted(found)


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def test_zygote_node_is_unprivileged_and_isolated(host: WorkerHost, monkeypatch) -> None:
    monkeypatch.setenv("EDGETB_TOKEN", "agent-secret-0123456789")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    host.create_nodes(nodes_body("a", "b"))
    keys = RunKeys()
    procs = {n: start(host, n, keys) for n in ("a", "b")}
    zyg = host._zygote
    assert zyg is not None
    for node in procs:  # (a node after the zygote's first is answered at the fork, before its set-up)
        wait_for(lambda: answers(host, node), what=f"{node}'s /health")
    for node, proc in procs.items():
        pid, ident = proc["pid"], host.runtime.identity(node)
        fields = status_fields(pid)
        assert fields["Uid"].split() == [str(ident.uid)] * 4 and fields["Gid"].split() == [str(ident.gid)] * 4
        assert fields["Groups"].strip() == ""
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(fields[cap], 16) == 0, (node, cap, fields[cap])
        assert fields["NoNewPrivs"].strip() == "1"
        for kind in ("mnt", "ipc"):
            assert os.stat(f"/proc/{pid}/ns/{kind}").st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino, kind
        with open(f"/proc/{pid}/mountinfo") as f:
            mounts = [line.split() for line in f]
        if privilege.per_mount_proc():
            proc_mounts = [" ".join(m) for m in mounts if m[4] == "/proc"]
            assert proc_mounts and "hidepid=invisible" in proc_mounts[-1], proc_mounts
        # no handle on any namespace's (each would pin it, and n nodes would hold n^2)
        assert not [m for m in mounts if m[4].startswith("/run/netns")], [m[4] for m in mounts]
        assert not socket_inodes(pid) & socket_inodes(zyg.pid)  # not the zygote's control socket
        env = environ(pid)
        assert not [k for k in env if k.startswith("EDGETB_TOKEN") or "SECRET" in k], env
    zygote_env = environ(zyg.pid)
    assert set(zygote_env) <= {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", *NODE_ENV} | {
        k for k in zygote_env if k.startswith("LC_")}, zygote_env
    assert zygote_env["MALLOC_ARENA_MAX"] == "2"  # read once at start: its nodes have it


def test_no_node_secret_in_the_zygote_nor_in_another_node(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a", "b"))
    keys = RunKeys()
    a = start(host, "a", keys)
    b = start(host, "b", keys)  # forked after a's secret went by
    wait_for(lambda: answers(host, "b"), what="b's /health")
    secret_a = keys.node_secret("a")
    derived = auth.to_controller_key(secret_a)  # what a keeps from its secret for as long as it runs
    needles = [secret_a.hex().encode(), secret_a, derived]
    # the node that owns it holds it (the test can see a secret where there is one) ...
    wait_for(lambda: derived in memory_holds(a["pid"], [derived]), what="a's key in a's memory")
    time.sleep(0.2)
    # ... no one else does
    assert memory_holds(host._zygote.pid, needles) == []
    assert memory_holds(b["pid"], needles) == []
    assert not re.search(secret_a.hex(), open(f"/proc/{b['pid']}/environ", "rb").read().decode(errors="replace"))
