"""The Flower fork server's pure parts (a shim's request checked, flwr's versions, the environment's
ownership) and the shim's protocol against a small server of the test's own (no root, no flwr)."""
from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from worker.api.errors import ConfigError
from worker.confinement import flower_forks as ff


def test_a_request_for_a_flower_program_is_taken_with_its_name_as_argv0():
    r = ff.check_request({"argv": ["/run/edgetb-flwr/5/bin/flwr-clientapp", "--insecure"], "env": {"A": "1"},
                          "cwd": "/"})
    assert (r.name, r.argv, r.env, r.cwd) == ("flwr-clientapp", ["flwr-clientapp", "--insecure"], {"A": "1"}, "/")


@pytest.mark.parametrize("doc, message", [
    ([], "JSON object"),
    ({"argv": ["flwr-clientapp"], "shell": "x"}, "JSON object"),
    ({"argv": []}, "list of 1 to"),
    ({"argv": "flwr-clientapp --insecure"}, "list of 1 to"),
    ({"argv": ["python3", "-c", "print(1)"]}, "not one of Flower's programs"),
    ({"argv": ["/bin/sh"]}, "not one of Flower's programs"),
    ({"argv": ["flwr"]}, "not one of Flower's programs"),
    ({"argv": ["flwr-clientapp", 3]}, "must be a string"),
    ({"argv": ["flwr-clientapp", "a\0b"]}, "without NUL"),
    ({"argv": ["flwr-clientapp"] * (ff.MAX_ARGS + 1)}, "list of 1 to"),
    ({"argv": ["flwr-clientapp"], "env": ["A=1"]}, "env must be an object"),
    ({"argv": ["flwr-clientapp"], "env": {"A=B": "1"}}, "bad environment variable"),
    ({"argv": ["flwr-clientapp"], "env": {"A": 1}}, "must be a string"),
    ({"argv": ["flwr-clientapp"], "cwd": "tmp"}, "absolute path"),
])
def test_a_bad_request_is_refused_saying_why(doc, message):
    with pytest.raises(ConfigError, match=message):
        ff.check_request(doc)


@pytest.mark.parametrize("version, ok", [("1.42.0", True), ("1.43.1rc2", True), ("1.99", True),
                                         ("1.41.9", False), ("2.0.0", False), ("0.9", False), ("dev", False)])
def test_the_versions_of_flwr_the_server_forks(version, ok):
    assert ff.flwr_version_ok(version) is ok


def test_an_environment_that_others_may_write_is_not_imported_by_root(tmp_path):
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    os.symlink(os.path.realpath(sys.executable), prefix / "bin" / "python3")
    (prefix / "lib").mkdir()
    loose = prefix / "lib" / "mod.py"
    loose.write_text("")
    os.chmod(loose, 0o666)
    why = ff.check_owned_by_root(str(prefix))
    assert why is not None and "is not root's alone" in why and str(tmp_path) in why


def _root_venv(where) -> str:
    """A virtual environment of root's under ``where`` (its interpreter: this one's)."""
    prefix = where / "venv"
    (prefix / "bin").mkdir(parents=True)
    os.symlink(os.path.realpath(sys.executable), prefix / "bin" / "python3")
    (prefix / "pyvenv.cfg").write_text(f"home = {os.path.dirname(os.path.realpath(sys.executable))}\n"
                                       "include-system-site-packages = false\n")
    site = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site.mkdir(parents=True)
    (site / "mod.py").write_text("")
    return str(prefix)


AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="files of root's are made by root")


@pytest.fixture
def open_tmp():
    """A directory of root's that anybody may read (nobody is asked where the interpreter imports from)."""
    import shutil
    import tempfile
    from pathlib import Path

    where = tempfile.mkdtemp(prefix="edgetb-forks-")
    os.chmod(where, 0o755)
    yield Path(where)
    shutil.rmtree(where, ignore_errors=True)


@AS_ROOT
def test_an_environment_of_root_s_alone_may_be_imported_by_root(open_tmp):
    assert ff.check_owned_by_root(_root_venv(open_tmp)) is None


@AS_ROOT
def test_a_symbolic_link_to_what_others_may_write_is_refused(open_tmp):
    prefix = _root_venv(open_tmp)
    elsewhere = open_tmp / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pkg.py").write_text("")
    os.chmod(elsewhere / "pkg.py", 0o666)
    os.symlink(elsewhere, os.path.join(prefix, "lib", "pkg"))
    why = ff.check_owned_by_root(prefix)
    assert why is not None and str(elsewhere / "pkg.py") in why, why
    os.chmod(elsewhere / "pkg.py", 0o644)
    os.chmod(elsewhere, 0o777)
    why = ff.check_owned_by_root(prefix)
    assert why is not None and f"{elsewhere} is not root's alone" in why and "the target of" in why, why
    os.chmod(elsewhere, 0o755)
    os.symlink(elsewhere / "not-yet", os.path.join(prefix, "lib", "later"))  # (who may make it: root alone)
    assert ff.check_owned_by_root(prefix) is None
    os.chmod(elsewhere, 0o777)
    os.unlink(os.path.join(prefix, "lib", "pkg"))
    why = ff.check_owned_by_root(prefix)
    assert why is not None and "the target of" in why and "later" in why, why


@AS_ROOT
def test_a_directory_a_pth_file_adds_is_checked_as_the_environment(open_tmp):
    prefix = _root_venv(open_tmp)
    added = open_tmp / "added"
    added.mkdir()
    os.chmod(added, 0o777)  # (where anybody could put a sitecustomize.py that root would run)
    site = os.path.join(prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
    with open(os.path.join(site, "extra.pth"), "w") as f:
        f.write(f"{added}\n")
    assert str(added) in ff.import_path(os.path.join(prefix, "bin", "python3"))
    why = ff.check_owned_by_root(prefix)
    assert why is not None and f"{added} is not root's alone" in why, why


@AS_ROOT
def test_an_environment_under_a_directory_others_may_write_is_refused(open_tmp):
    loose = open_tmp / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)  # (not sticky: anybody may rename the environment and put another there)
    prefix = _root_venv(loose)
    why = ff.check_owned_by_root(prefix)
    assert why is not None and f"{loose}, above" in why, why


@AS_ROOT
def test_an_environment_in_a_sticky_directory_of_root_s_may_be_imported(open_tmp):
    os.chmod(open_tmp, 0o1777)  # (as /tmp: others rename nothing of root's there)
    assert ff.check_owned_by_root(_root_venv(open_tmp)) is None


def test_a_running_fork_server_serves_what_it_preloaded_and_what_a_run_still_uses():
    assert ff.may_serve(("torch",), ("torch",), 0) and ff.may_serve(("torch",), (), 0)
    assert not ff.may_serve((), ("torch",), 0)  # idle: started anew with torch
    assert ff.may_serve((), ("torch",), 3)  # its programs run: it serves on (slower, not wrong)


def test_a_node_s_cpu_weight_is_written_to_its_cpu_groups_on_either_cgroup_version():
    v1 = ["/cg/cpu,cpuacct/tb/n1/cgroup.procs", "/cg/memory/tb/n1/cgroup.procs"]
    have = {"/cg/cpu,cpuacct/tb/n1/cpu.shares"}
    assert ff.cpu_weight_writes(v1, 800, have.__contains__) == [("/cg/cpu,cpuacct/tb/n1/cpu.shares", "8192")]
    v2 = ["/cg/tb/n1/cgroup.procs"]
    assert ff.cpu_weight_writes(v2, 800, {"/cg/tb/n1/cpu.weight"}.__contains__) == [("/cg/tb/n1/cpu.weight", "800")]
    assert ff.cpu_weight_writes(v2, 800, lambda p: False) == []  # (no cpu controller: nothing to weigh)
    for bad in (0, 10001):
        with pytest.raises(ConfigError, match="1 to 10000"):
            ff.cpu_weight_writes(v2, bad)


# the shim, run for real against a server of the test's --------------------------------------------
def shim(tmp_path, sock_path: str, answer_s: float = ff.SHIM_ANSWER_S) -> str:
    bin_dir = tmp_path / "shims"
    bin_dir.mkdir()
    path = bin_dir / "flwr-clientapp"
    path.write_text(ff.shim_text(os.path.realpath(sys.executable), sock_path, str(bin_dir), answer_s))
    os.chmod(path, 0o755)
    return str(path)


def serve_one(listener: socket.socket, answer, got: dict) -> None:
    """Take one request; ``answer(conn, doc, fds)`` replies."""
    conn, _ = listener.accept()
    fds = array.array("i")
    data, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(8 * fds.itemsize))
    for _, _, payload in anc:
        fds.frombytes(payload)
    got["doc"], got["fds"] = json.loads(data), list(fds)
    try:
        answer(conn, got["doc"], list(fds))
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()


def listening(tmp_path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.listen(1)
    return s, path


def test_the_shim_sends_argv_env_cwd_and_stdio_and_exits_as_the_child_did(tmp_path):
    listener, path = listening(tmp_path)
    program = shim(tmp_path, path)
    got: dict = {}

    def answer(conn, doc, fds):
        os.write(fds[1], b"written by the child\n")
        conn.send(json.dumps({"pid": os.getpid()}).encode())
        conn.send(json.dumps({"exit": 3}).encode())
    server = threading.Thread(target=serve_one, args=(listener, answer, got))
    server.start()
    done = subprocess.run([program, "--insecure", "--token", "t"], capture_output=True, text=True, timeout=30,
                          cwd=str(tmp_path), env={"PATH": os.environ["PATH"], "FLWR_HOME": "/h"})
    server.join(timeout=10)
    listener.close()
    assert done.returncode == 3, done.stderr
    assert done.stdout == "written by the child\n"
    assert got["doc"]["argv"] == ["flwr-clientapp", "--insecure", "--token", "t"]
    assert got["doc"]["env"]["FLWR_HOME"] == "/h" and got["doc"]["cwd"] == str(tmp_path)
    assert len(got["fds"]) == 3
    assert ff.check_request(got["doc"]).name == "flwr-clientapp"  # what the server takes


def test_the_shim_passes_a_signal_on_to_the_child_and_dies_of_it(tmp_path):
    listener, path = listening(tmp_path)
    program = shim(tmp_path, path)
    child = subprocess.Popen(["sleep", "60"])
    got: dict = {}

    def answer(conn, doc, fds):
        conn.send(json.dumps({"pid": child.pid}).encode())
        code = child.wait(timeout=20)  # the shim passed on its SIGTERM
        conn.send(json.dumps({"exit": code}).encode())
    server = threading.Thread(target=serve_one, args=(listener, answer, got))
    server.start()
    shim_proc = subprocess.Popen([program], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while "doc" not in got and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # (its handlers set)
    shim_proc.send_signal(signal.SIGTERM)
    assert shim_proc.wait(timeout=20) == -signal.SIGTERM
    server.join(timeout=10)
    listener.close()
    assert child.returncode == -signal.SIGTERM


def test_without_a_server_the_shim_runs_the_real_program_from_path(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "flwr-clientapp").write_text("#!/bin/sh\necho fresh \"$@\"\n")
    os.chmod(real / "flwr-clientapp", 0o755)
    program = shim(tmp_path, str(tmp_path / "no-such-sock"))
    env = {"PATH": f"{os.path.dirname(program)}:{real}:/usr/bin:/bin"}
    done = subprocess.run(["flwr-clientapp", "--insecure"], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "fresh --insecure\n"
    assert "flwr-clientapp starts as a fresh process: no fork server" in done.stderr


def test_a_server_that_does_not_answer_makes_the_shim_run_the_real_program(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "flwr-clientapp").write_text("#!/bin/sh\necho fresh\n")
    os.chmod(real / "flwr-clientapp", 0o755)
    sock_path = str(tmp_path / "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sock_path)
    listener.listen(4)  # (and never accepts: a server stuck or out of descriptors)
    try:
        program = shim(tmp_path, sock_path, answer_s=1.0)
        env = {"PATH": f"{os.path.dirname(program)}:{real}:/usr/bin:/bin"}
        with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:  # (not pipes: the request
            done = subprocess.run(["flwr-clientapp"], stdout=out, stderr=err, timeout=30, env=env)  # holds its ends)
    finally:
        listener.close()
    said = (tmp_path / "err").read_text()
    assert done.returncode == 0 and (tmp_path / "out").read_text() == "fresh\n", said
    assert "starts as a fresh process: no fork server (timed out)" in said


def test_a_refusal_makes_the_shim_run_the_real_program(tmp_path):
    listener, path = listening(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    (real / "flwr-clientapp").write_text("#!/bin/sh\necho fresh\n")
    os.chmod(real / "flwr-clientapp", 0o755)
    program = shim(tmp_path, path)
    server = threading.Thread(target=serve_one, args=(
        listener, lambda conn, doc, fds: conn.send(json.dumps({"error": "refused"}).encode()), {}))
    server.start()
    env = {"PATH": f"{os.path.dirname(program)}:{real}:/usr/bin:/bin"}
    done = subprocess.run(["flwr-clientapp"], capture_output=True, text=True, timeout=30, env=env)
    server.join(timeout=10)
    listener.close()
    assert done.stdout == "fresh\n" and "starts as a fresh process: refused" in done.stderr


def _node_with_a_caller(tmp_path, send: bytes, fds: tuple[int, ...] = ()) -> tuple[ff._Node, socket.socket]:
    """A node's listening socket with one caller (this test's uid) that sent ``send`` and ``fds``."""
    path = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.setblocking(False)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    socket.send_fds(client, [send], list(fds))
    return ff._Node({"uid": os.getuid()}, listener, -1), client


def _accepted(node: ff._Node) -> tuple[dict, socket.socket]:
    """The server's accept on ``node``: its waiting connections and the first of them."""
    waiting: dict = {}
    ff._accept(node, waiting)
    assert waiting, "no connection taken"
    return waiting, next(iter(waiting))


def test_no_request_of_a_node_ends_the_server(tmp_path):
    """Deep nesting (RecursionError in the JSON parser) is refused like any bad request."""
    node, client = _node_with_a_caller(tmp_path, b"[" * 200_000)
    try:
        waiting, conn = _accepted(node)
        assert ff._answer_shim(node, conn, {}) is None
        assert "error" in json.loads(client.recv(65536))
        waiting.clear()
        ff._accept(node, waiting)  # nobody waiting: nothing to do
        assert waiting == {}
    finally:
        client.close()
        node.listener.close()


def test_the_descriptors_of_a_malformed_request_are_closed(tmp_path):
    r, w = os.pipe()
    node, client = _node_with_a_caller(tmp_path, b"{not json", (r, w, w))
    try:
        before = len(os.listdir("/proc/self/fd"))
        _, conn = _accepted(node)
        assert ff._answer_shim(node, conn, {}) is None
        assert "error" in json.loads(client.recv(65536))
        assert len(os.listdir("/proc/self/fd")) == before  # (the three that came with it, closed: conn too)
    finally:
        client.close()
        node.listener.close()
        os.close(r)
        os.close(w)


def test_a_socket_passed_with_a_request_closes_without_lingering():
    import struct

    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 30))
        ff._unlinger(a.fileno())
        assert struct.unpack("ii", a.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))[0] == 0
        assert a.fileno() >= 0  # (still the caller's)
    finally:
        a.close()
        b.close()


def test_a_node_holds_a_bounded_number_of_forked_programs(tmp_path):
    r, w = os.pipe()
    request = json.dumps({"argv": ["flwr-clientapp"], "env": {}, "cwd": "/"}).encode()
    node, client = _node_with_a_caller(tmp_path, request, (r, w, w))
    node.live.update(range(1, ff.MAX_LIVE_PER_NODE + 1))
    try:
        _, conn = _accepted(node)
        assert ff._answer_shim(node, conn, {}) is None
        assert "forked programs already" in json.loads(client.recv(65536))["error"]
    finally:
        client.close()
        node.listener.close()
        os.close(r)
        os.close(w)


def test_a_shim_that_sends_nothing_waits_aside_until_its_time_is_up(tmp_path):
    """Accepting never blocks the server: a silent connection waits in ``waiting``, a bounded
    number of them a node, and is closed at its deadline."""
    node, quiet = _node_with_a_caller(tmp_path, b"")
    more = []
    try:
        for _ in range(ff.MAX_WAITING_PER_NODE + 2):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(tmp_path / "s"))
            more.append(c)
        waiting: dict = {}
        started = time.monotonic()
        ff._accept(node, waiting)
        assert time.monotonic() - started < ff.ACCEPT_TIMEOUT_S / 2
        assert len(waiting) == ff.MAX_WAITING_PER_NODE
        assert more[-1].recv(16) == b""  # one past the bound: closed at once
        ff._expire(waiting, time.monotonic())
        assert len(waiting) == ff.MAX_WAITING_PER_NODE  # (not yet)
        ff._expire(waiting, time.monotonic() + ff.ACCEPT_TIMEOUT_S)
        assert waiting == {} and quiet.recv(16) == b""
    finally:
        for c in [quiet, *more]:
            c.close()
        node.listener.close()


def test_a_shim_that_is_killed_is_seen_by_its_connection_closing():
    from worker.confinement import zygote

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    callers = {101: a, 102: c, 103: None}
    try:
        assert ff._hung_up(callers, zygote.poll_readable([a, c], 0)) == []
        b.close()  # the shim of 101 is gone
        assert ff._hung_up(callers, zygote.poll_readable([a, c], 1.0)) == [101]
        assert callers == {101: None, 102: c, 103: None} and a.fileno() == -1
    finally:
        for s in (a, c, d):
            s.close()


def test_a_node_made_anew_takes_the_place_of_its_old_registration(tmp_path):
    old, client = _node_with_a_caller(tmp_path, b"")
    other = ff._Node({"uid": os.getuid() + 1}, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET), -1)
    try:
        waiting, conn = _accepted(old)
        nodes = {old.listener.fileno(): old, other.listener.fileno(): other}
        assert ff._unregister(nodes, waiting, os.getuid()) == [old]
        assert list(nodes.values()) == [other] and waiting == {} and conn.fileno() == -1
    finally:
        client.close()
        old.listener.close()
        other.listener.close()


def _draw_in_fork(reseed: bool) -> float:
    import numpy as np

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: as a program forked from the server
        try:
            if reseed:
                ff.fresh_random_state()
            os.write(w, repr(float(np.random.random())).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        value = float(f.read())
    os.waitpid(pid, 0)
    return value


def test_forked_programs_draw_their_own_numbers_from_numpy():
    import numpy as np

    np.random.seed(7)  # the server's state, which every child inherits
    assert _draw_in_fork(False) == _draw_in_fork(False)  # what a fork alone gives
    assert len({_draw_in_fork(True) for _ in range(3)}) == 3
