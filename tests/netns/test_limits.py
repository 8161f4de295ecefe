"""CPU quota and memory limit of a node, measured on real processes."""
import os
import sys
import time

from worker.host import WorkerHost


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_cpu_quota_holds_a_busy_loop(host: WorkerHost):
    host.create_nodes({"version": 1, "nodes": [{"name": "busy", "cpu": 0.5}]})
    proc = host.start_process("busy", {"version": 1, "argv": [sys.executable, "-c", "while True: pass"]})
    time.sleep(0.5)
    start_cpu, start = _cpu_seconds(proc["pid"]), time.monotonic()
    time.sleep(3)
    share = (_cpu_seconds(proc["pid"]) - start_cpu) / (time.monotonic() - start)
    assert 0.3 <= share <= 0.55, f"busy loop used {share:.2f} of a core under a 0.5 quota"


def test_memory_limit_stops_an_allocation_beyond_it(host: WorkerHost):
    host.create_nodes({"version": 1, "nodes": [{"name": "small", "mem_bytes": 64 * 2**20}]})
    big = host.exec("small", {"version": 1, "argv": [sys.executable, "-c",
                                                     "b = bytearray(256 * 1024 * 1024); print('allocated')"]})
    assert "allocated" not in big["stdout"] and big["returncode"] != 0, big
    small = host.exec("small", {"version": 1, "argv": [sys.executable, "-c",
                                                       "b = bytearray(16 * 1024 * 1024); print('allocated')"]})
    assert small["returncode"] == 0 and "allocated" in small["stdout"], small
