"""The Flower fork server on real nodes: a node's processes that connect to its socket and send
nothing hold no program up, a shim that is killed takes its program with it, and a node served
again (made anew) takes the place of its old registration. Needs flwr in its own environment
(``bash scripts/flower_setup.sh``), as the Flower runs do."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.netns.conftest import NETNS, nodes_body, wait_for
from worker.host import WorkerHost

FLWR = os.environ.get("EDGETB_FLWR_PYTHON", "/opt/edgetb-flwr")
HAVE_FLWR = os.access(os.path.join(FLWR, "bin", "flower-superlink"), os.X_OK)
pytestmark = [*NETNS, pytest.mark.skipif(not HAVE_FLWR and os.environ.get("EDGETB_REQUIRE_FLOWER") != "1",
                                         reason=f"flwr not installed in {FLWR} (bash scripts/flower_setup.sh)")]
# a ClientApp that never reaches its SuperNode: it retries until it is stopped
WAITING_CLIENTAPP = ["--runtime-api-address", "127.0.0.1:9", "--insecure", "--token", "t"]
# a process of the node that keeps every connection it may have to its socket open and silent
SILENT = """
import socket, sys, time
held = []
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    held = [s for s in held if s.fileno() >= 0]
    for s in list(held):
        s.setblocking(False)
        try:
            if s.recv(1) == b"":
                s.close()
        except BlockingIOError:
            pass
    while len(held) < 16:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(sys.argv[1])
        held.append(s)
    print("holding", flush=True)
    time.sleep(0.05)
"""


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def serve_nodes(host: WorkerHost) -> tuple[dict[str, str], int]:
    """Nodes ``a`` and ``b`` declaring the Flower environment, served by the fork server through a
    forked program of each: their shims' directories and the server's pid."""
    host.create_nodes(nodes_body({"name": "a", "python": FLWR}, {"name": "b", "python": FLWR}))
    bins = {}
    for node in ("a", "b"):
        host.start_process(node, {"version": 1, "env": {"EDGETB_FORK": "flower"},
                                  "argv": [os.path.join(FLWR, "bin", "flwr-clientapp"), *WAITING_CLIENTAPP]})
        bins[node] = f"/run/edgetb-flwr/{host.runtime.identity(node).uid}/bin"
        wait_for(lambda: os.path.exists(os.path.join(bins[node], "flwr-clientapp")), 60, f"{node}'s shims")
    forks = host.procs._flower[FLWR]
    assert forks.pid and len(children_of(forks.pid)) == 2
    return bins, forks.pid


def shim_help_s(host: WorkerHost, node: str, bin_dir: str, times: int = 3) -> float:
    """Seconds ``times`` runs of the node's ``flwr-clientapp --help`` shim take, each forked by the server."""
    started = time.monotonic()
    for _ in range(times):
        done = host.exec(node, {"version": 1, "argv": [os.path.join(bin_dir, "flwr-clientapp"), "--help"],
                                "timeout_s": 60})
        assert done["returncode"] == 0 and "usage: flwr-clientapp" in done["stdout"], done
        assert "fresh process" not in done["stderr"], done["stderr"]  # forked by the server, not started anew
    return time.monotonic() - started


def test_silent_connections_hold_nothing_up_and_a_killed_shim_takes_its_program(host: WorkerHost) -> None:
    bins, server = serve_nodes(host)
    alone_s = shim_help_s(host, "b", bins["b"])
    sock = os.path.join(os.path.dirname(bins["a"]), "sock")  # (node a hurts only its own shims)
    holder = host.popen("a", [os.path.join(FLWR, "bin", "python3"), "-c", SILENT, sock, "60"], {},
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n", holder.stderr.read()
        beside_s = shim_help_s(host, "b", bins["b"])
    finally:
        holder.kill()
        holder.wait()
    # a server that waited for each silent connection (2 s) would add 2 to 4 s to each of b's three
    assert beside_s < alone_s + 3, f"b's shims: {alone_s:.1f} s alone, {beside_s:.1f} s beside a's silent connections"

    before = children_of(server)
    shim = host.popen("a", [os.path.join(bins["a"], "flwr-clientapp"), *WAITING_CLIENTAPP], {},
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(children_of(server) - before) == 1, 30, "the shim's program forked")
        (program,) = children_of(server) - before
        os.kill(shim.pid, signal.SIGKILL)
        shim.wait()
        wait_for(lambda: not os.path.exists(f"/proc/{program}") or program not in children_of(server), 10,
                 "the killed shim's program gone")
    finally:
        shim.kill()
        shim.wait()
    assert children_of(server) == before  # the recorded program runs on


def namespaces_held(pid: int) -> list[str]:
    """The network namespaces ``pid`` holds open (one a node it serves), by their paths."""
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    return sorted(link for link in links if link.startswith(("net:[", "/run/netns/")))


def test_a_node_served_again_takes_the_place_of_its_old_registration(host: WorkerHost) -> None:
    _, server = serve_nodes(host)
    forks = host.procs._flower[FLWR]
    uid, gid = host.runtime.identity("a").uid, host.runtime.identity("a").gid
    paths = {n: host.runtime.netns_path(host.runtime.node(n)) for n in ("a", "b")}
    assert namespaces_held(server) == [paths["a"], paths["b"]]
    for _ in range(3):  # node a made anew: another network namespace for its uid, each time
        for node in ("b", "a"):
            fd = os.open(paths[node], os.O_RDONLY)
            try:
                forks.serve_node({"uid": uid, "gid": gid, "cgroup_procs": [], "ops": [], "rlimits": []}, fd)
            finally:
                os.close(fd)
            # a's programs go to the namespace it was served with last; the one before is let go
            assert namespaces_held(server) == sorted([paths[node], paths["b"]])
