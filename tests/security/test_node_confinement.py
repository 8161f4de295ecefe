"""A node is bounded in what it takes and what it reaches in the kernel: it cannot make a user
namespace (and with it capabilities over a network stack of its own), nor reach the keyrings,
bpf, io_uring, userfaultfd, perf or ptrace; a fork bomb stops at the node's pids limit, other
nodes still start processes, and reset removes every process of it. The node's ordinary work
(threads, child processes, its HTTP server) still runs."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import sys
import time

import pytest

from tests.netns.conftest import nodes_body, report
from tests.security.conftest import SECURITY
from tests.security.test_node_privilege import run_py, status_fields, wait_for
from tests.security.test_zygote_node import answers, start
from worker.confinement import confine
from worker.host import WorkerHost

pytestmark = SECURITY

# in a node: each system call's errno (0: it worked), plus a thread and a child process
SYSCALL_PROBE = """
import ctypes, errno, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
nr = json.loads(NUMBERS)
def call(name, *args):
    rc = libc.syscall(nr[name], *args)
    return 0 if rc >= 0 else ctypes.get_errno()
params = ctypes.create_string_buffer(120)
out = {"unshare_user": call("unshare", 0x10000000),  # CLONE_NEWUSER
       "clone3": call("clone3", None, 0),
       "keyctl": call("keyctl", 0, -3, 0),  # the session keyring's id
       "add_key": call("add_key", b"user", b"k", b"v", 1, -3),
       "io_uring_setup": call("io_uring_setup", 1, params),
       "userfaultfd": call("userfaultfd", 1),  # user-mode faults only: allowed unprivileged
       "ptrace": call("ptrace", 3, 1 << 30, 0, 0),  # PEEKUSER of no process: ESRCH if allowed
       "bpf": call("bpf", 0, None, 0),
       "perf_event_open": call("perf_event_open", None, 0, -1, -1, 0)}
t = threading.Thread(target=lambda: None); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
out["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(out))
"""
DENIED = {"unshare_user": errno.EPERM, "clone3": errno.ENOSYS, "keyctl": errno.EPERM, "add_key": errno.EPERM,
          "io_uring_setup": errno.EPERM, "userfaultfd": errno.EPERM, "ptrace": errno.EPERM, "bpf": errno.EPERM,
          "perf_event_open": errno.EPERM}


def test_a_node_cannot_make_a_user_namespace(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a"))
    for argv in (["unshare", "-U", "true"], ["unshare", "-Urn", "ip", "link", "set", "lo", "up"]):
        out = host.exec("a", {"version": 1, "argv": argv})
        assert out["returncode"] != 0 and "Operation not permitted" in out["stderr"], (argv, out)
    out = host.exec("a", {"version": 1, "argv": ["sh", "-c", "sleep 0.1 & wait; echo forked"]})
    assert (out["returncode"], out["stdout"]) == (0, "forked\n"), out  # an ordinary child still starts


def test_the_kernel_attack_surface_is_closed_in_a_node(host: WorkerHost) -> None:
    host.create_nodes(nodes_body("a"))
    numbers = json.dumps(confine.SYSCALLS[os.uname().machine])
    seen = run_py(host, "a", f"NUMBERS = {numbers!r}\n" + SYSCALL_PROBE)
    assert seen.pop("child") == 7, seen  # threads and child processes work
    assert seen == DENIED, {k: (errno.errorcode.get(v, v), errno.errorcode[DENIED[k]]) for k, v in seen.items()}


def _probe_in_child(filtered: bool, number: int, *args: int) -> tuple[int, int]:
    """Fork; in the child (with ``no_new_privs`` and the node filter when ``filtered``) make the
    system call; (its errno or 0, the child's exit code as Popen gives it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    read_end, write_end = os.pipe()
    program = confine.node_filter()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            if filtered:
                libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
                program.install()
            rc = libc.syscall(number, *args)
            os.write(write_end, str(0 if rc >= 0 else ctypes.get_errno()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        got = f.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return (int(got) if got else -1), code


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the x32 ABI is x86_64's")
def test_the_filter_kills_a_system_call_of_another_abi() -> None:
    getpid_x32 = confine.X32_SYSCALL_BIT | 39
    # without the filter the kernel answers (ENOSYS where x32 is not built in), with it the caller dies
    assert _probe_in_child(False, getpid_x32)[1] == 0
    assert _probe_in_child(True, getpid_x32) == (-1, -signal.SIGSYS)
    # as root, where no privilege check hides it: unshare(CLONE_NEWUSER) works without the filter
    unshare = confine.SYSCALLS["x86_64"]["unshare"]
    assert _probe_in_child(False, unshare, confine.CLONE_NEWUSER) == (0, 0)
    assert _probe_in_child(True, unshare, confine.CLONE_NEWUSER) == (errno.EPERM, 0)
    assert _probe_in_child(True, unshare, 0x00020000) == (0, 0)  # a mount namespace: not the filter's business


def test_a_zygote_node_runs_with_its_limits_and_filter(host: WorkerHost) -> None:
    from controller.run.node_auth import RunKeys

    host.create_nodes(nodes_body("a", {"name": "b", "pids_max": 300, "mem_bytes": 512 << 20}))
    keys = RunKeys()
    procs = {n: start(host, n, keys) for n in ("a", "b")}
    for node, proc in procs.items():
        # it works under all of it (60 s: in the vm tier, a guest without KVM emulates its CPU)
        wait_for(lambda: answers(host, node), timeout_s=60, what=f"{node}'s /health")
        fields = status_fields(proc["pid"])
        assert fields["Seccomp"].strip() == "2" and int(fields["Seccomp_filters"]) >= 1, fields
        with open(f"/proc/{proc['pid']}/limits") as f:
            limits = {line[:26].strip(): line[26:].split()[:2] for line in f.read().splitlines()[1:]}
        pids, mem = (1024, confine.default_mem_bytes()) if node == "a" else (300, 512 << 20)
        assert limits["Max processes"] == [str(pids)] * 2, limits
        assert limits["Max open files"] == [str(confine.NOFILE)] * 2
        assert limits["Max file size"] == [str(confine.FSIZE_BYTES)] * 2
        assert limits["Max core file size"] == ["0", "0"]
        assert read_group(host, node, "pids.max") == str(pids)
        assert read_group(host, node, "memory.limit_in_bytes" if host.runtime.cgroups.version == 1
                          else "memory.max") == str(mem)


def group_dir(host: WorkerHost, node: str, controller: str) -> str:
    groups = host.runtime.cgroups
    if groups.version == 2:
        return groups.dirs(node)[0]
    return os.path.join(groups.root, controller, groups.group, node)


def read_group(host: WorkerHost, node: str, name: str) -> str:
    with open(os.path.join(group_dir(host, node, name.split(".")[0]), name)) as f:
        return f.read().strip()


def uid_processes(uid: int, zombies: bool = True) -> list[int]:
    """The processes of ``uid``; ``zombies`` False: only those not dead yet (a zombie holds no
    memory nor group, and waits for its parent, init for the orphans of a killed node, to reap it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = status_fields(int(entry))
                if int(fields["Uid"].split()[0]) == uid and (zombies or not fields["State"].startswith("Z")):
                    found.append(int(entry))
            except (OSError, KeyError):
                pass
    return found


# every process forks without end (dash exits when a fork fails, and the others fill its place)
FORK_BOMB = "exec 2>/dev/null; f() { while :; do f & done; }; f"


def sample_peak(read, reach: int, least_s: float = 2.0, most_s: float = 20.0) -> int:
    """The highest value ``read`` gave, sampled every 20 ms for ``least_s`` and then until it
    reached ``reach`` (``most_s`` at most: a loaded machine forks slowly)."""
    peak, started = 0, time.monotonic()
    while True:
        peak = max(peak, read())
        spent = time.monotonic() - started
        if spent > most_s or (spent > least_s and peak >= reach):
            return peak
        time.sleep(0.02)


def test_a_fork_bomb_stops_at_pids_max_and_reset_removes_it(host: WorkerHost, request) -> None:
    host.create_nodes(nodes_body("bomb", "calm"))
    uid = host.runtime.identity("bomb").uid
    limit = int(read_group(host, "bomb", "pids.max"))
    assert limit == confine.DEFAULT_PIDS_MAX
    host.start_process("bomb", {"version": 1, "argv": ["sh", "-c", FORK_BOMB]})
    peak = sample_peak(lambda: int(read_group(host, "bomb", "pids.current")), reach=int(limit * 0.8))
    report(request, "peak_pids", peak)
    assert int(limit * 0.8) <= peak <= limit, peak  # it really bombs (a slow guest dies back a little), no further
    out = host.exec("calm", {"version": 1, "argv": ["sh", "-c", "echo alive"], "timeout_s": 30})
    assert out["stdout"] == "alive\n", out  # another node is not starved of processes
    started = time.monotonic()
    host.reset()
    report(request, "reset_s", time.monotonic() - started)
    assert uid_processes(uid, zombies=False) == []  # every one killed, and out of its groups
    wait_for(lambda: not uid_processes(uid), 10, "the killed processes reaped")
