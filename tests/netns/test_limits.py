"""CPU quota and memory limit of a node, measured on real processes; exec deadlines."""
import os
import sys
import time

import pytest

from tests.netns.conftest import NETNS, nodes_body, report
from worker.api.errors import TestbedTimeout
from worker.confinement.cgroups import detect_version

pytestmark = NETNS + [pytest.mark.skipif(detect_version() is None,
                                         reason="no cgroup v1 (cpu, memory) or v2 hierarchy under /sys/fs/cgroup")]

MIB = 1024 * 1024


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_cpu_quota_holds_a_busy_loop(host, request):
    host.create_nodes(nodes_body({"name": "busy", "cpu": 0.5}))
    proc = host.start_process("busy", {"version": 1, "argv": [sys.executable, "-c", "while True: pass"]})
    time.sleep(0.3)  # let the interpreter start
    cpu0, t0 = _cpu_seconds(proc["pid"]), time.monotonic()
    time.sleep(3)
    share = (_cpu_seconds(proc["pid"]) - cpu0) / (time.monotonic() - t0)
    report(request, "busy loop CPU share under cpu=0.5", share)
    assert share <= 0.55, f"busy loop used {share:.2f} of a core under a 0.5 quota"
    assert share >= 0.3, f"busy loop used only {share:.2f} of a core: did it run?"
    running = {p["id"]: p for p in host.processes()["processes"]}[proc["id"]]
    assert running["running"] is True


def test_memory_limit_stops_an_allocation_beyond_it(host):
    host.create_nodes(nodes_body({"name": "small", "mem_bytes": 64 * MIB}))
    big = host.exec("small", {"version": 1, "timeout_s": 60, "argv": [
        sys.executable, "-c", "b = bytearray(256 * 1024 * 1024); print('allocated')"]})
    assert "allocated" not in big["stdout"], big
    assert big["returncode"] != 0, big
    assert big["returncode"] in (-9, 137) or "MemoryError" in big["stderr"], big  # OOM-killed (or refused)
    small = host.exec("small", {"version": 1, "timeout_s": 60, "argv": [
        sys.executable, "-c", "b = bytearray(16 * 1024 * 1024); print('allocated')"]})
    assert small["returncode"] == 0 and "allocated" in small["stdout"], small


def test_exec_timeout_kills_the_whole_command(host):
    """A command whose children keep its output open is still stopped at its deadline."""
    host.create_nodes({"version": 1, "nodes": [{"name": "slow"}]})
    started = time.monotonic()
    with pytest.raises(TestbedTimeout):
        host.exec("slow", {"version": 1, "argv": ["sh", "-c", "sleep 30 & sleep 30"], "timeout_s": 1})
    assert time.monotonic() - started < 5


def test_a_process_weighs_its_node_while_it_runs_and_again_when_started_again(host):
    """``EDGETB_CPU_WEIGHT`` (the SuperLink's, in Flower runs) holds while its process runs: it is
    written again when the process is started again, and the node weighs as any once it stops."""
    import signal

    from worker.confinement.flower_forks import cpu_weight_writes

    host.create_nodes(nodes_body({"name": "heavy", "cpu": 1.0}))
    procs = host.runtime.procs_files(host.runtime.node("heavy"))
    heavy, default = cpu_weight_writes(procs, 800), cpu_weight_writes(procs, 100)
    assert heavy, f"no cpu.weight or cpu.shares beside {procs}"

    def weights() -> list[tuple[str, str]]:
        return [(path, open(path).read().strip()) for path, _ in heavy]

    assert weights() == default
    body = {"version": 1, "argv": [sys.executable, "-c", "import time; time.sleep(60)"],
            "env": {"EDGETB_CPU_WEIGHT": "800"}}
    proc = host.start_process("heavy", body)
    assert weights() == heavy
    os.kill(proc["pid"], signal.SIGKILL)  # as when its node was replaced: a new group, weighing 100
    deadline = time.monotonic() + 10
    while {p["id"]: p for p in host.processes()["processes"]}[proc["id"]]["running"]:
        assert time.monotonic() < deadline, "the killed process still runs"
        time.sleep(0.05)
    for path, value in default:
        with open(path, "w") as f:
            f.write(value)
    (again,) = host.restart_processes("heavy")
    assert weights() == heavy
    host.stop_process("heavy", again)
    assert weights() == default
