"""A Docker node is bounded as a netns node is: a read-only root file system (a private tmpfs
where a process writes), a pids limit a fork bomb stops at, the default memory limit, the
nodes' rlimits; and reset removes a bombing container."""
from __future__ import annotations

import os
import time

from tests.docker.conftest import DOCKER, run
from tests.netns.conftest import report
from tests.security.test_node_confinement import FORK_BOMB, sample_peak
from worker.confinement import cgroups, confine
from worker.host import WorkerHost

pytestmark = DOCKER


def pids_current(engine, container: str) -> int:
    """The container's pids.current, read from the host through its init's cgroup."""
    pid = engine.inspect_container(container)["State"]["Pid"]
    with open(f"/proc/{pid}/cgroup") as f:
        lines = [line.split(":", 2) for line in f.read().splitlines()]
    path = next((os.path.join("/sys/fs/cgroup/pids", p.lstrip("/")) for _, c, p in lines if "pids" in c.split(",")),
                None)
    if path is None:  # v2
        path = os.path.join(cgroups.process_groups(pid)[1][0])
    with open(os.path.join(path, "pids.current")) as f:
        return int(f.read())


def test_a_container_is_read_only_and_limited(host: WorkerHost, engine, request) -> None:
    host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b", "pids_max": 64}]})
    for node, pids in (("a", confine.DEFAULT_PIDS_MAX), ("b", 64)):
        info = engine.inspect_container(f"etb-{host.testbed_id}-{node}")["HostConfig"]
        assert info["PidsLimit"] == pids and info["ReadonlyRootfs"] is True, info
        assert info["Memory"] == confine.default_mem_bytes()
    for path in ("/usr/local/x", "/etc/x", "/x"):
        out = run(host, "a", "touch", path)
        assert out["returncode"] != 0 and "Read-only" in out["stderr"], (path, out)
    out = run(host, "a", "sh", "-c", "touch /tmp/x /var/tmp/x /run/lock/x && cat /proc/self/limits")
    assert out["returncode"] == 0, out
    limits = {line[:26].strip(): line[26:].split()[:2] for line in out["stdout"].splitlines()[1:]}
    assert limits["Max processes"] == [str(confine.DEFAULT_PIDS_MAX)] * 2, limits
    assert limits["Max core file size"] == ["0", "0"] and limits["Max open files"] == [str(confine.NOFILE)] * 2
    # a fork bomb stops at the container's limit, and reset still removes the container
    host.start_process("b", {"version": 1, "argv": ["sh", "-c", FORK_BOMB]})
    peak = sample_peak(lambda: pids_current(engine, f"etb-{host.testbed_id}-b"), reach=56)
    report(request, "peak_pids", peak)
    assert 56 <= peak <= 64, peak
    started = time.monotonic()
    host.reset()
    report(request, "reset_s", time.monotonic() - started)
    assert engine.containers(all=True, filters={"label": f"edgetb.testbed={host.testbed_id}"}) == []
